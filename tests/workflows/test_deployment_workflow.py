"""DeploymentWorkflow on the time-skipping server, with every activity faked by name."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import (
    WithStartWorkflowOperation,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
)
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.store import StoreActivities
from modelkeeper.domain.catalog import (
    CatalogModel,
    DeploymentRequest,
    DeploymentStatusUpdate,
    Generation,
    ReplicaStateUpdate,
    ScaleRequest,
)
from modelkeeper.domain.draining import DrainReplicaInput, DrainReplicaResult
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, MoveId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    DeploymentSpec,
    KeeperConfig,
    KeeperState,
    room_watch_wait_s,
)
from modelkeeper.domain.moves import (
    AwaitMoveRequest,
    CancelMoveRequest,
    DeploymentBrief,
    MoveKind,
    MoveOutcome,
    MoveRequest,
    MoveState,
    SetGenerationRequest,
)
from modelkeeper.domain.nodes import AgentRegistration, Inventory, NodeSilentInput
from modelkeeper.domain.shards import (
    EngineKind,
    ExitKind,
    ShardEndpoint,
    ShardExit,
    ShardReport,
    ShardSpec,
    ShardState,
    StartShardInput,
    StopShardInput,
    WatchShardInput,
)
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import (
    DeleteDeploymentInput,
    EvictionFound,
    FindEvictionInput,
    PlaceReplicaInput,
    PlaceReplicaResult,
    ReleaseReplicaInput,
    RoomFound,
    WatchForRoomInput,
)
from modelkeeper.domain.tunables import Tunables
from modelkeeper.names import (
    CONTROL_TASK_QUEUE,
    DEPLOYMENTS_VIEW_QUERY,
    ERROR_MOVE_REFUSED,
    QUERY_BRIEF,
    ROOM_WATCH_TASK_QUEUE,
    UPDATE_AWAIT_MOVE,
    UPDATE_CANCEL_MOVE,
    UPDATE_MOVE,
    UPDATE_SET_GENERATION,
    deployment_workflow_id,
    node_task_queue,
)
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from workflows.deployment import (
    DESIRED_KEY,
    MODEL_ID_KEY,
    NODES_KEY,
    READY_KEY,
    STATUS_KEY,
    DeleteRequest,
    DeploymentInput,
    DeploymentWorkflow,
    DeploymentWorkflowState,
    WorkflowStatus,
)

pytestmark = pytest.mark.timeout(60)

NODE = NodeId("n1")


@dataclass
class FakeCluster:
    """What the faked activities saw and how they answer."""

    start_failures: int = 0
    statuses: list[DeploymentStatusUpdate] = field(default_factory=list)
    replica_states: list[tuple[str, str]] = field(default_factory=list)
    #: Every record_replica_state, whole (its endpoint and relaunch note too).
    replica_updates: list[ReplicaStateUpdate] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    placements: list[str] = field(default_factory=list)
    crash: dict[str, asyncio.Event] = field(default_factory=dict)
    cant_place: str | None = None
    #: The next placements fail after committing their claim (recorded in ``claimed``):
    #: each pops one error; "timeout" sleeps past the placement's schedule-to-close.
    place_errors: list[str] = field(default_factory=list)
    claimed: list[str] = field(default_factory=list)
    #: Extra keys in every answer an agent sends (start, watch, list): an agent one
    #: version ahead of the worker. Answers are then plain dicts, decoded by the worker.
    agent_extra: dict[str, Any] | None = None
    #: The next watch of each of these replicas stops heartbeating (its node goes quiet).
    silence: set[str] = field(default_factory=set)
    #: list_shards: the replicas the agent says it runs; None: the agent does not answer.
    agent_runs: set[str] | None = field(default_factory=set)
    #: start_shard waits for the replica's gate, if it has one.
    start_gates: dict[str, asyncio.Event] = field(default_factory=dict)
    #: record_replica_state and record_deployment_status fail (a database outage).
    store_down: bool = False
    #: While set and not yet open, every store write (replica state, status, audit event)
    #: waits for it; ``store_waiting`` counts the writes waiting.
    store_gate: asyncio.Event | None = None
    store_waiting: int = 0
    #: Each watch_shard as it begins, and each one cancelled by the workflow.
    watches: list[str] = field(default_factory=list)
    watches_cancelled: list[str] = field(default_factory=list)
    #: The engine's last log lines, in a watch's exit and a failed start's error details
    #: (as the agent sends them: ShardExit.log_tail, the ApplicationError's first detail).
    exit_log: list[str] = field(default_factory=list)
    start_failure_log: list[str] = field(default_factory=list)
    #: Every record_event, in order.
    events: list[NewEvent] = field(default_factory=list)
    #: Each drain_replica (a graceful stop), and each stop_shard, in one order.
    drained: list[str] = field(default_factory=list)
    #: Each drain's grace (a preemption's is short).
    drain_graces: dict[str, float] = field(default_factory=dict)
    stop_order: list[str] = field(default_factory=list)
    #: list_shards answers only once this status was written to the store. The store
    #: writes coalesce (each writes what is current when it starts), so a status that
    #: lasts only until a probe answers in milliseconds need never be written otherwise.
    probe_after_status: DeploymentStatus | None = None
    #: watch_for_room: the count each room watch started from, the number of dry runs
    #: each made, and each one cancelled. Its dry run says the replica fits when
    #: place_replica would (no cant_place), unless ``dry_run_fits`` says otherwise (a dry
    #: run that disagrees with the placement after it).
    room_watches: list[int] = field(default_factory=list)
    room_checks: list[int] = field(default_factory=list)
    room_watches_cancelled: int = 0
    dry_run_fits: bool | None = None
    #: The watch heartbeats (how a cancel reaches it) only once this is set. The test
    #: server, unlike Temporal, adds a workflow task to the history when a heartbeat
    #: lands while one is in flight, so a test that counts events keeps them apart.
    room_beats: bool = False
    #: find_eviction: each deployment that sought room, and what the fake answers
    #: (default: nothing may be stopped).
    sought: list[str] = field(default_factory=list)
    eviction: EvictionFound = field(default_factory=lambda: EvictionFound(
        reason="nothing this deployment outranks makes the room"))

    def _agent_answer(self, model: Any) -> Any:
        if self.agent_extra is None:
            return model
        return {**model.model_dump(mode="json"), **self.agent_extra}

    def room_watch(self) -> object:
        """The fake watch_for_room, for the worker of ROOM_WATCH_TASK_QUEUE."""

        @activity.defn(name="watch_for_room")
        async def watch_for_room(req: WatchForRoomInput) -> RoomFound:
            # The real one's schedule and heartbeats (activities/store.py), with the
            # fake's answer for a dry run.
            self.room_watches.append(req.unplaceable)
            self.room_checks.append(0)
            loop = asyncio.get_running_loop()
            check = 0
            try:
                while True:
                    deadline = loop.time() + req.wait_s(check)
                    while (left := deadline - loop.time()) > 0:
                        if self.room_beats:
                            activity.heartbeat(check)
                        await asyncio.sleep(min(left, 0.05))
                    check += 1
                    self.room_checks[-1] = check
                    fits = (self.cant_place is None if self.dry_run_fits is None
                            else self.dry_run_fits)
                    if fits:
                        return RoomFound(nodes=[NODE], checks=check)
            except asyncio.CancelledError:
                self.room_watches_cancelled += 1
                raise

        return watch_for_room

    def activities(self) -> tuple[list[object], list[object]]:
        @activity.defn(name="place_replica")
        async def place_replica(req: PlaceReplicaInput) -> PlaceReplicaResult:
            self.placements.append(req.replica_id)
            if self.place_errors:
                error = self.place_errors.pop(0)
                self.claimed.append(req.replica_id)  # committed, then the answer is lost
                if error == "timeout":
                    await asyncio.sleep(3)
                raise ApplicationError(error, type="Unexpected", non_retryable=True)
            if self.cant_place is not None:
                return PlaceReplicaResult(cant_place=self.cant_place)
            return PlaceReplicaResult(shards=[ShardSpec(
                replica_id=req.replica_id, model_id=req.spec.model_id, node_id=NODE,
                engine=EngineKind.SIM, source="sim", memory_bytes=1)])

        async def gate() -> None:
            if self.store_gate is not None and not self.store_gate.is_set():
                self.store_waiting += 1
                try:
                    await self.store_gate.wait()
                finally:
                    self.store_waiting -= 1

        @activity.defn(name="record_replica_state")
        async def record_replica_state(update: ReplicaStateUpdate) -> None:
            await gate()
            if self.store_down:
                raise ApplicationError("connection refused")
            self.replica_states.append((update.replica_id, update.state.value))
            self.replica_updates.append(update)

        @activity.defn(name="release_replica")
        async def release_replica(req: ReleaseReplicaInput) -> None:
            self.released.append(req.replica_id)

        @activity.defn(name="record_deployment_status")
        async def record_deployment_status(update: DeploymentStatusUpdate) -> None:
            await gate()
            if self.store_down:
                raise ApplicationError("connection refused")
            self.statuses.append(update)

        @activity.defn(name="delete_deployment")
        async def delete_deployment(req: DeleteDeploymentInput) -> None:
            self.deleted.append(req.deployment_id)

        @activity.defn(name="record_event")
        async def record_event(event: NewEvent) -> Event:
            await gate()
            self.events.append(event)
            return Event(**event.model_dump(), event_id=len(self.events),
                         at=activity.info().started_time)

        @activity.defn(name="start_shard")
        async def start_shard(req: StartShardInput) -> Any:
            self.started.append(req.spec.replica_id)
            if len(self.started) <= self.start_failures:
                ended = ShardExit(replica_id=req.spec.replica_id, kind=ExitKind.ERROR,
                                  exit_code=1, detail="exited with code 1",
                                  log_tail=self.start_failure_log)
                raise ApplicationError("engine exited with code 1", ended,
                                       type="ShardStartFailed", non_retryable=True)
            gate = self.start_gates.get(req.spec.replica_id)
            if gate is not None:
                await gate.wait()
            self.crash[req.spec.replica_id] = asyncio.Event()
            return self._agent_answer(ShardEndpoint(
                replica_id=req.spec.replica_id, node_id=NODE, rank=0,
                url=f"http://engine/{req.spec.replica_id}", port=1, pid=1))

        @activity.defn(name="watch_shard")
        async def watch_shard(req: WatchShardInput) -> Any:
            self.watches.append(req.replica_id)
            if req.replica_id in self.silence:
                self.silence.discard(req.replica_id)
                await asyncio.sleep(3600)  # no heartbeat: cancelled at worker shutdown
            crash = self.crash[req.replica_id]
            try:
                while not crash.is_set():
                    activity.heartbeat()
                    try:
                        await asyncio.wait_for(crash.wait(), 0.2)
                    except TimeoutError:
                        continue
            except asyncio.CancelledError:
                self.watches_cancelled.append(req.replica_id)
                raise
            return self._agent_answer(ShardExit(
                replica_id=req.replica_id, kind=ExitKind.SIGNALLED, signal=9,
                detail="killed by SIGKILL", log_tail=self.exit_log))

        @activity.defn(name="drain_replica")
        async def drain_replica(req: DrainReplicaInput) -> DrainReplicaResult:
            self.drained.append(req.replica_id)
            self.drain_graces[req.replica_id] = req.grace_s
            self.stop_order.append(f"drain {req.replica_id}")
            return DrainReplicaResult(waited_s=0.0, in_flight_left=0, timed_out=False)

        @activity.defn(name="stop_shard")
        async def stop_shard(req: StopShardInput) -> ShardExit:
            self.stopped.append(req.replica_id)
            self.stop_order.append(f"stop {req.replica_id}")
            return ShardExit(replica_id=req.replica_id, kind=ExitKind.STOPPED)

        @activity.defn(name="list_shards")
        async def list_shards() -> list[Any]:
            while self.probe_after_status not in (None, *(s.status for s in self.statuses)):
                await asyncio.sleep(0.05)
            if self.agent_runs is None:
                raise ApplicationError("agent restarting")
            return [self._agent_answer(ShardReport(
                replica_id=ReplicaId(r), model_id=ModelId("m"), rank=0,
                state=ShardState.READY, port=1, pid=1, url=f"http://engine/{r}",
                adopted=True)) for r in sorted(self.agent_runs)]

        @activity.defn(name="find_eviction")
        async def find_eviction(req: FindEvictionInput) -> EvictionFound:
            self.sought.append(req.spec.deployment_id)
            return self.eviction

        control = [place_replica, record_replica_state, release_replica,
                   record_deployment_status, delete_deployment, record_event, drain_replica,
                   find_eviction]
        node = [start_shard, watch_shard, stop_shard, list_shards]
        return control, node


#: A query is answered in milliseconds; see Running.view for why it has a deadline.
QUERY_DEADLINE = timedelta(seconds=2)


@dataclass
class Running:
    env: WorkflowEnvironment
    cluster: FakeCluster
    handle: WorkflowHandle[DeploymentWorkflow, str]

    async def view(self) -> WorkflowStatus:
        # By workflow id alone, so the query follows continue-as-new to the latest run:
        # the handle start_workflow returns names the first run, and a query to a run that
        # has closed can hang on the time-skipping server.
        # A query that lands as a run continues as new can go unanswered on that server
        # ("workflow execution already completed"), so each has a deadline and is asked
        # again of the new run.
        latest = self.env.client.get_workflow_handle(self.handle.id)
        while True:
            try:
                return await latest.query(DeploymentWorkflow.status,
                                          rpc_timeout=QUERY_DEADLINE)
            except RPCError as err:
                # The deadline passing reads DEADLINE_EXCEEDED, or CANCELLED ("Timeout
                # expired") when the client's own timer ends the call first.
                if err.status not in (RPCStatusCode.DEADLINE_EXCEEDED,
                                      RPCStatusCode.CANCELLED):
                    raise

    async def until(self, status: DeploymentStatus, timeout: float = 20,
                    skip_s: float = 0.0) -> WorkflowStatus:
        """Poll the status query; with ``skip_s``, let that much test time pass between
        polls (queries alone do not make the test server skip time)."""

        async def poll() -> WorkflowStatus:
            while True:
                view = await self.view()
                if view.status is status:
                    return view
                if skip_s:
                    await self.env.sleep(skip_s)
                else:
                    await asyncio.sleep(0.05)

        return await asyncio.wait_for(poll(), timeout)


def _tunables(**fields: Any) -> Tunables:
    """The tunables with ``fields`` set, without backoff jitter and without relaunch in
    place unless they say: the tests that crash an engine here pin what follows a replica
    lost after ready (relaunch in place has its own, which turn it on)."""
    return Tunables(**{"backoff_jitter": 0.0, "relaunch_tries": 0, **fields})


def _input(*, replicas: int = 1, tunables: Tunables | None = None,
           search_attributes: bool = False) -> DeploymentInput:
    """A new deployment d1 of model m, without backoff jitter unless ``tunables`` says."""
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"),
                          replicas=replicas)
    return DeploymentInput(spec=spec, tunables=tunables or _tunables(),
                           search_attributes=search_attributes)


@contextlib.asynccontextmanager
async def _workers(env: WorkflowEnvironment, cluster: FakeCluster, *,
                   store: StoreActivities | None = None) -> AsyncIterator[None]:
    """The control, node and room-watch workers. The node's activities are the cluster's
    fakes; the control queue's and the room watch's are too, unless ``store`` gives the
    real ones."""
    fake_control, node = cluster.activities()
    control: list[object] = fake_control if store is None else [*store.all()]
    room_watch: list[object] = ([cluster.room_watch()] if store is None
                                else [*store.room_watches()])
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=control), \
            Worker(env.client, task_queue=node_task_queue(NODE), activities=node), \
            Worker(env.client, task_queue=ROOM_WATCH_TASK_QUEUE, activities=room_watch,
                   # A heartbeat sent as soon as it is recorded (not 0.8 x the timeout
                   # later): a cancel reaches a room watch at once.
                   max_heartbeat_throttle_interval=timedelta(seconds=0.1)):
        yield


async def _start(env: WorkflowEnvironment, cluster: FakeCluster,
                 request: DeploymentInput) -> Running:
    handle = await env.client.start_workflow(
        DeploymentWorkflow.run, request, id=f"deployment/{uuid.uuid4()}",
        task_queue=CONTROL_TASK_QUEUE)
    return Running(env, cluster, handle)


@contextlib.asynccontextmanager
async def _run(env: WorkflowEnvironment, cluster: FakeCluster, replicas: int = 1,
               tunables: Tunables | None = None,
               *, search_attributes: bool = False) -> AsyncIterator[Running]:
    async with _workers(env, cluster):
        yield await _start(env, cluster, _input(
            replicas=replicas, tunables=tunables, search_attributes=search_attributes))


HISTORIES = Path(__file__).resolve().parents[1] / "histories"


async def record_history(handle: WorkflowHandle[Any, Any], name: str) -> None:
    """With MODELKEEPER_RECORD_HISTORIES=1, save this run's history for replay tests
    (tests/workflows/test_replay.py). Re-record after an intended workflow change that is
    versioned with workflow.patched; never to make a replay failure go away."""
    if os.environ.get("MODELKEEPER_RECORD_HISTORIES") != "1":
        return
    history = await handle.fetch_history()
    (HISTORIES / f"{name}.json").write_text(history.to_json())


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


async def test_deploys_serves_replaces_a_crashed_engine_and_deletes(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    async with _run(time_skipping_env, cluster) as run:
        view = await run.until(DeploymentStatus.SERVING)
        [replica] = view.keeper.replicas
        assert replica.endpoint == "http://engine/d1-r1"
        await asyncio.wait_for(_until(lambda: ("d1-r1", "ready") in cluster.replica_states), 20)

        # The engine dies after serving: replaced at once, no backoff.
        cluster.crash["d1-r1"].set()
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.crash), 20)
        view = await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r1"]), 20)
        view = await run.view()
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r2"]
        assert cluster.stopped == ["d1-r1"]
        assert view.keeper.consecutive_failures == 0

        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        assert cluster.stopped == ["d1-r1", "d1-r2"]
        assert cluster.deleted == ["d1"]
        await record_history(run.handle, "deploy_crash_replace_delete")
        assert [s.status for s in cluster.statuses][-1] is DeploymentStatus.DELETING


async def test_a_deleted_deployment_ends_with_a_human_result(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """Issue 24: the run's result (the web UI's, ``temporal workflow result``) says who
    deleted it, when, and what it stopped; not an empty result."""
    async with _run(time_skipping_env, cluster, replicas=2) as run:
        view = await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: len(cluster.started) == 2), 20)
        asked = await time_skipping_env.get_current_time()
        await run.handle.signal(DeploymentWorkflow.delete, DeleteRequest(requested_by="alice"))
        result = await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "deleted_result")
    spec = view.keeper.spec
    prefix = f"Deployment {spec.deployment_id} ({spec.model_id}) deleted by alice at "
    assert result.startswith(prefix) and result.endswith(" UTC: 2 replicas stopped"), result
    at = datetime.strptime(result[len(prefix):len(prefix) + 19], "%Y-%m-%d %H:%M:%S")
    assert abs((at.replace(tzinfo=UTC) - asked).total_seconds()) < 60
    assert sorted(cluster.stopped) == sorted(r.replica_id for r in view.keeper.replicas)


async def _until(check: object) -> None:
    assert callable(check)
    while not check():
        await asyncio.sleep(0.05)


async def test_failed_starts_back_off_on_durable_timers_then_park(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    cluster.start_failures = 100
    async with _run(time_skipping_env, cluster) as run:
        before = await time_skipping_env.get_current_time()
        view = await run.until(DeploymentStatus.PARKED, timeout=30, skip_s=5)
        waited = (await time_skipping_env.get_current_time() - before).total_seconds()
        # 10 + 20 + 40 + 60 s of backoff between five failed starts, skipped in test time.
        assert waited >= 130
        assert len(cluster.started) == 5
        assert view.keeper.last_failure == "engine exited with code 1"
        # The query answers from memory at once; the store write follows it.
        await asyncio.wait_for(_until(
            lambda: cluster.statuses[-1].status is DeploymentStatus.PARKED), 20)
        assert cluster.statuses[-1].consecutive_failures == 5

        # Un-park: the next start succeeds.
        cluster.start_failures = 0
        await run.handle.signal(DeploymentWorkflow.retry)
        await run.until(DeploymentStatus.SERVING)
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "backoff_park_retry_delete")


async def test_cant_place_reason_is_kept_and_retried_on_node_change(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    cluster.cant_place = "node a: 8.0 GiB free, needs 24.0 GiB"
    async with _run(time_skipping_env, cluster) as run:
        view = await run.until(DeploymentStatus.CANT_PLACE)
        assert view.keeper.placement_error == "node a: 8.0 GiB free, needs 24.0 GiB"
        reason = view.keeper.placement_error
        await asyncio.wait_for(_until(
            lambda reason=reason: cluster.statuses[-1].placement_error == reason), 20)
        tries = len(cluster.placements)
        cluster.cant_place = None
        await run.handle.signal(DeploymentWorkflow.nodes_changed)
        await run.until(DeploymentStatus.SERVING)
        assert len(cluster.placements) == tries + 1
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "cant_place_nodes_changed")


async def test_scale_is_an_update_validated_against_deletion(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.SERVING)
        assert await run.handle.execute_update(DeploymentWorkflow.scale,
                                               ScaleRequest(replicas=2)) == 2
        view = await run.until(DeploymentStatus.SERVING)
        assert len(view.keeper.replicas) == 2
        await run.handle.execute_update(DeploymentWorkflow.scale, ScaleRequest(replicas=1))
        await _until_async(run, lambda v: len(v.keeper.replicas) == 1)
        await run.handle.signal(DeploymentWorkflow.delete)
        with pytest.raises(WorkflowUpdateFailedError):
            await run.handle.execute_update(DeploymentWorkflow.scale,
                                            ScaleRequest(replicas=3))
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "scale_update")


async def _until_async(run: Running, check: object) -> None:
    assert callable(check)

    async def poll() -> None:
        while not check(await run.view()):
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), 20)


async def test_continue_as_new_carries_the_whole_state(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    tunables = _tunables(continue_as_new_after_events=60)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        handle = run.handle
        first_run = (await handle.describe()).run_id
        for n in range(1, 5):
            await run.until(DeploymentStatus.SERVING)
            await _until(lambda n=n: f"d1-r{n}" in cluster.crash)
            cluster.crash[f"d1-r{n}"].set()
            await _until(lambda n=n: f"d1-r{n + 1}" in cluster.crash)
        await _until_async(run, lambda v: [r.replica_id for r in v.keeper.replicas] ==
                           ["d1-r5"])  # r4's stop may still be in flight a moment
        view = await run.until(DeploymentStatus.SERVING)
        latest = time_skipping_env.client.get_workflow_handle(handle.id)

        async def continued() -> None:
            # It continues as new once nothing is in flight and its writer is idle: the
            # last status write may still be on its way when r5 reads serving.
            while (await latest.describe()).run_id == first_run:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(continued(), 20)
        # The carried state goes on where it left off: replica numbers keep counting.
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r5"]
        assert cluster.stopped == ["d1-r1", "d1-r2", "d1-r3", "d1-r4"]
        await latest.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(latest.result(), 20)
        assert cluster.deleted == ["d1"]
        # The first run (it ends by continuing as new) and the last (it starts from the
        # carried state and resumes the work in flight).
        await record_history(time_skipping_env.client.get_workflow_handle(
            handle.id, run_id=first_run), "continue_as_new")
        await record_history(latest, "continue_as_new_resumed")


async def test_continue_as_new_waits_for_a_pending_store_write_and_carries_what_came_meanwhile(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """Continue-as-new is due, but a store write is in flight (the database is slow) and
    an audit event waits behind it; a scale update and a node change arrive meanwhile. The
    run continues only once the writer is idle and nothing waits to be decided
    (continue-as-new-waits-for-inbox): the next run has the scale's replica, and every
    write and event reached the store exactly once.

    Without the patch's wait the run continues at the first moment it is not busy: the
    queued replica.start_failed event, which continue-as-new does not carry, is lost."""
    cluster.start_failures = 1
    cluster.store_gate = asyncio.Event()  # every store write waits from the start
    # A short backoff: the write held in flight holds the test server's clock to the wall.
    tunables = _tunables(start_backoff_initial_s=0.1, continue_as_new_after_events=20)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        first = run.handle
        latest = time_skipping_env.client.get_workflow_handle(first.id)
        # d1-r1 failed to start (its event queued behind the first write, still in
        # flight), d1-r2 serves: nothing is busy and the history is past 20 events.
        await run.until(DeploymentStatus.SERVING)
        assert cluster.store_waiting >= 1 and cluster.events == []
        assert await latest.execute_update(DeploymentWorkflow.scale,
                                           ScaleRequest(replicas=2)) == 2
        await latest.signal(DeploymentWorkflow.nodes_changed)
        await _until_async(run, lambda v: v.status is DeploymentStatus.SERVING
                           and len(v.keeper.replicas) == 2)
        cluster.store_gate.set()

        async def continued() -> None:
            while (await latest.describe()).run_id == first.result_run_id:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(continued(), 20)
        view = await run.view()
        assert view.keeper.spec.replicas == 2
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r2", "d1-r3"]
        assert all(r.phase == "ready" for r in view.keeper.replicas)
        # Each write once, in the one order; none repeated by the next run.
        await asyncio.wait_for(_until(lambda: cluster.statuses and cluster.statuses[-1]
                                      .desired_replicas == 2), 20)
        assert [(e.kind, e.replica_id) for e in cluster.events] == [
            ("replica.start_failed", "d1-r1")]
        assert len(cluster.replica_states) == len(set(cluster.replica_states))
        assert len(cluster.statuses) == len({s.model_dump_json() for s in cluster.statuses})
        await latest.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(latest.result(), 20)
        assert cluster.statuses[-1].status is DeploymentStatus.DELETING
        assert len(cluster.statuses) == len({s.model_dump_json() for s in cluster.statuses})


def test_state_is_whole_from_construction() -> None:
    """@workflow.init builds the state from the input: the status query answers from a
    workflow object no workflow task has run yet (no worker, no run, no event loop)."""
    request = _input()
    view = DeploymentWorkflow(request).status()
    assert view.keeper == KeeperState(spec=request.spec)
    assert view.keeper.replicas == []


async def test_status_query_sent_before_the_first_workflow_task_is_answered(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """A query sent right after start, while no worker polls yet, is answered (not failed)
    once one does. The server holds a query until the first workflow task completes."""
    handle = (await _start(time_skipping_env, cluster, _input())).handle
    query = asyncio.create_task(handle.query(DeploymentWorkflow.status))
    # Not a wait for anything: it lets the query go out before a worker exists. The test
    # passes either way; this only makes it test what it says more often.
    await asyncio.sleep(0.2)
    async with _workers(time_skipping_env, cluster):
        view = await asyncio.wait_for(query, 20)
        assert view.keeper.spec.deployment_id == "d1"
        assert view.status in {DeploymentStatus.PLACING, DeploymentStatus.STARTING,
                               DeploymentStatus.SERVING}
        # Serving before the delete: on two loaded cores, the time-skipping server once
        # left a workflow task started and never completed (nor timed out: its clock does
        # not move while an activity runs) when the delete landed during the start. That
        # path is the keeper's own tests' (delete while starting), not this one's.
        await Running(time_skipping_env, cluster, handle).until(DeploymentStatus.SERVING)
        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 20)


async def test_an_update_in_the_first_workflow_task_sees_the_whole_state(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """Update-with-start delivers the update in the first workflow task, whose handlers
    (the validator included) the SDK runs before run's first line: the validator reads the
    state, which only @workflow.init can have built by then."""
    start = WithStartWorkflowOperation(
        DeploymentWorkflow.run, _input(), id=f"deployment/{uuid.uuid4()}",
        task_queue=CONTROL_TASK_QUEUE, id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
    async with _workers(time_skipping_env, cluster):
        assert await asyncio.wait_for(time_skipping_env.client.execute_update_with_start_workflow(
            DeploymentWorkflow.scale, ScaleRequest(replicas=2),
            start_workflow_operation=start), 20) == 2
        handle = await start.workflow_handle()
        run = Running(time_skipping_env, cluster, handle)
        view = await run.until(DeploymentStatus.SERVING)
        assert len(view.keeper.replicas) == 2
        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 20)


# -- cancel, crashed placements, tolerant payloads, visibility -----------------------------


async def test_cancel_is_handled_as_a_delete(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """A cancel (web UI, `temporal workflow cancel`) stops and releases every replica and
    deletes the deployment's row; only then does the workflow end, as cancelled."""
    async with _run(time_skipping_env, cluster, replicas=2) as run:
        await run.until(DeploymentStatus.SERVING)
        await run.handle.cancel()
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(run.handle.result(), 20)
        assert isinstance(failure.value.cause, CancelledError)
        assert sorted(cluster.stopped) == ["d1-r1", "d1-r2"]
        assert sorted(cluster.released) == ["d1-r1", "d1-r2"]
        assert cluster.deleted == ["d1"]
        assert cluster.statuses[-1].status is DeploymentStatus.DELETING
        await record_history(run.handle, "cancel_as_delete")


