"""Fit plans: one test per rule of modelkeeper.domain.fit_plans' docstring, in its order,
then a property over random clusters: every plan makes the room on the copy, and none
keeps an action it does not need. (Headroom's tests are tests/unit/test_preemption.py's
and the capacity simulation's.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelkeeper.domain.demand import ReplicaUse, ScalingPolicy
from modelkeeper.domain.eviction import Candidate, VictimClaim
from modelkeeper.domain.fit_plans import (
    MAX_PLANS,
    ActionKind,
    FitPlan,
    Held,
    Holder,
    fit_plans,
    fits,
    room_after,
)
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.placement import NodeView, PlacementRequest
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.units import GIB

pytestmark = pytest.mark.timeout(60)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PROTECT_S = 300.0
ASKER = DeploymentId("d-asked")
ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=3600)


def node(node_id: str, *, mem_gib: int = 16, claimed_gib: int = 0,
         state: NodeState = NodeState.READY) -> NodeView:
    return NodeView(node_id=NodeId(node_id), name=node_id, state=state,
                    memory_total_bytes=mem_gib * GIB, memory_claimed_bytes=claimed_gib * GIB)


def asking(mem_gib: int = 8) -> PlacementRequest:
    return PlacementRequest(model_id=ModelId("m-asked"), memory_bytes=mem_gib * GIB,
                            deployment_id=ASKER)


def replica(replica_id: str, *, deployment: str, on: str = "n1", gib: int = 8,
            idle_min: float = 30, policy: ScalingPolicy | None = ON_DEMAND,
            state: ReplicaState = ReplicaState.READY, known: bool = True) -> Candidate:
    return Candidate(
        replica_id=ReplicaId(replica_id), deployment_id=DeploymentId(deployment),
        policy=policy, state=state, ready_at=NOW - timedelta(hours=2),
        claims=[VictimClaim(node_id=NodeId(on), memory_bytes=gib * GIB)],
        use=ReplicaUse(replica_id=ReplicaId(replica_id), in_flight=0,
                       last_used_at=NOW - timedelta(minutes=idle_min),
                       reporting_since=NOW - timedelta(hours=5)) if known else None)


# -- fit plans --------------------------------------------------------------------------

def holder(deployment: str, *, desired: int = 1, scaling: ScalingPolicy | None = None,
           keeps_gib: int | None = None) -> Holder:
    return Holder(deployment_id=DeploymentId(deployment), desired_replicas=desired,
                  fixed_count=scaling is None, sleep_keeps_bytes=None if keeps_gib is None
                  else keeps_gib * GIB)


def plans_for(request: PlacementRequest, nodes: list[NodeView], candidates: list[Candidate],
              holders: list[Holder], count: int = 1) -> list[FitPlan]:
    return fit_plans(request, nodes, candidates, holders, count=count, for_deployment=ASKER)


def test_no_plan_when_it_fits_already() -> None:
    assert plans_for(asking(8), [node("n1")], [], []) == []


def test_rule4_sleep_frees_the_kv_cache_and_scale_down_the_keepers_choice() -> None:
    # d-v: vLLM-like, keeps 2 of 10 GiB asleep. d-l: llama.cpp (cannot sleep), 2 replicas,
    # fixed: scaling it down retires the newest ready one (r7, not r3).
    v = replica("d-v-r1", deployment="d-v", gib=10, policy=None)
    l3 = replica("d-l-r3", deployment="d-l", on="n2", gib=6, policy=None)
    l7 = replica("d-l-r7", deployment="d-l", on="n2", gib=6, policy=None)
    nodes = [node("n1", mem_gib=12, claimed_gib=10), node("n2", mem_gib=13, claimed_gib=12)]
    plans = plans_for(asking(7), nodes, [v, l3, l7],
                      [holder("d-v", keeps_gib=2), holder("d-l", desired=2)])
    actions = [(a.kind, a.replica_id, a.frees_bytes) for p in plans for a in p.actions]
    assert (ActionKind.SLEEP, "d-v-r1", 8 * GIB) in actions
    assert (ActionKind.SCALE_DOWN, "d-l-r7", 6 * GIB) in actions
    assert not any(a[1] == "d-l-r3" for a in actions)
    down = next(a for p in plans for a in p.actions if a.kind is ActionKind.SCALE_DOWN)
    assert (down.replicas_from, down.replicas_to) == (2, 1)
    assert down.text == ("scale d-l down from 2 to 1: its keeper retires d-l-r7 (frees "
                         "6.0 GiB on n2)")


def test_rule4_what_is_never_offered() -> None:
    nodes = [node("n1", claimed_gib=16)]
    cases = [
        # A scaling policy: not scaled down by hand; cannot sleep either.
        ([replica("p-r1", deployment="d-p", gib=16)], [holder("d-p", scaling=ON_DEMAND)]),
        # A replica placing or unreachable besides (2 wanted, 1 listed): which one the
        # keeper retires is not known.
        ([replica("q-r1", deployment="d-q", gib=16, policy=None)], [holder("d-q", desired=2)]),
        # The asking deployment's own.
        ([replica("x-r1", deployment=ASKER, gib=16, policy=None)], [holder(ASKER)]),
        # Asleep already: sleeping frees nothing more, and it keeps all it claims.
        ([replica("z-r1", deployment="d-z", gib=16, state=ReplicaState.SLEEPING)],
         [holder("d-z", scaling=ON_DEMAND, keeps_gib=16)]),
    ]
    for candidates, holders in cases:
        assert plans_for(asking(8), nodes, candidates, holders) == [], candidates


def test_rule5_each_plan_makes_the_room_with_only_what_it_needs() -> None:
    # 9 GiB asked on n1 (full): sleeping both 5 GiB caches makes it, one does not; the
    # replica on n2 frees room on the wrong node and is not in any plan.
    reps = [replica(f"d-{n}-r1", deployment=f"d-{n}", gib=8, policy=None) for n in "ab"]
    far = replica("d-c-r1", deployment="d-c", on="n2", gib=8, policy=None)
    nodes = [node("n1", claimed_gib=16), node("n2", mem_gib=8, claimed_gib=8)]
    plans = plans_for(asking(9), nodes, [*reps, far],
                      [holder("d-a", keeps_gib=3), holder("d-b", keeps_gib=3),
                       holder("d-c", keeps_gib=3)])
    assert plans, "sleeping both makes the room"
    assert [(a.kind, a.replica_id) for a in plans[0].actions] == [
        (ActionKind.SLEEP, "d-a-r1"), (ActionKind.SLEEP, "d-b-r1")]
    assert all(a.node_id == "n1" for p in plans for a in p.actions)


def test_rule6_smallest_disruption_first_and_numbered() -> None:
    # A sleep alone makes it, and so does a scale-down: the sleep is plan 1.
    v = replica("d-v-r1", deployment="d-v", gib=10, policy=None)
    f = replica("d-f-r1", deployment="d-f", gib=6, policy=None)
    nodes = [node("n1", claimed_gib=16)]
    plans = plans_for(asking(6), nodes, [v, f],
                      [holder("d-v", keeps_gib=2), holder("d-f")])
    assert [p.number for p in plans] == list(range(1, len(plans) + 1))
    assert len(plans) <= MAX_PLANS
    assert [a.kind for a in plans[0].actions] == [ActionKind.SLEEP]
    assert any(a.kind is ActionKind.SCALE_DOWN for p in plans[1:] for a in p.actions)


def test_count_asks_room_for_every_replica() -> None:
    reps = [replica(f"d-{n}-r1", deployment=f"d-{n}", gib=8, policy=None) for n in "ab"]
    nodes = [node("n1", claimed_gib=16)]
    holders = [holder("d-a"), holder("d-b")]
    [one] = [p for p in plans_for(asking(8), nodes, reps, holders) if len(p.actions) == 1][:1]
    two = plans_for(asking(8), nodes, reps, holders, count=2)
    assert two and all(len(p.actions) == 2 for p in two)
    assert len(one.actions) == 1


def held(c: Candidate) -> Held:
    return Held(replica_id=c.replica_id, state=c.state, claims=c.claims)


def test_room_after_counts_actions_not_yet_seen_and_sees_what_took_the_room() -> None:
    v = replica("d-v-r1", deployment="d-v", gib=10, policy=None)
    nodes = [node("n1", mem_gib=12, claimed_gib=10)]
    plan = plans_for(asking(8), nodes, [v], [holder("d-v", keeps_gib=2)])[0]
    assert [a.kind for a in plan.actions] == [ActionKind.SLEEP]
    # Asked for, not yet carried out: counted as done.
    assert room_after(plan, asking(8), nodes, [held(v)], count=1)
    # Draining on its way to sleep, still holding it all: counted as done too.
    draining = held(v).model_copy(update={"state": ReplicaState.DRAINING})
    assert room_after(plan, asking(8), nodes, [draining], count=1)
    # Carried out (asleep, its claim shrunk): still made.
    slept = v.model_copy(update={"state": ReplicaState.SLEEPING, "claims": [
        VictimClaim(node_id=NodeId("n1"), memory_bytes=2 * GIB)]})
    assert room_after(plan, asking(8), [node("n1", mem_gib=12, claimed_gib=2)], [held(slept)],
                      count=1)
    # Something else took the room meanwhile: not made.
    assert not room_after(plan, asking(8), [node("n1", mem_gib=12, claimed_gib=14)], [held(v)],
                          count=1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8), st.booleans(),
                          st.booleans()), min_size=1, max_size=8),
       st.integers(1, 12), st.integers(1, 2))
def test_every_plan_makes_the_room_and_needs_each_action(
        spec: list[tuple[int, int, bool, bool]], ask_gib: int, count: int) -> None:
    nodes_claimed = {f"n{i}": 0 for i in range(3)}
    candidates, holders = [], []
    for i, (n, gib, sleeps, fixed) in enumerate(spec):
        name = f"d-{i}"
        candidates.append(replica(f"{name}-r1", deployment=name, on=f"n{n}", gib=gib,
                                  policy=None if fixed else ON_DEMAND))
        holders.append(holder(name, scaling=None if fixed else ON_DEMAND,
                              keeps_gib=gib // 2 if sleeps else None))
        nodes_claimed[f"n{n}"] += gib
    nodes = [node(n, mem_gib=max(c, 12), claimed_gib=c) for n, c in nodes_claimed.items()]
    request = asking(ask_gib)
    plans = plans_for(request, nodes, candidates, holders, count=count)
    if fits(request, nodes, count):
        assert plans == []
    for plan in plans:
        assert room_after(plan, request, nodes, [held(c) for c in candidates], count=count)
        ids = [a.replica_id for a in plan.actions]
        assert len(ids) == len(set(ids))
        for dropped in plan.actions:
            rest = plan.model_copy(update={"actions": [a for a in plan.actions
                                                       if a is not dropped]})
            if rest.actions:
                assert not room_after(rest, request, nodes, [held(c) for c in candidates],
                                      count=count)
