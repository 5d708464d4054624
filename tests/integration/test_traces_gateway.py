"""The gateway's spans, received by an in-process OTLP collector: a client's trace is
continued through admission, routing, the upstream request and the first token, and the
engine receives a ``traceparent`` naming the upstream span. Off, the gateway binds its
plain methods and sends the engine no trace header.

The whole path from ``POST /deployments`` to an engine, through a real `up`:
tests/integration/test_traces_up.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import asyncpg
import httpx
import pytest
from aiohttp import web

from gateway.app import Gateway
from gateway.forwarding import Forwarder
from modelkeeper.infra import tracing
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from tests.support.gateway_support import (
    HOST,
    add_deployment,
    add_replica,
    ready_replicas,
    running_gateway,
    until,
)
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver

pytestmark = pytest.mark.timeout(60)

MODEL = "traced"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SERVER, CLIENT = 2, 3  # OTLP's SpanKind values


class Engine:
    """A stand-in engine that answers completions, whole or streamed, and keeps the
    headers of each request it got."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.url = ""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("the", " fox"):
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@asynccontextmanager
async def engine() -> AsyncIterator[Engine]:
    fake = Engine()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, HOST, port)
    await site.start()
    fake.url = f"http://{HOST}:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    """A collector, and this process tracing to it until the test ends."""
    with otlp_receiver() as collector:
        tracing.setup(Settings(otlp_endpoint=collector.url), service="modelkeeper-gateway")
        try:
            yield collector
        finally:
            tracing.shutdown()


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


async def test_a_streamed_request_is_traced_through_to_the_engine(
        receiver: OtlpReceiver, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    async with engine() as fake, running_gateway(database_url) as server, \
            httpx.AsyncClient(timeout=20) as http:
        await add_replica(db, deployment, "r-t", fake.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
        resp = await http.post(server.url + "/v1/chat/completions",
                               headers={"traceparent": TRACEPARENT},
                               json={"model": MODEL, "stream": True, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200 and "[DONE]" in resp.text, resp.text
    tracing.shutdown()  # exports what the batch holds

    spans = [s for s in receiver.received() if s.trace_id == CLIENT_TRACE]
    assert {s.service for s in spans} == {"modelkeeper-gateway"}
    request = one(spans, "POST /v1/chat/completions")
    admission, routing = one(spans, "admission"), one(spans, "routing")
    upstream, first = one(spans, "upstream"), one(spans, "first token")
    # The client's trace continues: its span is the request's parent.
    assert (request.parent_id, request.kind) == (CLIENT_SPAN, SERVER)
    assert request.attributes["http.response.status_code"] == 200
    assert admission.parent_id == routing.parent_id == request.span_id
    assert admission.end_ns <= routing.start_ns
    assert (upstream.parent_id, upstream.kind) == (routing.span_id, CLIENT)
    assert upstream.attributes["modelkeeper.replica_id"] == "r-t"
    assert upstream.attributes["http.response.status_code"] == 200
    assert first.parent_id == upstream.span_id
    assert upstream.start_ns <= first.end_ns <= upstream.end_ns
    # The engine got the trace, its parent the upstream span, beside its own key.
    [sent] = fake.headers
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{upstream.span_id}-01"
    assert sent["Authorization"].startswith("Bearer ")


async def test_a_request_without_a_traceparent_starts_a_trace_when_drawn(
        receiver: OtlpReceiver, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    async with engine() as fake, running_gateway(database_url,
                                                 gateway_trace_ratio=1.0) as server, \
            httpx.AsyncClient(timeout=20) as http:
        await add_replica(db, deployment, "r-t", fake.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
        resp = await http.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text
    tracing.shutdown()

    spans = receiver.received()
    request = one(spans, "POST /v1/chat/completions")
    assert request.parent_id == ""
    assert {s.trace_id for s in spans} == {request.trace_id}
    # A whole answer has no first token of its own: its upstream span covers it.
    assert {s.name for s in spans} == {"POST /v1/chat/completions", "admission", "routing",
                                       "upstream"}
    [sent] = fake.headers
    # Sampled (01), and with the SDK's own trace id the W3C "random" flag (02) too.
    assert sent["traceparent"] == f"00-{request.trace_id}-{one(spans, 'upstream').span_id}-03"


async def test_undrawn_requests_make_no_span_but_a_clients_sampled_trace_is_kept(
        receiver: OtlpReceiver, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with engine() as fake, running_gateway(database_url,
                                                 gateway_trace_ratio=0.0) as server, \
            httpx.AsyncClient(timeout=20) as http:
        await add_replica(db, deployment, "r-t", fake.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
        for _ in range(3):
            assert (await http.post(server.url + "/v1/chat/completions",
                                    json=body)).status_code == 200
        # A client that traces sent it unsampled: its choice holds, nothing is recorded.
        unsampled = await http.post(server.url + "/v1/chat/completions", json=body, headers={
            "traceparent": f"00-{'5' * 32}-{CLIENT_SPAN}-00"})
        assert unsampled.status_code == 200
        sampled = await http.post(server.url + "/v1/chat/completions", json=body,
                                  headers={"traceparent": TRACEPARENT})
        assert sampled.status_code == 200
    tracing.shutdown()
    spans = receiver.received()
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    assert len(spans) == 4  # the request, admission, routing, upstream
    # Only the traced request took a traceparent to the engine.
    assert ["traceparent" in sent for sent in fake.headers] == [False] * 4 + [True]


async def test_off_the_gateway_binds_its_plain_methods_and_sends_no_trace(
        database_url: str, db: asyncpg.Connection) -> None:
    assert not tracing.ON
    deployment = await add_deployment(db, MODEL)
    async with engine() as fake, running_gateway(database_url) as server, \
            httpx.AsyncClient(timeout=20) as http:
        gateway = server.gateway
        # uvicorn serves the gateway itself, with no wrapper around it.
        assert isinstance(server._server.config.app, Gateway)
        assert gateway._route == gateway.router.route
        assert gateway.router._attempt == gateway.forwarder.attempt
        assert gateway.forwarder._post == gateway.forwarder._session_post
        assert isinstance(gateway.forwarder, Forwarder)
        await add_replica(db, deployment, "r-t", fake.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
        resp = await http.post(server.url + "/v1/chat/completions",
                               headers={"traceparent": TRACEPARENT}, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text
    [sent] = fake.headers
    assert "traceparent" not in {name.lower() for name in sent}


async def test_a_collector_that_is_down_costs_spans_not_requests(
        database_url: str, db: asyncpg.Connection) -> None:
    nobody = f"http://{HOST}:{free_port()}"  # nothing listens there
    tracing.setup(Settings(otlp_endpoint=nobody), service="modelkeeper-gateway")
    try:
        deployment = await add_deployment(db, MODEL)
        async with engine() as fake, running_gateway(database_url) as server, \
                httpx.AsyncClient(timeout=20) as http:
            await add_replica(db, deployment, "r-t", fake.url)
            await until(lambda: ready_replicas(server, MODEL) == ["r-t"], what="routed")
            for _ in range(3):
                resp = await http.post(server.url + "/v1/chat/completions",
                                       headers={"traceparent": TRACEPARENT}, json={
                    "model": MODEL, "max_tokens": 2, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]})
                assert resp.status_code == 200 and "[DONE]" in resp.text, resp.text
        assert len(fake.headers) == 3
    finally:
        tracing.shutdown()
