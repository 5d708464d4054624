"""The API's saga routes (api/operations.py) against real PostgreSQL and Temporal.

No worker runs the sagas here: a started saga stays running, which is what the one-at-a-
time rule needs to be seen. These check what the API decides: 404/409/422, the row it
inserts first, the workflow it starts (type, id, queue, summary, input), list, show and
cancel, and the end of a row whose workflow ended without recording its outcome.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from api.operations import START_GRACE, abandoned
from modelkeeper.domain.catalog import DeploymentRequest, ScaleRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, OperationId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operations import (
    DrainInput,
    OperationKind,
    OperationRecord,
    OperationState,
    RestartInput,
    SwitchInput,
)
from modelkeeper.names import CONTROL_TASK_QUEUE, UPDATE_SCALE
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(90)

GIB = 1 << 30
SIM_A = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": GIB}
SIM_B = {**SIM_A, "model_id": "sim-b"}


async def _deployment(api: httpx.AsyncClient, replicas: int = 2) -> str:
    """A deployment of sim-a (its workflow starts and waits: no worker), sim-b in the
    catalog beside it."""
    for model in (SIM_A, SIM_B):
        assert (await api.post("/models", json=model)).status_code == 201
    created = await api.post("/deployments", json={"model_id": "sim-a", "replicas": replicas})
    assert created.status_code == 201, created.text
    return str(created.json()["deployment_id"])


async def _started(client: Client, workflow_id: str, input_type: type[Any]
                   ) -> tuple[str, str, str | None, Any]:
    """The started workflow's type, task queue, summary and decoded input."""
    handle = client.get_workflow_handle(workflow_id)
    described = await handle.describe()
    history = await handle.fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    [arg] = await client.data_converter.decode(started.input.payloads, [input_type])
    return (described.workflow_type, described.raw_description.workflow_execution_info
            .task_queue, await described.static_summary(), arg)


def _detail(resp: httpx.Response) -> Any:
    return resp.json()["detail"]


async def test_restart_starts_its_saga_after_its_row_and_a_second_saga_gets_409(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment) -> None:
    client = local_temporal_env.client
    assert (await api.post("/deployments/d-missing/restart")).status_code == 404
    dep = await _deployment(api)

    resp = await api.post(f"/deployments/{dep}/restart")
    assert resp.status_code == 202, resp.text
    started = resp.json()
    assert (started["operation_id"], started["workflow_id"], started["kind"],
            started["deployment_id"], started["state"], started["requested_by"]) == (
        f"restart/{dep}/1", f"restart/{dep}/1", "restart", dep, "running", "api")
    summary = f"restart {dep} (sim-a): replace its 2 replicas one at a time"
    assert started["summary"] == summary
    assert await _started(client, f"restart/{dep}/1", RestartInput) == (
        "RestartSaga", CONTROL_TASK_QUEUE, summary,
        RestartInput(deployment_id=DeploymentId(dep), requested_by="api"))

    # One saga at a time per deployment, whatever its kind: the 409 names the running one.
    running = (f"restart/{dep}/1 (restart) is running on {dep}; wait for it or cancel it: "
               f"modelkeeper operations cancel restart/{dep}/1")
    again = await api.post(f"/deployments/{dep}/restart")
    assert (again.status_code, _detail(again)) == (409, running)
    switch = await api.post(f"/deployments/{dep}/switch", json={"model_id": "sim-b"})
    assert (switch.status_code, _detail(switch)) == (409, running)
    patch = await api.patch(f"/deployments/{dep}", json={"engine_args": {"load_time_s": 1}})
    assert (patch.status_code, _detail(patch)) == (409, running)
    listed = (await api.get("/operations")).json()
    assert [o["operation_id"] for o in listed] == [f"restart/{dep}/1"]


async def test_racing_restarts_start_one_saga(api: httpx.AsyncClient) -> None:
    dep = await _deployment(api)
    results = await asyncio.gather(*(api.post(f"/deployments/{dep}/restart")
                                     for _ in range(5)))
    assert sorted(r.status_code for r in results) == [202, 409, 409, 409, 409]
    assert len((await api.get("/operations")).json()) == 1


