"""The liveness rules (modelkeeper.domain.liveness), stepped at chosen times, one test per
rule in the module's order; and a silent node reads unreachable."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from modelkeeper.domain.liveness import (
    CameBack,
    Checked,
    Ended,
    Ending,
    LivenessEvent,
    NodeLiveness,
    Opened,
    Pinged,
    Verdict,
    WentSilent,
    check_at,
    is_current,
    step,
)
from modelkeeper.domain.nodes import NodeRecord, NodeState, node_state

pytestmark = pytest.mark.timeout(10)

SILENT_AFTER = 1.5


def run(events: list[LivenessEvent], state: NodeLiveness | None = None,
        ) -> tuple[NodeLiveness | None, list[Verdict]]:
    verdicts = []
    for event in events:
        state, verdict = step(state, event, silent_after_s=SILENT_AFTER)
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
    assert check_at(state, silent_after_s=SILENT_AFTER) == 2.5
    # Silent at 2.5 (no ping since 1.0); a ping at 4.0 brings it back after 1.5 s.
    state, verdicts = run([Checked(1, 2.5), Pinged(1, 4.0)], state)
    assert verdicts == [WentSilent("no ping for 1.5s (silent after 1.5s)"), CameBack(1.5)]
    assert state == NodeLiveness(stream=1, last_ping_at=4.0)
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
    assert check_at(state, silent_after_s=SILENT_AFTER) is None


def test_4_a_stream_that_breaks_without_bye_is_silence_at_once() -> None:
    state, verdicts = run([Opened(1, 0.0), Pinged(1, 0.5), Ended(1, 0.6, Ending.BROKEN)])
    assert verdicts == [WentSilent("its liveness stream broke without a goodbye")]
    assert state == NodeLiveness(stream=1, last_ping_at=0.5, silent_since=0.6)


def test_5_bye_is_a_planned_stop_never_silence() -> None:
    state, verdicts = run([Opened(1, 0.0), Pinged(1, 0.5), Ended(1, 0.7, Ending.BYE)])
    assert (state, verdicts) == (None, [])
    assert check_at(state, silent_after_s=SILENT_AFTER) is None
    # A frozen agent that thaws and says bye at once was alive to say it: back, then gone.
    state, verdicts = run([Opened(1, 0.0), Checked(1, 2.0), Ended(1, 5.0, Ending.BYE)])
    assert state is None
    assert verdicts == [WentSilent("no ping for 2.0s (silent after 1.5s)"), CameBack(3.0)]


def test_6_the_api_closing_says_nothing_about_the_node() -> None:
    assert run([Opened(1, 0.0), Pinged(1, 0.5), Ended(1, 0.6, Ending.API_CLOSING)]) == (
        None, [])


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
