"""Hardware profiles (modelkeeper.domain.profiles): the order they are tried in, the first
that fits wins, and every one passed over or refused is named with its reason; and the
catalog's checks on a declared profile."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from modelkeeper.domain.catalog import MAX_PROFILES, CatalogModel, HardwareProfile, ModelSpec
from modelkeeper.domain.ids import ModelId, NodeId
from modelkeeper.domain.placement import (
    SUMMARY_LIMIT_BYTES,
    CantPlace,
    NodeState,
    NodeView,
    PlacementRequest,
    place,
)
from modelkeeper.domain.profiles import (
    ProfilePlacement,
    order_profiles,
    place_profiles,
    profile_candidates,
    profile_model,
)
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.units import GIB

pytestmark = pytest.mark.timeout(60)

MODEL = ModelId("m")


def node(name: str, *, mem_gib: float = 8, claimed_gib: float = 0, gpus: int = 0,
         cpus: int | None = None) -> NodeView:
    return NodeView.model_validate({
        "node_id": NodeId(name), "name": name, "state": NodeState.READY,
        "memory_total_bytes": int(mem_gib * GIB), "memory_claimed_bytes": int(claimed_gib * GIB),
        "cpu_count": cpus,
        "gpus": [{"index": i, "memory_bytes": 80 * GIB} for i in range(gpus)]})


def profile(name: str, *, engine: EngineKind = EngineKind.SIM, mem_gib: float | None = None,
            gpus: int | None = None, cpu: float | None = None, priority: int = 0,
            args: dict[str, Any] | None = None) -> HardwareProfile:
    return HardwareProfile(name=name, engine=engine, gpus=gpus, cpu_cores=cpu,
                           priority=priority, engine_args=args or {},
                           memory_bytes=None if mem_gib is None else int(mem_gib * GIB))


def model(*profiles: HardwareProfile, mem_gib: float = 4,
          args: dict[str, Any] | None = None) -> CatalogModel:
    return CatalogModel(model_id=MODEL, engine=EngineKind.SIM, source="sim",
                        memory_bytes=int(mem_gib * GIB), engine_args=args or {},
                        profiles=list(profiles))


def base(m: CatalogModel) -> PlacementRequest:
    """What the model's own fields ask, as the activity builds it."""
    return PlacementRequest(model_id=m.model_id, memory_bytes=m.memory_bytes,
                            cpu_cores=m.cpu_cores, gpus=m.gpus)


def names(profiles: list[HardwareProfile]) -> list[str]:
    return [p.name for p in profiles]


# -- rule 1: order ---------------------------------------------------------------------

def test_higher_priority_first_and_ties_keep_declared_order() -> None:
    declared = [profile("a"), profile("b", priority=5), profile("c"), profile("d", priority=5)]
    assert names(order_profiles(declared, {})) == ["b", "d", "a", "c"]


def test_measured_orders_equal_priorities_most_first_and_unmeasured_last() -> None:
    # The hook for measured capacity: within one priority, the most tokens per GPU or
    # core first; a profile never measured after the measured ones; priority still rules.
    declared = [profile("a"), profile("b"), profile("c"), profile("top", priority=1)]
    assert names(order_profiles(declared, {"b": 10.0, "c": 30.0})) == ["top", "c", "b", "a"]


# -- rule 2: no profiles is exactly place() --------------------------------------------

def test_a_model_without_profiles_places_as_place_does() -> None:
    m = model(mem_gib=6)
    nodes = [node("a", mem_gib=4), node("b", mem_gib=5)]
    [candidate] = profile_candidates(m, base(m))
    assert candidate.profile is None and candidate.model is m
    assert place_profiles([candidate], nodes) == place(base(m), nodes)
    fits = place_profiles([candidate], [node("c", mem_gib=8)])
    assert isinstance(fits, ProfilePlacement)
    assert fits.candidate.name is None and fits.note is None


# -- rules 3-5: the first that fits, and what it runs ----------------------------------

def test_first_profile_that_fits_wins_and_runs_its_own_fields() -> None:
    m = model(profile("gpu", gpus=1, args={"tokens_per_second": 500.0}),
              profile("cpu", mem_gib=6, cpu=2.0, args={"load_time_s": 1.0}),
              mem_gib=4, args={"hang": True})
    result = place_profiles(profile_candidates(m, base(m)), [node("a", cpus=8)])
    assert isinstance(result, ProfilePlacement)
    chosen = result.candidate
    assert chosen.name == "cpu"
    # Its own memory, cores, GPUs and engine arguments: never the model's.
    assert chosen.request.memory_bytes == 6 * GIB
    assert chosen.request.cpu_cores == 2.0 and not chosen.request.gpus
    assert chosen.model.engine_args == {"load_time_s": 1.0}
    assert result.placement.assignments[0].memory_bytes == 6 * GIB
    assert result.placement.assignments[0].cpu_cores == 2.0
    assert result.note == ("runs profile cpu, passed over profile gpu: node a: "
                           "0 of 0 GPUs free, needs 1")


def test_a_fitting_first_profile_is_taken_over_a_later_one() -> None:
    m = model(profile("gpu", gpus=1), profile("cpu"))
    result = place_profiles(profile_candidates(m, base(m)), [node("a", gpus=2)])
    assert isinstance(result, ProfilePlacement)
    assert result.candidate.name == "gpu" and result.note is None
    assert result.placement.assignments[0].gpu_indices == [0]


def test_a_profile_without_memory_claims_the_models() -> None:
    m = model(profile("small"), mem_gib=3)
    [candidate] = profile_candidates(m, base(m))
    assert candidate.request.memory_bytes == 3 * GIB
    assert candidate.model.memory_bytes == 3 * GIB


