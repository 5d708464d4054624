"""Sleep and wake of a running shard: its engine frees its KV cache and keeps its weights,
then takes the cache back, in a fraction of a load's time.

Each engine that can sleep has its dialect (:func:`agent.engines.base.sleep_dialect`: vLLM's
``/sleep?level=1`` and ``/wake_up``, which the sim speaks too; SGLang's memory saver);
llama.cpp cannot, and the keeper stops it instead. The rules, in order (each has its test
in tests/unit/test_shard_sleep.py):

1. A shard this agent does not run is a :class:`ShardNotHereError`: no retry can find it.
2. Both are idempotent: sleeping a sleeping shard, or waking an awake one, succeeds and
   changes nothing. What the engine says (``/is_sleeping``) is believed first, the
   agent's record of the shard where the engine cannot say.
3. A sleep is never delayed: freeing memory must stay immediate (as a stop).
4. A wake waits its turn at the node's start-up gate, as a start does: it re-allocates
   memory, and would disturb another engine's load as a second load would. When its turn
   comes, the memory it takes back is checked against the node's available memory.
5. A stop of a shard whose wake is queued takes the wake out of the queue (it fails as
   stopped) and stops the engine.

A rank that serves no HTTP (rank > 0 of a multi-node replica) has nothing to call: rank
0's engine sleeps and wakes the whole replica, so its own sleep and wake succeed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.redact import scrub_secrets
from modelkeeper.domain.shards import ShardNotHereError, ShardState, SleepWakeError

from .engine_process import POLL_INTERVAL_S, LiveShard
from .engines.base import SleepDialect, clip_detail, post_sleep_call, read_sleeping, sleep_dialect
from .shard_startup import ShardTable
from .startup_gate import (
    ANSWER_MARGIN_S,
    Admitted,
    Queued,
    Removed,
    StartupGate,
    TimedOut,
    wake_memory_needed,
)

log = logging.getLogger(__name__)

#: How long a sleep call may take. vLLM's level 1 copies the weights to CPU memory before
#: it answers: seconds for a small model, tens of seconds for one of 70B parameters.
SLEEP_TIMEOUT_S = 60.0
#: How long a wake call may take, once through the gate: the weights come back (level 1)
#: and the KV cache is allocated again; vLLM measures 0.1-0.4 s for small models and
#: tens of seconds for the largest. Beyond this the engine is wedged, not slow.
WAKE_TIMEOUT_S = 120.0
#: "Is it sleeping?" reads a flag: an engine that takes longer is not answering.
STATE_TIMEOUT_S = 5.0
#: A wake waits at the start-up gate at most this long: a queue behind loads of minutes
#: means the node is busy, and the keeper may rather load elsewhere (dgxmm gives a queued
#: wake 300 s too). Cut further by the caller's own deadline (see :meth:`ShardSleep.wake`).
WAKE_QUEUE_LIMIT_S = 300.0


class ShardSleep:
    """Sleeps and wakes this node's engines; shares the start-up gate with starts."""

    def __init__(self, table: ShardTable, *, gate: StartupGate,
                 available_memory: Callable[[], int | None],
                 http: httpx.AsyncClient) -> None:
        self._table = table
        self._gate = gate
        self._available_memory = available_memory
        self._http = http
        #: One sleep or wake per replica at a time: each reads, then changes, the state.
        self._locks: dict[ReplicaId, asyncio.Lock] = {}

    def _lock(self, replica_id: ReplicaId) -> asyncio.Lock:
        return self._locks.setdefault(replica_id, asyncio.Lock())

    def _live(self, replica_id: ReplicaId) -> tuple[LiveShard, SleepDialect]:
        """The running shard and its engine's dialect (rules 1 and the engine's ability)."""
        live = self._table.running.get(replica_id)
        if live is None or self._table.poll_exit(live) is not None:
            raise ShardNotHereError(f"this node runs no shard {replica_id}: it never "
                                    "started here, has ended, or was lost")
        spec = live.record.spec
        dialect = sleep_dialect(spec.engine, spec.engine_args)
        if dialect is None:
            raise SleepWakeError(f"{replica_id}: the {spec.engine.value} engine cannot "
                                 "sleep (stop it instead)", retryable=False)
        if live.record.state is not ShardState.READY:
            raise SleepWakeError(f"{replica_id} is still {live.record.state.value}: only a "
                                 "ready engine sleeps or wakes", retryable=False)
        return live, dialect

    async def _sleeping(self, live: LiveShard, dialect: SleepDialect) -> bool:
        """Whether the engine sleeps: its own word, else the record (rule 2)."""
        assert live.record.url is not None
        said = await read_sleeping(self._http, live.record.url,
                                   self._table.engine_key(live.record.spec.replica_id),
                                   dialect, timeout=STATE_TIMEOUT_S)
        return live.record.sleeping if said is None else said

    def _mark(self, live: LiveShard, *, sleeping: bool) -> None:
        if live.record.sleeping != sleeping:
            live.record = live.record.model_copy(update={"sleeping": sleeping})
            self._table.save(live.record)

    async def _call(self, live: LiveShard, path: str, dialect: SleepDialect, *,
                    timeout: float, what: str) -> None:
        """POST one call; a refusal or a silence is a :class:`SleepWakeError`."""
        assert live.record.url is not None
        replica_id = live.record.spec.replica_id
        try:
            response = await post_sleep_call(self._http, live.record.url,
                                             self._table.engine_key(replica_id), path,
                                             dialect.body, timeout=timeout)
        except httpx.HTTPError as exc:
            # Retryable: a busy engine may answer the next attempt.
            raise SleepWakeError(f"{replica_id}: {what} (POST {path}) failed: "
                                 f"{type(exc).__name__}: {exc}", retryable=True) from exc
        if response.status_code != 200:
            # A 4xx is the engine refusing the call itself (started without sleep mode,
            # a level it does not take): the same call would be refused again.
            raise SleepWakeError(
                f"{replica_id}: {what} (POST {path}) answered {response.status_code}: "
                f"{scrub_secrets(clip_detail(response.text))}",
                retryable=response.status_code >= 500)

    async def sleep(self, replica_id: ReplicaId) -> None:
        """Free the engine's KV cache, keep its weights (rules 1-3)."""
        async with self._lock(replica_id):
            live, dialect = self._live(replica_id)
            if live.record.url is None:
                return
            if not await self._sleeping(live, dialect):
                began = time.monotonic()
                await self._call(live, dialect.sleep_path, dialect, timeout=SLEEP_TIMEOUT_S,
                                 what="sleep")
                log.info("%s asleep after %.2fs", replica_id, time.monotonic() - began)
            self._mark(live, sleeping=True)

    async def wake(self, replica_id: ReplicaId, heartbeat: Callable[[], None], *,
                   answer_within_s: float | None = None) -> None:
        """Take the KV cache back, after the node's start-up gate (rules 1, 2, 4, 5).

        ``heartbeat`` is called while the wake waits at the gate and while the engine
        wakes. ``answer_within_s``: the time the caller gives this call (Temporal's
        start-to-close); the queue wait is cut so that a full wake and its answer still
        fit in it.
        """
        async with self._lock(replica_id):
            live, dialect = self._live(replica_id)
            if live.record.url is None or not await self._sleeping(live, dialect):
                self._mark(live, sleeping=False)
                return
            limit = WAKE_QUEUE_LIMIT_S
            if answer_within_s is not None:
                limit = max(0.0, min(limit, answer_within_s - WAKE_TIMEOUT_S - ANSWER_MARGIN_S))

            def queued(place: Queued) -> None:
                heartbeat()

            outcome = await self._gate.wait_turn(replica_id, limit_s=limit, on_queued=queued,
                                                 poll_s=POLL_INTERVAL_S)
            try:
                match outcome:
                    case TimedOut():
                        raise SleepWakeError(f"wake: {outcome.detail()}", retryable=False)
                    case Removed():
                        raise SleepWakeError(f"{replica_id} was stopped while its wake waited "
                                             "at the start-up gate", retryable=False)
                    case Admitted():
                        pass
                self._check_room(live)
                began = time.monotonic()
                call = asyncio.ensure_future(self._call(live, dialect.wake_path, dialect,
                                                        timeout=WAKE_TIMEOUT_S, what="wake"))
                try:
                    while not call.done():
                        heartbeat()
                        await asyncio.wait({call}, timeout=POLL_INTERVAL_S)
                finally:
                    if not call.done():
                        call.cancel()
                        with contextlib.suppress(asyncio.CancelledError, SleepWakeError):
                            await call
                call.result()
                log.info("%s awake after %.2fs", replica_id, time.monotonic() - began)
                self._mark(live, sleeping=False)
            finally:
                # Awake, failed or cancelled: it allocates no more, the next in line may.
                self._gate.leave(replica_id)

    def _check_room(self, live: LiveShard) -> None:
        """Refuse a wake whose memory is not available on the node now (rule 4)."""
        needed = wake_memory_needed(live.record.spec)
        available = self._available_memory()
        if needed is None or available is None or needed <= available:
            return
        raise SleepWakeError(
            f"{live.record.spec.replica_id} cannot wake on this node: waking takes back "
            f"{needed} bytes and {available} bytes are available (memory outside "
            "modelkeeper grew while it slept)", retryable=False)