async def test_switch_and_reconfigure_validate_then_start_the_switch_saga(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment,
        store: Store) -> None:
    client = local_temporal_env.client
    dep = await _deployment(api)
    missing = await api.post("/deployments/d-missing/switch", json={"model_id": "sim-b"})
    assert missing.status_code == 404
    unknown = await api.post(f"/deployments/{dep}/switch", json={"model_id": "nope"})
    assert unknown.status_code == 422
    [error] = _detail(unknown)
    assert (error["loc"], error["input"]) == (["body", "model_id"], "nope")
    assert "sim-a, sim-b" in error["msg"]
    same = await api.post(f"/deployments/{dep}/switch", json={"model_id": "sim-a"})
    assert (same.status_code, _detail(same)) == (
        409, f"deployment '{dep}' already runs 'sim-a': nothing to switch")
    bad_key = await api.post(f"/deployments/{dep}/reconfigure",
                             json={"engine_args": {"rm_rf": True}})
    assert bad_key.status_code == 422
    [error] = _detail(bad_key)
    assert error["loc"] == ["body", "engine_args"]
    assert "engine_args.rm_rf=True: not an allowed sim argument" in error["msg"]
    empty = await api.post(f"/deployments/{dep}/reconfigure", json={"engine_args": {}})
    assert empty.status_code == 422 and "at least one" in _detail(empty)[0]["msg"]
    assert (await api.get("/operations")).json() == []  # nothing was kept

    switched = await api.post(f"/deployments/{dep}/switch", json={"model_id": "sim-b"})
    assert switched.status_code == 202, switched.text
    assert switched.json()["operation_id"] == f"switch/{dep}/1"
    assert await _started(client, f"switch/{dep}/1", SwitchInput) == (
        "SwitchSaga", CONTROL_TASK_QUEUE, f"switch {dep} from sim-a to sim-b",
        SwitchInput(deployment_id=DeploymentId(dep), model_id=ModelId("sim-b"),
                    requested_by="api"))

    # Once it has ended, a reconfigure may start: PATCH with engine_args is one.
    operations = store.operations
    await operations.save(OperationRecord(operation_id=OperationId(f"switch/{dep}/1"),
                                   kind=OperationKind.SWITCH, deployment_id=DeploymentId(dep),
                                   state=OperationState.ROLLED_BACK))
    patched = await api.patch(f"/deployments/{dep}",
                              json={"engine_args": {"load_time_s": 2, "fail_at_start": True}})
    assert patched.status_code == 202, patched.text
    assert (patched.json()["operation_id"], patched.json()["kind"]) == (
        f"reconfigure/{dep}/1", "reconfigure")
    assert await _started(client, f"reconfigure/{dep}/1", SwitchInput) == (
        "SwitchSaga", CONTROL_TASK_QUEUE,
        f"reconfigure {dep} (sim-a): fail_at_start=True, load_time_s=2",
        SwitchInput(deployment_id=DeploymentId(dep),
                    engine_args={"load_time_s": 2, "fail_at_start": True},
                    requested_by="api"))
    for body in ({}, {"replicas": 1, "engine_args": {"load_time_s": 1}}):
        both = await api.patch(f"/deployments/{dep}", json=body)
        assert both.status_code == 422 and "give one of replicas" in str(_detail(both))


@workflow.defn(name="DeploymentWorkflow", sandboxed=False)  # test-only stand-in
class ScaleOnly:
    """Answers the scale update as the deployment workflow does, and waits."""

    def __init__(self) -> None:
        self.replicas = -1

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.update(name=UPDATE_SCALE)
    async def scale(self, request: ScaleRequest) -> int:
        self.replicas = request.replicas
        return request.replicas


