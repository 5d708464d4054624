"""DeploymentWorkflow on the time-skipping server, with every activity faked by name."""

from __future__ import annotations

import asyncio
import contextlib
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
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate, ScaleRequest
from modelkeeper.domain.control import (
    DeleteDeploymentInput,
    PlaceReplicaInput,
    PlaceReplicaResult,
    ReleaseReplicaInput,
)
from modelkeeper.domain.draining import DrainReplicaInput, DrainReplicaResult
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, OpId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec, KeeperConfig
from modelkeeper.domain.nodes import NodeSilentInput
from modelkeeper.domain.ops import (
    AwaitOpRequest,
    CancelOpRequest,
    DeploymentBrief,
    Generation,
    OpKind,
    OpOutcome,
    OpRequest,
    OpState,
    SetGenerationRequest,
)
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
from modelkeeper.names import (
    CONTROL_TASK_QUEUE,
    ERROR_OP_REFUSED,
    QUERY_BRIEF,
    UPDATE_AWAIT_OP,
    UPDATE_CANCEL_OP,
    UPDATE_OP,
    UPDATE_SET_GENERATION,
    node_task_queue,
)
from workflows.deployment import (
    DESIRED_KEY,
    NODES_KEY,
    READY_KEY,
    STATUS_KEY,
    DeploymentInput,
    DeploymentWorkflow,
    WorkflowStatus,
    WorkflowTimings,
    initial_state,
)

pytestmark = pytest.mark.timeout(60)

NODE = NodeId("n1")


@dataclass
class FakeCluster:
    """What the faked activities saw and how they answer."""

    start_failures: int = 0
    statuses: list[DeploymentStatusUpdate] = field(default_factory=list)
    replica_states: list[tuple[str, str]] = field(default_factory=list)
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
    stop_order: list[str] = field(default_factory=list)
    #: list_shards answers only once this status was written to the store. The store
    #: writes coalesce (each writes what is current when it starts), so a status that
    #: lasts only until a probe answers in milliseconds need never be written otherwise.
    probe_after_status: DeploymentStatus | None = None

    def _agent_answer(self, model: Any) -> Any:
        if self.agent_extra is None:
            return model
        return {**model.model_dump(mode="json"), **self.agent_extra}

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

        @activity.defn(name="record_replica_state")
        async def record_replica_state(update: ReplicaStateUpdate) -> None:
            if self.store_down:
                raise ApplicationError("connection refused")
            self.replica_states.append((update.replica_id, update.state.value))

        @activity.defn(name="release_replica")
        async def release_replica(req: ReleaseReplicaInput) -> None:
            self.released.append(req.replica_id)

        @activity.defn(name="record_deployment_status")
        async def record_deployment_status(update: DeploymentStatusUpdate) -> None:
            if self.store_down:
                raise ApplicationError("connection refused")
            self.statuses.append(update)

        @activity.defn(name="delete_deployment")
        async def delete_deployment(req: DeleteDeploymentInput) -> None:
            self.deleted.append(req.deployment_id)

        @activity.defn(name="record_event")
        async def record_event(event: NewEvent) -> Event:
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

        control = [place_replica, record_replica_state, release_replica,
                   record_deployment_status, delete_deployment, record_event, drain_replica]
        node = [start_shard, watch_shard, stop_shard, list_shards]
        return control, node


#: A query is answered in milliseconds; see Running.view for why it has a deadline.
QUERY_DEADLINE = timedelta(seconds=2)


@dataclass
class Running:
    env: WorkflowEnvironment
    cluster: FakeCluster
    handle: WorkflowHandle[DeploymentWorkflow, None]

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


