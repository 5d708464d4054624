"""Node liveness, as the API sees an agent's liveness stream. Pure: time is an argument.

Each agent keeps one streaming request open to the API and writes a ping line on it every
``liveness_interval_s``; it writes ``bye`` before a planned stop. The API feeds what it
sees to :func:`step`, one event at a time, and carries out the verdict it returns. The
rules, in order (each has its test in ``tests/unit/test_liveness.py``):

1. Only the node's newest stream counts. A stream opening replaces the one before it;
   events of a replaced stream change nothing, so a half-open old connection, still
   waiting for pings that now arrive on the new one, never makes a live node silent.
2. A stream opening, or a ping on it, is proof of life: the node is alive from then. A
   node that was silent comes back (:class:`CameBack`).
3. No ping for ``silent_after_s`` makes the node silent (:class:`WentSilent`), once:
   a frozen agent (SIGSTOP, a hung host) keeps its socket open but writes nothing.
4. A stream that breaks without ``bye`` makes the node silent at once: a kill -9 of the
   agent, or of its whole machine's processes, closes the socket within milliseconds.
5. A stream that ends with ``bye`` is a planned stop (an agent restart, after which the
   new agent adopts the engines): the node is forgotten, never silent. A node that was
   silent and says ``bye`` is alive enough to say it, so it comes back first.
6. A stream that ends because the API itself stops says nothing about the node: forgotten,
   no verdict. The next API hears from the agent when it reconnects.

Times are seconds on a monotonic clock (the API passes ``time.monotonic()``). States and
events are frozen dataclasses rather than pydantic models: the API steps one per ping, two
a second per node, and they never leave the process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

#: The line an agent writes before it closes its stream on purpose (rule 5). Anything else
#: on a line is a ping.
BYE = b"bye"
#: The line an agent writes every ``liveness_interval_s``.
PING = b"ping"


class Ending(StrEnum):
    """How a liveness stream ended."""

    #: The agent wrote ``bye``: a planned stop.
    BYE = "bye"
    #: The connection closed, or the body ended, without ``bye``.
    BROKEN = "broken"
    #: The API is shutting down and ended the stream itself.
    API_CLOSING = "api_closing"


@dataclass(frozen=True, slots=True)
class Opened:
    """A new stream from the node's agent; ``stream`` is unique within the API process."""

    stream: int
    now: float


@dataclass(frozen=True, slots=True)
class Pinged:
    """One or more ping lines arrived on ``stream``."""

    stream: int
    now: float


@dataclass(frozen=True, slots=True)
class Checked:
    """The API looked at the node at its :func:`check_at` time without a ping arriving."""

    stream: int
    now: float


@dataclass(frozen=True, slots=True)
class Ended:
    """``stream`` ended, and how."""

    stream: int
    now: float
    how: Ending


LivenessEvent = Opened | Pinged | Checked | Ended


@dataclass(frozen=True, slots=True)
class NodeLiveness:
    """One node's liveness: its newest stream, its last sign of life, and whether (since
    when) it is silent."""

    stream: int
    last_ping_at: float
    silent_since: float | None = None


@dataclass(frozen=True, slots=True)
class WentSilent:
    """The node just went silent: tell its deployments, keep placement off it."""

    reason: str


@dataclass(frozen=True, slots=True)
class CameBack:
    """The node was silent and is alive again after ``silent_for_s``."""

    silent_for_s: float


Verdict = WentSilent | CameBack


def step(state: NodeLiveness | None, event: LivenessEvent, *, silent_after_s: float,
         ) -> tuple[NodeLiveness | None, Verdict | None]:
    """The node's liveness after ``event``, and what the API must do about it, if anything.

    ``None`` state: the API is not following the node (never connected, said ``bye``, or
    the API is closing).
    """
    if isinstance(event, Opened):
        return _on_opened(state, event)
    if state is None or event.stream != state.stream:
        return state, None  # rule 1: not the node's newest stream
    match event:
        case Pinged():
            return _on_pinged(state, event)
        case Checked():
            return _on_checked(state, event, silent_after_s=silent_after_s)
        case Ended():
            return _on_ended(state, event)


def check_at(state: NodeLiveness | None, *, silent_after_s: float) -> float | None:
    """When the node goes silent unless a ping arrives first; None when nothing is due
    (not followed, or already silent)."""
    if state is None or state.silent_since is not None:
        return None
    return state.last_ping_at + silent_after_s


def is_current(state: NodeLiveness | None, stream: int) -> bool:
    """Whether ``stream`` is the node's newest stream (its reader should keep reading)."""
    return state is not None and state.stream == stream


def _on_opened(state: NodeLiveness | None, event: Opened,
               ) -> tuple[NodeLiveness, Verdict | None]:
    fresh = NodeLiveness(stream=event.stream, last_ping_at=event.now)
    return fresh, _back(state, event.now)


def _on_pinged(state: NodeLiveness, event: Pinged) -> tuple[NodeLiveness, Verdict | None]:
    return replace(state, last_ping_at=event.now, silent_since=None), _back(state, event.now)


def _on_checked(state: NodeLiveness, event: Checked, *, silent_after_s: float,
                ) -> tuple[NodeLiveness, Verdict | None]:
    quiet = event.now - state.last_ping_at
    if state.silent_since is not None or quiet < silent_after_s:
        return state, None
    reason = f"no ping for {quiet:.1f}s (silent after {silent_after_s:g}s)"
    return replace(state, silent_since=event.now), WentSilent(reason)


def _on_ended(state: NodeLiveness, event: Ended,
              ) -> tuple[NodeLiveness | None, Verdict | None]:
    match event.how:
        case Ending.BYE:
            return None, _back(state, event.now)
        case Ending.API_CLOSING:
            return None, None
        case Ending.BROKEN if state.silent_since is None:
            return (replace(state, silent_since=event.now),
                    WentSilent("its liveness stream broke without a goodbye"))
        case Ending.BROKEN:
            return state, None


def _back(state: NodeLiveness | None, now: float) -> CameBack | None:
    if state is None or state.silent_since is None:
        return None
    return CameBack(silent_for_s=now - state.silent_since)
