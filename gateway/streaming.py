"""Passing an engine's answer back to the client, whole or as a stream of server-sent
events, and naming the ways an engine fails on the way (the ``kind`` label of
``modelkeeper_gateway_upstream_errors``).

What the gateway holds of an answer is bounded: a whole answer up to
:data:`MAX_REPLY_BYTES`, a stream one event of up to :data:`MAX_EVENT_BYTES` at a time.
A stream is relayed whole events only, so that one cut midway still ends with a
well-formed error event.
"""

from __future__ import annotations

import logging
import time

import aiohttp

from modelkeeper.infra import tracing

from . import responses
from .asgi import Send, send_reply
from .metrics import GatewayMetrics
from .table import Endpoint

log = logging.getLogger(__name__)

#: Largest answer an engine may give to a request that is not streamed: the gateway holds
#: it whole before passing it on. A reply of a million tokens of text is under 8 MB, and
#: one of 4,096 tokens with 20 alternatives each (the most a request may ask for) about
#: 7 MB; past this, an engine is misbehaving, and holding more would let one reply (or a
#: few) take the gateway's memory. Longer answers are streamed, which holds no more than
#: one event.
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: Largest server-sent event an engine may send while streaming: the gateway holds an
#: event until it is complete. One event is one chunk of one choice, a few hundred bytes,
#: a few KiB with 20 alternatives per token; this leaves room for an engine that sends a
#: whole answer as one event, and stops one that never ends its line.
MAX_EVENT_BYTES = 1024 * 1024


def error_kind(exc: BaseException) -> str:
    """The ``kind`` label of an upstream error."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return "reset"
    return "protocol"


def describe(exc: BaseException) -> str:
    """An upstream error as the client and the log read it."""
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, aiohttp.ClientError) else f"{type(exc).__name__}: {text}"


def _events_end(data: bytes) -> int:
    """Where the last complete server-sent event in ``data`` ends; 0 when none does."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


async def _read_reply(response: aiohttp.ClientResponse) -> bytes | None:
    """An engine's whole answer; None when it is over :data:`MAX_REPLY_BYTES`. An answer
    with a Content-Length (as engines send) is read in one go, as before the bound; one
    without (chunked, or ended by closing) is counted as it comes."""
    length = response.content_length
    if length is not None:
        return None if length > MAX_REPLY_BYTES else await response.read()
    parts: list[bytes] = []
    size = 0
    async for part in response.content.iter_any():
        size += len(part)
        if size > MAX_REPLY_BYTES:
            return None
        parts.append(part)
    return b"".join(parts)


def _first_token() -> None:
    from .tracing import first_token  # it imports this module, through forwarding

    first_token()


class AnswerRelay:
    """Relays engines' answers, counting their failures in ``metrics``."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    def upstream_error(self, endpoint: Endpoint, exc: BaseException,
                       kind: str | None = None) -> None:
        """Count and log an engine's failure (``kind``: as :func:`error_kind` names it)."""
        kind = kind or error_kind(exc)
        self.metrics.upstream_errors.labels(endpoint.replica_id, kind).inc()
        log.warning("replica %s of %s at %s failed (%s): %s", endpoint.replica_id,
                    endpoint.model, endpoint.url, kind, describe(exc))

    async def relay(self, response: aiohttp.ClientResponse, endpoint: Endpoint, send: Send,
                    started: float) -> tuple[bool, int]:
        """Pass the engine's answer to the client; return (engine healthy?, status)."""
        status = response.status
        content_type = response.headers.get("Content-Type", "application/json")
        if status == 200 and content_type.startswith("text/event-stream"):
            return await self._relay_stream(response, endpoint, send, started)
        try:
            data = await _read_reply(response)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.upstream_error(endpoint, exc)
            reply = responses.upstream_failed(endpoint.model, describe(exc),
                                              504 if isinstance(exc, TimeoutError) else 502)
            await send_reply(send, reply)
            return False, reply.status
        if data is None:
            # Counted against the replica, as a garbled answer is: a healthy engine never
            # sends this much for a bounded request.
            why = f"its answer was over {MAX_REPLY_BYTES} bytes, the most the gateway holds"
            self.metrics.upstream_errors.labels(endpoint.replica_id, "reply_too_large").inc()
            log.warning("replica %s of %s: %s", endpoint.replica_id, endpoint.model, why)
            reply = responses.upstream_failed(endpoint.model, why)
            await send_reply(send, reply)
            return False, reply.status
        if status >= 500:
            self.metrics.upstream_errors.labels(endpoint.replica_id, "status_5xx").inc()
        if status >= 400:
            # Off the hot path: an engine's error in the one shape clients get from us.
            data = responses.engine_error(status, data).body()
            content_type = "application/json"
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type.encode("latin-1")),
            (b"content-length", str(len(data)).encode()),
            (b"x-modelkeeper-replica", endpoint.replica_id.encode()),
        ]})
        await send({"type": "http.response.body", "body": data})
        return status < 500, status

    async def _relay_stream(self, response: aiohttp.ClientResponse, endpoint: Endpoint,
                            send: Send, started: float) -> tuple[bool, int]:
        """Relay server-sent events as they come, whole events only, so that a stream cut
        midway can still end with a well-formed error event and ``[DONE]``."""
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-modelkeeper-replica", endpoint.replica_id.encode()),
        ]})
        content = response.content
        pending = b""
        done = False
        first = True
        failure: str | None = None
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                if first:
                    first = False
                    self.metrics.ttft.labels(endpoint.model).observe(
                        time.perf_counter() - started)
                    if tracing.ON:
                        _first_token()
                if pending:
                    chunk = pending + chunk
                    pending = b""
                # Forward up to the end of the last complete event; keep the rest.
                end = _events_end(chunk)
                if end == 0:
                    pending = chunk
                else:
                    if end < len(chunk):
                        pending = chunk[end:]
                        chunk = chunk[:end]
                    if not done and b"[DONE]" in chunk:
                        done = True
                    chunk = responses.engine_error_events(chunk)
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
                if len(pending) > MAX_EVENT_BYTES:
                    # An event that never ends would otherwise be held without bound.
                    failure = (f"it sent an event over {MAX_EVENT_BYTES} bytes, the most the "
                               "gateway holds")
                    pending = b""
                    self.metrics.upstream_errors.labels(endpoint.replica_id,
                                                        "event_too_large").inc()
                    break
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = describe(exc)
            self.upstream_error(endpoint, exc, "stream_cut")
        if not done:
            if failure is None:
                failure = "the engine ended the stream without [DONE]"
                self.metrics.upstream_errors.labels(endpoint.replica_id, "stream_cut").inc()
            log.warning("stream from replica %s of %s cut midway: %s", endpoint.replica_id,
                        endpoint.model, failure)
            await send({"type": "http.response.body", "more_body": True,
                        "body": responses.sse_error_event(
                            f"The stream from `{endpoint.model}` was cut midway: {failure}")})
        elif pending:
            await send({"type": "http.response.body", "body": pending, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return done, 200
