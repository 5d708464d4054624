"""The sim engine's multi-rank mode: a rendezvous that behaves as the real engines' does.

vLLM (``--master-addr``/``--master-port``, torch's TCPStore) and SGLang
(``--dist-init-addr``) both start every rank together: rank 0 listens at the rendezvous
address, the other ranks connect to it (retrying until their start timeout), and rank 0
serves only once every rank has joined. A rank that dies breaks the process group, and
the others exit with an error. The sim does the same over one TCP connection per rank:

- rank N > 0 connects to rank 0's address and sends ``rank N``; rank 0 answers
  ``welcome`` and keeps the connection;
- rank 0 is ready (``/health`` 200) only when all ``world_size - 1`` ranks have joined;
- a connection that closes is a rank gone: rank 0 exits when a joined rank leaves, and a
  rank exits when rank 0 leaves.

A connection that sends no hello (the agent's link check, a port scan) is closed and
counts for nothing, as a TCP connect to a TCPStore does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

logger = logging.getLogger("agent.engines.sim")

#: Exit code of a rank whose peer left: what vLLM and SGLang do when the process group
#: breaks (an error, not a signal).
RANK_LOST_EXIT_CODE = 1
#: How long a connection may take to say which rank it is. A joining rank sends at once;
#: anything slower is not one.
HELLO_TIMEOUT_S = 5.0
#: Between a joining rank's connection attempts while rank 0 is not up yet.
JOIN_RETRY_S = 0.2
#: One hello line is a few bytes; anything longer is not ours.
MAX_HELLO_BYTES = 64


def _hello(rank: int) -> bytes:
    return f"rank {rank}\n".encode()


def _parse_hello(line: bytes) -> int | None:
    words = line.decode("ascii", "replace").split()
    if len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
        return None
    return int(words[1])


class Leader:
    """Rank 0's side: listens at the rendezvous address and tracks who joined."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        self.host, self.port, self.world_size = host, port, world_size
        self.joined: set[int] = set()
        #: Set once every other rank has joined.
        self.complete = asyncio.Event()
        #: Set when a joined rank leaves; ``lost_reason`` says which.
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._server: asyncio.Server | None = None
        self._peers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port,
                                                  limit=MAX_HELLO_BYTES)
        logger.info("rendezvous listening on %s:%d for %d more rank(s)", self.host, self.port,
                    self.world_size - 1)

    def progress(self) -> str:
        """"1/3 ranks joined" (rank 0 counts as joined)."""
        return f"{len(self.joined) + 1}/{self.world_size} ranks joined"

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        rank = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                rank = _parse_hello(await reader.readline())
        except (TimeoutError, OSError, ValueError, asyncio.LimitOverrunError):
            rank = None
        if rank is None:
            writer.close()  # a link check, or not one of ours
            return
        if not 0 < rank < self.world_size or rank in self.joined:
            logger.error("refused rank %d from %s: %s", rank, peer,
                         "already joined" if rank in self.joined else
                         f"outside world size {self.world_size}")
            writer.close()
            return
        self.joined.add(rank)
        self._peers.add(writer)
        writer.write(b"welcome\n")
        with contextlib.suppress(OSError):
            await writer.drain()
        logger.info("rank %d joined from %s (%s)", rank, peer, self.progress())
        if len(self.joined) == self.world_size - 1:
            self.complete.set()
        # The connection stays open for the engine's life: its end is the rank's.
        with contextlib.suppress(OSError):
            while await reader.read(1024):
                pass
        self._peers.discard(writer)
        if not self.lost.is_set():
            self.lost_reason = f"rank {rank} ({peer[0] if peer else '?'}) left the rendezvous"
            self.lost.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._peers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()


class Follower:
    """A rank above 0: joins rank 0, and notices when it leaves."""

    def __init__(self, host: str, port: int, rank: int) -> None:
        self.host, self.port, self.rank = host, port, rank
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        #: Set once rank 0 welcomed this rank.
        self.joined = asyncio.Event()

    async def join(self, timeout_s: float) -> str | None:
        """Connect and say hello, retrying until ``timeout_s``; None once joined, else why
        not."""
        deadline = time.monotonic() + timeout_s
        last = "no attempt"
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port,
                                                               limit=MAX_HELLO_BYTES)
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(JOIN_RETRY_S)
                continue
            writer.write(_hello(self.rank))
            try:
                async with asyncio.timeout(HELLO_TIMEOUT_S):
                    await writer.drain()
                    answer = await reader.readline()
            except (TimeoutError, OSError) as exc:
                answer, last = b"", f"no welcome: {type(exc).__name__}"
            if answer == b"welcome\n":
                self._reader, self._writer = reader, writer
                self.joined.set()
                logger.info("rank %d joined rank 0 at %s:%d", self.rank, self.host, self.port)
                return None
            writer.close()
            last = last if not answer and last.startswith("no welcome") else "refused by rank 0"
            await asyncio.sleep(JOIN_RETRY_S)
        return (f"rank {self.rank} could not join rank 0 at {self.host}:{self.port} within "
                f"{timeout_s:.0f}s ({last})")

    async def wait_lost(self) -> str:
        """Return, saying why, when rank 0's connection ends (after joining it)."""
        await self.joined.wait()
        assert self._reader is not None
        with contextlib.suppress(OSError):
            while await self._reader.read(1024):
                pass
        return f"lost rank 0 at {self.host}:{self.port} (its connection closed)"

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
