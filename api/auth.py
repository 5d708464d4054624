"""Who may call the API, and by which name.

* :func:`require_operator`: the dependency ``create_app`` puts on the operators' routers
  (nodes, deployments, operations, and monitoring but ``/healthz``). A bearer operator
  token (``modelkeeper tokens create``), looked up by its hash; ``viewer`` reads, ``admin``
  also changes (:func:`modelkeeper.domain.operators.refusal` decides). 401 without a valid
  token, 403 for a viewer that writes, each saying what is needed. The agents' routes are
  not the operators': agents authenticate as nodes.

  A token bound to a scope of the tenancy tree (``tokens create --scope``) changes only
  the deployments owned there (:func:`modelkeeper.domain.operators.scope_refusal`): a
  change under ``/deployments/{id}`` is refused with a 403 naming the scope unless that
  deployment's owner is within it; ``POST /deployments`` is judged by the route, on the
  owner it asks for; any other change (nodes, models, quotas, operations) is refused.
* :class:`HostAllowlist`: middleware on the whole app, agents' routes included. A request
  whose ``Host`` is not a name the API is reached by gets a 400 naming it. A web page on
  a name its owner points at 127.0.0.1 (DNS rebinding) sends its own name, so the
  browser cannot be used to reach the API on loopback. The rule is
  :mod:`modelkeeper.infra.hosts`, which the gateway shares (its names are re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId, NodeId
from modelkeeper.domain.operators import (
    READ_METHODS,
    Operator,
    OperatorRole,
    refusal,
    scope_refusal,
    unscoped_refusal,
)
from modelkeeper.infra import hosts
from modelkeeper.infra.hosts import ANY_HOST as ANY_HOST
from modelkeeper.infra.hosts import LOOPBACK_HOSTS as LOOPBACK_HOSTS
from modelkeeper.infra.hosts import OwnAddresses as OwnAddresses
from modelkeeper.infra.hosts import host_allowed
from modelkeeper.infra.hosts import host_name as host_name
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from .deps import SettingsDep, StoreDep

#: The actor of changes while ``api_auth`` is off: no token names anyone. It is what
#: operations carried as ``requested_by`` before there were tokens.
UNAUTHENTICATED_ACTOR = "api"

#: Reads the header and documents the scheme in OpenAPI (the docs' Authorize button);
#: the refusal is :func:`require_operator`'s, which says what is needed.
_BEARER = HTTPBearer(auto_error=False, description="An operator token: "
                     "`modelkeeper tokens create NAME --role viewer|admin`.")

_NEEDS_TOKEN = ("send one as `Authorization: Bearer <token>`. `modelkeeper tokens create "
                "NAME --role viewer` (reads) or `--role admin` (changes) makes one; the CLI "
                "sends MODELKEEPER_TOKEN or the file MODELKEEPER_TOKEN_FILE (default "
                "<data_dir>/operator-token, which `up` writes)")

#: Where :class:`OperatorsFirst` leaves the operator it found, in the request's state.
_OPERATOR_STATE = "modelkeeper_operator"

#: What a refusal answers, documented on every operator route (``create_app``).
AUTH_RESPONSES: dict[int | str, dict[str, str]] = {
    401: {"description": "No operator token, or one unknown or revoked."},
    403: {"description": "A viewer token on a route that changes something, or a token "
                         "bound to a scope changing what is not that scope's."},
}


async def authenticate_operator(*, store: Store, settings: Settings, method: str, path: str,
                                authorization: str | None) -> Operator:
    """The operator an ``Authorization`` header names, allowed ``method``; else an
    HTTPException, 401 or 403, saying what is needed."""
    if not settings.api_auth:
        return Operator(name=UNAUTHENTICATED_ACTOR, role=OperatorRole.ADMIN)
    scheme, token = get_authorization_scheme_param(authorization)
    if not token or scheme.lower() != "bearer":
        raise HTTPException(401, f"{method} {path} needs an operator "
                                 f"token, and none was sent; {_NEEDS_TOKEN}",
                            headers={"WWW-Authenticate": "Bearer"})
    record = await store.tokens.authenticate(token)
    if record is None:
        raise HTTPException(401, "the bearer token sent is not an active operator token "
                                 "(unknown or revoked: `modelkeeper tokens ls` lists them); "
                                 + _NEEDS_TOKEN, headers={"WWW-Authenticate": "Bearer"})
    why = refusal(record.role, method)
    if why is not None:
        raise HTTPException(403, f"token {record.name!r} ({record.token_id}) cannot "
                                 f"{method} {path}: {why}")
    if record.scope is not None and method.upper() not in READ_METHODS:
        why = await _outside_scope(store, record.scope, method=method, path=path)
        if why is not None:
            raise HTTPException(403, f"token {record.name!r} ({record.token_id}) cannot "
                                     f"{method} {path}: {why}")
    return Operator(name=record.name, role=record.role, scope=record.scope)


#: The path of every change to one deployment: ``/deployments/{id}`` and what is beneath.
_DEPLOYMENTS_PREFIX = "/deployments/"


async def _outside_scope(store: Store, scope: str, *, method: str, path: str) -> str | None:
    """Why a token bound to ``scope`` may not send this change; None when it may (or
    when the route is to judge: a create, by the owner it asks for; an unknown
    deployment, by its 404)."""
    if path.rstrip("/") == "/deployments":
        return None
    if not path.startswith(_DEPLOYMENTS_PREFIX):
        return unscoped_refusal(scope, f"{method} {path}")
    deployment_id = path.removeprefix(_DEPLOYMENTS_PREFIX).split("/", 1)[0]
    view = await store.deployments.get_deployment(deployment_id)
    if view is None:
        return None
    return scope_refusal(scope, view.owner, f"deployment {deployment_id}")


async def require_operator(
    request: Request, store: StoreDep, settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> Operator:
    """The operator behind the request, allowed its method; else a 401 or a 403. Found by
    :class:`OperatorsFirst` already, before anything of the request was read; looked up
    here only where that middleware is not installed."""
    found = request.scope.get("state", {}).get(_OPERATOR_STATE)
    if isinstance(found, Operator):
        return found
    authorization = (None if credentials is None
                     else f"{credentials.scheme} {credentials.credentials}")
    return await authenticate_operator(store=store, settings=settings, method=request.method,
                                       path=request.url.path, authorization=authorization)


#: The operator calling a route: its name is the actor of the change it records. The same
#: dependency as the routers', so FastAPI runs it once per request.
OperatorDep = Annotated[Operator, Depends(require_operator)]


def change(operator: Operator, kind: str, message: str, *,
           deployment_id: DeploymentId | None = None, node_id: NodeId | None = None,
           data: dict[str, Any] | None = None) -> NewEvent:
    """The audit-log entry of a change ``operator`` made, naming them as its actor."""
    return NewEvent(kind=kind, message=message, actor=operator.name,
                    deployment_id=deployment_id, node_id=node_id, data=data or {})


def allowed_hosts(settings: Settings) -> frozenset[str]:
    """The names the API answers to: loopback, the bind host unless it is a wildcard, and
    ``api_allowed_hosts`` (the rule is :mod:`modelkeeper.infra.hosts`, the gateway's too)."""
    return hosts.allowed_hosts(settings.bind_host, settings.api_allowed_hosts)


class HostAllowlist:
    """ASGI middleware: a 400 naming the host for a request sent to another name."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str],
                 own_addresses: OwnAddresses | None = None) -> None:
        """``own_addresses``: also answer to this machine's current addresses (a
        wildcard bind); None: only to ``allowed``."""
        self.app = app
        self.allowed = allowed
        self.own_addresses = own_addresses

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or ANY_HOST in self.allowed:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("host")
        if host_allowed(header, self.allowed, self.own_addresses):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await WebSocketClose(code=1008)(scope, receive, send)
            return
        sent = f"Host {header!r}" if header else "no Host header"
        own = " and this machine's addresses" if self.own_addresses is not None else ""
        detail = (f"{sent}: this API answers only to {', '.join(sorted(self.allowed))}{own}; "
                  "if clients reach it by another name, add that name to "
                  "MODELKEEPER_API_ALLOWED_HOSTS")
        await JSONResponse({"detail": detail}, status_code=400)(scope, receive, send)


class OperatorsFirst:
    """ASGI middleware: a request for an operator route is authenticated before anything
    of it is read. FastAPI reads and parses a route's body before its dependencies run,
    ``require_operator`` included, so without this a caller with no token could make the
    API hold a body (up to the body limit) before being refused.

    ``routes``: the app's routes in the order they are matched, each with whether it is an
    operator's. The first route that matches the request's path and method decides, as in
    Starlette's router; a request that matches none (a 404 or a 405) is passed on, and
    answered without its body being read. A refusal closes the connection: the body the
    client may still be sending is not read.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[tuple[BaseRoute, bool]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        headers = Headers(scope=scope)
        try:
            operator = await authenticate_operator(
                store=state.store, settings=state.settings, method=scope["method"],
                path=scope["path"], authorization=headers.get("authorization"))
        except HTTPException as refused:
            answer = {**(refused.headers or {})}
            if "content-length" in headers or "transfer-encoding" in headers:
                answer["Connection"] = "close"
            await JSONResponse({"detail": refused.detail}, status_code=refused.status_code,
                               headers=answer)(scope, receive, send)
            return
        scope.setdefault("state", {})[_OPERATOR_STATE] = operator
        await self.app(scope, receive, send)

    def _guarded(self, scope: Scope) -> bool:
        for route, guarded in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return guarded
        return False