async def test_cancel_while_a_replica_starts_stops_it_too(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    cluster.start_gates["d1-r1"] = asyncio.Event()  # never opens: the engine loads
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.STARTING)
        await run.handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(run.handle.result(), 20)
        assert cluster.stopped == ["d1-r1"] and cluster.released == ["d1-r1"]
        assert cluster.deleted == ["d1"]


async def test_a_failed_placement_releases_what_it_may_have_claimed(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """place_replica committed its claim and then failed: the keeper forgets that replica
    id, so the workflow releases it before the keeper hears of the failure."""
    cluster.place_errors = ["database went away"]
    async with _run(time_skipping_env, cluster) as run:
        # The next placement comes cant_place_retry_s (30 s of test time) later.
        view = await run.until(DeploymentStatus.SERVING, timeout=30, skip_s=5)
        assert cluster.claimed == ["d1-r1"]
        assert cluster.released == ["d1-r1"]
        assert cluster.placements == ["d1-r1", "d1-r2"]
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r2"]
        assert view.keeper.last_failure == "placement failed: database went away"
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        assert cluster.released == ["d1-r1", "d1-r2"]
        await record_history(run.handle, "placement_crash_release")


async def test_a_timed_out_placement_is_released_once_its_last_attempt_has_ended(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """A placement that times out may still be inside its transaction: the release waits
    out an attempt's start-to-close first, so it does not run before that commit."""
    cluster.place_errors = ["timeout"]
    tunables = _tunables(place_schedule_to_close_s=1.0)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        before = await time_skipping_env.get_current_time()
        await asyncio.wait_for(_until(lambda: cluster.claimed == ["d1-r1"]), 20)
        await run.until(DeploymentStatus.SERVING, timeout=30, skip_s=5)
        assert cluster.released == ["d1-r1"]
        view = await run.view()
        assert view.keeper.last_failure == (
            "placement failed: place_replica timed out: it took too long")
        waited = (await time_skipping_env.get_current_time() - before).total_seconds()
        assert waited >= 30  # STORE_TIMEOUT before the release (then cant_place_retry_s)
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "placement_timeout_release")


async def test_agent_answers_with_fields_this_worker_does_not_know(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """An agent one version ahead of the worker adds fields to its start and exit answers:
    the worker ignores them rather than failing its workflow task for ever."""
    cluster.agent_extra = {"added_in_a_later_version": {"gpu_uuid": "GPU-1"}}
    async with _run(time_skipping_env, cluster) as run:
        view = await run.until(DeploymentStatus.SERVING)
        assert view.keeper.replicas[0].endpoint == "http://engine/d1-r1"
        cluster.crash["d1-r1"].set()
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.crash), 20)
        view = await run.until(DeploymentStatus.SERVING)
        assert view.keeper.last_failure == "signalled: killed by SIGKILL"
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)


