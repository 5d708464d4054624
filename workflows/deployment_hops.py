"""The deployment workflow's hops: each activity it calls, typed (activities.stubs), with
its timeouts and retry policy named once beside the reason for its value.

Called from :class:`workflows.deployment.DeploymentWorkflow` only, inside its workflow
code: everything here is deterministic (commands, timers, no I/O). The order of the
commands each function issues is part of replay: change it only behind
``workflow.patched`` (docs/keeper.md, "Patches and replay").
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any, assert_never

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from activities import stubs
    from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate
    from modelkeeper.domain.demand import DemandFound, DemandView, Pressure, WatchDemandInput
    from modelkeeper.domain.draining import DrainReplicaInput
    from modelkeeper.domain.engine_logs import last_line
    from modelkeeper.domain.events import NewEvent
    from modelkeeper.domain.ids import DeploymentId, ReplicaId
    from modelkeeper.domain.keeper import (
        DeploymentSpec,
        Exited,
        KeeperConfig,
        Replica,
        Silent,
        Started,
        StartFailed,
        WakeFailed,
        Woke,
    )
    from modelkeeper.domain.shards import (
        ExitKind,
        ShardEndpoint,
        ShardExit,
        ShardSpec,
        SleepShardInput,
        StartShardInput,
        StopShardInput,
        WakeShardInput,
        WatchShardInput,
    )
    from modelkeeper.domain.status import ReplicaState
    from modelkeeper.domain.store_activities import (
        DeleteDeploymentInput,
        EvictionFound,
        FindEvictionInput,
        PlaceReplicaInput,
        PlaceReplicaResult,
        RegrowClaimsInput,
        ReleaseReplicaInput,
        RoomFound,
        ShrinkClaimsInput,
        WatchForRoomInput,
    )
    from modelkeeper.domain.tunables import Tunables
    from modelkeeper.names import (
        CONTROL_TASK_QUEUE,
        ERROR_SHARD_NOT_HERE,
        ERROR_UNKNOWN_MODEL,
        PATCH_MULTI_NODE,
        ROOM_WATCH_TASK_QUEUE,
        node_task_queue,
    )

# Timeouts and retry policies, each named once beside the reason for its value. Those a
# deployment may set (from settings, or a test) are the fields of Tunables
# (modelkeeper.domain.tunables).

#: Store activities (place_replica included) are one short transaction each: 30 s covers a
#: slow database without hiding a dead one, which STORE_RETRY (or PLACE_RETRY) waits out.
STORE_TIMEOUT = timedelta(seconds=30)
#: Store activities retry quickly and for a long time: a database restart must delay the
#: keeper, not fail it.
STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                          maximum_interval=timedelta(seconds=10))
#: place_replica retries every second, flat, for tunables.place_schedule_to_close_s: a
#: settling control plane names its own next retry (ERROR_SETTLING) and a database blip is
#: short. A model missing from the catalog stays missing, so that error is not retried.
PLACE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=1.0,
                          non_retryable_error_types=[ERROR_UNKNOWN_MODEL])
#: Node activities are not retried by Temporal: the keeper decides what a failure means.
ONCE = RetryPolicy(maximum_attempts=1)
#: ... except stop_shard, tried twice: a stop is harmless to repeat (the agent answers for
#: a shard it no longer runs) and one more try rides out a lost answer. Past that, the
#: agent's orphan reaper stops an engine nobody watches (see _stop).
STOP_RETRY = RetryPolicy(maximum_attempts=2)
#: start_shard heartbeats through fetch, launch and load (every 0.25 s while it waits for
#: the engine to answer); 10 s of silence means the node or its agent is gone.
START_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
#: start_shard and stop_shard each end by a deadline their agent keeps (the spec's start
#: timeout; the stop's grace period, then SIGKILL). Temporal's start-to-close is that
#: deadline plus this slack, so the agent's own answer (a start timeout with the engine's
#: log, an exit after the kill) arrives before a bare Temporal timeout would.
AGENT_DEADLINE_SLACK = timedelta(seconds=30)
#: ... and a start may first wait at its node's start-up gate (agent/startup_gate.py) for
#: up to half its start timeout, which does not count against that timeout: the deadline
#: is the start timeout times this, plus the slack. (Timeouts are not part of replay: a
#: history recorded with the old deadline replays.)
START_QUEUE_ALLOWANCE = 1.5
#: A watch lasts as long as its engine runs, for months: its heartbeat timeout, not its
#: start-to-close, notices a dead node. Ten years stands for "unbounded".
WATCH_LIFETIME = timedelta(days=3650)
#: watch_for_room runs as long as the deployment cannot be placed, for months maybe: its
#: heartbeat timeout notices a dead worker, and the workflow cancels it when the wait ends.
ROOM_WATCH_LIFETIME = WATCH_LIFETIME
#: ... retried for ever, like a store write: a database outage or a lost worker must not
#: end the watch (a retry goes on with its schedule; retries add no history events). A
#: model gone from the catalog is not retried (as place_replica): the workflow then
#: places at once, and the placement's failure says why.
ROOM_WATCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                               maximum_interval=timedelta(seconds=60),
                               non_retryable_error_types=[ERROR_UNKNOWN_MODEL])
#: drain_replica waits up to the grace period for in-flight requests; it heartbeats each
#: second, so 10 s of silence means the control worker died (another picks it up, and the
#: retry goes on with the same wait). Its start-to-close is the grace plus this slack.
DRAIN_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
DRAIN_SLACK = timedelta(seconds=30)
#: A drain is a courtesy to in-flight requests: tried three times, then the stop goes on
#: (a database outage must not keep a retired replica running).
DRAIN_RETRY = RetryPolicy(maximum_attempts=3)
#: An engine's exit or failed start keeps this many of its last log lines in its audit
#: event (GET /events?deployment_id=...): what an agent sends (ShardExit.log_tail), and
#: a bound should one ever send more, since the event is an activity input in history.
EVENT_LOG_LINES = 200



#: What the background writer hands the store, one at a time.
StoreWrite = NewEvent | ReplicaStateUpdate | DeploymentStatusUpdate


# -- the control queue: placement, the store, routing ------------------------------------------


async def place(spec: DeploymentSpec, replica_id: ReplicaId, replica: Replica | None,
                tunables: Tunables) -> PlaceReplicaResult:
    """Place ``replica_id`` (claims and its row); raises ActivityError when it failed."""
    return await workflow.execute_activity(
        stubs.place_replica,
        PlaceReplicaInput(spec=spec, replica_id=replica_id,
                          start_timeout_s=tunables.start_timeout_s,
                          avoid_nodes=replica.avoid_nodes if replica else [],
                          generation=replica.generation if replica else None),
        task_queue=CONTROL_TASK_QUEUE,
        start_to_close_timeout=STORE_TIMEOUT,
        schedule_to_close_timeout=timedelta(seconds=tunables.place_schedule_to_close_s),
        retry_policy=PLACE_RETRY)


async def release_crashed_placement(replica_id: ReplicaId, exc: ActivityError) -> None:
    """Release whatever a failed placement may have claimed for ``replica_id``.

    An attempt can commit its claims and still fail as far as the workflow knows (its
    answer lost, or the schedule-to-close timeout firing while it ran); the keeper
    forgets the replica id on PlacementCrashed, so nothing else would release them.
    release_replica is idempotent: it deletes the row and claims if there are any.
    After a timeout the last attempt may still be inside its transaction, for up to
    its start-to-close (STORE_TIMEOUT): the release waits that long first, so it comes
    after that commit, not before. Meanwhile the replica still counts as placing, so
    no other placement of this deployment starts.
    """
    if isinstance(exc.cause, TimeoutError):
        await workflow.sleep(STORE_TIMEOUT)
    await release(replica_id)


async def release(replica_id: ReplicaId) -> None:
    """Delete the replica's row and claims, if any (idempotent)."""
    await workflow.execute_activity(
        stubs.release_replica, ReleaseReplicaInput(replica_id=replica_id),
        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
        retry_policy=STORE_RETRY)


