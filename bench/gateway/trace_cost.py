"""What tracing adds to one gateway request, in CPU, measured in process: the gateway's
own tracing wrappers (:mod:`gateway.tracing`) around stand-ins that do nothing, so that
only tracing's work is timed, not the noise of a shared machine's HTTP round trips.

Three ways, each over many requests in one event loop, timed with the process's CPU
clock (which counts the exporter's thread too):

* plain: the stand-ins alone, as the gateway binds them with tracing off;
* untraced: tracing on, a request not drawn for a trace (the header scan, the draw, the
  lookups of whether the current span records);
* traced: tracing on, a streamed request traced (five spans made, batched, encoded and
  posted to ``sink_url``).

``run.py --traces`` runs it beside the end-to-end rounds; alone::

    python -m bench.gateway.trace_cost --sink http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway import tracing as gateway_tracing
from gateway.forwarding import Replied
from modelkeeper.infra import tracing
from modelkeeper.settings import Settings

SCOPE: dict[str, Any] = {
    "type": "http", "path": "/v1/chat/completions", "method": "POST",
    "headers": [(b"host", b"127.0.0.1:8401"), (b"content-type", b"application/json"),
                (b"authorization", b"Bearer sk-test"), (b"user-agent", b"bench"),
                (b"content-length", b"120"), (b"accept", b"*/*")]}


@dataclass(frozen=True)
class Costs:
    """CPU per request, in microseconds."""

    plain_us: float
    untraced_us: float
    traced_us: float

    def at(self, ratio: float) -> float:
        """What tracing adds to a request, on average, at ``ratio``."""
        return (1 - ratio) * (self.untraced_us - self.plain_us) + ratio * (
            self.traced_us - self.plain_us)


class _Endpoint:
    replica_id = "bench-r1"
    model = "bench-model"
    url = "http://127.0.0.1:1"
    headers: dict[str, str] = {"Authorization": "Bearer engine-key"}


class _Route:
    model_id = "bench-model"


class _Entry:
    route = _Route()


async def _noop_send(message: Any) -> None:
    return None


async def _noop_receive() -> Any:
    return {"type": "http.request", "body": b""}


def _chain(traced: bool, ratio: float) -> Any:
    """The ASGI callable of one request's path, with tracing's wrappers where the gateway
    binds them when ``traced``."""
    endpoint = _Endpoint()
    # Stand-ins with only what the wrappers read, typed as what they stand in for.
    entry: Any = _Entry()

    async def post(url: str, body: bytes, headers: dict[str, str]) -> Any:
        return headers

    send_post = gateway_tracing.posting_traceparent(post) if traced else post

    async def attempt(endpoint: Any, path: str, body: bytes, *, send: Any,
                      started: float) -> Replied:
        await send_post(endpoint.url + path, body, endpoint.headers)
        if traced and tracing.ON:
            gateway_tracing.first_token()
        return Replied(200)

    attempt_fn = gateway_tracing.traced_attempt(attempt) if traced else attempt

    async def route(path: str, body: bytes, entry: Any, send: Any, started: float) -> int:
        outcome = await attempt_fn(endpoint, path, body, send=send, started=started)
        assert isinstance(outcome, Replied)
        return outcome.status

    route_fn = gateway_tracing.traced_route(route) if traced else route

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await route_fn(scope["path"], b"{}", entry, send, time.perf_counter())

    return gateway_tracing.traced_app(app, ratio=ratio) if traced else app


async def _per_request_us(app: Any, requests: int) -> float:
    for _ in range(200):  # warm up
        await app(SCOPE, _noop_receive, _noop_send)
    started = time.process_time()
    for _ in range(requests):
        await app(SCOPE, _noop_receive, _noop_send)
    return (time.process_time() - started) / requests * 1e6


async def measure(sink_url: str, *, requests: int = 20_000) -> Costs:
    """CPU per request of the three ways, tracing exporting to ``sink_url``."""
    plain = await _per_request_us(_chain(False, 0.0), requests)
    tracing.setup(Settings(otlp_endpoint=sink_url), service="modelkeeper-gateway")
    try:
        untraced = await _per_request_us(_chain(True, 0.0), requests)
        started = time.process_time()
        app = _chain(True, 1.0)
        traced_requests = requests // 10
        for _ in range(traced_requests):
            await app(SCOPE, _noop_receive, _noop_send)
        # The export of what is left, inside the timing: it is part of the cost.
        tracing.shutdown()
        traced = (time.process_time() - started) / traced_requests * 1e6
    finally:
        tracing.shutdown()
    return Costs(plain, untraced, traced)


def render(costs: Costs, *, gateway_cpu_us: float) -> str:
    """The in-process figures as markdown, against the gateway's CPU per request."""
    lines = [
        "## In process: tracing's own CPU per request",
        "",
        "Tracing's wrappers around stand-ins that do nothing (bench/gateway/trace_cost.py), "
        "timed on the process's CPU clock, exporter thread included: what tracing adds "
        "whatever the machine's noise.",
        "",
        "| | CPU per request | added |",
        "|---|---|---|",
        f"| plain (tracing off: the plain methods) | {costs.plain_us:.1f} µs | - |",
        f"| on, request not drawn | {costs.untraced_us:.1f} µs | "
        f"{costs.untraced_us - costs.plain_us:+.1f} µs |",
        f"| on, request traced (streamed: five spans, exported) | {costs.traced_us:.1f} µs "
        f"| {costs.traced_us - costs.plain_us:+.1f} µs |",
        "",
        f"Against the gateway's CPU per request with tracing off in the rounds above "
        f"({gateway_cpu_us:,.0f} µs, the mean): on as it comes (1 in 100 traced) adds "
        f"{costs.at(0.01):.1f} µs a request, **{costs.at(0.01) / gateway_cpu_us:.1%}**; "
        f"1 in 10 would add {costs.at(0.1) / gateway_cpu_us:.1%}, every request "
        f"{costs.at(1.0) / gateway_cpu_us:.1%}. Throughput follows the CPU per request while "
        "the gateway is CPU-bound, as it is at its maximum.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway.trace_cost")
    parser.add_argument("--sink", required=True, help="an OTLP/HTTP collector's base URL")
    parser.add_argument("--gateway-cpu-us", type=float, default=230.0,
                        help="the gateway's CPU per request to compare with (default 230, "
                        "bench/results/gateway.md)")
    args = parser.parse_args(argv)
    costs = asyncio.run(measure(args.sink))
    print(render(costs, gateway_cpu_us=args.gateway_cpu_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
