"""The sagas' records against a real PostgreSQL (migration 0008, store/operations.py):
one running operation per deployment and per node, an idempotent begin, readable ids; and
the activities over them (activities/operations.py), run through ``ActivityEnvironment``.

Deployment workflows are stand-ins started on a queue no worker polls: a signal to one is
recorded in its history, which is what the uncordon test counts."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.operations import OperationsActivities
from activities.store import StoreActivities
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, DeploymentStatusUpdate
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, OperationId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operations import (
    NodeDeploymentsInput,
    NodeReplica,
    OperationKind,
    OperationRecord,
    OperationState,
    OperationStep,
    SetCordonInput,
    StepState,
)
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import PlaceReplicaInput
from modelkeeper.names import (
    ERROR_OPERATION_CONFLICT,
    SIGNAL_NODES_CHANGED,
    deployment_workflow_id,
)
from modelkeeper.settings import Settings
from modelkeeper.store import OperationConflictError, OperationsStore, Store

pytestmark = pytest.mark.timeout(60)

D1 = DeploymentId("d1")


def restart(n: int, deployment: str = "d1", **fields: Any) -> OperationRecord:
    return OperationRecord(operation_id=OperationId(f"restart/{deployment}/{n}"),
                           kind=OperationKind.RESTART,
                           deployment_id=DeploymentId(deployment), **fields)


def drain(n: int, node: str = "n1") -> OperationRecord:
    return OperationRecord(operation_id=OperationId(f"drain/{node}/{n}"),
                           kind=OperationKind.DRAIN, node_id=NodeId(node))


@pytest.fixture
def operations(store: Store) -> OperationsStore:
    return store.operations


async def test_begin_is_idempotent_per_operation_id(operations: OperationsStore) -> None:
    first = await operations.begin(restart(1, summary="restart d1", requested_by="api"))
    assert (first.state, first.summary, first.requested_by) == (
        OperationState.RUNNING, "restart d1", "api")
    assert first.created_at is not None and first.updated_at is not None
    # The saga's own begin (or a retried one) finds the row and changes nothing.
    again = await operations.begin(restart(1, summary="other", requested_by="temporal"))
    assert again == first
    assert await operations.get("restart/d1/1") == first
    assert await operations.get("restart/d1/9") is None


async def test_a_second_running_operation_on_a_deployment_names_the_running_one(
        operations: OperationsStore) -> None:
    await operations.begin(restart(1))
    switch = OperationRecord(operation_id=OperationId("switch/d1/1"),
                             kind=OperationKind.SWITCH, deployment_id=D1)
    with pytest.raises(OperationConflictError) as info:
        await operations.begin(switch)
    assert info.value.running.operation_id == "restart/d1/1"
    assert str(info.value) == ("restart/d1/1 (restart) is running on d1; wait for it or "
                               "cancel it: modelkeeper operations cancel restart/d1/1")
    assert await operations.get("switch/d1/1") is None
    # Another deployment, and a drain of a node, are not in its way.
    await operations.begin(restart(1, deployment="d2"))
    await operations.begin(drain(1))
    with pytest.raises(OperationConflictError, match=r"drain/n1/1 .* running on n1"):
        await operations.begin(drain(2))
    # Once the first has ended, the next may run.
    await operations.save(restart(1, state=OperationState.SUCCEEDED))
    assert (await operations.begin(switch)).state is OperationState.RUNNING


async def test_racing_begins_on_one_deployment_leave_one_running(
        operations: OperationsStore) -> None:
    results = await asyncio.gather(
        *(operations.begin_next(OperationKind.RESTART, "d1", deployment_id=D1) for _ in range(6)),
        return_exceptions=True)
    started = [r for r in results if isinstance(r, OperationRecord)]
    refused = [r for r in results if isinstance(r, OperationConflictError)]
    assert len(started) == 1 and len(refused) == 5, results
    assert {r.running.operation_id for r in refused} == {started[0].operation_id}


async def test_readable_ids_count_per_kind_and_subject_and_skip_taken_ones(
        operations: OperationsStore) -> None:
    assert await operations.next_number(OperationKind.RESTART, "d1") == 1
    first = await operations.begin_next(OperationKind.RESTART, "d1", deployment_id=D1,
                                 summary="restart d1", requested_by="api")
    assert (first.operation_id, first.summary, first.requested_by) == (
        "restart/d1/1", "restart d1", "api")
    await operations.save(first.model_copy(update={"state": OperationState.SUCCEEDED}))
    # An id a person chose with the temporal CLI, ahead of the count: skipped, not reused.
    await operations.save(restart(2, state=OperationState.FAILED))
    await operations.save(restart(3, state=OperationState.CANCELLED))
    await operations.begin(restart(5, state=OperationState.SUCCEEDED))
    assert await operations.next_number(OperationKind.RESTART, "d1") == 5
    assert (await operations.begin_next(OperationKind.RESTART, "d1", deployment_id=D1)
            ).operation_id == "restart/d1/6"
    # Counted apart: another kind on the deployment, and a drain per node.
    assert await operations.next_number(OperationKind.RECONFIGURE, "d1") == 1
    assert (await operations.begin_next(OperationKind.DRAIN, "n1", node_id=NodeId("n1"))
            ).operation_id == "drain/n1/1"


async def test_save_upserts_steps_state_and_error_and_keeps_the_rest(
        operations: OperationsStore) -> None:
    begun = await operations.begin(restart(1, summary="restart d1", requested_by="api"))
    at = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    steps = [OperationStep(name="replace d1-r1", state=StepState.DONE, detail="d1-r3 ready",
                           started_at=at, ended_at=at),
             OperationStep(name="replace d1-r2", state=StepState.FAILED, detail="no room")]
    saved = await operations.save(restart(1, state=OperationState.FAILED, steps=steps,
                                   error="d1-r2: no room for a second copy",
                                   summary="restart d1: 1 of 2 replaced",
                                   requested_by="ignored"))
    assert saved.steps == steps
    assert (saved.state, saved.error, saved.summary, saved.requested_by) == (
        OperationState.FAILED, "d1-r2: no room for a second copy",
        "restart d1: 1 of 2 replaced", "api")
    assert saved.created_at == begun.created_at
    assert saved.updated_at is not None and begun.updated_at is not None
    assert saved.updated_at >= begun.updated_at
    assert await operations.save(saved) == (await operations.get("restart/d1/1"))  # idempotent
    # A record the saga writes first (started with the temporal CLI) is inserted.
    assert (await operations.save(restart(1, deployment="d9"))).operation_id == "restart/d9/1"


async def test_finish_if_running_never_overwrites_an_outcome(operations: OperationsStore) -> None:
    await operations.begin(restart(1))
    ended = await operations.finish_if_running("restart/d1/1", OperationState.FAILED,
                                        "its workflow could not be started")
    assert ended is not None
    assert (ended.state, ended.error) == (OperationState.FAILED,
                                          "its workflow could not be started")
    again = await operations.finish_if_running("restart/d1/1", OperationState.CANCELLED, "late")
    assert again == ended
    assert await operations.finish_if_running("restart/d1/404", OperationState.FAILED, "x") is None


async def test_list_is_newest_first_filtered_and_bounded(operations: OperationsStore) -> None:
    for n in (1, 2, 3):
        await operations.save(restart(n, state=OperationState.SUCCEEDED))
    await operations.begin(restart(4))
    await operations.begin(drain(1))
    ids = [r.operation_id for r in await operations.list_operations()]
    assert ids == ["drain/n1/1", "restart/d1/4", "restart/d1/3", "restart/d1/2",
                   "restart/d1/1"]
    assert [r.operation_id for r in await operations.list_operations(limit=2)] == ids[:2]
    assert [r.operation_id for r in await operations.list_operations(deployment_id="d1")] == ids[1:]
    assert [r.operation_id for r in await operations.list_operations(node_id="n1")] \
        == ["drain/n1/1"]
    assert [r.operation_id for r in await operations.list_operations(
        state=OperationState.RUNNING)] == ["drain/n1/1", "restart/d1/4"]
    assert (await operations.running_on(deployment_id="d1")) == await operations.get("restart/d1/4")
    assert (await operations.running_on(node_id="n2")) is None


# -- the sagas' activities (activities/operations.py), called as Temporal calls them ------

#: The task queue of the stand-in deployment workflows; nothing polls it.
NO_WORKER_QUEUE = "nobody-polls-this"
GIB = 1 << 30


async def _node(store: Store, node_id: str) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id,
        inventory=Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                            cpu_count=16)))


async def _deployment(store: Store, deployment_id: str, status: DeploymentStatus
                      ) -> DeploymentSpec:
    model = CatalogModel(model_id=ModelId(f"m-{deployment_id}"), engine=EngineKind.SIM,
                         source="sim", memory_bytes=GIB)
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(DeploymentId(deployment_id),
                                              DeploymentRequest(model_id=model.model_id),
                                              deployment_workflow_id(DeploymentId(deployment_id)))
    await store.deployments.record_deployment_status(DeploymentStatusUpdate(
        deployment_id=DeploymentId(deployment_id), status=status, placement_error=None,
        consecutive_failures=0, last_failure=None, desired_replicas=1))
    return DeploymentSpec(deployment_id=DeploymentId(deployment_id), model_id=model.model_id,
                          replicas=1)


class _UnusedClient:
    """Stands in for the Temporal client where an activity must not signal anyone."""


def _acts(store: Store, client: Client | None = None) -> OperationsActivities:
    return OperationsActivities(store, client or cast(Client, _UnusedClient()))


async def test_begin_operation_is_idempotent_and_its_conflict_is_final(store: Store) -> None:
    acts = _acts(store)
    env = ActivityEnvironment()
    first = await env.run(acts.begin_operation, restart(1, requested_by="temporal"))
    assert await env.run(acts.begin_operation, restart(1)) == first  # a retry
    with pytest.raises(ApplicationError) as info:
        await env.run(acts.begin_operation, OperationRecord(
            operation_id=OperationId("switch/d1/1"), kind=OperationKind.SWITCH,
            deployment_id=D1))
    assert (info.value.type, info.value.non_retryable) == (ERROR_OPERATION_CONFLICT, True)
    assert "restart/d1/1 (restart) is running on d1" in str(info.value)
    assert list(info.value.details) == ["restart/d1/1", "restart"]

    done = restart(1, state=OperationState.SUCCEEDED,
                   steps=[OperationStep(name="replace d1-r1", state=StepState.DONE)])
    for _ in range(2):  # retried: the same row
        await env.run(acts.record_operation, done)
    stored = await store.operations.get("restart/d1/1")
    assert stored is not None and (stored.state, stored.steps) == (done.state, done.steps)


async def test_set_cordon_keeps_the_reason_and_uncordon_signals_the_waiting(
    store: Store, local_temporal_env: WorkflowEnvironment,
) -> None:
    client = local_temporal_env.client
    await _node(store, "n1")
    for deployment_id, status in (("d-cant", DeploymentStatus.CANT_PLACE),
                                  ("d-serving", DeploymentStatus.SERVING)):
        await _deployment(store, deployment_id, status)
        await client.start_workflow("StandInDeployment", id=deployment_workflow_id(
            DeploymentId(deployment_id)), task_queue=NO_WORKER_QUEUE)
    acts = _acts(store, client)
    env = ActivityEnvironment()
    cordon = SetCordonInput(node_id=NodeId("n1"), cordoned=True, reason="drain/n1/1")
    for _ in range(2):  # retried: the same outcome
        assert await env.run(acts.set_cordon, cordon) is True
    node = await store.nodes.get_node("n1")
    assert node is not None and (node.cordoned, node.cordon_reason) == (True, "drain/n1/1")
    # A cordon outranks the agent's re-registration.
    await _node(store, "n1")
    node = await store.nodes.get_node("n1")
    assert node is not None and node.cordoned
    assert await _signals(client, "d-cant") == 0

    assert await env.run(acts.set_cordon, SetCordonInput(node_id=NodeId("n1"),
                                                         cordoned=False)) is True
    node = await store.nodes.get_node("n1")
    assert node is not None and (node.cordoned, node.cordon_reason) == (False, None)
    assert [await _signals(client, d) for d in ("d-cant", "d-serving")] == [1, 0]
    assert await env.run(acts.set_cordon, SetCordonInput(node_id=NodeId("ghost"),
                                                         cordoned=True)) is False


async def _signals(client: Client, deployment_id: str) -> int:
    history = await client.get_workflow_handle(
        deployment_workflow_id(DeploymentId(deployment_id))).fetch_history()
    return sum(1 for e in history.events
               if e.HasField("workflow_execution_signaled_event_attributes")
               and e.workflow_execution_signaled_event_attributes.signal_name
               == SIGNAL_NODES_CHANGED)


async def test_node_deployments_lists_each_replica_claiming_the_node(store: Store) -> None:
    await _node(store, "n1")
    await _node(store, "n2")
    placer = StoreActivities(store, Settings(database_url="postgresql://unused",
                                             settling_window_s=0))
    env = ActivityEnvironment()
    for deployment_id, replicas in (("d-b", ["d-b-r1", "d-b-r2"]), ("d-a", ["d-a-r1"])):
        spec = await _deployment(store, deployment_id, DeploymentStatus.STARTING)
        for replica_id in replicas:
            placed = await env.run(placer.place_replica, PlaceReplicaInput(
                spec=spec.model_copy(update={"node_ids": [NodeId("n1")]}),
                replica_id=ReplicaId(replica_id), start_timeout_s=60))
            assert placed.shards, placed
    acts = _acts(store)
    assert await env.run(acts.node_deployments, NodeDeploymentsInput(
        node_id=NodeId("n1"))) == [
        NodeReplica(deployment_id=DeploymentId("d-a"), replica_id=ReplicaId("d-a-r1")),
        NodeReplica(deployment_id=DeploymentId("d-b"), replica_id=ReplicaId("d-b-r1")),
        NodeReplica(deployment_id=DeploymentId("d-b"), replica_id=ReplicaId("d-b-r2"))]
    assert await env.run(acts.node_deployments,
                         NodeDeploymentsInput(node_id=NodeId("n2"))) == []


async def test_a_stale_running_save_cannot_run_beside_the_operation_that_replaced_it(
        operations: OperationsStore) -> None:
    # The API judged restart 1's start failed, and restart 2 began; then restart 1's saga,
    # started after all, writes its running record: refused, naming restart 2.
    await operations.begin(restart(1))
    await operations.finish_if_running("restart/d1/1", OperationState.FAILED, "start timed out")
    await operations.begin(restart(2))
    with pytest.raises(OperationConflictError) as info:
        await operations.save(restart(1))
    assert info.value.running.operation_id == "restart/d1/2"
    stored = await operations.get("restart/d1/1")
    assert stored is not None and stored.state is OperationState.FAILED
