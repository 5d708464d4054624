"""vLLM and SGLang launch plans: layouts, memory share, multi-node, keys and arguments."""

from __future__ import annotations

from typing import Any

import pytest

from agent.engines.base import EngineConfigError, LaunchPlan, sleep_dialect
from agent.engines.sglang import API_KEY_ENV, ENTRY_SCRIPT, SglangAdapter
from agent.engines.vllm import VllmAdapter
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec

pytestmark = pytest.mark.timeout(30)

KEY = "mk-secret-key-do-not-leak"
GIB = 2**30
PY = "/opt/engine/bin/python"

Adapter = VllmAdapter | SglangAdapter
#: Per engine: its adapter, and its flags for tensor parallel, pipeline parallel, memory
#: share and model source.
ENGINES: dict[EngineKind, tuple[Adapter, str, str, str, str]] = {
    EngineKind.VLLM: (
        VllmAdapter(python=PY),
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--gpu-memory-utilization",
        "--model",
    ),
    EngineKind.SGLANG: (
        SglangAdapter(python=PY),
        "--tp-size",
        "--pp-size",
        "--mem-fraction-static",
        "--model-path",
    ),
}
BOTH = pytest.mark.parametrize("kind", [EngineKind.VLLM, EngineKind.SGLANG])


def shard(kind: EngineKind, **overrides: Any) -> ShardSpec:
    fields: dict[str, Any] = {
        "replica_id": ReplicaId("rep-1"),
        "model_id": ModelId("qwen-7b"),
        "node_id": NodeId("gpu-a"),
        "engine": kind,
        "source": "Qwen/Qwen2.5-7B-Instruct",
        "memory_bytes": 40 * GIB,
        "gpu_memory_bytes": 80 * GIB,
        "gpu_indices": [0],
    }
    fields.update(overrides)
    return ShardSpec(**fields)


def plan_for(spec: ShardSpec) -> LaunchPlan:
    adapter = ENGINES[spec.engine][0]
    return adapter.launch_plan(spec, host="10.1.2.3", port=8200, api_key=KEY)


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def test_vllm_single_gpu_plan() -> None:
    plan = plan_for(shard(EngineKind.VLLM, gpu_indices=[3]))
    argv = plan.argv
    # vLLM's CLI: only `serve` honours --headless (agent/engines/vllm.py).
    assert argv[:4] == [PY, "-m", "vllm.entrypoints.cli.main", "serve"]
    assert flag(argv, "--model") == "Qwen/Qwen2.5-7B-Instruct"
    assert flag(argv, "--served-model-name") == "qwen-7b"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("10.1.2.3", "8200")
    assert flag(argv, "--gpu-memory-utilization") == "0.50"
    assert "--api-key" not in argv and "--nnodes" not in argv and "--headless" not in argv
    # Sleep mode on, and its endpoints served (vLLM keeps them among its dev endpoints).
    assert argv.count("--enable-sleep-mode") == 1
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "3", "HF_HUB_OFFLINE": "1",
                        "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": KEY}
    assert plan.notes == [] and plan.serves_http and plan.health_path == "/health"


def test_sglang_single_gpu_plan() -> None:
    plan = plan_for(shard(EngineKind.SGLANG, gpu_indices=[1]))
    argv = plan.argv
    assert argv[:2] == [PY, str(ENTRY_SCRIPT)]
    assert flag(argv, "--model-path") == "Qwen/Qwen2.5-7B-Instruct"
    assert flag(argv, "--served-model-name") == "qwen-7b"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("10.1.2.3", "8200")
    assert flag(argv, "--mem-fraction-static") == "0.50"
    # SGLang takes its key only as --api-key; our entry script takes it from the
    # environment instead, so the command line never holds it.
    assert "--api-key" not in argv and not any(KEY in arg for arg in argv)
    assert plan.notes == []
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "1", "HF_HUB_OFFLINE": "1", API_KEY_ENV: KEY}
    assert "--nnodes" not in argv and plan.serves_http
    # The memory saver, which release/resume_memory_occupation (its sleep) need.
    assert argv.count("--enable-memory-saver") == 1
    assert argv.count("--enable-metrics") == 1, "the gateway reads its queue gauge"


