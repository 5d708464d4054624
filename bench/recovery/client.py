"""A client that sends one chat completion through the gateway at a steady pace.

Open loop: a request starts every ``pace_s`` whether or not the earlier ones have been
answered, so a request the gateway holds during an outage (it waits for a replica up to
``MODELKEEPER_GATEWAY_WAIT_FOR_REPLICA_S``) does not stop the clock of the ones after
it. Each outcome is kept: when it was sent, when it ended, the HTTP status or the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

#: Longer than the gateway's own budget for holding a request (10 s by default), so what
#: the client records is the gateway's answer, not the client giving up first.
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Outcome:
    """One request: monotonic send and end times, and the status (None on an error)."""

    sent: float
    ended: float
    status: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def label(self) -> str:
        """The HTTP status, or the error's type when there was no answer."""
        return str(self.status) if self.status is not None else (self.error or "error")


@dataclass
class SteadyClient:
    """Sends ``model`` a one-token chat completion every ``pace_s`` until stopped."""

    url: str
    model: str
    key: str
    pace_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self) -> None:
        """Send on schedule until :meth:`stop`, then wait for the requests still out."""
        body = {"model": self.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {self.key}"}
        # No connection limit: held requests must not queue in the client's pool.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            next_at = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(self._one(http, body, headers))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
                # Behind schedule (a busy core), start from now rather than bursting.
                next_at = max(next_at + self.pace_s, time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), next_at - time.monotonic())
            if self._inflight:
                await asyncio.gather(*self._inflight)

    def stop(self) -> None:
        self._stop.set()

    async def _one(self, http: aiohttp.ClientSession, body: dict[str, object],
                   headers: dict[str, str]) -> None:
        sent = time.monotonic()
        try:
            async with http.post(self.url, json=body, headers=headers) as resp:
                await resp.read()
                status, error = resp.status, None
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, error = None, type(exc).__name__
        self.outcomes.append(Outcome(sent, time.monotonic(), status, error))

    def first_success_after(self, t0: float) -> Outcome | None:
        """The success that ended first among the requests sent at or after ``t0``."""
        ok = [o for o in self.outcomes if o.sent >= t0 and o.ok]
        return min(ok, key=lambda o: o.ended) if ok else None

    def between(self, start: float, end: float) -> list[Outcome]:
        """The requests sent in [start, end)."""
        return [o for o in self.outcomes if start <= o.sent < end]


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    """Failed requests by status (or error type)."""
    return dict(Counter(o.label for o in outcomes if not o.ok))
