"""The gateway's spans, while tracing is on (:mod:`modelkeeper.infra.tracing`).

A completion request is one SERVER span, ``POST /v1/chat/completions`` (continuing the
client's W3C ``traceparent`` when it sends one), with these children:

* ``admission``: from the request's arrival until routing starts (the key, reading and
  parsing the body, the bounds on its output), recorded when routing starts;
* ``routing``: picking a replica, any hold, and every attempt;
* ``upstream`` (CLIENT), one per attempt: the request to one replica, sent with a
  ``traceparent`` naming this span, so an engine that traces continues the trace;
* ``first token``: from the attempt's send to the first event of a streamed answer.

**Sampled.** Tracing every request costs the gateway about twice its CPU per request
(five spans made, batched, encoded and posted: bench/results/traces.md), so a request
that comes without a ``traceparent`` is traced with the chance ``gateway_trace_ratio``
(1 % by default), decided before any span is made; one whose client sent a sampled
``traceparent`` is always traced, and one sent unsampled never. The parts below check
whether the current span records (a context lookup) and otherwise run untraced: an
untraced request costs a look at its headers, one random number and three lookups, and
sends the engine no ``traceparent``.

Off, none of this runs: the app, the router and the forwarder bind their plain methods
when they are built (checking :data:`modelkeeper.infra.tracing.ON` once), and a stream
checks the flag once, at its first event. No span object, context or header is made.
Requests refused before a completion is admitted (the Host, the key, the content type)
are traced as the request span alone; the other routes (``/v1/models``, ``/metrics``,
``/healthz``) are not traced.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from modelkeeper.infra import tracing

from .admission import COMPLETION_PATHS
from .asgi import Message, Receive, Scope, Send
from .forwarding import Outcome, Replied

if TYPE_CHECKING:
    import aiohttp

    from .table import Endpoint, ModelRoute

_PROPAGATOR = TraceContextTextMapPropagator()
#: The request headers a client's trace comes in (W3C Trace Context).
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})

App = Callable[[Scope, Receive, Send], Awaitable[None]]
Route = Callable[[str, bytes, "ModelRoute", Send, float], Awaitable[int]]
Attempt = Callable[..., Awaitable[Outcome]]
Post = Callable[[str, bytes, dict[str, str]], Awaitable["aiohttp.ClientResponse"]]


def _tracer() -> trace.Tracer:
    return tracing.tracer("modelkeeper.gateway")


def _epoch_ns(perf_counter_s: float) -> int:
    """A ``time.perf_counter()`` reading (the gateway's request clock) as the span clock's
    epoch nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)


def _recording() -> bool:
    """Whether the request being served is traced (a span of it is current and records)."""
    return trace.get_current_span().is_recording()


def traced_app(app: App, *, ratio: float) -> App:
    """``app`` with a SERVER span around each completion request that is traced: one in
    ``ratio`` of those without a ``traceparent``, and those whose client sent one."""
    tracer = _tracer()
    draw = random.random

    async def traced(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in COMPLETION_PATHS:
            await app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"] if name in TRACE_HEADERS}
        if not carrier and draw() >= ratio:
            await app(scope, receive, send)
            return
        path: str = scope["path"]
        with tracer.start_as_current_span(
                f"{scope['method']} {path}", context=_PROPAGATOR.extract(carrier),
                kind=SpanKind.SERVER,
                attributes={"http.request.method": scope["method"], "url.path": path}) as span:

            async def send_noting_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status: int = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await app(scope, receive, send_noting_status)

    return traced


def traced_route(route: Route) -> Route:
    """``route`` (:meth:`gateway.routing.Router.route`) as the ``routing`` span, after an
    ``admission`` span for the time the request took to get there."""
    tracer = _tracer()

    async def traced(path: str, body: bytes, entry: ModelRoute, send: Send,
                     started: float) -> int:
        if not _recording():
            return await route(path, body, entry, send, started)
        model = entry.route.model_id
        tracer.start_span("admission", start_time=_epoch_ns(started),
                          attributes={"gen_ai.request.model": model}).end()
        with tracer.start_as_current_span(
                "routing", attributes={"gen_ai.request.model": model}) as span:
            status = await route(path, body, entry, send, started)
            span.set_attribute("http.response.status_code", status)
            return status

    return traced


def traced_attempt(attempt: Attempt) -> Attempt:
    """``attempt`` (:meth:`gateway.forwarding.Forwarder.attempt`) as an ``upstream``
    span, current while the request goes to the engine (:func:`posting_traceparent`)."""
    tracer = _tracer()

    async def traced(endpoint: Endpoint, path: str, body: bytes, *, send: Send,
                     started: float) -> Outcome:
        if not _recording():
            return await attempt(endpoint, path, body, send=send, started=started)
        with tracer.start_as_current_span(
                "upstream", kind=SpanKind.CLIENT,
                attributes={"modelkeeper.replica_id": endpoint.replica_id,
                            "gen_ai.request.model": endpoint.model,
                            "server.address": endpoint.url, "url.path": path}) as span:
            outcome = await attempt(endpoint, path, body, send=send, started=started)
            if isinstance(outcome, Replied):
                span.set_attribute("http.response.status_code", outcome.status)
                if outcome.status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            else:
                span.set_status(Status(StatusCode.ERROR, "retried elsewhere"))
            return outcome

    return traced


def posting_traceparent(post: Post) -> Post:
    """``post`` sending the current span's ``traceparent`` (and ``tracestate``) to the
    engine beside the replica's own headers, which stay as they are."""

    def traced(url: str, body: bytes,
               headers: dict[str, str]) -> Awaitable[aiohttp.ClientResponse]:
        if not _recording():
            return post(url, body, headers)
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return post(url, body, {**headers, **carrier} if carrier else headers)

    return traced


def first_token() -> None:
    """The first event of a streamed answer arrived: a ``first token`` span from the
    current (``upstream``) span's start until now."""
    parent = trace.get_current_span()
    if not parent.is_recording():
        return
    start: Any = getattr(parent, "start_time", None)
    _tracer().start_span("first token", start_time=start if isinstance(start, int) else None,
                         context=otel_context.get_current()).end()