@contextlib.asynccontextmanager
async def _run(env: WorkflowEnvironment, cluster: FakeCluster, replicas: int = 1,
               config: KeeperConfig | None = None, timings: WorkflowTimings | None = None,
               *, search_attributes: bool = False) -> AsyncIterator[Running]:
    control, node = cluster.activities()
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"),
                          replicas=replicas)
    state = initial_state(spec, config or KeeperConfig(backoff_jitter=0.0),
                          timings or WorkflowTimings(), search_attributes=search_attributes)
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=control), \
            Worker(env.client, task_queue=node_task_queue(NODE), activities=node):
        handle = await env.client.start_workflow(
            DeploymentWorkflow.run, DeploymentInput(state=state),
            id=f"deployment/{uuid.uuid4()}", task_queue=CONTROL_TASK_QUEUE)
        yield Running(env, cluster, handle)


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
    control, node = cluster.activities()
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"), replicas=1)
    state = initial_state(spec, KeeperConfig(backoff_jitter=0.0),
                          WorkflowTimings(continue_as_new_after_events=60),
                          search_attributes=False)
    async with Worker(time_skipping_env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=control), \
            Worker(time_skipping_env.client, task_queue=node_task_queue(NODE),
                   activities=node):
        handle = await time_skipping_env.client.start_workflow(
            DeploymentWorkflow.run, DeploymentInput(state=state),
            id=f"deployment/{uuid.uuid4()}", task_queue=CONTROL_TASK_QUEUE)
        run = Running(time_skipping_env, cluster, handle)
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


def _fresh_input() -> DeploymentInput:
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"), replicas=1)
    return DeploymentInput(state=initial_state(spec, KeeperConfig(backoff_jitter=0.0),
                                               WorkflowTimings(), search_attributes=False))


def test_state_is_whole_from_construction() -> None:
    """@workflow.init builds the state from the input: the status query answers from a
    workflow object no workflow task has run yet (no worker, no run, no event loop)."""
    request = _fresh_input()
    view = DeploymentWorkflow(request).status()
    assert view.keeper == request.state.keeper
    assert view.keeper.replicas == []


async def test_status_query_sent_before_the_first_workflow_task_is_answered(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """A query sent right after start, while no worker polls yet, is answered (not failed)
    once one does. The server holds a query until the first workflow task completes."""
    control, node = cluster.activities()
    handle = await time_skipping_env.client.start_workflow(
        DeploymentWorkflow.run, _fresh_input(), id=f"deployment/{uuid.uuid4()}",
        task_queue=CONTROL_TASK_QUEUE)
    query = asyncio.create_task(handle.query(DeploymentWorkflow.status))
    # Not a wait for anything: it lets the query go out before a worker exists. The test
    # passes either way; this only makes it test what it says more often.
    await asyncio.sleep(0.2)
    async with Worker(time_skipping_env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=control), \
            Worker(time_skipping_env.client, task_queue=node_task_queue(NODE),
                   activities=node):
        view = await asyncio.wait_for(query, 20)
        assert view.keeper.spec.deployment_id == "d1"
        assert view.status in {DeploymentStatus.PLACING, DeploymentStatus.STARTING,
                               DeploymentStatus.SERVING}
        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 20)


