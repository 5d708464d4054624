"""Activities that run on a node, on its own task queue (``node/<node_id>``), executed by
that node's agent. They are the only code that touches engine processes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.engine_args import EngineConfigError
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.log_reads import EngineLogChunk, EngineLogRequest
from modelkeeper.domain.shards import (
    FetchProgress,
    NoFreePortError,
    ShardEndpoint,
    ShardExit,
    ShardNotHereError,
    ShardReport,
    ShardSpec,
    ShardStartError,
    SleepShardInput,
    SleepWakeError,
    StartShardInput,
    StopShardInput,
    WakeShardInput,
    WatchShardInput,
)
from modelkeeper.names import (
    ACTIVITY_LIST_SHARDS,
    ACTIVITY_READ_ENGINE_LOG,
    ACTIVITY_SLEEP_SHARD,
    ACTIVITY_START_SHARD,
    ACTIVITY_STOP_SHARD,
    ACTIVITY_WAKE_SHARD,
    ACTIVITY_WATCH_SHARD,
    ERROR_ENGINE_CONFIG,
    ERROR_NO_ENGINE_LOG,
    ERROR_NO_FREE_PORT,
    ERROR_SHARD_NOT_HERE,
    ERROR_SHARD_START_FAILED,
    ERROR_SLEEP_WAKE_FAILED,
)

#: Workers on nodes send heartbeats at most this often (the SDK otherwise throttles to
#: 0.8 x heartbeat timeout, which leaves only 0.2 x T of slack against a false timeout).
MAX_HEARTBEAT_THROTTLE = timedelta(seconds=1)

#: A watch hands its heartbeat to the SDK at most once per this share of its heartbeat
#: timeout, and at most once per WATCH_BEAT_MAX_GAP_S: the shard manager polls the engine
#: every 0.25 s, and each heartbeat() is a call into the SDK's core even though the SDK sends
#: one per 0.8 x timeout (48 s at the default 60 s). A fleet of 50 simulated nodes spent
#: 6 % of its time in those calls (bench/scale). What reaches the server is unchanged: the
#: SDK still sends the latest one per its throttle, at most this stale.
WATCH_BEAT_TIMEOUT_SHARE = 0.1
WATCH_BEAT_MAX_GAP_S = 5.0


class StartQueued(Frozen):
    """Heartbeat details of a start waiting at its node's start-up gate (FetchProgress's
    place while fetching and loading)."""

    phase: str = "queued"
    #: 1 is next in line.
    position: int
    #: The replicas loading now, whose slots it waits for.
    waiting_for: list[ReplicaId]


class ShardRunner(Protocol):
    """What the node activities need from the agent's shard manager.

    A protocol rather than the agent's class: activities sit below the agent, which
    imports them to build its worker.
    """

    async def start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                    on_queued: Callable[[int, list[ReplicaId]], None] | None = None,
                    answer_within_s: float | None = None) -> ShardEndpoint: ...

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit: ...

    async def stop(self, replica_id: ReplicaId, grace_s: float) -> ShardExit: ...

    async def sleep(self, replica_id: ReplicaId) -> None: ...

    async def wake(self, replica_id: ReplicaId, heartbeat: Callable[[], None], *,
                   answer_within_s: float | None = None) -> None: ...

    def reports(self) -> list[ShardReport]: ...


def at_most_every(gap_s: float, beat: Callable[[], None], *,
                  clock: Callable[[], float] = time.monotonic) -> Callable[[], None]:
    """``beat``, called at once and then only once ``gap_s`` has passed since the last."""
    last: float | None = None

    def throttled() -> None:
        nonlocal last
        now = clock()
        if last is None or now - last >= gap_s:
            last = now
            beat()
    return throttled


class NodeActivities:
    """The activities of one node, bound to its shard manager."""

    def __init__(self, manager: ShardRunner) -> None:
        self._manager = manager

    @activity.defn(name=ACTIVITY_START_SHARD)
    async def start_shard(self, request: StartShardInput) -> ShardEndpoint:
        """Fetch weights if needed, wait for the node's start-up gate, launch the engine,
        wait until it is ready.

        The start-to-close Temporal gives this attempt bounds the time the start may
        queue: the agent answers (with the reason) before Temporal's bare timeout would.
        """
        timeout = activity.info().start_to_close_timeout

        def queued(position: int, waiting_for: list[ReplicaId]) -> None:
            activity.heartbeat(StartQueued(position=position, waiting_for=waiting_for))

        try:
            return await self._manager.start(
                request.spec, activity.heartbeat, on_queued=queued,
                answer_within_s=None if timeout is None else timeout.total_seconds())
        except ShardStartError as exc:
            raise ApplicationError(str(exc), exc.exit, type=ERROR_SHARD_START_FAILED,
                                   non_retryable=True) from exc
        except EngineConfigError as exc:
            raise ApplicationError(str(exc), type=ERROR_ENGINE_CONFIG,
                                   non_retryable=True) from exc
        except NoFreePortError as exc:
            # Retryable: ports free up as other shards stop.
            raise ApplicationError(str(exc), type=ERROR_NO_FREE_PORT) from exc

    @activity.defn(name=ACTIVITY_WATCH_SHARD)
    async def watch_shard(self, request: WatchShardInput) -> ShardExit:
        """Return when the engine exits: code, classification and the last 200 log lines."""
        timeout = activity.info().heartbeat_timeout
        gap = WATCH_BEAT_MAX_GAP_S if timeout is None else min(
            WATCH_BEAT_MAX_GAP_S, WATCH_BEAT_TIMEOUT_SHARE * timeout.total_seconds())
        return await self._manager.watch(request.replica_id,
                                         at_most_every(gap, activity.heartbeat))

    @activity.defn(name=ACTIVITY_STOP_SHARD)
    async def stop_shard(self, request: StopShardInput) -> ShardExit:
        """SIGTERM the shard's process group, SIGKILL after the grace period."""
        return await self._manager.stop(request.replica_id, request.grace_s)

    @activity.defn(name=ACTIVITY_SLEEP_SHARD)
    async def sleep_shard(self, request: SleepShardInput) -> None:
        """Free the engine's KV cache and keep its weights; never delayed, and a shard
        asleep already succeeds. Not here, or an engine that cannot sleep or refused, is
        non-retryable; an engine that did not answer is retried."""
        with _sleep_wake_errors():
            await self._manager.sleep(request.replica_id)

    @activity.defn(name=ACTIVITY_WAKE_SHARD)
    async def wake_shard(self, request: WakeShardInput) -> None:
        """Take the engine's KV cache back, after the node's start-up gate, heartbeating
        while it waits there and while the engine wakes; an awake shard succeeds. The
        start-to-close Temporal gives this attempt bounds the time it may queue."""
        timeout = activity.info().start_to_close_timeout
        with _sleep_wake_errors():
            await self._manager.wake(
                request.replica_id, activity.heartbeat,
                answer_within_s=None if timeout is None else timeout.total_seconds())

    @activity.defn(name=ACTIVITY_LIST_SHARDS)
    async def list_shards(self) -> list[ShardReport]:
        """What this node runs."""
        return self._manager.reports()

    def all(self) -> list[Callable[..., Any]]:
        """Every activity, for the agent's worker."""
        return [self.start_shard, self.watch_shard, self.stop_shard, self.sleep_shard,
                self.wake_shard, self.list_shards]


