"""What the demand bench sends through the gateway, and what it records of each answer.

* :func:`first_token`: one streamed chat completion, timed from the send to its first
  content chunk (the cold start, the wake).
* :class:`ClosedLoop`: clients that each send one streamed completion after another (the
  step load): a held request holds its client, as a user waiting on a chat would.
* :class:`Ask`: one answer, classified as the issue's contract reads it (:func:`classify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp

#: Longer than any hold the bench sets (load_wait_s) plus a load: what is recorded is the
#: gateway's answer, never the client giving up first.
REQUEST_TIMEOUT_S = 60.0
#: What the gateway says when it held a request for a loading model in vain (issue 21):
#: 503, Retry-After, and these words.
LOADING_WORDS = "is loading"


class Answer(StrEnum):
    """The three answers the issue tells apart for an on-demand model."""

    OK = "200"
    LOADING = "503 loading"  # the documented answer: held in vain while it loads
    OTHER = "other"  # anything else: a failure


def classify(status: int | None, body: str, headers: Mapping[str, str]) -> Answer:
    """A 200; a 503 with Retry-After that says the model is loading; or anything else."""
    if status == 200:
        return Answer.OK
    if status == 503 and "retry-after" in {k.lower() for k in headers} \
            and LOADING_WORDS in body:
        return Answer.LOADING
    return Answer.OTHER


@dataclass(frozen=True)
class Ask:
    """One request: monotonic send, first token and end times, status and its class."""

    model: str
    sent: float
    first_token: float | None
    ended: float
    status: int | None
    answer: Answer
    detail: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


def _body(model: str, *, max_tokens: int) -> dict[str, object]:
    return {"model": model, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "demand bench"}]}


async def first_token(http: aiohttp.ClientSession, url: str, model: str, *,
                      max_tokens: int = 4) -> Ask:
    """Send one streamed completion to ``model`` and read it to its end; the first chunk
    that carries content is the first token."""
    sent = time.monotonic()
    first: float | None = None
    try:
        async with http.post(url, json=_body(model, max_tokens=max_tokens)) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                return Ask(model, sent, None, time.monotonic(), resp.status,
                           classify(resp.status, text, resp.headers), text[:200])
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                if first is None and b'"content"' in payload:
                    first = time.monotonic()
            answer = Answer.OK if first is not None else Answer.OTHER
            return Ask(model, sent, first, time.monotonic(), 200, answer,
                       "" if first is not None else "a 200 stream without a token")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Ask(model, sent, first, time.monotonic(), None, Answer.OTHER,
                   f"{type(exc).__name__}: {exc}"[:200])


def session(key: str) -> aiohttp.ClientSession:
    """A client session with the gateway key, no connection limit (held requests must not
    queue in our pool) and :data:`REQUEST_TIMEOUT_S`."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        headers={"Authorization": f"Bearer {key}"})


@dataclass
class ClosedLoop:
    """Clients sending ``model`` one streamed completion after another; :meth:`resize`
    changes how many run (the step load's 1 -> 16 -> 1)."""

    http: aiohttp.ClientSession
    url: str
    model: str
    max_tokens: int
    asks: list[Ask] = field(default_factory=list)
    _tasks: list[tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=list)

    async def _client(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.asks.append(await first_token(self.http, self.url, self.model,
                                               max_tokens=self.max_tokens))

    @property
    def clients(self) -> int:
        return len(self._tasks)

    async def resize(self, clients: int) -> None:
        """Start clients up to ``clients``, or stop the newest ones (each ends its request
        first: nothing is cut, so nothing fails on the bench's side)."""
        while len(self._tasks) < clients:
            stop = asyncio.Event()
            self._tasks.append((stop, asyncio.create_task(self._client(stop))))
        leaving = self._tasks[clients:]
        del self._tasks[clients:]
        for stop, _ in leaving:
            stop.set()
        for _, task in leaving:
            with contextlib.suppress(asyncio.CancelledError):
                await task
