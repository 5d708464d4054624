"""Preemption: one test per rule 8-12 of modelkeeper.domain.eviction's docstring, the
order of victims, the set stopped together, and headroom (modelkeeper.domain.headroom)."""

from __future__ import annotations

import pytest

from modelkeeper.domain.capacity import CapacityClass, Holding, Limit, Quota, Resources
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.eviction import (
    EvictionChoice,
    NoVictim,
    RefusalReason,
    VictimKind,
)
from modelkeeper.domain.headroom import HEADROOM_CAP, headroom
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.domain.placement import PlacementRequest
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.units import GIB
from tests.support.capacity_sim import (
    ASKER,
    NOW,
    ON_DEMAND,
    PROTECT_S,
    STEADY,
    asker,
    asking,
    candidate,
    choose,
    holdings_of,
    node,
    nodes_holding,
)

pytestmark = pytest.mark.timeout(60)

CRIT, STD, OPP = CapacityClass.CRITICAL, CapacityClass.STANDARD, CapacityClass.OPPORTUNISTIC


def refused(result: EvictionChoice | NoVictim) -> dict[str, RefusalReason]:
    assert isinstance(result, NoVictim), result
    return {r.replica_id: r.reason_code for r in result.refusals}


def victims(result: EvictionChoice | NoVictim) -> dict[str, VictimKind]:
    assert isinstance(result, EvictionChoice), result
    return {v.replica_id: v.kind for v in result.victims}


# -- without an asker: issue 21 unchanged ------------------------------------------------------

def test_without_an_asker_nothing_is_preempted() -> None:
    busy = candidate("busy", gib=16, in_flight=3, policy=STEADY, cls=OPP)
    assert refused(choose(asking(), nodes_holding([busy]), [busy])) == {
        "busy": RefusalReason.NOT_ON_DEMAND}


# -- rule 9: idle on demand, evicted --------------------------------------------------------

def test_rule_9_an_idle_on_demand_replica_is_evicted_not_preempted() -> None:
    idle = candidate("idle", gib=16)
    result = choose(asking(), nodes_holding([idle]), [idle], who=asker(STD))
    assert victims(result) == {"idle": VictimKind.EVICT}
    assert isinstance(result, EvictionChoice) and not result.together
    assert result.reason.startswith("evicted d-idle")


def test_rule_9_an_idle_on_demand_replica_of_a_higher_class_is_not_evicted() -> None:
    idle = candidate("idle", gib=16, cls=CRIT)
    result = choose(asking(), nodes_holding([idle]), [idle], who=asker(STD))
    assert refused(result) == {"idle": RefusalReason.OUTRANKS}
    assert isinstance(result, NoVictim) and "critical outranks standard" in result.reason


# -- rule 11: a lower class --------------------------------------------------------------------

def test_rule_11_a_lower_class_is_preempted_even_in_use() -> None:
    busy = candidate("busy", gib=16, in_flight=3, policy=STEADY, cls=OPP)
    result = choose(asking(), nodes_holding([busy]), [busy], who=asker(CRIT))
    assert victims(result) == {"busy": VictimKind.PREEMPT}
    assert isinstance(result, EvictionChoice) and result.together
    assert "a lower class (opportunistic) than critical" in result.reason
    request = result.victims[0].preempt_request(ASKER)
    assert request.by == ASKER and request.reason.startswith("preempted by d-asked: a lower")


@pytest.mark.parametrize("kw", [{"known": False}, {"ready_min_ago": 1},
                                {"policy": None}])
def test_rule_11_usage_protection_and_promises_do_not_protect_a_lower_class(
    kw: dict[str, object],
) -> None:
    low = candidate("low", gib=16, cls=STD, **kw)  # type: ignore[arg-type]
    assert victims(choose(asking(), nodes_holding([low]), [low], who=asker(CRIT))) == {
        "low": VictimKind.PREEMPT}


