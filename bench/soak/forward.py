"""The one road from an agent's network namespace to the control plane.

Run as ``python -m bench.soak.forward --netns NAME --relay PORT:HOST:PORT:SIDE ... --ready
FILE``. For each relay it listens on ``127.0.0.1:PORT`` *inside* the namespace NAME and
relays every connection made there to ``HOST:PORT``, connecting from SIDE:

* ``netns``: from inside the namespace, over its veth pair. The API is reached this way,
  so it sees the node's own address as the peer (it checks that a node's engines are on
  the address its registration came from), as it would see a machine of its own.
* ``host``: from the namespace the forwarder was started in. The Temporal dev server is
  reached this way: it listens on the host's loopback only, and checks no peer.

The agent inside therefore finds the API and Temporal at the very addresses the other
agents use (``127.0.0.1``), and only through this process. A partition is a SIGSTOP of it:
connections still open at the kernel level (the listening sockets' backlog), but no byte
crosses either way until SIGCONT, as when packets are dropped on a cut link. The engines
are not behind it (the gateway reaches them over the veth pair), so a partition cuts the
node from the control plane only.

A socket stays in the namespace it was created in, whatever its process does next; so
sockets are made in the namespace they belong to (``setns`` there and back, in this one
thread) and used from anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvloop

#: ``setns(2)``'s flag for a network namespace (linux/sched.h).
CLONE_NEWNET = 0x40000000
#: Where ``ip netns add`` mounts the namespaces it names.
NETNS_DIR = Path("/var/run/netns")
LOOPBACK = "127.0.0.1"
#: Bytes read at a time: the control plane's messages are small, heartbeats most of all.
CHUNK = 64 * 1024
#: Pending connections per port while the relay is stopped (a partition): more than the
#: agent opens in 45 s, so a connect succeeds and then hangs, as over a dropped link.
BACKLOG = 512
#: Sides a relay may connect from.
SIDES = ("host", "netns")


@dataclass(frozen=True)
class Relay:
    """Listen on 127.0.0.1:``port`` in the namespace; connect to ``target`` from ``side``."""

    port: int
    target: tuple[str, int]
    side: str

    @classmethod
    def parse(cls, text: str) -> Relay:
        port, host, target_port, side = text.split(":")
        if side not in SIDES:
            raise ValueError(f"--relay {text}: side must be one of {SIDES}, not {side!r}")
        return cls(int(port), (host, int(target_port)), side)


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class Namespaces:
    """Open handles on our own network namespace and the agent's."""

    def __init__(self, netns: str) -> None:
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)
        self.netns = os.open(NETNS_DIR / netns, os.O_RDONLY)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Sockets made within are the namespace's. Single thread: nothing else runs."""
        _setns(self.netns)
        try:
            yield
        finally:
            _setns(self.home)

    def socket(self, side: str) -> socket.socket:
        """A non-blocking TCP socket of ``side``'s namespace."""
        with self.inside() if side == "netns" else contextlib.nullcontext():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        return sock


def listen(spaces: Namespaces, relays: Sequence[Relay]) -> list[socket.socket]:
    """A listening socket on 127.0.0.1 inside the namespace for each relay."""
    socks = []
    for relay in relays:
        sock = spaces.socket("netns")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, relay.port))
        sock.listen(BACKLOG)
        socks.append(sock)
    return socks


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close: HTTP/1.1 and gRPC both rely on the other half."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _relay(spaces: Namespaces, relay: Relay, inner_r: asyncio.StreamReader,
                 inner_w: asyncio.StreamWriter) -> None:
    sock = spaces.socket(relay.side)
    try:
        await asyncio.get_running_loop().sock_connect(sock, relay.target)
        outer_r, outer_w = await asyncio.open_connection(sock=sock)
    except OSError:
        sock.close()
        inner_w.close()  # nothing listens there: the agent sees its connection closed
        return
    try:
        await asyncio.gather(_pump(inner_r, outer_w), _pump(outer_r, inner_w))
    finally:
        for w in (inner_w, outer_w):
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


async def serve(spaces: Namespaces, relays: Sequence[Relay], ready: Path) -> None:
    servers = [await asyncio.start_server(functools.partial(_relay, spaces, relay), sock=sock)
               for relay, sock in zip(relays, listen(spaces, relays), strict=True)]
    ready.write_text(f"{os.getpid()}\n")
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak.forward",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", required=True, help="the namespace the agent runs in")
    parser.add_argument("--relay", type=Relay.parse, action="append", required=True,
                        metavar="PORT:HOST:PORT:SIDE",
                        help="listen on 127.0.0.1:PORT inside, connect to HOST:PORT from "
                        "SIDE (host or netns); repeat for each port")
    parser.add_argument("--ready", type=Path, required=True,
                        help="file written once every port listens")
    args = parser.parse_args(argv)
    uvloop.run(serve(Namespaces(args.netns), args.relay, args.ready))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
