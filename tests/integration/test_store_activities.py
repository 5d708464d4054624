"""The control worker's store activities on a real PostgreSQL, called as Temporal calls
them: through ``ActivityEnvironment``, with the activity info a retry keeps.

* A retried ``release_replica`` still tells the waiting deployments (cant_place and
  degraded) that room was freed, though its first attempt already deleted the row.
* A retried activity that appends to the audit log appends once.
* ``place_replica`` waits out the settling window of a fresh worker, or half of it when the
  ready-node count holds steady.
* ``watch_for_room`` dry-runs placement on its schedule, claiming nothing, answers once
  the replica would fit, and a retry goes on with the schedule where it was.

Deployment workflows are stand-ins started on a queue no worker polls: a signal to one is
recorded in its history, which is what these tests count.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import timedelta

import pytest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.store import StoreActivities
from api.signals import signal_waiting_deployments
from modelkeeper.domain.catalog import (
    CatalogModel,
    DeploymentRequest,
    DeploymentStatusUpdate,
)
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory, NodeUpdate
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import (
    DeleteDeploymentInput,
    PlaceReplicaInput,
    ReleaseReplicaInput,
    WatchForRoomInput,
)
from modelkeeper.names import ERROR_SETTLING, SIGNAL_NODES_CHANGED, deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
#: The task queue of the stand-in deployment workflows; nothing polls it.
NO_WORKER_QUEUE = "nobody-polls-this"


def _activities(store: Store, *, client: Client | None = None, settling_window_s: float = 0,
                clock: Callable[[], float] | None = None) -> StoreActivities:
    settings = Settings(database_url="postgresql://unused", settling_window_s=settling_window_s)
    if clock is None:
        return StoreActivities(store, settings, client)
    return StoreActivities(store, settings, client, clock=clock)


def _attempt(activity_id: str, *, run_id: str = "run-1") -> ActivityEnvironment:
    """An environment for one attempt of one activity of ``deployment/d1``'s run
    ``run_id``; Temporal keeps these ids the same across the retries of one activity."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="deployment/d1",
                                   workflow_run_id=run_id, activity_id=activity_id)
    return env


async def _node(store: Store, node_id: str, memory_gib: int = 64) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id,
        inventory=Inventory(memory_total_bytes=memory_gib * GIB,
                            memory_available_bytes=memory_gib * GIB, cpu_count=16)))


async def _deployment(store: Store, deployment_id: str,
                      status: DeploymentStatus = DeploymentStatus.PLACING) -> DeploymentSpec:
    """A deployment of its own model (one deployment per model), showing ``status``."""
    model = CatalogModel(model_id=ModelId(f"m-{deployment_id}"), engine=EngineKind.SIM,
                         source="sim", memory_bytes=GIB)
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(DeploymentId(deployment_id),
                                              DeploymentRequest(model_id=model.model_id),
                                              deployment_workflow_id(DeploymentId(deployment_id)))
    await store.deployments.record_deployment_status(_status(deployment_id, status))
    return DeploymentSpec(deployment_id=DeploymentId(deployment_id), model_id=model.model_id,
                          replicas=1)


def _status(deployment_id: str, status: DeploymentStatus) -> DeploymentStatusUpdate:
    return DeploymentStatusUpdate(
        deployment_id=DeploymentId(deployment_id), status=status,
        placement_error="no node has 1 GiB free" if status is DeploymentStatus.CANT_PLACE
        else None, consecutive_failures=0, last_failure=None, desired_replicas=1)


def _place(spec: DeploymentSpec, replica_id: str) -> PlaceReplicaInput:
    return PlaceReplicaInput(spec=spec, replica_id=ReplicaId(replica_id), start_timeout_s=60)


# -- release_replica: the nodes-changed signal -------------------------------------------

async def _start_stand_ins(client: Client, deployment_ids: list[str]) -> None:
    for deployment_id in deployment_ids:
        await client.start_workflow("StandInDeployment", id=deployment_workflow_id(
            DeploymentId(deployment_id)), task_queue=NO_WORKER_QUEUE)


async def _nodes_changed_signals(client: Client, deployment_id: str) -> int:
    history = await client.get_workflow_handle(
        deployment_workflow_id(DeploymentId(deployment_id))).fetch_history()
    return sum(1 for e in history.events
               if e.HasField("workflow_execution_signaled_event_attributes")
               and e.workflow_execution_signaled_event_attributes.signal_name
               == SIGNAL_NODES_CHANGED)


