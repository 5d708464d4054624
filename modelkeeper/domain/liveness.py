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
7. A node that comes back quickly from a quiet silence (within ``max_silent_after_s``)
   gets twice the deadline next time, up to ``max_silent_after_s``; each
   ``calm_after_s`` without a silence halves it again, down to ``silent_after_s``. A
   late ping on an overloaded agent or network then costs its deployments one surge, not
   one every few seconds (1,000 simulated nodes on two cores marked live nodes silent
   17,867 times in one run, and each silence started replacements on the same cores:
   the flapping fed itself). A broken stream is still silence at once (rule 4): damping
   never slows the detection of a crash, only of a freeze or a partition, and never
   beyond ``max_silent_after_s``.
8. The API's own lag is not the node's silence. A ping the agent sent on time can wait,
   unread, behind work the API has not yet got to: when its event loop falls behind (a
   CPU it shares, a burst of verdicts), a check finds the ping missing. A check
   (:class:`Checked`) carries how far behind the API has run lately, ``lag_s``, and the
   node is silent only once it has been quiet for its deadline plus that lag, the lag
   counted up to ``max_silent_after_s``. A quick API adds nothing; an overloaded one
   finds a freeze later by as much as it lags, never by more than that bound. (At 1,000
   simulated nodes on two cores, with damping but without this rule, the API marked live
   nodes silent 4,871 times while placing, its heartbeats' round trip at 3 s.)

Times are seconds on a monotonic clock (the API passes ``time.monotonic()``). States and
events are frozen dataclasses rather than pydantic models: the API steps one per ping, two
a second per node, and they never leave the process.
"""

from __future__ import annotations

import math
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
class Deadlines:
    """How long a node may go without a ping before it is silent, and how far damping
    (rule 7) may stretch that."""

    silent_after_s: float
    #: The longest a stretched deadline gets.
    max_silent_after_s: float
    #: This long without a silence halves a stretched deadline.
    calm_after_s: float

    def __post_init__(self) -> None:
        if not 0 < self.silent_after_s <= self.max_silent_after_s:
            raise ValueError(f"max_silent_after_s ({self.max_silent_after_s:g}) must be at "
                             f"least silent_after_s ({self.silent_after_s:g}), which must "
                             "be above 0")


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
    """The API looked at the node at its :func:`check_at` time without a ping arriving,
    having run up to ``lag_s`` behind lately (rule 8)."""

    stream: int
    now: float
    lag_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Ended:
    """``stream`` ended, and how."""

    stream: int
    now: float
    how: Ending


LivenessEvent = Opened | Pinged | Checked | Ended


@dataclass(frozen=True, slots=True)
class NodeLiveness:
    """One node's liveness: its newest stream, its last sign of life, whether (since when)
    it is silent and whether that silence was a quiet stretch (not a broken stream), and
    how many times its deadline is doubled (rule 7) and since when."""

    stream: int
    last_ping_at: float
    silent_since: float | None = None
    silent_on_quiet: bool = False
    stretch: int = 0
    stretched_at: float = 0.0


@dataclass(frozen=True, slots=True)
class WentSilent:
    """The node just went silent: tell its deployments, keep placement off it."""

    reason: str


@dataclass(frozen=True, slots=True)
class CameBack:
    """The node was silent and is alive again after ``silent_for_s``."""

    silent_for_s: float


Verdict = WentSilent | CameBack


def step(state: NodeLiveness | None, event: LivenessEvent, *, deadlines: Deadlines,
         ) -> tuple[NodeLiveness | None, Verdict | None]:
    """The node's liveness after ``event``, and what the API must do about it, if anything.

    ``None`` state: the API is not following the node (never connected, said ``bye``, or
    the API is closing).
    """
    if isinstance(event, Opened):
        return _on_opened(state, event, deadlines)
    if state is None or event.stream != state.stream:
        return state, None  # rule 1: not the node's newest stream
    match event:
        case Pinged():
            return _on_pinged(state, event, deadlines)
        case Checked():
            return _on_checked(state, event, deadlines)
        case Ended():
            return _on_ended(state, event, deadlines)


def check_at(state: NodeLiveness | None, *, deadlines: Deadlines,
             lag_s: float = 0.0) -> float | None:
    """When the node goes silent unless a ping arrives first, for an API that has run up
    to ``lag_s`` behind lately; None when nothing is due (not followed, or already
    silent)."""
    if state is None or state.silent_since is not None:
        return None
    return state.last_ping_at + deadline_s(state, deadlines) + lag_allowance_s(lag_s,
                                                                               deadlines)


def lag_allowance_s(lag_s: float, deadlines: Deadlines) -> float:
    """What an API ``lag_s`` behind adds to a deadline (rule 8): its lag, at most
    ``max_silent_after_s``."""
    return min(max(lag_s, 0.0), deadlines.max_silent_after_s)


def deadline_s(state: NodeLiveness, deadlines: Deadlines) -> float:
    """The node's silence deadline now: the base one, doubled once per ``stretch``."""
    return min(math.ldexp(deadlines.silent_after_s, state.stretch),
               deadlines.max_silent_after_s)


def is_current(state: NodeLiveness | None, stream: int) -> bool:
    """Whether ``stream`` is the node's newest stream (its reader should keep reading)."""
    return state is not None and state.stream == stream


def _on_opened(state: NodeLiveness | None, event: Opened, deadlines: Deadlines,
               ) -> tuple[NodeLiveness, Verdict | None]:
    if state is None:
        return NodeLiveness(stream=event.stream, last_ping_at=event.now), None
    # A new stream is the same node: its damping carries over (a flapping agent that also
    # reconnects stays damped).
    alive = _alive(state, event.now, deadlines)
    return (replace(alive, stream=event.stream, last_ping_at=event.now),
            _back(state, event.now))


def _on_pinged(state: NodeLiveness, event: Pinged, deadlines: Deadlines,
               ) -> tuple[NodeLiveness, Verdict | None]:
    alive = _alive(state, event.now, deadlines)
    return replace(alive, last_ping_at=event.now), _back(state, event.now)


def _on_checked(state: NodeLiveness, event: Checked, deadlines: Deadlines,
                ) -> tuple[NodeLiveness, Verdict | None]:
    quiet = event.now - state.last_ping_at
    deadline = deadline_s(state, deadlines)
    allowance = lag_allowance_s(event.lag_s, deadlines)
    if state.silent_since is not None or quiet < deadline + allowance:
        return state, None
    reason = f"no ping for {quiet:.1f}s (silent after {deadline:g}s"
    if state.stretch:
        reason += f", stretched from {deadlines.silent_after_s:g}s: it came back quickly " \
                  "before"
    if allowance:
        reason += f"; the API itself ran {allowance:.1f}s behind"
    return (replace(state, silent_since=event.now, silent_on_quiet=True),
            WentSilent(reason + ")"))


def _on_ended(state: NodeLiveness, event: Ended, deadlines: Deadlines,
              ) -> tuple[NodeLiveness | None, Verdict | None]:
    match event.how:
        case Ending.BYE:
            return None, _back(state, event.now)
        case Ending.API_CLOSING:
            return None, None
        case Ending.BROKEN if state.silent_since is None:
            return (replace(state, silent_since=event.now, silent_on_quiet=False),
                    WentSilent("its liveness stream broke without a goodbye"))
        case Ending.BROKEN:
            return state, None


def _alive(state: NodeLiveness, now: float, deadlines: Deadlines) -> NodeLiveness:
    """The node showed life at ``now``: no longer silent, its deadline stretched (a quick
    return from a quiet silence) or relaxed (a calm stretch) by rule 7."""
    stretch, stretched_at = state.stretch, state.stretched_at
    if state.silent_since is not None:
        quick = now - state.silent_since < deadlines.max_silent_after_s
        if state.silent_on_quiet and quick and deadline_s(state, deadlines) < \
                deadlines.max_silent_after_s:
            stretch, stretched_at = stretch + 1, now
    elif stretch and now - stretched_at >= deadlines.calm_after_s:
        stretch, stretched_at = stretch - 1, now
    return replace(state, silent_since=None, silent_on_quiet=False, stretch=stretch,
                   stretched_at=stretched_at)


def _back(state: NodeLiveness | None, now: float) -> CameBack | None:
    if state is None or state.silent_since is None:
        return None
    return CameBack(silent_for_s=now - state.silent_since)
