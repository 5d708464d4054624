"""A lean HTTP/1.1 load generator for the gateway benchmark.

It speaks just enough HTTP/1.1 over keep-alive connections (Content-Length and chunked
bodies) to time requests, and nothing else, so that on a 2-core machine it takes as
little CPU as possible away from the server being measured. A general client (httpx,
aiohttp) costs several times more CPU per request than the servers it would measure.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class Sample:
    """What one request measured."""

    status: int
    #: Seconds from writing the request to reading the last byte of the response.
    total_s: float
    #: Seconds from writing the request to the first body byte (the first SSE chunk).
    first_byte_s: float
    #: SSE events received (``data:`` lines), 0 for a plain JSON body.
    events: int


@dataclass
class Result:
    """All samples of one run, and its wall time."""

    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0

    @property
    def rate(self) -> float:
        """Completed requests per second."""
        return len(self.samples) / self.wall_s if self.wall_s else 0.0


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The bytes of one POST request (or GET when ``body`` is empty)."""
    method = "POST" if body else "GET"
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader, started: float) -> Sample:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    events = 0
    first = 0.0
    if b"transfer-encoding: chunked" in lower:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            data = await reader.readexactly(size + 2)
            if not first:
                first = time.perf_counter() - started
            events += data.count(b"data:")
    else:
        start = lower.index(b"content-length:") + 15
        length = int(lower[start:lower.index(b"\r\n", start)])
        events = (await reader.readexactly(length)).count(b"data:")
        first = time.perf_counter() - started
    return Sample(status, time.perf_counter() - started, first, events)


async def _worker(host: str, port: int, request: bytes, deadline: float, count: int | None,
                  result: Result, counter: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            if count is not None:
                if counter[0] >= count:
                    return
                counter[0] += 1
            started = time.perf_counter()
            writer.write(request)
            try:
                result.samples.append(await _read_response(reader, started))
            except (ConnectionError, asyncio.IncompleteReadError):
                result.errors += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
    finally:
        writer.close()


async def run(host: str, port: int, request: bytes, *, concurrency: int, duration_s: float,
              count: int | None = None, warmup: int = 50) -> Result:
    """Send ``request`` over ``concurrency`` connections for ``duration_s`` (or ``count``)."""
    # Warm up: connections, caches, the server's first-request paths.
    await run_once(host, port, request, warmup)
    result = Result()
    counter = [0]
    started = time.perf_counter()
    deadline = started + duration_s
    await asyncio.gather(*(
        _worker(host, port, request, deadline, count, result, counter)
        for _ in range(concurrency)
    ))
    result.wall_s = time.perf_counter() - started
    return result


async def run_once(host: str, port: int, request: bytes, n: int) -> None:
    """Send ``n`` requests one after the other (used to warm up)."""
    if n <= 0:
        return
    await run(host, port, request, concurrency=1, duration_s=3600, count=n, warmup=0)