async def _waiting_fleet(store: Store, client: Client) -> list[str]:
    """One deployment in each status that matters here; returns them in that order."""
    statuses = {"d-cant": DeploymentStatus.CANT_PLACE, "d-degraded": DeploymentStatus.DEGRADED,
                "d-serving": DeploymentStatus.SERVING}
    for deployment_id, status in statuses.items():
        await _deployment(store, deployment_id, status)
    await _start_stand_ins(client, list(statuses))
    return list(statuses)


async def test_a_retried_release_replica_still_signals_the_waiting_deployments(
    store: Store, local_temporal_env: WorkflowEnvironment,
) -> None:
    client = local_temporal_env.client
    await _node(store, "n1")
    held = await _deployment(store, "d-held")
    acts = _activities(store, client=client)
    assert (await _attempt("1").run(acts.place_replica, _place(held, "r1"))).shards
    cant, degraded, serving = await _waiting_fleet(store, client)

    # The first attempt deleted the row and failed before it signalled (its worker died,
    # or the Temporal call failed): the retry finds no row to delete.
    assert await store.deployments.release_replica("r1")
    await _attempt("2").run(acts.release_replica, ReleaseReplicaInput(replica_id=ReplicaId("r1")))

    assert [await _nodes_changed_signals(client, d) for d in (cant, degraded, serving)] == \
        [1, 1, 0]


async def test_the_api_signals_degraded_deployments_too(
    store: Store, local_temporal_env: WorkflowEnvironment,
) -> None:
    client = local_temporal_env.client
    cant, degraded, serving = await _waiting_fleet(store, client)
    assert await signal_waiting_deployments(store, client) == 2
    assert [await _nodes_changed_signals(client, d) for d in (cant, degraded, serving)] == \
        [1, 1, 0]


# -- audit-log appends: once per activity, however often it is retried --------------------

async def test_retried_activities_append_each_event_once(store: Store) -> None:
    await _node(store, "n1")
    spec = await _deployment(store, "d1")
    acts = _activities(store)
    # In the workflow's order, each activity twice: the first attempt committed, and its
    # retry must add nothing.
    probe = NewEvent(kind="probe", message="once", deployment_id=spec.deployment_id)
    first, retried = [await _attempt("1").run(acts.record_event, probe) for _ in range(2)]
    for _ in range(2):
        await _attempt("2").run(acts.place_replica, _place(spec, "r1"))
    for _ in range(2):
        await _attempt("3").run(acts.record_deployment_status,
                                _status("d1", DeploymentStatus.STARTING))
    for _ in range(2):
        await _attempt("4").run(acts.delete_deployment,
                                DeleteDeploymentInput(deployment_id=spec.deployment_id))
    kinds = [e.kind for e in await store.events.list_events(deployment_id="d1")]
    assert kinds == ["probe", "replica.placed", "deployment.starting", "deployment.deleted"]
    # A retry answers with the entry the first attempt appended.
    assert retried == first

    # Another activity, or the same activity id in the run after a continue-as-new
    # (activity ids start again from 1 in each run), is another entry.
    probe = NewEvent(kind="probe", message="again", deployment_id=spec.deployment_id)
    await _attempt("5").run(acts.record_event, probe)
    await _attempt("1", run_id="run-2").run(acts.record_event, probe)
    assert [e.kind for e in await store.events.list_events(deployment_id="d1")].count("probe") == 3


# -- place_replica: the settling gate -----------------------------------------------------