async def test_carried_state_with_fields_this_worker_does_not_know_decodes(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The state a newer worker carried over (continue-as-new, then a rollback) has
    fields this one does not know, at every level: it decodes, and the run goes on from
    it (the ready replica is watched on its node, replica numbers keep counting)."""
    extra = {"added_later": [1, 2]}
    shard = ShardSpec(replica_id=ReplicaId("d1-r1"), model_id=ModelId("m"), node_id=NODE,
                      engine=EngineKind.SIM, source="sim", memory_bytes=1)
    status = DeploymentStatusUpdate(
        deployment_id=DeploymentId("d1"), status=DeploymentStatus.SERVING,
        placement_error=None, consecutive_failures=0, last_failure=None, desired_replicas=1)
    request = _input()
    raw = request.model_dump(mode="json")
    state = raw["carried"] = DeploymentWorkflowState(
        keeper=KeeperState(spec=request.spec), config=KeeperConfig.of(request.tunables),
        tunables=request.tunables, search_attributes=False).model_dump(mode="json")
    state["keeper"]["replicas"] = [{"replica_id": "d1-r1", "phase": "ready",
                                    "nodes": [NODE], "endpoint": "http://engine/d1-r1",
                                    **extra}]
    state["keeper"]["next_replica_seq"] = 2
    state["shards"] = {"d1-r1": [{**shard.model_dump(mode="json"), **extra}]}
    state["written_status"] = {**status.model_dump(mode="json"), **extra}
    for part in (raw, state, state["keeper"], state["keeper"]["spec"], state["config"],
                 state["tunables"]):
        part.update(extra)
    cluster.crash["d1-r1"] = asyncio.Event()  # the engine the newer worker started
    async with _workers(time_skipping_env, cluster):
        handle = await time_skipping_env.client.start_workflow(
            "DeploymentWorkflow", raw, id=f"deployment/{uuid.uuid4()}",
            task_queue=CONTROL_TASK_QUEUE)
        run = Running(time_skipping_env, cluster, handle)
        view = await run.until(DeploymentStatus.SERVING)
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r1"]
        cluster.crash["d1-r1"].set()  # its watch, re-opened from the carried shards, ends
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.crash), 20)
        await asyncio.wait_for(_until(lambda: cluster.stopped == ["d1-r1"]), 20)
        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 20)


async def test_an_unreachable_replica_its_agent_vouches_for_is_adopted(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The watch goes silent: the replica is unreachable (degraded) and a replacement is
    placed; the agent's answer to the probe says it still runs it (with a field this
    worker does not know): it is watched again, and the replacement is stopped."""
    cluster.silence = {"d1-r1"}
    cluster.agent_runs = {"d1-r1"}
    cluster.agent_extra = {"added_in_a_later_version": True}
    cluster.start_gates["d1-r2"] = asyncio.Event()  # the replacement is still loading
    cluster.probe_after_status = DeploymentStatus.DEGRADED
    tunables = _tunables(watch_heartbeat_timeout_s=2.0)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r2"]), 20)
        await _until_async(run, lambda v: [(r.replica_id, r.phase) for r in v.keeper.replicas]
                           == [("d1-r1", "ready")])
        assert cluster.stopped == ["d1-r2"]
        assert (await run.view()).status is DeploymentStatus.SERVING
        assert DeploymentStatus.DEGRADED in [s.status for s in cluster.statuses]
        cluster.crash["d1-r1"].set()  # the re-opened watch is a live one
        await asyncio.wait_for(_until(lambda: "d1-r3" in cluster.crash), 20)
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        cluster.start_gates["d1-r2"].set()
        await record_history(run.handle, "unreachable_probe_adoption")


async def test_degraded_while_the_surge_replacement_loads_then_the_original_is_stopped(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The watch goes silent and the agent does not answer: degraded, with a replacement
    placed at once; once it is ready the original is stopped."""
    cluster.silence = {"d1-r1"}
    cluster.agent_runs = None
    gate = cluster.start_gates["d1-r2"] = asyncio.Event()
    tunables = _tunables(watch_heartbeat_timeout_s=2.0, replica_lost_after_s=300.0)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        view = await run.until(DeploymentStatus.DEGRADED)
        assert view.keeper.last_failure == "d1-r1 unreachable: no heartbeat from n1"
        await _until_async(run, lambda v: [(r.replica_id, r.phase) for r in v.keeper.replicas]
                           == [("d1-r1", "unreachable"), ("d1-r2", "starting")])
        gate.set()
        await _until_async(run, lambda v: [r.replica_id for r in v.keeper.replicas]
                           == ["d1-r2"])
        assert (await run.view()).status is DeploymentStatus.SERVING
        assert cluster.stopped == cluster.released == ["d1-r1"]
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "degraded_surge_replacement")


async def test_web_ui_details_show_status_replicas_and_nodes(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.SERVING)

        async def details(handle: WorkflowHandle[Any, Any]) -> str:
            while True:
                meta = await handle.query("__temporal_workflow_metadata",
                                              result_type=WorkflowMetadata)
                if meta.current_details.startswith("**serving**"):
                    return str(meta.current_details)
                await asyncio.sleep(0.05)

        text = await asyncio.wait_for(details(run.handle), 20)
        assert text.splitlines()[0] == "**serving**: 1/1 ready, model `m`"
        assert "| d1-r1 | ready | n1 |" in text
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)


async def test_search_attributes_move_on_while_the_store_is_down(
    local_temporal_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """On the dev server, which has them registered: status, ready and desired counts and
    nodes are upserted before the store writes, so a database outage does not freeze
    them."""
    async with _run(local_temporal_env, cluster, search_attributes=True) as run:
        await run.until(DeploymentStatus.SERVING)
        await _until_search_attributes(run, status="serving", ready=1, desired=1,
                                       nodes=["n1"])
        # Upserted first: wait for the store writes that follow, so the loop is idle.
        await asyncio.wait_for(_until(lambda: bool(cluster.statuses) and
                                      cluster.statuses[-1].status is DeploymentStatus.SERVING),
                               20)
        cluster.store_down = True
        written = len(cluster.statuses)
        await run.handle.execute_update(DeploymentWorkflow.scale, ScaleRequest(replicas=2))
        await _until_search_attributes(run, status="placing", ready=1, desired=2,
                                       nodes=["n1"])
        assert len(cluster.statuses) == written  # the store refused the write meanwhile
        cluster.store_down = False
        await _until_search_attributes(run, status="serving", ready=2, desired=2,
                                       nodes=["n1"])
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 30)
        # The one recorded history with search attributes on (the time-skipping server
        # has none registered).
        await record_history(run.handle, "search_attributes_store_down")


async def test_the_web_uis_saved_view_lists_model_status_and_ready_over_desired(
    local_temporal_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """Issue 24: the list of runs tells deployments apart. The saved view that
    docs/keeper.md ("The web UI's list") documents is a visibility query plus columns of
    the search attributes; this runs its query on the dev server, and each row carries the
    columns it shows: ModelId, DeploymentStatus, ReadyReplicas and DesiredReplicas."""
    client = local_temporal_env.client
    async with _workers(local_temporal_env, cluster):
        handles = []
        for deployment_id, model_id, replicas in (("d1", "m", 2), ("d2", "m2", 1)):
            spec = DeploymentSpec(deployment_id=DeploymentId(deployment_id),
                                  model_id=ModelId(model_id), replicas=replicas)
            handles.append(await client.start_workflow(
                DeploymentWorkflow.run,
                DeploymentInput(spec=spec, tunables=_tunables(), search_attributes=True),
                id=f"deployment/{deployment_id}-{uuid.uuid4().hex[:6]}",
                task_queue=CONTROL_TASK_QUEUE,
                # As the API starts one: the model and the first status at start.
                search_attributes=TypedSearchAttributes([
                    SearchAttributePair(MODEL_ID_KEY, model_id),
                    SearchAttributePair(STATUS_KEY, "placing")])))
        ids = {h.id for h in handles}

        async def rows() -> dict[str, tuple[object, ...]]:
            found: dict[str, tuple[object, ...]] = {}
            async for execution in client.list_workflows(DEPLOYMENTS_VIEW_QUERY):
                if execution.id in ids:
                    sa = execution.typed_search_attributes
                    found[execution.id] = (sa.get(MODEL_ID_KEY), sa.get(STATUS_KEY),
                                           sa.get(READY_KEY), sa.get(DESIRED_KEY))
            return found

        want = {handles[0].id: ("m", "serving", 2, 2), handles[1].id: ("m2", "serving", 1, 1)}

        async def listed() -> None:
            while await rows() != want:
                await asyncio.sleep(0.2)

        await asyncio.wait_for(listed(), 30)
        # A filter on a column: one model's deployments.
        only_m2 = [e.id async for e in client.list_workflows(
            f"{DEPLOYMENTS_VIEW_QUERY} AND ModelId = 'm2'") if e.id in ids]
        assert only_m2 == [handles[1].id]
        for handle in handles:
            await handle.signal(DeploymentWorkflow.delete)
        for handle in handles:
            await asyncio.wait_for(handle.result(), 30)


async def test_the_model_id_column_follows_a_switch(
    local_temporal_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """Issue 24: after a switch commits another model, the list's ModelId says the model
    the deployment runs now, not the one it was created for."""
    client = local_temporal_env.client
    async with _workers(local_temporal_env, cluster):
        handle = await client.start_workflow(
            DeploymentWorkflow.run, _input(search_attributes=True),
            id=f"deployment/{uuid.uuid4()}", task_queue=CONTROL_TASK_QUEUE,
            search_attributes=TypedSearchAttributes([SearchAttributePair(MODEL_ID_KEY, "m"),
                                                     SearchAttributePair(STATUS_KEY, "placing")]))
        run = Running(local_temporal_env, cluster, handle)
        await run.until(DeploymentStatus.SERVING)
        await run.handle.execute_update(UPDATE_SET_GENERATION, SetGenerationRequest(
            move_id=MoveId("switch/d1/1:commit"),
            generation=Generation(number=1, model_id=ModelId("m2"))))

        async def model_id() -> None:
            while (await handle.describe()).typed_search_attributes.get(MODEL_ID_KEY) != "m2":
                await asyncio.sleep(0.1)

        await asyncio.wait_for(model_id(), 20)
        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 30)
        await record_history(handle, "model_id_follows_switch")


async def test_a_store_outage_delays_status_writes_not_the_replacement_of_a_lost_replica(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The database refuses every status and replica-state write while a serving engine
    dies: the replacement is still placed, started and watched (the writes go on in the
    background, retrying). Once the store is back it gets what is current, not each state
    in between."""
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: bool(cluster.statuses) and
                                      cluster.statuses[-1].status is DeploymentStatus.SERVING
                                      and ("d1-r1", "ready") in cluster.replica_states), 20)
        cluster.store_down = True
        statuses, replica_states = len(cluster.statuses), len(cluster.replica_states)
        cluster.crash["d1-r1"].set()

        # Replaced during the outage: placed, started, watched, serving.
        await asyncio.wait_for(_until(lambda: cluster.watches == ["d1-r1", "d1-r2"]), 20)
        view = await _until_view(run, lambda v: [(r.replica_id, r.phase)
                                                 for r in v.keeper.replicas]
                                 == [("d1-r2", "ready")])
        assert view.status is DeploymentStatus.SERVING
        assert cluster.placements == cluster.started == ["d1-r1", "d1-r2"]
        assert cluster.stopped == cluster.released == ["d1-r1"]
        assert len(cluster.statuses) == statuses  # the store refused every write meanwhile
        assert len(cluster.replica_states) == replica_states

        cluster.store_down = False
        current = DeploymentStatusUpdate(
            deployment_id=DeploymentId("d1"), status=DeploymentStatus.SERVING,
            placement_error=None, consecutive_failures=0,
            last_failure="signalled: killed by SIGKILL", desired_replicas=1)
        await asyncio.wait_for(_until(lambda: cluster.statuses[statuses:] == [current]), 30)
        await asyncio.wait_for(_until(
            lambda: cluster.replica_states[-1] == ("d1-r2", "ready")), 20)
        # Coalesced: the replacement's starting state, and the placing status while it was
        # placed, were never current when the store could take them.
        assert ("d1-r2", "starting") not in cluster.replica_states
        assert cluster.statuses[-1] == current

        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        assert cluster.statuses[-1].status is DeploymentStatus.DELETING
        assert cluster.deleted == ["d1"]
        await record_history(run.handle, "store_outage_replacement")


