"""The start-up gate: at most ``slots`` engines load at once on a node; later starts queue.

Why a gate: an engine sizes itself from the memory it finds while it loads. vLLM profiles
free memory and asserts that it did not change meanwhile; llama.cpp and the sim engine
touch their memory page by page. Two loads at once on one node disturb each other (on
unified memory, "No available memory for the cache blocks"), so by default one engine
loads at a time and the others wait their turn.

Rules, in order (each has its test in tests/unit/test_startup_gate.py):

1. A start enters at the back of the queue. A replica already in the gate, waiting or
   loading, keeps its place: a repeated start must not lose its turn or take two.
2. The head of the queue takes a slot as soon as one is free; nobody overtakes it.
3. A start leaves the gate when its engine is ready, has failed, or its start was
   cancelled. A waiter that leaves held no slot; the waiters behind it move up.
4. A stop of a waiting replica takes it out of the queue at once: its start fails as
   stopped, and its engine is never launched.
5. A waiter fails once it has waited :func:`queue_limit_s`, naming whom it was behind.
6. When its turn comes, the fit is checked again (:func:`check_fit`): memory outside
   modelkeeper may have grown while it waited. A memory reading that cannot be had is no
   reason to refuse a start.

A wake from sleep passes through the gate like a start (it re-allocates the KV cache, as
a load does, and would disturb another engine's load the same way), and its fit is
checked for what it takes back (:func:`wake_memory_needed`). Stops, sleeps and
``list_shards`` never pass through the gate: freeing memory must stay immediate, even
though a stop during another engine's load can still disturb it.

The decisions (:class:`GateState` and the functions on it) are pure: no clock, no
asyncio. :class:`StartupGate` holds the state for the agent and wakes waiters on change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.domain.units import format_gib

#: A queued start waits at most this share of its own start timeout, which then counts
#: from leaving the queue. Half: a queue that long means the node is busy loading other
#: models, and the keeper's backoff may find a quieter node.
QUEUE_LIMIT_SHARE = 0.5
#: After its load's start timeout, a start still needs this long to answer: stop the
#: engine (5 s grace, then SIGKILL), read its log tail, report. The queue wait is cut so
#: that the load's full start timeout and this margin still fit in the time the caller
#: gives the whole start (Temporal's start-to-close, see :func:`queue_limit_s`).
ANSWER_MARGIN_S = 10.0


@dataclass(frozen=True)
class GateState:
    """Who loads (holds a slot) and who waits, first in line first. Every transition
    returns a copy."""

    slots: int
    loading: tuple[ReplicaId, ...] = ()
    waiting: tuple[ReplicaId, ...] = ()

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots = {self.slots}: a gate needs at least 1 slot")


def admit(state: GateState) -> GateState:
    """Move waiters from the head of the queue into free slots (rule 2)."""
    free = state.slots - len(state.loading)
    if free <= 0 or not state.waiting:
        return state
    return replace(state, loading=state.loading + state.waiting[:free],
                   waiting=state.waiting[free:])


def enter(state: GateState, replica_id: ReplicaId) -> GateState:
    """``replica_id`` joins the back of the queue, unless it is in the gate already (rule 1)."""
    if replica_id in state.loading or replica_id in state.waiting:
        return state
    return admit(replace(state, waiting=(*state.waiting, replica_id)))


def occupy(state: GateState, replica_id: ReplicaId) -> GateState:
    """``replica_id`` holds a slot without queueing, even past the count: its engine is
    loading already (adopted after an agent restart), and queueing it would not stop it."""
    if replica_id in state.loading:
        return state
    return replace(state, loading=(*state.loading, replica_id),
                   waiting=tuple(r for r in state.waiting if r != replica_id))


def leave(state: GateState, replica_id: ReplicaId) -> GateState:
    """``replica_id`` leaves, from a slot or from the queue; the next waiters move in
    (rule 3). Harmless for a replica that is not in the gate."""
    if replica_id not in state.loading and replica_id not in state.waiting:
        return state
    return admit(replace(state, loading=tuple(r for r in state.loading if r != replica_id),
                         waiting=tuple(r for r in state.waiting if r != replica_id)))


@dataclass(frozen=True)
class Admitted:
    """The start holds a slot: it may launch its engine."""

    replica_id: ReplicaId


@dataclass(frozen=True)
class Queued:
    """The start waits: ``position`` 1 is next in line; ``waiting_for`` are the replicas
    loading now, holding the slots."""

    replica_id: ReplicaId
    position: int
    waiting_for: tuple[ReplicaId, ...]


@dataclass(frozen=True)
class TimedOut:
    """The start waited past its limit (rule 5)."""

    place: Queued
    waited_s: float
    limit_s: float

    def detail(self) -> str:
        behind = ", ".join(self.place.waiting_for) or "nothing (the slot was just freed)"
        return (f"{self.place.replica_id} still queued behind {behind} after "
                f"{self.waited_s:.0f}s at the node's start-up gate (position "
                f"{self.place.position}; a queued start waits at most {self.limit_s:.0f}s)")


@dataclass(frozen=True)
class Removed:
    """The start is no longer in the gate: a stop took it out of the queue (rule 4)."""

    replica_id: ReplicaId

    def detail(self) -> str:
        return (f"{self.replica_id} stopped while queued at the node's start-up gate; "
                "its engine was never launched")


Turn = Admitted | Queued | TimedOut | Removed


def turn(state: GateState, replica_id: ReplicaId, *, waited_s: float,
         limit_s: float) -> Turn:
    """Where ``replica_id`` stands after waiting ``waited_s`` of at most ``limit_s``."""
    if replica_id in state.loading:
        return Admitted(replica_id)
    if replica_id not in state.waiting:
        return Removed(replica_id)
    place = Queued(replica_id, position=state.waiting.index(replica_id) + 1,
                   waiting_for=state.loading)
    if waited_s >= limit_s:
        return TimedOut(place, waited_s=waited_s, limit_s=limit_s)
    return place


def queue_limit_s(start_timeout_s: float, answer_within_s: float | None) -> float:
    """How long a start may wait in the queue (rule 5).

    ``QUEUE_LIMIT_SHARE`` of its start timeout, cut to what the caller's own deadline
    leaves after a full start timeout and ``ANSWER_MARGIN_S``, so that the agent's
    answer, with its reason, comes before a bare timeout of the caller would. The
    deployment workflow gives start_shard a start-to-close of the start timeout plus 30 s
    (AGENT_DEADLINE_SLACK): under it a start queues at most 20 s, whatever its timeout,
    unless the workflow grants the queue time on top.
    """
    limit = QUEUE_LIMIT_SHARE * start_timeout_s
    if answer_within_s is not None:
        limit = min(limit, answer_within_s - start_timeout_s - ANSWER_MARGIN_S)
    return max(0.0, limit)


def memory_needed(spec: ShardSpec) -> int | None:
    """The node memory ``spec``'s engine will take, or None where the agent cannot judge.

    * sim: ``engine_args.memory_bytes`` when given: that is what it holds, whatever its
      claim (tests claim gigabytes and hold a megabyte).
    * llama.cpp runs on the CPU: its claim. It maps its weights from the file, and mapped
      pages count as available memory, so the check is lenient after another llama.cpp
      load, never stricter than it should be.
    * vLLM and SGLang: None. Their claim is a share of GPU memory, and the agent reads no
      free GPU memory.
    """
    match spec.engine:
        case EngineKind.SIM:
            held = spec.engine_args.get("memory_bytes")
            # An invalid value is refused when the engine's command line is built.
            if isinstance(held, int) and not isinstance(held, bool) and held >= 0:
                return held
            return spec.memory_bytes
        case EngineKind.LLAMACPP:
            return spec.memory_bytes
        case _:
            return None


def wake_memory_needed(spec: ShardSpec) -> int | None:
    """The node memory waking ``spec``'s engine takes back, or None where the agent cannot
    judge: for the sim, what it holds less the ``weights_bytes`` it kept asleep (all of
    it kept when absent); None for the GPU engines, as :func:`memory_needed` says."""
    held = memory_needed(spec) if spec.engine is EngineKind.SIM else None
    if held is None:
        return None
    kept = spec.engine_args.get("weights_bytes")
    if isinstance(kept, bool) or not isinstance(kept, int):
        return 0
    return max(0, held - max(0, kept))


@dataclass(frozen=True)
class NoRoom:
    """The node's available memory does not cover the shard (rule 6)."""

    replica_id: ReplicaId
    needed_bytes: int
    available_bytes: int

    def detail(self) -> str:
        return (f"{self.replica_id} no longer fits on this node: it needs "
                f"{format_gib(self.needed_bytes)} ({self.needed_bytes} bytes), "
                f"{format_gib(self.available_bytes)} ({self.available_bytes} bytes) is "
                "available; memory outside modelkeeper grew while it waited to start")


