"""Eviction: one test per rule of modelkeeper.domain.eviction's docstring, in its order,
then properties over random clusters: a victim always makes the room on the copy and is
never of the asking deployment, a promise, multi-node, unknown, busy or protected."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelkeeper.domain.demand import ReplicaUse, ScalingPolicy
from modelkeeper.domain.eviction import (
    IDLE_BUCKET_S,
    Candidate,
    EvictionChoice,
    NoVictim,
    RefusalReason,
    VictimClaim,
    choose_victim,
    idle_s,
    without,
)
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.placement import NodeView, Placement, PlacementRequest, place
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


def asking(mem_gib: int = 8, min_nodes: int = 1) -> PlacementRequest:
    return PlacementRequest(model_id=ModelId("m-asked"), memory_bytes=mem_gib * GIB,
                            min_nodes=min_nodes, deployment_id=ASKER)


def candidate(replica_id: str, *, deployment: str | None = None, on: str | list[str] = "n1",
              gib: int = 8, idle_min: float = 30, in_flight: int = 0,
              policy: ScalingPolicy | None = ON_DEMAND,
              state: ReplicaState = ReplicaState.READY, ready_min_ago: float = 60,
              known: bool = True) -> Candidate:
    nodes = [on] if isinstance(on, str) else on
    return Candidate(
        replica_id=ReplicaId(replica_id), deployment_id=DeploymentId(deployment or
                                                                     f"d-{replica_id}"),
        policy=policy, state=state, ready_at=NOW - timedelta(minutes=ready_min_ago),
        claims=[VictimClaim(node_id=NodeId(n), memory_bytes=gib * GIB // len(nodes))
                for n in nodes],
        use=ReplicaUse(replica_id=ReplicaId(replica_id), in_flight=in_flight,
                       last_used_at=NOW - timedelta(minutes=idle_min),
                       reporting_since=NOW - timedelta(hours=5)) if known else None)


def full_node(*held: Candidate, mem_gib: int = 16) -> NodeView:
    """n1, its memory claimed by ``held`` exactly."""
    return node("n1", mem_gib=mem_gib, claimed_gib=sum(c.freed_bytes for c in held) // GIB)


def choose(request: PlacementRequest, nodes: list[NodeView], candidates: list[Candidate]
           ) -> EvictionChoice | NoVictim:
    return choose_victim(request, nodes, candidates, for_deployment=ASKER, now=NOW,
                         protect_s=PROTECT_S)


def refused(result: EvictionChoice | NoVictim) -> dict[str, RefusalReason]:
    assert isinstance(result, NoVictim), result
    return {r.replica_id: r.reason_code for r in result.refusals}


# -- the rules, in the docstring's order --------------------------------------------------

def test_room_already_means_no_victim() -> None:
    a = candidate("a")
    result = choose(asking(8), [node("n1", claimed_gib=8)], [a])
    assert isinstance(result, NoVictim) and result.fits_now
    assert "fits without evicting anything, on n1" in result.reason


def test_rule_1_never_a_replica_of_the_deployment_asking() -> None:
    own = candidate("own", deployment=ASKER, gib=16)
    assert refused(choose(asking(), [full_node(own)], [own])) == {
        "own": RefusalReason.SAME_DEPLOYMENT}


@pytest.mark.parametrize("policy, words", [
    (ScalingPolicy(min_replicas=1, max_replicas=2), "min 1: a promise"),
    (None, "no scaling policy"),
])
def test_rule_2_a_model_at_min_1_or_with_no_policy_is_a_promise(
    policy: ScalingPolicy | None, words: str,
) -> None:
    kept = candidate("kept", gib=16, policy=policy)
    result = choose(asking(), [full_node(kept)], [kept])
    assert refused(result) == {"kept": RefusalReason.NOT_ON_DEMAND}
    assert isinstance(result, NoVictim) and words in result.reason


def test_rule_2_an_on_demand_model_may_be_evicted() -> None:
    idle = candidate("idle", gib=16)
    result = choose(asking(), [full_node(idle)], [idle])
    assert isinstance(result, EvictionChoice) and result.replica_id == "idle"


def test_rule_3_only_single_node_replicas() -> None:
    wide = candidate("wide", on=["n1", "n2"], gib=32)
    nodes = [node("n1", claimed_gib=16), node("n2", claimed_gib=16)]
    result = choose(asking(), nodes, [wide])
    assert refused(result) == {"wide": RefusalReason.MULTI_NODE}
    assert isinstance(result, NoVictim) and "spans 2 nodes" in result.reason


@pytest.mark.parametrize("state", [ReplicaState.STARTING, ReplicaState.DRAINING,
                                   ReplicaState.STOPPING, ReplicaState.UNREACHABLE])
def test_rule_4_only_serving_or_sleeping_replicas(state: ReplicaState) -> None:
    busy = candidate("x", gib=16, state=state)
    assert refused(choose(asking(), [full_node(busy)], [busy])) == {
        "x": RefusalReason.NOT_SERVING}


def test_rule_4_a_sleeping_replica_frees_what_it_keeps() -> None:
    # Asleep, it keeps its 10 GiB of weights of the 14 it held awake; 6 GiB free besides.
    asleep = Candidate(**{**candidate("zz", state=ReplicaState.SLEEPING).model_dump(),
                          "claims": [VictimClaim(node_id=NodeId("n1"), memory_bytes=10 * GIB,
                                                 awake_memory_bytes=14 * GIB)]})
    result = choose(asking(12), [node("n1", claimed_gib=10)], [asleep])
    assert isinstance(result, EvictionChoice)
    assert (result.asleep, result.freed_bytes) == (True, 10 * GIB)
    assert "asleep" in result.reason


def test_rule_5_unknown_is_not_idle() -> None:
    unknown = candidate("u", gib=16, known=False)
    result = choose(asking(), [full_node(unknown)], [unknown])
    assert refused(result) == {"u": RefusalReason.USAGE_UNKNOWN}
    assert idle_s(unknown, NOW) is None


def test_rule_6_never_a_replica_with_requests_in_flight() -> None:
    busy = candidate("b", gib=16, in_flight=2)
    result = choose(asking(), [full_node(busy)], [busy])
    assert refused(result) == {"b": RefusalReason.IN_USE}
    assert isinstance(result, NoVictim) and "2 request(s) in flight" in result.reason


def test_rule_7_protected_for_a_window_after_it_starts_serving() -> None:
    fresh = candidate("f", gib=16, ready_min_ago=4.9)  # the window is 5 min
    result = choose(asking(), [full_node(fresh)], [fresh])
    assert refused(result) == {"f": RefusalReason.PROTECTED}
    assert isinstance(result, NoVictim) and "protected for 5 min" in result.reason
    old_enough = candidate("f", gib=16, ready_min_ago=5)
    assert isinstance(choose(asking(), [full_node(old_enough)], [old_enough]), EvictionChoice)


def test_two_models_with_room_for_one_take_turns_at_most_once_per_window() -> None:
    """A and B on a node with room for one, asked alternately every 10 s: each eviction
    makes the other the newcomer, which is then safe for the window; so at most one
    eviction per window, however often they are asked for."""
    ready_at = {"a": NOW - timedelta(hours=1)}
    evictions = []
    for tick in range(0, 1200, 10):  # 20 minutes
        now = NOW + timedelta(seconds=tick)
        wanted = "b" if (tick // 10) % 2 else "a"
        [running] = ready_at
        if running == wanted:
            continue
        held = Candidate(**{**candidate(running, gib=16).model_dump(),
                            "ready_at": ready_at[running],
                            "use": ReplicaUse(replica_id=ReplicaId(running), in_flight=0,
                                              last_used_at=now - timedelta(seconds=10),
                                              reporting_since=NOW - timedelta(hours=5))})
        result = choose_victim(
            PlacementRequest(model_id=ModelId(f"m-{wanted}"), memory_bytes=16 * GIB),
            [full_node(held)], [held], for_deployment=DeploymentId(f"d-{wanted}"), now=now,
            protect_s=PROTECT_S)
        if isinstance(result, EvictionChoice):
            evictions.append(tick)
            ready_at = {wanted: now}
    assert evictions == [10, 320, 630, 940]
    assert all(b - a >= PROTECT_S for a, b in itertools.pairwise(evictions))


def test_the_most_idle_goes_first() -> None:
    a, b = candidate("a", idle_min=10, gib=8), candidate("b", idle_min=40, gib=8)
    result = choose(asking(8), [full_node(a, b)], [a, b])
    assert isinstance(result, EvictionChoice) and result.replica_id == "b"
    assert result.reason == "evicted d-b (replica b, idle 40 min, 8.0 GiB on n1) to place d-asked"
    assert result.idle_s == 40 * 60 and result.place_on == ["n1"]


def test_of_equally_idle_the_smallest_goes_first() -> None:
    """Idle the same whole minutes (seconds of flush jitter apart) is equally idle: the
    smaller goes, though the bigger was left alone 40 s longer."""
    big = candidate("big", idle_min=14.7, gib=8)
    small = candidate("small", idle_min=14.05, gib=4)
    assert (idle_s(big, NOW) or 0) // IDLE_BUCKET_S == (idle_s(small, NOW) or 0) // IDLE_BUCKET_S
    result = choose(asking(4), [full_node(big, small, mem_gib=12)], [big, small])
    assert isinstance(result, EvictionChoice) and result.replica_id == "small"
    # A whole minute more idle outranks size.
    bigger_idle = candidate("big", idle_min=15.1, gib=8)
    result = choose(asking(4), [full_node(bigger_idle, small, mem_gib=12)],
                    [bigger_idle, small])
    assert isinstance(result, EvictionChoice) and result.replica_id == "big"


def test_idle_counts_from_when_it_became_ready_and_when_reporting_began() -> None:
    c = candidate("c", idle_min=60, ready_min_ago=20)
    assert idle_s(c, NOW) == 20 * 60
    late = Candidate(**{**c.model_dump(), "use": ReplicaUse(
        replica_id=ReplicaId("c"), in_flight=0, last_used_at=None,
        reporting_since=NOW - timedelta(minutes=3))})
    assert idle_s(late, NOW) == 3 * 60


def test_a_victim_is_chosen_only_if_it_makes_the_room() -> None:
    """The most idle replica is on the wrong node (its node has too little memory even
    empty): the next one, on a node it frees enough on, is the victim."""
    wrong = candidate("wrong", on="n2", idle_min=50, gib=4)
    right = candidate("right", on="n1", idle_min=20, gib=16)
    nodes = [node("n1", claimed_gib=16), node("n2", mem_gib=8, claimed_gib=4)]
    result = choose(asking(16), nodes, [wrong, right])
    assert isinstance(result, EvictionChoice) and result.replica_id == "right"
    assert result.also_needed == []


def test_none_makes_the_room_and_none_is_chosen() -> None:
    a = candidate("a", on="n2", gib=4)
    nodes = [node("n1", claimed_gib=16), node("n2", mem_gib=8, claimed_gib=4)]
    result = choose(asking(16), nodes, [a])
    assert refused(result) == {"a": RefusalReason.NO_ROOM}
    assert isinstance(result, NoVictim)
    assert "would not make room" in result.reason
    assert "stopping it frees 4.0 GiB on n2, not enough: 8.0 GiB free, needs 16.0 GiB" \
        in result.reason


def test_two_needed_together_are_pruned_to_those_that_make_the_room() -> None:
    """No one replica frees 16 GiB; the most idle (on n2) frees room on the wrong node and
    is pruned from the set; the two on n1 are needed, the more idle of them first."""
    elsewhere = candidate("elsewhere", on="n2", idle_min=90, gib=8)
    x, y = candidate("x", idle_min=60, gib=8), candidate("y", idle_min=30, gib=8)
    nodes = [full_node(x, y), node("n2", mem_gib=8, claimed_gib=8)]
    result = choose(asking(16), nodes, [elsewhere, x, y])
    assert isinstance(result, EvictionChoice)
    assert (result.replica_id, result.also_needed) == ("x", ["y"])
    assert "(1 of 2 needed; next y)" in result.reason


def test_a_replica_across_two_nodes_needs_one_victim_on_each() -> None:
    """Shards of 4 GiB on two nodes: n0 fits already, n1 and n2 are full. One victim on
    n1 (or n2) makes the second node, and the more idle one goes; freeing room on n0, which
    fits already, makes nothing."""
    on0 = candidate("on0", on="n0", idle_min=90, gib=4)
    a, b = candidate("a", on="n1", idle_min=20, gib=4), candidate("b", on="n2", idle_min=50,
                                                                  gib=4)
    nodes = [node("n0", mem_gib=8, claimed_gib=4), node("n1", mem_gib=4, claimed_gib=4),
             node("n2", mem_gib=4, claimed_gib=4)]
    result = choose(asking(8, min_nodes=2), nodes, [on0, a, b])
    assert isinstance(result, EvictionChoice)
    assert (result.replica_id, result.also_needed, result.place_on) == ("b", [], ["n0", "n2"])
    # Three nodes needed, one fits: both are needed, the more idle first.
    result = choose(asking(12, min_nodes=3), nodes, [on0, a, b])
    assert isinstance(result, EvictionChoice)
    assert (result.replica_id, result.also_needed) == ("b", ["a"])


def test_a_single_victim_is_preferred_to_a_set_of_more_idle_ones() -> None:
    """{a, b} together would make the room, and are more idle; but one eviction beats two."""
    a, b = candidate("a", idle_min=60, gib=8), candidate("b", idle_min=60, gib=8)
    whole = candidate("whole", on="n2", idle_min=10, gib=16)
    nodes = [full_node(a, b), node("n2", claimed_gib=16)]
    result = choose(asking(16), nodes, [a, b, whole])
    assert isinstance(result, EvictionChoice) and result.replica_id == "whole"


def test_no_candidates_at_all() -> None:
    result = choose(asking(), [node("n1", claimed_gib=16)], [])
    assert isinstance(result, NoVictim) and not result.fits_now
    assert result.reason == "no replica of another deployment is serving or asleep"


def test_the_answer_does_not_depend_on_the_order_of_its_inputs() -> None:
    cs = [candidate(f"r{i}", idle_min=30, gib=2 + i % 3) for i in range(6)]
    # 4 GiB free on n1: equally idle, the 2s and 3s are tried first and do not make the
    # room; the first 4 GiB one (by replica id) does.
    nodes = [node("n1", mem_gib=64, claimed_gib=60), node("n0", claimed_gib=16)]
    first = choose(asking(8), nodes, cs)
    assert isinstance(first, EvictionChoice) and first.replica_id == "r2"
    assert choose(asking(8), nodes[::-1], cs[::-1]) == first


def test_the_summary_is_bounded() -> None:
    many = [candidate(f"r{i:04}", gib=1, policy=None) for i in range(500)]
    result = choose(asking(16), [node("n1", mem_gib=500, claimed_gib=500)], many)
    assert isinstance(result, NoVictim) and len(result.refusals) == 500
    assert len(result.reason.encode()) <= 4096 and result.reason.endswith("more")


def test_without_frees_memory_cpus_and_gpus_on_a_copy() -> None:
    n = NodeView(node_id=NodeId("n1"), name="n1", state=NodeState.READY,
                 memory_total_bytes=16 * GIB, memory_claimed_bytes=12 * GIB, cpu_count=8,
                 cpu_claimed=6.0, gpus=[{"index": i, "memory_bytes": GIB} for i in range(4)],
                 gpu_claimed=[0, 1, 3])
    c = Candidate(**{**candidate("c").model_dump(), "claims": [VictimClaim(
        node_id=NodeId("n1"), memory_bytes=8 * GIB, cpu_cores=4, gpu_indices=[1, 3])]})
    [after] = without([n], [c])
    assert (after.memory_claimed_bytes, after.cpu_claimed, after.gpu_claimed) == (
        4 * GIB, 2.0, [0])
    assert n.memory_claimed_bytes == 12 * GIB  # the original is untouched


# -- properties -----------------------------------------------------------------------------

#: One broken rule each, as ``candidate``'s arguments.
FLAWS: dict[str, dict[str, object]] = {
    "asker": {"deployment": ASKER}, "no policy": {"policy": None},
    "promise": {"policy": ScalingPolicy(min_replicas=1, max_replicas=1)},
    "starting": {"state": ReplicaState.STARTING}, "unknown": {"known": False},
    "busy": {"in_flight": 1}, "protected": {"ready_min_ago": 4.5},
}


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeView], list[Candidate], PlacementRequest]:
    """Up to 4 nodes of 8-32 GiB, each full of candidates of every kind, and a request."""
    nodes: list[NodeView] = []
    candidates: list[Candidate] = []
    for i in range(draw(st.integers(1, 4))):
        total = draw(st.sampled_from([8, 16, 32]))
        used = 0
        while used < total:
            gib = draw(st.integers(1, total - used))
            idx = len(candidates)
            # Most are fit to evict; the rest break one rule each.
            flaw = draw(st.sampled_from([None] * 7 + list(FLAWS)))
            kwargs: dict[str, Any] = {
                "state": draw(st.sampled_from([ReplicaState.READY, ReplicaState.SLEEPING])),
                **(FLAWS[flaw] if flaw else {})}
            candidates.append(candidate(f"r{idx:02}", on=f"n{i}", gib=gib,
                                        idle_min=draw(st.floats(0, 120)), **kwargs))
            used += gib
        nodes.append(node(f"n{i}", mem_gib=total, claimed_gib=used))
    # A multi-node replica across the first two nodes, when there are two.
    if len(nodes) >= 2 and draw(st.booleans()):
        candidates.append(candidate("wide", on=["n0", "n1"], gib=0))
    request = asking(draw(st.integers(1, 32)), min_nodes=draw(st.sampled_from([1, 1, 2])))
    return nodes, candidates, request


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_a_victim_always_makes_the_room_and_breaks_no_rule(
    cluster: tuple[list[NodeView], list[Candidate], PlacementRequest],
) -> None:
    nodes, candidates, request = cluster
    result = choose(request, nodes, candidates)
    if isinstance(result, NoVictim):
        assert result.fits_now == isinstance(place(request, nodes), Placement)
        return
    by_id = {c.replica_id: c for c in candidates}
    victims = [by_id[result.replica_id], *(by_id[r] for r in result.also_needed)]
    for v in victims:
        assert v.deployment_id != ASKER
        assert v.policy is not None and v.policy.min_replicas == 0
        assert len({c.node_id for c in v.claims}) == 1
        assert v.state in (ReplicaState.READY, ReplicaState.SLEEPING)
        assert v.use is not None and v.use.in_flight == 0
        assert v.ready_at is not None and (NOW - v.ready_at).total_seconds() >= PROTECT_S
    # The room is made on the copy, by exactly these, and each is needed.
    made = place(request, without(nodes, victims))
    assert isinstance(made, Placement) and made.node_ids == result.place_on
    if len(victims) > 1:
        for v in victims:
            assert not isinstance(place(request, without(nodes, [x for x in victims
                                                                 if x is not v])), Placement)


def test_a_refusal_that_passes_with_time_says_when_to_seek_again() -> None:
    from modelkeeper.domain.eviction import RESEEK_S

    fresh = candidate("f", gib=16, ready_min_ago=1)  # protected until 4 min from now
    result = choose(asking(), [full_node(fresh)], [fresh])
    assert isinstance(result, NoVictim)
    assert result.retry_at == NOW + timedelta(minutes=4)
    for waiting in (candidate("s", gib=16, state=ReplicaState.STARTING),  # soon protected
                    candidate("b", gib=16, in_flight=1), candidate("u", gib=16, known=False)):
        result = choose(asking(), [full_node(waiting)], [waiting])
        assert isinstance(result, NoVictim)
        assert result.retry_at == NOW + timedelta(seconds=RESEEK_S)
    promise = candidate("p", gib=16, policy=ScalingPolicy(min_replicas=1, max_replicas=1))
    result = choose(asking(), [full_node(promise)], [promise])
    assert isinstance(result, NoVictim) and result.retry_at is None  # cant_place, honestly
