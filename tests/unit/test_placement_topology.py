"""Facility-aware placement (rules 5, 9 and 10 of modelkeeper.domain.placement): holds,
power caps and spread over a topology key, each with its reason and words; then properties
over random fleets: a returned placement never passes a cap or the skew, and a held node
never takes another class's or owner's replica."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelkeeper.domain.capacity import CapacityClass, within
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.placement import (
    CantPlace,
    NodeView,
    Placement,
    PlacementRequest,
    RejectionReason,
    apply,
    explain,
    place,
)
from modelkeeper.domain.topology import PDU_LABEL, RACK_LABEL, Spread, TopologyKey
from modelkeeper.domain.units import GIB

pytestmark = pytest.mark.timeout(60)

MODEL = ModelId("m")
DEP = DeploymentId("d1")


def node(node_id: str, *, rack: str | None = None, pdu: str | None = None,
         mem_gib: int = 64, claimed_gib: int = 0, watts: int = 0,
         hold_class: CapacityClass | None = None, hold_owner: str | None = None,
         state: NodeState = NodeState.READY) -> NodeView:
    labels = {}
    if rack is not None:
        labels[RACK_LABEL] = rack
    if pdu is not None:
        labels[PDU_LABEL] = pdu
    return NodeView(node_id=NodeId(node_id), name=node_id, state=state, labels=labels,
                    memory_total_bytes=mem_gib * GIB, memory_claimed_bytes=claimed_gib * GIB,
                    watts_claimed=watts, hold_class=hold_class, hold_owner=hold_owner)


def request(**fields: object) -> PlacementRequest:
    base: dict[str, object] = {"model_id": MODEL, "memory_bytes": 8 * GIB,
                               "deployment_id": DEP}
    return PlacementRequest.model_validate({**base, **fields})


def verdicts(req: PlacementRequest, nodes: list[NodeView]) -> dict[str, tuple[str | None, str]]:
    return {d.node_id: (d.rejection.reason_code.value if d.rejection else None, d.message)
            for d in explain(req, nodes)}


# --- rule 5: holds -------------------------------------------------------------------

def test_a_node_held_for_a_class_takes_only_that_class() -> None:
    nodes = [node("a", hold_class=CapacityClass.CRITICAL)]
    refused = place(request(capacity_class="standard", owner="acme/web"), nodes)
    assert isinstance(refused, CantPlace)
    [rejection] = refused.rejections
    assert rejection.reason_code is RejectionReason.HELD
    assert rejection.message == ("held for class critical; this replica runs as standard, "
                                 "owner acme/web")
    assert isinstance(place(request(capacity_class="critical"), nodes), Placement)


def test_a_node_held_for_an_owner_takes_only_that_scope_and_beneath() -> None:
    nodes = [node("a", hold_owner="acme/ml")]
    assert isinstance(place(request(owner="acme/ml"), nodes), Placement)
    assert isinstance(place(request(owner="acme/ml/llm"), nodes), Placement)
    for owner in ("acme", "acme/mlx", None):
        refused = place(request(owner=owner), nodes)
        assert isinstance(refused, CantPlace), owner
        assert refused.rejections[0].reason_code is RejectionReason.HELD
    assert verdicts(request(), nodes)["a"] == (
        "held", "held for owner acme/ml; this replica has no class, no owner")


def test_a_node_held_for_both_needs_both() -> None:
    nodes = [node("a", hold_class=CapacityClass.CRITICAL, hold_owner="acme")]
    assert isinstance(place(request(capacity_class="critical", owner="acme/x"), nodes),
                      Placement)
    assert isinstance(place(request(capacity_class="critical", owner="other"), nodes),
                      CantPlace)
    assert isinstance(place(request(capacity_class="standard", owner="acme"), nodes),
                      CantPlace)


def test_a_hold_comes_after_labels_and_before_memory() -> None:
    held_and_full = node("a", hold_class=CapacityClass.CRITICAL, claimed_gib=64)
    assert verdicts(request(), [held_and_full])["a"][0] == "held"
    assert verdicts(request(labels={"gpu": "h100"}), [held_and_full])["a"][0] == \
        "missing_labels"


def test_an_unheld_node_is_preferred_by_nothing_and_still_used() -> None:
    # A hold refuses; it does not attract: an unheld node takes a critical replica too.
    result = place(request(capacity_class="critical"), [node("a")])
    assert isinstance(result, Placement)


# --- rule 9: power caps ----------------------------------------------------------------

def test_a_pdu_at_its_cap_refuses_with_the_numbers() -> None:
    nodes = [node("a", pdu="p1", watts=4800), node("b", pdu="p1", watts=0),
             node("c", pdu="p2", watts=0, claimed_gib=60)]
    req = request(watts=400, pdu_caps_watts={"p1": 5000})
    result = place(req, nodes)
    assert isinstance(result, CantPlace)
    seen = verdicts(req, nodes)
    assert seen["a"] == ("power_cap", "pdu p1 draws 4800 W of its 5000 W cap, "
                                      "a shard adds 400 W")
    assert seen["b"][0] == "power_cap"  # b draws nothing, but its PDU does
    assert seen["c"][0] == "insufficient_memory"
    # At exactly the cap it fits; a watt past it does not.
    assert isinstance(place(request(watts=200, pdu_caps_watts={"p1": 5000}), nodes),
                      Placement)
    assert isinstance(place(request(watts=201, pdu_caps_watts={"p1": 5000}), nodes),
                      CantPlace)


def test_a_cordoned_node_still_draws_on_its_pdu() -> None:
    nodes = [node("a", pdu="p1", watts=900, state=NodeState.CORDONED), node("b", pdu="p1")]
    result = place(request(watts=200, pdu_caps_watts={"p1": 1000}), nodes)
    assert isinstance(result, CantPlace)


def test_the_facility_cap_counts_every_node() -> None:
    nodes = [node("a", pdu="p1", watts=600), node("b", watts=300)]
    req = request(watts=200, facility_cap_watts=1000)
    assert verdicts(req, nodes)["b"] == (
        "power_cap", "the facility draws 900 W of its 1000 W cap, a shard adds 200 W")
    assert isinstance(place(request(watts=100, facility_cap_watts=1000), nodes), Placement)


def test_no_cap_or_no_pdu_or_no_watts_is_not_capped() -> None:
    nodes = [node("a", pdu="p1", watts=10_000), node("b", watts=10_000)]
    assert isinstance(place(request(watts=500, pdu_caps_watts={"p2": 1}), nodes), Placement)
    assert isinstance(place(request(pdu_caps_watts={"p1": 1}), nodes), Placement)


def test_two_shards_on_one_pdu_draw_twice() -> None:
    nodes = [node("a", pdu="p1"), node("b", pdu="p1"), node("c", pdu="p2")]
    result = place(request(watts=600, min_nodes=2, pdu_caps_watts={"p1": 1000}), nodes)
    assert isinstance(result, Placement)
    assert "c" in result.node_ids  # the second shard on p1 would pass its cap
    refused = place(request(watts=600, min_nodes=3, pdu_caps_watts={"p1": 1000}), nodes)
    assert isinstance(refused, CantPlace)
    assert refused.summary.endswith("no 3 of the nodes that fit stay within the power caps "
                                    "at 600 W a shard together")


def test_a_placement_carries_its_watts_and_apply_adds_them() -> None:
    nodes = [node("a", pdu="p1", watts=100)]
    result = place(request(watts=250), nodes)
    assert isinstance(result, Placement)
    assert result.assignments[0].watts == 250
    assert apply(nodes, result)[0].watts_claimed == 350


# --- rule 10: spread -------------------------------------------------------------------

def rack_spread(max_skew: int = 1) -> Spread:
    return Spread(key=TopologyKey.RACK, max_skew=max_skew)


def test_a_node_without_the_key_is_out_of_the_spread() -> None:
    nodes = [node("a")]
    assert verdicts(request(spread=rack_spread()), nodes)["a"] == (
        "no_topology_domain", "no topology.rack label: the replicas spread over rack")


def test_spread_refuses_a_domain_past_the_skew_with_the_counts() -> None:
    # r1 holds 2 shards, r2 one: r1 would be 3 against 1.
    nodes = [node("a", rack="r1"), node("b", rack="r1"), node("c", rack="r2", claimed_gib=60)]
    req = request(spread=rack_spread(), sibling_node_ids=["a", "b", "c"])
    result = place(req, nodes)
    assert isinstance(result, CantPlace)
    seen = verdicts(req, nodes)
    assert seen["a"] == ("spread_skew", "rack r1 would hold 3 shards of d1, rack r2 holds 1: "
                                        "max skew 1")
    assert seen["c"][0] == "insufficient_memory"
    assert isinstance(place(request(spread=rack_spread(2), sibling_node_ids=["a", "b", "c"]),
                            nodes), Placement)


def test_spread_prefers_the_emptiest_domain() -> None:
    nodes = [node("a", rack="r1"), node("b", rack="r2"), node("c", rack="r2")]
    result = place(request(spread=rack_spread(5), sibling_shards={"b": 1}), nodes)
    assert isinstance(result, Placement)
    assert result.node_ids == ["a"]


def test_sibling_shards_count_many_per_node() -> None:
    nodes = [node("a", rack="r1"), node("b", rack="r2")]
    req = request(spread=rack_spread(), sibling_node_ids=["a"], sibling_shards={"a": 2})
    assert verdicts(req, nodes)["a"][0] == "spread_skew"


def test_a_cordoned_domain_does_not_hold_the_others_back() -> None:
    nodes = [node("a", rack="r1"), node("b", rack="r2", state=NodeState.CORDONED)]
    result = place(request(spread=rack_spread(), sibling_node_ids=["a"]), nodes)
    assert isinstance(result, Placement)  # r2 is not eligible, so r1 is the emptiest


def test_a_full_domain_holds_the_others_back() -> None:
    # As Kubernetes counts: r2 cannot take a shard now, but it could; r1 must not run away.
    nodes = [node("a", rack="r1"), node("b", rack="r2", claimed_gib=64)]
    result = place(request(spread=rack_spread(), sibling_node_ids=["a"]), nodes)
    assert isinstance(result, CantPlace)


def test_a_multi_node_replica_spreads_its_own_shards() -> None:
    nodes = [node(f"n{i}", rack=f"r{i % 2}") for i in range(4)]
    result = place(request(spread=rack_spread(), min_nodes=2), nodes)
    assert isinstance(result, Placement)
    assert sorted(n.labels[RACK_LABEL] for n in nodes if n.node_id in result.node_ids) == \
        ["r0", "r1"]
    refused = place(request(spread=rack_spread(), min_nodes=3,
                            node_ids=["n0", "n1", "n2"]), nodes)
    # n0 and n2 in r0, n1 in r1: three shards over two racks are 2 and 1, within 1.
    assert isinstance(refused, Placement)


def test_rules_run_in_the_docstring_order() -> None:
    nodes = [node("a", rack="r1", pdu="p1", watts=1000, hold_class=CapacityClass.CRITICAL)]
    req = request(spread=rack_spread(), watts=10, pdu_caps_watts={"p1": 1000},
                  capacity_class="standard")
    assert verdicts(req, nodes)["a"][0] == "held"
    req = request(spread=rack_spread(), watts=10, pdu_caps_watts={"p1": 1000},
                  capacity_class="critical")
    assert verdicts(req, nodes)["a"][0] == "power_cap"
    assert verdicts(request(spread=Spread(key=TopologyKey.ZONE), capacity_class="critical"),
                    nodes)["a"][0] == "no_topology_domain"


# --- properties ------------------------------------------------------------------------

CLASSES = [None, *CapacityClass]
OWNERS = [None, "acme", "acme/ml", "other"]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[NodeView], PlacementRequest]:
    count = draw(st.integers(1, 10))
    nodes = []
    for i in range(count):
        nodes.append(node(
            f"n{i}", rack=draw(st.sampled_from([None, "r0", "r1", "r2"])),
            pdu=draw(st.sampled_from([None, "p0", "p1"])),
            mem_gib=draw(st.sampled_from([8, 16, 64])),
            watts=draw(st.integers(0, 15).map(lambda h: h * 100)),
            hold_class=draw(st.sampled_from(CLASSES)),
            hold_owner=draw(st.sampled_from(OWNERS)),
            state=draw(st.sampled_from([NodeState.READY] * 4 + [NodeState.CORDONED]))))
    ids = [n.node_id for n in nodes]
    siblings = draw(st.dictionaries(st.sampled_from(ids), st.integers(1, 3), max_size=count))
    req = request(
        memory_bytes=draw(st.sampled_from([1, 4, 8])) * GIB,
        min_nodes=draw(st.integers(1, 3)),
        watts=draw(st.sampled_from([None, 100, 400])),
        pdu_caps_watts=draw(st.dictionaries(st.sampled_from(["p0", "p1"]),
                                            st.integers(0, 30).map(lambda h: h * 100))),
        facility_cap_watts=draw(st.sampled_from([None, 2000, 8000])),
        spread=draw(st.sampled_from([None, rack_spread(1), rack_spread(2)])),
        sibling_node_ids=sorted(siblings), sibling_shards=siblings,
        capacity_class=draw(st.sampled_from(CLASSES)), owner=draw(st.sampled_from(OWNERS)))
    return nodes, req


def eligible_racks(req: PlacementRequest, nodes: list[NodeView]) -> set[str]:
    """Racks of the nodes passing rules 1 to 5, recomputed here from first principles."""
    racks = set()
    for n in nodes:
        if n.state is not NodeState.READY or RACK_LABEL not in n.labels:
            continue
        if n.hold_class is not None and n.hold_class is not req.capacity_class:
            continue
        if n.hold_owner is not None and (req.owner is None
                                         or not within(req.owner, n.hold_owner)):
            continue
        racks.add(n.labels[RACK_LABEL])
    return racks


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_a_placement_keeps_holds_caps_and_skew(fleet: tuple[list[NodeView], PlacementRequest]
                                              ) -> None:
    nodes, req = fleet
    result = place(req, nodes)
    if not isinstance(result, Placement):
        return
    by_id = {n.node_id: n for n in nodes}
    chosen = [by_id[i] for i in result.node_ids]
    # Holds: never a foreign class or owner.
    for n in chosen:
        if n.hold_class is not None:
            assert req.capacity_class is n.hold_class
        if n.hold_owner is not None:
            assert req.owner is not None and within(req.owner, n.hold_owner)
    # Power: no capped PDU, nor the facility, past its cap after placing.
    after = apply(nodes, result)
    if req.watts:
        draw: Counter[str] = Counter()
        for n in after:
            if PDU_LABEL in n.labels:
                draw[n.labels[PDU_LABEL]] += n.watts_claimed
        before: Counter[str] = Counter()
        for n in nodes:
            if PDU_LABEL in n.labels:
                before[n.labels[PDU_LABEL]] += n.watts_claimed
        for pdu, cap in req.pdu_caps_watts.items():
            if draw[pdu] > before[pdu]:
                assert draw[pdu] <= cap
        if req.facility_cap_watts is not None:
            assert sum(n.watts_claimed for n in after) <= req.facility_cap_watts
    # Skew: if it was within max_skew over the eligible racks, it still is.
    if req.spread is not None:
        racks = eligible_racks(req, nodes)
        counts = Counter({r: 0 for r in racks})
        for node_id, shards in req.sibling_shards.items():
            rack = by_id[node_id].labels.get(RACK_LABEL)
            if rack in racks:
                counts[rack] += shards
        was = max(counts.values()) - min(counts.values())
        for n in chosen:
            assert n.labels[RACK_LABEL] in racks
            counts[n.labels[RACK_LABEL]] += 1
        if was <= req.spread.max_skew:
            assert max(counts.values()) - min(counts.values()) <= req.spread.max_skew


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_place_and_explain_agree(fleet: tuple[list[NodeView], PlacementRequest]) -> None:
    nodes, req = fleet
    result = place(req, nodes)
    decisions = {d.node_id: d for d in explain(req, nodes)}
    if isinstance(result, Placement):
        assert all(decisions[i].fits for i in result.node_ids)
    else:
        assert {r.node_id for r in result.rejections} == {
            i for i, d in decisions.items() if not d.fits}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["p0", "p1", "p2"]), st.integers(0, 10)),
                min_size=1, max_size=8),
       st.integers(1, 3), st.integers(1, 5),
       st.dictionaries(st.sampled_from(["p0", "p1"]), st.integers(-5, 5)))
def test_a_placement_never_takes_a_pdu_past_its_cap(
        fleet: list[tuple[str, int]], min_nodes: int, hundreds: int,
        margins: dict[str, int]) -> None:
    # Caps drawn near each PDU's draw, so that the edge of every cap is met often.
    nodes = [node(f"n{i}", pdu=pdu, watts=w * 100) for i, (pdu, w) in enumerate(fleet)]
    before: Counter[str] = Counter()
    for n in nodes:
        before[n.labels[PDU_LABEL]] += n.watts_claimed
    caps = {pdu: max(0, before[pdu] + m * 100) for pdu, m in margins.items()}
    result = place(request(watts=hundreds * 100, min_nodes=min_nodes, pdu_caps_watts=caps),
                   nodes)
    if isinstance(result, CantPlace):
        # Refused only when no min_nodes nodes could stay within the caps: check by count.
        room = sum(max(0, (caps[p] - before[p]) // (hundreds * 100)) if p in caps
                   else min_nodes for p in {n.labels[PDU_LABEL] for n in nodes})
        nodes_per_pdu = Counter(n.labels[PDU_LABEL] for n in nodes)
        fits = sum(min(nodes_per_pdu[p], max(0, (caps[p] - before[p]) // (hundreds * 100))
                       if p in caps else nodes_per_pdu[p]) for p in nodes_per_pdu)
        assert fits < min_nodes, (room, fits)
        return
    after: Counter[str] = Counter()
    for n in apply(nodes, result):
        after[n.labels[PDU_LABEL]] += n.watts_claimed
    for pdu, cap in caps.items():
        assert after[pdu] <= cap or after[pdu] == before[pdu]
