"""Engine versions per node (issue 23): the requirement's rules (modelkeeper.domain.versions),
placement rule 11 and its reasons, a profile's own requirement, the catalog's refusal of
a bad one, and what an agent finds it can run (agent.inventory)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.inventory import llama_server_build, read_engine_versions
from modelkeeper import __version__
from modelkeeper.domain.catalog import CatalogModel, HardwareProfile
from modelkeeper.domain.ids import ModelId, NodeId
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.placement import (
    CantPlace,
    NodeView,
    PlacementRequest,
    RejectionReason,
    explain,
    place,
)
from modelkeeper.domain.profiles import place_profiles, profile_candidates
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.units import GIB
from modelkeeper.domain.versions import normalise_requirement, parse_requirement, satisfies


@pytest.mark.parametrize("version, requirement, ok", [
    ("0.6.3", ">=0.6.0", True),
    ("0.5.4", ">=0.6.0", False),
    ("0.6.3", "0.6.3", True),           # a bare version means exactly it
    ("0.6.4", "0.6.3", False),
    ("0.7.1", ">=0.6,<0.8", True),
    ("0.8.0", ">=0.6,<0.8", False),
    ("0.6.5", "~=0.6.3", True),
    ("0.7.0rc1", ">=0.6", True),        # a node running a pre-release counts
    ("b4567", "===b4567", True),        # a native llama-server build: exact only
    ("b4567", ">=1", False),
    ("2026.10.11549", ">=2026.10", True),
])
def test_a_reported_version_meets_a_requirement_as_pip_reads_it(
        version: str, requirement: str, ok: bool) -> None:
    assert satisfies(version, requirement) is ok


def test_requirements_are_stored_normalised() -> None:
    assert normalise_requirement("0.6.3") == "==0.6.3"
    assert normalise_requirement(" >=0.6 , <0.8 ") == "<0.8,>=0.6"


@pytest.mark.parametrize("text, says", [
    ("", "must not be empty"),
    ("newest", "is not a version requirement"),
    ("=>0.6", "is not a version requirement"),
    (">=" + "1." * 40 + "0", "characters long, at most 64"),
])
def test_a_bad_requirement_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_requirement(text)


def test_the_catalog_refuses_a_bad_requirement_naming_the_field() -> None:
    with pytest.raises(ValidationError) as refused:
        CatalogModel(model_id=ModelId("m"), engine=EngineKind.VLLM, source="org/m",
                     memory_bytes=GIB, engine_version="latest")
    [error] = refused.value.errors()
    assert error["loc"] == ("engine_version",)
    assert "'latest' is not a version requirement" in error["msg"]
    with pytest.raises(ValidationError) as refused:
        HardwareProfile(name="gpu", engine=EngineKind.VLLM, engine_version=">>1")
    assert refused.value.errors()[0]["loc"] == ("engine_version",)


def _node(node_id: str, engines: dict[str, str] | None, *, free: int = 8 * GIB) -> NodeView:
    return NodeView(node_id=NodeId(node_id), name=node_id, state=NodeState.READY,
                    memory_total_bytes=free, engines=engines)


def _request(engine: EngineKind, version: str | None = None) -> PlacementRequest:
    return PlacementRequest(model_id=ModelId("m"), memory_bytes=GIB, engine=engine,
                            engine_version=version)


def test_rule_11_passes_over_a_node_that_cannot_run_the_engine_and_says_why() -> None:
    nodes = [_node("a", {"sim": "0.2.0", "llamacpp": "2026.10.11549"}),
             _node("b", {"vllm": "0.5.4", "sim": "0.2.0"}),
             _node("c", {"vllm": "0.6.3"}),
             # An agent older than the report: taken as able, as unknown memory is.
             _node("d", None, free=4 * GIB)]
    decisions = {d.node_id: d for d in explain(_request(EngineKind.VLLM, ">=0.6.0"), nodes)}
    assert decisions[NodeId("a")].rejection is not None
    assert decisions[NodeId("a")].rejection.reason_code is RejectionReason.NO_ENGINE
    assert decisions[NodeId("a")].rejection.message == (
        "cannot run vllm (its agent found: llamacpp 2026.10.11549, sim 0.2.0)")
    assert decisions[NodeId("b")].rejection is not None
    assert decisions[NodeId("b")].rejection.reason_code is RejectionReason.ENGINE_VERSION
    assert decisions[NodeId("b")].rejection.message == "vllm 0.5.4, needs >=0.6.0"
    assert decisions[NodeId("c")].rejection is None
    assert decisions[NodeId("d")].rejection is None
    # Without a version requirement, any version of the engine will do.
    assert place(_request(EngineKind.VLLM), nodes[:2]).node_ids == [NodeId("b")]


def test_rule_11_is_the_last_reason_a_node_gives() -> None:
    full = _node("a", {"sim": "0.2.0"}, free=GIB // 2)
    refused = place(_request(EngineKind.VLLM, ">=0.6"), [full])
    assert isinstance(refused, CantPlace)
    assert refused.rejections[0].reason_code is RejectionReason.INSUFFICIENT_MEMORY


def test_a_profile_requires_its_own_version_and_the_next_one_is_tried() -> None:
    model = CatalogModel(
        model_id=ModelId("m"), engine=EngineKind.VLLM, source="org/m", memory_bytes=GIB,
        engine_version=">=9", profiles=[
            HardwareProfile(name="new-vllm", engine=EngineKind.VLLM, gpus=0,
                            engine_version=">=0.7", priority=1),
            HardwareProfile(name="any-vllm", engine=EngineKind.VLLM, gpus=0)])
    nodes = [_node("b", {"vllm": "0.6.3"})]
    chosen = place_profiles(profile_candidates(model, _request(EngineKind.VLLM)), nodes)
    assert not isinstance(chosen, CantPlace)
    # The model's ">=9" is not the profile's: a profile stands alone.
    assert chosen.candidate.name == "any-vllm"
    assert chosen.note == ("runs profile any-vllm, passed over profile new-vllm: node b: "
                           "vllm 0.6.3, needs >=0.7")


def test_an_agent_reports_the_sim_and_the_engine_packages_installed_beside_it() -> None:
    found = read_engine_versions()
    assert found[EngineKind.SIM] == __version__
    # xllamacpp is a dependency of the agent; vLLM and SGLang are not installed here.
    assert EngineKind.LLAMACPP in found
    assert EngineKind.VLLM not in found and EngineKind.SGLANG not in found


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_native_llama_server_reports_its_build_in_place_of_the_wheel(
        tmp_path: Path) -> None:
    server = _script(tmp_path / "llama-server",
                     'echo "version: 4567 (abcdef0)" >&2; echo "built with cc" >&2')
    assert llama_server_build(server) == "b4567"
    assert read_engine_versions(server)[EngineKind.LLAMACPP] == "b4567"
    # One that says no version (or does not run) is not reported: the node cannot run it.
    silent = _script(tmp_path / "broken", "exit 1")
    assert EngineKind.LLAMACPP not in read_engine_versions(silent)
    assert EngineKind.LLAMACPP not in read_engine_versions(tmp_path / "missing")
