"""Which ``engine_args`` each engine accepts, for the catalog to validate up front.

Each engine module owns its allow-list (next to the code that turns the arguments into
flags); this module only gathers them. The engine modules build command lines only, so
importing them loads neither vLLM, SGLang nor xllamacpp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelkeeper.shards import EngineKind

from .base import reject_unknown_args
from .llamacpp import ALLOWED_ARGS as _LLAMACPP
from .sglang import ALLOWED_ARGS as _SGLANG
from .sim import ALLOWED_ARGS as _SIM
from .vllm import ALLOWED_ARGS as _VLLM

ALLOWED_ENGINE_ARGS: dict[EngineKind, frozenset[str]] = {
    EngineKind.LLAMACPP: _LLAMACPP,
    EngineKind.VLLM: _VLLM,
    EngineKind.SGLANG: _SGLANG,
    EngineKind.SIM: _SIM,
}


def check_engine_arg_names(kind: EngineKind, args: Mapping[str, Any]) -> None:
    """Raise :class:`~agent.engines.base.EngineConfigError` for an argument ``kind`` refuses.

    Only names are checked here; each adapter checks values when it builds a plan.
    """
    reject_unknown_args(kind, args, ALLOWED_ENGINE_ARGS[kind])