class LogReader(Protocol):
    """What reading an engine's log needs from the agent (agent.log_reader)."""

    def read_log(self, request: EngineLogRequest) -> EngineLogChunk:
        """The lines asked for; raises LookupError when there is no such log here."""
        ...


class NodeLogActivities:
    """The node's log reads for `modelkeeper logs`: apart from :class:`NodeActivities`,
    whose runner drives engines; this only reads files."""

    def __init__(self, reader: LogReader) -> None:
        self._reader = reader

    @activity.defn(name=ACTIVITY_READ_ENGINE_LOG)
    async def read_engine_log(self, request: EngineLogRequest) -> EngineLogChunk:
        """The log lines asked for, bounded and scrubbed (modelkeeper.domain.log_reads).
        No log here is non-retryable: asking again finds none either."""
        try:
            return self._reader.read_log(request)
        except LookupError as exc:
            raise ApplicationError(str(exc), type=ERROR_NO_ENGINE_LOG,
                                   non_retryable=True) from exc
        except ValueError as exc:
            raise ApplicationError(str(exc), type=ERROR_NO_ENGINE_LOG,
                                   non_retryable=True) from exc

    def all(self) -> list[Callable[..., Any]]:
        return [self.read_engine_log]


@contextlib.contextmanager
def _sleep_wake_errors() -> Iterator[None]:
    """The shard manager's sleep and wake errors as the ApplicationErrors a workflow
    matches on (ERROR_SHARD_NOT_HERE, ERROR_SLEEP_WAKE_FAILED)."""
    try:
        yield
    except ShardNotHereError as exc:
        raise ApplicationError(str(exc), type=ERROR_SHARD_NOT_HERE,
                               non_retryable=True) from exc
    except SleepWakeError as exc:
        raise ApplicationError(str(exc), type=ERROR_SLEEP_WAKE_FAILED,
                               non_retryable=not exc.retryable) from exc
