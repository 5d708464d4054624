"""An attacker's attempts at model sources and at bounded input (issue 11).

* Sources outside the policy: scheme, host, credentials, local roots, names that read as
  flags; judged by the domain, by the API (a 422 naming the source and the rule) and by
  the agent's fetcher, with and without redirects (real HTTP servers on loopback).
* Downloads that stop: over the size limit, with the wrong digest, when the last start
  waiting for them is cancelled.
* Oversize and hostile bodies at the API: body size, labels, node ids, huge and infinite
  numbers, engine arguments, /events?limit.
* The gateway: deeply nested JSON, max_tokens and rate bounds, header and body deadlines,
  and a revoked key that stops working while the store is unreachable.

Each attempt must be refused with an answer that says why: none may succeed, and none may
be lost to a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from agent.fetch import FetchRefused, WeightFetcher
from api.app import create_app
from api.limits import MAX_BODY_BYTES
from api.monitoring import MAX_EVENTS_LIMIT
from gateway.admission import KeyRateLimiter, bound_max_tokens
from gateway.responses import ErrorReply
from modelkeeper.domain.catalog import MAX_LABELS, MAX_MEMORY_BYTES, MAX_NODE_IDS
from modelkeeper.domain.engine_args import EngineConfigError, check_engine_arg_names
from modelkeeper.domain.shards import EngineKind, FetchProgress
from modelkeeper.domain.sources import (
    SourceAllowed,
    SourceKind,
    SourcePolicy,
    SourceRefused,
    check_source,
)
from modelkeeper.settings import Settings
from modelkeeper.store.routing import RoutingStore
from tests.support.gateway_support import HOST, running_gateway, until

pytestmark = pytest.mark.timeout(90)

#: The default policy, as settings give it (https, Hugging Face's hosts), with one root.
DEFAULT = SourcePolicy(local_roots=(PurePosixPath("/srv/models"),))
#: What the fetch tests' plain-http servers on loopback need; "localhost" is not on it,
#: so a redirect to the same server by that name leaves the policy.
LOOPBACK = SourcePolicy(schemes=frozenset({"http"}), hosts=("127.0.0.1",))


def _noop(_: FetchProgress) -> None:
    pass


# -- the policy (pure) -------------------------------------------------------------------

@pytest.mark.parametrize(("source", "words"), [
    ("http://huggingface.co/org/m/resolve/main/m.gguf", "scheme 'http'"),
    ("ftp://huggingface.co/m.gguf", "scheme 'ftp'"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("https://evil.example/m.gguf", "host 'evil.example'"),
    ("https://huggingface.co.evil.example/m.gguf", "not an allowed host"),
    ("https://evilhf.co/m.gguf", "not an allowed host"),
    ("https://user:pass@huggingface.co/m.gguf", "credentials"),
    ("https://token@huggingface.co/m.gguf", "credentials"),
    ("https://huggingface.co:99999/m.gguf", "well-formed"),
    ("/etc/passwd", "not under an allowed local root"),
    ("/srv/models/../../etc/shadow", "'..'"),
    ("/srv/modelsX/m.gguf", "not under an allowed local root"),
    ("~/m.gguf", "'~'"),
    ("--trust-remote-code", "name"),
    ("org/../../etc", "name"),
    ("a/b/c", "name"),
    ("", "name"),
])
def test_sources_outside_the_policy_are_refused_with_the_rule(source: str,
                                                              words: str) -> None:
    verdict = check_source(DEFAULT, source)
    assert isinstance(verdict, SourceRefused), verdict
    assert words in verdict.rule and source in verdict.message


@pytest.mark.parametrize(("source", "kind"), [
    ("https://huggingface.co/org/m/resolve/main/m.gguf", SourceKind.URL),
    ("https://cdn-lfs.hf.co/repos/x", SourceKind.URL),
    ("https://HuggingFace.co./x", SourceKind.URL),
    ("/srv/models/m.gguf", SourceKind.PATH),
    ("/srv/models", SourceKind.PATH),
    ("smollm2", SourceKind.NAME),
    ("Qwen/Qwen2.5-0.5B-Instruct", SourceKind.NAME),
])
def test_sources_inside_the_policy_are_allowed(source: str, kind: SourceKind) -> None:
    assert check_source(DEFAULT, source) == SourceAllowed(kind)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "[::1]",
                                  "localhost", "db.localhost", "2130706433", "0x7f.1"])
def test_a_wildcard_host_never_reaches_the_agents_own_network(host: str) -> None:
    anywhere = SourcePolicy(hosts=("*",))
    verdict = check_source(anywhere, f"https://{host}/m.gguf")
    assert isinstance(verdict, SourceRefused) and "listed by itself" in verdict.rule
    assert isinstance(check_source(anywhere, "https://models.example/m.gguf"), SourceAllowed)
    listed = SourcePolicy(hosts=("*", host.strip("[]")))
    assert isinstance(check_source(listed, f"https://{host}/m.gguf"), SourceAllowed)


def test_no_hosts_means_no_downloads() -> None:
    verdict = check_source(SourcePolicy(hosts=()), "https://huggingface.co/m.gguf")
    assert isinstance(verdict, SourceRefused) and "downloads are off" in verdict.rule


def test_settings_default_to_https_and_hugging_face_and_bounded_staleness() -> None:
    settings = Settings()
    assert settings.source_schemes == ["https"]
    assert "huggingface.co" in settings.source_hosts and "*" not in settings.source_hosts
    assert settings.gateway_key_max_staleness_s <= 15


@pytest.mark.parametrize(("kind", "args", "claim", "words"), [
    (EngineKind.LLAMACPP, {"ctx_size": 10**15}, None, "from 1 to"),
    (EngineKind.LLAMACPP, {"parallel": True}, None, "integer"),
    (EngineKind.VLLM, {"max_model_len": -1}, None, "from 1 to"),
    (EngineKind.VLLM, {"dtype": "--trust-remote-code"}, None, "word"),
    (EngineKind.SGLANG, {"max_running_requests": 10**12}, None, "from 1 to"),
    (EngineKind.SIM, {"load_time_s": float("inf")}, None, "number"),
    (EngineKind.SIM, {"memory_bytes": 2 << 30}, 1 << 30, "claims"),
])
def test_engine_argument_values_have_limits(kind: EngineKind, args: dict[str, Any],
                                            claim: int | None, words: str) -> None:
    with pytest.raises(EngineConfigError) as info:
        check_engine_arg_names(kind, args, claim_bytes=claim)
    assert words in str(info.value) and info.value.field.startswith("engine_args.")


# -- the agent's fetcher, against real servers on loopback ---------------------------------

class Served:
    """What a test server saw."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.authorization: list[str | None] = []
        self.release = threading.Event()
        self.closed = threading.Event()


