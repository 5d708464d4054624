"""An in-process OTLP/HTTP receiver: what a collector would get, for tests to assert on.

It accepts ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest`` (what the
SDK's OTLP/HTTP exporter sends), answers 200 with an empty response, and keeps every
span, flattened with its service's name. It runs on a thread of its own, so it serves a
test's event loop and the processes of a `modelkeeper up` alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


class OtlpReceiver:
    """A running receiver: its base URL (``otlp_endpoint``) and the spans it has got."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per export would drown the test's output

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="otlp-receiver")

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano))
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)

    def received(self) -> list[ReceivedSpan]:
        """The spans so far."""
        with self._lock:
            return list(self.spans)

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], *, timeout: float,
                 what: str) -> list[ReceivedSpan]:
        """The spans once ``found`` holds for them; AssertionError naming ``what`` and
        the spans' names after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.received()
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({f"{s.service}: {s.name}" for s in spans})
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                     f"received {len(spans)} span(s): {names}")
            time.sleep(0.05)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver serving until the block ends."""
    receiver = OtlpReceiver()
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
