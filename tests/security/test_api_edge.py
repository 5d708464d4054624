"""What the control API reads before anyone is authenticated, tried over real HTTP (the
API served by uvicorn as `modelkeeper api` serves it, ``api.server.uvicorn_config``), with
raw sockets where the attack is in how the bytes arrive:

* an oversized body, sent with no token or the wrong credential, on every kind of route,
  is refused while the client still holds most of it;
* a slowloris client (headers trickled) and a stalled body get a 408 within their
  deadlines; a header over the cap is refused before it is all sent; an agent's liveness
  stream, once its credential is checked, outlives the body deadline;
* strings the store cannot hold (NUL, lone surrogates) are a 422 naming where they are,
  wherever they are: path, query, body, nested;
* ``X-Forwarded-For`` from loopback does not change the peer the API sees.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from api.limits import MAX_BODY_BYTES
from api.server import served
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.http_server import MAX_HEADER_BYTES
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(90)

#: Short deadlines, so that the tests wait seconds, not the defaults' tens of seconds.
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
#: What the attacker claims to send: far more than the API may hold for anyone.
CLAIMED_BYTES = 200 << 20
#: What it actually sends before waiting for an answer: more than uvicorn's read buffer
#: (64 KiB), less than the body limit, so only a server that refuses before reading the
#: body answers in time. A chunked body declares no length: the routes anyone may call
#: read it up to the limit, so one just past the limit is sent.
SENT_BYTES = 256 << 10
SENT_CHUNKED_BYTES = MAX_BODY_BYTES + (64 << 10)
#: How long a refusal may take to arrive: generous for 2 loaded cores, far below what
#: sending 200 MiB takes.
ANSWER_TIMEOUT_S = 10.0
SECRET = "edge-engine-secret"
GIB = 1 << 30


@dataclass
class Edge:
    """The API served over HTTP, tokens of each role, and a registered node."""

    app: FastAPI
    url: str
    store: Store
    admin: str
    viewer: str
    node_id: str
    credential: str

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port


def registration(node_id: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "node_id": node_id, "name": node_id, "engine_host": "127.0.0.1",
        "inventory": {"memory_total_bytes": 8 * GIB, "memory_available_bytes": 8 * GIB,
                      "cpu_count": 4}}
    body.update(overrides)
    return body


@pytest.fixture
async def edge(local_temporal_env: WorkflowEnvironment,
               database_url: str) -> AsyncIterator[Edge]:
    client = local_temporal_env.client
    settings = Settings(
        database_url=database_url, api_port=free_port(),
        temporal_address=client.service_client.config.target_host,
        temporal_namespace=client.namespace, engine_key_secret=SECRET,
        api_header_timeout_s=HEADER_TIMEOUT_S, api_body_timeout_s=BODY_TIMEOUT_S)
    app = create_app(settings)
    async with served(app, settings) as url:
        store: Store = app.state.store
        _, admin = await store.tokens.create_token("alice", OperatorRole.ADMIN)
        _, viewer = await store.tokens.create_token("victor", OperatorRole.VIEWER)
        async with httpx.AsyncClient(base_url=url) as http:
            resp = await http.post("/nodes/register", json=registration("n-edge"))
        assert resp.status_code == 200, resp.text
        yield Edge(app, url, store, admin, viewer, "n-edge", resp.json()["node_credential"])


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    #: Seconds from the first byte sent to the answer's arrival.
    after_s: float

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader, started: float) -> Answer:
    """One HTTP/1.1 answer with a Content-Length, read off ``reader``."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_TIMEOUT_S)
    arrived = time.monotonic() - started
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(
        reader.readexactly(int(headers.get("content-length", "0"))), ANSWER_TIMEOUT_S)
    return Answer(int(status_line.split()[1]), headers, body, arrived)


