"""The gateway's Prometheus metrics.

With several worker processes, prometheus_client's multiprocess mode (its directory in
``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor before the workers start) sums the
workers' values, so a scrape of any worker sees the whole gateway.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from .breaker import BreakerState

#: Seconds; LLM requests run from milliseconds (cached, short) to minutes (long outputs).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0)

#: The ``model`` label of requests naming no known model: client input must not be
#: allowed to create label values (a stream of typos would grow the series without bound).
UNKNOWN_MODEL = "(unknown)"

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def multiprocess_dir() -> str | None:
    """The multiprocess directory, when the gateway runs as several workers."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class GatewayMetrics:
    """The metric families, in a registry of their own (several gateways may run in one
    process under test)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "modelkeeper_gateway_requests", "Requests answered, by model and HTTP status.",
            ["model", "code"], registry=r)
        self.latency = Histogram(
            "modelkeeper_gateway_request_seconds",
            "Seconds from receiving a request to its last byte, by model.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "modelkeeper_gateway_time_to_first_token_seconds",
            "Seconds from receiving a streamed request to the engine's first chunk, by model.",
            ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.in_flight = Gauge(
            "modelkeeper_gateway_in_flight", "Requests open at each replica.",
            ["model", "replica"], registry=r, multiprocess_mode="livesum")
        self.waiting = Gauge(
            "modelkeeper_gateway_waiting", "Requests waiting for a ready replica, by model.",
            ["model"], registry=r, multiprocess_mode="livesum")
        self.held_for_load = Counter(
            "modelkeeper_gateway_held_for_load",
            "Requests held while their model loaded or woke on demand (none of it ready), "
            "by model: each counted once, whether it was then sent or answered 503 loading.",
            ["model"], registry=r)
        self.upstream_errors = Counter(
            "modelkeeper_gateway_upstream_errors",
            "Failures talking to engines, by replica and kind (connect, reset, timeout, "
            "status_5xx, stream_cut, protocol, reply_too_large, event_too_large).",
            ["replica", "kind"], registry=r)
        self.retries = Counter(
            "modelkeeper_gateway_retries",
            "Requests sent again after a replica failed them before answering (at once, or "
            "after being held for a replica to retry on), by model.",
            ["model"], registry=r)
        self.stale_connections = Counter(
            "modelkeeper_gateway_stale_connections",
            "Requests sent again on a new connection because the pooled one had been closed "
            "by the engine while idle (llama.cpp closes after each streamed response); no "
            "failure of the engine's.", registry=r)
        self.breaker_state = Gauge(
            "modelkeeper_gateway_breaker_state",
            "Each replica's circuit breaker: 0 closed, 1 open, 2 half-open.",
            ["replica"], registry=r, multiprocess_mode="max")

        # Labelled children, cached: ``labels()`` takes a lock and builds tuples, which
        # is measurable at thousands of requests per second.
        self._answered: dict[tuple[str, int], Any] = {}
        self._latency: dict[str, Any] = {}
        self._in_flight: dict[tuple[str, str], Any] = {}

    def answered(self, model: str, code: int, seconds: float) -> None:
        """Count a request answered with ``code`` after ``seconds``."""
        counter = self._answered.get((model, code))
        if counter is None:
            counter = self._answered[model, code] = self.requests.labels(model, str(code))
        counter.inc()
        histogram = self._latency.get(model)
        if histogram is None:
            histogram = self._latency[model] = self.latency.labels(model)
        histogram.observe(seconds)

    def in_flight_of(self, model: str, replica: str) -> Any:
        """The in-flight gauge of one replica."""
        gauge = self._in_flight.get((model, replica))
        if gauge is None:
            gauge = self._in_flight[model, replica] = self.in_flight.labels(model, replica)
        return gauge

    def set_breaker(self, replica: str, state: BreakerState) -> None:
        """Record a breaker's state."""
        self.breaker_state.labels(replica).set(int(state))

    def forget_replica(self, model: str, replica: str) -> None:
        """Drop a replica's series once it has left the routing table."""
        self._in_flight.pop((model, replica), None)
        for gauge, labels in ((self.in_flight, (model, replica)),
                              (self.breaker_state, (replica,))):
            with contextlib.suppress(KeyError):  # it never had a value
                gauge.remove(*labels)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        directory = multiprocess_dir()
        if directory is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