async def delete_deployment(deployment_id: DeploymentId) -> None:
    """Delete the deployment's row (its replicas are released already)."""
    await workflow.execute_activity(
        stubs.delete_deployment, DeleteDeploymentInput(deployment_id=deployment_id),
        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
        retry_policy=STORE_RETRY)


async def write(item: StoreWrite) -> None:
    """Carry out one of the background writer's writes."""
    match item:
        case NewEvent():
            await workflow.execute_activity(
                stubs.record_event, item, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
        case ReplicaStateUpdate():
            await workflow.execute_activity(
                stubs.record_replica_state, item, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
        case DeploymentStatusUpdate():
            await workflow.execute_activity(
                stubs.record_deployment_status, item, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
        case _:
            assert_never(item)


async def watch_for_room(spec: DeploymentSpec, unplaceable: int, *, config: KeeperConfig,
                         tunables: Tunables) -> RoomFound:
    """Until a dry run of the placement finds room (raises ActivityError if it fails for
    good: the model left the catalog)."""
    return await workflow.execute_activity(
        stubs.watch_for_room,
        WatchForRoomInput(spec=spec, generation=spec.generation, unplaceable=unplaceable,
                          first_wait_s=config.cant_place_retry_s,
                          max_wait_s=config.room_watch_max_s),
        task_queue=ROOM_WATCH_TASK_QUEUE,
        start_to_close_timeout=ROOM_WATCH_LIFETIME,
        heartbeat_timeout=timedelta(seconds=tunables.room_watch_heartbeat_timeout_s),
        retry_policy=ROOM_WATCH_RETRY)


async def drain(replica_id: ReplicaId, tunables: Tunables, *,
                grace_s: float | None = None) -> None:
    """Out of routing, and its in-flight requests finish (bounded by the grace period,
    ``grace_s`` or the tunables' ``drain_grace_s``); a drain that fails for good does not
    hold up the stop that follows."""
    grace = tunables.drain_grace_s if grace_s is None else grace_s
    with contextlib.suppress(ActivityError):
        await workflow.execute_activity(
            stubs.drain_replica,
            DrainReplicaInput(replica_id=replica_id, grace_s=grace),
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=grace) + DRAIN_SLACK,
            heartbeat_timeout=DRAIN_HEARTBEAT_TIMEOUT, retry_policy=DRAIN_RETRY)


# -- each node's queue: the agent ---------------------------------------------------------------


def start_shards(specs: list[ShardSpec],
                 tunables: Tunables) -> list[asyncio.Task[ShardEndpoint]]:
    """Start every shard of a replica at once (rank 0 is the endpoint). Workers before
    rank 0 would matter for engines whose ranks rendezvous."""
    return [asyncio.create_task(workflow.execute_activity(
        stubs.start_shard, StartShardInput(spec=spec), task_queue=node_task_queue(spec.node_id),
        schedule_to_start_timeout=timedelta(seconds=tunables.node_schedule_to_start_s),
        start_to_close_timeout=timedelta(
            seconds=spec.start_timeout_s * START_QUEUE_ALLOWANCE) + AGENT_DEADLINE_SLACK,
        heartbeat_timeout=START_HEARTBEAT_TIMEOUT, retry_policy=ONCE)) for spec in specs]


def watch_shards(replica_id: ReplicaId, specs: list[ShardSpec],
                 tunables: Tunables) -> list[asyncio.Task[ShardExit]]:
    """Watch every shard of a replica, each on its node, until its engine exits."""
    return [asyncio.create_task(workflow.execute_activity(
        stubs.watch_shard, WatchShardInput(replica_id=replica_id),
        task_queue=node_task_queue(spec.node_id),
        schedule_to_start_timeout=timedelta(seconds=tunables.node_schedule_to_start_s),
        start_to_close_timeout=WATCH_LIFETIME,
        heartbeat_timeout=timedelta(seconds=tunables.watch_heartbeat_timeout_s),
        retry_policy=ONCE)) for spec in specs]


async def runs(replica_id: ReplicaId, specs: list[ShardSpec], tunables: Tunables) -> bool | None:
    """Whether every node of the replica still runs its shard (a probe): None when one
    does not answer."""
    timeout = timedelta(seconds=tunables.probe_timeout_s)
    for spec in specs:
        try:
            reports = await workflow.execute_activity(
                stubs.list_shards, task_queue=node_task_queue(spec.node_id),
                schedule_to_start_timeout=timeout, start_to_close_timeout=timeout,
                retry_policy=ONCE)
        except ActivityError:
            return None
        if not any(r.replica_id == replica_id for r in reports):
            return False
    return True


async def stop_shards(replica_id: ReplicaId, specs: list[ShardSpec], tunables: Tunables) -> None:
    """Stop every shard of a replica. A node that is gone or silent cannot answer: its
    agent's orphan reaper stops the engine once nobody watches it."""
    stops = [asyncio.create_task(workflow.execute_activity(
        stubs.stop_shard,
        StopShardInput(replica_id=replica_id, grace_s=tunables.stop_grace_s),
        task_queue=node_task_queue(spec.node_id),
        schedule_to_start_timeout=timedelta(seconds=tunables.node_schedule_to_start_s),
        start_to_close_timeout=timedelta(seconds=tunables.stop_grace_s) + AGENT_DEADLINE_SLACK,
        retry_policy=STOP_RETRY))
        for spec in specs]
    for task in stops:
        with contextlib.suppress(ActivityError):
            await task


#: A multi-node replica's progress while it starts is shown, not needed: one retry, and a
#: store that does not answer costs the progress alone.
PROGRESS_RETRY = RetryPolicy(maximum_attempts=2)
#: How long a multi-node replica's watch waits, once one shard has ended, for the others
#: to say how they ended: a rank that dies takes the others down within a second or two
#: (the engines' process group breaks), and the status then names the first cause and what
#: followed, instead of whichever report arrived first.
SHARD_EXITS_GRACE = timedelta(seconds=3)


#: How a shard ends when something ended it from outside (a signal, the OOM killer, its
#: link to rank 0 cut, its process gone): the cause, when other ranks exited with errors.
KILLED_KINDS = frozenset({ExitKind.SIGNALLED, ExitKind.OOM_KILLED, ExitKind.LINK_LOST,
                          ExitKind.VANISHED})


def shard_name(spec: ShardSpec) -> str:
    """"shard 1 on node n-…", for a multi-node replica's errors."""
    return f"shard {spec.rank} on node {spec.node_id}"


def last_log_line(ended: ShardExit | None) -> str:
    """The engine's last log line, ": <line>", or nothing."""
    lines = [] if ended is None else [line for line in ended.log_tail if line.strip()]
    if not lines or ended is None or f"{last_line(lines)!r}" in ended.detail:
        # The agent named the last line in the detail already (start_failure_detail).
        return ""
    return f": {lines[-1].strip()}"


async def start(replica_id: ReplicaId, deployment_id: DeploymentId, specs: list[ShardSpec],
                tunables: Tunables) -> tuple[Started | StartFailed, NewEvent | None]:
    """Start the replica's shards: Started with rank 0's endpoint, or StartFailed with the
    audit event that keeps the engine's last log lines.

    Every rank starts at once: vLLM's and SGLang's ranks rendezvous at rank 0 and wait
    for each other (docs/engines.md). A multi-node replica fails at its first failed
    shard, named with how many were ready: rank 0 would otherwise wait for a rank that is
    gone until its start timeout."""
    tasks = start_shards(specs, tunables)
    if len(specs) > 1 and workflow.patched(PATCH_MULTI_NODE):
        return await _start_shards_together(replica_id, deployment_id, specs, tasks)
    try:
        endpoints: list[ShardEndpoint] = []
        for task in tasks:
            endpoints.append(await task)
    except ActivityError as exc:
        cancel_all(tasks)
        error = describe(exc)
        return StartFailed(replica_id=replica_id, error=error), engine_log_event(
            "replica.start_failed", deployment_id, replica_id, message=error,
            ended=start_exit(exc))
    except asyncio.CancelledError:
        cancel_all(tasks)
        raise
    rank0 = next(e for e in endpoints if e.rank == 0)
    return Started(replica_id=replica_id, endpoint=rank0.url or ""), None


async def _start_shards_together(
        replica_id: ReplicaId, deployment_id: DeploymentId, specs: list[ShardSpec],
        tasks: list[asyncio.Task[ShardEndpoint]]) -> tuple[Started | StartFailed, NewEvent | None]:
    """:func:`start` for a replica of several shards: each shard that becomes ready while
    others load is written to the replica's row (``shards_ready``), so its status reads
    "loading, 1/2 shards ready" (best effort: a store outage costs the progress, not the
    start)."""
    try:
        while not all(t.done() for t in tasks):
            done, _ = await workflow.wait([t for t in tasks if not t.done()],
                                          return_when=asyncio.FIRST_COMPLETED)
            if any(t.exception() is not None for t in done):
                break
            ready = sum(1 for t in tasks if t.done())
            if ready < len(tasks):
                with contextlib.suppress(ActivityError):
                    await workflow.execute_activity(
                        stubs.record_replica_state, ReplicaStateUpdate(
                            replica_id=replica_id, state=ReplicaState.STARTING,
                            shards_ready=ready),
                        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
                        retry_policy=PROGRESS_RETRY)
    except asyncio.CancelledError:
        cancel_all(tasks)
        raise
    failed = next((i for i, t in enumerate(tasks) if t.done() and t.exception() is not None),
                  None)
    if failed is None:
        rank0 = next(t.result() for t in tasks if t.result().rank == 0)
        return Started(replica_id=replica_id, endpoint=rank0.url or ""), None
    ready = sum(1 for t in tasks if t.done() and t.exception() is None)
    cancel_all(tasks)
    exc = tasks[failed].exception()
    assert isinstance(exc, ActivityError)  # start_shard fails only as an activity does
    ended = start_exit(exc)
    error = (f"loading, {ready}/{len(specs)} shards ready; {shard_name(specs[failed])}: "
             f"{describe(exc)}{last_log_line(ended)}")
    return StartFailed(replica_id=replica_id, error=error), engine_log_event(
        "replica.start_failed", deployment_id, replica_id, message=error, ended=ended)


async def watch(replica_id: ReplicaId, deployment_id: DeploymentId, specs: list[ShardSpec],
                tunables: Tunables) -> tuple[Exited | Silent, NewEvent | None] | None:
    """Watch the replica's shards until the first ends: Exited (with its audit event), or
    Silent when its watch failed; None for a replica with no shards."""
    tasks = watch_shards(replica_id, specs, tunables)
    if not tasks:
        return None
    try:
        done, pending = await workflow.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cancel_all(tasks)
        raise
    if len(specs) > 1 and workflow.patched(PATCH_MULTI_NODE):
        return await _watch_shards_together(replica_id, deployment_id, specs, tasks, done)
    cancel_all(list(pending))
    try:
        ended = next(iter(done)).result()
    except ActivityError:
        # A missed heartbeat, a queue nobody polls, an agent shutting down: the node went
        # quiet. Not lost yet: the keeper probes before giving up on it.
        return Silent(replica_id=replica_id), None
    detail = f"{ended.kind.value}: {ended.detail}"
    return Exited(replica_id=replica_id, detail=detail,
                  exit_kind=ended.kind), engine_log_event(
        "replica.exited", deployment_id, replica_id, message=detail, ended=ended)


async def _watch_shards_together(
        replica_id: ReplicaId, deployment_id: DeploymentId, specs: list[ShardSpec],
        tasks: list[asyncio.Task[ShardExit]], first: list[asyncio.Task[ShardExit]],
) -> tuple[Exited | Silent, NewEvent | None]:
    """:func:`watch` for a replica of several shards, once one watch has ended: the others
    get SHARD_EXITS_GRACE to end too, and the detail names each shard that ended, one
    killed before one that exited (KILLED_KINDS), else the first first: "shard 1 on node
    b: signalled: killed by SIGKILL; shard 0 on node a: error: exited with code 1: rank 1
    left the rendezvous". Silent only when no shard says it ended: a node that went quiet
    while another's engine exited is an exit."""
    order = [t for t in tasks if t in first]
    rest = [t for t in tasks if t not in first]
    if rest:
        await workflow.wait(rest, timeout=SHARD_EXITS_GRACE.total_seconds(),
                            return_when=asyncio.ALL_COMPLETED)
    order += [t for t in rest if t.done()]
    cancel_all([t for t in tasks if not t.done()])
    ended: list[tuple[ShardSpec, ShardExit]] = []
    for task in order:
        with contextlib.suppress(ActivityError):
            ended.append((specs[tasks.index(task)], task.result()))
    # Killed before exited: when one rank dies, the others exit with an error as their
    # process group breaks, often before the dead rank's agent has polled it. A stable
    # sort keeps the order the reports came in otherwise.
    ended.sort(key=lambda pair: pair[1].kind not in KILLED_KINDS)
    if not ended:
        return Silent(replica_id=replica_id), None
    detail = "; ".join(f"{shard_name(spec)}: {exit_.kind.value}: {exit_.detail}"
                       f"{last_log_line(exit_)}" for spec, exit_ in ended)
    return Exited(replica_id=replica_id, detail=detail), engine_log_event(
        "replica.exited", deployment_id, replica_id, message=detail, ended=ended[0][1])


# -- failures ----------------------------------------------------------------------------------


def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel activity tasks whose outcome no longer matters, consuming their errors so
    a cancelled activity is not reported as an exception nobody retrieved."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def describe(exc: ActivityError) -> str:
    """The innermost message of an activity failure, for last_failure and events."""
    cause = exc.cause
    if isinstance(cause, TimeoutError):
        kind = {TimeoutType.SCHEDULE_TO_START: "no agent picked it up in time",
                TimeoutType.HEARTBEAT: "its node went silent",
                TimeoutType.START_TO_CLOSE: "it took too long",
                TimeoutType.SCHEDULE_TO_CLOSE: "it took too long"}.get(
                    cause.type or TimeoutType.START_TO_CLOSE, "timeout")
        return f"{exc.activity_type} timed out: {kind}"
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause or exc)


def start_exit(exc: ActivityError) -> ShardExit | None:
    """How the engine of a failed start ended, with its log: the agent's ShardExit, the
    first detail of its ApplicationError (activities/node.py). None for a failure without
    one (a timeout, a bad engine config), or one this worker cannot read."""
    cause = exc.cause
    if not isinstance(cause, ApplicationError) or not cause.details:
        return None
    try:
        return ShardExit.model_validate(cause.details[0])
    except ValidationError:
        return None


def engine_log_event(kind: str, deployment_id: DeploymentId, replica_id: ReplicaId, *,
                     message: str, ended: ShardExit | None) -> NewEvent:
    """The audit event for an engine that exited or failed to start, with its last
    EVENT_LOG_LINES log lines (none when the failure came without them)."""
    data: dict[str, Any] = {"log": []}
    if ended is not None:
        data = {"exit_kind": ended.kind.value, "exit_code": ended.exit_code,
                "signal": ended.signal, "log": ended.log_tail[-EVENT_LOG_LINES:]}
    return NewEvent(kind=kind, deployment_id=deployment_id, replica_id=replica_id,
                    message=message, data=data)


# -- demand (modelkeeper.domain.demand) ---------------------------------------------------------

#: The usage watch runs as long as the deployment follows demand, for months maybe: its
#: heartbeat timeout notices a dead worker, and the workflow cancels it when its view of
#: the keeper moves on. Retried for ever like the room watch (retries add no events).
DEMAND_WATCH_LIFETIME = WATCH_LIFETIME
#: ... and heartbeats at least every quarter of this (activities/demand.py): a worker that
#: died is noticed within it, and its watches start again on another. Shorter than the
#: room watch's 120 s because a cold start waits on it: about one heartbeat RPC per 7.5 s
#: per deployment that follows demand.
DEMAND_WATCH_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
DEMAND_WATCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1),
                                 backoff_coefficient=2.0,
                                 maximum_interval=timedelta(seconds=30))
