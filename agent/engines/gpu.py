"""What the GPU engines (vLLM, SGLang) share: parallel layout, memory share, flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from modelkeeper.domain.shards import ShardSpec, split_address

from .base import EngineConfigError, bool_arg, int_arg, token_arg

#: The most of a GPU's memory an engine is told it may take. Above this, CUDA context
#: and allocator overhead outside the engine's accounting can run the GPU out of memory.
MAX_MEMORY_FRACTION_HUNDREDTHS = 95

#: Hugging Face weights must already be on the node: an engine that downloads at start
#: turns a restart into a multi-gigabyte fetch, or hangs on a node without internet.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}

ArgKind = Literal["int", "token", "bool"]


@dataclass(frozen=True)
class Parallelism:
    """How a replica's GPUs are split: tensor parallel within, pipeline across."""

    tensor: int
    pipeline: int


def require_gpus(spec: ShardSpec) -> None:
    """Raise unless the shard holds at least one GPU."""
    if not spec.gpu_indices:
        raise EngineConfigError(
            "gpu_indices", spec.gpu_indices, f"{spec.engine.value} needs at least one GPU"
        )


def parallelism(spec: ShardSpec) -> Parallelism:
    """Tensor and pipeline parallel sizes for ``spec``.

    Defaults: tensor parallel over this node's GPUs, pipeline parallel over the nodes
    (one stage per node), because tensor parallelism syncs on every layer and wants the
    fast links inside a node, while pipeline stages exchange little across nodes. Either
    may be overridden, but their product must use exactly the replica's GPUs (assumed
    the same count on every node): fewer would leave allocated GPUs idle, more do not
    exist.
    """
    require_gpus(spec)
    per_node = len(spec.gpu_indices)
    tensor = int_arg(spec.engine_args, "tensor_parallel_size", per_node)
    pipeline = int_arg(spec.engine_args, "pipeline_parallel_size", spec.world_size)
    total = per_node * spec.world_size
    if tensor * pipeline != total:
        raise EngineConfigError(
            "engine_args",
            {"tensor_parallel_size": tensor, "pipeline_parallel_size": pipeline},
            f"tensor x pipeline = {tensor * pipeline}, but the replica holds {total} GPUs "
            f"({spec.world_size} node(s) x {per_node})",
        )
    return Parallelism(tensor=tensor, pipeline=pipeline)


def memory_fraction(spec: ShardSpec) -> str:
    """The share of its GPUs' memory the shard may use, as a flag value ("0.45").

    Rounded down to hundredths so the engine never takes more than its allocation, and
    capped at 0.95. Computed in integers: float division could round 0.45 up to 0.46.
    """
    if spec.gpu_memory_bytes is None:
        raise EngineConfigError(
            "gpu_memory_bytes", None, "needed to turn memory_bytes into a GPU memory fraction"
        )
    if spec.gpu_memory_bytes <= 0:
        raise EngineConfigError("gpu_memory_bytes", spec.gpu_memory_bytes, "must be positive")
    hundredths = min(
        spec.memory_bytes * 100 // spec.gpu_memory_bytes, MAX_MEMORY_FRACTION_HUNDREDTHS
    )
    if hundredths <= 0:
        raise EngineConfigError(
            "memory_bytes",
            spec.memory_bytes,
            f"less than 1% of gpu_memory_bytes={spec.gpu_memory_bytes}",
        )
    return f"0.{hundredths:02d}"


def cuda_env(spec: ShardSpec) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the shard's GPUs, plus the offline switch."""
    require_gpus(spec)
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices), **OFFLINE_ENV}


def leader_host_port(spec: ShardSpec) -> tuple[str, int]:
    """Host and port of rank 0 from ``leader_address`` ("host:port" or "[v6]:port")."""
    address = spec.leader_address
    if not address:
        raise EngineConfigError(
            "leader_address", address, f"needed when world_size={spec.world_size}"
        )
    parts = split_address(address)
    if parts is None:
        raise EngineConfigError("leader_address", address, "must be host:port")
    return parts


def optional_flags(args: Mapping[str, Any], table: Mapping[str, tuple[str, ArgKind]]) -> list[str]:
    """Flags for the optional engine arguments present in ``args``, in ``table`` order."""
    flags: list[str] = []
    for name, (flag, kind) in table.items():
        if name not in args:
            continue
        if kind == "int":
            flags += [flag, str(int_arg(args, name, 1))]
        elif kind == "token":
            flags += [flag, str(token_arg(args, name))]
        elif bool_arg(args, name):
            flags.append(flag)
    return flags
