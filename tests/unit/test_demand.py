"""The scaling rules of modelkeeper.domain.demand, each step-tested with time as an
argument, and a simulation: whatever the gateways report, the rules never go above max or
below min, and never stop or sleep a replica nobody reports (unknown is not idle)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from modelkeeper.domain.demand import (
    Add,
    DemandSample,
    DemandView,
    Pressure,
    ReplicaStanding,
    ReplicaUse,
    Retire,
    ScalingPolicy,
    Sleep,
    Standing,
    Wake,
    step,
)
from modelkeeper.domain.ids import DeploymentId, ReplicaId

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=2, idle_timeout_s=600)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def rid(name: str) -> ReplicaId:
    return ReplicaId(name)


def replica(name: str, standing: Standing = Standing.READY, *, ready_at: float | None = 0,
            asleep_since: float | None = None, standby: bool = False) -> ReplicaStanding:
    return ReplicaStanding(
        replica_id=rid(name), standing=standing,
        ready_at=None if ready_at is None else at(ready_at),
        asleep_since=None if asleep_since is None else at(asleep_since), standby=standby)


def view(policy: ScalingPolicy, desired: int, *replicas: ReplicaStanding,
         last_change_at: float | None = None, can_sleep: bool = False) -> DemandView:
    return DemandView(deployment_id=DeploymentId("d-1"), policy=policy, desired=desired,
                      replicas=list(replicas), can_sleep=can_sleep,
                      last_change_at=None if last_change_at is None else at(last_change_at))


def use(name: str, *, in_flight: int = 0, last_used: float | None = None,
        since: float = 0) -> ReplicaUse:
    return ReplicaUse(replica_id=rid(name), in_flight=in_flight,
                      last_used_at=None if last_used is None else at(last_used),
                      reporting_since=at(since))


def sample(now: float, *uses: ReplicaUse, waiting: int = 0) -> DemandSample:
    return DemandSample(at=at(now), waiting=waiting, replicas=list(uses))


def decide(v: DemandView, s: DemandSample, pressure: Pressure | None = None
           ) -> Add | Retire | Sleep | Wake | None:
    return step(v, s, pressure or Pressure(), now=s.at)[1]


# -- rule 1: unknown is not idle ---------------------------------------------------------------


def test_rule1_a_replica_nobody_reports_is_never_stopped_or_slept() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=60,
                           sleep_after_s=30)
    v = view(policy, 1, replica("r1"), can_sleep=True)
    assert decide(v, sample(10_000)) is None
    # Reported by one gateway: idle since it was last used.
    assert isinstance(decide(v, sample(10_000, use("r1", last_used=0))), Sleep)


def test_rule1_the_idle_clock_starts_when_the_last_gateway_began_reporting() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=60)
    v = view(policy, 1, replica("r1"))
    # Last used at 0, but a gateway began reporting at 100: it knows nothing before.
    reported = use("r1", last_used=0, since=100)
    assert decide(v, sample(159, reported)) is None
    assert decide(v, sample(160, reported)) == Retire(replica_id=rid("r1"),
                                                      reason="idle: unused for 60 s")


def test_rule1_a_request_in_flight_is_use_whatever_the_last_use_says() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=60)
    v = view(policy, 1, replica("r1"))
    assert decide(v, sample(1000, use("r1", in_flight=1, last_used=0))) is None


def test_rule1_the_idle_clock_starts_no_earlier_than_the_replica_became_ready() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=60)
    v = view(policy, 1, replica("r1", ready_at=500))
    assert decide(v, sample(559, use("r1"))) is None
    assert isinstance(decide(v, sample(560, use("r1"))), Retire)


# -- rule 2: asked for, none ready -------------------------------------------------------------


def test_rule2_a_request_for_an_on_demand_model_at_zero_loads_it_once() -> None:
    v = view(ON_DEMAND, 0)
    assert decide(v, sample(0, waiting=3)) == Add(reason="loading: 3 request(s) waiting")
    # Once one is on its way, a thousand more requests add nothing.
    coming = view(ON_DEMAND, 1, replica("r1", Standing.ON_ITS_WAY, ready_at=None))
    assert decide(coming, sample(1, waiting=1000)) is None


def test_rule2_a_model_without_an_on_demand_policy_is_never_loaded_by_a_request() -> None:
    for policy in (ScalingPolicy.fixed(0), ScalingPolicy.fixed(1)):
        assert decide(view(policy, policy.min_replicas), sample(0, waiting=5)) is None


def test_rule2_wakes_a_sleeper_before_loading_and_an_ordinary_one_before_a_standby() -> None:
    v = view(ON_DEMAND, 2, replica("a", Standing.SLEEPING, asleep_since=0, standby=True),
             replica("b", Standing.SLEEPING, asleep_since=0), can_sleep=True)
    assert decide(v, sample(10, waiting=1)) == Wake(replica_id=rid("b"),
                                                    reason="1 request(s) waiting")
    waking = view(ON_DEMAND, 2, replica("a", Standing.SLEEPING, asleep_since=0),
                  replica("b", Standing.ON_ITS_WAY), can_sleep=True)
    assert decide(waking, sample(10, waiting=1)) is None


def test_rule2_while_requests_wait_for_a_replica_on_its_way_nothing_is_stopped() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, idle_timeout_s=1,
                           sleep_after_s=0.5)
    v = view(policy, 2, replica("a", Standing.SLEEPING, asleep_since=0),
             replica("b", Standing.ON_ITS_WAY), can_sleep=True)
    assert decide(v, sample(10_000, waiting=1)) is None


# -- rule 3: grow ------------------------------------------------------------------------------


def test_rule3_waiting_held_for_the_period_adds_one_and_a_break_starts_it_again() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_up_waiting=2,
                           scale_up_after_s=60)
    v = view(policy, 1, replica("r1"))
    busy = [use("r1", in_flight=4)]
    pressure, found = step(v, sample(0, *busy, waiting=2), Pressure(), now=at(0))
    assert found is None and pressure.busy_since == at(0)
    pressure, found = step(v, sample(59, *busy, waiting=3), pressure, now=at(59))
    assert found is None
    # One sample below the threshold breaks it.
    broken, found = step(v, sample(59.5, *busy, waiting=1), pressure, now=at(59.5))
    assert found is None and broken.busy_since is None
    assert step(v, sample(60, *busy, waiting=2), broken, now=at(60))[1] is None
    after, found = step(v, sample(60, *busy, waiting=2), pressure, now=at(60))
    assert isinstance(found, Add) and "2 waiting on 1 ready for 60 s" in found.reason
    assert after.busy_since is None, "the next addition needs a period of its own"


def test_rule3_counts_the_engines_queue_too() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, scale_up_after_s=0)
    v = view(policy, 1, replica("r1"))
    s = DemandSample(at=at(0), engine_waiting=1, replicas=[use("r1", in_flight=8)])
    assert isinstance(decide(v, s), Add)


def test_rule3_requests_queued_in_the_engines_alone_held_for_the_period_grow() -> None:
    """The gateway forwards at once while a replica is ready, so under load its own
    waiting count stays 0 and the requests wait in the engines' queues (vLLM's
    --max-num-seqs): those alone, per ready replica, drive a Grow."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_up_waiting=2,
                           scale_up_after_s=60)
    v = view(policy, 2, replica("r1"), replica("r2"))
    busy = (use("r1", in_flight=6), use("r2", in_flight=6))

    def queued(now: float, engine_waiting: int) -> DemandSample:
        return DemandSample(at=at(now), engine_waiting=engine_waiting, replicas=list(busy))

    pressure, found = step(v, queued(0, 4), Pressure(), now=at(0))
    assert found is None and pressure.busy_since == at(0) and pressure.quiet_since is None
    # 3 queued on 2 ready is below 2 per replica: the period starts again.
    broken, _ = step(v, queued(30, 3), pressure, now=at(30))
    assert broken.busy_since is None
    _, found = step(v, queued(60, 4), pressure, now=at(60))
    assert isinstance(found, Add) and "4 waiting on 2 ready for 60 s" in found.reason