#: A sleep or wake is a call to the engine: vLLM's wake re-allocates its KV cache in
#: seconds; the agent bounds each call itself (agent/shards.py) and this bounds the agent.
SLEEP_WAKE_TIMEOUT = timedelta(minutes=5)
SLEEP_WAKE_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
#: Sleep and wake are idempotent on the agent: a lost answer is asked again, twice more;
#: a shard that is not on the node (ERROR_SHARD_NOT_HERE) is not.
SLEEP_WAKE_RETRY = RetryPolicy(maximum_attempts=3,
                               non_retryable_error_types=[ERROR_SHARD_NOT_HERE])


async def watch_demand(view: DemandView, pressure: Pressure,
                       tunables: Tunables) -> DemandFound:
    """Until a scaling step is due on ``view`` (raises ActivityError only if it cannot be
    retried: its retries go on for ever, like the room watch's)."""
    return await workflow.execute_activity(
        stubs.watch_demand, WatchDemandInput(view=view, pressure=pressure),
        task_queue=ROOM_WATCH_TASK_QUEUE, start_to_close_timeout=DEMAND_WATCH_LIFETIME,
        heartbeat_timeout=DEMAND_WATCH_HEARTBEAT_TIMEOUT, retry_policy=DEMAND_WATCH_RETRY)


