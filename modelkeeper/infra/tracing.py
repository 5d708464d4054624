"""OpenTelemetry traces: off unless ``otlp_endpoint`` is set, then posted over OTLP/HTTP.

Every long-running process (the API, the worker, the gateway, the agent) calls
:func:`setup` once at start with its service name. With the setting empty it does
nothing, imports nothing of the OpenTelemetry SDK, and leaves :data:`ON` false: the code
that would trace checks that one module attribute (the gateway's hot path checks it when
its parts are built, and binds the traced or the plain method once), so tracing off makes
no span object and no context lookup.

On, spans are batched (the SDK's ``BatchSpanProcessor``: a background thread, at most
512 per export, every 5 s unless ``OTEL_BSP_SCHEDULE_DELAY`` says otherwise) and posted
as protobuf to ``<otlp_endpoint>/v1/traces``. A collector that is down costs dropped
spans and a warning from the SDK's exporter, never a failed request: nothing waits on an
export.

The provider is this module's own, not OpenTelemetry's global one: the global can be set
only once per process, and a test that turns tracing on and off again needs to replace
it. Whatever traces here asks :func:`tracer` for its tracer; the Temporal interceptor is
handed one (:mod:`modelkeeper.infra.temporal`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from modelkeeper import __version__
from modelkeeper.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

#: Whether this process traces: set by :func:`setup`, read where spans would be made.
ON = False
#: Where OTLP/HTTP collectors take traces, under their base URL (the protocol's path).
TRACES_PATH = "/v1/traces"
#: How long one export may take before it is dropped: spans are diagnostics, and a
#: collector that hangs must not hold the exporter's thread (and its queue) for longer.
EXPORT_TIMEOUT_S = 5.0

_provider: TracerProvider | None = None


def setup(settings: Settings, *, service: str) -> bool:
    """Start exporting this process's spans as ``service`` when ``otlp_endpoint`` is set;
    whether it is. Call it once, before the process builds what traces (its Temporal
    client, its apps)."""
    global ON, _provider
    if not settings.otlp_endpoint:
        return False
    # Imported only when on: a process that does not trace loads none of the SDK.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = settings.otlp_endpoint + TRACES_PATH
    provider = TracerProvider(resource=Resource.create(
        {"service.name": service, "service.version": __version__}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)))
    if _provider is not None:
        _provider.shutdown()
    _provider = provider
    ON = True
    log.info("tracing on: %s posts its spans to %s", service, endpoint)
    return True


def tracer(name: str) -> Tracer:
    """A tracer of this process's provider; only while :data:`ON`."""
    if _provider is None:
        raise RuntimeError("tracing is off: check modelkeeper.infra.tracing.ON first")
    return _provider.get_tracer(name, __version__)


def provider() -> TracerProvider:
    """This process's tracer provider; only while :data:`ON` (for libraries that take
    one: FastAPI's own telemetry, in the API)."""
    if _provider is None:
        raise RuntimeError("tracing is off: check modelkeeper.infra.tracing.ON first")
    return _provider


def shutdown() -> None:
    """Export what is buffered and turn tracing off (a process's exit does the export by
    itself; tests that turned tracing on call this)."""
    global ON, _provider
    ON = False
    if _provider is not None:
        _provider.shutdown()
        _provider = None
