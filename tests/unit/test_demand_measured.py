"""Rules 3 and 4 of modelkeeper.domain.demand with a measured concurrency
(modelkeeper.domain.measured): requests per ready replica beyond it add one; a replica is
removed only if the rest would stay under 70 % of theirs. Without a measurement the rules
are issue 21's (tests/unit/test_demand.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modelkeeper.domain.demand import (
    Add,
    DemandSample,
    DemandView,
    Pressure,
    Retire,
    ScalingPolicy,
    Sleep,
    Standing,
    Wake,
    step,
)
from modelkeeper.domain.measured import SCALE_IN_FRACTION

from .test_demand import at, decide, replica, rid, use, view

#: 1 to 4 replicas, a minute of pressure to grow, ten quiet minutes to shrink.
POLICY = ScalingPolicy(min_replicas=1, max_replicas=4, scale_up_after_s=60,
                       scale_down_after_s=600)
#: One replica was measured to serve 8 requests at once within its objective.
MEASURED = 8


def measured(now: float, *uses: tuple[str, int], waiting: int = 0,
             concurrency: int | None = MEASURED) -> DemandSample:
    return DemandSample(at=at(now), waiting=waiting, measured_concurrency=concurrency,
                        replicas=[use(name, in_flight=n, last_used=now) for name, n in uses])


def grown(v: DemandView, s: DemandSample) -> Add | Retire | Sleep | Wake | None:
    """The step at ``s.at`` when the same load has held since 0 (the rules' periods)."""
    pressure, first = step(v, s.model_copy(update={"at": at(0)}), Pressure(), now=at(0))
    assert first is None
    return step(v, s, pressure, now=s.at)[1]


def test_more_in_flight_per_replica_than_measured_adds_one() -> None:
    v = view(POLICY, 2, replica("r1"), replica("r2"))
    # 17 in flight on 2 replicas measured at 8: 8.5 each, beyond what one serves.
    step_ = grown(v, measured(60, ("r1", 9), ("r2", 8)))
    assert isinstance(step_, Add)
    assert "17 request(s) on 2 ready" in step_.reason and "> 8 per replica" in step_.reason


def test_at_the_measured_concurrency_nothing_is_added() -> None:
    v = view(POLICY, 2, replica("r1"), replica("r2"))
    # 16 on 2: exactly what they serve; nothing waits at the gateway either.
    assert grown(v, measured(60, ("r1", 8), ("r2", 8))) is None


def test_requests_waiting_at_the_gateway_count_with_those_in_flight() -> None:
    v = view(POLICY, 1, replica("r1"))
    assert grown(v, measured(60, ("r1", 8), waiting=1)) == Add(reason=(
        "9 request(s) on 1 ready for 60 s (> 8 per replica, as measured, for 60 s)"))


def test_the_measurement_replaces_the_waiting_threshold() -> None:
    v = view(POLICY, 2, replica("r1"), replica("r2"))
    # 2 waiting per ready replica adds one by issue 21's rule (scale_up_waiting 1) ...
    unmeasured = measured(60, ("r1", 3), ("r2", 3), waiting=4, concurrency=None)
    assert isinstance(grown(v, unmeasured), Add)
    # ... but 10 requests on 2 replicas measured at 8 each is within what they serve.
    assert grown(v, measured(60, ("r1", 3), ("r2", 3), waiting=4)) is None


def test_growing_still_waits_the_period_and_for_the_last_addition() -> None:
    v = view(POLICY, 2, replica("r1"), replica("r2"))
    assert grown(v, measured(59, ("r1", 9), ("r2", 9))) is None
    coming = view(POLICY, 3, replica("r1"), replica("r2"), replica("r3", Standing.ON_ITS_WAY))
    assert grown(coming, measured(60, ("r1", 9), ("r2", 9))) is None


def test_a_replica_goes_only_if_the_rest_stay_under_70_percent() -> None:
    assert SCALE_IN_FRACTION == 0.7
    v = view(POLICY, 3, replica("r1"), replica("r2"), replica("r3"))
    # The rest (2) at 70 % of 8 serve 11.2: 11 requests stay under it, 12 would not.
    under = measured(600, ("r1", 4), ("r2", 4), ("r3", 3))
    over = measured(600, ("r1", 4), ("r2", 4), ("r3", 4))
    pressure, first = step(v, measured(0, ("r1", 4), ("r2", 4), ("r3", 3)), Pressure(),
                           now=at(0))
    assert first is None
    retire = step(v, under, pressure, now=under.at)[1]
    assert retire == Retire(replica_id=rid("r3"), reason=(
        "11 request(s) would leave the 2 other ready replica(s) under 70% of the measured "
        "8 each, for 10 min; r3 is the least loaded"))
    pressure, _ = step(v, measured(0, ("r1", 4), ("r2", 4), ("r3", 4)), Pressure(), now=at(0))
    assert step(v, over, pressure, now=over.at)[1] is None


def test_removal_under_load_waits_the_quiet_period() -> None:
    v = view(POLICY, 3, replica("r1"), replica("r2"), replica("r3"))
    light = measured(599, ("r1", 1), ("r2", 1), ("r3", 0))
    pressure, _ = step(v, measured(0, ("r1", 1), ("r2", 1)), Pressure(), now=at(0))
    assert step(v, light, pressure, now=light.at)[1] is None


def test_without_a_measurement_a_loaded_replica_is_never_removed() -> None:
    """Issue 21's rule 4 asks for nothing waiting and an unused replica: light load on
    every replica keeps them all."""
    v = view(POLICY, 3, replica("r1"), replica("r2"), replica("r3"))
    loaded = measured(600, ("r1", 1), ("r2", 1), ("r3", 1), concurrency=None)
    pressure, _ = step(v, measured(0, ("r1", 1), ("r2", 1), ("r3", 1), concurrency=None),
                       Pressure(), now=at(0))
    assert step(v, loaded, pressure, now=loaded.at)[1] is None
    # Measured, the same load leaves two replicas far under 70 % of 8: one goes.
    pressure, _ = step(v, measured(0, ("r1", 1), ("r2", 1), ("r3", 1)), Pressure(),
                       now=at(0))
    assert isinstance(step(v, measured(600, ("r1", 1), ("r2", 1), ("r3", 1)), pressure,
                           now=at(600))[1], Retire)


def test_the_last_replica_and_the_minimum_stay() -> None:
    one = view(POLICY, 1, replica("r1"))
    assert decide(one, measured(10_000, ("r1", 0))) is None
    at_min = view(ScalingPolicy(min_replicas=2, max_replicas=4, scale_down_after_s=0), 2,
                  replica("r1"), replica("r2"))
    assert decide(at_min, measured(10_000, ("r1", 0), ("r2", 0))) is None


def test_a_replica_nobody_reports_is_never_the_one_removed() -> None:
    v = view(ScalingPolicy(min_replicas=1, max_replicas=4, scale_down_after_s=0), 2,
             replica("r1"), replica("r2"))
    # r2 is unknown (no row): not idle, not a victim; r1 is the only candidate.
    only_r1 = decide(v, measured(0, ("r1", 2)))
    assert isinstance(only_r1, Retire) and only_r1.replica_id == rid("r1")


# -- simulation: steady load settles inside the band and stays ------------------------------


@settings(max_examples=200, deadline=None, derandomize=True)
@given(load=st.integers(min_value=0, max_value=80), concurrency=st.integers(1, 16),
       start=st.integers(1, 8))
def test_steady_load_settles_between_the_two_lines_and_never_flaps(
        load: int, concurrency: int, start: int) -> None:
    """Whatever the load, the measured concurrency and the replicas it starts with, the
    count settles where no rule fires (the load fits under the measured concurrency, or
    max is reached; one fewer would not stay under 70 %, or one is left) and stays."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=8, scale_up_after_s=0,
                           scale_down_after_s=0)
    names = [f"r{i}" for i in range(start)]
    born, pressure, changes = start, Pressure(), []
    for tick in range(60):
        ready = [replica(n) for n in names]
        v = view(policy, len(names), *ready)
        # The load spread evenly over the ready replicas, as the gateway spreads it.
        share = [load // len(names) + (1 if i < load % len(names) else 0)
                 for i in range(len(names))]
        pressure, found = step(v, measured(tick, *zip(names, share, strict=True),
                                           concurrency=concurrency), pressure, now=at(tick))
        match found:
            case Add():
                names.append(f"r{born}")
                born += 1
                changes.append(tick)
            case Retire(replica_id=victim):
                names.remove(victim)
                changes.append(tick)
    r = len(names)
    assert load <= concurrency * r or r == policy.max_replicas
    assert r == 1 or load >= SCALE_IN_FRACTION * concurrency * (r - 1)
    # Settled within the 7 steps 1 -> 8 takes, then never changed again.
    assert not [t for t in changes if t >= 8], changes