class FakeClock:
    """Seconds that move only when the test says."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def _settling_refusal(acts: StoreActivities, request: PlaceReplicaInput
                            ) -> ApplicationError:
    with pytest.raises(ApplicationError) as refused:
        await _attempt("1").run(acts.place_replica, request)
    assert refused.value.type == ERROR_SETTLING
    assert not refused.value.non_retryable  # the workflow's retry brings it back
    return refused.value


async def test_placement_waits_until_the_settling_window_ends(store: Store) -> None:
    await _node(store, "n1")
    spec = await _deployment(store, "d1")
    clock = FakeClock(1000.0)
    acts = _activities(store, settling_window_s=10, clock=clock)

    refused = await _settling_refusal(acts, _place(spec, "r1"))
    assert "10.0s" in str(refused)
    # It asks again after what is left of the window, but at most a second later (the
    # window can end early) ...
    assert refused.next_retry_delay == timedelta(seconds=1)
    clock.now = 1009.95
    delay = (await _settling_refusal(acts, _place(spec, "r1"))).next_retry_delay
    assert delay is not None and delay.total_seconds() == pytest.approx(0.05)
    assert await store.deployments.list_replicas() == []  # nothing was claimed while settling

    clock.now = 1010.0
    result = await _attempt("1").run(acts.place_replica, _place(spec, "r1"))
    assert [s.node_id for s in result.shards] == ["n1"]


async def _sampled(acts: StoreActivities, count: int) -> None:
    for _ in range(200):
        if acts.settling.last_count == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the sampler never saw {count} ready nodes")


async def test_placement_goes_early_once_the_ready_count_holds_for_half_the_window(
    store: Store,
) -> None:
    await _node(store, "n1")
    spec = await _deployment(store, "d1")
    clock = FakeClock(1000.0)
    acts = _activities(store, settling_window_s=10, clock=clock)
    await acts.start_settling_sampler()
    try:
        await _sampled(acts, 1)  # seen at 1000.0
        clock.now = 1003.0
        await _node(store, "n2")  # a second agent reports in: the count changed at 1003.0
        await _sampled(acts, 2)
        clock.now = 1007.9  # the first count held 3 s only; the second 4.9 s
        await _settling_refusal(acts, _place(spec, "r1"))
        clock.now = 1008.0  # 5 s steady: half the window, before the window's end at 1010
        result = await _attempt("1").run(acts.place_replica, _place(spec, "r1"))
        assert len(result.shards) == 1
    finally:
        await acts.stop_settling_sampler()


# -- watch_for_room: the room watch's dry runs -------------------------------------------

def _watch(spec: DeploymentSpec, *, unplaceable: int = 1,
           max_wait_s: float = 0.2) -> WatchForRoomInput:
    """A room watch on a short schedule: 50 ms doubling to ``max_wait_s``."""
    return WatchForRoomInput(spec=spec, unplaceable=unplaceable, first_wait_s=0.05,
                             max_wait_s=max_wait_s)


async def test_watch_for_room_claims_nothing_and_answers_once_the_replica_would_fit(
    store: Store,
) -> None:
    """A cordon lifted in the store, with no signal to anyone: the watch's next dry run
    finds the node, and none of its dry runs took a lock or claimed anything."""
    await _node(store, "n1")
    await store.nodes.update_node("n1", NodeUpdate(cordoned=True, cordon_reason="maintenance"))
    spec = await _deployment(store, "d1", DeploymentStatus.CANT_PLACE)
    acts = _activities(store)
    env = _attempt("watch")
    beats: list[int] = []
    env.on_heartbeat = lambda *details: beats.append(details[0])
    watch = asyncio.create_task(env.run(acts.watch_for_room, _watch(spec)))

    async def refused(times: int) -> None:
        while not beats or beats[-1] < times:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(refused(2), 10)  # two dry runs found no room
    assert not watch.done()
    await store.nodes.update_node("n1", NodeUpdate(cordoned=False))
    found = await asyncio.wait_for(watch, 10)
    assert found.nodes == ["n1"] and found.checks >= 3
    assert await store.deployments.list_replicas() == []
    [node] = await store.nodes.list_nodes()
    assert node.memory_claimed_bytes == 0
    # What it found is still there for place_replica to claim.
    assert (await _attempt("place").run(acts.place_replica, _place(spec, "d1-r1"))).shards


async def test_a_retried_watch_for_room_goes_on_with_its_schedule(store: Store) -> None:
    """A retry (a database error, the worker lost) starts from the dry runs its last
    heartbeat reported, not from the first wait: after 4 dry runs the wait is 0.8 s."""
    await _node(store, "n1")
    spec = await _deployment(store, "d1", DeploymentStatus.CANT_PLACE)
    env = _attempt("watch")
    env.info = dataclasses.replace(env.info, attempt=2, heartbeat_details=[4])
    loop = asyncio.get_running_loop()
    began = loop.time()
    found = await env.run(_activities(store).watch_for_room, _watch(spec, max_wait_s=10))
    assert found.checks == 5
    assert loop.time() - began >= _watch(spec, max_wait_s=10).wait_s(4) == 0.8


async def test_a_cancelled_watch_for_room_ends_while_it_waits(store: Store) -> None:
    await _node(store, "n1")
    await store.nodes.update_node("n1", NodeUpdate(cordoned=True))
    spec = await _deployment(store, "d1", DeploymentStatus.CANT_PLACE)
    env = _attempt("watch")
    beats: list[int] = []
    env.on_heartbeat = lambda *details: beats.append(details[0])
    watch = asyncio.create_task(env.run(_activities(store).watch_for_room, _watch(spec)))

    async def waiting() -> None:
        while not beats:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(waiting(), 10)
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(watch, 10)
