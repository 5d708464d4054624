"""Which ``engine_args`` each engine accepts, and the error for one it refuses.

The API validates a catalog entry against these lists before anything is stored, and the
agent's adapters check the same lists when they build a command line, so both live here
in the domain where the API and the agent can each reach them without importing the
other. Nothing that loads code (``trust_remote_code``) or changes where an engine
listens is on any list: those belong to the operator, not to a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .shards import EngineKind

#: Both multi-GPU engines take their layout the same way.
_PARALLELISM = frozenset({"tensor_parallel_size", "pipeline_parallel_size"})

#: Each engine's allow-list. The vLLM and SGLang adapters map every name here, other than
#: the parallelism pair, to a flag; a unit test keeps their flag tables and these in step.
ALLOWED_ENGINE_ARGS: dict[EngineKind, frozenset[str]] = {
    EngineKind.LLAMACPP: frozenset({"ctx_size", "parallel"}),
    EngineKind.VLLM: _PARALLELISM
    | {"max_model_len", "max_num_seqs", "dtype", "quantization", "enforce_eager"},
    EngineKind.SGLANG: _PARALLELISM
    | {"context_length", "max_running_requests", "dtype", "quantization",
       "disable_cuda_graph"},
    # ``memory_bytes``: resident memory to hold, instead of the shard's whole allocation;
    # a scale test gives fake nodes large capacities but cannot back them with real memory.
    EngineKind.SIM: frozenset(
        {"load_time_s", "tokens_per_second", "fail_at_start", "crash_after_s", "hang",
         "memory_bytes"}
    ),
}  # fmt: skip


class EngineConfigError(ValueError):
    """A shard cannot be launched as configured; names the offending field and value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={value!r}: {reason}")


def reject_unknown_args(kind: EngineKind, args: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Raise :class:`EngineConfigError` for the first argument of ``args`` not in ``allowed``."""
    for name in sorted(args):
        if name not in allowed:
            listed = ", ".join(sorted(allowed)) or "none"
            raise EngineConfigError(
                f"engine_args.{name}",
                args[name],
                f"not an allowed {kind.value} argument (allowed: {listed})",
            )


def check_engine_arg_names(kind: EngineKind, args: Mapping[str, Any]) -> None:
    """Raise :class:`EngineConfigError` for an argument ``kind`` refuses.

    Only names are checked here; each adapter checks values when it builds a plan.
    """
    reject_unknown_args(kind, args, ALLOWED_ENGINE_ARGS[kind])
