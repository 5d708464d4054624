"""The control API as an attacker finds it: every operator route without a token, with a
viewer's, with a revoked one; a hostile Host header; and who the event history names.

The routes are read off ``app.routes``, so a route added later is tried without anyone
listing it here. Open by design: ``/healthz`` (probes, `up`) and the agents' routes
(``api.agents``, ``api.liveness``), where agents authenticate as nodes, tried by their own
tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute
from temporalio.testing import WorkflowEnvironment

from api import auth
from api.app import create_app
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operators import READ_METHODS, OperatorRole, name_problem, refusal
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.routing import hash_key
from modelkeeper.store.tokens import OperatorTokenRecord, TokensStore

pytestmark = pytest.mark.timeout(90)

#: Routes open by design (see the module docstring). The console's pages and actions take
#: the same tokens by a cookie, not a bearer header: test_console_auth.py tries them.
OPEN_MODULES = frozenset({"api.agents", "api.liveness", "api.console.pages",
                          "api.console.actions"})
OPEN_PATHS = frozenset({"/healthz"})
#: Fewer operator routes than this means the enumeration broke, not that the API shrank.
MIN_OPERATOR_CALLS = 20
#: The reads a viewer may not make: an engine's log may hold prompts (api/logs.py).
ADMIN_READS = frozenset({("GET", "/replicas/x/logs")})
#: Reads that never end (server-sent events), which the in-process client would wait out:
#: asked for a deployment that does not exist, so a 422 answers once the token passed.
STREAM_PATHS = frozenset({"/events/stream"})

GIB = 1 << 30
SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": GIB}


def api_routes(routes: Iterable[BaseRoute]) -> Iterator[APIRoute]:
    """Every route of ours, included routers walked into (FastAPI keeps an included router
    as one entry that holds the original router). Not FastAPI's own /docs and
    /openapi.json: plain Starlette routes, with no data behind them."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from api_routes(included.routes)
        elif isinstance(route, APIRoute):
            yield route


