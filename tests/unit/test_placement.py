"""Placement: a table for each rule and the exact wording of "can't place", then
properties over random clusters checked against an independent brute-force oracle."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.placement import (
    AVOIDED_MESSAGE,
    SUMMARY_LIMIT_BYTES,
    CantPlace,
    GpuView,
    NodeState,
    NodeView,
    Placement,
    PlacementRequest,
    RejectionReason,
    ShardAssignment,
    apply,
    explain,
    place,
)
from modelkeeper.domain.units import GIB

pytestmark = pytest.mark.timeout(60)

MODEL = ModelId("qwen2.5-coder-14b")


def node(
    node_id: str,
    *,
    state: NodeState = NodeState.READY,
    mem_gib: float | None = 64,
    claimed_gib: float = 0,
    labels: dict[str, str] | None = None,
    cpus: int | None = None,
    cpu_claimed: float = 0.0,
    gpus: int = 0,
    unhealthy: Sequence[int] = (),
    gpu_claimed: Sequence[int] = (),
    gpu_gib: int = 80,
) -> NodeView:
    return NodeView(
        node_id=NodeId(node_id),
        name=node_id,
        state=state,
        labels=labels or {},
        memory_total_bytes=None if mem_gib is None else int(mem_gib * GIB),
        memory_claimed_bytes=int(claimed_gib * GIB),
        cpu_count=cpus,
        cpu_claimed=cpu_claimed,
        gpus=[
            GpuView(index=i, memory_bytes=gpu_gib * GIB, healthy=i not in unhealthy)
            for i in range(gpus)
        ],
        gpu_claimed=list(gpu_claimed),
    )


def req(
    mem_gib: float = 0,
    *,
    cpu: float | None = None,
    gpus: int | None = None,
    min_nodes: int = 1,
    node_ids: list[str] | None = None,
    labels: dict[str, str] | None = None,
    avoid: Sequence[str] = (),
    siblings: Sequence[str] = (),
) -> PlacementRequest:
    return PlacementRequest(
        model_id=MODEL,
        memory_bytes=int(mem_gib * GIB),
        cpu_cores=cpu,
        gpus=gpus,
        min_nodes=min_nodes,
        node_ids=None if node_ids is None else [NodeId(i) for i in node_ids],
        labels=labels or {},
        avoid_node_ids=[NodeId(i) for i in avoid],
        deployment_id=DeploymentId("d1") if siblings else None,
        sibling_node_ids=[NodeId(i) for i in siblings],
    )


def placed(result: Placement | CantPlace) -> Placement:
    assert isinstance(result, Placement), getattr(result, "summary", result)
    return result


def cant(result: Placement | CantPlace) -> CantPlace:
    assert isinstance(result, CantPlace), result
    return result


def reason_of(result: CantPlace, node_id: str) -> tuple[RejectionReason, str]:
    (r,) = [r for r in result.rejections if r.node_id == node_id]
    return r.reason_code, r.message


# --- avoid ---------------------------------------------------------------------------


def test_an_avoided_node_is_never_chosen() -> None:
    # The avoided node is the better bin-packing fit (and the only fit for 24 GiB).
    nodes = [node("a", mem_gib=16), node("b", mem_gib=64)]
    assert placed(place(req(8), nodes)).node_ids == ["a"]
    assert placed(place(req(8, avoid=["a"]), nodes)).node_ids == ["b"]
    result = cant(place(req(24, avoid=["b"]), nodes))
    assert reason_of(result, "b") == (RejectionReason.AVOIDED, AVOIDED_MESSAGE)
    assert result.summary == (
        "node a: 16.0 GiB free, needs 24.0 GiB; node b: avoided (being drained)")


def test_avoid_is_reported_before_the_drains_own_cordon() -> None:
    # A drain cordons the node it empties; "cordoned" would hide why it was skipped.
    n = node("a", state=NodeState.CORDONED, mem_gib=1)
    result = cant(place(req(100, node_ids=["z"], avoid=["a"]), [n]))
    assert reason_of(result, "a") == (RejectionReason.AVOIDED, "avoided (being drained)")


def test_avoiding_an_unknown_node_changes_nothing() -> None:
    nodes = [node("a"), node("b")]
    assert place(req(8, avoid=["zz"]), nodes) == place(req(8), nodes)


# --- state ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "code"),
    [
        (NodeState.UNREACHABLE, RejectionReason.UNREACHABLE),
        (NodeState.LOST, RejectionReason.LOST),
        (NodeState.CORDONED, RejectionReason.CORDONED),
    ],
)
def test_only_ready_nodes_take_shards(state: NodeState, code: RejectionReason) -> None:
    result = cant(place(req(1), [node("a", state=state, mem_gib=512)]))
    assert reason_of(result, "a") == (code, str(state))
    assert result.summary == f"node a: {state}"


def test_a_cordoned_node_is_skipped_for_a_ready_one() -> None:
    # The cordoned node is the better bin-packing fit; it must still not be used.
    nodes = [node("a", state=NodeState.CORDONED, mem_gib=16), node("b", mem_gib=64)]
    assert placed(place(req(16), nodes)).node_ids == ["b"]


def test_state_is_reported_before_anything_else() -> None:
    n = node("a", state=NodeState.CORDONED, mem_gib=1, labels={})
    result = cant(place(req(100, node_ids=["z"], labels={"gpu": "a100"}), [n]))
    assert reason_of(result, "a")[0] is RejectionReason.CORDONED


# --- node_ids and labels -------------------------------------------------------------


def test_node_ids_restrict_the_candidates() -> None:
    nodes = [node("a", mem_gib=16), node("b", mem_gib=64)]
    # a is the bin-packing choice, but only b is allowed.
    assert placed(place(req(8, node_ids=["b"]), nodes)).node_ids == ["b"]
    result = cant(place(req(8, node_ids=["c"]), nodes))
    assert reason_of(result, "a") == (RejectionReason.NOT_IN_NODE_IDS, "not in node_ids")
    assert result.unknown_node_ids == ["c"]
    assert result.summary == (
        "node a: not in node_ids; node b: not in node_ids; node_ids not registered: c"
    )


def test_labels_must_all_match() -> None:
    nodes = [
        node("a", labels={"gpu": "h100"}),
        node("b", labels={"zone": "x"}),
        node("c", labels={"gpu": "a100", "zone": "x", "extra": "ok"}),
    ]
    assert placed(place(req(1, labels={"gpu": "a100", "zone": "x"}), nodes)).node_ids == ["c"]
    result = cant(place(req(1, labels={"gpu": "a100"}), nodes[:2]))
    assert reason_of(result, "a") == (
        RejectionReason.MISSING_LABELS,
        "missing label gpu=a100 (has gpu=h100)",
    )
    assert reason_of(result, "b") == (RejectionReason.MISSING_LABELS, "missing label gpu=a100")
    result = cant(place(req(1, labels={"zone": "y", "gpu": "a100"}), [nodes[1]]))
    assert reason_of(result, "b")[1] == "missing labels gpu=a100, zone=y (has zone=x)"


# --- memory --------------------------------------------------------------------------


def test_memory_shortfall_names_free_and_needed() -> None:
    nodes = [node("b", mem_gib=16, claimed_gib=8), node("c", state=NodeState.CORDONED)]
    result = cant(place(req(24), nodes))
    assert reason_of(result, "b") == (
        RejectionReason.INSUFFICIENT_MEMORY,
        "8.0 GiB free, needs 24.0 GiB",
    )
    assert result.summary == "node b: 8.0 GiB free, needs 24.0 GiB; node c: cordoned"


def test_an_exact_fit_fits() -> None:
    a = placed(place(req(24), [node("a", mem_gib=32, claimed_gib=8)])).assignments[0]
    assert a.memory_bytes == 24 * GIB


def test_memory_message_shows_bytes_when_the_rounded_figures_agree() -> None:
    n = NodeView(node_id=NodeId("a"), name="a", state=NodeState.READY, memory_total_bytes=GIB - 1)
    request = PlacementRequest(model_id=MODEL, memory_bytes=GIB)
    assert cant(place(request, [n])).summary == (
        f"node a: 1.0 GiB ({GIB - 1} bytes) free, needs 1.0 GiB ({GIB} bytes)"
    )


def test_no_memory_requirement_fits_even_an_over_claimed_node() -> None:
    over = node("a", mem_gib=8, claimed_gib=12)
    assert placed(place(req(0), [over])).node_ids == ["a"]
    result = cant(place(req(1), [over]))
    assert reason_of(result, "a")[1] == "-4.0 GiB free, needs 1.0 GiB"


def test_a_node_without_memory_reported_fits_but_is_chosen_last() -> None:
    old = node("a", mem_gib=None)
    new = node("z", mem_gib=32)
    # The known node fits: it wins even though "a" sorts first by id.
    assert placed(place(req(16), [old, new])).node_ids == ["z"]
    # Nothing known fits: the old agent is used rather than refusing.
    assert placed(place(req(48), [old, new])).node_ids == ["a"]
    assert placed(place(req(48), [old])).node_ids == ["a"]
    # Multi-node: known nodes are the emptiest choice, the unknown one fills in last.
    p = placed(place(req(32, min_nodes=2), [old, new, node("m", mem_gib=64)]))
    assert p.node_ids == ["m", "z"]
    p = placed(place(req(32, min_nodes=3), [old, new, node("m", mem_gib=64)]))
    assert p.node_ids == ["m", "z", "a"]


# --- CPU -----------------------------------------------------------------------------


def test_cpu_must_fit_when_both_sides_declare_it() -> None:
    busy = node("a", cpus=8, cpu_claimed=6.5)
    result = cant(place(req(1, cpu=4), [busy]))
    assert reason_of(result, "a") == (
        RejectionReason.INSUFFICIENT_CPU,
        "1.5 of 8 CPU cores free, needs 4",
    )
    assert placed(place(req(1, cpu=1.5), [busy])).assignments[0].cpu_cores == 1.5
    result = cant(place(req(1, cpu=0.25), [node("q", cpus=1, cpu_claimed=0.875)]))
    assert reason_of(result, "q")[1] == "0.125 of 1 CPU cores free, needs 0.25"
    # A node that does not report CPUs, or a request without a CPU figure: no CPU check.
    assert placed(place(req(1, cpu=64), [node("b", cpus=None)])).node_ids == ["b"]
    p = placed(place(req(1), [node("c", cpus=1, cpu_claimed=1.0)]))
    assert p.assignments[0].cpu_cores == 0.0


def test_summed_fractional_claims_do_not_reject_an_exact_fit() -> None:
    # 0.2 + 0.4 leaves 0.3999999999999999 in floating point.
    n = node("a", cpus=1, cpu_claimed=0.2 + 0.4)
    assert placed(place(req(0, cpu=0.4), [n])).node_ids == ["a"]


# --- GPUs ----------------------------------------------------------------------------


def test_gpus_are_the_lowest_free_healthy_indices() -> None:
    n = node("a", gpus=6, unhealthy=[1], gpu_claimed=[0, 3], gpu_gib=80)
    a = placed(place(req(1, gpus=2), [n])).assignments[0]
    assert a.gpu_indices == [2, 4]
    assert a.gpu_memory_bytes == 160 * GIB
    none = placed(place(req(1), [n])).assignments[0]
    assert none.gpu_indices == [] and none.gpu_memory_bytes is None


def test_gpu_shortfall_counts_claimed_and_unhealthy() -> None:
    n = node("a", gpus=4, unhealthy=[1], gpu_claimed=[0, 3])
    result = cant(place(req(1, gpus=2), [n]))
    assert reason_of(result, "a") == (
        RejectionReason.INSUFFICIENT_GPUS,
        "1 of 4 GPUs free (2 claimed, 1 unhealthy), needs 2",
    )
    result = cant(place(req(1, gpus=1), [node("b")]))
    assert reason_of(result, "b")[1] == "0 of 0 GPUs free, needs 1"


# --- choosing among fitting nodes ----------------------------------------------------


def test_one_node_replicas_are_bin_packed() -> None:
    nodes = [
        node("empty", mem_gib=128),
        node("half", mem_gib=64, claimed_gib=32),  # 32 free -> 8 after
        node("tight", mem_gib=32, claimed_gib=10),  # 22 free: does not fit
        node("big", mem_gib=256, claimed_gib=200),  # 56 free -> 32 after
    ]
    assert placed(place(req(24), nodes)).node_ids == ["half"]


def test_bin_packing_ties_break_by_node_id_whatever_the_input_order() -> None:
    nodes = [node("c", mem_gib=32), node("a", mem_gib=32), node("b", mem_gib=32)]
    for order in itertools.permutations(nodes):
        assert placed(place(req(8), order)).node_ids == ["a"]


def test_multi_node_replicas_get_the_emptiest_nodes() -> None:
    nodes = [
        node("a", mem_gib=64, claimed_gib=40),  # 24 free
        node("b", mem_gib=128),  # 128 free
        node("c", mem_gib=64),  # 64 free
        node("d", mem_gib=96),  # 96 free
    ]
    p = placed(place(req(40, min_nodes=3), nodes))
    assert p.node_ids == ["b", "d", "c"]
    assert [a.rank for a in p.assignments] == [0, 1, 2]
    # Each shard carries an even share, rounded up.
    request = PlacementRequest(model_id=MODEL, memory_bytes=10, min_nodes=3)
    p = placed(place(request, nodes))
    assert [a.memory_bytes for a in p.assignments] == [4, 4, 4]


def test_multi_node_shards_each_need_their_own_gpus_and_cpus() -> None:
    nodes = [node("a", gpus=2, cpus=8), node("b", gpus=2, cpus=8, gpu_claimed=[0])]
    p = placed(place(req(8, gpus=1, cpu=2, min_nodes=2), nodes))
    assert [(a.node_id, a.gpu_indices, a.cpu_cores) for a in p.assignments] == [
        ("a", [0], 2.0),
        ("b", [1], 2.0),
    ]


# --- spread: replicas of one deployment on distinct nodes -------------------------------


def test_a_node_without_a_replica_of_the_deployment_is_preferred() -> None:
    # Bin-packing alone would stack the second replica on "a" with the first.
    nodes = [node("a", mem_gib=64, claimed_gib=32), node("b", mem_gib=128)]
    assert placed(place(req(8), nodes)).node_ids == ["a"]
    p = placed(place(req(8, siblings=["a"]), nodes))
    assert p.node_ids == ["b"]
    assert p.note is None


def test_spread_is_preferred_over_bin_packing_among_the_others_too() -> None:
    nodes = [node("a", mem_gib=16), node("b", mem_gib=128), node("c", mem_gib=32)]
    # Among the nodes without a replica, the tightest fit still wins.
    assert placed(place(req(8, siblings=["a"]), nodes)).node_ids == ["c"]


def test_sharing_a_node_says_so_and_why_no_other_node_would_do() -> None:
    nodes = [
        node("n1", mem_gib=64),
        node("n2", mem_gib=16, claimed_gib=15),
        node("n3", state=NodeState.CORDONED),
        node("n4", mem_gib=64),
    ]
    p = placed(place(req(2, avoid=["n4"], siblings=["n1"]), nodes))
    assert p.node_ids == ["n1"]
    assert p.note == (
        "shares node n1 with another replica of d1: no other node has room "
        "(node n2: 1.0 GiB free, needs 2.0 GiB; node n3: cordoned; "
        "node n4: avoided (being drained))")


def test_a_lone_node_is_shared_without_complaint_about_other_nodes() -> None:
    p = placed(place(req(2, siblings=["n1"]), [node("n1")]))
    assert p.note == "shares node n1 with another replica of d1: every node holds one already"


def test_a_multi_node_replica_spreads_and_names_each_node_it_shares() -> None:
    nodes = [node("a", mem_gib=128), node("b", mem_gib=96), node("c", mem_gib=64),
             node("d", mem_gib=8)]
    # Emptiest first would take a and b; both hold a replica, so c first, then a.
    p = placed(place(req(32, min_nodes=2, siblings=["a", "b"]), nodes))
    assert p.node_ids == ["c", "a"]
    assert p.note == (
        "shares node a with another replica of d1: needs 2 nodes, 1 other node has room "
        "(node d: 8.0 GiB free, needs 16.0 GiB per shard)")
    p = placed(place(req(32, min_nodes=3, siblings=["a", "b", "c"]), nodes))
    assert p.note is not None
    assert p.note.startswith("shares nodes a, b, c with other replicas of d1: "
                             "needs 3 nodes, 0 other nodes have room")


def test_without_siblings_the_placement_has_no_note() -> None:
    assert placed(place(req(8), [node("a")])).note is None


# --- the summary ---------------------------------------------------------------------


def test_no_nodes_at_all() -> None:
    assert cant(place(req(1), [])).summary == "no nodes registered"
    assert cant(place(req(1, min_nodes=3), [])).summary == "no nodes registered"


def test_too_few_nodes_for_min_nodes_states_the_shortfall() -> None:
    nodes = [
        node("a", mem_gib=64),
        node("b", mem_gib=16, claimed_gib=8),
        node("c", state=NodeState.CORDONED),
        node("d", mem_gib=64),
    ]
    result = cant(place(req(72, min_nodes=3), nodes))
    assert result.summary == (
        "needs 3 nodes, 2 fit (a, d): node b: 8.0 GiB free, needs 24.0 GiB per shard; "
        "node c: cordoned"
    )
    assert result.fitting_node_ids == ["a", "d"]
    assert result.needed_nodes == 3
    assert [r.node_id for r in result.rejections] == ["b", "c"]


def test_shortfall_when_every_node_fits_but_there_are_too_few() -> None:
    result = cant(place(req(8, min_nodes=3), [node("a"), node("b")]))
    assert result.summary == "needs 3 nodes, 2 fit (a, b)"
    assert result.rejections == []
    result = cant(place(req(8, min_nodes=2), [node("a", state=NodeState.LOST)]))
    assert result.summary == "needs 2 nodes, 0 fit: node a: lost"


def thousand_node_fleet() -> list[NodeView]:
    """1,000 nodes that all say no, for different reasons and by different margins."""
    nodes = []
    for i in range(1000):
        name = f"node-{i:04d}-in-a-rack-with-a-long-name"
        if i % 4 == 0:
            nodes.append(node(name, mem_gib=16, claimed_gib=(i % 97) / 10))
        elif i % 4 == 1:
            nodes.append(node(name, state=NodeState.CORDONED))
        elif i % 4 == 2:
            nodes.append(node(name, state=NodeState.LOST))
        else:
            nodes.append(node(name, state=NodeState.UNREACHABLE))
    return nodes


def test_the_summary_stays_under_4_kb_at_a_thousand_nodes() -> None:
    nodes = thousand_node_fleet()
    result = cant(place(req(24), nodes))
    assert len(result.summary.encode()) <= SUMMARY_LIMIT_BYTES
    # Every rejection is still there as data; only the sentence is bounded.
    assert len(result.rejections) == 1000
    # The closest nodes come first: short of memory, smallest shortfall first (claimed 0).
    assert result.summary.startswith("node node-0000-in-a-rack-with-a-long-name: 16.0 GiB free")
    listed = result.summary.count("node node-")
    # Then the rest, counted by cause, and the counts add up.
    tail = result.summary.split("; and ", 1)[1]
    omitted = int(tail.split(" more", 1)[0])
    assert listed + omitted == 1000
    counts = tail.split("(", 1)[1].split(")", 1)[0]
    assert sum(int(part.split()[0]) for part in counts.split(", ")) == omitted
    assert "250 lost" in counts and "250 unreachable" in counts and "`modelkeeper explain`" in tail


def test_the_summary_stays_under_4_kb_at_a_thousand_nodes_with_half_avoided() -> None:
    nodes = thousand_node_fleet()
    avoid = [n.node_id for n in nodes[::2]]
    result = cant(place(req(24, avoid=avoid), nodes))
    assert len(result.summary.encode()) <= SUMMARY_LIMIT_BYTES
    assert sum(r.reason_code is RejectionReason.AVOIDED for r in result.rejections) == 500
    tail = result.summary.split("; and ", 1)[1]
    counts = tail.split("(", 1)[1].split(")", 1)[0]
    # Avoided nodes are counted by cause like the rest, and listed last: they will never
    # take this replica, so the nodes closer to fitting get the room.
    assert "500 avoided" in counts
    assert AVOIDED_MESSAGE not in result.summary
    listed = result.summary.count("node node-")
    assert listed + int(tail.split(" more", 1)[0]) == 1000


def test_the_sharing_note_stays_under_4_kb_at_a_thousand_nodes() -> None:
    nodes = [*thousand_node_fleet(), node("home", mem_gib=64)]
    avoid = [n.node_id for n in nodes[1:1000:2]]
    p = placed(place(req(24, avoid=avoid, siblings=["home"]), nodes))
    assert p.node_ids == ["home"]
    assert p.note is not None
    assert len(p.note.encode()) <= SUMMARY_LIMIT_BYTES
    assert p.note.startswith("shares node home with another replica of d1: no other node "
                             "has room (node node-0000-in-a-rack-with-a-long-name: 16.0 GiB")
    tail = p.note.split("; and ", 1)[1]
    assert "avoided" in tail and "`modelkeeper explain`" in tail
    listed = p.note.count("node node-")
    assert listed + int(tail.split(" more", 1)[0]) == 1000


def test_a_short_summary_is_not_cut() -> None:
    nodes = thousand_node_fleet()[:8]
    result = cant(place(req(24), nodes))
    assert "more" not in result.summary
    assert result.summary.count("node node-") == 8


# --- explain and apply ---------------------------------------------------------------


def test_explain_lists_every_node_with_its_numbers() -> None:
    nodes = [node("b", mem_gib=16, claimed_gib=8), node("a", mem_gib=32), node("c", mem_gib=None)]
    decisions = explain(req(8), nodes)
    assert [d.node_id for d in decisions] == ["a", "b", "c"]
    assert [d.fits for d in decisions] == [True, True, True]
    assert decisions[0].memory_free_after_bytes == 24 * GIB
    assert decisions[0].message == "fits: 32.0 GiB free, 24.0 GiB left after"
    assert decisions[1].message == "fits: 8.0 GiB free, 0.0 GiB left after"
    assert decisions[2].message == "fits (memory not reported)"
    decisions = explain(req(16), nodes)
    assert decisions[1].message == "8.0 GiB free, needs 16.0 GiB"
    assert decisions[1].rejection is not None


def test_apply_adds_the_claims() -> None:
    nodes = [node("a", mem_gib=32, cpus=8, gpus=2), node("b")]
    p = placed(place(req(8, cpu=2, gpus=1), nodes))
    after = apply(nodes, p)
    assert after[1] == nodes[1]
    assert after[0].memory_claimed_bytes == 8 * GIB
    assert after[0].cpu_claimed == 2.0
    assert after[0].gpu_claimed == [0]
    with pytest.raises(ValueError, match="already claimed"):
        apply(after, p)
    with pytest.raises(ValueError, match="unknown nodes: a"):
        apply([nodes[1]], p)


def test_duplicate_node_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        place(req(1), [node("a"), node("a")])


def test_a_placement_cannot_have_bad_ranks_or_repeat_a_node() -> None:
    def shard(node_id: str, rank: int) -> ShardAssignment:
        return ShardAssignment(node_id=NodeId(node_id), rank=rank, memory_bytes=0, cpu_cores=0)

    with pytest.raises(ValidationError):
        Placement(assignments=[shard("a", 1), shard("b", 0)])
    with pytest.raises(ValidationError):
        Placement(assignments=[shard("a", 0), shard("a", 1)])


# --- properties over random clusters -------------------------------------------------

POOL = ["a", "b", "c", "d", "e", "f", "g", "h"]
LABELS = {"gpu": ["a100", "h100"], "zone": ["x", "y"]}
HALF_GIB = GIB // 2


@st.composite
def node_views(draw: st.DrawFn, node_id: str) -> NodeView:
    total = draw(st.one_of(st.none(), st.integers(0, 128).map(lambda h: h * HALF_GIB)))
    if total is None:
        claimed = draw(st.integers(0, 64)) * HALF_GIB
    else:
        # Mostly within capacity; sometimes over (a node that came back smaller).
        claimed = draw(st.integers(0, total // HALF_GIB + 2)) * HALF_GIB
    cpus = draw(st.one_of(st.none(), st.integers(0, 16)))
    cpu_claimed = 0.0 if cpus is None else draw(st.integers(0, cpus * 2)) / 2
    n_gpus = draw(st.integers(0, 4))
    gpus = [
        GpuView(index=i, memory_bytes=24 * GIB, healthy=draw(st.sampled_from([True, True, False])))
        for i in range(n_gpus)
    ]
    gpu_claimed = (
        draw(st.lists(st.sampled_from(range(n_gpus)), unique=True, max_size=2)) if n_gpus else []
    )
    labels = {k: draw(st.sampled_from(v)) for k, v in LABELS.items() if draw(st.booleans())}
    state = draw(
        st.sampled_from([NodeState.READY] * 8 + list(NodeState)),
    )
    return NodeView(
        node_id=NodeId(node_id),
        name=f"n-{node_id}",
        state=state,
        labels=labels,
        memory_total_bytes=total,
        memory_claimed_bytes=claimed,
        cpu_count=cpus,
        cpu_claimed=cpu_claimed,
        gpus=gpus,
        gpu_claimed=gpu_claimed,
    )


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeView]:
    ids = draw(st.lists(st.sampled_from(POOL), unique=True, max_size=8))
    return [draw(node_views(i)) for i in ids]


@st.composite
def requests(draw: st.DrawFn) -> PlacementRequest:
    # Mostly half-GiB steps (ties and exact fits), sometimes odd bytes (rounding).
    memory = draw(
        st.one_of(
            st.integers(0, 64).map(lambda h: h * HALF_GIB),
            st.integers(0, 32 * GIB),
        )
    )
    # Restrictions are drawn sparingly so that many requests can be placed.
    node_ids = None
    if draw(st.integers(0, 3)) == 0:
        node_ids = draw(st.lists(st.sampled_from([*POOL, "zz"]), unique=True, min_size=1))
    labels = {
        k: draw(st.sampled_from(v)) for k, v in LABELS.items() if draw(st.integers(0, 5)) == 0
    }
    avoid = []
    if draw(st.integers(0, 3)) == 0:
        avoid = draw(st.lists(st.sampled_from([*POOL, "zz"]), unique=True, max_size=3))
    return PlacementRequest(
        model_id=MODEL,
        memory_bytes=memory,
        cpu_cores=draw(st.one_of(st.none(), st.none(), st.integers(1, 16).map(lambda c: c / 2))),
        gpus=draw(st.sampled_from([None, None, None, 0, 1, 2, 3])),
        min_nodes=draw(st.sampled_from([1, 1, 1, 2, 2, 3, 4])),
        node_ids=None if node_ids is None else [NodeId(i) for i in node_ids],
        labels=labels,
        avoid_node_ids=[NodeId(i) for i in avoid],
    )


def oracle_fits(request: PlacementRequest, n: NodeView) -> bool:
    """Could ``n`` take one shard? Written from the rules, not from placement.py."""
    need = math.ceil(request.memory_bytes / request.min_nodes)
    if n.node_id in request.avoid_node_ids:
        return False
    if n.state != NodeState.READY:
        return False
    if request.node_ids is not None and n.node_id not in request.node_ids:
        return False
    if any(n.labels.get(k) != v for k, v in request.labels.items()):
        return False
    total, cpus = n.memory_total_bytes, n.cpu_count
    if need and total is not None and total - n.memory_claimed_bytes < need:
        return False
    cores = request.cpu_cores
    if cores is not None and cpus is not None and cpus - n.cpu_claimed < cores - 1e-9:
        return False
    free_gpus = [g for g in n.gpus if g.healthy and g.index not in n.gpu_claimed]
    return len(free_gpus) >= (request.gpus or 0)


def brute_force_exists(request: PlacementRequest, nodes: Sequence[NodeView]) -> bool:
    """Is there any set of min_nodes distinct nodes that could each take a shard?"""
    return any(
        all(oracle_fits(request, n) for n in combo)
        for combo in itertools.combinations(nodes, request.min_nodes)
    )


def assert_never_over_claims(before: Sequence[NodeView], p: Placement) -> list[NodeView]:
    after = apply(before, p)  # raises on a GPU claimed twice or not on the node
    by_id = {n.node_id: n for n in before}
    for shard in p.assignments:
        old = by_id[shard.node_id]
        new = next(n for n in after if n.node_id == shard.node_id)
        # apply must record exactly the shard's claims, or later rounds would over-claim.
        assert new.memory_claimed_bytes == old.memory_claimed_bytes + shard.memory_bytes
        assert new.cpu_claimed == old.cpu_claimed + shard.cpu_cores
        assert new.gpu_claimed == sorted({*old.gpu_claimed, *shard.gpu_indices})
        if shard.memory_bytes and old.memory_total_bytes is not None:
            assert new.memory_claimed_bytes <= old.memory_total_bytes
        if shard.cpu_cores and old.cpu_count is not None:
            assert new.cpu_claimed <= old.cpu_count + 1e-9
        healthy = {g.index for g in old.gpus if g.healthy}
        assert set(shard.gpu_indices) <= healthy
        assert not set(shard.gpu_indices) & set(old.gpu_claimed)
    return after


PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(request=requests(), nodes=clusters())
def test_every_placement_is_valid_and_every_refusal_is_justified(
    request: PlacementRequest, nodes: list[NodeView]
) -> None:
    result = place(request, nodes)
    exists = brute_force_exists(request, nodes)
    if isinstance(result, Placement):
        assert exists
        shards = result.assignments
        assert len(shards) == request.min_nodes
        assert len({a.node_id for a in shards}) == request.min_nodes
        assert [a.rank for a in shards] == list(range(request.min_nodes))
        by_id = {n.node_id: n for n in nodes}
        for a in shards:
            n = by_id[a.node_id]
            assert oracle_fits(request, n)
            assert n.state == NodeState.READY
            assert a.node_id not in request.avoid_node_ids
            assert request.node_ids is None or a.node_id in request.node_ids
            assert all(n.labels.get(k) == v for k, v in request.labels.items())
            assert a.memory_bytes == math.ceil(request.memory_bytes / request.min_nodes)
            assert len(a.gpu_indices) == (request.gpus or 0)
            # Lowest free healthy indices.
            free = [g.index for g in n.gpus if g.healthy and g.index not in n.gpu_claimed]
            assert a.gpu_indices == free[: len(a.gpu_indices)]
            assert a.memory_bytes * request.min_nodes >= request.memory_bytes
        assert_never_over_claims(nodes, result)
    else:
        assert not exists
        fitting = sorted(n.node_id for n in nodes if oracle_fits(request, n))
        assert result.fitting_node_ids == fitting
        rejected = [r.node_id for r in result.rejections]
        # Every node is accounted for exactly once: rejected, or fitting but too few.
        assert sorted(rejected + fitting) == sorted(n.node_id for n in nodes)
        assert len(set(rejected)) == len(rejected)
        if not nodes:
            assert result.summary == "no nodes registered"
        elif request.min_nodes == 1:
            assert fitting == []
        else:
            assert result.summary.startswith(f"needs {request.min_nodes} nodes, {len(fitting)} fit")
        names = {n.node_id: n.name for n in nodes}
        for r in result.rejections:
            assert f"node {names[r.node_id]}: {r.message}" in result.summary


@PROPERTY
@given(request=requests(), nodes=clusters())
def test_explain_agrees_with_the_oracle_on_every_node(
    request: PlacementRequest, nodes: list[NodeView]
) -> None:
    decisions = explain(request, nodes)
    assert [d.node_id for d in decisions] == sorted(n.node_id for n in nodes)
    by_id = {n.node_id: n for n in nodes}
    for d in decisions:
        assert d.fits == oracle_fits(request, by_id[d.node_id])
        assert (d.rejection is None) == d.fits


@PROPERTY
@given(request=requests(), nodes=clusters())
def test_place_and_explain_give_the_same_verdicts(
    request: PlacementRequest, nodes: list[NodeView]
) -> None:
    """place() judges every node by the verdict alone and writes decisions only where it
    must: what it returns is what explain() says of the same nodes."""
    result = place(request, nodes)
    decisions = {d.node_id: d for d in explain(request, nodes)}
    if isinstance(result, CantPlace):
        assert result.rejections == [d.rejection for d in decisions.values()
                                     if d.rejection is not None]
        return
    for shard in result.assignments:
        assert decisions[shard.node_id].fits
        assert shard.gpu_indices == decisions[shard.node_id].gpu_indices
    shares = set(result.node_ids) & set(request.sibling_node_ids)
    assert (result.note is not None) == bool(shares)


@PROPERTY
@given(request=requests(), nodes=clusters(), data=st.data())
def test_the_order_of_the_nodes_does_not_matter(
    request: PlacementRequest, nodes: list[NodeView], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(nodes))
    assert place(request, shuffled) == place(request, nodes)


@PROPERTY
@given(request=requests(), nodes=clusters())
def test_one_node_replicas_go_where_the_least_memory_is_left(
    request: PlacementRequest, nodes: list[NodeView]
) -> None:
    request = request.model_copy(update={"min_nodes": 1})
    result = place(request, nodes)
    if not isinstance(result, Placement):
        return
    (chosen,) = result.node_ids
    fitting = [n for n in nodes if oracle_fits(request, n)]
    known = [n for n in fitting if n.memory_free_bytes is not None]
    if not known:
        return  # only nodes without a memory figure fit: any of them is fine
    left = {n.node_id: (n.memory_free_bytes or 0) - request.shard_memory_bytes for n in known}
    assert chosen in left, "a node with unknown memory was chosen over a known fit"
    least = min(left.values())
    assert left[chosen] == least
    assert chosen == min(i for i, v in left.items() if v == least)


@PROPERTY
@given(request=requests(), nodes=clusters())
def test_multi_node_replicas_take_the_emptiest_nodes(
    request: PlacementRequest, nodes: list[NodeView]
) -> None:
    if request.min_nodes == 1:
        request = request.model_copy(update={"min_nodes": 2})
    result = place(request, nodes)
    if not isinstance(result, Placement):
        return
    fitting = [n for n in nodes if oracle_fits(request, n)]
    known = sorted(
        (n for n in fitting if n.memory_free_bytes is not None),
        key=lambda n: (-(n.memory_free_bytes or 0), n.node_id),
    )
    unknown = sorted((n for n in fitting if n.memory_free_bytes is None), key=lambda n: n.node_id)
    expected = [n.node_id for n in [*known, *unknown][: request.min_nodes]]
    assert result.node_ids == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests(), nodes=clusters())
def test_placing_until_nothing_fits_never_over_claims(
    request: PlacementRequest, nodes: list[NodeView]
) -> None:
    # Each placement is made against the state holding the previous ones, as the
    # control plane does; a capacity leak shows up as an over-claim on a later round.
    current = nodes
    for _ in range(12):
        result = place(request, current)
        if isinstance(result, CantPlace):
            assert not brute_force_exists(request, current)
            break
        current = assert_never_over_claims(current, result)
    for n, start in zip(current, nodes, strict=True):
        if n.memory_total_bytes is not None and n.memory_claimed_bytes > n.memory_total_bytes:
            # Only a node that started over-claimed may end over, and only by
            # zero-memory shards: its claim never grew.
            assert n.memory_claimed_bytes == start.memory_claimed_bytes
        if n.cpu_count is not None and request.cpu_cores is not None:
            assert n.cpu_claimed <= max(n.cpu_count + 1e-9, start.cpu_claimed)


@PROPERTY
@given(request=requests(), nodes=clusters(), data=st.data())
def test_replicas_share_a_node_only_when_too_few_others_fit(
    request: PlacementRequest, nodes: list[NodeView], data: st.DataObject
) -> None:
    siblings = data.draw(st.lists(st.sampled_from(POOL), unique=True, max_size=8))
    spread = request.model_copy(update={"deployment_id": DeploymentId("d1"),
                                        "sibling_node_ids": [NodeId(i) for i in siblings]})
    result = place(spread, nodes)
    # Spread is a preference, never a rule: it places exactly when placement without it does.
    assert isinstance(result, Placement) == isinstance(place(request, nodes), Placement)
    if not isinstance(result, Placement):
        return
    free_of_them = [n for n in nodes if oracle_fits(request, n) and n.node_id not in siblings]
    shared = [i for i in result.node_ids if i in siblings]
    assert len(shared) == max(0, request.min_nodes - len(free_of_them))
    assert (result.note is None) == (not shared)
    if result.note is not None:
        assert len(result.note.encode()) <= SUMMARY_LIMIT_BYTES
        names = {n.node_id: n.name for n in nodes}
        assert all(names[i] in result.note for i in shared)