async def test_patch_with_replicas_still_scales(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment,
        store: Store) -> None:
    client = local_temporal_env.client
    await api.post("/models", json=SIM_A)
    await store.deployments.create_deployment(
        DeploymentId("d-scale"), DeploymentRequest(model_id=ModelId("sim-a")), "scale-only")
    async with Worker(client, task_queue="scale-only", workflows=[ScaleOnly]):
        await client.start_workflow(ScaleOnly.run, id="scale-only", task_queue="scale-only")
        resp = await api.patch("/deployments/d-scale", json={"replicas": 3})
        assert resp.status_code == 200, resp.text
        assert resp.json()["desired_replicas"] == 3
        bad = await api.patch("/deployments/d-scale", json={"replicas": -1})
        assert bad.status_code == 422 and _detail(bad)[0]["loc"] == ["body", "replicas"]


async def test_drain_checks_the_node_and_grace_then_starts_the_drain_saga(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment,
        store: Store) -> None:
    client = local_temporal_env.client
    assert (await api.post("/nodes/ghost/drain")).status_code == 404
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="box-1",
        inventory=Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                            cpu_count=8)))
    bad = await api.post("/nodes/n1/drain", json={"grace_s": 0})
    assert bad.status_code == 422
    [error] = _detail(bad)
    assert (error["loc"], error["input"]) == (["body", "grace_s"], 0)

    resp = await api.post("/nodes/n1/drain")  # no body: the contract's default grace
    assert resp.status_code == 202, resp.text
    assert (resp.json()["operation_id"], resp.json()["node_id"],
            resp.json()["deployment_id"]) == ("drain/n1/1", "n1", None)
    summary = ("drain node box-1 (n1): move its 0 replica(s) of 0 deployment(s) elsewhere "
               "within 300s")
    assert await _started(client, "drain/n1/1", DrainInput) == (
        "DrainSaga", CONTROL_TASK_QUEUE, summary,
        DrainInput(node_id=NodeId("n1"), grace_s=300, requested_by="api"))
    again = await api.post("/nodes/n1/drain", json={"grace_s": 30})
    assert (again.status_code, _detail(again)) == (
        409, "drain/n1/1 (drain) is running on n1; wait for it or cancel it: "
             "modelkeeper operations cancel drain/n1/1")

    await store.operations.finish_if_running("drain/n1/1", OperationState.SUCCEEDED,
                                                      "")
    second = await api.post("/nodes/n1/drain",
                            json={"grace_s": 30, "uncordon_on_cancel": True})
    assert second.status_code == 202 and second.json()["operation_id"] == "drain/n1/2"
    assert (await _started(client, "drain/n1/2", DrainInput))[3] == DrainInput(
        node_id=NodeId("n1"), grace_s=30, uncordon_on_cancel=True, requested_by="api")


async def test_list_show_and_cancel(api: httpx.AsyncClient,
                                    local_temporal_env: WorkflowEnvironment,
                                    store: Store) -> None:
    client = local_temporal_env.client
    dep = await _deployment(api)
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1", inventory=Inventory(memory_total_bytes=GIB)))
    restart_id = (await api.post(f"/deployments/{dep}/restart")).json()["operation_id"]
    drain_id = (await api.post("/nodes/n1/drain")).json()["operation_id"]

    assert [o["operation_id"] for o in (await api.get("/operations")).json()] == [
        drain_id, restart_id]
    assert [o["operation_id"] for o in (await api.get(
        "/operations", params={"deployment": dep})).json()] == [restart_id]
    assert [o["operation_id"] for o in (await api.get(
        "/operations", params={"node": "n1", "state": "running"})).json()] == [drain_id]
    assert [o["operation_id"] for o in (await api.get(
        "/operations", params={"limit": 1})).json()] == [drain_id]
    bad_state = await api.get("/operations", params={"state": "sleeping"})
    assert bad_state.status_code == 422 and _detail(bad_state)[0]["loc"] == ["query", "state"]
    shown = await api.get(f"/operations/{restart_id}")  # the id's slashes are its path
    assert (shown.status_code, shown.json()["kind"]) == (200, "restart")
    assert (await api.get("/operations/restart/nope/1")).status_code == 404

    cancelled = await api.post(f"/operations/{restart_id}/cancel")
    assert cancelled.status_code == 202, cancelled.text
    history = await client.get_workflow_handle(restart_id).fetch_history()
    assert any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED
               for e in history.events)
    assert (await api.post("/operations/restart/nope/1/cancel")).status_code == 404

    # Ended as the saga recorded it: nothing to cancel.
    await store.operations.finish_if_running(
        restart_id, OperationState.CANCELLED, "cancelled by the operator")
    ended = await api.post(f"/operations/{restart_id}/cancel")
    assert (ended.status_code, _detail(ended)) == (
        409, f"{restart_id} already ended (cancelled: cancelled by the operator); "
             "nothing to cancel")


