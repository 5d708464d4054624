"""The API's surfaces of following demand (docs/demand.md) against real PostgreSQL and
Temporal: a deployment created with a scaling policy (its row, its workflow's input, its
run summary), ``replicas`` and ``scaling`` refused together, the demand columns the
keeper writes shown by GET, and, with the control worker running the real deployment
workflow, PATCH ``scaling`` reaching the workflow and the row, and a sleep the workflow
refuses answered 409 with its sentence."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from modelkeeper.domain.catalog import DeploymentStatusUpdate
from modelkeeper.domain.demand import ScalingPolicy, SetPolicyRequest
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.names import UPDATE_SET_POLICY, UPDATE_SLEEP, UPDATE_WAKE
from modelkeeper.store import Store
from workflows.deployment import DeploymentInput

pytestmark = pytest.mark.timeout(90)

SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30}
#: The packaged SmolLM2 under llama.cpp, which cannot sleep.
SMOL = {"model_id": "smol", "engine": "llamacpp", "source": "smollm2"}
ON_DEMAND = {"min_replicas": 0, "max_replicas": 2, "idle_timeout_s": 600,
             "sleep_after_s": 120, "load_wait_s": 30, "warm_standby": 1}
#: How long a test waits for the keeper's own row write (an activity): a workflow task
#: and an activity on an idle dev server take well under a second.
KEEPER_WRITE_WAIT_S = 20


async def _start_input(client: Client, workflow_id: str) -> DeploymentInput:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    [arg] = await client.data_converter.decode(started.input.payloads, [DeploymentInput])
    assert isinstance(arg, DeploymentInput)
    return arg


async def test_create_with_scaling_starts_at_its_minimum_and_shows_the_policy(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment,
        store: Store) -> None:
    client = local_temporal_env.client
    assert (await api.post("/models", json=SIM)).status_code == 201
    created = await api.post("/deployments", json={"model_id": "sim-a", "scaling": ON_DEMAND})
    assert created.status_code == 201, created.text
    view = created.json()
    policy = ScalingPolicy(**ON_DEMAND)
    assert (view["desired_replicas"], view["status"]) == (0, "idle")
    assert ScalingPolicy(**view["scaling"]) == policy
    assert (view["loading_since"], view["loading_reason"], view["demand_note"]) == (
        None, None, None)
    # The workflow is started with the policy and at its minimum.
    spec = (await _start_input(client, view["workflow_id"])).spec
    assert (spec.replicas, spec.scaling) == (0, policy)
    described = await client.get_workflow_handle(view["workflow_id"]).describe()
    assert "created for model sim-a" in (await described.static_summary() or "")
    # The row keeps it: what the gateway and a restarted API read.
    row = await store.deployments.get_deployment(view["deployment_id"])
    assert row is not None and row.scaling == policy

    # replicas alone is min = max = N, as before: no policy.
    fixed = await api.post("/deployments", json={"model_id": "sim-b", "replicas": 2})
    assert fixed.status_code == 422  # sim-b is not in the catalog yet
    assert (await api.post("/models", json={**SIM, "model_id": "sim-b"})).status_code == 201
    fixed = await api.post("/deployments", json={"model_id": "sim-b", "replicas": 2})
    assert (fixed.json()["scaling"], fixed.json()["desired_replicas"]) == (None, 2)
    spec = (await _start_input(client, fixed.json()["workflow_id"])).spec
    assert (spec.replicas, spec.scaling) == (2, None)


@pytest.mark.parametrize(("body", "words"), [
    ({"model_id": "sim-a", "replicas": 1, "scaling": ON_DEMAND},
     "give one of replicas (a fixed count) or scaling (a policy), not both: replicas = 1 "
     "and scaling = 0-2 were given"),
    ({"model_id": "sim-a", "scaling": {**ON_DEMAND, "min_replicas": 3}},
     "min_replicas = 3 is above max_replicas = 2"),
    ({"model_id": "sim-a", "scaling": {**ON_DEMAND, "sleep_after_s": 600}},
     "sleep_after_s = 600 must be below idle_timeout_s = 600"),
    ({"model_id": "sim-a", "scaling": {**ON_DEMAND, "idle_timeout_s": "10m"}},
     "valid number"),
    ({"model_id": "sim-a", "scaling": {**ON_DEMAND, "max_replicas": 65}},
     "less than or equal to 64"),
])
async def test_a_bad_count_or_policy_is_a_422_that_names_it_and_keeps_nothing(
        api: httpx.AsyncClient, body: dict[str, Any], words: str) -> None:
    assert (await api.post("/models", json=SIM)).status_code == 201
    resp = await api.post("/deployments", json=body)
    assert resp.status_code == 422, resp.text
    assert any(words in error["msg"] for error in resp.json()["detail"]), resp.json()
    assert (await api.get("/deployments")).json() == []


async def test_views_show_what_the_keeper_writes_of_demand(
        api: httpx.AsyncClient, store: Store) -> None:
    assert (await api.post("/models", json=SIM)).status_code == 201
    created = await api.post("/deployments", json={"model_id": "sim-a", "scaling": ON_DEMAND})
    deployment_id = DeploymentId(created.json()["deployment_id"])
    since = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    window = {**ON_DEMAND, "min_replicas": 1}  # the policy in force, a window's bounds on it
    # Written as the keeper writes it (no worker runs here), with a sleeping replica.
    await store.deployments.record_deployment_status(DeploymentStatusUpdate(
        deployment_id=deployment_id, status=DeploymentStatus.LOADING, placement_error=None,
        consecutive_failures=0, last_failure=None, desired_replicas=1,
        scaling=ScalingPolicy(**window).model_dump(mode="json"), loading_since=since,
        loading_reason="3 request(s) waiting",
        demand_note="2025-01-02 03:04:05: +1: loading: 3 request(s) waiting"))
    await store._pool.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                              "VALUES ($1, $2, 'sleeping')", f"{deployment_id}-r1",
                              deployment_id)
    for shown in ((await api.get("/deployments")).json()[0],
                  (await api.get(f"/deployments/{deployment_id}")).json()):
        assert (shown["status"], shown["desired_replicas"], shown["ready_replicas"]) == (
            "loading", 1, 0)
        assert ScalingPolicy(**shown["scaling"]) == ScalingPolicy(**window)
        assert datetime.fromisoformat(shown["loading_since"]) == since
        assert shown["loading_reason"] == "3 request(s) waiting"
        assert shown["demand_note"] == "2025-01-02 03:04:05: +1: loading: 3 request(s) waiting"
        assert [r["state"] for r in shown["replicas"]] == ["sleeping"]

    # Idle: the keeper clears the loading columns when nothing is wanted.
    await store.deployments.record_deployment_status(DeploymentStatusUpdate(
        deployment_id=deployment_id, status=DeploymentStatus.IDLE, placement_error=None,
        consecutive_failures=0, last_failure=None, desired_replicas=0,
        scaling=ScalingPolicy(**ON_DEMAND).model_dump(mode="json"),
        demand_note="2025-01-02 03:14:05: -1: idle: unused for 10 min"))
    shown = (await api.get(f"/deployments/{deployment_id}")).json()
    assert (shown["status"], shown["loading_since"], shown["loading_reason"]) == (
        "idle", None, None)


# -- with the control worker: the real deployment workflow answers -----------------------


async def _updates(client: Client, workflow_id: str) -> list[tuple[str, Any]]:
    """The updates the workflow accepted, in order: name and decoded input."""
    accepted = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            request = event.workflow_execution_update_accepted_event_attributes.accepted_request
            accepted.append((request.input.name, request.input.args))
    return accepted


@pytest.mark.slow  # the worker starts and each update waits for a workflow task
async def test_patch_scaling_reaches_the_workflow_and_the_row_and_sleep_refusals_are_409(
        worked: tuple[FastAPI, httpx.AsyncClient], store: Store) -> None:
    app, api = worked
    client: Client = app.state.temporal
    assert (await api.post("/models", json=SIM)).status_code == 201
    created = await api.post("/deployments", json={"model_id": "sim-a", "replicas": 1})
    assert created.status_code == 201, created.text
    deployment_id, workflow_id = created.json()["deployment_id"], created.json()["workflow_id"]

    patched = await api.patch(f"/deployments/{deployment_id}", json={"scaling": ON_DEMAND})
    assert patched.status_code == 200, patched.text
    policy = ScalingPolicy(**ON_DEMAND)
    # The policy set by an operator keeps the count within its bounds (1 is within 0-2).
    assert ScalingPolicy(**patched.json()["scaling"]) == policy
    assert patched.json()["desired_replicas"] == 1
    [(name, args)] = await _updates(client, workflow_id)
    [sent] = await client.data_converter.decode(args.payloads, [SetPolicyRequest])
    assert (name, sent) == (UPDATE_SET_POLICY, SetPolicyRequest(policy=policy, actor="api"))
    events = (await api.get("/events", params={"deployment_id": deployment_id})).json()
    [audit] = [e for e in events if e["kind"] == "deployment.policy_set"]
    assert audit["actor"] == "api"
    assert audit["message"] == (f"set {deployment_id}'s scaling to 0-2 sleep 2m idle 10m "
                                "wait 30s standby 1 (was fixed at 1); 1 replica(s) wanted")
    # The keeper's own write says the same, with its note of who set it.
    for _ in range(KEEPER_WRITE_WAIT_S * 20):
        row = await store.deployments.get_deployment(deployment_id)
        assert row is not None
        if row.demand_note is not None:
            break
        await asyncio.sleep(0.05)
    assert row.scaling == policy and row.demand_note is not None
    assert row.demand_note.endswith("policy set by api: min 0, max 2")

    # A sleep the workflow refuses (no replica whose engine can sleep) is a 409 with its
    # sentence, and nothing is recorded.
    assert (await api.post("/models", json=SMOL)).status_code == 201
    smol = (await api.post("/deployments", json={"model_id": "smol"})).json()
    refused = await api.post(f"/deployments/{smol['deployment_id']}/sleep")
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"] == (
        f"replica_id: any is not a replica of {smol['deployment_id']} whose engine can "
        "sleep (llama.cpp cannot: scale it down instead)")
    named = await api.post(f"/deployments/{smol['deployment_id']}/sleep",
                           json={"replica_id": "d-x-r9"})
    assert named.status_code == 409 and "replica_id: d-x-r9 is not a replica" in \
        named.json()["detail"]
    assert await _updates(client, smol["workflow_id"]) == []  # refused: not in the history
    smol_events = (await api.get("/events",
                                 params={"deployment_id": smol["deployment_id"]})).json()
    assert not [e for e in smol_events if e["kind"] == "deployment.sleep_requested"]

    # A wake the workflow takes is a 202, in its history, and in the audit log.
    woken = await api.post(f"/deployments/{deployment_id}/wake")
    assert (woken.status_code, woken.json()["deployment_id"]) == (202, deployment_id)
    assert [name for name, _ in await _updates(client, workflow_id)] == [
        UPDATE_SET_POLICY, UPDATE_WAKE]
    events = (await api.get("/events", params={"deployment_id": deployment_id})).json()
    assert any(e["kind"] == "deployment.wake_requested" and e["actor"] == "api"
               for e in events), events
    assert (await api.post("/deployments/d-missing/sleep")).status_code == 404
    bad = await api.post(f"/deployments/{deployment_id}/sleep", json={"replica_id": ""})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "replica_id"
    assert UPDATE_SLEEP not in [name for name, _ in await _updates(client, workflow_id)]
