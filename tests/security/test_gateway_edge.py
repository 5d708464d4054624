"""The gateway's edge (issue 19): what reaches it before a request is routed, and what an
engine may send back.

* A header line that never ends is cut once the header bound has arrived (finding 8), by
  the HTTP protocol the API uses too (modelkeeper.infra.http_server), answering a 431 in
  OpenAI's error shape that a client still sending reads whole.
* Engine-native knobs that set how much is generated are bounded like ``max_tokens``
  (finding 9).
* The Host allowlist and ``Content-Type: application/json`` (no blind cross-site POSTs).
* ``/metrics`` needs a token while client auth is on.
* An engine's answer is buffered up to a bound, past which the request fails with a 502
  naming it and the replica's breaker counts a failure.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn
from aiohttp import web
from uvicorn.server import ServerState

import gateway.streaming
from gateway.edge import HostCheck
from gateway.server import GatewayConfigError, GatewayServer, gateway_protocol
from modelkeeper.domain.output_bounds import (
    ENGINE_OUTPUT_FIELDS,
    OutputField,
    OutputRefusal,
    bound_output,
)
from modelkeeper.domain.shards import EngineKind
from modelkeeper.infra.hosts import OwnAddresses
from modelkeeper.infra.http_server import MAX_HEADER_BYTES
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from tests.support.gateway_support import (
    HOST,
    SECRET,
    add_deployment,
    add_replica,
    metric,
    ready_replicas,
    running_gateway,
    settings_for,
    until,
)

pytestmark = pytest.mark.timeout(60)


# -- finding 8: the header bound holds while a header is still arriving ----------------------

class _Transport(asyncio.Transport):
    """What the protocol writes and whether it closed: no socket."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000),
                "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False  # no half-close here: a refusal closes at once


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


#: One read as a client trickles it: the protocol may keep at most this much past the bound.
_READ = 4096


