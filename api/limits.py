"""The API's bounds on what clients send, and its answers to malformed requests: request
bodies bounded before any route reads one, 422 answers that can echo any input, and 405
answers that name every method the path has.

FastAPI reads a whole body into memory before it validates it, so without a bound one
request can hold as much of the API's memory as its sender likes. This middleware refuses
a body over :data:`MAX_BODY_BYTES` with a 422 in FastAPI's own error shape, naming the
body's size and the limit: from its Content-Length before anything is read, or, for a
chunked body, as soon as the bytes read pass the limit.

One route is exempt: ``POST /nodes/{node_id}/liveness``, an agent's liveness stream, one
long-lived body by design. Its route reads nothing before it has checked the node's
credential, and then bounds each line itself (``liveness.MAX_LINE_BYTES``). Any other
request, whatever its path ends with, is bounded.

No route may be handed a string the store cannot hold: :func:`refuse_unstorable`, a
dependency of every route, answers a 422 naming the first body field, path or query
parameter holding a NUL or a lone surrogate (PostgreSQL refuses both; a 500 each before).

A 422 echoes the input it refuses, and Python's JSON parser accepts ``NaN`` and
``Infinity``, which FastAPI's own handler then cannot encode (a 500 for ``"cpu_cores":
Infinity``): :func:`validation_error` writes such a number as a string instead.

A path with several routes (GET and DELETE /models/{id}) answers a method it lacks from
whichever route Starlette tried first, whose ``Allow`` names that route's methods only:
:func:`http_error` lists them all, those of the path's most specific template (so
/nodes/register allows POST, not /nodes/{node_id}'s GET). And a body that is not UTF-8
gets FastAPI's 400, while a body that is not JSON gets its 422: :func:`http_error` makes
both the documented 422.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

from fastapi import FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelkeeper.domain.text import printable, unstorable

#: The largest body any route needs is an agent's registration listing its shards (about
#: 200 bytes each, at most ``nodes.MAX_SHARDS_PER_NODE``); 1 MiB holds that several times.
MAX_BODY_BYTES = 1 << 20
#: FastAPI's 400 for a body it could not read as text (json.loads of bytes that are not
#: UTF-8); any other body that is not JSON gets its 422.
FASTAPI_BODY_ERROR = "There was an error parsing the body"
_PARAMETER = re.compile(r"\{[^}]*\}")


def install(app: FastAPI, *, streams: Sequence[BaseRoute] = ()) -> None:
    """The bounds on ``app``: the body limit (outermost of the middleware added so far),
    sparing the routes in ``streams``, and the 422 handler that can encode any input."""
    app.add_middleware(BodyLimit, streams=streams)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422, with non-finite numbers in it written as strings ("inf", "nan")."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(status_code=422,
                        content={"detail": _finite(jsonable_encoder(exc.errors()))})


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer to an HTTPException; for a 405, with every method of the path."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
        return JSONResponse(status_code=422, content={"detail": [{
            "type": "json_invalid", "loc": ["body"], "input": None,
            "msg": "the body is not JSON: it is not even UTF-8 text"}]})
    if exc.status_code == 405:
        routes = list(_matching(request.app.router.routes, request.scope))
        if routes:
            specific = max(_literal_chars(route.path) for route in routes)
            methods = {method for route in routes if _literal_chars(route.path) == specific
                       for method in route.methods or ()}
            exc = HTTPException(405, exc.detail, headers={"Allow": ", ".join(sorted(methods))})
    return await http_exception_handler(request, exc)


def _matching(routes: Iterable[BaseRoute], scope: Scope) -> Iterator[Route]:
    """Every route whose path matches ``scope``'s, whatever its method, walking into
    included routers (FastAPI keeps each as one entry holding the original router)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _matching(included.routes, scope)
        elif isinstance(route, Route) and route.matches(scope)[0] is not Match.NONE:
            yield route


def _literal_chars(template: str) -> int:
    """How much of a path template is literal: the more, the more specific."""
    return len(_PARAMETER.sub("", template))


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by its name, and every lone surrogate
    by its escape, which JSON (as UTF-8) can carry."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


async def refuse_unstorable(request: Request) -> None:
    """A 422 naming the first path parameter, query parameter or body field whose string
    the store cannot hold (a NUL, a lone surrogate): the dependency of every route, run
    before any route reads its parameters. Query parameters the route does not take are
    not looked at (nothing reads them); nor is a body the route does not take (the
    liveness stream's is read by its route, line by line)."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    taken = _query_names(route.dependant)
    body = await _body_json(request) if route.body_field is not None else None
    found = next(chain(
        unstorable(dict(request.path_params), ("path",)),
        *(unstorable(value, ("query", name))
          for name, value in request.query_params.multi_items() if name in taken),
        unstorable(body, ("body",))), None)
    if found is not None:
        loc, problem, text = found
        where = ".".join(printable(str(part)) for part in loc)
        raise RequestValidationError([{"type": "string_unstorable", "loc": loc,
                                       "input": printable(text), "msg": f"{where} {problem}"}])


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route takes, its dependencies' included."""
    names = {param.alias for param in dependant.query_params}
    for dependency in dependant.dependencies:
        names |= _query_names(dependency)
    return names


async def _body_json(request: Request) -> Any:
    """The body as JSON, as FastAPI has already parsed it (Starlette keeps it); None for a
    body that is not JSON, which the route's own validation refuses."""
    try:
        return await request.json()
    except ValueError:
        return None


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 422 and never reaches a
    route, but for a request of a route in ``streams``."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, *,
                 streams: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or any(
                route.matches(scope)[0] is Match.FULL for route in self.streams):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(declared, scope, receive, send)
                return
            # The server reads no more than Content-Length says: the bound holds.
            await self.app(scope, receive, send)
            return
        # No length (chunked, or no body at all): read up to the limit, then replay.
        parts: list[bytes] = []
        size = 0
        message: Message = {"type": "http.request", "more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left; the route sees the disconnect itself
            part: bytes = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                await self._refuse(size, scope, receive, send, at_least=True)
                return
            parts.append(part)
        buffered: Message = {"type": "http.request", "body": b"".join(parts),
                             "more_body": False}
        if message["type"] != "http.request":
            buffered = message
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return buffered

        await self.app(scope, replay, send)

    async def _refuse(self, size: int, scope: Scope, receive: Receive, send: Send, *,
                      at_least: bool = False) -> None:
        more = "more than " if at_least else ""
        response = JSONResponse(status_code=422, content={"detail": [{
            "type": "too_long", "loc": ["body"], "input": None,
            "msg": f"the request body is {more}{size} bytes; the limit is "
                   f"{self.max_bytes} bytes",
            "ctx": {"max_length": self.max_bytes}}]},
            # The rest of the body is not read: the connection cannot carry another request.
            headers={"Connection": "close"})
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The request's Content-Length; None when absent. The HTTP server has refused a
    malformed one already."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