def test_sleep_dialects() -> None:
    """The calls the agent makes to sleep and wake each engine (no GPU here: checked
    against the names vLLM's and SGLang's servers route, as their sources had them)."""
    vllm = sleep_dialect(EngineKind.VLLM)
    assert vllm is not None
    assert (vllm.sleep_path, vllm.wake_path, vllm.body, vllm.state_path) == (
        "/sleep?level=1", "/wake_up", None, "/is_sleeping")
    sglang = sleep_dialect(EngineKind.SGLANG)
    assert sglang is not None
    assert (sglang.sleep_path, sglang.wake_path, sglang.state_path) == (
        "/release_memory_occupation", "/resume_memory_occupation", None)
    # The KV cache only: the weights stay loaded, as in vLLM's level 1.
    assert sglang.body == {"tags": ["kv_cache"]}
    assert sleep_dialect(EngineKind.LLAMACPP) is None


def test_vllm_key_never_in_argv_nor_repr() -> None:
    plan = plan_for(shard(EngineKind.VLLM, world_size=2, rank=1, leader_address="h:1"))
    assert not any(KEY in arg for arg in plan.argv)
    assert KEY not in repr(plan)


@BOTH
@pytest.mark.parametrize(
    ("gpus", "world_size", "engine_args", "tensor", "pipeline"),
    [
        ([0], 1, {}, 1, 1),
        ([0, 1, 2, 3], 1, {}, 4, 1),
        ([0, 1, 2, 3], 1, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 2, 2),
        ([0, 1, 2, 3], 1, {"pipeline_parallel_size": 4, "tensor_parallel_size": 1}, 1, 4),
        ([0, 1], 2, {}, 2, 2),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, {}, 8, 2),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, {"tensor_parallel_size": 16, "pipeline_parallel_size": 1},
         16, 1),
    ],
)  # fmt: skip
def test_parallel_layout(
    kind: EngineKind,
    gpus: list[int],
    world_size: int,
    engine_args: dict[str, int],
    tensor: int,
    pipeline: int,
) -> None:
    _, tp_flag, pp_flag, _, _ = ENGINES[kind]
    spec = shard(
        kind,
        gpu_indices=gpus,
        world_size=world_size,
        leader_address="10.0.0.1:5000" if world_size > 1 else None,
        engine_args=engine_args,
    )
    argv = plan_for(spec).argv
    assert (flag(argv, tp_flag), flag(argv, pp_flag)) == (str(tensor), str(pipeline))


@BOTH
@pytest.mark.parametrize(
    ("gpus", "world_size", "engine_args"),
    [
        ([0, 1, 2, 3], 1, {"tensor_parallel_size": 2}),
        ([0, 1], 1, {"tensor_parallel_size": 4}),
        ([0, 1], 2, {"pipeline_parallel_size": 1}),
        ([0], 1, {"tensor_parallel_size": 0}),
        ([0], 1, {"pipeline_parallel_size": "2"}),
    ],
)
def test_layouts_that_do_not_fit_the_gpus(
    kind: EngineKind, gpus: list[int], world_size: int, engine_args: dict[str, Any]
) -> None:
    spec = shard(
        kind,
        gpu_indices=gpus,
        world_size=world_size,
        leader_address="10.0.0.1:5000" if world_size > 1 else None,
        engine_args=engine_args,
    )
    with pytest.raises(EngineConfigError) as info:
        plan_for(spec)
    assert info.value.field.startswith("engine_args")