def test_rule2_only_the_gateways_own_waiting_asks_for_a_load_or_a_wake() -> None:
    """An engine's queue with no ready replica (a stale row of one going away) asks for
    nothing: only requests held at the gateways say the model is wanted and unserved."""
    v = view(ON_DEMAND, 0, replica("a", Standing.SLEEPING, asleep_since=0), can_sleep=True)
    assert decide(v, DemandSample(at=at(1), engine_waiting=5)) is None
    assert isinstance(decide(v, DemandSample(at=at(1), waiting=1)), Wake)


def test_rule4_a_queue_in_an_engine_is_not_quiet() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_down_after_s=600)
    v = view(policy, 2, replica("a"), replica("b"), last_change_at=0)
    uses = [use("a", in_flight=1), use("b")]
    pressure, _ = step(v, DemandSample(at=at(0), engine_waiting=1, replicas=uses),
                       Pressure(), now=at(0))
    assert pressure.quiet_since is None
    assert step(v, DemandSample(at=at(600), engine_waiting=1, replicas=uses),
                Pressure(quiet_since=at(0)), now=at(600))[1] is None


def test_rule3_never_above_max_nor_while_the_last_addition_is_on_its_way() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, scale_up_after_s=0)
    busy = sample(0, use("r1", in_flight=5), waiting=5)
    assert decide(view(policy, 2, replica("r1"), replica("r2")), busy) is None
    assert decide(view(policy, 2, replica("r1"),
                       replica("r2", Standing.ON_ITS_WAY, ready_at=None)), busy) is None