def test_where_it_may_go_does_not_change_with_the_profile() -> None:
    m = model(profile("cpu", mem_gib=1, cpu=1.0))
    request = base(m).model_copy(update={"labels": {"zone": "a"}, "min_nodes": 2,
                                         "avoid_node_ids": [NodeId("x")]})
    [candidate] = profile_candidates(m, request)
    assert candidate.request.labels == {"zone": "a"}
    assert candidate.request.min_nodes == 2
    assert candidate.request.avoid_node_ids == ["x"]


def test_generation_arguments_lie_over_the_profiles() -> None:
    m = model(profile("cpu", args={"load_time_s": 1.0, "hang": False}))
    [candidate] = profile_candidates(m, base(m), overrides={"hang": True})
    assert candidate.model.engine_args == {"load_time_s": 1.0, "hang": True}
    assert profile_model(m, m.profiles[0], overrides={"hang": True}).engine_args == \
        candidate.model.engine_args
    assert profile_model(m, None) is m


def test_a_profile_whose_engine_refuses_the_arguments_is_not_tried() -> None:
    # A generation's vLLM argument cannot go to a llama.cpp profile: it is passed over,
    # with the argument named, and the next profile is placed.
    m = model(profile("cpp", engine=EngineKind.LLAMACPP), profile("sim"))
    result = place_profiles(profile_candidates(m, base(m), overrides={"load_time_s": 2.0}),
                            [node("a")])
    assert isinstance(result, ProfilePlacement)
    assert result.candidate.name == "sim"
    assert result.passed_over == (
        "profile cpp: llamacpp refuses its engine arguments (engine_args.load_time_s=2.0: "
        "not an allowed llamacpp argument (allowed: ctx_size, parallel))",)


# -- rule 6: none fits, every one named -------------------------------------------------

def test_cant_place_names_every_profile_and_why() -> None:
    m = model(profile("vllm-1gpu", mem_gib=1, gpus=1), profile("cpu", mem_gib=4))
    nodes = [node("a", mem_gib=8, claimed_gib=4.9)]
    result = place_profiles(profile_candidates(m, base(m)), nodes)
    assert isinstance(result, CantPlace)
    assert result.summary == ("profile vllm-1gpu: node a: 0 of 0 GPUs free, needs 1; "
                              "profile cpu: node a: 3.1 GiB free, needs 4.0 GiB")
    # Per node, the first profile's rejections: the one the model wants most.
    assert [r.message for r in result.rejections] == ["0 of 0 GPUs free, needs 1"]


def test_cant_place_when_every_profile_is_refused() -> None:
    m = model(profile("cpp", engine=EngineKind.LLAMACPP))
    result = place_profiles(profile_candidates(m, base(m), overrides={"hang": True}),
                            [node("a")])
    assert isinstance(result, CantPlace)
    assert result.rejections == [] and result.needed_nodes == 1
    assert result.summary.startswith("profile cpp: llamacpp refuses its engine arguments")


def test_a_long_reason_is_cut_so_every_profile_is_still_named() -> None:
    # 300 nodes short of memory for each of 8 profiles: each profile's reason alone is
    # near the bound; together they are cut to a share each, and the last is named.
    nodes = [node(f"n{i:03}", mem_gib=1) for i in range(300)]
    m = model(*[profile(f"p{i}", mem_gib=2 + i) for i in range(MAX_PROFILES)])
    result = place_profiles(profile_candidates(m, base(m)), nodes)
    assert isinstance(result, CantPlace)
    assert len(result.summary.encode()) <= SUMMARY_LIMIT_BYTES
    for i in range(MAX_PROFILES):
        assert f"profile p{i}: node n000: 1.0 GiB free, needs {2 + i}.0 GiB" in result.summary


def test_no_candidates_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        place_profiles([], [node("a")])


# -- the catalog's checks ---------------------------------------------------------------

def spec(**fields: Any) -> ModelSpec:
    return ModelSpec.model_validate({"model_id": "m", "engine": "sim", "source": "sim",
                                     "memory_bytes": 4 * GIB, **fields})


def test_profiles_are_bounded_in_number() -> None:
    spec(profiles=[{"name": f"p{i}", "engine": "sim"} for i in range(MAX_PROFILES)])
    with pytest.raises(ValidationError, match=f"at most {MAX_PROFILES} items"):
        spec(profiles=[{"name": f"p{i}", "engine": "sim"} for i in range(MAX_PROFILES + 1)])


def test_a_profile_name_is_given_once() -> None:
    with pytest.raises(ValidationError, match=r"profiles\[1\].name = 'cpu' is given twice"):
        spec(profiles=[{"name": "cpu", "engine": "sim"}, {"name": "cpu", "engine": "sim"}])


def test_weights_within_each_profiles_memory() -> None:
    with pytest.raises(ValidationError, match=r"weights_bytes = 3221225472 is above "
                                              r"profiles\[0\].memory_bytes = 2147483648"):
        spec(weights_bytes=3 * GIB, profiles=[{"name": "small", "engine": "sim",
                                               "memory_bytes": 2 * GIB}])


@pytest.mark.parametrize(("field", "value"), [
    ("name", "-bad"), ("name", ""), ("engine", "tpu"), ("memory_bytes", 0),
    ("gpus", -1), ("cpu_cores", 0), ("priority", 1001), ("unknown", 1)])
def test_a_bad_profile_field_is_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as err:
        spec(profiles=[{"name": "p", "engine": "sim", field: value}])
    assert any(e["loc"][:3] == ("profiles", 0, field) for e in err.value.errors())
