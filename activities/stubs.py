"""Typed stubs of the activities the deployment workflow calls, for it to call by function.

The implementations live where the workflow may not import them: the store's, the
routing's and the usage watch's (activities/store.py, activities/routing.py,
activities/demand.py) import the store, and the node's
(activities/node.py) run in each agent's process. A stub carries what a call needs and
mypy checks, its registered name (modelkeeper.names), its input and its result, and no
body: it is never registered on a worker. tests/unit/test_activity_stubs.py checks each
stub against its implementation, name and signature alike.

Nothing here may import the store, the settings or anything with I/O: the workflow
sandbox imports this module.
"""

from __future__ import annotations

from typing import NoReturn

from temporalio import activity

from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate
from modelkeeper.domain.demand import DemandFound, WatchDemandInput
from modelkeeper.domain.draining import DrainReplicaInput, DrainReplicaResult
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.domain.log_reads import EngineLogChunk, EngineLogRequest
from modelkeeper.domain.shards import (
    ShardEndpoint,
    ShardExit,
    ShardReport,
    SleepShardInput,
    StartShardInput,
    StopShardInput,
    WakeShardInput,
    WatchShardInput,
)
from modelkeeper.domain.store_activities import (
    DeleteDeploymentInput,
    EvictionFound,
    FindEvictionInput,
    PlaceReplicaInput,
    PlaceReplicaResult,
    RegrowClaimsInput,
    RegrowClaimsResult,
    ReleaseReplicaInput,
    RoomFound,
    ShrinkClaimsInput,
    WatchForRoomInput,
)
from modelkeeper.names import (
    ACTIVITY_DELETE_DEPLOYMENT,
    ACTIVITY_DRAIN_REPLICA,
    ACTIVITY_FIND_EVICTION,
    ACTIVITY_LIST_SHARDS,
    ACTIVITY_PLACE_REPLICA,
    ACTIVITY_READ_ENGINE_LOG,
    ACTIVITY_RECORD_DEPLOYMENT_STATUS,
    ACTIVITY_RECORD_EVENT,
    ACTIVITY_RECORD_REPLICA_STATE,
    ACTIVITY_REGROW_CLAIMS,
    ACTIVITY_RELEASE_REPLICA,
    ACTIVITY_SHRINK_CLAIMS,
    ACTIVITY_SLEEP_SHARD,
    ACTIVITY_START_SHARD,
    ACTIVITY_STOP_SHARD,
    ACTIVITY_WAKE_SHARD,
    ACTIVITY_WATCH_DEMAND,
    ACTIVITY_WATCH_FOR_ROOM,
    ACTIVITY_WATCH_SHARD,
)


def _stub(name: str) -> NoReturn:
    raise NotImplementedError(f"{name} is a stub: the worker that polls its queue runs it")


# -- the control worker's (activities/store.py: StoreActivities) -----------------------------


@activity.defn(name=ACTIVITY_PLACE_REPLICA)
async def place_replica(request: PlaceReplicaInput) -> PlaceReplicaResult:
    _stub(ACTIVITY_PLACE_REPLICA)


@activity.defn(name=ACTIVITY_WATCH_FOR_ROOM)
async def watch_for_room(request: WatchForRoomInput) -> RoomFound:
    _stub(ACTIVITY_WATCH_FOR_ROOM)


@activity.defn(name=ACTIVITY_FIND_EVICTION)
async def find_eviction(request: FindEvictionInput) -> EvictionFound:
    _stub(ACTIVITY_FIND_EVICTION)


@activity.defn(name=ACTIVITY_RECORD_EVENT)
async def record_event(event: NewEvent) -> Event:
    _stub(ACTIVITY_RECORD_EVENT)


@activity.defn(name=ACTIVITY_RECORD_REPLICA_STATE)
async def record_replica_state(update: ReplicaStateUpdate) -> None:
    _stub(ACTIVITY_RECORD_REPLICA_STATE)


@activity.defn(name=ACTIVITY_RELEASE_REPLICA)
async def release_replica(request: ReleaseReplicaInput) -> None:
    _stub(ACTIVITY_RELEASE_REPLICA)


@activity.defn(name=ACTIVITY_RECORD_DEPLOYMENT_STATUS)
async def record_deployment_status(update: DeploymentStatusUpdate) -> None:
    _stub(ACTIVITY_RECORD_DEPLOYMENT_STATUS)


@activity.defn(name=ACTIVITY_DELETE_DEPLOYMENT)
async def delete_deployment(request: DeleteDeploymentInput) -> None:
    _stub(ACTIVITY_DELETE_DEPLOYMENT)


@activity.defn(name=ACTIVITY_SHRINK_CLAIMS)
async def shrink_claims(request: ShrinkClaimsInput) -> None:
    _stub(ACTIVITY_SHRINK_CLAIMS)


@activity.defn(name=ACTIVITY_REGROW_CLAIMS)
async def regrow_claims(request: RegrowClaimsInput) -> RegrowClaimsResult:
    _stub(ACTIVITY_REGROW_CLAIMS)


# -- the control worker's (activities/routing.py: RoutingActivities) -------------------------


@activity.defn(name=ACTIVITY_DRAIN_REPLICA)
async def drain_replica(request: DrainReplicaInput) -> DrainReplicaResult:
    _stub(ACTIVITY_DRAIN_REPLICA)


# -- the room-watch worker's (activities/demand.py: DemandActivities) ------------------------


@activity.defn(name=ACTIVITY_WATCH_DEMAND)
async def watch_demand(request: WatchDemandInput) -> DemandFound:
    _stub(ACTIVITY_WATCH_DEMAND)


# -- each agent's, on its node's queue (activities/node.py: NodeActivities) ------------------


@activity.defn(name=ACTIVITY_START_SHARD)
async def start_shard(request: StartShardInput) -> ShardEndpoint:
    _stub(ACTIVITY_START_SHARD)


@activity.defn(name=ACTIVITY_WATCH_SHARD)
async def watch_shard(request: WatchShardInput) -> ShardExit:
    _stub(ACTIVITY_WATCH_SHARD)


@activity.defn(name=ACTIVITY_STOP_SHARD)
async def stop_shard(request: StopShardInput) -> ShardExit:
    _stub(ACTIVITY_STOP_SHARD)


@activity.defn(name=ACTIVITY_SLEEP_SHARD)
async def sleep_shard(request: SleepShardInput) -> None:
    _stub(ACTIVITY_SLEEP_SHARD)


@activity.defn(name=ACTIVITY_WAKE_SHARD)
async def wake_shard(request: WakeShardInput) -> None:
    _stub(ACTIVITY_WAKE_SHARD)


@activity.defn(name=ACTIVITY_LIST_SHARDS)
async def list_shards() -> list[ShardReport]:
    _stub(ACTIVITY_LIST_SHARDS)


@activity.defn(name=ACTIVITY_READ_ENGINE_LOG)
async def read_engine_log(request: EngineLogRequest) -> EngineLogChunk:
    _stub(ACTIVITY_READ_ENGINE_LOG)
