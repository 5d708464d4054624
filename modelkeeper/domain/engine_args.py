"""Which ``engine_args`` each engine accepts, the values each may take, and the error for
one it refuses.

The API validates a catalog entry against these lists before anything is stored, and the
agent's adapters check the same lists when they build a command line, so both live here
in the domain where the API and the agent can each reach them without importing the
other. Nothing that loads code (``trust_remote_code``) or changes where an engine
listens is on any list: those belong to the operator, not to a model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .catalog import MAX_MEMORY_BYTES
from .shards import EngineKind


@dataclass(frozen=True, slots=True)
class IntArg:
    """An integer from ``low`` to ``high`` (a bool is not one: ``parallel: true`` is a
    mistake, not 1)."""

    low: int
    high: int


@dataclass(frozen=True, slots=True)
class NumberArg:
    """A finite number from ``low`` to ``high``."""

    low: float
    high: float


@dataclass(frozen=True, slots=True)
class FlagArg:
    """true or false."""


@dataclass(frozen=True, slots=True)
class WordArg:
    """A short word (a dtype, a quantization method): it becomes its own argv element, and
    may not start with '-', where it would read as a flag."""


@dataclass(frozen=True, slots=True)
class ChoiceArg:
    """One of ``values``."""

    values: tuple[str, ...]


ArgRule = IntArg | NumberArg | FlagArg | WordArg | ChoiceArg

#: The longest context any model is trained for is 10M tokens (Llama 4 Scout); 16M leaves
#: room for the next without letting ctx_size=10**15 through to an engine that would try
#: to size a KV cache for it.
MAX_CONTEXT_TOKENS = 1 << 24
#: Sequences one engine runs at once: vLLM's and SGLang's defaults are in the hundreds.
MAX_SEQUENCES = 1 << 14
#: llama.cpp's slots each get ctx_size / parallel tokens; beyond 256 none has room.
MAX_LLAMACPP_SLOTS = 256
#: Tensor or pipeline ranks: the GPUs of one replica (catalog.MAX_GPUS).
MAX_PARALLEL = 1024
#: The sim's timings and rate: a day, far above any test's, and a rate no engine reaches.
MAX_SIM_SECONDS = 86_400.0
MAX_SIM_TOKENS_PER_SECOND = 1e6
#: A word argument's longest value (vLLM's longest dtype or quantization name is ~20).
MAX_WORD_CHARS = 64
_WORD = re.compile(rf"^[A-Za-z0-9_.][A-Za-z0-9_.-]{{0,{MAX_WORD_CHARS - 1}}}$")

_RANKS = IntArg(1, MAX_PARALLEL)
_CONTEXT = IntArg(1, MAX_CONTEXT_TOKENS)
_SEQUENCES = IntArg(1, MAX_SEQUENCES)
#: Both multi-GPU engines take their layout the same way.
_PARALLELISM: dict[str, ArgRule] = {"tensor_parallel_size": _RANKS,
                                    "pipeline_parallel_size": _RANKS}

#: Each engine's arguments and the values each may take. The vLLM and SGLang adapters map
#: every name here, other than the parallelism pair, to a flag; a unit test keeps their
#: flag tables and these in step.
ENGINE_ARG_RULES: dict[EngineKind, dict[str, ArgRule]] = {
    EngineKind.LLAMACPP: {"ctx_size": _CONTEXT, "parallel": IntArg(1, MAX_LLAMACPP_SLOTS)},
    EngineKind.VLLM: {**_PARALLELISM, "max_model_len": _CONTEXT, "max_num_seqs": _SEQUENCES,
                      "dtype": WordArg(), "quantization": WordArg(), "enforce_eager": FlagArg()},
    EngineKind.SGLANG: {**_PARALLELISM, "context_length": _CONTEXT,
                        "max_running_requests": _SEQUENCES, "dtype": WordArg(),
                        "quantization": WordArg(), "disable_cuda_graph": FlagArg()},
    # ``memory_bytes``: resident memory to hold, instead of the shard's whole allocation;
    # a scale test gives fake nodes large capacities but cannot back them with real memory.
    # Never more than the model claims (checked against the claim where it is known).
    # ``weights_bytes``: what it keeps of that while asleep (the rest, its "KV cache", is
    # freed); absent: all of it. ``wake_time_s``: how long a wake takes.
    # ``max_num_seqs``: requests it runs at once, as vLLM's; the rest wait in its queue.
    # ``dialect``: the engine whose HTTP dialect it speaks, as that engine's source has it
    # (agent/engines/sim_server.py); absent: the sim's own, vLLM's paths.
    EngineKind.SIM: {"load_time_s": NumberArg(0.0, MAX_SIM_SECONDS),
                     "tokens_per_second": NumberArg(0.0, MAX_SIM_TOKENS_PER_SECOND),
                     "fail_at_start": FlagArg(),
                     "crash_after_s": NumberArg(0.0, MAX_SIM_SECONDS),
                     "hang": FlagArg(), "memory_bytes": IntArg(0, MAX_MEMORY_BYTES),
                     "weights_bytes": IntArg(0, MAX_MEMORY_BYTES),
                     "wake_time_s": NumberArg(0.0, MAX_SIM_SECONDS),
                     "max_num_seqs": _SEQUENCES,
                     "dialect": ChoiceArg(("vllm", "sglang"))},
}

#: Each engine's allow-list (the names of :data:`ENGINE_ARG_RULES`).
ALLOWED_ENGINE_ARGS: dict[EngineKind, frozenset[str]] = {
    kind: frozenset(rules) for kind, rules in ENGINE_ARG_RULES.items()
}


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


def check_engine_arg_names(kind: EngineKind, args: Mapping[str, Any], *,
                           claim_bytes: int | None = None) -> None:
    """Raise :class:`EngineConfigError` for an argument ``kind`` refuses: an unknown name,
    or a value outside its rule (:data:`ENGINE_ARG_RULES`). ``claim_bytes``: the memory the
    model claims, which the sim's ``memory_bytes`` may not exceed; None where unknown.

    Each adapter still checks what it needs when it builds a plan (an agent may run a
    catalog entry written before these bounds).
    """
    rules = ENGINE_ARG_RULES[kind]
    reject_unknown_args(kind, args, frozenset(rules))
    for name in sorted(args):
        _check_value(f"engine_args.{name}", args[name], rules[name])
    if kind is not EngineKind.SIM or claim_bytes is None:
        return
    for name in ("memory_bytes", "weights_bytes"):
        held = args.get(name)
        if isinstance(held, int) and held > claim_bytes:
            raise EngineConfigError(f"engine_args.{name}", held,
                                    f"more than the {claim_bytes} bytes the model claims "
                                    "(memory_bytes): the sim would hold memory placement "
                                    "does not count")


def _check_value(field: str, value: Any, rule: ArgRule) -> None:
    """Raise :class:`EngineConfigError` unless ``value`` keeps ``rule``."""
    match rule:
        case IntArg(low=low, high=high):
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not low <= value <= high:
                raise EngineConfigError(field, value, f"must be an integer from {low} to {high}")
        case NumberArg(low=low, high=high):
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or not low <= value <= high:
                raise EngineConfigError(field, value, f"must be a number from {low:g} to {high:g}")
        case FlagArg():
            if not isinstance(value, bool):
                raise EngineConfigError(field, value, "must be true or false")
        case ChoiceArg(values=values):
            if not isinstance(value, str) or value not in values:
                raise EngineConfigError(field, value, f"must be one of {', '.join(values)}")
        case WordArg():
            if not isinstance(value, str) or _WORD.match(value) is None:
                raise EngineConfigError(
                    field, value, f"must be a word of at most {MAX_WORD_CHARS} letters, "
                    "digits, '.', '_' or '-', not starting with '-'")
