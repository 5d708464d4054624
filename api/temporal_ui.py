"""The door to the Temporal web UI under `up`: the API's Host allowlist and an operator login.

The dev server's UI answers every Host, has no login, and its own ``/api/v1`` can list
every history and terminate any workflow. A web page that rebinds its name to 127.0.0.1
is same-origin with it, reads its CSRF cookie and sends it back. So `up` runs that UI on a
hidden loopback address (cli.temporal_server.hidden_ui_listener) and
this proxy on the documented port, which, in order:

1. refuses a request whose Host is not one the API answers to (auth.HostAllowlist, the
   same list): a rebinding page sends its own name, and gets a 400;
2. asks for an admin operator token once, on a form, and answers it with a session
   cookie (HttpOnly, SameSite=Strict): a page on another site cannot send it, even to
   an allowed name, and script cannot read it. Admin, because the UI can terminate any
   workflow and has no read-only mode the dev server exposes;
3. forwards everything else, unchanged, to the hidden UI.

A session lasts SESSION_TTL_S, and its token is checked again at most every
SESSION_RECHECK_S, so a revoked token stops opening the UI within that.
"""

from __future__ import annotations

import html
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import parse_qs

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from modelkeeper.domain.operators import OperatorRole
from modelkeeper.settings import Settings
from modelkeeper.store.tokens import OperatorTokenRecord, TokensStore

from . import auth

log = logging.getLogger(__name__)

#: Our own paths, under a prefix the Temporal UI does not use.
LOGIN_PATH = "/_modelkeeper/login"
SESSION_COOKIE = "modelkeeper_ui_session"
#: A working day: an operator logs in once a day, and a session left on a shared browser
#: ends on its own.
SESSION_TTL_S = 12 * 3600.0
#: How stale a session's view of its token may be: the API refuses a revoked token at the
#: next request; the UI makes dozens a page, so it checks again at most this often.
SESSION_RECHECK_S = 15.0
#: A login form is a few hundred bytes; anything bigger is not one.
MAX_LOGIN_BODY_BYTES = 4096
#: The hidden UI is on loopback: connecting takes nothing, and a UI query that runs longer
#: than this (a full history list) is one to narrow.
UPSTREAM_TIMEOUT_S = 60.0
#: Headers of one hop only (RFC 9110 7.6.1), never forwarded; Host is the upstream's own.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "transfer-encoding",
                         "upgrade", "host"})

@dataclass
class _Session:
    token: str
    expires_at: float
    checked_at: float


class Sessions:
    """Logged-in browsers, in this process's memory: a restart of the proxy asks again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._by_id: dict[str, _Session] = {}

    def open(self, token: str) -> str:
        now = self._clock()
        self._by_id = {k: s for k, s in self._by_id.items() if s.expires_at > now}
        session_id = secrets.token_urlsafe(32)
        self._by_id[session_id] = _Session(token, now + SESSION_TTL_S, now)
        return session_id

    async def valid(self, session_id: str | None, tokens: TokensStore) -> bool:
        """Whether ``session_id`` is a live session whose token is still an admin's."""
        session = self._by_id.get(session_id) if session_id else None
        if session is None or session_id is None:
            return False
        now = self._clock()
        if now >= session.expires_at:
            del self._by_id[session_id]
            return False
        if now - session.checked_at >= SESSION_RECHECK_S:
            if not _is_admin(await tokens.authenticate(session.token)):
                del self._by_id[session_id]
                return False
            session.checked_at = now
        return True


def _is_admin(record: OperatorTokenRecord | None) -> bool:
    return record is not None and record.role is OperatorRole.ADMIN


def _login_page(message: str = "", status_code: int = 200) -> HTMLResponse:
    note = f"<p><strong>{html.escape(message)}</strong></p>" if message else ""
    return HTMLResponse(
        "<!doctype html><html><head><meta charset='utf-8'><title>modelkeeper: Temporal UI"
        "</title></head><body><h1>Temporal UI</h1>"
        "<p>Paste an admin operator token (<code>modelkeeper tokens create NAME --role "
        "admin</code>, or the file <code>up</code> names in its banner).</p>"
        f"{note}<form method='post' action='{LOGIN_PATH}'>"
        "<input type='password' name='token' autocomplete='off' size='60' autofocus> "
        "<button type='submit'>Open</button></form></body></html>",
        status_code=status_code)


def create_app(settings: Settings, upstream: str, *,
               tokens: TokensStore | None = None) -> Starlette:
    """The proxy to the hidden UI at ``upstream``. ``tokens``: a store to check logins
    with (tests); by default one on ``settings.database_url``, opened at start."""
    sessions = Sessions()
    state: dict[str, TokensStore | httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = tokens
        if store is None:
            if not settings.database_url:
                raise RuntimeError("MODELKEEPER_DATABASE_URL is not set: the Temporal UI "
                                   "proxy checks operator tokens in the database")
            store = await TokensStore.connect(settings.database_url)
        async with httpx.AsyncClient(base_url=upstream, timeout=UPSTREAM_TIMEOUT_S) as client:
            state["tokens"], state["client"] = store, client
            try:
                yield
            finally:
                if tokens is None:
                    await store.close()

    def store() -> TokensStore:
        found = state["tokens"]
        assert isinstance(found, TokensStore)
        return found

    async def login_form(request: Request) -> Response:
        return _login_page()

    async def login(request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_LOGIN_BODY_BYTES:
            return _login_page(f"the form is {len(body)} bytes; a login is at most "
                               f"{MAX_LOGIN_BODY_BYTES}", 413)
        token = (parse_qs(body.decode(errors="replace")).get("token") or [""])[0].strip()
        record = await store().authenticate(token) if token else None
        if not _is_admin(record):
            why = ("that token is a viewer's: the Temporal UI can terminate workflows, so it "
                   "needs an admin token" if record is not None
                   else "unknown or revoked token")
            return _login_page(why, 401)
        assert record is not None
        log.info("Temporal UI: %s logged in", record.name)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(SESSION_COOKIE, sessions.open(token), max_age=int(SESSION_TTL_S),
                            path="/", httponly=True, samesite="strict")
        return response

    async def forward(request: Request) -> Response:
        if not await sessions.valid(request.cookies.get(SESSION_COOKIE), store()):
            if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                return RedirectResponse(LOGIN_PATH, status_code=303)
            return JSONResponse({"detail": f"log in to the Temporal UI first: {LOGIN_PATH}"},
                                status_code=401)
        client = state["client"]
        assert isinstance(client, httpx.AsyncClient)
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_HEADERS]
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers,
            content=request.stream())
        answer = await client.send(upstream_request, stream=True)
        response = StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                     background=BackgroundTask(answer.aclose))
        # Raw, so that repeated headers (Set-Cookie) pass as they came.
        response.raw_headers = [(k, v) for k, v in answer.headers.raw
                                if k.decode("latin-1").lower() not in HOP_HEADERS]
        return response

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(
        routes=[Route(LOGIN_PATH, login_form, methods=["GET"]),
                Route(LOGIN_PATH, login, methods=["POST"]),
                Route("/{path:path}", forward, methods=methods)],
        middleware=[Middleware(auth.HostAllowlist, allowed=auth.allowed_hosts(settings))],
        lifespan=lifespan)