async def test_an_endless_header_line_is_cut_once_the_bound_has_arrived() -> None:
    protocol_class = gateway_protocol(Settings(gateway_header_timeout_s=30.0))
    protocol = protocol_class(config=uvicorn.Config(_app, log_config=None),
                              server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    try:
        fed = 0
        chunk = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: "
        while not transport.closed and fed < 64 * MAX_HEADER_BYTES:
            protocol.data_received(chunk)
            fed += len(chunk)
            chunk = b"a" * _READ
        assert transport.closed, f"still reading a header line after {fed} bytes"
        # Cut in the read that passed the bound: the parser was fed no more than the bound.
        assert MAX_HEADER_BYTES < fed <= MAX_HEADER_BYTES + _READ, fed
        assert transport.written.startswith(b"HTTP/1.1 431 "), transport.written[:80]
        error = json.loads(transport.written.split(b"\r\n\r\n", 1)[1])["error"]
        assert error == {"message": "the request line and headers are over 65536 bytes",
                         "type": "invalid_request_error", "param": None,
                         "code": "headers_too_large"}, error
    finally:
        protocol.connection_lost(None)


async def test_a_body_in_the_same_read_as_its_headers_is_not_counted_as_headers() -> None:
    """A read that completes the headers may carry a large body: the bound is on headers."""
    protocol_class = gateway_protocol(Settings())
    protocol = protocol_class(config=uvicorn.Config(_app, log_config=None),
                              server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    try:
        body = b"x" * (4 * MAX_HEADER_BYTES)
        protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                               + body[:3 * MAX_HEADER_BYTES])
        protocol.data_received(body[3 * MAX_HEADER_BYTES:])
        assert not transport.written.startswith(b"HTTP/1.1 4"), transport.written[:200]
    finally:
        protocol.connection_lost(None)


async def test_a_malformed_request_gets_a_400_in_openais_shape() -> None:
    """The parser's refusals are written below the app, in the shape of every other error."""
    protocol = gateway_protocol(Settings())(
        config=uvicorn.Config(_app, log_config=None), server_state=ServerState(),
        app_state={}, _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    try:
        protocol.data_received(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nBad Header\r\n\r\n")
        assert transport.closed and transport.written.startswith(b"HTTP/1.1 400 "), (
            transport.written[:80])
        error = json.loads(transport.written.split(b"\r\n\r\n", 1)[1])["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error",
                                                  "malformed_request"), error
    finally:
        protocol.connection_lost(None)


def _endless_header(port: int, limit: int) -> tuple[bytes, int]:
    """Send one header line that never ends, in small writes, until the server answers or
    ``limit`` bytes are sent; what came back and how much was sent."""
    sent = 0
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: ")
        sock.setblocking(False)
        chunk = b"a" * _READ
        received = b""
        while sent < limit:
            try:
                received += sock.recv(65536)
                break  # the server answered (or closed)
            except BlockingIOError:
                pass
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                pass  # the server is not reading: its answer is on the way, or a timeout
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        sock.settimeout(10)
        try:
            while data := sock.recv(65536):
                received += data
        except ConnectionResetError:
            pass
    return received, sent


async def test_a_gateway_answers_an_endless_header_line_with_a_431(database_url: str) -> None:
    async with running_gateway(database_url, gateway_header_timeout_s=5.0) as server:
        received, sent = await asyncio.to_thread(
            _endless_header, server.settings.gateway_port, 16 * MAX_HEADER_BYTES)
        # Not a 408 after the header timeout: cut for its size. How much was sent says
        # little (the kernel's buffers take megabytes); what the parser held is the exact
        # test's above.
        assert received.startswith(b"HTTP/1.1 431"), (sent, received[:200])
        assert b"the request line and headers are over 65536 bytes" in received


def _refused_while_sending(port: int, data: bytes) -> bytes:
    """Send all of ``data`` at once, then read the answer until the server closes."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


async def test_a_client_refused_while_still_sending_reads_the_answer(
        database_url: str) -> None:
    """The connection lingers after the 431 (reads and drops what still comes, within a
    bound) rather than closing with the client's bytes unread, which makes the kernel
    reset it and throw the answer away before the client reads it."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Big: "
            + b"a" * (MAX_HEADER_BYTES + 1))
    async with running_gateway(database_url) as server:
        received = await asyncio.to_thread(
            _refused_while_sending, server.settings.gateway_port, head + b"b" * (1 << 20))
    assert received.startswith(b"HTTP/1.1 431"), received[:200]
    error = json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "headers_too_large", error


# -- a fake engine: counts output as the real ones do, or misbehaves on request ------------

#: The fake engine's context: what llama.cpp generates with ``n_predict`` -1 (or none) and
#: ``ignore_eos``.
CONTEXT_TOKENS = 4096
LIMIT = 64
HI = [{"role": "user", "content": "hi"}]


def _count(value: object, default: int) -> int:
    """A number as the engines read one, leniently (pydantic reads "8" as 8)."""
    if isinstance(value, bool) or value is None:
        return default
    return int(value) if isinstance(value, int | str) else default


def generated_tokens(body: dict[str, Any]) -> int:
    """What an engine generates for ``body``: llama.cpp's ``n_predict`` wins over
    ``max_tokens`` (-1 or none: until the context is full, with ``ignore_eos``); vLLM and
    SGLang generate at least ``min_tokens``; ``n``, ``best_of`` and ``n_cmpl`` outputs per
    prompt, and a batch of prompts one output each."""
    length = _count(body.get("n_predict"), _count(body.get("max_completion_tokens"),
                                                  _count(body.get("max_tokens"), -1)))
    if length < 0:
        length = CONTEXT_TOKENS
    length = max(length, _count(body.get("min_tokens"), 0))
    outputs = max(_count(body.get(name), 1) for name in ("n", "best_of", "n_cmpl"))
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(
        prompt[0], str) else 1
    return length * outputs * prompts


class FakeEngine:
    """An engine on a free port. ``model`` picks what it does: ``count`` answers with the
    tokens :func:`generated_tokens` counts; ``huge`` sends a body without end (chunked),
    ``huge-length`` announces one; ``endless-event`` streams an event that never ends."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        match body["model"]:
            case "count":
                return web.json_response({"choices": [], "usage": {
                    "completion_tokens": generated_tokens(body)}})
            case "huge-length":
                return web.Response(body=b"x" * (4 * SMALL_REPLY), content_type="text/plain")
            case "huge":
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                response.enable_chunked_encoding()
                await response.prepare(request)
                for _ in range(16):
                    await response.write(b"x" * (SMALL_REPLY // 4))
                await response.write_eof()
                return response
            case _:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(b'data: {"choices": []}\n\n')
                for _ in range(16):
                    await response.write(b"x" * (SMALL_EVENT // 4))
                await response.write_eof()
                return response


#: The bounds on what the gateway holds, made small for the test.
SMALL_REPLY = 64 << 10
SMALL_EVENT = 16 << 10



async def _route(db: asyncpg.Connection, engine: FakeEngine, *models: str) -> None:
    for model in models:
        deployment = await add_deployment(db, model)
        await add_replica(db, deployment, f"r-{model}", engine.url)


# -- finding 9: engine-native knobs do not escape the bounds -------------------------------

#: Requests that asked an engine for more than the model's limit of 64 tokens, each with
#: the field the gateway's refusal names (None: it must be answered within the limit).
OVER_THE_LIMIT: list[tuple[dict[str, Any], str | None]] = [
    ({"n_predict": 400, "ignore_eos": True}, None),  # llama.cpp: 400 tokens, before
    ({"max_tokens": 10, "n_predict": 400}, None),
    ({"ignore_eos": True}, None),  # no length named: the model's limit is sent
    # -1, "until the context is full", is lowered to the limit (issue 27), not refused.
    ({"n_predict": -1, "ignore_eos": True}, None),
    ({"n_predict": "400"}, "n_predict"),
    ({"n": 8}, "n"),  # vLLM, SGLang: 8 outputs of 64 tokens
    ({"n": "8"}, "n"),
    ({"best_of": 4}, "best_of"),
    ({"n_cmpl": 4}, "n_cmpl"),  # llama.cpp
    ({"min_tokens": 400}, "min_tokens"),  # vLLM, SGLang
    ({"logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ({"n_probs": 50000}, "n_probs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM: the whole vocabulary
    ({"return_hidden_states": True}, "return_hidden_states"),  # SGLang
]


@pytest.mark.parametrize(("asked", "refused"), OVER_THE_LIMIT)
async def test_no_engine_knob_gets_more_than_the_models_limit(
        database_url: str, db: asyncpg.Connection, asked: dict[str, Any],
        refused: str | None) -> None:
    async with FakeEngine() as engine:
        await _route(db, engine, "count")
        await db.execute("UPDATE models SET max_tokens_limit = $1 WHERE model_id = 'count'",
                         LIMIT)
        async with running_gateway(database_url) as server, httpx.AsyncClient() as http:
            await until(lambda: ready_replicas(server, "count") == ["r-count"], what="routed")
            resp = await http.post(server.url + "/v1/chat/completions",
                                   json={"model": "count", "messages": HI, **asked})
            if refused is None:
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] <= LIMIT
                return
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == refused, error
            # The sentence names the field and the value it had.
            assert f"`{refused}` is {asked[refused]!r}" in error["message"], error


async def test_a_batch_of_prompts_counts_as_that_many_outputs(
        database_url: str, db: asyncpg.Connection) -> None:
    async with FakeEngine() as engine:
        await _route(db, engine, "count")
        await db.execute("UPDATE models SET max_tokens_limit = $1 WHERE model_id = 'count'",
                         LIMIT)
        async with running_gateway(database_url) as server, httpx.AsyncClient() as http:
            await until(lambda: ready_replicas(server, "count") == ["r-count"], what="routed")
            url = server.url + "/v1/completions"
            batch = await http.post(url, json={"model": "count", "prompt": ["a", "b", "c"]})
            assert batch.status_code == 400, batch.text
            error = batch.json()["error"]
            assert error["param"] == "prompt" and "3 prompts" in error["message"], error
            one = await http.post(url, json={"model": "count", "prompt": "a"})
            assert one.json()["usage"]["completion_tokens"] == LIMIT
        # An operator who allows more outputs per request gets them, each bounded.
        async with running_gateway(database_url, gateway_max_choices=4) as server, \
                httpx.AsyncClient() as http:
            await until(lambda: ready_replicas(server, "count") == ["r-count"], what="routed")
            four = await http.post(server.url + "/v1/completions",
                                   json={"model": "count", "prompt": "a", "n": 4,
                                         "n_predict": 1000})
            assert four.json()["usage"]["completion_tokens"] == 4 * LIMIT


@pytest.mark.parametrize("engine", list(EngineKind))
def test_every_engines_length_and_count_fields_are_bounded(engine: EngineKind) -> None:
    """Each field the engine reads, asked far past the limit: refused naming it, or
    lowered to the limit, with max_tokens sent when no OpenAI length field is named."""
    for name, kind in ENGINE_OUTPUT_FIELDS[engine].items():
        decided = bound_output({name: 10**6}, model_limit=LIMIT)
        if isinstance(decided, OutputRefusal):
            assert decided.field == name and f"`{name}` is 1000000" in decided.message
            continue
        assert kind is OutputField.LENGTH, (name, decided)
        assert decided[name] == LIMIT
        assert decided.get("max_tokens", LIMIT) == LIMIT


# -- an engine's answer is held up to a bound ----------------------------------------------

async def test_an_engines_answer_past_the_bound_fails_and_counts_against_it(
        database_url: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway.streaming, "MAX_REPLY_BYTES", SMALL_REPLY, raising=False)
    monkeypatch.setattr(gateway.streaming, "MAX_EVENT_BYTES", SMALL_EVENT, raising=False)
    models = ("huge", "huge-length", "endless-event")
    async with FakeEngine() as engine:
        await _route(db, engine, *models)
        async with running_gateway(database_url) as server, \
                httpx.AsyncClient(timeout=20) as http:
            await until(lambda: all(ready_replicas(server, m) for m in models), what="routed")
            for model in ("huge", "huge-length"):
                resp = await http.post(server.url + "/v1/chat/completions",
                                       json={"model": model, "messages": HI})
                assert resp.status_code == 502, resp.text[:200]
                assert f"over {SMALL_REPLY} bytes" in resp.json()["error"]["message"]
            stream = await http.post(server.url + "/v1/chat/completions",
                                     json={"model": "endless-event", "messages": HI,
                                           "stream": True})
            # The stream had begun (200): it ends with an error event naming the bound.
            assert stream.status_code == 200
            assert f"an event over {SMALL_EVENT} bytes" in stream.text, stream.text[-300:]
            assert stream.text.endswith("data: [DONE]\n\n")
            assert len(stream.content) < SMALL_EVENT
            # Each counted against its replica, as a garbled answer is.
            for model in models:
                (endpoint,) = server.gateway.table.models[model].endpoints
                assert endpoint.breaker.failures == 1, model
            scraped = (await http.get(server.url + "/metrics")).text
            assert metric(scraped, "modelkeeper_gateway_upstream_errors_total",
                          replica="r-huge", kind="reply_too_large") == 1
            assert metric(scraped, "modelkeeper_gateway_upstream_errors_total",
                          replica="r-endless-event", kind="event_too_large") == 1


# -- Host, Content-Type, /metrics ----------------------------------------------------------

async def test_a_foreign_host_and_a_body_not_sent_as_json_are_refused(
        database_url: str) -> None:
    async with running_gateway(database_url) as server, httpx.AsyncClient() as http:
        chat = server.url + "/v1/chat/completions"
        body = b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}'
        # A page on a rebound name: every route refuses it, /healthz and /metrics too.
        for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/healthz"), ("GET", "/metrics")]:
            resp = await http.request(method, server.url + path, content=body, headers={
                "host": "evil.example:8401", "content-type": "application/json"})
            assert resp.status_code == 400, (path, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "host_not_allowed"
            assert "'evil.example:8401'" in error["message"]
            assert "MODELKEEPER_GATEWAY_ALLOWED_HOSTS" in error["message"]
        # A blind cross-site POST (a form's text/plain) never reaches the model lookup.
        for sent in [{"content-type": "text/plain"}, {},
                     {"content-type": "application/x-www-form-urlencoded"}]:
            resp = await http.post(chat, content=body, headers=sent)
            assert resp.status_code == 415, resp.text
            assert resp.json()["error"]["code"] == "unsupported_media_type"
        # JSON with parameters, and the loopback names with and without the port, pass.
        for host in ["localhost", f"127.0.0.1:{server.settings.gateway_port}", "[::1]:80"]:
            resp = await http.post(chat, content=body, headers={
                "host": host, "content-type": "Application/JSON; charset=utf-8"})
            assert resp.json()["error"]["code"] == "model_not_found", (host, resp.text)


def test_a_wildcard_bind_answers_this_machines_name_and_addresses() -> None:
    own = OwnAddresses(lambda: frozenset({"10.0.0.5", "fd00::5"}))
    check = HostCheck(Settings(bind_host="0.0.0.0", gateway_allowed_hosts="gw.lan"), own)
    for host in [socket.gethostname().lower(), "10.0.0.5:8401", "[fd00::5]:8401", "gw.lan",
                 "GW.LAN:8401", "localhost:8401"]:
        assert check.refusal(host.encode()) is None, host
    for header in [b"evil.example", b"10.0.0.6", None]:
        refused = check.refusal(header)
        assert refused is not None and refused.status == 400, header
    # Bound to one address, the machine's other names are not answered.
    assert HostCheck(Settings(bind_host="10.0.0.5")).refusal(
        socket.gethostname().lower().encode()) is not None
    assert HostCheck(Settings(gateway_allowed_hosts="*")).refusal(b"any.example") is None


async def test_metrics_need_a_token_while_client_auth_is_on(
        database_url: str, tmp_path: Path) -> None:
    async with running_gateway(database_url, gateway_auth=True) as server, \
            httpx.AsyncClient() as http:
        closed = await http.get(server.url + "/metrics")
        assert closed.status_code == 403, closed.text
        assert "MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE" in closed.json()["error"]["message"]
    token_file = tmp_path / "metrics-token"
    token_file.write_text("s3cret-scrape\n")
    async with running_gateway(database_url, gateway_auth=True,
                               gateway_metrics_token_file=token_file) as server, \
            httpx.AsyncClient() as http:
        for sent in [{}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-scrape"}]:
            assert (await http.get(server.url + "/metrics", headers=sent)).status_code == 401
        scraped = await http.get(server.url + "/metrics",
                                 headers={"authorization": "Bearer s3cret-scrape"})
        assert scraped.status_code == 200 and "modelkeeper_gateway" in scraped.text
    # Auth off (`up`, on loopback): open, as before.
    async with running_gateway(database_url) as server, httpx.AsyncClient() as http:
        assert (await http.get(server.url + "/metrics")).status_code == 200
    # A token file that cannot be read stops the gateway at start, naming the setting.
    with pytest.raises(GatewayConfigError, match="gateway_metrics_token_file"):
        GatewayServer(settings_for(database_url, gateway_metrics_token_file=tmp_path / "no"),
                      engine_key_secret=SECRET)