# -- rule 4: shrink ----------------------------------------------------------------------------


def test_rule4_a_quiet_period_retires_the_replica_idle_longest() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_down_after_s=600)
    v = view(policy, 2, replica("a"), replica("b"), last_change_at=0)
    uses = (use("a", last_used=500), use("b", last_used=100))
    pressure, found = step(v, sample(0, *uses), Pressure(), now=at(0))
    assert found is None and pressure.quiet_since == at(0)
    assert step(v, sample(599, *uses), pressure, now=at(599))[1] is None
    _, found = step(v, sample(600, *uses), pressure, now=at(600))
    assert isinstance(found, Retire) and found.replica_id == "b"
    assert "quiet: nothing waiting for 10 min" in found.reason


def test_rule4_with_no_quiet_period_still_never_shrinks_while_requests_wait() -> None:
    """scale_down_after_s 0: a quiet period that never began must not count as held for
    0 s (found by a seeded simulation: 5 waiting on 2 ready retired one)."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_down_after_s=0)
    v = view(policy, 2, replica("a"), replica("b"), last_change_at=0)
    idle = (use("a"), use("b", last_used=100))
    assert step(v, sample(600, *idle, waiting=5), Pressure(), now=at(600))[1] is None
    assert isinstance(step(v, sample(600, *idle), Pressure(), now=at(600))[1], Retire)


def test_rule4_waits_as_long_since_the_last_change() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_down_after_s=600)
    v = view(policy, 2, replica("a"), replica("b"), last_change_at=300)
    pressure = Pressure(quiet_since=at(0))
    uses = (use("a"), use("b"))
    assert step(v, sample(899, *uses), pressure, now=at(899))[1] is None
    assert isinstance(step(v, sample(900, *uses), pressure, now=at(900))[1], Retire)


def test_rule4_never_a_replica_in_use_or_unreported_nor_below_the_minimum() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=3, scale_down_after_s=60)
    quiet = Pressure(quiet_since=at(0))
    v = view(policy, 2, replica("a"), replica("b"))
    # a is busy, b unreported: no victim.
    assert step(v, sample(100, use("a", in_flight=1)), quiet, now=at(100))[1] is None
    # At the minimum: none.
    one = view(policy, 1, replica("a"))
    assert step(one, sample(100, use("a")), quiet, now=at(100))[1] is None


def test_rule4_never_takes_the_last_replica_of_a_model_in_use() -> None:
    """Nothing waiting is also what light use looks like: rule 4 takes back what load
    added; zero is the idle stop's (rule 6), which asks for no use at all. (Before the
    fix, a min-0 model served all day was stopped every scale_down_after_s.)"""
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, scale_down_after_s=60)
    quiet = Pressure(quiet_since=at(0))
    v = view(policy, 1, replica("a"))
    assert step(v, sample(1000, use("a", last_used=999)), quiet, now=at(1000))[1] is None
    two = view(policy, 2, replica("a"), replica("b"))
    _, found = step(two, sample(1000, use("a", last_used=999), use("b", last_used=10)),
                    quiet, now=at(1000))
    assert isinstance(found, Retire) and found.replica_id == "b"


# -- rule 5: sleep -----------------------------------------------------------------------------


def test_rule5_an_unused_replica_sleeps_where_the_engine_can() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, sleep_after_s=30,
                           idle_timeout_s=300)
    v = view(policy, 1, replica("a"), can_sleep=True)
    assert decide(v, sample(29, use("a"))) is None
    assert decide(v, sample(30, use("a"))) == Sleep(replica_id=rid("a"),
                                                   reason="unused for 30 s")
    # llama.cpp cannot sleep: rule 6 stops it later instead.
    cannot = view(policy, 1, replica("a"), can_sleep=False)
    assert decide(cannot, sample(30, use("a"))) is None
    assert isinstance(decide(cannot, sample(300, use("a"))), Retire)


def test_rule5_a_sleeper_does_not_keep_the_minimums_promise() -> None:
    """Before the fix, with min 1 and one replica already asleep, the last awake one was
    slept (or stopped) too, leaving none to serve."""
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, sleep_after_s=30,
                           idle_timeout_s=300)
    v = view(policy, 2, replica("a"), replica("b", Standing.SLEEPING, asleep_since=250),
             can_sleep=True)
    assert decide(v, sample(260, use("a"))) is None
    # The sleeper itself is stopped once asleep long enough (300 - 30 s).
    assert decide(v, sample(519, use("a"))) is None
    assert decide(v, sample(520, use("a"))) == Retire(replica_id=rid("b"),
                                                      reason="idle: asleep for 4 min")


# -- rule 6: idle stop -------------------------------------------------------------------------


def test_rule6_an_idle_replica_above_the_minimum_is_stopped() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, idle_timeout_s=60,
                           scale_down_after_s=10_000)
    v = view(policy, 2, replica("a"), replica("b"))
    s = sample(100, use("a", last_used=90), use("b", last_used=30))
    assert decide(v, s) == Retire(replica_id=rid("b"), reason="idle: unused for 70 s")
    # The minimum is a promise: the last one stays however idle.
    assert decide(view(policy, 1, replica("a")), sample(10_000, use("a"))) is None


def test_rule6_a_standby_sleeper_is_never_stopped_idle() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, sleep_after_s=10,
                           idle_timeout_s=20, warm_standby=1)
    v = view(policy, 1, replica("s", Standing.SLEEPING, asleep_since=0, standby=True),
             can_sleep=True)
    assert decide(v, sample(10_000)) is None


# -- a simulation ------------------------------------------------------------------------------


policies = st.builds(
    lambda lo, extra, idle, sleep, can: (ScalingPolicy(
        min_replicas=lo, max_replicas=lo + extra, idle_timeout_s=idle,
        sleep_after_s=sleep if (sleep is not None and (idle is None or sleep < idle))
        else None, scale_up_after_s=5, scale_down_after_s=20, scale_up_waiting=1), can),
    st.integers(0, 2), st.integers(0, 3), st.one_of(st.none(), st.sampled_from([15.0, 40.0])),
    st.one_of(st.none(), st.sampled_from([5.0, 30.0])), st.booleans())

#: Each tick of the simulation: requests waiting, and per replica slot whether it is
#: reported, how many requests it has in flight, and whether one ended there since the
#: last tick. Mostly unused, so that the idle rules get their turn.
ticks = st.lists(st.tuples(st.integers(0, 4),
                           st.lists(st.tuples(st.booleans(), st.sampled_from([0, 0, 0, 1, 2]),
                                              st.sampled_from([False, False, False, True])),
                                    min_size=6, max_size=6)),
                 min_size=1, max_size=50)


@settings(max_examples=150, deadline=None)
@given(policy_and_sleep=policies, script=ticks)
def test_simulated_demand_stays_within_bounds_and_never_touches_the_unknown(
        policy_and_sleep: tuple[ScalingPolicy, bool],
        script: list[tuple[int, list[tuple[bool, int, bool]]]]) -> None:
    policy, can_sleep = policy_and_sleep
    replicas = [replica(f"r{i}") for i in range(policy.min_replicas)]
    desired = policy.min_replicas
    pressure = Pressure()
    last_change: datetime | None = None
    born = len(replicas)
    last_used: dict[ReplicaId, float] = {}
    for tick, (waiting, reports) in enumerate(script):
        now = tick * 3.0
        # What was on its way is ready by the next tick.
        replicas = [r.model_copy(update={"standing": Standing.READY, "ready_at": at(now)})
                    if r.standing is Standing.ON_ITS_WAY else r for r in replicas]
        uses = []
        for r, (reported, n, used) in zip(replicas, reports, strict=False):
            if used or n:
                last_used[r.replica_id] = now
            if reported and r.standing is Standing.READY:
                uses.append(use(r.replica_id, in_flight=n,
                                last_used=last_used.get(r.replica_id), since=0))
        v = DemandView(deployment_id=DeploymentId("d"), policy=policy, desired=desired,
                       replicas=replicas, can_sleep=can_sleep, last_change_at=last_change)
        s = DemandSample(at=at(now), waiting=waiting, replicas=uses)
        pressure, found = step(v, s, pressure, now=at(now))
        awake = sum(1 for r in replicas
                    if r.standing in (Standing.READY, Standing.ON_ITS_WAY))
        match found:
            case Add():
                assert desired < policy.max_replicas
                assert policy.on_demand or desired > 0, "no policy: never loaded on demand"
                replicas = [*replicas, replica(f"r{born}", Standing.ON_ITS_WAY,
                                               ready_at=None)]
                born += 1
                desired += 1
            case Retire(replica_id=victim) | Sleep(replica_id=victim):
                target = next(r for r in replicas if r.replica_id == victim)
                if target.standing is Standing.READY:
                    report = s.use_of(victim)
                    assert report is not None, f"{found} of an unreported replica"
                    assert report.in_flight == 0, f"{found} of a replica in use"
                    assert awake > policy.min_replicas, f"{found} below the minimum"
                else:
                    assert target.standing is Standing.SLEEPING and not target.standby
                if isinstance(found, Retire):
                    assert desired > policy.min_replicas
                    replicas = [r for r in replicas if r.replica_id != victim]
                    desired -= 1
                else:
                    assert can_sleep and policy.sleep_after_s is not None
                    replicas = [r.model_copy(update={"standing": Standing.SLEEPING,
                                                     "asleep_since": at(now)})
                                if r.replica_id == victim else r for r in replicas]
            case Wake(replica_id=woken):
                replicas = [r.model_copy(update={"standing": Standing.ON_ITS_WAY,
                                                 "asleep_since": None})
                            if r.replica_id == woken else r for r in replicas]
            case None:
                pass
        if found is not None and not isinstance(found, Wake):
            last_change = at(now)
        assert policy.min_replicas <= desired <= policy.max_replicas