@pytest.mark.parametrize("cls", [STD, CRIT])
def test_rule_11_never_the_same_or_a_higher_class(cls: CapacityClass) -> None:
    kept = candidate("kept", gib=16, policy=STEADY, cls=cls)
    result = choose(asking(), nodes_holding([kept]), [kept], who=asker(STD))
    assert refused(result) == {"kept": RefusalReason.NOT_ON_DEMAND}
    assert isinstance(result, NoVictim) and "not preempted" in result.reason


def test_rule_11_the_common_rules_still_hold() -> None:
    own = candidate("own", deployment=ASKER, gib=8, cls=OPP, policy=STEADY)
    starting = candidate("st", gib=8, cls=OPP, policy=STEADY, state=ReplicaState.STARTING)
    nodes = nodes_holding([own, starting])
    assert refused(choose(asking(), nodes, [own, starting], who=asker(CRIT))) == {
        "own": RefusalReason.SAME_DEPLOYMENT, "st": RefusalReason.NOT_SERVING}


# -- rule 12: same class, grown under load -------------------------------------------------------

def test_rule_12_a_replica_grown_under_load_for_a_deployment_below_its_minimum() -> None:
    grown = candidate("g", gib=16, policy=STEADY, running=2, in_flight=1)
    result = choose(asking(), nodes_holding([grown]), [grown],
                    who=asker(STD, replicas=0, min_replicas=1))
    assert victims(result) == {"g": VictimKind.PREEMPT}
    assert isinstance(result, EvictionChoice) and "grown beyond its minimum" in result.reason


def test_rule_12_not_for_an_asker_at_its_minimum() -> None:
    grown = candidate("g", gib=16, policy=STEADY, running=2, in_flight=1)
    result = choose(asking(), nodes_holding([grown]), [grown],
                    who=asker(STD, replicas=1, min_replicas=1))
    assert refused(result) == {"g": RefusalReason.NOT_ON_DEMAND}
    assert isinstance(result, NoVictim) and "is not below its minimum" in result.reason


def test_rule_12_not_a_replica_at_its_deployments_minimum() -> None:
    at_min = candidate("m", gib=16, policy=STEADY, running=1, in_flight=1)
    result = choose(asking(), nodes_holding([at_min]), [at_min],
                    who=asker(STD, min_replicas=1))
    assert isinstance(result, NoVictim) and "its deployment is at its minimum" in result.reason


def test_rule_12_takes_no_more_than_a_deployments_surplus() -> None:
    # d-g runs 3 at min 1: two may go, not the third; 24 GiB are needed, 8 each.
    a, b, c = (candidate(r, deployment="d-g", gib=8, policy=STEADY, running=3,
                         in_flight=1, on="n1") for r in ("a", "b", "c"))
    nodes = [node("n1", mem_gib=24, claimed_gib=24)]
    result = choose(asking(24), nodes, [a, b, c], who=asker(STD, min_replicas=1, mem_gib=24))
    assert refused(result)["c"] is RefusalReason.AT_MINIMUM
    result = choose(asking(16), nodes, [a, b, c], who=asker(STD, min_replicas=1, mem_gib=16))
    assert set(victims(result)) == {"a", "b"}


def test_rule_12_a_sleeper_is_beyond_the_minimum_whatever_the_count() -> None:
    asleep = candidate("z", gib=16, policy=STEADY, running=1, state=ReplicaState.SLEEPING)
    result = choose(asking(), nodes_holding([asleep]), [asleep], who=asker(STD, min_replicas=1))
    assert victims(result) == {"z": VictimKind.PREEMPT}


# -- rule 8: guarantees ----------------------------------------------------------------------

TEAM_A = Quota(scope="org/a", guarantee=Resources(memory_bytes=16 * GIB))
TEAM_B = Quota(scope="org/b", guarantee=Resources(memory_bytes=16 * GIB))


