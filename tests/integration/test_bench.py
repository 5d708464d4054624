"""`modelkeeper bench` against a real sim engine through the real gateway: the engine
runs two requests at once (``--max-num-seqs 2``) and queues the rest, so levels 1 and 2
meet a TTFT objective that level 4, whose second pair waits a whole request, misses; the
capacity stored is 2. The API is answered by a stand-in (as in the operator CLI's tests):
the route itself is tests/integration/test_measured_capacity.py's."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from cli.bench import run_bench
from cli.main import build_parser
from tests.support.gateway_support import (
    add_deployment,
    add_replica,
    ready_replicas,
    running_gateway,
    sims,
    until,
)

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

MODEL = "sim-bench"
#: Each request: 8 tokens at 10/s, 0.8 s, its first token after 0.1 s. At level 4 the
#: second pair waits for the first: TTFT about 0.9 s, against an objective of 0.5 s that
#: leaves 0.4 s for the gateway and a busy machine at levels 1 and 2.
TOKENS, TOKENS_PER_S, SLOTS = 8, 10, 2
TTFT_OBJECTIVE_S = 0.5



async def test_bench_finds_the_concurrency_an_engine_serves_within_the_objective(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    put: list[dict[str, Any]] = []

    def api(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/deployments":
            return httpx.Response(200, json=[{
                "deployment_id": deployment, "model_id": MODEL, "runs_model_id": None,
                "status": "serving", "ready_replicas": 1}])
        assert (request.method, request.url.path) == ("PUT", f"/models/{MODEL}/capacity")
        body = json.loads(request.content)
        put.append(body)
        return httpx.Response(200, json={**body, "model_id": MODEL, "unit": None,
                                         "tokens_per_s_per_unit": None,
                                         "measured_at": "2026-12-03T00:00:00Z"})

    lines: list[str] = []
    flags = ("--max-num-seqs", str(SLOTS), "--tokens-per-second", str(TOKENS_PER_S))
    async with sims(tmp_path, MODEL, "r-b", flags=flags) as (sim,), \
            running_gateway(database_url) as server:
        await add_replica(db, deployment, "r-b", sim.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-b"], what="routed")
        args: argparse.Namespace = build_parser().parse_args([
            "bench", MODEL, "--ttft-p95", str(TTFT_OBJECTIVE_S), "--itl-p95", "0.5",
            "--max-concurrency", "8", "--duration", "1", "--min-requests", "4",
            "--max-tokens", str(TOKENS)])
        # Its own event loop, in a thread: the gateway serves from this one.
        code = await asyncio.to_thread(
            run_bench, args, api_url="http://api.test", gateway_url=server.url,
            out=lines.append, transport=httpx.MockTransport(api))

    assert code == 0, lines
    assert [body["concurrency"] for body in put] == [2], lines
    stored = put[0]
    assert stored["objective"] == {"ttft_p95_s": TTFT_OBJECTIVE_S, "itl_p95_s": 0.5}
    assert stored["ttft_p95_s"] <= TTFT_OBJECTIVE_S and stored["replicas"] == 1
    # Two streams of 10 tokens/s at most: no more than 20 tokens/s, and some.
    assert 0 < stored["tokens_per_s"] <= 2 * TOKENS_PER_S
    # A request lasts its 8 tokens at 10/s, give or take the way through the gateway.
    assert 0.7 <= stored["mean_request_s"] < 2.0
    # Three levels ran, the third missing on TTFT; 8 was never tried.
    assert len([line for line in lines if "per replica:" in line]) == 3, lines
    assert "misses it (TTFT p95" in lines[3], lines