async def send_partly(edge: Edge, method: str, path: str, headers: dict[str, str], *,
                      chunked: bool = False) -> Answer:
    """A request claiming a :data:`CLAIMED_BYTES` body, of which only :data:`SENT_BYTES`
    are sent before the answer is awaited; the connection must then be closed."""
    reader, writer = await asyncio.open_connection(*edge.address)
    try:
        framing = ({"Transfer-Encoding": "chunked"} if chunked
                   else {"Content-Length": str(CLAIMED_BYTES)})
        head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in {**framing, **headers}.items())
        started = time.monotonic()
        writer.write(head.encode() + b"\r\n")
        part = b"x" * (16 << 10)
        for _ in range((SENT_CHUNKED_BYTES if chunked else SENT_BYTES) // len(part)):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
        await writer.drain()
        answer = await read_answer(reader, started)
        # Closed after the answer: nothing more of the body is read.
        assert await asyncio.wait_for(reader.read(), ANSWER_TIMEOUT_S) == b""
        return answer
    finally:
        writer.close()


# -- finding 3: no body is read for anyone who is not authenticated ----------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_an_oversized_body_is_refused_before_it_is_sent(edge: Edge,
                                                              chunked: bool) -> None:
    wrong = {"Authorization": "Bearer mkc-not-the-credential"}
    cases = [
        # Once exempt from the body limit by its path's suffix, and parsed before the token
        # check: 200 MiB held in memory, then a 401.
        ("PATCH", "/nodes/liveness", {}, {401}),
        ("PATCH", f"/nodes/{edge.node_id}", {}, {401}),
        ("POST", "/models", {}, {401}),
        ("POST", "/models", {"Authorization": "Bearer mko-forged"}, {401}),
        ("PATCH", "/deployments/d-1", {"Authorization": f"Bearer {edge.viewer}"}, {403}),
        # The liveness route: refused on its credential before anything is read.
        ("POST", f"/nodes/{edge.node_id}/liveness", wrong, {403}),
        ("POST", f"/nodes/{edge.node_id}/liveness", {}, {401}),
        ("POST", "/nodes/x/liveness", wrong, {404}),
        # Agents' routes take bodies from anyone who may join: bounded, never held whole.
        ("POST", "/nodes/register", {}, {422}),
        ("POST", f"/nodes/{edge.node_id}/heartbeat", wrong, {422}),
        ("POST", "/nowhere", {}, {404, 422}),
    ]
    answered = []
    for method, path, headers, expected in cases:
        answer = await send_partly(edge, method, path, headers, chunked=chunked)
        assert answer.status in expected, (method, path, answer)
        answered.append(f"{method} {path}: {answer.status} in {answer.after_s:.2f}s")
        if answer.status == 422:
            assert str(MAX_BODY_BYTES) in answer.json()["detail"][0]["msg"], answer
    print("\n" + "\n".join(answered))
    # Nothing that was refused got through to be recorded.
    assert [e.kind for e in await edge.store.events.list_events()] == ["node.registered"]


# -- finding 7: deadlines and the header cap ----------------------------------------------


async def test_a_slowloris_client_gets_a_408_within_the_header_deadline(edge: Edge) -> None:
    # Before the connection: the server's deadline counts from its accept, which a loaded
    # machine can put milliseconds before the line after open_connection (0.998 s once).
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(*edge.address)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        await writer.drain()

        async def trickle() -> None:
            # The attack itself: a byte every tenth of a second, forever.
            while True:
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        try:
            answer = await read_answer(reader, started)
        finally:
            trickling.cancel()
        assert answer.status == 408, answer
        assert HEADER_TIMEOUT_S <= answer.after_s < HEADER_TIMEOUT_S + 3, answer
        assert "not sent in time" in answer.json()["detail"]
    finally:
        writer.close()


