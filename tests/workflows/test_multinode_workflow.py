"""A multi-node replica in DeploymentWorkflow on the time-skipping server, with two fake
nodes (each its own task queue, as each agent is): its start fails at its first failed
shard without waiting for rank 0, and an exit names each shard that ended, the first
first, before the replica is replaced whole (workflows/deployment_hops.py,
PATCH_MULTI_NODE)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate
from modelkeeper.domain.draining import DrainReplicaInput, DrainReplicaResult
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.keeper import DeploymentSpec
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
from modelkeeper.domain.store_activities import (
    EvictionFound,
    FindEvictionInput,
    PlaceReplicaInput,
    PlaceReplicaResult,
    ReleaseReplicaInput,
)
from modelkeeper.domain.tunables import Tunables
from modelkeeper.names import CONTROL_TASK_QUEUE, node_task_queue
from tests.workflows.test_deployment_workflow import record_history
from workflows.deployment import DeploymentInput, DeploymentWorkflow

pytestmark = pytest.mark.timeout(60)

NODES = [NodeId("n-a"), NodeId("n-b")]
#: A heartbeat sent as soon as it is recorded (not 0.8 x the timeout later): the cancel of
#: rank 0's start reaches it at once.
BEAT = timedelta(seconds=0.1)
LEADER = "10.0.0.1:20999"


@dataclass
class TwoNodes:
    """What the fakes saw, and how they answer."""

    #: Replicas whose rank 1 fails to start (rank 0 then waits for it until cancelled).
    fail_rank1: set[str] = field(default_factory=set)
    crash: dict[tuple[str, int], asyncio.Event] = field(default_factory=dict)
    started: list[tuple[str, int]] = field(default_factory=list)
    start_cancelled: list[tuple[str, int]] = field(default_factory=list)
    stopped: list[tuple[str, NodeId]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    events: list[NewEvent] = field(default_factory=list)
    states: list[tuple[str, str, int | None]] = field(default_factory=list)

    def control(self) -> list[Any]:
        @activity.defn(name="place_replica")
        async def place_replica(req: PlaceReplicaInput) -> PlaceReplicaResult:
            return PlaceReplicaResult(shards=[ShardSpec(
                replica_id=req.replica_id, model_id=req.spec.model_id, node_id=node,
                engine=EngineKind.SIM, source="sim", memory_bytes=1, rank=rank,
                world_size=2, leader_address=LEADER) for rank, node in enumerate(NODES)])

        @activity.defn(name="record_replica_state")
        async def record_replica_state(update: ReplicaStateUpdate) -> None:
            self.states.append((update.replica_id, update.state.value, update.shards_ready))

        @activity.defn(name="release_replica")
        async def release_replica(req: ReleaseReplicaInput) -> None:
            self.released.append(req.replica_id)

        @activity.defn(name="record_deployment_status")
        async def record_deployment_status(update: DeploymentStatusUpdate) -> None:
            pass

        @activity.defn(name="delete_deployment")
        async def delete_deployment(req: Any) -> None:
            pass

        @activity.defn(name="record_event")
        async def record_event(event: NewEvent) -> Event:
            self.events.append(event)
            return Event(**event.model_dump(), event_id=len(self.events),
                         at=activity.info().started_time)

        @activity.defn(name="drain_replica")
        async def drain_replica(req: DrainReplicaInput) -> DrainReplicaResult:
            return DrainReplicaResult(waited_s=0.0, in_flight_left=0, timed_out=False)

        @activity.defn(name="find_eviction")
        async def find_eviction(req: FindEvictionInput) -> EvictionFound:
            return EvictionFound(reason="nothing to evict")

        return [place_replica, record_replica_state, release_replica,
                record_deployment_status, delete_deployment, record_event, drain_replica,
                find_eviction]

    def node(self, node_id: NodeId) -> list[Any]:
        rank = NODES.index(node_id)

        @activity.defn(name="start_shard")
        async def start_shard(req: StartShardInput) -> ShardEndpoint:
            replica = req.spec.replica_id
            assert req.spec.leader_address == LEADER and req.spec.node_id == node_id
            self.started.append((replica, rank))
            if replica in self.fail_rank1:
                if rank == 1:
                    ended = ShardExit(replica_id=replica, kind=ExitKind.ERROR, exit_code=1,
                                      detail="exited with code 1",
                                      log_tail=["loading", "NCCL error: unhandled system error"])
                    raise ApplicationError("engine exited with code 1", ended,
                                           type="ShardStartFailed", non_retryable=True)
                try:  # rank 0 waits for a rank that will never join
                    while True:
                        activity.heartbeat()
                        await asyncio.sleep(0.2)
                except asyncio.CancelledError:
                    self.start_cancelled.append((replica, rank))
                    raise
            if rank == 0:
                # Rank 0 serves once rank 1 has joined: by then the workflow has written
                # that one shard of two is ready.
                while (replica, "starting", 1) not in self.states:
                    activity.heartbeat()
                    await asyncio.sleep(0.05)
            self.crash[(replica, rank)] = asyncio.Event()
            return ShardEndpoint(replica_id=replica, node_id=node_id, rank=rank,
                                 url=f"http://engine/{replica}" if rank == 0 else None,
                                 port=20000 + rank, pid=1)

        @activity.defn(name="watch_shard")
        async def watch_shard(req: WatchShardInput) -> ShardExit:
            crash = self.crash[(req.replica_id, rank)]
            while not crash.is_set():
                activity.heartbeat()
                await asyncio.sleep(0.1)
            if rank == 1:
                # Rank 1 dies first; rank 0 follows when its process group breaks.
                self.crash[(req.replica_id, 0)].set()
                return ShardExit(replica_id=req.replica_id, kind=ExitKind.SIGNALLED,
                                 signal=9, detail="killed by SIGKILL", log_tail=["serving"])
            await asyncio.sleep(0.3)
            return ShardExit(replica_id=req.replica_id, kind=ExitKind.ERROR, exit_code=1,
                             detail="exited with code 1",
                             log_tail=["rank 1 (10.0.0.2) left the rendezvous; exiting"])

        @activity.defn(name="stop_shard")
        async def stop_shard(req: StopShardInput) -> ShardExit:
            self.stopped.append((req.replica_id, node_id))
            return ShardExit(replica_id=req.replica_id, kind=ExitKind.STOPPED)

        @activity.defn(name="list_shards")
        async def list_shards() -> list[ShardReport]:
            return []

        return [start_shard, watch_shard, stop_shard, list_shards]


async def _until(check: Any, timeout: float = 20) -> None:
    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout)


async def test_a_multi_node_replica_fails_at_its_first_failed_shard_and_names_each_exit(
        time_skipping_env: WorkflowEnvironment) -> None:
    env, cluster = time_skipping_env, TwoNodes(fail_rank1={"d1-r1"})
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"),
                          replicas=1)
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=cluster.control()), \
            Worker(env.client, task_queue=node_task_queue(NODES[0]),
                   activities=cluster.node(NODES[0]), max_heartbeat_throttle_interval=BEAT), \
            Worker(env.client, task_queue=node_task_queue(NODES[1]),
                   activities=cluster.node(NODES[1]), max_heartbeat_throttle_interval=BEAT):
        handle = await env.client.start_workflow(
            DeploymentWorkflow.run,
            DeploymentInput(spec=spec, tunables=Tunables(backoff_jitter=0.0),
                            search_attributes=False),
            id=f"deployment/{uuid.uuid4()}", task_queue=CONTROL_TASK_QUEUE)

        # Rank 1 fails: the start fails at once, rank 0's start is cancelled, not waited
        # out for its start timeout, and the failure names the shard and its last line.
        await _until(lambda: ("d1-r1", 0) in cluster.start_cancelled)
        failed = next(e for e in cluster.events if e.kind == "replica.start_failed")
        assert failed.message == ("loading, 0/2 shards ready; shard 1 on node n-b: engine "
                                  "exited with code 1: NCCL error: unhandled system error")

        # The next replica (after the backoff, skipped) serves from rank 0's endpoint.
        async def serving() -> None:
            while True:
                view = await handle.query(DeploymentWorkflow.status)
                if view.status is DeploymentStatus.SERVING:
                    assert [r.endpoint for r in view.keeper.replicas] == ["http://engine/d1-r2"]
                    return
                await env.sleep(5)

        await asyncio.wait_for(serving(), 30)
        # Its progress was shown while rank 0 loaded: "1 of its 2 shards ready".
        assert ("d1-r2", "starting", 1) in cluster.states

        # Rank 1 is killed; rank 0 exits when the group breaks: the exit names both, the
        # cause first, and the replica is replaced whole.
        cluster.crash[("d1-r2", 1)].set()
        await _until(lambda: ("d1-r3", 0) in cluster.crash and ("d1-r3", 1) in cluster.crash)
        exited = next(e for e in cluster.events if e.kind == "replica.exited")
        assert exited.message == (
            "shard 1 on node n-b: signalled: killed by SIGKILL: serving; shard 0 on node n-a: "
            "error: exited with code 1: rank 1 (10.0.0.2) left the rendezvous; exiting")
        assert exited.data["signal"] == 9
        await _until(lambda: "d1-r2" in cluster.released)
        assert {("d1-r2", NODES[0]), ("d1-r2", NODES[1])} <= set(cluster.stopped)
        view = await handle.query(DeploymentWorkflow.status)
        assert [r.replica_id for r in view.keeper.replicas] == ["d1-r3"]

        await handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(handle.result(), 20)
        await record_history(handle, "multi_node_start_fail_exit_replace")