def test_rule_8_a_replica_within_its_guarantee_is_never_taken_for_another_scope() -> None:
    guarded = candidate("g", gib=16, cls=OPP, policy=STEADY, owner="org/b")
    result = choose(asking(), nodes_holding([guarded]), [guarded],
                    who=asker(CRIT, owner="org/a"), quotas=[TEAM_B])
    assert refused(result) == {"g": RefusalReason.GUARANTEED}
    assert isinstance(result, NoVictim) and "within scope 'org/b''s guarantee" in result.reason


def test_rule_8_guards_an_idle_on_demand_replica_too() -> None:
    guarded = candidate("g", gib=16, owner="org/b")
    assert refused(choose(asking(), nodes_holding([guarded]), [guarded], quotas=[TEAM_B])) == {
        "g": RefusalReason.GUARANTEED}


def test_rule_8_does_not_guard_within_the_askers_own_scope() -> None:
    # org holds the guarantee; asker and victim are both beneath it.
    org = Quota(scope="org", guarantee=Resources(memory_bytes=64 * GIB))
    low = candidate("low", gib=16, cls=OPP, policy=STEADY, owner="org/b")
    result = choose(asking(), nodes_holding([low]), [low], who=asker(CRIT, owner="org/a"),
                    quotas=[org])
    assert victims(result) == {"low": VictimKind.PREEMPT}


def test_rule_8_what_is_held_beyond_the_guarantee_may_go_but_not_below_it() -> None:
    # org/b holds 24 GiB (three of 8) against 16 guaranteed: one may go, not two.
    b1, b2, b3 = (candidate(r, gib=8, cls=OPP, policy=STEADY, owner="org/b", on="n1")
                  for r in ("b1", "b2", "b3"))
    nodes = [node("n1", mem_gib=24, claimed_gib=24)]
    result = choose(asking(8), nodes, [b1, b2, b3], who=asker(CRIT), quotas=[TEAM_B])
    assert set(victims(result)) == {"b1"}
    result = choose(asking(16), nodes, [b1, b2, b3], who=asker(CRIT, mem_gib=16),
                    quotas=[TEAM_B])
    assert isinstance(result, NoVictim)
    assert refused(result) == {"b1": RefusalReason.NO_ROOM, "b2": RefusalReason.GUARANTEED,
                               "b3": RefusalReason.GUARANTEED}


def test_rule_8_a_project_is_guarded_by_its_teams_guarantee_too() -> None:
    team = Quota(scope="org/b", guarantee=Resources(memory_bytes=16 * GIB))
    low = candidate("low", gib=16, cls=OPP, policy=STEADY, owner="org/b/p1")
    assert refused(choose(asking(), nodes_holding([low]), [low], who=asker(CRIT),
                          quotas=[team])) == {"low": RefusalReason.GUARANTEED}


# -- rule 10: borrowed room taken back ---------------------------------------------------------

def test_rule_10_borrowed_room_is_taken_back_whatever_the_classes() -> None:
    # The acceptance: B borrows A's idle share (a critical, busy replica B has no
    # guarantee for); A, opportunistic, deploys within its 16 GiB guarantee.
    borrowed = candidate("b", gib=16, cls=CRIT, policy=STEADY, in_flight=2, owner="org/b")
    result = choose(asking(), nodes_holding([borrowed]), [borrowed],
                    who=asker(OPP, owner="org/a"), quotas=[TEAM_A])
    assert victims(result) == {"b": VictimKind.PREEMPT}
    assert isinstance(result, EvictionChoice)
    assert "borrowed room taken back for scope 'org/a'" in result.reason


def test_rule_10_not_for_an_asker_past_its_guarantee() -> None:
    borrowed = candidate("b", gib=16, cls=CRIT, policy=STEADY, owner="org/b")
    already = Holding(owner="org/a", resources=Resources(memory_bytes=12 * GIB))
    result = choose(asking(), nodes_holding([borrowed]), [borrowed],
                    who=asker(OPP, owner="org/a"), quotas=[TEAM_A],
                    holdings=holdings_of([borrowed], already))
    assert refused(result) == {"b": RefusalReason.NOT_ON_DEMAND}


