"""The web console (/ui) as an attacker finds it: every page and action without a session,
with a viewer's, with a forged or revoked token; a change without the CSRF token or from
another site's page; and the cookie's attributes. The browser test
(tests/integration/test_console_browser.py) drives the same rules through Chromium.

The console's routes are read off ``app.routes``, so a page or action added later is
tried without anyone listing it here.
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.resources import files

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from api.console import actions, pages
from api.console.render import HTMX_FILE
from api.console.session import COOKIE, CSRF_HEADER, csrf_token
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from tests.security.test_api_auth import api_routes

pytestmark = pytest.mark.timeout(90)

GIB = 1 << 30
ORIGIN = "http://localhost"
#: The vendored htmx, as npm's htmx.org@2.0.11 ships it (api/console/static/README.md).
HTMX_SHA256 = "d6fdc75f204e6bdefa99b69bf1e6d4ac69b8a364f77929f45c13476b4000f717"


@dataclass
class Console:
    app: FastAPI
    http: httpx.AsyncClient
    store: Store
    admin: str
    viewer: str


@pytest.fixture
async def console(local_temporal_env: WorkflowEnvironment,
                  database_url: str) -> AsyncIterator[Console]:
    client = local_temporal_env.client
    app = create_app(Settings(database_url=database_url,
                              temporal_address=client.service_client.config.target_host,
                              temporal_namespace=client.namespace))
    assert app.state.settings.api_auth
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url=ORIGIN) as http:
        store: Store = app.state.store
        _, admin = await store.tokens.create_token("alice", OperatorRole.ADMIN)
        _, viewer = await store.tokens.create_token("victor", OperatorRole.VIEWER)
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId("n1"), name="n1",
            inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                                cpu_count=8)))
        yield Console(app, http, store, admin, viewer)


def console_calls(app: FastAPI, module: str) -> list[tuple[str, str]]:
    """(method, path) of each console route of ``module``, path parameters as ``n1``."""
    calls: list[tuple[str, str]] = []
    for route in api_routes(app.routes):
        if route.endpoint.__module__ != module or not isinstance(route, APIRoute):
            continue
        path = route.path_format.format(**{name: "n1" for name in route.param_convertors})
        calls.extend((method, path) for method in sorted(route.methods or ()))
    return calls


def as_(token: str, *, csrf: bool = True, origin: str | None = ORIGIN) -> dict[str, str]:
    """The headers a console page's htmx sends for a session holding ``token``."""
    headers = {"Cookie": f"{COOKIE}={token}", "HX-Request": "true"}
    if csrf:
        headers[CSRF_HEADER] = csrf_token(token)
    if origin is not None:
        headers["Origin"] = origin
    return headers


async def test_without_a_session_pages_send_to_the_login_and_actions_are_refused(
        console: Console) -> None:
    reads = [c for c in console_calls(console.app, pages.__name__)
             if c[0] == "GET" and c[1] != "/ui/login"]
    changes = console_calls(console.app, actions.__name__)
    assert len(reads) >= 7 and len(changes) >= 8, (reads, changes)
    for token in (None, "mko-forged", console.admin + "x"):
        cookie = {"Cookie": f"{COOKIE}={token}"} if token else {}
        for method, path in reads:
            resp = await console.http.request(method, path, headers=cookie)
            assert resp.status_code == 303, (path, token, resp.text)
            assert resp.headers["location"] == "/ui/login"
            polled = await console.http.request(method, path,
                                                headers={**cookie, "HX-Request": "true"})
            assert polled.status_code == 401 and polled.headers["hx-redirect"] == "/ui/login"
        for method, path in changes:
            resp = await console.http.request(method, path, headers={
                **cookie, "Origin": ORIGIN, CSRF_HEADER: csrf_token(token or "")})
            assert resp.status_code == 401, (path, token, resp.text)
            assert "operator token" in resp.text
    assert await console.store.events.list_events() == []


