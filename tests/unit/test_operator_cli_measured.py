"""The CLI of measured capacity: `size` and `models show` send what they should and say
what came back; `bench` refuses out-of-bounds flags and a model with no ready replica
before any load. The API is answered by httpx.MockTransport (tests/integration has the
real routes, and bench against a real gateway)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from cli.bench import run_bench
from cli.main import build_parser
from cli.operator_cli import UsageError, render, run_operator_command

pytestmark = pytest.mark.timeout(10)

API = "http://api.test"
MEASURED: dict[str, Any] = {
    "model_id": "chat", "profile": "", "engine": "vllm", "concurrency": 12,
    "tokens_per_s": 600.0, "unit": "gpu", "tokens_per_s_per_unit": 600.0,
    "mean_request_s": 4.0, "ttft_p95_s": 0.8, "itl_p95_s": 0.04,
    "objective": {"ttft_p95_s": 2.0, "itl_p95_s": 0.1}, "replicas": 2, "max_tokens": 128,
    "measured_at": "2026-12-03T10:00:00Z"}
MODEL: dict[str, Any] = {
    "model_id": "chat", "engine": "vllm", "source": "org/chat", "memory_bytes": 16 << 30,
    "memory_estimated": False, "gpus": 1, "cpu_cores": None, "min_nodes": 1,
    "measured": [MEASURED]}


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def test_size_asks_the_api_and_says_how_and_whether_there_is_room() -> None:
    seen: list[str] = []
    answer = {"model_id": "chat", "profile": "", "rps": 9.0, "concurrency_needed": 36.0,
              "per_replica_rps": 3.0, "replicas_needed": 3, "replicas_now": 1,
              "more_needed": 2, "fit_now": 1, "enough_room": False,
              "assumption": "Little's law: ...", "measured_at": MEASURED["measured_at"]}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, json=answer)

    lines: list[str] = []
    run_operator_command(parse("size", "org/chat", "--rps", "9", "--profile", "h100"), API,
                         lines.append, transport=httpx.MockTransport(handler))
    assert seen == [f"{API}/models/org/chat/size?rps=9.0&profile=h100"]
    assert lines[0].splitlines() == [
        "chat at 9 req/s needs 3 replica(s) (3 req/s each): 2 more than the 1 there are; "
        "only 1 more fit now",
        "  how: Little's law: ..."]
    with pytest.raises(UsageError, match="--rps 0: a target rate must be above 0"):
        run_operator_command(parse("size", "chat", "--rps", "0"), API, lines.append,
                             transport=httpx.MockTransport(handler))


def test_models_show_has_the_measured_capacity() -> None:
    assert render(parse("models", "show", "chat"), MODEL).splitlines() == [
        "model chat: vllm, org/chat, 16.0 GiB, 1 GPU(s)",
        "  measured as (own resources): 12 concurrent request(s) per replica, 600.0 "
        "tokens/s, 600.0 tokens/s per gpu, within TTFT p95 2 s and inter-token p95 0.1 s "
        "(measured 2026-12-03T10:00:00Z, 128 max_tokens, 4.00 s mean request)"]
    never = render(parse("models", "show", "chat"), {**MODEL, "measured": []})
    assert "measured: never (modelkeeper bench MODEL measures it)" in never


@pytest.mark.parametrize(("flags", "words"), [
    (["--ttft-p95", "0"], "--ttft-p95 0: must be above 0"),
    (["--itl-p95", "61"], "--itl-p95 61: must be above 0 and at most 60 s"),
    (["--max-concurrency", "0"], "--max-concurrency 0: must be at least 1"),
    (["--duration", "0"], "--duration 0: must be above 0"),
])
def test_bench_refuses_flags_out_of_bounds_before_any_request(flags: list[str],
                                                              words: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no request expected, got {request.url}")

    with pytest.raises(UsageError, match=words):
        run_bench(parse("bench", "chat", *flags), api_url=API, gateway_url="http://gw.test",
                  out=print, transport=httpx.MockTransport(handler))


def test_bench_needs_a_deployed_and_ready_model() -> None:
    deployments = [{"deployment_id": "d1", "model_id": "chat", "status": "loading",
                    "ready_replicas": 0}]

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/deployments"
        return httpx.Response(200, content=json.dumps(deployments))

    with pytest.raises(UsageError, match=r"no replica is ready \(loading\)"):
        run_bench(parse("bench", "chat"), api_url=API, gateway_url="http://gw.test",
                  out=print, transport=httpx.MockTransport(handler))
    with pytest.raises(UsageError, match="no deployment has that id or model id"):
        run_bench(parse("bench", "other"), api_url=API, gateway_url="http://gw.test",
                  out=print, transport=httpx.MockTransport(handler))