async def test_a_row_whose_workflow_ended_without_its_outcome_is_ended_not_in_the_way(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment) -> None:
    client = local_temporal_env.client
    dep = await _deployment(api)
    first = (await api.post(f"/deployments/{dep}/restart")).json()["operation_id"]
    await client.get_workflow_handle(first).terminate(reason="by hand")
    # The next restart ends the abandoned row, then starts.
    second = await api.post(f"/deployments/{dep}/restart")
    assert second.status_code == 202, second.text
    assert second.json()["operation_id"] == f"restart/{dep}/2"
    old = (await api.get(f"/operations/{first}")).json()
    assert (old["state"], old["error"]) == (
        "failed", "its workflow ended terminated without recording its outcome")
    # A cancel of one finds it ended.
    await client.get_workflow_handle(f"restart/{dep}/2").terminate(reason="by hand")
    cancel = await api.post(f"/operations/restart/{dep}/2/cancel")
    assert cancel.status_code == 409 and "ended terminated" in _detail(cancel)


async def test_a_failed_start_ends_the_row_as_failed(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment) -> None:
    client = local_temporal_env.client
    dep = await _deployment(api)
    # A workflow already runs under the id the API picks (started by hand, no row).
    await client.start_workflow("RestartSaga", id=f"restart/{dep}/1",
                                task_queue="nobody-polls-this")
    resp = await api.post(f"/deployments/{dep}/restart")
    assert resp.status_code == 503 and "restart" in _detail(resp)
    row = (await api.get(f"/operations/restart/{dep}/1")).json()
    assert row["state"] == "failed"
    assert row["error"].startswith("its workflow could not be started")
    # The deployment is free again.
    assert (await api.post(f"/deployments/{dep}/restart")).json()["operation_id"] == \
        f"restart/{dep}/2"


# -- abandoned(): pure ----------------------------------------------------------------

NOW = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
ROW = OperationRecord(operation_id=OperationId("restart/d1/1"), kind=OperationKind.RESTART,
                      deployment_id=DeploymentId("d1"), created_at=NOW - timedelta(hours=1))


@pytest.mark.parametrize(("status", "created_ago", "expected"), [
    (WorkflowExecutionStatus.RUNNING, timedelta(hours=1), None),
    (WorkflowExecutionStatus.CONTINUED_AS_NEW, timedelta(hours=1), None),
    # Not known to Temporal: maybe its start is in flight, so only past the grace.
    (None, START_GRACE - timedelta(seconds=1), None),
    (None, START_GRACE, (OperationState.FAILED,
                         "its workflow restart/d1/1 does not exist (never started, or ended "
                         "and past Temporal's retention)")),
    (WorkflowExecutionStatus.CANCELED, timedelta(0),
     (OperationState.CANCELLED, "its workflow was cancelled before it recorded its outcome")),
    (WorkflowExecutionStatus.TERMINATED, timedelta(0),
     (OperationState.FAILED, "its workflow ended terminated without recording its outcome")),
    (WorkflowExecutionStatus.COMPLETED, timedelta(0),
     (OperationState.FAILED, "its workflow ended completed without recording its outcome")),
    (WorkflowExecutionStatus.TIMED_OUT, timedelta(0),
     (OperationState.FAILED, "its workflow ended timed_out without recording its outcome")),
])
def test_abandoned_ends_a_row_only_once_its_workflow_cannot_record_its_outcome(
        status: WorkflowExecutionStatus | None, created_ago: timedelta,
        expected: tuple[OperationState, str] | None) -> None:
    row = ROW.model_copy(update={"created_at": NOW - created_ago})
    assert abandoned(row, status, now=NOW) == expected
