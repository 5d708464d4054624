"""The API's request spans: FastAPI's own OpenTelemetry support, handed this process's
tracer provider while tracing is on (:mod:`modelkeeper.infra.tracing`), and off otherwise.

FastAPI makes one SERVER span per request around its whole middleware stack (so a
request refused for its Host or token is traced too), named by method and route template
(``POST /deployments``, ``GET /deployments/{deployment_id}``; the method alone when no
route matched), continuing a caller's W3C ``traceparent``, with child spans for
dependencies and the endpoint. The request span is current while the route runs, so a
workflow the route starts continues the trace through the Temporal client's interceptor.

Not traced: the agents' heartbeats and liveness streams, a request per node every few
seconds and a stream per node for hours, and the ``/healthz`` and ``/metrics`` probes:
machine traffic on a timer, which would bury the operators' requests. FastAPI's metrics
and log events stay off: the API's metrics are Prometheus's (``/metrics``), its logs
Python's.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fastapi.telemetry import TelemetryConfig

from modelkeeper.infra import tracing

#: The paths of the probes, traced by no one.
PROBE_PATHS = frozenset({"/healthz", "/metrics"})
#: The last part of the agents' per-node routes on a timer (api.agents, api.liveness).
TIMER_ROUTES = ("/heartbeat", "/liveness")


def untraced(scope: MutableMapping[str, Any]) -> bool:
    """Whether a request is machine traffic on a timer, left out of the traces."""
    path: str = scope.get("path", "")
    return path in PROBE_PATHS or (path.startswith("/nodes/") and path.endswith(TIMER_ROUTES))


def telemetry() -> TelemetryConfig:
    """FastAPI's ``telemetry`` argument: this process's provider while tracing is on; all
    off otherwise, whatever global provider a library may have set."""
    if not tracing.ON:
        return {"tracing": False, "metrics": False, "logs": False, "auto_configure": False}
    return {"tracer_provider": tracing.provider(), "tracing": True, "metrics": False,
            "logs": False, "auto_configure": False, "exclude": untraced}