async def test_an_engine_exit_and_a_failed_start_leave_the_engine_log_in_the_events(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """A watch's exit and a failed start each append an audit event (replica.exited,
    replica.start_failed) with the engine's last 200 log lines."""
    cluster.exit_log = [f"exit line {n}" for n in range(250)]  # more than an agent sends
    cluster.start_failure_log = ["loading weights", "CUDA error: out of memory"]
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.SERVING)
        cluster.start_failures = 2  # the replacement's start fails once
        cluster.crash["d1-r1"].set()
        # Replaced again after the failed start's backoff (10 s of test time).
        await asyncio.wait_for(_until(lambda: "d1-r3" in cluster.crash), 30)
        await asyncio.wait_for(_until(lambda: len(cluster.events) == 2), 20)
        exited, start_failed = cluster.events
        assert (exited.kind, exited.deployment_id, exited.replica_id) == (
            "replica.exited", "d1", "d1-r1")
        assert exited.message == "signalled: killed by SIGKILL"
        assert exited.data["log"] == cluster.exit_log[-200:]
        assert (start_failed.kind, start_failed.deployment_id, start_failed.replica_id) == (
            "replica.start_failed", "d1", "d1-r2")
        assert start_failed.message == "engine exited with code 1"
        assert start_failed.data["log"] == cluster.start_failure_log
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        assert len(cluster.events) == 2
        await record_history(run.handle, "engine_log_events")


