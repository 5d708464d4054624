"""The shared readiness probe, the registry and the engine-argument allow-lists."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.engines.base import EngineConfigError, LaunchPlan, adapter_for, probe_ready
from agent.engines.llamacpp import LlamaCppAdapter
from agent.engines.sglang import SglangAdapter
from agent.engines.vllm import VllmAdapter
from modelkeeper.domain.engine_args import ALLOWED_ENGINE_ARGS, check_engine_arg_names
from modelkeeper.domain.shards import EngineKind

pytestmark = pytest.mark.timeout(30)

KEY = "mk-probe-key-0123"
BASE = "http://engine.test:9000"

Handler = Callable[[httpx.Request], httpx.Response]


def engine(
    health: int = 200,
    completions: int = 200,
    chat: int = 200,
    seen: list[httpx.Request] | None = None,
) -> Handler:
    """A fake OpenAI-compatible engine answering with the given status codes."""
    answer = {"choices": [{"text": "x", "index": 0}]}

    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        if request.url.path == "/health":
            return httpx.Response(health, json={"status": "ok" if health == 200 else "loading"})
        status = {"/v1/completions": completions, "/v1/chat/completions": chat}.get(
            request.url.path, 404
        )
        if status == 200:
            return httpx.Response(200, json=answer)
        return httpx.Response(status, json={"error": {"message": f"status {status}"}})

    return handle


async def probe(handler: Handler) -> tuple[bool, str]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        check = await probe_ready(client, BASE, KEY, "m1")
    return check.ready, check.detail


@pytest.mark.parametrize(
    ("kwargs", "ready", "in_detail"),
    [
        ({}, True, "/v1/completions 200"),
        ({"health": 503}, False, "answered 503"),
        ({"completions": 404}, True, "/v1/chat/completions 200"),
        ({"completions": 404, "chat": 404}, False, "no completion endpoint"),
        ({"completions": 401}, False, "answered 401"),
        ({"completions": 500}, False, "answered 500"),
        ({"completions": 404, "chat": 503}, False, "answered 503"),
    ],
)
async def test_probe_outcomes(kwargs: dict[str, Any], ready: bool, in_detail: str) -> None:
    got_ready, detail = await probe(engine(**kwargs))
    assert got_ready is ready
    assert in_detail in detail
    assert KEY not in detail


async def test_probe_sends_the_key_and_asks_for_one_token() -> None:
    seen: list[httpx.Request] = []
    await probe(engine(completions=404, seen=seen))
    posts = [r for r in seen if r.method == "POST"]
    assert [r.url.path for r in posts] == ["/v1/completions", "/v1/chat/completions"]
    for request in posts:
        assert request.headers["authorization"] == f"Bearer {KEY}"
        body = json.loads(request.content)
        assert body["max_tokens"] == 1 and body["model"] == "m1"
    health = [r for r in seen if r.url.path == "/health"]
    assert len(health) == 1 and "authorization" not in health[0].headers


async def test_a_200_without_choices_is_not_ready() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy page</html>")

    ready, _ = await probe(handle)
    assert not ready


async def test_an_engine_that_refuses_connections_is_not_ready() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    ready, detail = await probe(handle)
    assert not ready and "ConnectError" in detail


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        (EngineKind.LLAMACPP, LlamaCppAdapter),
        (EngineKind.VLLM, VllmAdapter),
        (EngineKind.SGLANG, SglangAdapter),
    ],
)
def test_registry(kind: EngineKind, cls: type) -> None:
    adapter = adapter_for(kind)
    assert isinstance(adapter, cls) and adapter.kind is kind


def test_registry_passes_the_native_llama_server_path() -> None:
    adapter = adapter_for(EngineKind.LLAMACPP, llama_server_path=Path("/opt/llama-server"))
    assert isinstance(adapter, LlamaCppAdapter)
    assert adapter.llama_server_path == Path("/opt/llama-server")


def test_every_engine_has_an_allow_list() -> None:
    assert set(ALLOWED_ENGINE_ARGS) == set(EngineKind)
    for kind in EngineKind:
        assert ALLOWED_ENGINE_ARGS[kind], f"{kind} accepts no engine_args"
    assert ALLOWED_ENGINE_ARGS[EngineKind.LLAMACPP] == {"ctx_size", "parallel"}
    for kind in (EngineKind.VLLM, EngineKind.SGLANG):
        assert {"tensor_parallel_size", "pipeline_parallel_size"} <= ALLOWED_ENGINE_ARGS[kind]
        assert "trust_remote_code" not in ALLOWED_ENGINE_ARGS[kind]


def test_flag_tables_match_the_domain_allow_lists() -> None:
    # The allow-lists live in the domain (the API validates with them); each adapter maps
    # every name but the parallelism pair to a flag. A name on one side only is a bug.
    from agent.engines import sglang, vllm

    parallelism = {"tensor_parallel_size", "pipeline_parallel_size"}
    assert parallelism | set(vllm._FLAGS) == ALLOWED_ENGINE_ARGS[EngineKind.VLLM]
    assert parallelism | set(sglang._FLAGS) == ALLOWED_ENGINE_ARGS[EngineKind.SGLANG]


def test_unknown_argument_names_itself_and_the_allowed_ones() -> None:
    check_engine_arg_names(EngineKind.LLAMACPP, {"ctx_size": 1024})
    with pytest.raises(EngineConfigError) as info:
        check_engine_arg_names(EngineKind.LLAMACPP, {"ctx_size": 1024, "n_gpu_layers": 99})
    assert info.value.field == "engine_args.n_gpu_layers" and info.value.value == 99
    assert "ctx_size, parallel" in str(info.value)


def test_launch_plan_repr_hides_the_environment() -> None:
    plan = LaunchPlan(argv=["engine"], env={"VLLM_API_KEY": KEY})
    assert KEY not in repr(plan) and KEY not in str(plan)
