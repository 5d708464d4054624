"""The interface every engine adapter implements, and what they share.

An adapter turns a :class:`~modelkeeper.domain.shards.ShardSpec` into a :class:`LaunchPlan` (the
command line and environment of one engine process) and says when that process is
ready to serve. It starts nothing itself: the agent runs the plan under
:class:`~modelkeeper.infra.processes.ManagedProcess`, so every engine is stopped the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from pydantic import Field

from modelkeeper.domain.base import Frozen

# Re-exported: every adapter in this package takes them from here.
from modelkeeper.domain.engine_args import EngineConfigError as EngineConfigError
from modelkeeper.domain.engine_args import reject_unknown_args as reject_unknown_args
from modelkeeper.domain.shards import EngineKind, ShardSpec

#: Seconds one readiness probe may take. A loaded engine answers a one-token completion
#: in well under this; a longer wait means "not ready yet", and the caller polls again.
PROBE_TIMEOUT_S = 10.0

#: How much of an engine's error body goes into a ReadyCheck detail: enough to diagnose,
#: short enough for an event log.
_DETAIL_CHARS = 200


class LaunchPlan(Frozen):
    """How to start one engine process."""

    argv: list[str] = Field(min_length=1)
    #: Variables to add to the agent's environment. Holds the API key, so it is left out
    #: of repr(): a logged plan must not leak the key.
    env: dict[str, str] = Field(default_factory=dict, repr=False)
    #: Path answering 200 once the engine has loaded its model.
    health_path: str = "/health"
    #: False for a multi-node rank other than 0: it joins the leader's process group and
    #: serves no HTTP, so only its liveness can be watched.
    serves_http: bool = True
    #: Warnings for the operator (for example an argument this engine build ignores).
    notes: list[str] = Field(default_factory=list)


class ReadyCheck(Frozen):
    """The outcome of one readiness probe."""

    ready: bool
    detail: str


class EngineAdapter(Protocol):
    """Builds launch plans for, and probes the readiness of, one kind of engine."""

    kind: EngineKind

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        """The command line and environment that start ``spec`` on host:port."""
        ...

    async def check_ready(
        self, client: httpx.AsyncClient, base_url: str, api_key: str, model_name: str
    ) -> ReadyCheck:
        """Whether the engine at ``base_url`` serves ``model_name`` right now."""
        ...


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + "..."


def _has_choices(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and bool(body.get("choices"))


async def probe_ready(
    client: httpx.AsyncClient,
    base_url: str,
    api_key: str,
    model_name: str,
    *,
    health_path: str = "/health",
    timeout: float = PROBE_TIMEOUT_S,
) -> ReadyCheck:
    """Probe an OpenAI-compatible engine: its health path, then a one-token completion.

    A 200 from the health path alone is not enough: some engines answer it before the
    first request would succeed, and it does not prove the key works. So the probe also
    asks for one token with the key, on ``/v1/completions``, falling back to
    ``/v1/chat/completions`` for engines (or models) that have no plain completions.
    Never raises for an engine that is down or misbehaving: that is "not ready".
    """
    base = base_url.rstrip("/")
    try:
        health = await client.get(base + health_path, timeout=timeout)
    except httpx.HTTPError as exc:
        return ReadyCheck(ready=False, detail=f"GET {health_path}: {type(exc).__name__}: {exc}")
    if health.status_code != 200:
        return ReadyCheck(
            ready=False,
            detail=f"GET {health_path} answered {health.status_code}: {_clip(health.text)}",
        )

    headers = {"Authorization": f"Bearer {api_key}"}
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": model_name, "prompt": "Hi", "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {
                "model": model_name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
            },
        ),
    ]
    detail = ""
    for path, body in attempts:
        try:
            response = await client.post(base + path, json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            return ReadyCheck(ready=False, detail=f"POST {path}: {type(exc).__name__}: {exc}")
        if response.status_code == 404:
            detail = f"POST {path} answered 404"
            continue
        if response.status_code == 200 and _has_choices(response):
            return ReadyCheck(ready=True, detail=f"{health_path} 200 and POST {path} 200")
        # The detail never quotes our request, so the key cannot end up in a log.
        return ReadyCheck(
            ready=False,
            detail=f"POST {path} answered {response.status_code}: {_clip(response.text)}",
        )
    return ReadyCheck(ready=False, detail=f"no completion endpoint ({detail})")


def int_arg(args: Mapping[str, Any], name: str, default: int, *, minimum: int = 1) -> int:
    """An integer engine argument, at least ``minimum``; ``default`` when absent."""
    value = args.get(name, default)
    # bool is an int subclass; ``parallel: true`` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineConfigError(f"engine_args.{name}", value, "must be an integer")
    if value < minimum:
        raise EngineConfigError(f"engine_args.{name}", value, f"must be at least {minimum}")
    return value


def token_arg(args: Mapping[str, Any], name: str) -> str | None:
    """A short word-like string argument (dtype, quantization method), or None if absent.

    The value becomes its own argv element, so there is no shell to inject into; the
    pattern still refuses values such as ``--trust-remote-code`` that would read as flags.
    """
    if name not in args:
        return None
    value = args[name]
    if (
        not isinstance(value, str)
        or not value
        or value.startswith("-")
        or not all(c.isalnum() or c in "._-" for c in value)
    ):
        raise EngineConfigError(
            f"engine_args.{name}", value, "must be a word of letters, digits, '.', '_' or '-'"
        )
    return value


def bool_arg(args: Mapping[str, Any], name: str) -> bool:
    """A boolean engine argument; False when absent."""
    value = args.get(name, False)
    if not isinstance(value, bool):
        raise EngineConfigError(f"engine_args.{name}", value, "must be true or false")
    return value


def threads_for(spec: ShardSpec) -> int:
    """CPU threads for a CPU engine: the shard's cores rounded up, else 1.

    One by default because oversubscribed threads hurt: two engines with two threads
    each on two cores run several times slower than with one each.
    """
    if spec.cpu_cores is None:
        return 1
    return max(1, math.ceil(spec.cpu_cores))


def require_single_node(spec: ShardSpec) -> None:
    """Raise unless ``spec`` is the only shard of its replica."""
    if spec.world_size != 1:
        raise EngineConfigError(
            "world_size", spec.world_size, f"{spec.engine.value} runs on one node only"
        )


def check_executable(field: str, path: Path) -> None:
    """Raise unless ``path`` is an executable file."""
    if not path.is_file():
        raise EngineConfigError(field, str(path), "no such file")
    if not path.stat().st_mode & 0o111:
        raise EngineConfigError(field, str(path), "not executable")


@dataclass(frozen=True)
class SleepDialect:
    """How one engine is put to sleep and woken over HTTP (both idempotent on our side:
    see :meth:`agent.shards.ShardManager.sleep`)."""

    #: POSTed to free the KV cache and keep the weights.
    sleep_path: str
    #: POSTed to take the KV cache back.
    wake_path: str
    #: The JSON body of both calls; None: none.
    body: Mapping[str, Any] | None = None
    #: GET path answering ``{"is_sleeping": bool}``; None where the engine has none, and
    #: the agent's record of the shard says.
    state_path: str | None = None


def sleep_dialect(kind: EngineKind,
                  engine_args: Mapping[str, Any] | None = None) -> SleepDialect | None:
    """How ``kind`` sleeps, or None where it cannot (llama.cpp: the keeper stops it).
    Agrees with :func:`modelkeeper.domain.shards.can_sleep` (a unit test checks).
    ``engine_args``: the shard's, where the sim is told which engine's dialect to speak."""
    if kind is EngineKind.SIM and (engine_args or {}).get("dialect") == "sglang":
        from .sglang import SLEEP_DIALECT as SGLANG_DIALECT

        return SGLANG_DIALECT
    if kind is EngineKind.VLLM or kind is EngineKind.SIM:
        # The sim speaks vLLM's dialect, so that this path is what the tests run.
        from .vllm import SLEEP_DIALECT as VLLM_DIALECT

        return VLLM_DIALECT
    if kind is EngineKind.SGLANG:
        from .sglang import SLEEP_DIALECT as SGLANG_DIALECT

        return SGLANG_DIALECT
    return None


async def post_sleep_call(client: httpx.AsyncClient, base_url: str, api_key: str, path: str,
                          body: Mapping[str, Any] | None, *, timeout: float) -> httpx.Response:
    """POST one sleep or wake call to the engine at ``base_url``, with its key."""
    headers = {"Authorization": f"Bearer {api_key}"}
    return await client.post(base_url.rstrip("/") + path, headers=headers, timeout=timeout,
                             json=None if body is None else dict(body))


async def read_sleeping(client: httpx.AsyncClient, base_url: str, api_key: str,
                        dialect: SleepDialect, *, timeout: float) -> bool | None:
    """Whether the engine says it sleeps; None where it has no way to say, or did not
    answer plainly (the caller then goes by its own record)."""
    if dialect.state_path is None:
        return None
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        response = await client.get(base_url.rstrip("/") + dialect.state_path,
                                    headers=headers, timeout=timeout)
        answer = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    value = answer.get("is_sleeping") if isinstance(answer, dict) else None
    return value if isinstance(value, bool) else None


def clip_detail(text: str) -> str:
    """An engine's answer, on one line and clipped, for an error message or an event."""
    return _clip(text)


def adapter_for(kind: EngineKind, *, llama_server_path: Path | None = None) -> EngineAdapter:
    """The adapter for ``kind``.

    ``llama_server_path`` (from the node config) makes llama.cpp run a native
    ``llama-server`` binary instead of the bundled xllamacpp entry point. Engine modules
    are imported here, not at the top, because they import this module.
    """
    if kind is EngineKind.LLAMACPP:
        from .llamacpp import LlamaCppAdapter

        return LlamaCppAdapter(llama_server_path=llama_server_path)
    if kind is EngineKind.VLLM:
        from .vllm import VllmAdapter

        return VllmAdapter()
    if kind is EngineKind.SGLANG:
        from .sglang import SglangAdapter

        return SglangAdapter()
    if kind is EngineKind.SIM:
        from .sim import SimAdapter

        return SimAdapter()
    raise EngineConfigError("engine", kind, "no adapter for this engine")