async def test_an_engine_that_exits_after_ready_is_relaunched_in_place_then_replaced(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """An engine exits after it was ready: started again on its node, in its claim (no
    placement, no stop, no release), out of routing (stored as starting) until it is
    ready again, and said so in an audit event and in the replica's stored note. Its
    relaunch_tries (2) spent within the window, the next exit places it again."""
    tunables = _tunables(relaunch_tries=2, relaunch_window_s=600.0)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: ("d1-r1", "ready") in cluster.replica_states),
                               20)
        # The relaunch's start waits here, so its starting state is seen (and written).
        gate = cluster.start_gates["d1-r1"] = asyncio.Event()
        cluster.crash["d1-r1"].set()
        view = await run.until(DeploymentStatus.STARTING)
        [replica] = view.keeper.replicas
        note = ("engine exited (signalled: killed by SIGKILL); relaunched in place on n1, "
                "try 1 of 2 in 600 s")
        assert (replica.replica_id, replica.phase, replica.relaunching) == (
            "d1-r1", "starting", True)
        assert view.keeper.last_failure == f"d1-r1: {note}"
        # Out of routing while it starts: the store is told it is starting, with why.
        await asyncio.wait_for(_until(lambda: cluster.replica_states[-1] == (
            "d1-r1", "starting")), 20)
        assert cluster.replica_updates[-1].relaunch_note == note
        await asyncio.wait_for(_until(lambda: len(cluster.events) == 2), 20)
        exited, relaunched = cluster.events
        assert (exited.kind, exited.message) == ("replica.exited",
                                                 "signalled: killed by SIGKILL")
        assert (relaunched.kind, relaunched.replica_id, relaunched.message) == (
            "replica.relaunched", "d1-r1", note)
        assert relaunched.data == {"attempt": 1, "tries": 2, "window_s": 600.0,
                                   "nodes": ["n1"]}
        # Ready again: routed again (ready, its endpoint), still noting the relaunch.
        gate.set()
        view = await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: cluster.replica_states[-1] == (
            "d1-r1", "ready")), 20)
        assert cluster.replica_updates[-1].endpoint == "http://engine/d1-r1"
        assert cluster.replica_updates[-1].relaunch_note == note
        assert cluster.placements == ["d1-r1"] and cluster.started == ["d1-r1", "d1-r1"]
        assert cluster.stopped == cluster.released == []
        await asyncio.wait_for(_until(lambda: cluster.watches == ["d1-r1", "d1-r1"]), 20)

        # The second exit: the last try of the window.
        del cluster.start_gates["d1-r1"]
        cluster.crash["d1-r1"].set()
        await asyncio.wait_for(_until(lambda: cluster.started == ["d1-r1"] * 3), 20)
        await asyncio.wait_for(_until(lambda: cluster.watches == ["d1-r1"] * 3), 20)
        # The third: no try left in the window, so stopped, released and placed again.
        cluster.crash["d1-r1"].set()
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.crash), 20)
        view = await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r1"]), 20)
        assert cluster.placements == ["d1-r1", "d1-r2"] and cluster.stopped == ["d1-r1"]
        assert view.keeper.last_failure == (
            "signalled: killed by SIGKILL; not relaunched in place: 2 relaunch(es) in the "
            "last 600 s already (at most 2), so it is placed again")
        assert [e.kind for e in cluster.events].count("replica.relaunched") == 2
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "relaunch_in_place")