def _each_shard(activity: Any, arg: Any, specs: list[ShardSpec],
                tunables: Tunables) -> list[asyncio.Task[None]]:
    return [asyncio.create_task(workflow.execute_activity(
        activity, arg, task_queue=node_task_queue(spec.node_id),
        schedule_to_start_timeout=timedelta(seconds=tunables.node_schedule_to_start_s),
        start_to_close_timeout=SLEEP_WAKE_TIMEOUT,
        heartbeat_timeout=SLEEP_WAKE_HEARTBEAT_TIMEOUT, retry_policy=SLEEP_WAKE_RETRY))
        for spec in specs]


async def _all(tasks: list[asyncio.Task[None]]) -> str | None:
    """Wait for every task; the first failure's description, or None."""
    error: str | None = None
    try:
        for task in tasks:
            try:
                await task
            except ActivityError as exc:
                error = error or describe(exc)
    except asyncio.CancelledError:
        cancel_all(tasks)
        raise
    return error


async def sleep(replica_id: ReplicaId, specs: list[ShardSpec],
                tunables: Tunables) -> str | None:
    """Out of routing with its requests finished (drained), each shard asleep, then its
    claims shrunk to what sleep keeps (which tells deployments waiting for room). The
    error, or None. A claim is shrunk only once the engine has freed the memory."""
    await drain(replica_id, tunables)
    error = await _all(_each_shard(stubs.sleep_shard, SleepShardInput(replica_id=replica_id),
                                   specs, tunables))
    if error is not None:
        return error
    await workflow.execute_activity(
        stubs.shrink_claims, ShrinkClaimsInput(replica_id=replica_id),
        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
        retry_policy=STORE_RETRY)
    return None


