"""An engine that closes every connection after its response, as llama.cpp's server does
after a streamed one (issue 27): the gateway sends the next request on a new connection,
and nobody sees an error, counts one, or holds one against the engine's breaker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import asyncpg
import httpx
import pytest

from modelkeeper.infra.processes import free_port
from tests.support.gateway_support import (
    HOST,
    add_deployment,
    add_replica,
    metric,
    ready_replicas,
    running_gateway,
    until,
)

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-stale"


@dataclass
class ClosingEngine:
    """Answers one request per connection, then closes it, in one of two ways:
    ``on_next`` closes it only when the next request arrives, unanswered (the race lost
    every time: the client reused the connection before it saw the close); ``at_once``
    closes it right after the response (the race as it comes)."""

    mode: str
    port: int = field(default_factory=free_port)
    answered: int = 0
    #: Requests that arrived on a connection the engine had already answered once.
    refused_on_reuse: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode("latin-1").split("\r\n"):
                name, _, value = line.partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            if head.startswith(b"GET "):
                # The gateway's engine-queue poll (GET /metrics): not a request to count.
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            request = json.loads(await reader.readexactly(length))
            writer.write(self._answer(bool(request.get("stream"))))
            await writer.drain()
            self.answered += 1
            if self.mode == "on_next" and await reader.read(1):
                self.refused_on_reuse += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _answer(stream: bool) -> bytes:
        # HTTP/1.1 with no "Connection: close": a client may keep the connection.
        if stream:
            chunk = {"object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
            body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            kind = b"text/event-stream"
        else:
            body = json.dumps({"object": "text_completion", "model": MODEL,
                               "choices": [{"index": 0, "text": "hi",
                                            "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                         "total_tokens": 2}}).encode()
            kind = b"application/json"
        return (b"HTTP/1.1 200 OK\r\nContent-Type: " + kind
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@asynccontextmanager
async def closing_engine(mode: str) -> AsyncIterator[ClosingEngine]:
    engine = ClosingEngine(mode)
    server = await asyncio.start_server(engine.handle, HOST, engine.port)
    try:
        yield engine
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("mode", ["on_next", "at_once"])
async def test_a_connection_closed_after_each_response_costs_no_request(
        mode: str, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    # One replica and a short wait: a stale connection treated as the engine's failure
    # would rule out the only replica and answer 502 within 0.3 s.
    async with closing_engine(mode) as engine, \
            running_gateway(database_url, gateway_wait_for_replica_s=0.3,
                            gateway_breaker_failures=2) as server, \
            httpx.AsyncClient(timeout=10) as http:
        await add_replica(db, deployment, "r-close", engine.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-close"], what="routed")
        sent = 0
        for stream in (False, True) * 10:  # back to back, as the benchmark clients send
            resp = await http.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 1, "stream": stream})
            assert resp.status_code == 200, resp.text
            sent += 1
        answers = await asyncio.gather(*(http.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1}) for _ in range(16)))
        assert [a.status_code for a in answers] == [200] * 16
        sent += 16

        text = (await http.get(server.url + "/metrics")).text
        assert engine.answered == sent  # each request ran once: none twice, none lost
        for kind in ("reset", "connect", "protocol"):
            assert not metric(text, "modelkeeper_gateway_upstream_errors_total",
                              replica="r-close", kind=kind)
        assert not metric(text, "modelkeeper_gateway_retries_total", model=MODEL)
        assert not metric(text, "modelkeeper_gateway_breaker_state", replica="r-close")
        assert server.gateway.table.models[MODEL].endpoints[0].breaker.failures == 0
        stale = metric(text, "modelkeeper_gateway_stale_connections_total") or 0
        if mode == "on_next":
            # The path under test ran: every reuse found its connection closed.
            assert engine.refused_on_reuse >= 1
            assert stale == engine.refused_on_reuse
