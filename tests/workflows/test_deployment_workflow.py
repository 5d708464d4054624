"""DeploymentWorkflow on the time-skipping server, with every activity faked by name."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import (
    WithStartWorkflowOperation,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
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
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.keeper import DeploymentSpec, KeeperConfig
from modelkeeper.domain.shards import (
    EngineKind,
    ExitKind,
    ShardEndpoint,
    ShardExit,
    ShardReport,
    ShardSpec,
    StartShardInput,
    StopShardInput,
    WatchShardInput,
)
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.names import CONTROL_TASK_QUEUE, node_task_queue
from workflows.deployment import (
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

    def activities(self) -> tuple[list[object], list[object]]:
        @activity.defn(name="place_replica")
        async def place_replica(req: PlaceReplicaInput) -> PlaceReplicaResult:
            self.placements.append(req.replica_id)
            if self.cant_place is not None:
                return PlaceReplicaResult(cant_place=self.cant_place)
            return PlaceReplicaResult(shards=[ShardSpec(
                replica_id=req.replica_id, model_id=req.spec.model_id, node_id=NODE,
                engine=EngineKind.SIM, source="sim", memory_bytes=1)])

        @activity.defn(name="record_replica_state")
        async def record_replica_state(update: ReplicaStateUpdate) -> None:
            self.replica_states.append((update.replica_id, update.state.value))

        @activity.defn(name="release_replica")
        async def release_replica(req: ReleaseReplicaInput) -> None:
            self.released.append(req.replica_id)

        @activity.defn(name="record_deployment_status")
        async def record_deployment_status(update: DeploymentStatusUpdate) -> None:
            self.statuses.append(update)

        @activity.defn(name="delete_deployment")
        async def delete_deployment(req: DeleteDeploymentInput) -> None:
            self.deleted.append(req.deployment_id)

        @activity.defn(name="record_event")
        async def record_event(event: NewEvent) -> Event:
            raise AssertionError("not used")

        @activity.defn(name="start_shard")
        async def start_shard(req: StartShardInput) -> ShardEndpoint:
            self.started.append(req.spec.replica_id)
            if len(self.started) <= self.start_failures:
                raise ApplicationError("engine exited with code 1", type="ShardStartFailed",
                                       non_retryable=True)
            self.crash[req.spec.replica_id] = asyncio.Event()
            return ShardEndpoint(replica_id=req.spec.replica_id, node_id=NODE, rank=0,
                                 url=f"http://engine/{req.spec.replica_id}", port=1, pid=1)

        @activity.defn(name="watch_shard")
        async def watch_shard(req: WatchShardInput) -> ShardExit:
            crash = self.crash[req.replica_id]
            while not crash.is_set():
                activity.heartbeat()
                try:
                    await asyncio.wait_for(crash.wait(), 0.2)
                except TimeoutError:
                    continue
            return ShardExit(replica_id=req.replica_id, kind=ExitKind.SIGNALLED,
                             signal=9, detail="killed by SIGKILL")

        @activity.defn(name="stop_shard")
        async def stop_shard(req: StopShardInput) -> ShardExit:
            self.stopped.append(req.replica_id)
            return ShardExit(replica_id=req.replica_id, kind=ExitKind.STOPPED)

        @activity.defn(name="list_shards")
        async def list_shards() -> list[ShardReport]:
            return []

        control = [place_replica, record_replica_state, release_replica,
                   record_deployment_status, delete_deployment, record_event]
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
                if err.status is not RPCStatusCode.DEADLINE_EXCEEDED:
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


async def _run(env: WorkflowEnvironment, cluster: FakeCluster, replicas: int = 1,
               config: KeeperConfig | None = None) -> AsyncIterator[Running]:
    control, node = cluster.activities()
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"),
                          replicas=replicas)
    state = initial_state(spec, config or KeeperConfig(backoff_jitter=0.0),
                          WorkflowTimings(), search_attributes=False)
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
    async for run in _run(time_skipping_env, cluster):
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
    async for run in _run(time_skipping_env, cluster):
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
    async for run in _run(time_skipping_env, cluster):
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


async def test_scale_is_an_update_validated_against_deletion(
    time_skipping_env: WorkflowEnvironment, cluster: FakeCluster,
) -> None:
    async for run in _run(time_skipping_env, cluster):
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
        assert (await latest.describe()).run_id != first_run  # it continued as new
        # The carried state goes on where it left off: replica numbers keep counting.
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r5"]
        assert cluster.stopped == ["d1-r1", "d1-r2", "d1-r3", "d1-r4"]
        await latest.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(latest.result(), 20)
        assert cluster.deleted == ["d1"]


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
