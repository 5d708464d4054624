"""The gateway when engines fail: retry on another replica, the circuit breaker, a stream
cut midway, and a client that leaves."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest

from modelkeeper.infra.processes import free_port
from tests.support.gateway_support import (
    HOST,
    add_deployment,
    add_replica,
    launch_sim,
    metric,
    ready_replicas,
    running_gateway,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-f"
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 1}



async def test_refused_connection_is_retried_on_another_replica(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL, replicas=2)
    dead_url = f"http://{HOST}:{free_port()}"  # nothing listens there
    async with sims(tmp_path, MODEL, "r-live") as (live,), \
            running_gateway(database_url, gateway_breaker_failures=100) as server, \
            httpx.AsyncClient() as http:
        await add_replica(db, deployment, "r-dead", dead_url)
        await add_replica(db, deployment, "r-live", live.url)
        await until(lambda: len(ready_replicas(server, MODEL)) == 2, what="both routed")
        for _ in range(8):
            resp = await http.post(server.url + "/v1/completions", json=BODY)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-modelkeeper-replica"] == "r-live"
        text = (await http.get(server.url + "/metrics")).text
        refused = metric(text, "modelkeeper_gateway_upstream_errors_total",
                         replica="r-dead", kind="connect")
        retried = metric(text, "modelkeeper_gateway_retries_total", model=MODEL)
        # Round-robin among equals sends about half the first attempts to the dead one.
        assert refused is not None and refused >= 1
        assert retried == refused
        assert metric(text, "modelkeeper_gateway_requests_total", model=MODEL,
                      code="200") == 8


async def test_breaker_opens_on_failures_and_closes_when_the_replica_recovers(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    port = free_port()
    async with running_gateway(database_url, gateway_breaker_failures=2,
                               gateway_breaker_open_s=1.0, gateway_wait_for_replica_s=0.3,
                               gateway_retries=2) as server, \
            httpx.AsyncClient() as http:
        await add_replica(db, deployment, "r-b", f"http://{HOST}:{port}")
        await until(lambda: ready_replicas(server, MODEL) == ["r-b"], what="routed")
        endpoint = server.gateway.table.models[MODEL].endpoints[0]

        # Refused twice in a row, by two requests (a request does not go back at once to a
        # replica that refused it: it is held for another, in vain): the breaker opens.
        for _ in range(2):
            first = await http.post(server.url + "/v1/completions", json=BODY)
            assert first.status_code == 502
            assert "Cannot connect" in first.json()["error"]["message"]
        text = (await http.get(server.url + "/metrics")).text
        assert metric(text, "modelkeeper_gateway_breaker_state", replica="r-b") == 1

        # While open, the replica gets nothing: the request waits, then a 503 says why.
        second = await http.post(server.url + "/v1/completions", json=BODY)
        assert second.status_code == 503
        assert "keep failing" in second.json()["error"]["reason"]
        assert endpoint.requests == 2, "an open breaker must keep requests away"

        sim = launch_sim(tmp_path, "r-b", MODEL, port=port)
        try:
            await sim.wait_healthy()
            # One trial once the open period is over; it succeeds and closes the breaker.
            await until(lambda: endpoint.breaker.allows(time.monotonic()), what="trial due")
            third = await http.post(server.url + "/v1/completions", json=BODY)
            assert third.status_code == 200, third.text
            text = (await http.get(server.url + "/metrics")).text
            assert metric(text, "modelkeeper_gateway_breaker_state", replica="r-b") == 0
            for _ in range(3):
                resp = await http.post(server.url + "/v1/completions", json=BODY)
                assert resp.status_code == 200
        finally:
            sim.stop()


async def test_stream_cut_midway_ends_with_an_error_event_and_done(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL, replicas=2)
    # Both crash 6 s after starting, in the middle of 10-second streams.
    crash = ("--tokens-per-second", "10", "--crash-after", "6")
    async with sims(tmp_path, MODEL, "r-c1", "r-c2", flags=crash) as (one, two), \
            running_gateway(database_url) as server, \
            httpx.AsyncClient(timeout=30) as http:
        await add_replica(db, deployment, "r-c1", one.url)
        await add_replica(db, deployment, "r-c2", two.url)
        await until(lambda: len(ready_replicas(server, MODEL)) == 2, what="both routed")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 100, "stream": True}

        async def raw_stream() -> str:
            async with http.stream("POST", server.url + "/v1/chat/completions",
                                   json=body) as resp:
                assert resp.status_code == 200
                return "".join([text async for text in resp.aiter_text()])

        async def sdk_stream() -> tuple[list[str], BaseException | None]:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x",
                                        max_retries=0)
            tokens: list[str] = []
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}],
                    max_tokens=100, stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens.append(chunk.choices[0].delta.content)
            except openai.APIError as exc:
                return tokens, exc
            finally:
                await client.close()
            return tokens, None

        raw, (tokens, sdk_error) = await asyncio.gather(raw_stream(), sdk_stream())
        # Least-outstanding routing put the two streams on different replicas: both crashed.
        await until(lambda: one.process.poll() is not None and two.process.poll() is not None,
                    timeout=5, what="both sims to have crashed")

        events = [e for e in raw.split("\n\n") if e]
        assert len(events) > 5, "tokens flowed before the cut"
        assert events[-1] == "data: [DONE]"
        assert '"code":"stream_interrupted"' in events[-2]
        assert "cut midway" in events[-2]

        assert 0 < len(tokens) < 100
        assert isinstance(sdk_error, openai.APIError), "the SDK must see an error, not an end"
        assert "cut midway" in str(sdk_error)
        text = (await http.get(server.url + "/metrics")).text
        for replica in ("r-c1", "r-c2"):
            assert metric(text, "modelkeeper_gateway_upstream_errors_total", replica=replica,
                          kind="stream_cut") == 1


async def test_client_that_leaves_cancels_its_upstream_request(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    async with sims(tmp_path, MODEL, "r-slow", flags=("--tokens-per-second", "10")) as (sim,), \
            running_gateway(database_url) as server:
        await add_replica(db, deployment, "r-slow", sim.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-slow"], what="routed")
        endpoint = server.gateway.table.models[MODEL].endpoints[0]

        # A stream: read two events, then hang up (a 10-second stream).
        body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True}
        async with httpx.AsyncClient(timeout=30) as http, \
                http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data:")
                if seen == 2:
                    break
            assert endpoint.in_flight == 1
        left = time.monotonic()
        await until(lambda: endpoint.in_flight == 0, timeout=3, what="upstream cancelled")
        assert time.monotonic() - left < 3

        # A plain request (5 s of generation) whose client gives up after a moment.
        async with httpx.AsyncClient(timeout=30) as http:
            request = asyncio.create_task(http.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 50}))
            await until(lambda: endpoint.in_flight == 1, what="request sent")
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        await until(lambda: endpoint.in_flight == 0, timeout=3, what="upstream cancelled")
        text = (await httpx.AsyncClient().get(server.url + "/metrics")).text
        assert metric(text, "modelkeeper_gateway_requests_total", model=MODEL,
                      code="499") == 2
        # The breaker holds nothing against a replica whose client left.
        assert endpoint.breaker.failures == 0