async def test_a_stalled_body_gets_a_408_within_the_body_deadline(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection(*edge.address)
    try:
        started = time.monotonic()
        writer.write(b"POST /nodes/register HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"no")
        await writer.drain()
        answer = await read_answer(reader, started)
        assert answer.status == 408, answer
        assert BODY_TIMEOUT_S <= answer.after_s < BODY_TIMEOUT_S + 3, answer
    finally:
        writer.close()


async def test_a_header_over_the_cap_is_refused_before_it_is_all_sent(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection(*edge.address)
    try:
        started = time.monotonic()
        # One header of (it claims) 100 MB: httptools buffers a header's value until it
        # ends, so a cap checked once the header is whole never comes.
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        writer.write(b"a" * (MAX_HEADER_BYTES + (16 << 10)))
        await writer.drain()
        answer = await read_answer(reader, started)
        assert answer.status == 431, answer
        assert str(MAX_HEADER_BYTES) in answer.json()["detail"]
        assert answer.after_s < HEADER_TIMEOUT_S, answer  # the cap, not the deadline
        assert await asyncio.wait_for(reader.read(), ANSWER_TIMEOUT_S) == b""
    finally:
        writer.close()


async def test_a_liveness_stream_outlives_the_body_deadline(edge: Edge) -> None:
    reader, writer = await asyncio.open_connection(*edge.address)
    try:
        writer.write(f"POST /nodes/{edge.node_id}/liveness HTTP/1.1\r\nHost: localhost\r\n"
                     f"Authorization: Bearer {edge.credential}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        started = time.monotonic()
        # An agent's pings, paced as an agent paces them, for three body deadlines.
        while time.monotonic() - started < 3 * BODY_TIMEOUT_S:
            writer.write(b"5\r\nping\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        assert edge.app.state.liveness.state(edge.node_id) is not None
        writer.write(b"4\r\nbye\n\r\n0\r\n\r\n")
        await writer.drain()
        answer = await read_answer(reader, started)
        assert answer.status == 204, answer
        assert answer.after_s >= 3 * BODY_TIMEOUT_S
    finally:
        writer.close()


# -- strings the store cannot hold --------------------------------------------------------


async def test_nul_and_lone_surrogates_are_a_422_naming_where_they_are(edge: Edge) -> None:
    admin = {"Authorization": f"Bearer {edge.admin}"}
    wrong = {"Authorization": "Bearer mkc-wrong"}
    nul_gpu = registration("n-nul")
    nul_gpu["inventory"]["gpus"] = [{"index": 0, "name": "A\u0000", "memory_total_bytes": GIB}]
    surrogate_text = json.dumps(registration("n-sur", name="x")).replace(
        '"name": "x"', '"name": "\\ud800"')
    label_key = json.dumps({"model_id": "m", "labels": {"te\\u0000am": "a"}}).replace(
        "\\\\u0000", "\\u0000")
    cases: list[tuple[str, str, dict[str, str], Any, list[Any]]] = [
        ("GET", "/nodes/a%00b", admin, None, ["path", "node_id"]),
        ("POST", "/nodes/a%00b/heartbeat", wrong, {"inventory": {}}, ["path", "node_id"]),
        ("GET", "/events?deployment_id=d%00", admin, None, ["query", "deployment_id"]),
        ("POST", "/nodes/register", {}, registration("n\u0000"), ["body", "node_id"]),
        ("POST", "/nodes/register", {}, nul_gpu, ["body", "inventory", "gpus", 0, "name"]),
        ("POST", "/nodes/register", {}, surrogate_text, ["body", "name"]),
        # Echoed escaped: the answer itself holds no NUL.
        ("POST", "/deployments", admin, label_key, ["body", "labels", "te\\u0000am"]),
    ]
    async with httpx.AsyncClient(base_url=edge.url) as http:
        for method, path, headers, body, loc in cases:
            content = body if isinstance(body, str) else (
                None if body is None else json.dumps(body))
            resp = await http.request(method, path, content=content, headers={
                **headers, "Content-Type": "application/json"})
            assert resp.status_code == 422, (method, path, resp.text)
            [error] = resp.json()["detail"]
            assert error["loc"] == loc, (path, error)
            assert error["type"] == "string_unstorable", error
            assert ".".join(str(part) for part in loc[:2]) in error["msg"], error
    assert [e.kind for e in await edge.store.events.list_events()] == ["node.registered"]


# -- forwarded headers ---------------------------------------------------------------------


async def test_x_forwarded_for_from_loopback_does_not_change_the_peer(edge: Edge) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as http:
        resp = await http.post("/nodes/register", json=registration("n-fwd"),
                               headers={"X-Forwarded-For": "203.0.113.7"})
    assert resp.status_code == 200, resp.text
    [event] = [e for e in await edge.store.events.list_events() if e.node_id == "n-fwd"]
    assert event.data["peer"] == "127.0.0.1", event.data
