"""The liveness rules (modelkeeper.domain.liveness), stepped at chosen times, one test per
rule in the module's order; and a silent node reads unreachable."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest

from api.liveness import LoopLag
from modelkeeper.domain.liveness import (
    CameBack,
    Checked,
    Deadlines,
    Ended,
    Ending,
    LivenessEvent,
    NodeLiveness,
    Opened,
    Pinged,
    Verdict,
    WentSilent,
    check_at,
    deadline_s,
    is_current,
    step,
)
from modelkeeper.domain.nodes import NodeRecord, NodeState, node_state

pytestmark = pytest.mark.timeout(10)

SILENT_AFTER = 1.5
#: The settings' defaults: 1.5 s, stretched at most to 6 s, halved after each calm minute.
DEADLINES = Deadlines(silent_after_s=SILENT_AFTER, max_silent_after_s=6.0, calm_after_s=60.0)


def run(events: list[LivenessEvent], state: NodeLiveness | None = None,
        ) -> tuple[NodeLiveness | None, list[Verdict]]:
    verdicts = []
    for event in events:
        state, verdict = step(state, event, deadlines=DEADLINES)
        if verdict is not None:
            verdicts.append(verdict)
    return state, verdicts


def test_1_only_the_newest_stream_counts() -> None:
    # Stream 1 goes half-open; stream 2 replaces it and pings. Stream 1's silence, or its
    # break, says nothing: the node is alive.
    state, verdicts = run([Opened(1, 0.0), Opened(2, 0.4), Pinged(2, 0.9), Checked(1, 1.6),
                           Ended(1, 1.7, Ending.BROKEN), Pinged(2, 1.9)])
    assert verdicts == []
    assert state == NodeLiveness(stream=2, last_ping_at=1.9)
    assert is_current(state, 2) and not is_current(state, 1) and not is_current(None, 2)
    # Events of a stream the API no longer follows (the node said bye) change nothing.
    assert run([Pinged(3, 5.0), Checked(3, 9.0), Ended(3, 9.0, Ending.BROKEN)]) == (None, [])


def test_2_an_opening_or_a_ping_is_proof_of_life_and_ends_a_silence() -> None:
    state, verdicts = run([Opened(1, 0.0), Pinged(1, 0.5), Pinged(1, 1.0)])
    assert verdicts == [] and state == NodeLiveness(stream=1, last_ping_at=1.0)
    assert check_at(state, deadlines=DEADLINES) == 2.5
    # Silent at 2.5 (no ping since 1.0); a ping at 4.0 brings it back after 1.5 s (and, by
    # rule 8, with its deadline doubled).
    state, verdicts = run([Checked(1, 2.5), Pinged(1, 4.0)], state)
    assert verdicts == [WentSilent("no ping for 1.5s (silent after 1.5s)"), CameBack(1.5)]
    assert state == NodeLiveness(stream=1, last_ping_at=4.0, stretch=1, stretched_at=4.0)
    # A silent node that opens a new stream comes back too.
    state, verdicts = run([Opened(1, 0.0), Ended(1, 0.1, Ending.BROKEN), Opened(2, 0.3)])
    assert verdicts == [WentSilent("its liveness stream broke without a goodbye"),
                        CameBack(pytest.approx(0.2))]
    assert state == NodeLiveness(stream=2, last_ping_at=0.3)


@pytest.mark.parametrize(("checked_at", "silent"),
                         [(0.5, False), (1.49, False), (1.5, True), (7.0, True)])
def test_3_no_ping_for_silent_after_makes_the_node_silent(checked_at: float,
                                                          silent: bool) -> None:
    state, verdicts = run([Opened(1, 0.0), Checked(1, checked_at)])
    assert bool(verdicts) is silent
    assert state is not None and (state.silent_since == checked_at if silent
                                  else state.silent_since is None)


def test_3_a_silence_is_told_once() -> None:
    state, verdicts = run([Opened(1, 0.0), Checked(1, 1.5), Checked(1, 3.0),
                           Checked(1, 9.0), Ended(1, 9.5, Ending.BROKEN)])
    assert len(verdicts) == 1
    assert state is not None and state.silent_since == 1.5
    # Nothing more is due until a sign of life.
    assert check_at(state, deadlines=DEADLINES) is None


def test_4_a_stream_that_breaks_without_bye_is_silence_at_once() -> None:
    state, verdicts = run([Opened(1, 0.0), Pinged(1, 0.5), Ended(1, 0.6, Ending.BROKEN)])
    assert verdicts == [WentSilent("its liveness stream broke without a goodbye")]
    assert state == NodeLiveness(stream=1, last_ping_at=0.5, silent_since=0.6)


def test_5_bye_is_a_planned_stop_never_silence() -> None:
    state, verdicts = run([Opened(1, 0.0), Pinged(1, 0.5), Ended(1, 0.7, Ending.BYE)])
    assert (state, verdicts) == (None, [])
    assert check_at(state, deadlines=DEADLINES) is None
    # A frozen agent that thaws and says bye at once was alive to say it: back, then gone.
    state, verdicts = run([Opened(1, 0.0), Checked(1, 2.0), Ended(1, 5.0, Ending.BYE)])
    assert state is None
    assert verdicts == [WentSilent("no ping for 2.0s (silent after 1.5s)"), CameBack(3.0)]


def test_6_the_api_closing_says_nothing_about_the_node() -> None:
    assert run([Opened(1, 0.0), Pinged(1, 0.5), Ended(1, 0.6, Ending.API_CLOSING)]) == (
        None, [])


def simulate(pings: list[float], *, until: float, state: NodeLiveness | None = None,
             ) -> tuple[NodeLiveness | None, list[tuple[float, Verdict]]]:
    """Step a node whose stream (1) opened at 0 and carries ``pings``, the way the API does:
    a check at each ``check_at`` that comes before the next ping."""
    told: list[tuple[float, Verdict]] = []
    events: list[LivenessEvent] = [] if state is not None else [Opened(1, 0.0)]
    queue = sorted(pings)
    while True:
        for event in events:
            state, verdict = step(state, event, deadlines=DEADLINES)
            if verdict is not None:
                told.append((event.now, verdict))
        due = check_at(state, deadlines=DEADLINES)
        upcoming = queue[0] if queue else until
        if due is not None and due < upcoming:
            events = [Checked(1, due)]
        elif queue:
            events = [Pinged(1, queue.pop(0))]
        else:
            return state, told


def test_7_a_node_whose_pings_come_late_is_told_once_not_every_time() -> None:
    # A ping late by 1.5 s every other time for a minute (an agent on a loaded machine):
    # gaps of 0.5 and 2.0 s. Without damping each 2 s gap is a silence.
    pings, at = [], 0.0
    while at < 60:
        at += 0.5 if len(pings) % 2 == 0 else 2.0
        pings.append(at)
    state, told = simulate(pings, until=60.0)
    assert [type(v) for _, v in told] == [WentSilent, CameBack]
    assert state is not None and deadline_s(state, DEADLINES) == 3.0
    # Gaps longer than the stretched deadline stretch it again, up to the most allowed.
    state, told = simulate([2.0, 6.0, 13.0, 14.0], until=14.0)
    assert [round(t, 1) for t, v in told if isinstance(v, WentSilent)] == [1.5, 5.0, 12.0]
    assert told[1] == (2.0, CameBack(0.5)) and told[3] == (6.0, CameBack(1.0))
    assert told[2][1] == WentSilent("no ping for 3.0s (silent after 3s, stretched from 1.5s: "
                                    "it came back quickly before)")
    assert state is not None and deadline_s(state, DEADLINES) == 6.0


def test_7_a_calm_minute_halves_a_stretched_deadline() -> None:
    stretched = NodeLiveness(stream=1, last_ping_at=10.0, stretch=2, stretched_at=10.0)
    assert deadline_s(stretched, DEADLINES) == 6.0
    state, _ = simulate([10.5 + 0.5 * i for i in range(120)], until=70.0, state=stretched)
    assert state is not None and deadline_s(state, DEADLINES) == 3.0  # one calm minute
    state, _ = simulate([70.5 + 0.5 * i for i in range(120)], until=130.5, state=state)
    assert state is not None and deadline_s(state, DEADLINES) == SILENT_AFTER


@pytest.mark.parametrize("how_it_went", ["a long silence", "a broken stream"])
def test_7_a_real_outage_is_not_damped(how_it_went: str) -> None:
    # A freeze longer than the most a deadline stretches, or a crash (a broken stream and a
    # new agent's stream), is an outage, not a late ping: the deadline stays.
    if how_it_went == "a long silence":
        events: list[LivenessEvent] = [Opened(1, 0.0), Checked(1, 1.5), Pinged(1, 7.5)]
    else:
        events = [Opened(1, 0.0), Ended(1, 0.6, Ending.BROKEN), Opened(2, 1.0)]
    state, verdicts = run(events)
    assert [type(v) for v in verdicts] == [WentSilent, CameBack]
    assert state is not None and deadline_s(state, DEADLINES) == SILENT_AFTER


def test_7_damping_outlives_a_new_stream_and_never_slows_a_crash() -> None:
    state, _ = run([Opened(1, 0.0), Checked(1, 1.5), Pinged(1, 2.0), Opened(2, 2.2)])
    assert state is not None and state.stream == 2 and deadline_s(state, DEADLINES) == 3.0
    # Stretched, and still silent the moment its stream breaks.
    state, verdicts = run([Ended(2, 2.4, Ending.BROKEN)], state)
    assert verdicts == [WentSilent("its liveness stream broke without a goodbye")]


def test_8_the_apis_own_lag_is_not_the_nodes_silence() -> None:
    # The API ran 0.8 s behind: a check at the deadline finds the ping missing, but the
    # node is given its deadline plus that lag, and check_at says when that is.
    opened, _ = run([Opened(1, 0.0)])
    assert check_at(opened, deadlines=DEADLINES, lag_s=0.8) == pytest.approx(2.3)
    state, verdicts = run([Checked(1, 1.5, lag_s=0.8), Pinged(1, 2.0)], opened)
    assert verdicts == []
    assert state is not None and deadline_s(state, DEADLINES) == SILENT_AFTER  # not damped
    # Quiet past the deadline and the lag: silent, and the reason says the API lagged.
    _, verdicts = run([Checked(1, 2.3, lag_s=0.8)], opened)
    assert verdicts == [WentSilent("no ping for 2.3s (silent after 1.5s; the API itself "
                                   "ran 0.8s behind)")]
    # A quick API adds nothing (the lag a check reports is the API's, not a ping's).
    _, verdicts = run([Checked(1, 1.5, lag_s=0.0)], opened)
    assert [type(v) for v in verdicts] == [WentSilent]


def test_8_a_lagging_api_finds_a_freeze_late_by_at_most_max_silent_after() -> None:
    opened, _ = run([Opened(1, 0.0)])
    # An API 60 s behind still finds a frozen node 1.5 + 6 s after its last ping.
    assert check_at(opened, deadlines=DEADLINES, lag_s=60.0) == pytest.approx(7.5)
    _, verdicts = run([Checked(1, 7.4, lag_s=60.0)], opened)
    assert verdicts == []
    _, verdicts = run([Checked(1, 7.5, lag_s=60.0)], opened)
    assert [type(v) for v in verdicts] == [WentSilent]
    # A broken stream is silence at once, however far behind the API runs.
    _, verdicts = run([Ended(1, 0.1, Ending.BROKEN)], opened)
    assert verdicts == [WentSilent("its liveness stream broke without a goodbye")]


def test_deadlines_refuse_a_most_below_the_base() -> None:
    with pytest.raises(ValueError, match=r"max_silent_after_s \(1\) must be at least "
                                         r"silent_after_s \(1.5\)"):
        Deadlines(silent_after_s=1.5, max_silent_after_s=1.0, calm_after_s=60.0)


def _record(silent_since: datetime | None, *, seen_ago: float = 0.5,
            cordoned: bool = False) -> tuple[NodeRecord, datetime]:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return NodeRecord(node_id="n", name="n", agent_labels={}, operator_labels={},
                      cordoned=cordoned, cordon_reason=None, memory_total_bytes=None,
                      memory_available_bytes=None, cpu_count=None, gpus=[],
                      last_seen=now - timedelta(seconds=seen_ago), registered_at=now,
                      silent_since=silent_since), now


@pytest.mark.parametrize(
    ("silent", "seen_ago", "cordoned", "state"),
    [(False, 0.5, False, NodeState.READY), (True, 0.5, False, NodeState.UNREACHABLE),
     (False, 6.0, False, NodeState.UNREACHABLE), (True, 60.0, False, NodeState.LOST),
     (True, 0.5, True, NodeState.CORDONED)],
)
def test_a_silent_node_is_unreachable_and_the_time_rules_still_hold(
    silent: bool, seen_ago: float, cordoned: bool, state: NodeState,
) -> None:
    record, now = _record(datetime(2026, 1, 1, tzinfo=UTC) if silent else None,
                          seen_ago=seen_ago, cordoned=cordoned)
    assert node_state(record, now, unreachable_after_s=6, lost_after_s=60) is state


def test_loop_lag_is_the_most_of_its_window() -> None:
    lag = LoopLag(sample_s=0.1, window_s=10.0)
    assert lag.recent_s(0.0) == 0.0
    for at, late in [(1.0, 0.2), (2.0, 0.9), (3.0, 0.1), (4.0, 0.3)]:
        lag.record(at, late)
    assert lag.recent_s(4.0) == 0.9
    assert lag.recent_s(11.9) == 0.9  # 2.0 is still inside the window
    assert lag.recent_s(12.5) == 0.3  # the 0.9 has left it; 0.3 (at 4.0) is the most since
    assert lag.recent_s(14.5) == 0.0


async def test_loop_lag_sees_a_blocked_loop() -> None:
    lag = LoopLag(sample_s=0.01, window_s=10.0)
    sampling = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)  # a few samples of an idle loop
        time.sleep(0.3)  # the loop blocked, as a burst of work on its thread would
        await asyncio.sleep(0.05)  # the next sample lands
        assert lag.recent_s(time.monotonic()) >= 0.25
    finally:
        sampling.cancel()
