"""What a node agent needs to run one shard of one replica. Pure data, shared by the
control plane (which builds it) and the agent (which runs it)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from .domain import Frozen
from .ids import ModelId, NodeId, ReplicaId


class EngineKind(StrEnum):
    """The inference engines modelkeeper can start."""

    LLAMACPP = "llamacpp"
    VLLM = "vllm"
    SGLANG = "sglang"
    SIM = "sim"


class ShardSpec(Frozen):
    """One shard (one rank) of a replica, as the agent on ``node_id`` must start it."""

    replica_id: ReplicaId
    model_id: ModelId
    node_id: NodeId
    engine: EngineKind
    #: A .gguf path, "smollm2" for the packaged SmolLM2, a Hugging Face repo id, or for
    #: the sim engine any label.
    source: str
    rank: int = Field(default=0, ge=0)
    world_size: int = Field(default=1, ge=1)
    #: Address of rank 0, for multi-node engines (host:port); None for one node.
    leader_address: str | None = None
    #: Memory this shard may use, from its allocation.
    memory_bytes: int = Field(ge=0)
    #: Total memory of the GPUs this shard holds, to derive vLLM's utilisation fraction.
    gpu_memory_bytes: int | None = Field(default=None, ge=0)
    gpu_indices: list[int] = Field(default_factory=list)
    cpu_cores: float | None = Field(default=None, gt=0)
    #: Allow-listed engine arguments (the catalog validates them).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    #: Seconds the start may take, load included, before the shard counts as failed.
    start_timeout_s: float = Field(default=600.0, gt=0)
