"""A stand-in OTLP/HTTP collector for the traces benchmark: it takes ``POST /v1/traces``
and answers 200 at once, keeping the bodies; ``GET /count`` parses them then and answers
how many spans it got. Parsing waits until asked, so the collector's work does not take
the (shared) cores while the gateway is measured.

    python -m bench.gateway.otlp_sink --port PORT
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

BODIES: list[bytes] = []


class Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        BODIES.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        spans = 0
        for body in BODIES:
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            spans += sum(len(scope.spans) for resource in request.resource_spans
                         for scope in resource.scope_spans)
        answer = json.dumps({"exports": len(BODIES), "spans": spans}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway.otlp_sink")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    ThreadingHTTPServer((args.host, args.port), Sink).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