def check_fit(spec: ShardSpec, available_bytes: int | None) -> NoRoom | None:
    """None when ``spec`` fits in ``available_bytes``, or when either is unknown."""
    needed = memory_needed(spec)
    if needed is None or available_bytes is None or needed <= available_bytes:
        return None
    return NoRoom(spec.replica_id, needed_bytes=needed, available_bytes=available_bytes)


class StartupGate:
    """The gate of one node's agent: holds a :class:`GateState` and wakes waiters when it
    changes. Single event loop; no locking needed."""

    def __init__(self, slots: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._state = GateState(slots=slots)
        self._clock = clock
        self._changed = asyncio.Event()

    @property
    def state(self) -> GateState:
        return self._state

    def _set(self, state: GateState) -> None:
        if state == self._state:
            return
        self._state = state
        # A fresh event per change: every waiter woken by this one looks again.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def positions(self) -> dict[ReplicaId, int]:
        """Each waiter's place in the queue, 1 for the next in line."""
        return {rid: i + 1 for i, rid in enumerate(self._state.waiting)}

    def occupy(self, replica_id: ReplicaId) -> None:
        """See :func:`occupy`."""
        self._set(occupy(self._state, replica_id))

    def leave(self, replica_id: ReplicaId) -> None:
        """See :func:`leave`."""
        self._set(leave(self._state, replica_id))

    def remove_waiter(self, replica_id: ReplicaId) -> bool:
        """Take a waiting replica out of the queue (a stop); False if it was not waiting."""
        if replica_id not in self._state.waiting:
            return False
        self.leave(replica_id)
        return True

    async def wait_turn(self, replica_id: ReplicaId, *, limit_s: float,
                        on_queued: Callable[[Queued], None],
                        poll_s: float) -> Admitted | TimedOut | Removed:
        """Enter and wait until admitted, timed out or removed.

        ``on_queued`` is called at once and then every ``poll_s`` while waiting: the
        caller's heartbeat. A waiter that times out or is cancelled leaves the queue.
        """
        self._set(enter(self._state, replica_id))
        entered = self._clock()
        try:
            while True:
                outcome = turn(self._state, replica_id, waited_s=self._clock() - entered,
                               limit_s=limit_s)
                match outcome:
                    case Queued():
                        on_queued(outcome)
                        changed = self._changed
                        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                        # cancellation that lands as its timeout fires, and the cancelled
                        # waiter would stay in the queue.
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(poll_s):
                                await changed.wait()
                    case TimedOut():
                        self.leave(replica_id)
                        return outcome
                    case Admitted() | Removed():
                        return outcome
        except BaseException:
            # Cancelled (the workflow gave up on the start): nothing may stay in the queue,
            # or hold a slot it was just given.
            self.leave(replica_id)
            raise