async def test_an_update_in_the_first_workflow_task_sees_the_whole_state(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """Update-with-start delivers the update in the first workflow task, whose handlers
    (the validator included) the SDK runs before run's first line: the validator reads the
    state, which only @workflow.init can have built by then."""
    control, node = cluster.activities()
    start = WithStartWorkflowOperation(
        DeploymentWorkflow.run, _fresh_input(), id=f"deployment/{uuid.uuid4()}",
        task_queue=CONTROL_TASK_QUEUE, id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
    async with Worker(time_skipping_env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=control), \
            Worker(time_skipping_env.client, task_queue=node_task_queue(NODE),
                   activities=node):
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
    timings = WorkflowTimings(place_schedule_to_close_s=1.0)
    async with _run(time_skipping_env, cluster, timings=timings) as run:
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
    control, node = cluster.activities()
    extra = {"added_later": [1, 2]}
    shard = ShardSpec(replica_id=ReplicaId("d1-r1"), model_id=ModelId("m"), node_id=NODE,
                      engine=EngineKind.SIM, source="sim", memory_bytes=1)
    status = DeploymentStatusUpdate(
        deployment_id=DeploymentId("d1"), status=DeploymentStatus.SERVING,
        placement_error=None, consecutive_failures=0, last_failure=None, desired_replicas=1)
    raw = _fresh_input().model_dump(mode="json")
    state = raw["state"]
    state["keeper"]["replicas"] = [{"replica_id": "d1-r1", "phase": "ready",
                                    "nodes": [NODE], "endpoint": "http://engine/d1-r1",
                                    **extra}]
    state["keeper"]["next_replica_seq"] = 2
    state["shards"] = {"d1-r1": [{**shard.model_dump(mode="json"), **extra}]}
    state["written_status"] = {**status.model_dump(mode="json"), **extra}
    for part in (raw, state, state["keeper"], state["keeper"]["spec"], state["config"],
                 state["timings"]):
        part.update(extra)
    cluster.crash["d1-r1"] = asyncio.Event()  # the engine the newer worker started
    async with Worker(time_skipping_env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=control), \
            Worker(time_skipping_env.client, task_queue=node_task_queue(NODE),
                   activities=node):
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
    timings = WorkflowTimings(watch_heartbeat_timeout_s=2.0)
    async with _run(time_skipping_env, cluster, timings=timings) as run:
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
    timings = WorkflowTimings(watch_heartbeat_timeout_s=2.0)
    config = KeeperConfig(backoff_jitter=0.0, lost_after_s=300.0)
    async with _run(time_skipping_env, cluster, config=config, timings=timings) as run:
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
    async with _run(time_skipping_env, cluster) as run:
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


async def test_a_deployment_that_cannot_be_placed_costs_at_most_30_history_events_an_hour(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    """The blind retry backs off from 30 s to 30 min (cant-place-backoff), so after the
    first hour a deployment nothing fits costs 2 retries an hour, 22 history events.

    Before the patch it retried every 30 s: measured the same way, 1,309 events in an
    hour (119 retries of 11 events). The patch turns the switch on in every new run, so the
    old rate is counted where the switch can be off, in the keeper's simulation (120 blind
    retries an hour: test_blind_retries_of_a_deployment_that_never_fits_an_hour_at_a_time).

    A node change still retries at once and keeps the backoff; the one that finds room
    places the replica."""
    cluster.cant_place = "node a: 8.0 GiB free, needs 24.0 GiB"
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.CANT_PLACE)
        # From when the first retry's timer is armed and the status write is in (the clock
        # runs on meanwhile: an activity in flight holds the time-skipping server to the
        # wall clock). The timer no longer waits for the write, so the write may end last.
        quiet = await _quiet_history(run.handle)
        assert len(_open_timers(quiet)) == 1
        start = _at(quiet.events[-1])
        hour = timedelta(hours=1)
        await time_skipping_env.sleep(2 * hour)
        history = await run.handle.fetch_history()
        first, second = (_within(history, start, start + hour),
                         _within(history, start + hour, start + 2 * hour))
        assert len(second) <= UNPLACEABLE_EVENTS_PER_HOUR
        # Counted, not assumed: two blind retries of 11 events each, nothing else.
        assert len(second) == 2 * EVENTS_PER_BLIND_RETRY
        places = [round((_at(e) - start).total_seconds()) for e in history.events
                  if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                  and e.activity_task_scheduled_event_attributes.activity_type.name
                  == "place_replica" and _at(e) > start]
        assert places == [30, 90, 210, 450, 930, 1890, 3690, 5490]
        assert len(first) == 6 * EVENTS_PER_BLIND_RETRY  # the ramp: 30 s to 16 min
        assert len(cluster.placements) == 1 + len(places)

        # Memory freed elsewhere: retried at once, still no room, and the backoff is kept:
        # the next blind retry is 30 min after this answer, not 30 s.
        await run.handle.signal(DeploymentWorkflow.nodes_changed)
        await asyncio.wait_for(_until(lambda: len(cluster.placements) == 10), 20)
        view = await _until_view(run, lambda v: v.keeper.placement_retry_at is not None and
                                 not any(r.phase == "placing" for r in v.keeper.replicas))
        assert view.keeper.unplaceable_in_a_row == 10
        assert view.keeper.placement_retry_at is not None
        now = await time_skipping_env.get_current_time()
        assert (view.keeper.placement_retry_at - now).total_seconds() >= 1790

        # Room: the node change places it, and the count starts over.
        cluster.cant_place = None
        await run.handle.signal(DeploymentWorkflow.nodes_changed)
        view = await run.until(DeploymentStatus.SERVING)
        assert view.keeper.unplaceable_in_a_row == 0
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 20)
        await record_history(run.handle, "cant_place_backoff")


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
    timings = WorkflowTimings(watch_heartbeat_timeout_s=2.0)  # one heartbeat sent per 1.6 s
    async with _run(time_skipping_env, cluster, timings=timings) as run:
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


# -- ops: what sagas ask for -----------------------------------------------------------


async def _await_op(run: Running, op_id: str) -> OpOutcome:
    while True:
        outcome: OpOutcome = await run.handle.execute_update(
            UPDATE_AWAIT_OP, AwaitOpRequest(op_id=OpId(op_id), wait_s=5),
            result_type=OpOutcome)
        if outcome.state is not OpState.RUNNING:
            return outcome


async def test_replace_through_updates_drains_the_old_replica_before_it_stops(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    new = Generation(number=1, model_id=ModelId("m2"), engine_args={"ctx_size": 512})
    async with _run(time_skipping_env, cluster, replicas=2) as run:
        await run.until(DeploymentStatus.SERVING)
        request = OpRequest(op_id=OpId("restart/d1/1:replace-d1-r1"), kind=OpKind.REPLACE,
                            replica_id=ReplicaId("d1-r1"), generation=new,
                            reason="restart/d1/1")
        first: OpOutcome = await run.handle.execute_update(UPDATE_OP, request,
                                                           result_type=OpOutcome)
        assert first.state is OpState.RUNNING and first.surged == "d1-r3"
        # A retried update (the saga's activity retried) is answered again, not repeated.
        again: OpOutcome = await run.handle.execute_update(UPDATE_OP, request,
                                                           result_type=OpOutcome)
        assert again.surged == "d1-r3"
        done = await _await_op(run, request.op_id)
        assert done.state is OpState.SUCCEEDED and done.retired == "d1-r1"
        assert cluster.placements == ["d1-r1", "d1-r2", "d1-r3"]
        # Out of routing and drained first, then stopped.
        assert cluster.stop_order == ["drain d1-r1", "stop d1-r1"]
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r1"]), 20)

        # The same replica again is refused with a reason, and nothing changes.
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await run.handle.execute_update(UPDATE_OP, OpRequest(
                op_id=OpId("x:1"), kind=OpKind.RETIRE, replica_id=ReplicaId("d1-r1")))
        cause = refused.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == ERROR_OP_REFUSED
        assert cause.message == ("replica_id: d1-r1 is not a live replica of d1 "
                                 "(live: d1-r2, d1-r3)")

        await run.handle.execute_update(UPDATE_SET_GENERATION, SetGenerationRequest(
            op_id=OpId("restart/d1/1:commit"), generation=new))
        view: DeploymentBrief = await run.handle.query(QUERY_BRIEF,
                                                       result_type=DeploymentBrief)
        assert view.generation == new
        assert [(r.replica_id, r.generation.number if r.generation else None)
                for r in view.replicas] == [("d1-r2", 0), ("d1-r3", 1)]
        await record_history(run.handle, "ops_replace_generation")


async def test_cancel_op_retires_the_surge_and_keeps_the_replica(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    cluster.start_gates["d1-r2"] = asyncio.Event()  # the new replica loads for ever
    async with _run(time_skipping_env, cluster) as run:
        await run.until(DeploymentStatus.SERVING)
        await run.handle.execute_update(UPDATE_OP, OpRequest(
            op_id=OpId("s:1"), kind=OpKind.REPLACE, replica_id=ReplicaId("d1-r1")))
        await asyncio.wait_for(_until(lambda: "d1-r2" in cluster.started), 20)
        cancelled: OpOutcome = await run.handle.execute_update(
            UPDATE_CANCEL_OP, CancelOpRequest(op_id=OpId("s:1")), result_type=OpOutcome)
        assert cancelled.state is OpState.CANCELLED
        await asyncio.wait_for(_until(lambda: cluster.released == ["d1-r2"]), 20)
        # Not started, so not drained; d1-r1 serves on.
        assert cluster.stop_order == ["stop d1-r2"]
        view = await run.view()
        assert [(r.replica_id, r.phase.value) for r in view.keeper.replicas] == [
            ("d1-r1", "ready")]
        await record_history(run.handle, "ops_cancel")


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
