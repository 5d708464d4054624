"""`DELETE /deployments/{id}` when its signal cannot be delivered, against real PostgreSQL
and real Temporal servers (no worker: the API's own decisions).

* Temporal unreachable, or the API pointed at a namespace that does not exist: the
  deployment is left as it was (never shown as deleting when nothing will delete it) and
  the answer is a 503 saying so.
* The workflow itself is gone (never started, or terminated by hand): the row is all that
  is left, so the API removes it and answers 200 with status ``deleted``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest
from fastapi import FastAPI
from temporalio.client import Client
from temporalio.service import RetryConfig
from temporalio.testing import WorkflowEnvironment

from cli import binaries
from modelkeeper.domain.catalog import DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId
from modelkeeper.infra.processes import free_port
from modelkeeper.names import deployment_workflow_id
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30}


# The API fixtures `app` and `api` are in tests/conftest.py.


async def _temporal_down(env: WorkflowEnvironment) -> Client:
    """A client of a Temporal server that has since stopped (one retry, not ten seconds'
    worth: the outcome is the same)."""
    server = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(binaries.temporal_cli()), ip="127.0.0.1",
        port=free_port(), ui=False)
    client = await Client.connect(server.client.service_client.config.target_host,
                                  retry_config=RetryConfig(max_retries=1))
    await server.shutdown()
    return client


async def _wrong_namespace(env: WorkflowEnvironment) -> Client:
    """A client of the right server in a namespace that does not exist: its NOT_FOUND is
    about the namespace, not the workflow, which runs on."""
    return await Client.connect(env.client.service_client.config.target_host,
                                namespace="no-such-namespace")


@pytest.mark.parametrize("failing_client", [_temporal_down, _wrong_namespace])
async def test_a_failed_signal_leaves_the_deployment_as_it_was(
    app: FastAPI, api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment,
    failing_client: Callable[[WorkflowEnvironment], Awaitable[Client]],
) -> None:
    assert (await api.post("/models", json=SIM)).status_code == 201
    created = await api.post("/deployments", json={"model_id": "sim-a"})
    assert created.status_code == 201, created.text
    deployment_id = created.json()["deployment_id"]

    working = app.state.temporal
    app.state.temporal = await failing_client(local_temporal_env)
    try:
        refused = await api.delete(f"/deployments/{deployment_id}")
    finally:
        app.state.temporal = working
    assert refused.status_code == 503, refused.text
    assert "not deleted" in refused.json()["detail"]
    view = await api.get(f"/deployments/{deployment_id}")
    assert view.json()["status"] == "placing"  # not "deleting": nothing would delete it

    # Once Temporal answers, the same request deletes as usual.
    accepted = await api.delete(f"/deployments/{deployment_id}")
    assert (accepted.status_code, accepted.json()["status"]) == (202, "deleting")
    assert (await api.get(f"/deployments/{deployment_id}")).json()["status"] == "deleting"


async def test_a_deployment_whose_workflow_is_gone_is_removed(
    app: FastAPI, api: httpx.AsyncClient,
) -> None:
    store: Store = app.state.store
    assert (await api.post("/models", json=SIM)).status_code == 201
    # A row whose workflow was never started (a create that died between the two) ...
    never = DeploymentId("d-never")
    await store.deployments.create_deployment(never, DeploymentRequest(model_id=ModelId("sim-a")),
                                              deployment_workflow_id(never))
    gone = await api.delete(f"/deployments/{never}")
    assert (gone.status_code, gone.json()) == (200, {"deployment_id": never,
                                                     "status": "deleted"})
    assert (await api.get(f"/deployments/{never}")).status_code == 404

    # ... and one whose workflow was terminated by hand.
    created = await api.post("/deployments", json={"model_id": "sim-a"})
    deployment_id = created.json()["deployment_id"]
    await app.state.temporal.get_workflow_handle(
        deployment_workflow_id(DeploymentId(deployment_id))).terminate("by hand")
    gone = await api.delete(f"/deployments/{deployment_id}")
    assert (gone.status_code, gone.json()["status"]) == (200, "deleted")
    assert (await api.get(f"/deployments/{deployment_id}")).status_code == 404