@BOTH
def test_no_gpus_is_refused(kind: EngineKind) -> None:
    with pytest.raises(EngineConfigError) as info:
        plan_for(shard(kind, gpu_indices=[]))
    assert info.value.field == "gpu_indices"


@BOTH
def test_gpu_indices_become_cuda_visible_devices(kind: EngineKind) -> None:
    plan = plan_for(shard(kind, gpu_indices=[2, 5, 7, 0]))
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,5,7,0"
    assert plan.env["HF_HUB_OFFLINE"] == "1"


@BOTH
@pytest.mark.parametrize(
    ("memory", "gpu_memory", "fraction"),
    [
        (40 * GIB, 80 * GIB, "0.50"),
        (80 * GIB, 80 * GIB, "0.95"),
        (200 * GIB, 80 * GIB, "0.95"),
        (1, 3, "0.33"),
        (2, 3, "0.66"),
        (9_199, 10_000, "0.91"),
        (45_999_999, 100_000_000, "0.45"),
        (1, 100, "0.01"),
        (7, 100, "0.07"),
    ],
)
def test_memory_fraction(kind: EngineKind, memory: int, gpu_memory: int, fraction: str) -> None:
    mem_flag = ENGINES[kind][3]
    spec = shard(kind, memory_bytes=memory, gpu_memory_bytes=gpu_memory)
    assert flag(plan_for(spec).argv, mem_flag) == fraction


