"""A span per API request, while tracing is on (:mod:`modelkeeper.infra.tracing`).

Outermost of the API's middleware, so the span covers the Host and token checks too. It
continues a caller's W3C ``traceparent`` when one is sent, and is the current span while
the route runs: a workflow the route starts (``POST /deployments``) continues the trace
through the Temporal client's interceptor. Named by method and route template
(``POST /deployments``, ``GET /deployments/{deployment_id}``), never by the raw path,
whose ids would make a name per deployment.

Not installed at all while tracing is off (:func:`install`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelkeeper.infra import tracing

#: The request headers a caller's trace comes in (W3C Trace Context).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestSpans:
    """ASGI middleware: one SERVER span per HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._tracer = tracing.tracer("modelkeeper.api")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"] if name in TRACE_HEADERS}
        method: str = scope["method"]
        attributes: dict[str, Any] = {"http.request.method": method,
                                      "url.path": scope["path"]}
        with self._tracer.start_as_current_span(
                method, context=_PROPAGATOR.extract(carrier), kind=SpanKind.SERVER,
                attributes=attributes) as span:

            async def send_noting_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status: int = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, send_noting_status)
            finally:
                # Set by the router once it matched (FastAPI's and Starlette's routes).
                route = scope.get("route")
                template = getattr(route, "path", None)
                if isinstance(template, str):
                    span.update_name(f"{method} {template}")
                    span.set_attribute("http.route", template)


def install(app: FastAPI) -> None:
    """Trace the app's requests, when this process traces; otherwise add nothing."""
    if tracing.ON:
        app.add_middleware(RequestSpans)