def test_rule_10_not_a_replica_within_its_own_guarantee() -> None:
    guarded = candidate("b", gib=16, cls=OPP, policy=STEADY, owner="org/b")
    result = choose(asking(), nodes_holding([guarded]), [guarded],
                    who=asker(OPP, owner="org/a"), quotas=[TEAM_A, TEAM_B])
    assert refused(result) == {"b": RefusalReason.GUARANTEED}


def test_rule_10_not_a_replica_of_the_askers_own_scope() -> None:
    mine = candidate("m", gib=16, cls=CRIT, policy=STEADY, owner="org/a/p2")
    result = choose(asking(), nodes_holding([mine]), [mine],
                    who=asker(OPP, owner="org/a/p1"), quotas=[TEAM_A])
    assert refused(result) == {"m": RefusalReason.NOT_ON_DEMAND}


# -- order and the set -------------------------------------------------------------------------

def test_the_lowest_class_goes_first_then_the_most_idle_then_the_smallest() -> None:
    std = candidate("a-std", gib=8, cls=STD, policy=STEADY, idle_min=120, on="n1")
    opp_busy = candidate("b-opp", gib=8, cls=OPP, policy=STEADY, in_flight=1, on="n2")
    opp_idle_big = candidate("c-big", gib=12, cls=OPP, policy=STEADY, idle_min=60, on="n3")
    opp_idle_small = candidate("d-small", gib=10, cls=OPP, policy=STEADY, idle_min=60,
                               on="n4")
    cands = [std, opp_busy, opp_idle_big, opp_idle_small]
    nodes = [node(n, mem_gib=16, claimed_gib=16) for n in ("n1", "n2", "n3", "n4")]
    result = choose(asking(8), nodes, cands, who=asker(CRIT))
    assert isinstance(result, EvictionChoice) and result.replica_id == "d-small"
    result = choose(asking(8), nodes, [std, opp_busy], who=asker(CRIT))
    assert isinstance(result, EvictionChoice) and result.replica_id == "b-opp"


def test_a_preempting_set_is_pruned_and_stopped_together() -> None:
    # n1: two opportunistic replicas of 6 (tried first, most idle) free room on the wrong
    # node for a 16 GiB replica; n2's two of 8 make it.
    w1 = candidate("w1", gib=6, cls=OPP, policy=STEADY, idle_min=90, on="n1")
    w2 = candidate("w2", gib=6, cls=OPP, policy=STEADY, idle_min=90, on="n1")
    r1 = candidate("r1", gib=8, cls=OPP, policy=STEADY, idle_min=30, on="n2")
    r2 = candidate("r2", gib=8, cls=OPP, policy=STEADY, idle_min=30, on="n2")
    nodes = [node("n1", mem_gib=12, claimed_gib=12), node("n2", mem_gib=16, claimed_gib=16)]
    result = choose(asking(16), nodes, [w1, w2, r1, r2], who=asker(CRIT, mem_gib=16))
    assert isinstance(result, EvictionChoice)
    assert victims(result) == {"r1": VictimKind.PREEMPT, "r2": VictimKind.PREEMPT}
    assert result.together and result.also_needed == ["r2"] and result.place_on == ["n2"]


def test_an_asker_for_another_deployment_is_refused() -> None:
    other = asker(CRIT).model_copy(update={"deployment_id": DeploymentId("d-other")})
    with pytest.raises(ValueError, match="is not d-asked"):
        choose(asking(), [node("n1")], [], who=other)


# -- headroom ------------------------------------------------------------------------------------

def test_headroom_counts_what_fits_now() -> None:
    result = headroom(asking(4), [node("n1", mem_gib=16, claimed_gib=4), node("n2")],
                      for_deployment=ASKER, now=NOW, protect_s=PROTECT_S)
    assert (result.now, result.by_stopping, result.capped) == (7, [], False)
    assert result.reason.startswith("no more fit:")