async def test_a_relaunch_that_fails_to_start_is_replaced_at_once(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The relaunched engine does not become ready: not a failed start of the deployment
    (no backoff), the replica is stopped, released and placed again at once."""
    async with _run(time_skipping_env, cluster, tunables=_tunables(relaunch_tries=3)) as run:
        await run.until(DeploymentStatus.SERVING)
        cluster.start_failures = 2  # the first start succeeded; the relaunch fails
        before = await time_skipping_env.get_current_time()
        cluster.crash["d1-r1"].set()
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.crash), 20)
        view = await run.until(DeploymentStatus.SERVING)
        assert (await time_skipping_env.get_current_time() - before).total_seconds() < 5
        assert cluster.started == ["d1-r1", "d1-r1", "d1-r2"]
        assert cluster.placements == ["d1-r1", "d1-r2"] and cluster.released == ["d1-r1"]
        assert view.keeper.consecutive_failures == 0
        assert view.keeper.last_failure == ("relaunch in place failed: engine exited with "
                                            "code 1")
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)


async def _until_search_attributes(run: Running, *, status: str, ready: int, desired: int,
                                   nodes: list[str]) -> None:
    want = (status, ready, desired, nodes)

    async def poll() -> None:
        while True:
            found = (await run.handle.describe()).typed_search_attributes
            nodes_found = found.get(NODES_KEY)
            if (found.get(STATUS_KEY), found.get(READY_KEY), found.get(DESIRED_KEY),
                    list(nodes_found) if nodes_found is not None else None) == want:
                return
            await asyncio.sleep(0.1)

    await asyncio.wait_for(poll(), 20)


async def test_node_silent_makes_replicas_unreachable_and_the_probe_supersedes_the_watch(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The API's liveness stream found the node silent (its watch still heartbeats: the
    backstop has not fired). The replica is unreachable at once and probed; its watch is
    cancelled. The agent vouches for it: it is watched again and its replacement stopped."""
    cluster.agent_runs = {"d1-r1"}
    cluster.start_gates["d1-r2"] = asyncio.Event()  # the replacement is still loading
    cluster.probe_after_status = DeploymentStatus.DEGRADED
    # Heartbeats every 2.4 s (0.8 x 3 s), which bring the watch its cancel: with the
    # default 60 s (Settings') the SDK would send one every 48 s.
    tunables = _tunables(watch_heartbeat_timeout_s=3.0)
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        await run.until(DeploymentStatus.SERVING)
        await run.handle.signal(DeploymentWorkflow.node_silent, NodeSilentInput(
            node_id=NODE, replica_ids=[ReplicaId("d1-r1"), ReplicaId("not-ours")]))
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r2"]), 20)
        await _until_async(run, lambda v: [(r.replica_id, r.phase) for r in v.keeper.replicas]
                           == [("d1-r1", "ready")])
        assert cluster.watches == ["d1-r1", "d1-r1"]
        await asyncio.wait_for(_until(lambda: cluster.watches_cancelled == ["d1-r1"]), 20)
        assert DeploymentStatus.DEGRADED in [s.status for s in cluster.statuses]
        cluster.crash["d1-r1"].set()  # the new watch is the live one
        await asyncio.wait_for(_until(lambda: "d1-r3" in cluster.crash), 20)
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        cluster.start_gates["d1-r2"].set()
        await record_history(run.handle, "node_silent_probe_adoption")


# -- what a deployment costs Temporal: history events an hour --------------------------------


def _at(event: HistoryEvent) -> datetime:
    return event.event_time.ToDatetime(tzinfo=UTC)


def _within(history: WorkflowHistory, start: datetime, end: datetime) -> list[HistoryEvent]:
    """The events recorded in (start, end] of the server's (virtual) time."""
    return [e for e in history.events if start < _at(e) <= end]


def _open_timers(history: WorkflowHistory) -> set[int]:
    """Timers started and neither fired nor cancelled: what would wake the workflow."""
    started = {e.event_id for e in history.events
               if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED}
    fired = {e.timer_fired_event_attributes.started_event_id for e in history.events
             if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED}
    cancelled = {e.timer_canceled_event_attributes.started_event_id for e in history.events
                 if e.event_type == EventType.EVENT_TYPE_TIMER_CANCELED}
    return started - fired - cancelled


async def _quiet_history(handle: WorkflowHandle[Any, Any]) -> WorkflowHistory:
    """The history once it has stopped growing (the last store write and its workflow task
    are in)."""
    history = await handle.fetch_history()
    while True:
        await asyncio.sleep(0.5)
        again = await handle.fetch_history()
        if len(again.events) == len(history.events):
            return again
        history = again


#: The budget from "Cheap on Temporal at scale": a deployment that cannot be placed.
UNPLACEABLE_EVENTS_PER_HOUR = 30
#: What one blind can't-place retry costs: the timer fires; a workflow task (scheduled,
#: started, completed) schedules place_replica (scheduled, started, completed); a workflow
#: task takes its answer and starts the next timer.
EVENTS_PER_BLIND_RETRY = 11
BLIND_RETRY = [EventType.EVENT_TYPE_TIMER_FIRED, *[EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
               EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
               EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED],
               EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
               EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED,
               EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
               EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
               EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
               EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, EventType.EVENT_TYPE_TIMER_STARTED]

#: The time-skipping server skips nothing while an activity is in flight (it holds its
#: clock to the wall clock from an activity's schedule to its result), and a deployment
#: that cannot be placed always has its room watch in flight. So the room watch's tests
#: run every can't-place timing this many times shorter: an hour is 10 s of test time,
#: the watch's 30 s and 10 min are 1/12 s and 1.7 s. History events count retries, which
#: the scaling keeps, not seconds.
SCALE = 360.0
HOUR = timedelta(hours=1) / SCALE
SCALED = _tunables(cant_place_retry_s=30 / SCALE,
                      room_watch_max_s=600 / SCALE, cant_place_backstop_s=3600 / SCALE)
#: The real room watch's heartbeats, sent every 0.8 x this, report its dry runs.
WATCH_TIMINGS = SCALED.model_copy(update={"room_watch_heartbeat_timeout_s": 5.0})


def _scaled_s(since: datetime, event: HistoryEvent) -> float:
    """Seconds from ``since`` to ``event``, unscaled (as the deployment would see them)."""
    return (_at(event) - since).total_seconds() * SCALE


def _activities_of(history: WorkflowHistory, name: str) -> list[HistoryEvent]:
    return [e for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name == name]


async def test_a_deployment_that_cannot_be_placed_costs_at_most_30_history_events_an_hour(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """While nothing fits, the room watch (an activity) dry-runs placement 30 s doubling to
    10 min, outside the history; the workflow's own blind retry is only a backstop, once an
    hour: 11 history events an hour (measured below, in SCALE time).

    Measured the same way before: every 30 s (before cant-place-backoff) 1,309 events in
    an hour; 30 s doubling to 30 min (cant-place-backoff) 66 in the first hour and 22 in
    each after; a 10-minute cap on that timer would have been 66 an hour. A node change
    still retries at once, and leaves the watch running; a placement that finds room
    cancels it."""
    cluster.cant_place = "node a: 8.0 GiB free, needs 24.0 GiB"
    async with _run(time_skipping_env, cluster, tunables=SCALED) as run:
        await run.until(DeploymentStatus.CANT_PLACE)
        # From when the first answer's timer (the backstop) and watch are started and the
        # status write is in.
        quiet = await _quiet_history(run.handle)
        [backstop] = _open_timers(quiet)
        start = _at(quiet.events[-1])
        assert len(_activities_of(quiet, "watch_for_room")) == 1
        await time_skipping_env.sleep(2.5 * HOUR)
        history = await run.handle.fetch_history()
        after = [e for e in history.events if _at(e) > start]
        # Counted, not assumed: the backstop at 1 h and at 2 h, 11 events each, nothing else.
        assert [e.event_type for e in after] == 2 * BLIND_RETRY, [
            (EventType.Name(e.event_type), round(_scaled_s(start, e))) for e in after]
        # From the first placement, whose answer set the backstop (the timer open now
        # may be a later one to the same deadline: the keeper re-arms its wake-up after
        # each decision, and seeking room (once, below) is one).
        first, *blind = _activities_of(history, "place_replica")
        places = [_scaled_s(_at(first), e) for e in blind]
        assert len(places) == 2 and all(0 <= p - 3600 * n < 120  # one scaled minute of lag
                                        for n, p in enumerate(places, start=1)), places
        assert _scaled_s(_at(first), next(e for e in quiet.events
                                          if e.event_id == backstop)) < 120
        # Room was sought once, at the first failure (issue 22), not at each blind retry.
        assert len(cluster.sought) == 1
        per_hour = [len(_within(history, start + (n - 0.5) * HOUR, start + (n + 0.5) * HOUR))
                    for n in (1, 2)]
        assert per_hour == [EVENTS_PER_BLIND_RETRY, EVENTS_PER_BLIND_RETRY]
        assert max(per_hour) <= UNPLACEABLE_EVENTS_PER_HOUR
        # Meanwhile the one watch dry-ran on its schedule, capped at 10 min: 30, 60, 120,
        # 240, 480 s, then every 600 s (18 dry runs in the 2.5 h), none in the history.
        assert cluster.room_watches == [1] and cluster.room_watches_cancelled == 0
        began = _at(_activities_of(history, "watch_for_room")[0])
        elapsed = (await time_skipping_env.get_current_time() - began).total_seconds() * SCALE
        schedule = itertools.accumulate(room_watch_wait_s(1, check, first_s=30, max_s=600)
                                        for check in range(100))
        due = sum(1 for at in schedule if at <= elapsed)
        assert due >= 18 and due - 1 <= cluster.room_checks[0] <= due

        # Memory freed elsewhere: retried at once, still no room; the count goes on and
        # the watch is left as it was (not cancelled and started again).
        await run.handle.signal(DeploymentWorkflow.nodes_changed)
        await asyncio.wait_for(_until(lambda: len(cluster.placements) == 4), 20)
        view = await _until_view(run, lambda v: v.keeper.unplaceable_in_a_row == 4)
        assert view.status is DeploymentStatus.CANT_PLACE
        assert cluster.room_watches == [1] and cluster.room_watches_cancelled == 0

        # Room, and a node change says so before the watch's next dry run: placed, and the
        # watch is cancelled (a cancel request, and its acknowledgement when the watch's
        # next heartbeat brings it back).
        cluster.room_beats = True
        cluster.cant_place, cluster.dry_run_fits = None, False
        await run.handle.signal(DeploymentWorkflow.nodes_changed)
        view = await run.until(DeploymentStatus.SERVING)
        assert view.keeper.unplaceable_in_a_row == 0
        await asyncio.wait_for(_until(lambda: cluster.room_watches_cancelled == 1), 20)
        history = await _quiet_history(run.handle)
        cancel = [e.event_type for e in history.events if e.event_type in (
            EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED,
            EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED)]
        assert cancel == [EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED,
                          EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED]
        assert cluster.room_watches == [1]
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "cant_place_room_watch")


async def test_room_that_appears_without_a_node_change_is_found_by_the_room_watch(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """No nodes_changed signal (the API was down as memory was freed): the room watch's next
    dry run finds the room, at most its cap (10 min, SCALE time) after it appeared, and
    the workflow places at once; the backstop (1 h) plays no part."""
    cluster.cant_place = "node a: 8.0 GiB free, needs 24.0 GiB"
    async with _run(time_skipping_env, cluster, tunables=SCALED) as run:
        await run.until(DeploymentStatus.CANT_PLACE)
        # Until the watch waits its longest: 30 + 60 + 120 + 240 + 480 s of dry runs.
        await asyncio.wait_for(_until(lambda: bool(cluster.room_checks)
                                      and cluster.room_checks[0] >= 5), 20)
        appeared = await time_skipping_env.get_current_time()
        cluster.cant_place = None
        view = await run.until(DeploymentStatus.SERVING)
        history = await run.handle.fetch_history()
        [_, placed] = _activities_of(history, "place_replica")
        assert 0 < _scaled_s(appeared, placed) <= 600 + 60  # the cap, and a minute of lag
        assert view.keeper.unplaceable_in_a_row == 0
        assert cluster.room_watches == [1] and cluster.room_watches_cancelled == 0
        assert not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                       for e in history.events)
        assert not any(e.event_type == EventType.EVENT_TYPE_TIMER_FIRED
                       for e in history.events)  # the backstop never fired
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)