@BOTH
@pytest.mark.parametrize(
    ("memory", "gpu_memory", "field"),
    [
        (40 * GIB, None, "gpu_memory_bytes"),
        (40 * GIB, 0, "gpu_memory_bytes"),
        (0, 80 * GIB, "memory_bytes"),
        (99, 10_000, "memory_bytes"),
    ],
)
def test_memory_fraction_errors(
    kind: EngineKind, memory: int, gpu_memory: int | None, field: str
) -> None:
    spec = shard(kind, memory_bytes=memory, gpu_memory_bytes=gpu_memory)
    with pytest.raises(EngineConfigError) as info:
        plan_for(spec)
    assert info.value.field == field


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_vllm_multi_node(rank: int) -> None:
    spec = shard(
        EngineKind.VLLM,
        gpu_indices=[0, 1],
        world_size=3,
        rank=rank,
        leader_address="10.0.0.1:29501",
    )
    plan = plan_for(spec)
    argv = plan.argv
    assert flag(argv, "--pipeline-parallel-size") == "3"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--distributed-executor-backend") == "mp"
    assert (flag(argv, "--nnodes"), flag(argv, "--node-rank")) == ("3", str(rank))
    assert (flag(argv, "--master-addr"), flag(argv, "--master-port")) == ("10.0.0.1", "29501")
    assert ("--headless" in argv) is (rank > 0)
    assert plan.serves_http is (rank == 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_multi_node(rank: int) -> None:
    spec = shard(
        EngineKind.SGLANG,
        gpu_indices=[0, 1, 2, 3],
        world_size=2,
        rank=rank,
        leader_address="gpu-a.internal:5000",
    )
    plan = plan_for(spec)
    argv = plan.argv
    assert (flag(argv, "--tp-size"), flag(argv, "--pp-size")) == ("4", "2")
    assert (flag(argv, "--nnodes"), flag(argv, "--node-rank")) == ("2", str(rank))
    assert flag(argv, "--dist-init-addr") == "gpu-a.internal:5000"
    assert plan.serves_http is (rank == 0)


def test_ipv6_leader_address() -> None:
    common: dict[str, Any] = {"world_size": 2, "rank": 1, "leader_address": "[fd00::1]:5000"}
    vllm_argv = plan_for(shard(EngineKind.VLLM, **common)).argv
    assert (flag(vllm_argv, "--master-addr"), flag(vllm_argv, "--master-port")) == (
        "fd00::1",
        "5000",
    )
    sglang_argv = plan_for(shard(EngineKind.SGLANG, **common)).argv
    assert flag(sglang_argv, "--dist-init-addr") == "[fd00::1]:5000"


@BOTH
@pytest.mark.parametrize("address", [None, "", "10.0.0.1", "10.0.0.1:", ":5000", "h:99999", "h:x"])
def test_bad_leader_address(kind: EngineKind, address: str | None) -> None:
    spec = shard(kind, world_size=2, leader_address=address)
    with pytest.raises(EngineConfigError) as info:
        plan_for(spec)
    assert (info.value.field, info.value.value) == ("leader_address", address)


@pytest.mark.parametrize(
    ("kind", "engine_args", "expected"),
    [
        (EngineKind.VLLM, {"max_model_len": 8192}, ["--max-model-len", "8192"]),
        (EngineKind.VLLM, {"max_num_seqs": 64}, ["--max-num-seqs", "64"]),
        (EngineKind.VLLM, {"dtype": "bfloat16"}, ["--dtype", "bfloat16"]),
        (EngineKind.VLLM, {"quantization": "awq_marlin"}, ["--quantization", "awq_marlin"]),
        (EngineKind.VLLM, {"enforce_eager": True}, ["--enforce-eager"]),
        (EngineKind.VLLM, {"enforce_eager": False}, []),
        (EngineKind.SGLANG, {"context_length": 4096}, ["--context-length", "4096"]),
        (EngineKind.SGLANG, {"max_running_requests": 32}, ["--max-running-requests", "32"]),
        (EngineKind.SGLANG, {"dtype": "half"}, ["--dtype", "half"]),
        (EngineKind.SGLANG, {"quantization": "fp8"}, ["--quantization", "fp8"]),
        (EngineKind.SGLANG, {"disable_cuda_graph": True}, ["--disable-cuda-graph"]),
    ],
)
def test_optional_engine_args(
    kind: EngineKind, engine_args: dict[str, Any], expected: list[str]
) -> None:
    argv = plan_for(shard(kind, engine_args=engine_args)).argv
    baseline = plan_for(shard(kind)).argv
    assert argv[len(baseline) :] == expected
    assert argv[: len(baseline)] == baseline


@BOTH
@pytest.mark.parametrize(
    ("engine_args", "field"),
    [
        ({"trust_remote_code": True}, "engine_args.trust_remote_code"),
        ({"host": "0.0.0.0"}, "engine_args.host"),
        ({"dtype": "--trust-remote-code"}, "engine_args.dtype"),
        ({"dtype": "bf16 --x"}, "engine_args.dtype"),
        ({"dtype": 16}, "engine_args.dtype"),
        ({"quantization": ""}, "engine_args.quantization"),
    ],
)
def test_rejected_engine_args(kind: EngineKind, engine_args: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineConfigError) as info:
        plan_for(shard(kind, engine_args=engine_args))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("kind", "engine_args", "field"),
    [
        (EngineKind.VLLM, {"enforce_eager": "yes"}, "engine_args.enforce_eager"),
        (EngineKind.VLLM, {"max_model_len": 0}, "engine_args.max_model_len"),
        (EngineKind.VLLM, {"context_length": 4096}, "engine_args.context_length"),
        (EngineKind.SGLANG, {"max_model_len": 4096}, "engine_args.max_model_len"),
        (EngineKind.SGLANG, {"disable_cuda_graph": 1}, "engine_args.disable_cuda_graph"),
    ],
)
def test_engine_specific_arg_errors(
    kind: EngineKind, engine_args: dict[str, Any], field: str
) -> None:
    with pytest.raises(EngineConfigError) as info:
        plan_for(shard(kind, engine_args=engine_args))
    assert info.value.field == field


@BOTH
def test_unknown_arg_error_lists_the_allowed_ones(kind: EngineKind) -> None:
    with pytest.raises(EngineConfigError, match=r"allowed: .*pipeline_parallel_size"):
        plan_for(shard(kind, engine_args={"seed": 1}))