async def wake(replica_id: ReplicaId, specs: list[ShardSpec],
               tunables: Tunables) -> Woke | WakeFailed:
    """The claims grown back if the room is still free (checked under placement's locks:
    nothing else can take it meanwhile), then each shard woken, through its node's
    start-up gate. A wake that fails leaves the claims grown: the keeper stops the
    replica, and its release frees them."""
    grown = await workflow.execute_activity(
        stubs.regrow_claims, RegrowClaimsInput(replica_id=replica_id),
        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
        retry_policy=STORE_RETRY)
    if not grown.ok:
        return WakeFailed(replica_id=replica_id, error=f"no room: {grown.reason}",
                          no_room=True)
    error = await _all(_each_shard(stubs.wake_shard, WakeShardInput(replica_id=replica_id),
                                   specs, tunables))
    if error is not None:
        return WakeFailed(replica_id=replica_id, error=error)
    return Woke(replica_id=replica_id)


async def find_eviction(spec: DeploymentSpec, next_seq: int) -> EvictionFound:
    """An idle replica of another on-demand deployment whose room would place the next
    replica of ``spec``, or why none (claims nothing, stops nothing)."""
    return await workflow.execute_activity(
        stubs.find_eviction,
        FindEvictionInput(spec=spec, replica_id=ReplicaId(f"{spec.deployment_id}-r{next_seq}"),
                          generation=spec.generation),
        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
        retry_policy=STORE_RETRY)