def operator_calls(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every operator route, each path parameter filled with ``x``."""
    calls = []
    for route in api_routes(app.routes):
        if route.endpoint.__module__ in OPEN_MODULES or route.path in OPEN_PATHS:
            continue
        path = route.path_format.format(**{name: "x" for name in route.param_convertors})
        calls.extend((method, path) for method in sorted(route.methods))
    return calls


async def send(http: httpx.AsyncClient, method: str, path: str, token: str | None = None,
               ) -> httpx.Response:
    """One request as an attacker sends it: a body of ``{}`` on writes."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = None if method in READ_METHODS else {}
    params = {"deployment": "no-such-deployment"} if path in STREAM_PATHS else None
    return await http.request(method, path, json=body, headers=headers, params=params)


@dataclass
class Secured:
    """The API with operator tokens on, and a token of each role."""

    app: FastAPI
    http: httpx.AsyncClient
    store: Store
    tokens: TokensStore
    admin: str
    admin_record: OperatorTokenRecord
    viewer: str


@pytest.fixture
async def secured(local_temporal_env: WorkflowEnvironment,
                  database_url: str) -> AsyncIterator[Secured]:
    client = local_temporal_env.client
    app = create_app(Settings(database_url=database_url,
                              temporal_address=client.service_client.config.target_host,
                              temporal_namespace=client.namespace,
                              api_allowed_hosts=["api.example"]))
    assert app.state.settings.api_auth  # the default: on
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        store: Store = app.state.store
        tokens = store.tokens
        admin_record, admin = await tokens.create_token("alice", OperatorRole.ADMIN)
        _, viewer = await tokens.create_token("victor", OperatorRole.VIEWER)
        yield Secured(app, http, store, tokens, admin, admin_record, viewer)


async def test_every_operator_route_refuses_a_request_without_a_valid_token(
        secured: Secured) -> None:
    calls = operator_calls(secured.app)
    assert len(calls) >= MIN_OPERATOR_CALLS, calls
    refused = []
    for method, path in calls:
        for token in (None, "mko-forged", secured.admin + "x", hash_key(secured.admin)):
            resp = await send(secured.http, method, path, token)
            assert resp.status_code == 401, (method, path, token, resp.text)
            assert "operator token" in resp.json()["detail"]
            assert resp.headers["www-authenticate"] == "Bearer"
            refused.append((method, path))
    print(f"\nno valid token: {len(refused)} tried, {len(refused)} refused (401), "
          f"{len(calls)} operator routes")
    assert (await secured.http.get("/healthz")).status_code in (200, 503)
    assert await secured.store.events.list_events() == []  # nothing got through to record


async def test_a_viewer_reads_but_every_write_is_refused(secured: Secured) -> None:
    assert (await secured.http.post("/models", json=SIM, headers={
        "Authorization": f"Bearer {secured.admin}"})).status_code == 201
    before = await secured.store.events.list_events()
    reads = writes = 0
    for method, path in operator_calls(secured.app):
        resp = await send(secured.http, method, path, secured.viewer)
        if (method, path) in ADMIN_READS:
            assert resp.status_code == 403, (method, path, resp.text)
            assert "needs an admin token" in resp.json()["detail"]
        elif method in READ_METHODS:
            reads += 1
            assert resp.status_code not in (401, 403), (method, path, resp.text)
            assert resp.status_code < 500, (method, path, resp.text)
        else:
            writes += 1
            assert resp.status_code == 403, (method, path, resp.text)
            detail = resp.json()["detail"]
            assert "'victor'" in detail and "viewer" in detail and "admin" in detail, detail
    print(f"\nviewer: {reads} reads allowed; {writes} writes tried, {writes} refused (403)")
    assert writes and reads
    # Refused means refused: the catalog and the history are as they were.
    viewer = {"Authorization": f"Bearer {secured.viewer}"}
    assert [m["model_id"] for m in
            (await secured.http.get("/models", headers=viewer)).json()] == ["sim-a"]
    assert await secured.store.events.list_events() == before


async def test_an_admin_passes_every_route(secured: Secured) -> None:
    tried = 0
    for method, path in operator_calls(secured.app):
        resp = await send(secured.http, method, path, secured.admin)
        tried += 1
        # Dummy ids and empty bodies: a 404 or a 422 each, never a refusal or a crash.
        assert resp.status_code not in (401, 403), (method, path, resp.text)
        assert resp.status_code < 500, (method, path, resp.text)
    print(f"\nadmin: {tried} tried, 0 refused")


async def test_a_revoked_token_stops_working_at_once(secured: Secured) -> None:
    admin = {"Authorization": f"Bearer {secured.admin}"}
    assert (await secured.http.get("/deployments", headers=admin)).status_code == 200
    [revoked] = await secured.tokens.revoke_tokens(secured.admin_record.prefix)
    assert revoked.token_id == secured.admin_record.token_id
    resp = await secured.http.get("/deployments", headers=admin)
    assert resp.status_code == 401 and "unknown or revoked" in resp.json()["detail"]
    resp = await secured.http.post("/models", json=SIM, headers=admin)
    assert resp.status_code == 401
    assert await secured.tokens.revoke_tokens(secured.admin_record.token_id) == []


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:8400", "localhost.evil.example", "127.0.0.1.nip.io",
    "[::2]:8400", "0.0.0.0:8400", "api.example.evil",
])
async def test_a_hostile_host_header_is_refused_on_every_router(
        secured: Secured, host: str) -> None:
    admin = {"Authorization": f"Bearer {secured.admin}"}
    for method, path in [("GET", "/healthz"), ("GET", "/deployments"), ("POST", "/models"),
                         ("POST", "/nodes/register"), ("POST", "/nodes/n1/heartbeat"),
                         ("GET", "/openapi.json")]:
        resp = await secured.http.request(method, path, json=SIM if method == "POST" else None,
                                          headers={**admin, "Host": host})
        assert resp.status_code == 400, (method, path, resp.text)
        assert repr(host) in resp.json()["detail"], resp.text
        assert "MODELKEEPER_API_ALLOWED_HOSTS" in resp.json()["detail"]
    assert await secured.store.catalog.list_models() == []


@pytest.mark.parametrize("host", [
    "localhost", "localhost:8400", "127.0.0.1:8400", "[::1]:8400", "API.example",
    "api.example:443",
])
async def test_the_allowed_hosts_are_answered(secured: Secured, host: str) -> None:
    resp = await secured.http.get("/deployments", headers={
        "Authorization": f"Bearer {secured.viewer}", "Host": host})
    assert resp.status_code == 200, resp.text


def test_the_allowed_hosts_are_loopback_the_bind_host_and_the_operators() -> None:
    assert auth.allowed_hosts(Settings()) == {"localhost", "127.0.0.1", "::1"}
    assert auth.allowed_hosts(Settings(bind_host="0.0.0.0")) == {
        "localhost", "127.0.0.1", "::1"}
    assert auth.allowed_hosts(Settings(bind_host="::")) == {"localhost", "127.0.0.1", "::1"}
    assert auth.allowed_hosts(Settings(bind_host="10.0.0.5",
                                       api_allowed_hosts="Gpu-Api.lan, api.example")) == {
        "localhost", "127.0.0.1", "::1", "10.0.0.5", "gpu-api.lan", "api.example"}
    assert [auth.host_name(h) for h in ("LOCALHOST:1", "[::1]:80", "::1", "a.b", "", None)] \
        == ["localhost", "::1", "::1", "a.b", None, None]


