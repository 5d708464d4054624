"""The start-up gate's rules (agent/startup_gate.py), one test or more each: the pure
state, the fit check, the queue limit, the asyncio waiter on top, and what the
start_shard activity passes to it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from activities.node import NodeActivities, StartQueued
from agent.startup_gate import (
    ANSWER_MARGIN_S,
    QUEUE_LIMIT_SHARE,
    Admitted,
    GateState,
    NoRoom,
    Queued,
    Removed,
    StartupGate,
    TimedOut,
    check_fit,
    enter,
    leave,
    memory_needed,
    occupy,
    queue_limit_s,
    turn,
)
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import (
    EngineKind,
    FetchProgress,
    ShardEndpoint,
    ShardSpec,
    StartShardInput,
)
from tests.support.node_activities import StubRunner, heartbeat_env

pytestmark = pytest.mark.timeout(10)

R1, R2, R3, R4 = (ReplicaId(f"r{i}") for i in range(1, 5))
MIB = 1 << 20


def _through(state: GateState, *events: tuple[str, ReplicaId]) -> GateState:
    for kind, rid in events:
        state = enter(state, rid) if kind == "enter" else leave(state, rid)
    return state


# -- rule 1 and 2: first in, first out ---------------------------------------------------


def test_one_slot_admits_in_arrival_order() -> None:
    state = _through(GateState(slots=1), ("enter", R1), ("enter", R2), ("enter", R3))
    assert (state.loading, state.waiting) == ((R1,), (R2, R3))
    assert turn(state, R3, waited_s=0, limit_s=10) == Queued(R3, position=2, waiting_for=(R1,))
    state = leave(state, R1)
    assert (state.loading, state.waiting) == ((R2,), (R3,))
    state = leave(state, R2)
    assert (state.loading, state.waiting) == ((R3,), ())
    assert turn(state, R3, waited_s=5, limit_s=1) == Admitted(R3)


def test_entering_twice_keeps_the_place() -> None:
    state = _through(GateState(slots=1), ("enter", R1), ("enter", R2), ("enter", R3))
    assert enter(state, R2) == state
    assert enter(state, R1) == state  # loading already: never a second slot


def test_two_slots_load_two_at_once_and_the_rest_wait_in_order() -> None:
    state = _through(GateState(slots=2), ("enter", R1), ("enter", R2), ("enter", R3),
                     ("enter", R4))
    assert (state.loading, state.waiting) == ((R1, R2), (R3, R4))
    assert turn(state, R4, waited_s=0, limit_s=10) == Queued(R4, position=2,
                                                            waiting_for=(R1, R2))
    state = leave(state, R2)  # the second loader finishes first: the head takes its slot
    assert (state.loading, state.waiting) == ((R1, R3), (R4,))


def test_a_gate_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GateState(slots=0)


# -- rule 3 and 4: leaving ---------------------------------------------------------------


def test_a_waiter_that_leaves_holds_nothing_and_the_next_moves_up() -> None:
    state = _through(GateState(slots=1), ("enter", R1), ("enter", R2), ("enter", R3))
    state = leave(state, R2)  # cancelled while waiting
    assert (state.loading, state.waiting) == ((R1,), (R3,))
    assert turn(state, R3, waited_s=0, limit_s=10) == Queued(R3, position=1, waiting_for=(R1,))
    assert turn(state, R2, waited_s=0, limit_s=10) == Removed(R2)
    assert leave(state, R2) == state  # harmless twice


def test_occupy_holds_a_slot_past_the_count_without_queueing() -> None:
    state = _through(GateState(slots=1), ("enter", R1), ("enter", R2))
    state = occupy(state, R3)  # already loading (adopted): it cannot be made to wait
    assert (state.loading, state.waiting) == ((R1, R3), (R2,))
    state = leave(state, R1)
    assert state.waiting == (R2,), "one slot: R3 still holds it"
    state = leave(state, R3)
    assert (state.loading, state.waiting) == ((R2,), ())


# -- rule 5: the queue limit -------------------------------------------------------------


def test_a_waiter_past_its_limit_times_out_naming_whom_it_was_behind() -> None:
    state = _through(GateState(slots=1), ("enter", R1), ("enter", R2))
    outcome = turn(state, R2, waited_s=20.4, limit_s=20)
    assert isinstance(outcome, TimedOut)
    assert outcome.place == Queued(R2, position=1, waiting_for=(R1,))
    assert "r2 still queued behind r1 after 20s" in outcome.detail()
    assert "at most 20s" in outcome.detail()


def test_queue_limit_is_a_share_of_the_start_timeout_cut_to_the_callers_deadline() -> None:
    assert queue_limit_s(600, None) == QUEUE_LIMIT_SHARE * 600
    # The workflow's start-to-close is the start timeout + 30 s: the load keeps its whole
    # start timeout and the answer margin, the queue gets the rest.
    assert queue_limit_s(600, 630) == 30 - ANSWER_MARGIN_S
    assert queue_limit_s(600, 600 * (1 + QUEUE_LIMIT_SHARE) + 60) == QUEUE_LIMIT_SHARE * 600
    assert queue_limit_s(600, 100) == 0.0  # no room at all: only a free slot passes


# -- rule 6: the fit, checked again ------------------------------------------------------


def _spec(engine: EngineKind, memory: int, **engine_args: Any) -> ShardSpec:
    return ShardSpec(replica_id=R2, model_id=ModelId("m"), node_id=NodeId("n"), engine=engine,
                     source="s", memory_bytes=memory, engine_args=engine_args)


def test_fit_names_the_replica_and_both_numbers() -> None:
    short = check_fit(_spec(EngineKind.LLAMACPP, 2 << 30), available_bytes=1 << 30)
    assert short == NoRoom(R2, needed_bytes=2 << 30, available_bytes=1 << 30)
    detail = short.detail()
    assert "r2" in detail and str(2 << 30) in detail and str(1 << 30) in detail
    assert "2.0 GiB" in detail and "1.0 GiB" in detail
    assert check_fit(_spec(EngineKind.LLAMACPP, 1 << 30), available_bytes=1 << 30) is None


def test_unknown_memory_never_refuses_a_start() -> None:
    assert check_fit(_spec(EngineKind.LLAMACPP, 2 << 30), available_bytes=None) is None
    # vLLM's claim is GPU memory, which the agent does not read.
    assert memory_needed(_spec(EngineKind.VLLM, 40 << 30)) is None
    assert check_fit(_spec(EngineKind.SGLANG, 40 << 30), available_bytes=1) is None


def test_the_sim_needs_what_it_holds_not_what_it_claims() -> None:
    assert memory_needed(_spec(EngineKind.SIM, 12 << 30, memory_bytes=MIB)) == MIB
    assert check_fit(_spec(EngineKind.SIM, 12 << 30, memory_bytes=MIB), 2 * MIB) is None
    assert memory_needed(_spec(EngineKind.SIM, 12 << 30)) == 12 << 30
    # An invalid override is refused later, by the adapter; here the claim stands.
    assert memory_needed(_spec(EngineKind.SIM, 5, memory_bytes=True)) == 5


# -- the asyncio waiter ------------------------------------------------------------------


async def _queued_until(gate: StartupGate, rid: ReplicaId) -> None:
    while rid not in gate.state.waiting:
        await asyncio.sleep(0)


async def test_waiters_pass_in_order_and_report_their_place() -> None:
    gate = StartupGate(1)
    order: list[ReplicaId] = []
    places: dict[ReplicaId, list[Queued]] = {R2: [], R3: []}

    async def start(rid: ReplicaId) -> None:
        outcome = await gate.wait_turn(rid, limit_s=10, on_queued=places.setdefault(
            rid, []).append, poll_s=0.01)
        assert outcome == Admitted(rid)
        order.append(rid)

    await start(R1)
    waiters = [asyncio.create_task(start(R2))]
    await _queued_until(gate, R2)
    waiters.append(asyncio.create_task(start(R3)))
    await _queued_until(gate, R3)
    assert gate.positions() == {R2: 1, R3: 2}
    gate.leave(R1)
    await waiters[0]
    assert order == [R1, R2] and gate.positions() == {R3: 1}
    gate.leave(R2)
    await waiters[1]
    assert order == [R1, R2, R3]
    assert places[R2][0] == Queued(R2, position=1, waiting_for=(R1,))
    assert places[R3][0] == Queued(R3, position=2, waiting_for=(R1,))
    assert places[R3][-1] == Queued(R3, position=1, waiting_for=(R2,))


async def test_a_cancelled_waiter_leaves_the_queue_and_the_next_passes() -> None:
    gate = StartupGate(1)
    await gate.wait_turn(R1, limit_s=10, on_queued=lambda _: None, poll_s=0.01)
    second = asyncio.create_task(gate.wait_turn(R2, limit_s=10, on_queued=lambda _: None,
                                                poll_s=0.01))
    await _queued_until(gate, R2)
    third = asyncio.create_task(gate.wait_turn(R3, limit_s=10, on_queued=lambda _: None,
                                               poll_s=0.01))
    await _queued_until(gate, R3)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert gate.state.waiting == (R3,) and gate.state.loading == (R1,)
    gate.leave(R1)
    assert await third == Admitted(R3)
    assert gate.state.loading == (R3,)


async def test_a_removed_waiter_returns_removed_at_once() -> None:
    gate = StartupGate(1)
    await gate.wait_turn(R1, limit_s=10, on_queued=lambda _: None, poll_s=5)
    waiter = asyncio.create_task(gate.wait_turn(R2, limit_s=10, on_queued=lambda _: None,
                                                poll_s=5))
    await _queued_until(gate, R2)
    assert gate.remove_waiter(R2) is True
    # Woken by the change, not by its 5 s poll.
    assert await asyncio.wait_for(waiter, 1) == Removed(R2)
    assert gate.remove_waiter(R1) is False, "a loader is not a waiter"
    assert gate.state.loading == (R1,)


async def test_a_waiter_times_out_and_leaves() -> None:
    now = [0.0]
    gate = StartupGate(1, clock=lambda: now[0])
    await gate.wait_turn(R1, limit_s=10, on_queued=lambda _: None, poll_s=0.01)

    def tick(_: Queued) -> None:
        now[0] += 1.0

    outcome = await gate.wait_turn(R2, limit_s=3, on_queued=tick, poll_s=0.01)
    assert isinstance(outcome, TimedOut) and outcome.waited_s == 3.0
    assert gate.state.waiting == ()


# -- the start_shard activity: what it tells the gate and its heartbeat --------------------


class _QueuedRunner(StubRunner):
    """A shard runner whose start is queued once, then ready."""

    def __init__(self) -> None:
        self.answer_within_s: float | None = None

    async def start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                    on_queued: Callable[[int, list[ReplicaId]], None] | None = None,
                    answer_within_s: float | None = None) -> ShardEndpoint:
        self.answer_within_s = answer_within_s
        assert on_queued is not None
        on_queued(1, [R1])
        return ShardEndpoint(replica_id=spec.replica_id, node_id=spec.node_id, rank=0,
                             url=None, port=1, pid=1)


async def test_start_shard_bounds_the_queue_by_its_start_to_close_and_heartbeats_it() -> None:
    env, beats = heartbeat_env(start_to_close_timeout=timedelta(seconds=630))
    runner = _QueuedRunner()
    await env.run(NodeActivities(runner).start_shard,
                  StartShardInput(spec=_spec(EngineKind.SIM, MIB)))
    assert runner.answer_within_s == 630.0
    assert beats == [(StartQueued(position=1, waiting_for=[R1]),)]
