"""The sim engine's request handling (pure functions and an in-process server) and its adapter."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.engines.base import EngineConfigError, adapter_for
from agent.engines.sim import SIM_ALLOWED_ENGINE_ARGS, SimAdapter
from agent.engines.sim_server import (
    API_KEY_ENV,
    DEFAULT_MAX_TOKENS,
    MAX_BODY_BYTES,
    WORDS,
    CompletionRequest,
    HttpError,
    Pacer,
    SimConfig,
    SimEngine,
    body_length,
    build_response,
    encode_chunk,
    generate_text,
    is_authorized,
    memory_to_hold,
    parse_args,
    parse_completion_request,
    parse_request_head,
    render_response,
    render_stream_head,
    sse_event,
    stream_chunks,
    wants_keep_alive,
)
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-model"


def head(raw: str) -> Any:
    return parse_request_head(raw.replace("\n", "\r\n").encode())


def completion(body: dict[str, Any], *, chat: bool = False) -> CompletionRequest:
    return parse_completion_request(json.dumps(body).encode(), chat=chat, served_model=MODEL)


# ------------------------------------------------------------------------------- HTTP


def test_parse_request_head_lowercases_and_joins_headers() -> None:
    h = head("POST /v1/completions?x=1 HTTP/1.1\nHost: a\nX-Tag: one\nx-tag: two\n")
    assert (h.method, h.target, h.path, h.version) == (
        "POST", "/v1/completions?x=1", "/v1/completions", "HTTP/1.1",
    )  # fmt: skip
    assert h.headers == {"host": "a", "x-tag": "one, two"}


@pytest.mark.parametrize(
    "raw",
    ["", "GET /health\n", "GET /health HTTP/2\n", "GET /health HTTP/1.1\nno colon here\n",
     "GET /health HTTP/1.1\n : empty name\n"],
)  # fmt: skip
def test_parse_request_head_rejects_malformed_requests(raw: str) -> None:
    with pytest.raises(HttpError) as err:
        head(raw)
    assert err.value.status == 400
    assert err.value.close


def test_keep_alive_defaults_per_http_version() -> None:
    assert wants_keep_alive(head("GET / HTTP/1.1\n"))
    assert not wants_keep_alive(head("GET / HTTP/1.1\nConnection: Close\n"))
    assert not wants_keep_alive(head("GET / HTTP/1.0\n"))
    assert wants_keep_alive(head("GET / HTTP/1.0\nConnection: keep-alive\n"))


def test_body_length() -> None:
    assert body_length(head("GET / HTTP/1.1\n")) == 0
    assert body_length(head("POST / HTTP/1.1\nContent-Length: 12\n")) == 12
    cases = [
        ("Content-Length: -1", 400),
        ("Content-Length: ten", 400),
        (f"Content-Length: {MAX_BODY_BYTES + 1}", 413),
        ("Transfer-Encoding: chunked", 501),
    ]
    for header, status in cases:
        with pytest.raises(HttpError) as err:
            body_length(head(f"POST / HTTP/1.1\n{header}\n"))
        assert err.value.status == status
        # The body's end is unknown, so the connection cannot be reused.
        assert err.value.close


def test_render_response() -> None:
    raw = render_response(503, b'{"a":1}', keep_alive=False)
    head_text, _, body = raw.partition(b"\r\n\r\n")
    lines = head_text.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert "Content-Length: 7" in lines
    assert "Connection: close" in lines
    assert body == b'{"a":1}'


def test_chunk_and_sse_framing() -> None:
    assert encode_chunk(b"hello world, 16b") == b"10\r\nhello world, 16b\r\n"
    assert sse_event({"a": [1, None]}) == b'data: {"a":[1,null]}\n\n'


def test_stream_head_framing() -> None:
    assert b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n" in render_stream_head(
        chunked=True
    )
    assert b"Connection: close" in render_stream_head(chunked=True, keep_alive=False)
    raw = render_stream_head(chunked=False)
    assert b"Transfer-Encoding" not in raw
    assert b"Connection: close" in raw


def test_is_authorized() -> None:
    assert is_authorized({}, None)
    assert is_authorized({}, "")
    assert is_authorized({"authorization": "Bearer s3cret"}, "s3cret")
    assert is_authorized({"authorization": "bearer s3cret"}, "s3cret")
    assert not is_authorized({}, "s3cret")
    assert not is_authorized({"authorization": "Bearer wrong"}, "s3cret")
    assert not is_authorized({"authorization": "Basic s3cret"}, "s3cret")
    assert not is_authorized({"authorization": "s3cret"}, "s3cret")


# ------------------------------------------------------------------------ completions


def test_completion_defaults() -> None:
    req = completion({"prompt": "one two three"})
    assert req == CompletionRequest(
        chat=False, prompt_tokens=(3,), max_tokens=DEFAULT_MAX_TOKENS, stream=False,
        include_usage=False,
    )  # fmt: skip


def test_prompt_shapes_give_one_choice_per_prompt() -> None:
    assert completion({"prompt": ["a b", "c"]}).prompt_tokens == (2, 1)
    assert completion({"prompt": [1, 2, 3, 4]}).prompt_tokens == (4,)
    assert completion({"prompt": [[1, 2], [3]]}).prompt_tokens == (2, 1)


def test_chat_counts_message_content_and_prefers_max_completion_tokens() -> None:
    req = completion(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi there you"}]},
            ],
            "max_tokens": 3,
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
    )
    assert req == CompletionRequest(
        chat=True, prompt_tokens=(5,), max_tokens=5, stream=True, include_usage=True
    )


@pytest.mark.parametrize(
    ("body", "chat", "status"),
    [
        (b"{not json", False, 400),
        (b"[1, 2]", False, 400),
        (b'{"prompt": "x", "model": "other"}', False, 404),
        (b'{"prompt": "x", "max_tokens": 0}', False, 400),
        (b'{"prompt": "x", "max_tokens": true}', False, 400),
        (b'{"prompt": "x", "max_tokens": "5"}', False, 400),
        (b'{"prompt": "x", "max_tokens": 1000000}', False, 400),
        (b'{"prompt": "x", "stream": "yes"}', False, 400),
        (b'{"prompt": "x", "stream_options": 1}', False, 400),
        (b"{}", False, 400),
        (b'{"prompt": []}', False, 400),
        (b'{"prompt": [1, "a"]}', False, 400),
        (b"{}", True, 400),
        (b'{"messages": []}', True, 400),
        (b'{"messages": [{"content": "no role"}]}', True, 400),
        (b'{"messages": [{"role": "user", "content": 5}]}', True, 400),
        (b'{"messages": [{"role": "user", "content": ["part"]}]}', True, 400),
    ],
)
def test_invalid_requests_are_refused(body: bytes, chat: bool, status: int) -> None:
    with pytest.raises(HttpError) as err:
        parse_completion_request(body, chat=chat, served_model=MODEL)
    assert err.value.status == status
    # A bad body is complete and well framed: the connection stays usable.
    assert not err.value.close


def test_generated_text_is_deterministic_and_cycles() -> None:
    assert generate_text(3) == "the quick brown"
    text = generate_text(len(WORDS) + 1)
    assert text.split() == [*WORDS, WORDS[0]]
    assert generate_text(7) == generate_text(7)


def test_completion_response_shape() -> None:
    req = completion({"prompt": ["a b", "c"], "max_tokens": 4})
    body = build_response(req, model=MODEL, request_id="cmpl-1", created=123)
    assert body["id"] == "cmpl-1"
    assert body["object"] == "text_completion"
    assert (body["created"], body["model"]) == (123, MODEL)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == generate_text(4) for c in body["choices"])
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


def test_chat_response_shape() -> None:
    req = completion({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, chat=True)
    body = build_response(req, model=MODEL, request_id="chatcmpl-1", created=1)
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "the quick"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_chat_stream_matches_the_non_streamed_answer() -> None:
    req = completion(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
         "stream_options": {"include_usage": True}},
        chat=True,
    )  # fmt: skip
    events = list(stream_chunks(req, model=MODEL, request_id="c", created=1))
    chunks = [chunk for _, chunk in events]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "c" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == generate_text(5)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    # One paced step per token, so --tokens-per-second governs the whole stream.
    assert sum(paced for paced, _ in events) == 5


def test_completion_stream_interleaves_choices() -> None:
    req = completion({"prompt": ["a", "b"], "max_tokens": 3, "stream": True})
    events = list(stream_chunks(req, model=MODEL, request_id="c", created=1))
    texts: dict[int, str] = {0: "", 1: ""}
    for _, chunk in events:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: generate_text(3), 1: generate_text(3)}
    assert [c["choices"][0]["finish_reason"] for _, c in events[-2:]] == ["length", "length"]
    assert "usage" not in events[-1][1]
    assert sum(paced for paced, _ in events) == 3


def test_memory_to_hold_tops_up_to_the_target() -> None:
    assert memory_to_hold(0, 20_000_000) == 0
    assert memory_to_hold(100_000_000, 20_000_000) == 80_000_000
    assert memory_to_hold(10_000_000, 20_000_000) == 0
    assert memory_to_hold(100_000_000, None) == 100_000_000


async def test_pacer_spaces_tokens() -> None:
    unpaced = Pacer(0)
    started = time.monotonic()
    for i in range(100):
        await unpaced.wait_for_token(i)
    assert time.monotonic() - started < 0.05
    paced = Pacer(100)
    for i in range(5):
        await paced.wait_for_token(i)
    assert time.monotonic() - paced.start >= 0.05


def test_parse_args() -> None:
    config = parse_args(
        ["--port", "8000", "--model", "m", "--load-time", "1.5", "--memory-bytes", "1024",
         "--tokens-per-second", "20", "--fail-at-start", "--crash-after", "3", "--hang"]
    )  # fmt: skip
    assert config == SimConfig(
        host="127.0.0.1", port=8000, model="m", load_time_s=1.5, memory_bytes=1024,
        tokens_per_second=20.0, fail_at_start=True, crash_after_s=3.0, hang=True,
    )  # fmt: skip
    defaults = parse_args(["--port", "1", "--model", "m"])
    assert (defaults.load_time_s, defaults.crash_after_s, defaults.hang) == (0.0, None, False)


@pytest.mark.parametrize("flag", ["--load-time", "--memory-bytes", "--tokens-per-second"])
def test_parse_args_rejects_negative_values(flag: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--model", "m", flag, "-1"])


# --------------------------------------------------------------- in-process server


class Client:
    """A raw HTTP client on one connection, to check framing that httpx hides."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """One response with a Content-Length body."""
        head_bytes = await self.reader.readuntil(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers, body


@pytest.fixture
async def engine_server() -> AsyncIterator[tuple[SimEngine, int]]:
    engine = SimEngine(SimConfig(host="127.0.0.1", port=0, model=MODEL), api_key="k")
    server = await asyncio.start_server(engine.handle_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield engine, port
    finally:
        server.close()
        await engine.close_connections()
        await server.wait_closed()


async def connect(port: int) -> Client:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return Client(reader, writer)


def post(path: str, body: dict[str, Any], *, version: str = "1.1", key: str = "k") -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def test_loading_then_ready_on_one_keep_alive_connection(
    engine_server: tuple[SimEngine, int],
) -> None:
    engine, port = engine_server
    client = await connect(port)
    await client.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await client.response()
    assert status == 503
    assert json.loads(body)["error"]["message"] == "Loading model"
    await client.send(post("/v1/completions", {"prompt": "x"}))
    assert (await client.response())[0] == 503

    engine.ready = True
    # Two requests in one write: pipelined requests are answered in order.
    await client.send(
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        + post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    )
    assert (await client.response())[0] == 200
    status, headers, body = await client.response()
    assert status == 200
    assert headers["connection"] == "keep-alive"
    assert json.loads(body)["choices"][0]["text"] == "the quick"


async def test_errors_keep_or_close_the_connection(engine_server: tuple[SimEngine, int]) -> None:
    engine, port = engine_server
    engine.ready = True
    client = await connect(port)
    await client.send(post("/v1/completions", {"prompt": "x"}, key="wrong"))
    status, _, body = await client.response()
    assert status == 401
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    for request, expected in [
        (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
        (b"GET /v1/completions HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n", 405),
        (post("/v1/completions", {"prompt": "x", "model": "other"}), 404),
    ]:
        await client.send(request)
        status, headers, _ = await client.response()
        assert (status, headers["connection"]) == (expected, "keep-alive")
    # A body we cannot frame ends the connection after the error.
    await client.send(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    status, headers, _ = await client.response()
    assert (status, headers["connection"]) == (501, "close")
    assert await client.reader.read() == b""


async def test_http_1_0_stream_is_delimited_by_close(engine_server: tuple[SimEngine, int]) -> None:
    engine, port = engine_server
    engine.ready = True
    client = await connect(port)
    await client.send(
        post("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
             version="1.0")
    )  # fmt: skip
    raw = await client.reader.read()  # returns at EOF: the server closed the connection
    head_bytes, _, body = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head_bytes
    assert b"text/event-stream" in head_bytes
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert len(events) == 1 + 2 + 1 + 1  # role, two tokens, finish, [DONE]


async def test_hang_never_answers() -> None:
    engine = SimEngine(SimConfig(host="127.0.0.1", port=0, model=MODEL, hang=True), None)
    engine.ready = True
    server = await asyncio.start_server(engine.handle_connection, "127.0.0.1", 0)
    try:
        client = await connect(server.sockets[0].getsockname()[1])
        await client.send(b"GET /health HTTP/1.1\r\n\r\n")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.reader.read(1), 0.3)
    finally:
        server.close()
        await engine.close_connections()
        await server.wait_closed()


# ------------------------------------------------------------------------ the adapter


def spec(**changes: Any) -> ShardSpec:
    fields: dict[str, Any] = {
        "replica_id": ReplicaId("r1"),
        "model_id": ModelId("tiny"),
        "node_id": NodeId("n1"),
        "engine": EngineKind.SIM,
        "source": "anything",
        "memory_bytes": 50_000_000,
    }
    return ShardSpec(**(fields | changes))


def test_launch_plan_maps_engine_args_to_flags() -> None:
    plan = SimAdapter().launch_plan(
        spec(engine_args={"load_time_s": 2, "tokens_per_second": 12.5, "crash_after_s": 30,
                          "fail_at_start": True, "hang": False}),
        host="127.0.0.1", port=9001, api_key="s3cret",
    )  # fmt: skip
    assert plan.argv[:3] == [sys.executable, "-m", "agent.engines.sim_server"]
    assert plan.argv[3:] == [
        "--host", "127.0.0.1", "--port", "9001", "--model", "tiny",
        "--memory-bytes", "50000000", "--load-time", "2.0", "--tokens-per-second", "12.5",
        "--crash-after", "30.0", "--fail-at-start",
    ]  # fmt: skip
    # The key travels in the environment only: argv is readable by every local user.
    assert plan.env == {API_KEY_ENV: "s3cret"}
    assert all("s3cret" not in arg for arg in plan.argv)
    assert "s3cret" not in repr(plan)
    assert plan.health_path == "/health"
    assert plan.serves_http
    # Every flag the adapter emits is one the server accepts.
    parse_args(plan.argv[3:])


def test_launch_plan_defaults_and_overrides() -> None:
    plan = SimAdapter(python="/opt/py").launch_plan(
        spec(engine_args={"memory_bytes": 0, "hang": True}, rank=1, world_size=2,
             leader_address="10.0.0.1:9000", gpu_indices=[0]),
        host="0.0.0.0", port=1, api_key="",
    )  # fmt: skip
    assert plan.argv[0] == "/opt/py"
    assert plan.argv[plan.argv.index("--memory-bytes") + 1] == "0"
    assert plan.argv[-1] == "--hang"
    assert "--load-time" not in plan.argv
    assert plan.env == {API_KEY_ENV: ""}
    assert not plan.serves_http
    assert plan.notes


@pytest.mark.parametrize(
    "engine_args",
    [
        {"ctx_size": 4096},
        {"load_time_s": -1},
        {"load_time_s": "2"},
        {"tokens_per_second": True},
        {"crash_after_s": float("inf")},
        {"hang": "yes"},
        {"fail_at_start": 1},
        {"memory_bytes": -5},
    ],
)
def test_launch_plan_rejects_bad_engine_args(engine_args: dict[str, Any]) -> None:
    with pytest.raises(EngineConfigError):
        SimAdapter().launch_plan(spec(engine_args=engine_args), host="h", port=1, api_key="k")


def test_allowed_engine_args() -> None:
    assert {"load_time_s", "tokens_per_second", "fail_at_start", "crash_after_s", "hang"} <= (
        SIM_ALLOWED_ENGINE_ARGS
    )
    assert SimAdapter.kind is EngineKind.SIM


def test_adapter_for_sim_returns_the_sim_adapter() -> None:
    assert isinstance(adapter_for(EngineKind.SIM), SimAdapter)