async def test_a_viewer_reads_every_page_and_every_action_is_refused_with_403(
        console: Console) -> None:
    for method, path in console_calls(console.app, pages.__name__):
        # Not the event stream, which never ends: the browser test follows it.
        if method == "GET" and not path.endswith("/stream"):
            resp = await console.http.get(path, headers=as_(console.viewer))
            assert resp.status_code in (200, 404), (path, resp.text)
    card = await console.http.get("/ui/nodes", headers=as_(console.viewer))
    assert "victor" in card.text and "disabled" in card.text
    for method, path in console_calls(console.app, actions.__name__):
        resp = await console.http.request(method, path, headers=as_(console.viewer),
                                          data={"replicas": "2", "cordoned": "true"})
        assert resp.status_code == 403, (path, resp.text)
        said = html.unescape(resp.text)
        assert "'victor'" in said and "needs an admin token" in said, said
    node = await console.store.nodes.get_node("n1")
    assert node is not None and not node.cordoned
    assert await console.store.events.list_events() == []


async def test_an_admin_change_needs_the_csrf_token_and_this_origin(
        console: Console) -> None:
    cordon = "/ui/nodes/n1/cordon"
    for headers, why in [
        (as_(console.admin, csrf=False), "CSRF"),
        ({**as_(console.admin), CSRF_HEADER: csrf_token(console.viewer)}, "CSRF"),
        (as_(console.admin, origin="http://evil.example"), "evil.example"),
        ({**as_(console.admin), "Sec-Fetch-Site": "cross-site"}, "cross-site"),
    ]:
        resp = await console.http.post(cordon, headers=headers, data={"cordoned": "true"})
        assert resp.status_code == 403 and why in resp.text, resp.text
    assert await console.store.events.list_events() == []
    resp = await console.http.post(cordon, headers=as_(console.admin),
                                   data={"cordoned": "true"})
    assert resp.status_code == 200 and "node n1 is cordoned" in resp.text, resp.text
    node = await console.store.nodes.get_node("n1")
    assert node is not None and node.cordoned
    [event] = await console.store.events.list_events()
    assert event.kind == "node.updated" and event.actor == "alice"


async def test_login_sets_a_strict_httponly_cookie_that_the_json_api_does_not_take(
        console: Console) -> None:
    refused = await console.http.post("/ui/login", data={"token": "mko-forged"})
    assert refused.status_code == 401 and "not an active operator token" in refused.text
    assert COOKIE not in refused.headers.get("set-cookie", "")
    other_site = await console.http.post("/ui/login", data={"token": console.admin},
                                         headers={"Origin": "http://evil.example"})
    assert other_site.status_code == 403
    resp = await console.http.post("/ui/login", data={"token": console.admin})
    assert resp.status_code == 303 and resp.headers["location"] == "/ui"
    cookie = resp.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={console.admin};"), cookie
    attributes = {a.strip().lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/ui"} <= attributes, cookie
    assert "secure" not in attributes  # http here; over https it is Secure
    # The cookie is the console's: the JSON API still wants a bearer token.
    api = await console.http.get("/deployments",
                                 headers={"Cookie": f"{COOKIE}={console.admin}"})
    assert api.status_code == 401
    page = await console.http.get("/ui", headers={"Cookie": f"{COOKIE}={console.admin}"})
    assert page.status_code == 200 and "alice" in page.text


async def test_pages_load_nothing_from_another_site(console: Console) -> None:
    resp = await console.http.get("/ui/deployments", headers=as_(console.admin))
    policy = resp.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "http://" not in resp.text.replace(ORIGIN, "") and "https://" not in resp.text
    htmx = await console.http.get(f"/ui/static/{HTMX_FILE}")
    assert htmx.status_code == 200
    assert hashlib.sha256(htmx.content).hexdigest() == HTMX_SHA256
    shipped = files("api.console") / "static" / HTMX_FILE
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == HTMX_SHA256


async def test_with_auth_off_the_console_needs_no_login_but_still_checks_the_origin(
        api: httpx.AsyncClient) -> None:
    """``api_auth`` off (the ``api`` fixture): everyone is the admin, as on the API; a
    change still needs this origin and the (then public) CSRF token."""
    page = await api.get("/ui/nodes")
    assert page.status_code == 200 and "admin" in page.text
    cordon = "/ui/nodes/n9/cordon"
    resp = await api.post(cordon, headers={"Origin": "http://evil.example",
                                           CSRF_HEADER: csrf_token("")})
    assert resp.status_code == 403
    resp = await api.post(cordon, headers={"Origin": ORIGIN, CSRF_HEADER: csrf_token("")})
    assert resp.status_code == 404 and "not registered" in resp.text, resp.text
