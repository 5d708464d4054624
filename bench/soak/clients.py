"""Clients that send a steady mix of chat and streamed completions through the gateway, and
the ledger that proves none went unanswered.

Each client is open loop: a request starts every ``pace_s`` whether or not the earlier ones
are answered, so a request held through an outage does not slow the ones after it. Every
request is written to the :class:`Ledger` *before* it is sent, and its verdict is written
when it ends, so that one lost on the way (a task that never finished, a stream that
stopped without a word) shows as an entry without a verdict.

A verdict is one of three (:func:`judge_reply`, :func:`judge_stream`, :func:`judge_failure`):

* **ok**: a 200 with a whole completion (for a stream: chunks, then ``[DONE]``);
* **error**: the client was told: an HTTP error with its body, a connection refused,
  reset or cut, or a stream that ended with an error event;
* **unanswered**: neither: no verdict at all, no answer within :data:`REQUEST_TIMEOUT_S`,
  or a 200 whose body is not a completion and says nothing of an error (a stream that
  stopped without ``[DONE]`` or an error event). The soak's target is zero of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp


class Outcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    UNANSWERED = "unanswered"


#: A client gives up after this long. Far past anything the gateway may take to answer (it
#: holds a request up to ``gateway_wait_for_replica_s``, 10 s, then answers 503), so a
#: request still open then was never going to be answered: it counts as unanswered.
REQUEST_TIMEOUT_S = 60.0
#: Tokens asked for: a stream of several chunks, so a cut midway is possible and is seen.
MAX_TOKENS = 8
#: The share of requests that stream.
STREAM_SHARE = 0.5
#: Characters of an error's reason kept per request (the report shows one per kind).
REASON_CHARS = 300


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one request ended: the outcome, a stable kind to count by, and the reason."""

    outcome: Outcome
    kind: str
    status: int | None = None
    reason: str = ""


@dataclass(slots=True)
class Entry:
    """One request in the ledger: written before it is sent, judged when it ends."""

    seq: int
    client: int
    model: str
    stream: bool
    sent: float
    ended: float | None = None
    verdict: Verdict | None = None


@dataclass
class Ledger:
    """Every request sent, in order."""

    entries: list[Entry] = field(default_factory=list)

    def open(self, *, client: int, model: str, stream: bool) -> Entry:
        entry = Entry(len(self.entries), client, model, stream, time.monotonic())
        self.entries.append(entry)
        return entry

    def unanswered(self) -> list[Entry]:
        """Entries with no verdict, or whose verdict is that no answer came."""
        return [e for e in self.entries
                if e.verdict is None or e.verdict.outcome is Outcome.UNANSWERED]


def _error_of(body: bytes) -> tuple[str, str] | None:
    """The ``code`` and reason of an OpenAI-shaped error body; None when it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None
    reason = error.get("reason") or error.get("message") or ""
    return str(error.get("code") or error.get("type") or "error"), str(reason)


def judge_reply(status: int, body: bytes) -> Verdict:
    """A whole (not streamed) answer."""
    if status == 200:
        try:
            data: Any = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("choices"):
            return Verdict(Outcome.OK, "ok", status)
        return Verdict(Outcome.UNANSWERED, "200 without a completion", status,
                       body[:REASON_CHARS].decode(errors="replace"))
    error = _error_of(body)
    if error is None:
        return Verdict(Outcome.ERROR, f"{status}", status,
                       body[:REASON_CHARS].decode(errors="replace"))
    code, reason = error
    return Verdict(Outcome.ERROR, f"{status} {code}", status, reason[:REASON_CHARS])


def judge_stream(events: Sequence[bytes]) -> Verdict:
    """A 200 stream, from the ``data:`` payloads it carried (``[DONE]`` included)."""
    chunks = 0
    for payload in events:
        if payload == b"[DONE]":
            if chunks:
                return Verdict(Outcome.OK, "ok", 200)
            return Verdict(Outcome.UNANSWERED, "stream of no chunk", 200)
        error = _error_of(payload)
        if error is not None:
            code, reason = error
            return Verdict(Outcome.ERROR, f"200 stream {code}", 200, reason[:REASON_CHARS])
        chunks += 1
    return Verdict(Outcome.UNANSWERED, "stream ended without [DONE] or an error", 200,
                   f"{chunks} chunk(s), then the end of the body")


def judge_failure(exc: BaseException) -> Verdict:
    """No HTTP answer (or not a whole one): what the client saw instead."""
    if isinstance(exc, TimeoutError):
        return Verdict(Outcome.UNANSWERED, "no answer in time",
                       reason=f"nothing within {REQUEST_TIMEOUT_S:.0f}s")
    match exc:
        case aiohttp.ClientConnectorError():
            kind = "connection refused"
        case aiohttp.ServerDisconnectedError():
            kind = "disconnected before the answer"
        case aiohttp.ClientPayloadError():
            kind = "answer cut midway"
        case aiohttp.ClientOSError():
            kind = "connection reset"
        case _:
            kind = type(exc).__name__
    return Verdict(Outcome.ERROR, kind, reason=(str(exc) or type(exc).__name__)[:REASON_CHARS])


@dataclass
class LoadClient:
    """Sends completions to ``models`` (one picked per request, by ``weights``) every
    ``pace_s``."""

    index: int
    url: str
    key: str
    models: Sequence[str]
    weights: Sequence[float]
    pace_s: float
    ledger: Ledger
    rng: random.Random
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)

    async def run(self) -> None:
        """Send on schedule until :meth:`stop`, then wait for every request still out."""
        async with session(self.key) as http:
            # Spread the clients' first requests over one pace, not all at once.
            next_at = time.monotonic() + self.rng.uniform(0, self.pace_s)
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), next_at - time.monotonic())
                if self._stop.is_set():
                    break
                model = self.rng.choices(self.models, self.weights)[0]
                entry = self.ledger.open(client=self.index, model=model,
                                         stream=self.rng.random() < STREAM_SHARE)
                task = asyncio.create_task(self._one(http, entry))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
                # Behind schedule (busy cores): start from now rather than in a burst.
                next_at = max(next_at + self.pace_s, time.monotonic())
            if self._inflight:
                await asyncio.gather(*self._inflight)

    def stop(self) -> None:
        self._stop.set()

    async def _one(self, http: aiohttp.ClientSession, entry: Entry) -> None:
        await send(http, self.url, entry)


def session(key: str) -> aiohttp.ClientSession:
    """A client session as the clients use: the key, no connection limit (requests the
    gateway holds must not queue in our pool), :data:`REQUEST_TIMEOUT_S`."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                 headers={"Authorization": f"Bearer {key}"})


async def send(http: aiohttp.ClientSession, url: str, entry: Entry) -> None:
    """Send ``entry``'s request and judge its answer (the ledger's entry is written first:
    a request lost on the way stays there without a verdict)."""
    body = {"model": entry.model, "max_tokens": MAX_TOKENS, "stream": entry.stream,
            "messages": [{"role": "user", "content": f"soak {entry.seq}"}]}
    try:
        async with http.post(url, json=body) as resp:
            if resp.status == 200 and entry.stream:
                entry.verdict = judge_stream(await _events(resp))
            else:
                entry.verdict = judge_reply(resp.status, await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        entry.verdict = judge_failure(exc)
    finally:
        entry.ended = time.monotonic()


async def _events(resp: aiohttp.ClientResponse) -> list[bytes]:
    """The ``data:`` payloads of a server-sent event stream, until ``[DONE]`` or its end."""
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            events.append(payload)
            if payload == b"[DONE]":
                break
    return events
