"""`POST /deployments/{id}/retry` against real PostgreSQL and a real Temporal server (no
worker: what the API itself sends). The signal it sends is the workflow's own
``DeploymentWorkflow.retry``, so its name is the one the workflow listens for; a workflow
that is gone is a 409, and the audit log records who asked."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from temporalio.api.enums.v1 import EventType

from modelkeeper.domain.ids import DeploymentId
from modelkeeper.names import SIGNAL_RETRY, deployment_workflow_id

pytestmark = pytest.mark.timeout(60)

SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30}


async def test_retry_signals_the_workflow_and_a_gone_one_is_a_409(
    app: FastAPI, api: httpx.AsyncClient,
) -> None:
    assert (await api.post("/models", json=SIM)).status_code == 201
    created = await api.post("/deployments", json={"model_id": "sim-a"})
    assert created.status_code == 201, created.text
    deployment_id = DeploymentId(created.json()["deployment_id"])

    accepted = await api.post(f"/deployments/{deployment_id}/retry")
    assert (accepted.status_code, accepted.json()["deployment_id"]) == (202, deployment_id)
    handle = app.state.temporal.get_workflow_handle(deployment_workflow_id(deployment_id))
    signals = [e.workflow_execution_signaled_event_attributes.signal_name
               async for e in handle.fetch_history_events()
               if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
    assert signals == [SIGNAL_RETRY]
    events = (await api.get("/events", params={"deployment_id": deployment_id})).json()
    assert any(e["kind"] == "deployment.retry_requested" for e in events), events

    await handle.terminate("by hand")
    gone = await api.post(f"/deployments/{deployment_id}/retry")
    assert gone.status_code == 409, gone.text
    assert "no running workflow" in gone.json()["detail"]