async def test_a_dry_run_that_says_fits_where_placement_says_no_backs_off_and_never_spins(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The watch's dry run says the replica fits, the placement after it says no (a racing
    placement took the room, or the two disagree for good): each placement that finds no
    room adds one to the count, and the next watch starts from it, so the placements come
    30 s, 60 s, 120 s ... apart, up to 10 min, never sooner (SCALE time). At the cap that
    is 6 placements an hour; each costs what the first below costs."""
    cluster.cant_place = "node a: 8.0 GiB free, needs 24.0 GiB"
    cluster.dry_run_fits = True
    async with _run(time_skipping_env, cluster, tunables=SCALED) as run:
        await asyncio.wait_for(_until(lambda: len(cluster.placements) == 9), 30)
        view = await _until_view(run, lambda v: v.keeper.unplaceable_in_a_row == 9)
        assert view.status is DeploymentStatus.CANT_PLACE
        history = await run.handle.fetch_history()
        places = [_at(e) for e in _activities_of(history, "place_replica")]
        gaps = [(b - a).total_seconds() * SCALE for a, b in itertools.pairwise(places)]
        # Each gap is the watch's first wait plus one round of workflow tasks; a spin
        # would show gaps of milliseconds.
        waits = [30, 60, 120, 240, 480, 600, 600, 600]
        assert all(w <= gap < w + 120 for w, gap in zip(waits, gaps, strict=True)), gaps
        # (The 9th placement's answer has started a 9th watch, from 9.)
        assert cluster.room_watches[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
        assert cluster.room_checks[:8] == [1] * 8
        # What one round costs in history events: from the watch's answer to the next
        # watch scheduled.
        watches = _activities_of(history, "watch_for_room")
        round_events = [e for e in history.events
                        if watches[5].event_id < e.event_id <= watches[6].event_id]
        assert len(round_events) == EVENTS_PER_DISAGREEING_ROUND, [
            EventType.Name(e.event_type) for e in round_events]
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "room_watch_dry_run_disagrees")


#: What a watch that finds room costs when the placement after it does not: its result
#: (started, completed), a workflow task that cancels the backstop's timer and schedules
#: place_replica (3 + 1 + 1), place_replica (started, completed), a workflow task that
#: starts the backstop again and the next watch (3 + 1 + 1). 14 events; 6 an hour at the
#: cap, 84 events an hour: over the budget, for as long as a dry run and the placement
#: disagree.
EVENTS_PER_DISAGREEING_ROUND = 14


async def _until_view(run: Running, check: object) -> WorkflowStatus:
    assert callable(check)

    async def poll() -> WorkflowStatus:
        while True:
            view = await run.view()
            if check(view):
                return view
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), 20)


async def test_a_serving_deployment_adds_no_history_events_while_its_watch_heartbeats(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """0 history events an hour while serving: nothing in the workflow is timed, and the
    watch's heartbeats are not events.

    The time-skipping server cannot skip an hour here: it holds its clock from an
    activity's schedule until its result, and the watch is always in flight (env.sleep
    with the watch running advances the clock only as fast as the wall clock). So the
    hour is shown in its two parts: no timer is open, so only an activity's result, a
    signal or an update can add an event, none of which time brings; and over seconds in
    which heartbeats reach the server, no event is added."""
    tunables = _tunables(watch_heartbeat_timeout_s=2.0)  # one heartbeat sent per 1.6 s
    async with _run(time_skipping_env, cluster, tunables=tunables) as run:
        await run.until(DeploymentStatus.SERVING)
        await asyncio.wait_for(_until(lambda: bool(cluster.statuses) and
                                      cluster.statuses[-1].status is DeploymentStatus.SERVING),
                               20)
        before = await _quiet_history(run.handle)
        assert _open_timers(before) == set()

        async def last_heartbeat() -> datetime | None:
            pending = (await run.handle.describe()).raw_description.pending_activities
            assert [p.activity_type.name for p in pending] == ["watch_shard"]
            beat = pending[0].last_heartbeat_time
            return beat.ToDatetime(tzinfo=UTC) if beat.seconds else None

        first_beat = await last_heartbeat()
        await asyncio.sleep(5)
        later_beat = await last_heartbeat()
        assert later_beat is not None and later_beat != first_beat  # heartbeats arrived...
        after = await run.handle.fetch_history()
        assert len(after.events) == len(before.events)  # ...and added no event
        assert cluster.watches == ["d1-r1"]
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)


# -- moves: what sagas ask for -----------------------------------------------------------


async def _await_move(run: Running, move_id: str) -> MoveOutcome:
    while True:
        outcome: MoveOutcome = await run.handle.execute_update(
            UPDATE_AWAIT_MOVE, AwaitMoveRequest(move_id=MoveId(move_id), wait_s=5),
            result_type=MoveOutcome)
        if outcome.state is not MoveState.RUNNING:
            return outcome


async def test_replace_through_updates_drains_the_old_replica_before_it_stops(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    new = Generation(number=1, model_id=ModelId("m2"), engine_args={"ctx_size": 512})
    async with _run(time_skipping_env, cluster, replicas=2) as run:
        await run.until(DeploymentStatus.SERVING)
        request = MoveRequest(move_id=MoveId("restart/d1/1:replace-d1-r1"), kind=MoveKind.REPLACE,
                            replica_id=ReplicaId("d1-r1"), generation=new,
                            reason="restart/d1/1")
        first: MoveOutcome = await run.handle.execute_update(UPDATE_MOVE, request,
                                                           result_type=MoveOutcome)
        assert first.state is MoveState.RUNNING and first.surged == "d1-r3"
        # A retried update (the saga's activity retried) is answered again, not repeated.
        again: MoveOutcome = await run.handle.execute_update(UPDATE_MOVE, request,
                                                           result_type=MoveOutcome)
        assert again.surged == "d1-r3"
        done = await _await_move(run, request.move_id)
        assert done.state is MoveState.SUCCEEDED and done.retired == "d1-r1"
        assert cluster.placements == ["d1-r1", "d1-r2", "d1-r3"]
        # Out of routing and drained first, then stopped.
        assert cluster.stop_order == ["drain d1-r1", "stop d1-r1"]
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r1"]), 20)

        # The same replica again is refused with a reason, and nothing changes.
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await run.handle.execute_update(UPDATE_MOVE, MoveRequest(
                move_id=MoveId("x:1"), kind=MoveKind.RETIRE, replica_id=ReplicaId("d1-r1")))
        cause = refused.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == ERROR_MOVE_REFUSED
        assert cause.message == ("replica_id: d1-r1 is not a live replica of d1 "
                                 "(live: d1-r2, d1-r3)")

        await run.handle.execute_update(UPDATE_SET_GENERATION, SetGenerationRequest(
            move_id=MoveId("restart/d1/1:commit"), generation=new))
        view: DeploymentBrief = await run.handle.query(QUERY_BRIEF,
                                                       result_type=DeploymentBrief)
        assert view.generation == new
        assert [(r.replica_id, r.generation.number if r.generation else None)
                for r in view.replicas] == [("d1-r2", 0), ("d1-r3", 1)]
        await record_history(run.handle, "moves_replace_generation")


async def test_cancel_move_retires_the_surge_and_keeps_the_replica(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    cluster.start_gates["d1-r2"] = asyncio.Event()  # the new replica loads for ever
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.SERVING)
        await run.handle.execute_update(UPDATE_MOVE, MoveRequest(
            move_id=MoveId("s:1"), kind=MoveKind.REPLACE, replica_id=ReplicaId("d1-r1")))
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.started), 20)
        cancelled: MoveOutcome = await run.handle.execute_update(
            UPDATE_CANCEL_MOVE, CancelMoveRequest(move_id=MoveId("s:1")), result_type=MoveOutcome)
        assert cancelled.state is MoveState.CANCELLED
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r2"]), 20)
        # Not started, so not drained; d1-r1 serves on.
        assert cluster.stop_order == ["stop d1-r2"]
        view = await run.view()
        assert [(r.replica_id, r.phase.value) for r in view.keeper.replicas] == [
            ("d1-r1", "ready")]
        await record_history(run.handle, "moves_cancel")


async def test_a_deleted_deployment_leaves_deleted_as_its_status_not_a_live_one(
    local_temporal_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """A closed workflow must not match a live status in a search: its last act sets
    DeploymentStatus to "deleted" (PATCH_FINAL_STATUS)."""
    async with _run(local_temporal_env, cluster, search_attributes=True) as run:
        await run.until(DeploymentStatus.SERVING)
        await _until_search_attributes(run, status="serving", ready=1, desired=1,
                                       nodes=["n1"])
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 30)
        found = (await run.handle.describe()).typed_search_attributes
        assert found.get(STATUS_KEY) == "deleted"
        await record_history(run.handle, "final_status_deleted")


# -- the room watch against the real store ----------------------------------------------

GIB = 1 << 30


async def _watch_checks(handle: WorkflowHandle[Any, Any], env: WorkflowEnvironment) -> int:
    """The dry runs the running room watch has reported in its last heartbeat (0: none)."""
    pending = (await handle.describe()).raw_description.pending_activities
    payloads = [p.heartbeat_details.payloads for p in pending
                if p.activity_type.name == "watch_for_room"]
    if not payloads or not payloads[0]:
        return 0
    [checks] = await env.client.data_converter.decode(list(payloads[0]), [int])
    return int(checks)


async def test_memory_the_store_shows_without_a_node_change_gets_the_deployment_placed(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster, store: Store,
) -> None:
    """The room watch of the control worker (activities.store) against a real PostgreSQL:
    the node's memory is raised in the store by a heartbeat whose nodes_changed signal
    never went out (the API died after writing it). The watch's next dry run sees it, at
    most its cap (10 min, SCALE time) later, and the real place_replica claims it."""
    await store.nodes.register_node(AgentRegistration(
        node_id=NODE, name="n1", inventory=Inventory(
            memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB, cpu_count=16)))
    await store.catalog.create_model(CatalogModel(model_id=ModelId("m"), engine=EngineKind.SIM,
                                                  source="sim", memory_bytes=24 * GIB))
    await store.deployments.create_deployment(
        DeploymentId("d1"), DeploymentRequest(model_id=ModelId("m")),
        deployment_workflow_id(DeploymentId("d1")))
    settings = Settings(database_url="postgresql://unused", settling_window_s=0)
    # No Temporal client: release_replica signals nobody, as no API does here.
    acts = StoreActivities(store, settings)
    async with _workers(time_skipping_env, cluster, store=acts):
        run = await _start(time_skipping_env, cluster,
                           _input(tunables=WATCH_TIMINGS))
        handle = run.handle
        view = await run.until(DeploymentStatus.CANT_PLACE)
        assert "n1" in (view.keeper.placement_error or "")

        async def at_its_cap() -> None:  # 30 + 60 + 120 + 240 + 480 s of dry runs
            while await _watch_checks(handle, time_skipping_env) < 5:
                await asyncio.sleep(0.1)

        await asyncio.wait_for(at_its_cap(), 20)
        assert await store.deployments.list_replicas() == []  # the dry runs claimed nothing
        appeared = await time_skipping_env.get_current_time()
        changed = await store.nodes.heartbeat_node(
            NODE, Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                            cpu_count=16), settings.node_unreachable_after_s)
        assert changed  # the API would have signalled nodes_changed; nobody does here
        view = await run.until(DeploymentStatus.SERVING)
        history = await handle.fetch_history()
        [_, placed] = _activities_of(history, "place_replica")
        assert 0 < _scaled_s(appeared, placed) <= 600 + 60  # the cap, and a minute of lag
        [replica] = await store.deployments.list_replicas()
        assert replica.replica_id == "d1-r2" and replica.nodes == ["n1"]
        assert not any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                       for e in history.events)
        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 20)