BODY = b"w" * (1 << 20)


@pytest.fixture
def server() -> Iterator[tuple[int, Served]]:
    """A plain-http server on loopback: /m.gguf serves BODY; /to/<url-path> redirects to
    that path on the host the test names in the query; /stall sends a little and waits;
    /big claims a size; /nolength streams BODY four times without a length."""
    state = Served()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.paths.append(self.path)
            state.authorization.append(self.headers.get("Authorization"))
            if self.path.startswith("/to/"):
                target = self.path[len("/to"):]
                path, _, host = target.partition("?host=")
                self.send_response(302)
                port = urlsplit(f"http://{self.headers['Host']}").port
                self.send_header("Location", f"http://{host}:{port}{path}" if host else path)
                self.end_headers()
                return
            if self.path == "/stall":
                self.send_response(200)
                self.send_header("Content-Length", str(len(BODY) * 8))
                self.end_headers()
                try:
                    self.wfile.write(BODY)
                    self.wfile.flush()
                    state.release.wait(20)
                    self.wfile.write(BODY)
                except OSError:
                    pass
                state.closed.set()
                return
            self.send_response(200)
            if self.path == "/big":
                self.send_header("Content-Length", str(10 * len(BODY)))
            elif self.path != "/nolength":
                self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            try:
                for _ in range(4 if self.path == "/nolength" else 1):
                    self.wfile.write(BODY)
            except OSError:
                pass

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer((HOST, 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], state
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()


async def test_the_agent_refuses_a_source_outside_its_policy_before_any_request(
        server: tuple[int, Served], tmp_path: Path) -> None:
    port, state = server
    for policy, source in [
        (SourcePolicy(), f"http://127.0.0.1:{port}/m.gguf"),  # the default: https only
        (LOOPBACK, f"http://localhost:{port}/m.gguf"),  # host not listed
        (LOOPBACK, f"http://u:p@127.0.0.1:{port}/m.gguf"),  # credentials
    ]:
        with pytest.raises(FetchRefused) as info:
            await WeightFetcher(tmp_path, policy=policy).fetch(source, _noop)
        assert info.value.field == "source"
    assert state.paths == []  # nothing was ever requested


async def test_redirects_are_followed_only_within_the_policy(
        server: tuple[int, Served], tmp_path: Path) -> None:
    port, state = server
    fetcher = WeightFetcher(tmp_path, policy=LOOPBACK)
    # Within: a redirect to another path of an allowed host is followed.
    path = await fetcher.fetch(f"http://127.0.0.1:{port}/to/m.gguf", _noop)
    assert path.read_bytes() == BODY and state.paths == ["/to/m.gguf", "/m.gguf"]
    # Outside: the same server under a name the policy does not list is never asked.
    state.paths.clear()
    with pytest.raises(FetchRefused) as info:
        await fetcher.fetch(f"http://127.0.0.1:{port}/to/m.gguf?host=localhost", _noop)
    assert "redirected to 'http://localhost:" in info.value.reason
    assert state.paths == ["/to/m.gguf?host=localhost"]
    # A loop ends after the redirect limit.

    class Loop(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", "/again")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer((HOST, 0), Loop)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(FetchRefused, match="redirects"):
            await WeightFetcher(tmp_path, policy=LOOPBACK).fetch(
                f"http://127.0.0.1:{httpd.server_address[1]}/start", _noop)
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_a_token_goes_to_the_source_origin_only(
        server: tuple[int, Served], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port, state = server
    both = SourcePolicy(schemes=frozenset({"http"}), hosts=("127.0.0.1", "localhost"))
    fetcher = WeightFetcher(tmp_path, policy=both)
    with pytest.raises(FetchRefused) as info:
        await fetcher.fetch(f"http://127.0.0.1:{port}/m.gguf", _noop, secret="HF")
    assert info.value.field == "secret" and "MODELKEEPER_SOURCE_TOKEN_HF" in str(info.value)
    monkeypatch.setenv("MODELKEEPER_SOURCE_TOKEN_HF", "hf_secret")
    await fetcher.fetch(f"http://127.0.0.1:{port}/to/m.gguf?host=localhost", _noop,
                        secret="HF")
    assert state.authorization == ["Bearer hf_secret", None]


async def test_oversize_downloads_stop_and_leave_nothing(
        server: tuple[int, Served], tmp_path: Path) -> None:
    port, _ = server
    small = SourcePolicy(schemes=frozenset({"http"}), hosts=("127.0.0.1",),
                         max_download_bytes=2 * len(BODY))
    fetcher = WeightFetcher(tmp_path, policy=small)
    with pytest.raises(FetchRefused, match="the server sends"):  # by its Content-Length
        await fetcher.fetch(f"http://127.0.0.1:{port}/big", _noop)
    with pytest.raises(FetchRefused, match="more than"):  # counted as it streams
        await fetcher.fetch(f"http://127.0.0.1:{port}/nolength", _noop)
    assert list(tmp_path.iterdir()) == []


async def test_the_digest_is_checked_before_the_engine_sees_the_file(
        server: tuple[int, Served], tmp_path: Path) -> None:
    port, _ = server
    fetcher = WeightFetcher(tmp_path, policy=LOOPBACK)
    url = f"http://127.0.0.1:{port}/m.gguf"
    with pytest.raises(FetchRefused) as info:
        await fetcher.fetch(url, _noop, sha256="0" * 64)
    assert info.value.field == "sha256" and hashlib.sha256(BODY).hexdigest() in str(info.value)
    assert not fetcher.cached_path(url).exists()  # removed: no engine may read it
    good = hashlib.sha256(BODY).hexdigest()
    path = await fetcher.fetch(url, _noop, sha256=good)
    assert path.read_bytes() == BODY
    # Cached: checked against the digest kept beside it, without a download.
    assert await fetcher.fetch(url, _noop, sha256=good) == path
    with pytest.raises(FetchRefused):
        await fetcher.fetch(url, _noop, sha256="f" * 64)


async def test_a_download_stops_when_its_activity_gives_up(
        server: tuple[int, Served], tmp_path: Path) -> None:
    port, state = server
    fetcher = WeightFetcher(tmp_path, policy=LOOPBACK)
    seen: list[FetchProgress] = []
    url = f"http://127.0.0.1:{port}/stall"
    waiters = [asyncio.create_task(fetcher.fetch(url, seen.append)) for _ in range(2)]
    await until(lambda: any(p.bytes_done >= len(BODY) for p in seen), what="first bytes")
    waiters[0].cancel()
    await asyncio.sleep(0.2)
    assert fetcher._inflight, "one start still waits: the download goes on"
    waiters[1].cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    await until(lambda: not fetcher._inflight and not fetcher._tasks, what="download stopped")
    # The server sees its connection go before it sends the rest.
    await asyncio.to_thread(state.closed.wait, 10)
    assert not list(tmp_path.glob("*.part")) and not fetcher.cached_path(url).exists()


# -- the API -------------------------------------------------------------------------------

@pytest.fixture
async def api(local_temporal_env: WorkflowEnvironment, database_url: str,
              tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The API with one local root, ``tmp_path / "models"``."""
    client = local_temporal_env.client
    (tmp_path / "models").mkdir()
    settings = Settings(database_url=database_url,
                        temporal_address=client.service_client.config.target_host,
                        temporal_namespace=client.namespace, api_auth=False,
                        source_local_roots=[tmp_path / "models"], data_dir=tmp_path / "data")
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        yield http


MODEL = {"model_id": "m", "engine": "llamacpp", "memory_bytes": 1 << 30}


def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    return dict(error)


async def test_the_api_refuses_sources_outside_the_policy_and_names_the_rule(
        api: httpx.AsyncClient, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "m.gguf"
    for source, words in [
        ("http://huggingface.co/m.gguf", "scheme 'http'"),
        ("https://evil.example/m.gguf", "host 'evil.example'"),
        ("https://user:pw@huggingface.co/m.gguf", "credentials"),
        (str(outside), "not under an allowed local root"),
        (f"{tmp_path}/models/../elsewhere/m.gguf", "'..'"),
        ("--model-path=/etc", "name"),
    ]:
        error = _error(await api.post("/models", json={**MODEL, "source": source}))
        assert error["loc"] == ["body", "source"] and error["input"] == source
        assert source in error["msg"] and words in error["msg"]
    assert (await api.get("/models")).json() == []


async def test_memory_is_estimated_only_under_the_allowed_roots(
        api: httpx.AsyncClient, tmp_path: Path) -> None:
    inside = tmp_path / "models" / "tiny.gguf"
    inside.write_bytes(b"g" * 1000)
    estimated = await api.post("/models", json={"model_id": "tiny", "engine": "llamacpp",
                                                "source": str(inside)})
    assert estimated.status_code == 201 and estimated.json()["memory_estimated"] is True
    # A link under the root to a file outside it: refused once resolved, never read.
    secret = tmp_path / "elsewhere.gguf"
    secret.write_bytes(b"s" * 5000)
    (tmp_path / "models" / "link.gguf").symlink_to(secret)
    error = _error(await api.post("/models", json={
        "model_id": "link", "engine": "llamacpp", "source": str(tmp_path / "models/link.gguf")}))
    assert error["loc"] == ["body", "memory_bytes"] and "outside the allowed" in error["msg"]
    # A path outside is refused by the policy: the API never looks at it.
    error = _error(await api.post("/models", json={
        "model_id": "out", "engine": "llamacpp", "source": "/proc/self/environ.gguf"}))
    assert error["loc"] == ["body", "source"] and "no such file" not in error["msg"]


async def test_sha256_and_secret_are_checked(api: httpx.AsyncClient) -> None:
    url = {**MODEL, "source": "https://huggingface.co/org/m/resolve/main/m.gguf"}
    assert _error(await api.post("/models", json={**url, "sha256": "XYZ"}))["loc"] == [
        "body", "sha256"]
    assert _error(await api.post("/models", json={**url, "secret": "hf token"}))["loc"] == [
        "body", "secret"]
    named = _error(await api.post("/models", json={**MODEL, "source": "smollm2",
                                                   "secret": "HF"}))
    assert named["loc"] == ["body", "secret"] and "not a URL" in named["msg"]
    digest = "ab" * 32
    created = await api.post("/models", json={**url, "sha256": digest, "secret": "HF"})
    assert created.status_code == 201, created.text
    stored = (await api.get("/models/m")).json()
    assert stored["sha256"] == digest and stored["secret"] == "HF"


async def test_oversize_and_hostile_bodies_are_422s_naming_the_limit(
        api: httpx.AsyncClient) -> None:
    sim = {"model_id": "s", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30}
    huge = json.dumps({**sim, "engine_args": {"pad": "x" * MAX_BODY_BYTES}})
    error = _error(await api.post("/models", content=huge,
                                  headers={"content-type": "application/json"}))
    assert error["loc"] == ["body"] and str(MAX_BODY_BYTES) in error["msg"]

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b" " * (MAX_BODY_BYTES // 2)
        yield b"{}"

    error = _error(await api.post("/models", content=chunked(),
                                  headers={"content-type": "application/json"}))
    assert str(MAX_BODY_BYTES) in error["msg"]

    for body, field in [
        ({**sim, "memory_bytes": MAX_MEMORY_BYTES + 1}, "memory_bytes"),
        ({**sim, "memory_bytes": 10**30}, "memory_bytes"),
        ({**sim, "cpu_cores": 10**9}, "cpu_cores"),
        ({**sim, "gpus": 2**40}, "gpus"),
        ({**sim, "engine_args": {"memory_bytes": 2 << 30}}, "engine_args"),
        ({**sim, "engine": "llamacpp", "source": "smollm2",
          "engine_args": {"ctx_size": 10**15}}, "engine_args"),
    ]:
        assert _error(await api.post("/models", json=body))["loc"][-1] == field
    infinite = (await api.post("/models", content=json.dumps(sim)[:-1] + ', "cpu_cores": '
                               'Infinity}', headers={"content-type": "application/json"}))
    assert _error(infinite)["loc"][-1] == "cpu_cores"

    assert (await api.post("/models", json=sim)).status_code == 201
    deployments: list[tuple[dict[str, Any], str]] = [
        ({"model_id": "s", "labels": {f"k{i}": "v" for i in range(MAX_LABELS + 1)}},
         "labels"),
        ({"model_id": "s", "labels": {"k" * 1000: "v"}}, "labels"),
        ({"model_id": "s", "labels": {"k": "v" * 1000}}, "labels"),
        ({"model_id": "s", "node_ids": [f"n{i}" for i in range(MAX_NODE_IDS + 1)]},
         "node_ids"),
        ({"model_id": "s", "node_ids": ["n" * 1000]}, "node_ids"),
    ]
    for body, field in deployments:
        loc = _error(await api.post("/deployments", json=body))["loc"]
        assert field in loc
    for limit in (-64971691, 0, MAX_EVENTS_LIMIT + 1):
        error = _error(await api.get("/events", params={"limit": limit}))
        assert error["loc"] == ["query", "limit"]
    assert (await api.get("/events", params={"limit": MAX_EVENTS_LIMIT})).status_code == 200


async def test_huge_numbers_in_an_inventory_are_422s(api: httpx.AsyncClient) -> None:
    registration = {"node_id": "n1", "name": "n1", "inventory": {}}
    for inventory, field in [
        ({"memory_total_bytes": 10**30}, "memory_total_bytes"),
        ({"memory_available_bytes": 2**63}, "memory_available_bytes"),
        ({"cpu_count": 2**40}, "cpu_count"),
        ({"gpus": [{"index": 0, "name": "g", "memory_bytes": 10**25}]}, "memory_bytes"),
    ]:
        resp = await api.post("/nodes/register",
                              json={**registration, "inventory": inventory})
        assert resp.status_code == 422, resp.text
        assert field in resp.json()["detail"][0]["loc"]
    labels = {f"k{i}": "v" for i in range(MAX_LABELS + 1)}
    resp = await api.post("/nodes/register", json={**registration, "labels": labels})
    assert resp.status_code == 422 and "labels" in resp.json()["detail"][0]["loc"]


# -- the gateway ---------------------------------------------------------------------------

async def test_deeply_nested_json_is_a_400(database_url: str) -> None:
    async with running_gateway(database_url) as server, httpx.AsyncClient() as http:
        url = server.url + "/v1/chat/completions"
        for body in ["[" * 100_000 + "]" * 100_000,
                     '{"model": "m", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}"]:
            resp = await http.post(url, content=body,
                                   headers={"content-type": "application/json"})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == "json_too_deep"


def test_max_tokens_bound() -> None:
    body = b'{"model": "m", "messages": []}\n'
    bounded = bound_max_tokens(json.loads(body), body, 64)
    assert not isinstance(bounded, ErrorReply)
    assert bounded.body == b'{"model": "m", "messages": [],"max_tokens":64}\n'
    asked = b'{"model": "m", "max_tokens": 10}'
    assert bound_max_tokens(json.loads(asked), asked, 64) == (asked, None)
    for field, value in [("max_tokens", 65), ("max_completion_tokens", 10**9),
                         ("max_tokens", "64"), ("max_tokens", True)]:
        over = json.dumps({"model": "m", field: value}).encode()
        reply = bound_max_tokens(json.loads(over), over, 64)
        assert isinstance(reply, ErrorReply) and reply.status == 400
        assert field in reply.message and "64" in reply.message


def test_rate_limit_per_key() -> None:
    limiter = KeyRateLimiter(rate_per_s=2.0, burst=3)
    assert [limiter.take("k1", 100.0) for _ in range(3)] == [None] * 3
    refused = limiter.take("k1", 100.0)
    assert refused is not None and refused.status == 429
    assert (b"retry-after", b"1") in refused.headers
    assert limiter.take("k2", 100.0) is None  # another key has its own bucket
    assert limiter.take("k1", 100.5) is None  # half a second refills one at 2/s


async def test_rate_limit_and_max_tokens_at_the_gateway(database_url: str) -> None:
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        _, key = await routes.create_api_key("fuzz")
        async with running_gateway(database_url, gateway_auth=True, gateway_key_rate_per_s=0.5,
                                   gateway_key_burst=2, gateway_max_tokens=8) as server, \
                httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
            await until(lambda: bool(server.gateway.admission._key_hashes), what="key cached")
            over = await http.post(server.url + "/v1/completions",
                                   json={"model": "m", "prompt": "x", "max_tokens": 9})
            assert over.status_code == 400 and "max_tokens" in over.json()["error"]["message"]
            assert (await http.get(server.url + "/v1/models")).status_code == 200
            limited = await http.get(server.url + "/v1/models")
            assert limited.status_code == 429 and limited.headers["retry-after"] == "2"
    finally:
        await routes.close()


def _raw(port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send ``data`` and read until the server closes; what came back, and how long."""
    started = time.monotonic()
    with socket.create_connection((HOST, port), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
    return received, time.monotonic() - started


async def test_slow_headers_and_bodies_get_a_408(database_url: str) -> None:
    async with running_gateway(database_url, gateway_header_timeout_s=0.5,
                               gateway_body_timeout_s=0.5) as server:
        port = server.settings.gateway_port
        for data in [b"",  # connected, says nothing
                     b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n",  # headers never end
                     b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n"
                     b"\r\n{\"model\":"]:  # body never ends
            received, took = await asyncio.to_thread(_raw, port, data, 10.0)
            assert received.startswith(b"HTTP/1.1 408"), received
            assert 0.4 < took < 5
            # The same error shape as every other answer of the gateway: OpenAI's.
            error = json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout", error
        big = (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * (70 << 10)
               + b"\r\n\r\n")
        received, _ = await asyncio.to_thread(_raw, port, big, 10.0)
        assert received.startswith(b"HTTP/1.1 431"), received[:100]
        error = json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]
        assert (error["code"], error["message"]) == (
            "headers_too_large", "the request line and headers are over 65536 bytes"), error
        # A whole request is served as before, on a connection kept alive.
        async with httpx.AsyncClient() as http:
            for _ in range(3):
                assert (await http.get(server.url + "/healthz")).status_code == 200


class Partition:
    """A TCP proxy to PostgreSQL that can be cut off: while cut, it carries nothing in
    either direction, on old connections or new, and delivers what waited once healed,
    as TCP does across a network partition (silence, not a refusal)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        await self._flowing.wait()
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        self._writers.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        self.heal()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


async def test_a_revoked_key_stops_working_while_the_store_is_unreachable(
        database_url: str) -> None:
    parts = urlsplit(database_url)
    assert parts.port is not None
    proxy = Partition(parts.port)
    await proxy.start()
    netloc = parts.netloc.replace(f":{parts.port}", f":{proxy.port}")
    proxied = urlunsplit(parts._replace(netloc=netloc))
    staleness = 1.5
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        record, key = await routes.create_api_key("staleness")
        async with running_gateway(proxied, gateway_auth=True,
                                   gateway_key_max_staleness_s=staleness) as server, \
                httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                  timeout=5) as http:
            await until(lambda: bool(server.gateway.admission._key_hashes), what="key cached")
            assert (await http.get(server.url + "/v1/models")).status_code == 200
            proxy.cut()  # the gateway's store is now unreachable, silently
            await routes.revoke_api_keys(record.prefix)  # a notification it never gets
            revoked = time.monotonic()
            while (resp := await http.get(server.url + "/v1/models")).status_code == 200:
                assert time.monotonic() - revoked < staleness + 1, "the key still works"
                await asyncio.sleep(0.05)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "keys_unconfirmed"
            assert resp.headers["retry-after"] == "5"
            health = (await http.get(server.url + "/healthz")).json()
            assert health["keys"] == "stale"
            # Fail closed: a request with no key is refused the same way, not judged.
            keyless = await http.get(server.url + "/v1/models",
                                     headers={"Authorization": ""})
            assert keyless.status_code == 503
            proxy.heal()  # back: the keys are read again, and the revocation seen
            await until(lambda: not server.gateway.admission._key_hashes, timeout=30,
                        what="keys read again")
            assert (await http.get(server.url + "/v1/models")).status_code == 401
    finally:
        await routes.close()
        await proxy.close()
