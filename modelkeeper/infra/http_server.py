"""uvicorn's httptools protocol with the bounds its own does not have: a deadline on each
part of a request, and a cap on the bytes of its request line and headers counted as they
arrive. Shared by the HTTP servers that face clients (the API and the gateway); each
names its deadlines and the shape of its own error bodies.

uvicorn bounds only the idle time between requests (its keep-alive timeout), and stops
counting at the first byte: a client sending a byte every few seconds, or headers and then
nothing, holds its connection, and a task, for as long as it likes (slowloris). Here a new
connection, and a request once begun, must deliver its headers within
``header_timeout_s``, and its body within ``body_timeout_s`` of the headers, or get a 408
and a closed connection.

httptools hands a header to uvicorn only once the header is whole, buffering its value
until then: a cap checked in that callback comes after the parser has held the whole
header (100 MB of one header was accepted that way). So the bytes of a request's head are
counted in :meth:`TimedHttpProtocol.data_received`, before the parser sees them, and the
connection is answered 431 and closed as soon as they pass ``max_header_bytes``, while the
client is still sending.

A connection closed while its client is still sending (an early refusal, a 408, a 431)
is closed the way RFC 9112 (9.6) asks: the answer is sent and the writing side shut, then
whatever still arrives is read and thrown away for at most ``LINGER_S`` or
``LINGER_BYTES``, then the socket is closed. Closing at once, with the client's bytes
unread, makes the kernel send a reset that discards the answer before the client reads it.

A route whose body is a long-lived stream by design (the API's liveness streams) lifts the
body deadline of its own request through the ASGI extension :data:`STREAM_BODY_EXTENSION`,
once it has authenticated the caller.

A deadline is armed only when a part of a request is still missing after the bytes at hand
are parsed: a request that arrives whole, as most do, costs no timer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: The most bytes a request line and headers may take. An OpenAI client or an agent sends
#: well under 2 KiB, a browser with cookies a few KiB; nginx's default for large headers is
#: 32 KiB. Over it: a 431 and a closed connection, before the rest is read.
MAX_HEADER_BYTES = 64 << 10
#: A new connection, and a request once begun, must deliver its headers within this: a
#: client on a slow link sends a few KiB in well under a second.
HEADER_TIMEOUT_S = 10.0
#: A request's body must arrive within this of its headers: the largest body the gateway
#: takes (32 MiB) at about 1 MB/s, with room.
BODY_TIMEOUT_S = 60.0
#: The ASGI scope extension (``scope["extensions"][STREAM_BODY_EXTENSION]["release"]``, a
#: callable taking nothing) that lifts the body deadline of the request it came with: for a
#: route whose body is a stream that never ends by itself. Absent under another server.
STREAM_BODY_EXTENSION = "modelkeeper.stream_body"

#: How long a connection closed under a client still sending keeps reading (and throwing
#: away) what arrives, so the answer reaches it before a reset: a client reads an early
#: answer within a round trip or two. nginx's lingering_timeout is 5 s; ours is shorter.
LINGER_S = 2.0
#: ... and how much it throws away at most: a client on loopback sends gigabytes in
#: seconds, and reading them is CPU spent for nothing.
LINGER_BYTES = 4 << 20

#: Which part of a request a connection is reading.
_IDLE, _HEADERS, _BODY = 0, 1, 2


def problem_body(message: str, code: str) -> tuple[bytes, bytes]:
    """An error body in FastAPI's shape, ``{"detail": "..."}``: its content type and bytes.
    ``code`` names the error for servers whose shape carries one."""
    return b"application/json", json.dumps({"detail": message}).encode()


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines and a header cap (see the module).

    Tuned per server by subclassing (:func:`timed_protocol`): the deadlines, the cap, and
    :meth:`error_body`, the shape of the answers written here, below the application.
    """

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    max_header_bytes = MAX_HEADER_BYTES

    def error_body(self, message: str, code: str) -> tuple[bytes, bytes]:
        """The content type and body of an answer this protocol writes itself."""
        return problem_body(message, code)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport
        self._lingering: asyncio.TimerHandle | None = None
        self._lingered = 0
        self._reading = _IDLE
        # uvicorn closes through the transport it is given: that one lingers.
        super().connection_made(_LingeringTransport(transport, close=self._close,
                                                    closing=self._closing))
        self._reading = _HEADERS  # a new connection owes its first request
        self._head_bytes = 0
        self._body_unbounded = False
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for = _IDLE
        self._extensions: dict[str, dict[object, object]] = {
            STREAM_BODY_EXTENSION: {"release": self._release_body}}
        self._arm(_HEADERS)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            # Closing: what still arrives is thrown away, up to a bound.
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self._socket.close()
            return
        # Bytes that may belong to a request's head are counted before the parser holds
        # them; once the parser reads a body, the body's own bounds apply.
        if self._reading == _BODY:
            super().data_received(data)
        elif self._head_bytes + len(data) <= self.max_header_bytes:
            # The usual read, a whole request or head well under the cap: parsed at once,
            # with no slicing (the gateway's hot path; see _read_head for the rest).
            self._head_bytes += len(data)
            super().data_received(data)
        else:
            rest = self._read_head(data)
            if rest is None:
                return
            if rest:
                super().data_received(rest)
        reading = self._reading
        if reading == _IDLE or self._closing() or (
                reading == _BODY and self._body_unbounded):
            if self._deadline is not None:
                self._disarm()
        elif self._deadline_for != reading:
            self._arm(reading)

    def _read_head(self, data: bytes) -> bytes | None:
        """Parse ``data``, which would take the head past the cap if it all belonged to
        it, piece by piece while the head is still arriving, refusing the request once
        the cap is reached; the bytes left once a body is being read, or None when the
        connection is closing."""
        while data and self._reading != _BODY:
            room = self.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse_head()
                return None
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)
            if self._closing():
                self._disarm()
                return None
        return data

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = _HEADERS
        self._body_unbounded = False
        # One dict per connection, not per request: its callable acts on the request
        # being read, whichever scope it is reached from.
        self.scope["extensions"] = self._extensions

    def on_headers_complete(self) -> None:
        self._reading = _BODY
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = _IDLE
        # The next request's head is counted afresh. A pipelined one already in the bytes
        # at hand goes uncounted, so the parser may hold one read past the cap: still
        # bounded.
        self._head_bytes = 0
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refused (a malformed request line or
        header) is plain text; here it is the server's error shape."""
        self._write_error(b"HTTP/1.1 400 Bad Request", msg, "malformed_request")
        self.transport.close()

    def _refuse_head(self) -> None:
        self._write_error(b"HTTP/1.1 431 Request Header Fields Too Large",
                          f"the request line and headers are over {self.max_header_bytes} "
                          "bytes", "headers_too_large")
        self._disarm()
        self.transport.close()

    def _write_error(self, status_line: bytes, message: str, code: str) -> None:
        """A whole error answer that closes the connection, written to the transport below
        the application (for a request that never reached it, or stopped arriving)."""
        content_type, body = self.error_body(message, code)
        self.transport.write(
            status_line + b"\r\ncontent-type: " + content_type + b"\r\nconnection: close"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def _closing(self) -> bool:
        return self._lingering is not None or self._socket.is_closing()

    def _close(self) -> None:
        """Close the connection; lingering (see the module) while a request's head or body
        is still arriving."""
        if self._lingering is not None or self._socket.is_closing():
            return
        if self._reading == _IDLE or not self._socket.can_write_eof():
            self._socket.close()
            return
        self._disarm()
        self._socket.write_eof()  # after the answer already written
        self._socket.resume_reading()
        self._lingering = self.loop.call_later(LINGER_S, self._socket.close)

    def _release_body(self) -> None:
        """Lift the body deadline of the request being read (see STREAM_BODY_EXTENSION)."""
        self._body_unbounded = True
        if self._deadline_for == _BODY:
            self._disarm()

    def _arm(self, reading: int) -> None:
        self._disarm()
        delay = self.header_timeout_s if reading == _HEADERS else self.body_timeout_s
        self._deadline = self.loop.call_later(delay, self._late, reading)
        self._deadline_for = reading

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_for = _IDLE

    def _late(self, reading: int) -> None:
        """The deadline for ``reading`` passed: if that part is still missing, answer 408
        (unless a response has begun) and close."""
        self._deadline = None
        self._deadline_for = _IDLE
        if self._reading != reading or self.transport.is_closing() or (
                reading == _BODY and self._body_unbounded):
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self._write_error(b"HTTP/1.1 408 Request Timeout",
                              "the request was not sent in time: its headers or body stopped "
                              "arriving", "request_timeout")
        if cycle is not None and not cycle.response_complete:
            # The app's pending receive() then reads a disconnect, and stops.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def timed_protocol(name: str, *, header_timeout_s: float, body_timeout_s: float,
                   base: type[TimedHttpProtocol] = TimedHttpProtocol,
                   ) -> type[TimedHttpProtocol]:
    """``base`` with these deadlines (uvicorn builds one protocol per connection from the
    class it is given, so the values travel as class attributes)."""
    attributes: dict[str, Any] = {"header_timeout_s": header_timeout_s,
                                  "body_timeout_s": body_timeout_s}
    return type(name, (base,), attributes)


def release_body_deadline(scope: dict[str, Any] | Any) -> bool:
    """Lift the body deadline of the request ``scope`` came with; whether the server had
    one to lift (another server, a test's ASGI transport, has none)."""
    extension = scope.get("extensions", {}).get(STREAM_BODY_EXTENSION)
    if extension is None:
        return False
    extension["release"]()
    return True


class _LingeringTransport(asyncio.Transport):
    """A connection's transport as uvicorn's protocol sees it: the same, but for
    :meth:`close`, which the protocol below decides (a lingering close)."""

    def __init__(self, transport: asyncio.Transport, *, close: Callable[[], None],
                 closing: Callable[[], bool]) -> None:
        super().__init__()
        self._transport = transport
        self._close = close
        self._closing = closing

    def close(self) -> None:
        self._close()

    def is_closing(self) -> bool:
        return self._closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def abort(self) -> None:
        self._transport.abort()