def test_headroom_is_capped() -> None:
    tiny = PlacementRequest(model_id=asking().model_id, memory_bytes=1, deployment_id=ASKER)
    result = headroom(tiny, [node("n1")], for_deployment=ASKER, now=NOW,
                      protect_s=PROTECT_S)
    assert (result.now, result.capped) == (HEADROOM_CAP, True)
    assert str(HEADROOM_CAP) in result.reason


def test_headroom_names_only_the_replicas_that_make_the_room() -> None:
    # One 8 GiB free on n1 then: w1 (most idle) frees room on the wrong node for a 16 GiB
    # replica and is tried, but only r1 and r2 are named; then nothing more may go.
    w1 = candidate("w1", gib=6, cls=OPP, policy=STEADY, idle_min=90, on="n1")
    r1 = candidate("r1", gib=8, cls=OPP, policy=STEADY, idle_min=30, on="n2")
    r2 = candidate("r2", gib=8, cls=OPP, policy=STEADY, idle_min=30, on="n2")
    std = candidate("s", gib=8, cls=STD, policy=STEADY, on="n3")
    nodes = [node("n1", mem_gib=12, claimed_gib=6), node("n2", mem_gib=16, claimed_gib=16),
             node("n3", mem_gib=16, claimed_gib=8)]
    result = headroom(asking(16), nodes, [w1, r1, r2, std], for_deployment=ASKER, now=NOW,
                      protect_s=PROTECT_S, asker=asker(CRIT, mem_gib=16),
                      holdings=holdings_of([w1, r1, r2, std]))
    assert result.now == 0
    assert [s.victim_ids for s in result.by_stopping] == [["r1", "r2"], ["s"]]
    assert result.by_stopping[0].frees == Resources(memory_bytes=16 * GIB)
    assert result.by_stopping[1].place_on == ["n3"]
    assert result.total == 2 and result.reason.startswith("no more by stopping others")


def test_headroom_stops_at_the_owners_limit() -> None:
    limited = Quota(scope="org/a", limit=Limit(memory_bytes=20 * GIB))
    result = headroom(asking(8), [node("n1", mem_gib=64)], for_deployment=ASKER, now=NOW,
                      protect_s=PROTECT_S, asker=asker(STD, owner="org/a"),
                      quotas=[limited])
    assert result.now == 2
    assert "scope 'org/a' would pass its memory limit" in result.reason


def test_headroom_counts_the_askers_minimum_as_it_grows() -> None:
    # Below its minimum of 2, the asker may take d-g's surplus (it runs 3 at min 1): two
    # replicas, but only one more by rule 12: then it is at its minimum.
    g = [candidate(r, deployment="d-g", gib=16, policy=STEADY, running=3, in_flight=1,
                   on=n) for r, n in (("g1", "n1"), ("g2", "n2"), ("g3", "n3"))]
    nodes = [node(n, claimed_gib=16) for n in ("n1", "n2", "n3")]
    result = headroom(asking(16), nodes, g, for_deployment=ASKER, now=NOW,
                      protect_s=PROTECT_S, asker=asker(STD, replicas=1, min_replicas=2,
                                                       mem_gib=16))
    assert [s.victim_ids for s in result.by_stopping] == [["g1"]]


def test_headroom_with_on_demand_victims_evicts() -> None:
    idle = candidate("idle", gib=16, policy=ON_DEMAND, on="n1")
    result = headroom(asking(16), [node("n1", claimed_gib=16)], [idle], for_deployment=ASKER,
                      now=NOW, protect_s=PROTECT_S)
    assert [(v.replica_id, v.kind) for s in result.by_stopping for v in s.victims] == [
        ("idle", VictimKind.EVICT)]


def test_scaling_policy_of_a_fixed_deployment_is_never_grown() -> None:
    fixed = candidate("f", gib=16, policy=None, running=5)
    assert not fixed.beyond_min and fixed.surplus == 0
    grown = candidate("g", gib=16, policy=ScalingPolicy(min_replicas=2, max_replicas=5),
                      running=5)
    assert grown.beyond_min and grown.surplus == 3
