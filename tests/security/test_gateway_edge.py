"""The gateway's edge (issue 19): what reaches it before a request is routed, and what an
engine may send back.

* A header line that never ends is cut once the header bound has arrived (finding 8).
* Engine-native knobs that set how much is generated are bounded like ``max_tokens``
  (finding 9).
* The Host allowlist and ``Content-Type: application/json`` (no blind cross-site POSTs).
* ``/metrics`` needs a token while client auth is on.
* An engine's answer is buffered up to a bound, past which the request fails with a 502
  naming it and the replica's breaker counts a failure.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.server import MAX_HEADER_BYTES, timed_protocol
from modelkeeper.settings import Settings
from tests.support.gateway_support import HOST, running_gateway

pytestmark = pytest.mark.timeout(60)


# -- finding 8: the header bound holds while a header is still arriving ----------------------

class _Transport(asyncio.Transport):
    """What the protocol writes and whether it closed: no socket."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000),
                "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


#: One read as a client trickles it: the protocol may keep at most this much past the bound.
_READ = 4096


async def test_an_endless_header_line_is_cut_once_the_bound_has_arrived() -> None:
    protocol_class = timed_protocol(Settings(gateway_header_timeout_s=30.0))
    protocol = protocol_class(config=uvicorn.Config(_app, log_config=None),
                              server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    try:
        fed = 0
        chunk = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: "
        while not transport.closed and fed < 64 * MAX_HEADER_BYTES:
            protocol.data_received(chunk)
            fed += len(chunk)
            chunk = b"a" * _READ
        assert transport.closed, f"still reading a header line after {fed} bytes"
        # Cut at the first read past the bound: the parser never held more than that.
        assert MAX_HEADER_BYTES < fed <= MAX_HEADER_BYTES + 2 * _READ, fed
        assert transport.written.startswith(b"HTTP/1.1 400 "), transport.written[:80]
        assert b'"the request\'s headers are over 65536 bytes"' in transport.written
    finally:
        protocol.connection_lost(None)


async def test_a_body_in_the_same_read_as_its_headers_is_not_counted_as_headers() -> None:
    """A read that completes the headers may carry a large body: the bound is on headers."""
    protocol_class = timed_protocol(Settings())
    protocol = protocol_class(config=uvicorn.Config(_app, log_config=None),
                              server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)
    try:
        body = b"x" * (4 * MAX_HEADER_BYTES)
        protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                               + body[:3 * MAX_HEADER_BYTES])
        protocol.data_received(body[3 * MAX_HEADER_BYTES:])
        assert not transport.written.startswith(b"HTTP/1.1 400"), transport.written[:200]
    finally:
        protocol.connection_lost(None)


def _endless_header(port: int, limit: int) -> tuple[bytes, int]:
    """Send one header line that never ends, in small writes, until the server answers or
    ``limit`` bytes are sent; what came back and how much was sent."""
    sent = 0
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: ")
        sock.setblocking(False)
        chunk = b"a" * _READ
        received = b""
        while sent < limit:
            try:
                received += sock.recv(65536)
                break  # the server answered (or closed)
            except BlockingIOError:
                pass
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                pass  # the server is not reading: its answer is on the way, or a timeout
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        sock.settimeout(10)
        try:
            while data := sock.recv(65536):
                received += data
        except ConnectionResetError:
            pass
    return received, sent


async def test_a_gateway_answers_an_endless_header_line_with_a_400(database_url: str) -> None:
    async with running_gateway(database_url, gateway_header_timeout_s=5.0) as server:
        received, sent = await asyncio.to_thread(
            _endless_header, server.settings.gateway_port, 32 * MAX_HEADER_BYTES)
        assert received.startswith(b"HTTP/1.1 400"), (sent, received[:200])
        # Kernel buffers on the way hold some of what was sent after the cut.
        assert sent < 16 * MAX_HEADER_BYTES, sent