def test_a_wildcard_bound_api_answers_to_an_address_the_machine_gained_after_start() -> None:
    """An interface added after start (docs/first-hour.md's veth) is answered within the
    re-read period; a name never is, and a flood of unknown addresses reads the
    interfaces once per period."""
    now = [0.0]
    addresses = [frozenset({"10.0.0.5"})]
    reads = []

    def read() -> frozenset[str]:
        reads.append(now[0])
        return addresses[0]

    own = auth.OwnAddresses(read, ttl_s=2.0, clock=lambda: now[0])
    assert "10.0.0.5" in own and "10.77.0.1" not in own
    addresses[0] = frozenset({"10.0.0.5", "10.77.0.1"})  # the veth comes up
    for _ in range(1000):  # a flood of unknown Hosts within the period: no read
        assert "10.9.9.9" not in own
    assert "10.77.0.1" not in own and len(reads) == 1
    now[0] = 2.0
    assert "10.77.0.1" in own and len(reads) == 2
    assert "10.77.0.1" in own and len(reads) == 2  # known: no read at all
    # A name is never looked up: a page that rebinds a name sends the name.
    addresses[0] = frozenset({"evil.example"})
    now[0] = 10.0
    assert "evil.example" not in own and len(reads) == 2


async def test_a_token_is_stored_hashed_and_found_by_its_hash(
        secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time: the secret is never compared, in Python or in SQL. The API hashes
    what it is sent and looks the hash up (an index on a SHA-256), so how long a refusal
    takes depends on the hash, which says nothing an attacker can use about the token."""
    rows = await secured.store._pool.fetch("SELECT * FROM operator_tokens")
    stored = [str(v) for row in rows for v in row.values()]
    assert secured.admin not in stored and secured.viewer not in stored
    assert hash_key(secured.admin) in stored

    sent: list[Any] = []
    real = asyncpg.pool.Pool.fetchrow

    async def spy(pool: asyncpg.Pool, query: str, *args: Any, **kw: Any) -> Any:
        sent.extend(args)
        return await real(pool, query, *args, **kw)

    monkeypatch.setattr(asyncpg.pool.Pool, "fetchrow", spy)
    for token in (secured.admin, "mko-forged"):
        await secured.http.get("/deployments", headers={"Authorization": f"Bearer {token}"})
        assert hash_key(token) in sent and token not in sent


async def test_each_change_records_its_actor(secured: Secured) -> None:
    admin = {"Authorization": f"Bearer {secured.admin}"}
    http = secured.http
    await secured.store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                            cpu_count=8)))
    for model in (SIM, {**SIM, "model_id": "sim-b"}):
        assert (await http.post("/models", json=model, headers=admin)).status_code == 201
    assert (await http.delete("/models/sim-b", headers=admin)).status_code == 204
    created = await http.post("/deployments", json={"model_id": "sim-a"}, headers=admin)
    assert created.status_code == 201, created.text
    deployment = created.json()["deployment_id"]
    assert (await http.patch("/nodes/n1", json={"cordoned": True, "cordon_reason": "disk"},
                             headers=admin)).status_code == 200
    started = await http.post(f"/deployments/{deployment}/restart", headers=admin)
    assert started.status_code == 202, started.text
    assert started.json()["requested_by"] == "alice"
    operation = started.json()["operation_id"]
    cancelled = await http.post(f"/operations/{operation}/cancel", headers=admin)
    assert cancelled.status_code == 202, cancelled.text
    assert (await http.delete(f"/deployments/{deployment}", headers=admin)).status_code == 202

    events = (await http.get("/events", headers={
        "Authorization": f"Bearer {secured.viewer}"})).json()
    by_alice = [(e["kind"], e["deployment_id"], e["node_id"]) for e in events
                if e["actor"] == "alice"]
    assert by_alice == [
        ("model.added", None, None), ("model.added", None, None),
        ("model.removed", None, None), ("deployment.created", deployment, None),
        ("node.updated", None, "n1"), ("operation.started", deployment, None),
        ("operation.cancel_requested", deployment, None),
        ("deployment.delete_requested", deployment, None)]
    assert {e["actor"] for e in events} == {"alice"}
    assert (await secured.store.events.list_events())[-1].actor == "alice"


def test_the_roles_decide_by_method_alone() -> None:
    for method in ("GET", "HEAD", "get"):
        assert refusal(OperatorRole.VIEWER, method) is None
    for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"):
        assert refusal(OperatorRole.ADMIN, method) is None
        assert f"{method} needs an admin token" in (refusal(OperatorRole.VIEWER, method) or "")
    assert name_problem("alice@laptop") is None
    assert name_problem("a" * 64) is None
    for bad in ("", "a b", "a" * 65, "x\n", "ops;drop"):
        assert repr(bad)[:10] in (name_problem(bad) or ""), bad
