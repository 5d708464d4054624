"""modelkeeper.domain.measured and .sizing: the level bench keeps, the stored form per GPU
or per core, sizing by Little's law against the room there is, and the order of profiles
of equal priority by measured tokens per GPU or core."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from modelkeeper.domain.ids import ModelId, NodeId
from modelkeeper.domain.measured import (
    CapacityReport,
    LevelResult,
    MeasuredCapacity,
    Objective,
    Unit,
    concurrency_steps,
    measured_of,
    most_cautious,
    order_equal_priority,
    percentile,
    rank,
    scores,
    size,
    sustained,
)
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.placement import NodeView, PlacementRequest
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.sizing import room_for

GIB = 1 << 30
WHEN = datetime(2026, 12, 3, tzinfo=UTC)
SLO = Objective(ttft_p95_s=1.0, itl_p95_s=0.1)


def level(concurrency: int, *, ttft: float = 0.2, itl: float = 0.05, errors: int = 0,
          tokens_per_s: float = 100.0) -> LevelResult:
    return LevelResult(concurrency=concurrency, requests=40, errors=errors, ttft_p95_s=ttft,
                       itl_p95_s=itl, tokens_per_s=tokens_per_s, mean_request_s=2.0)


def capacity(profile: str = "", *, concurrency: int = 8, mean_request_s: float = 2.0,
             per_unit: float | None = None, tokens_per_s: float = 100.0,
             unit: Unit | None = None) -> MeasuredCapacity:
    return MeasuredCapacity(
        model_id=ModelId("m"), profile=profile, concurrency=concurrency,
        tokens_per_s=tokens_per_s, unit=unit, tokens_per_s_per_unit=per_unit,
        mean_request_s=mean_request_s, ttft_p95_s=0.5, objective=SLO, replicas=1,
        max_tokens=128, measured_at=WHEN)


# -- the climb ----------------------------------------------------------------------------


def test_levels_double_up_to_the_bound() -> None:
    assert concurrency_steps(1) == [1]
    assert concurrency_steps(8) == [1, 2, 4, 8]
    assert concurrency_steps(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="at least 1"):
        concurrency_steps(0)


def test_percentile_is_a_measured_value_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.95) == 95.0
    assert percentile([3.0, 1.0, 2.0], 0.95) == 3.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_the_capacity_is_the_last_level_before_the_first_miss() -> None:
    levels = [level(1), level(2), level(4, ttft=0.9), level(8, ttft=1.5), level(16)]
    best = sustained(levels, SLO)
    # 16 met it again after 8 missed: noise past the break, not capacity.
    assert best is not None and best.concurrency == 4


def test_each_objective_and_every_error_can_break_a_level() -> None:
    assert level(1, ttft=1.01).miss(SLO) == "TTFT p95 1010 ms is above the objective 1000 ms"
    assert level(1, itl=0.2).miss(SLO) == ("inter-token p95 200 ms is above the objective "
                                           "100 ms")
    assert level(1, errors=1).miss(SLO) == "1 of 40 request(s) failed"
    assert sustained([level(1, errors=1), level(2)], SLO) is None


# -- the stored form ----------------------------------------------------------------------


def report(tokens_per_s: float = 120.0) -> CapacityReport:
    return CapacityReport(concurrency=6, tokens_per_s=tokens_per_s, mean_request_s=3.0,
                          ttft_p95_s=0.4, itl_p95_s=0.05, objective=SLO, replicas=2,
                          max_tokens=128)


def test_throughput_is_per_gpu_where_the_model_holds_gpus_else_per_core() -> None:
    on_gpus = measured_of(report(), model_id=ModelId("m"), engine=EngineKind.VLLM, gpus=2,
                          cpu_cores=8, at=WHEN)
    assert (on_gpus.unit, on_gpus.tokens_per_s_per_unit) == (Unit.GPU, 60.0)
    on_cores = measured_of(report(), model_id=ModelId("m"), engine=EngineKind.LLAMACPP,
                           gpus=0, cpu_cores=4, at=WHEN)
    assert (on_cores.unit, on_cores.tokens_per_s_per_unit) == (Unit.CORE, 30.0)
    neither = measured_of(report(), model_id=ModelId("m"), engine=EngineKind.SIM, gpus=None,
                          cpu_cores=None, at=WHEN)
    assert (neither.unit, neither.tokens_per_s_per_unit) == (None, None)


def test_a_report_out_of_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        CapacityReport(concurrency=0, tokens_per_s=1.0, mean_request_s=1.0, ttft_p95_s=0.1,
                       objective=SLO, replicas=1, max_tokens=1)
    # Found by the API's fuzzing: a mean of 5e-324 s made requests/s infinite.
    with pytest.raises(ValueError, match="mean_request_s"):
        CapacityReport(concurrency=1, tokens_per_s=1.0, mean_request_s=5e-324,
                       ttft_p95_s=0.1, objective=SLO, replicas=1, max_tokens=1)


def test_a_sliver_of_a_core_gives_no_per_core_figure_rather_than_infinity() -> None:
    tiny = measured_of(report(1e9), model_id=ModelId("m"), engine=EngineKind.LLAMACPP,
                       gpus=None, cpu_cores=5e-324, at=WHEN)
    assert (tiny.unit, tiny.tokens_per_s_per_unit) == (None, None)


# -- sizing -------------------------------------------------------------------------------


def test_size_by_littles_law() -> None:
    # 10 req/s x 2 s each = 20 open at once; 8 per replica: 3 replicas.
    answer = size(capacity(), rps=10, replicas_now=1, fit_now=5)
    assert (answer.concurrency_needed, answer.replicas_needed) == (20.0, 3)
    assert (answer.more_needed, answer.fit_now, answer.enough_room) == (2, 2, True)
    assert answer.per_replica_rps == 4.0
    assert "Little's law: 10 req/s x 2 s mean request" in answer.assumption
    # Exactly 16 open at once is exactly 2 replicas, not 3.
    assert size(capacity(), rps=8, replicas_now=0, fit_now=9).replicas_needed == 2


def test_size_says_when_the_room_is_short() -> None:
    answer = size(capacity(), rps=40, replicas_now=2, fit_now=3)
    assert (answer.replicas_needed, answer.more_needed) == (10, 8)
    assert (answer.fit_now, answer.enough_room) == (3, False)
    assert size(capacity(), rps=1, replicas_now=2, fit_now=0).enough_room


def node(name: str, memory_gib: int) -> NodeView:
    return NodeView(node_id=NodeId(name), name=name, state=NodeState.READY,
                    memory_total_bytes=memory_gib * GIB)


def test_room_for_places_one_after_another_on_a_copy() -> None:
    nodes = [node("a", 10), node("b", 7)]
    request = PlacementRequest(model_id=ModelId("m"), memory_bytes=3 * GIB)
    # 3 on a (9 of 10 GiB), 2 on b (6 of 7).
    assert room_for(request, nodes, limit=100) == 5
    assert room_for(request, nodes, limit=2) == 2
    assert nodes[0].memory_claimed_bytes == 0  # a copy: the nodes given are untouched


def test_the_most_cautious_measurement_is_the_least_concurrency() -> None:
    chosen = most_cautious([capacity("big", concurrency=16), capacity("small", concurrency=4)])
    assert chosen is not None and chosen.profile == "small"
    assert most_cautious([]) is None


# -- profile order ------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    name: str
    priority: int


def test_rank_by_tokens_per_gpu_or_core() -> None:
    ranked = rank([capacity("cpu", per_unit=6.0, unit=Unit.CORE),
                   capacity("gpu-a", per_unit=900.0, unit=Unit.GPU),
                   capacity("none", tokens_per_s=5000.0),
                   capacity("gpu-b", per_unit=1200.0, unit=Unit.GPU)])
    assert [m.profile for m in ranked] == ["gpu-b", "gpu-a", "cpu", "none"]


def test_equal_priority_tries_the_most_measured_first_and_never_jumps_a_priority() -> None:
    profiles = [Profile("h100", 0), Profile("a100-2", 1), Profile("l40s", 1),
                Profile("unmeasured", 1), Profile("cpu", 2)]
    measured = {"h100": capacity("h100", per_unit=500.0, unit=Unit.GPU),
                "a100-2": capacity("a100-2", per_unit=700.0, unit=Unit.GPU),
                "l40s": capacity("l40s", per_unit=900.0, unit=Unit.GPU),
                "cpu": capacity("cpu", per_unit=9000.0, unit=Unit.CORE)}
    ordered = order_equal_priority(profiles, priority=lambda p: p.priority,
                                   profile=lambda p: p.name, measured=measured)
    # h100 keeps first place below l40s' figure: priorities never move. Within priority
    # 1, l40s (900 per GPU) before a100-2 (700); the unmeasured one last of its run.
    assert [p.name for p in ordered] == ["h100", "l40s", "a100-2", "unmeasured", "cpu"]
    # Nothing measured: the declared order, unchanged.
    assert order_equal_priority(profiles, priority=lambda p: p.priority,
                                profile=lambda p: p.name, measured={}) == profiles


def test_scores_by_profile_name_leave_out_those_with_no_unit() -> None:
    assert scores([capacity("gpu", per_unit=900.0, unit=Unit.GPU),
                   capacity("none", tokens_per_s=5000.0)]) == {"gpu": 900.0}
