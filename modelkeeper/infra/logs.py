"""Log lines a long-running process writes while what it depends on is away.

A standalone agent outlives its control plane: the API and Temporal may be gone for
minutes while its engines keep serving. Its log must then say so in a few plain lines,
not fill with one warning per retry, tracebacks of connection errors, and the colour
codes Temporal's core writes to a terminal (they end up raw in a log file).

* :class:`LogBackoff` decides when a repeated failure is worth another line: the first at
  once, then after growing gaps, each saying how many it stands for.
* :class:`RepeatFilter` applies it to records the agent does not write itself (the
  Temporal SDK's and its core's), keyed by their message with the numbers taken out.
* :class:`OneLineFormatter` writes an error that only says a peer is unreachable as one
  line; any other exception keeps its traceback, which is how a bug is found. Every line
  it writes, traceback included, has its secrets scrubbed
  (:func:`modelkeeper.domain.redact.scrub_secrets`): a message or an exception that
  quotes a key must not put it in a log file.
* :func:`configure_logging` puts them together, and forwards Temporal's core logs into
  Python's logging (plain text, our format) instead of its coloured console output.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig
from temporalio.runtime import TelemetryFilter as CoreFilter
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.domain.redact import scrub_secrets

#: The first repeat of a failure is logged this long after the first line: an API or
#: Temporal that restarts is back within it, so a restart costs one line.
FIRST_REPEAT_GAP_S = 5.0
#: Each further line waits twice as long, up to this: someone tailing the log of an agent
#: whose control plane is gone still sees within a minute that it keeps trying.
MAX_REPEAT_GAP_S = 60.0
#: A failure not seen for this long starts over with a line at once: it is a new outage.
REPEAT_RESET_AFTER_S = 2 * MAX_REPEAT_GAP_S

#: The logger Temporal's core (Rust) logs are forwarded to; the SDK appends the target.
TEMPORAL_CORE_LOGGER = "temporalio.core"
#: Loggers whose repeated records :class:`RepeatFilter` thins out: the SDK's own and its
#: core's. Ours say themselves when they repeat (see ``agent.main``).
THINNED_LOGGERS = ("temporalio",)
#: Core logs at WARN and above, other crates' at ERROR: the SDK's own default levels.
CORE_LOG_FILTER = CoreFilter(core_level="WARN", other_level="ERROR")

#: RPC statuses that mean "the server is not there (yet)", not "the request is wrong".
UNREACHABLE_STATUSES = frozenset({RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED})

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_NUMBERS = re.compile(r"\d+(\.\d+)?")


@dataclass
class _Streak:
    """One kind of failure while it repeats."""

    next_line_at: float
    gap_s: float
    last_seen: float
    since: float
    held_back: int = 0


@dataclass
class LogBackoff:
    """When a failure that repeats is worth another line.

    Pure apart from its memory of each kind: time comes in as ``now``. A kind's first
    failure is logged at once; while it repeats, the next line comes FIRST_REPEAT_GAP_S
    later, then after twice that, up to MAX_REPEAT_GAP_S. :meth:`recovered` (or
    REPEAT_RESET_AFTER_S without it) ends the streak.
    """

    first_gap_s: float = FIRST_REPEAT_GAP_S
    max_gap_s: float = MAX_REPEAT_GAP_S
    reset_after_s: float = REPEAT_RESET_AFTER_S
    _streaks: dict[str, _Streak] = field(default_factory=dict)

    def failed(self, kind: str, *, now: float) -> int | None:
        """A failure of ``kind`` at ``now``: None to keep quiet, else the number of
        failures this line stands for (1 for the first; more once some were held back)."""
        streak = self._streaks.get(kind)
        if streak is None or now - streak.last_seen > self.reset_after_s:
            self._streaks[kind] = _Streak(next_line_at=now + self.first_gap_s,
                                          gap_s=self.first_gap_s, last_seen=now, since=now)
            return 1
        streak.last_seen = now
        if now < streak.next_line_at:
            streak.held_back += 1
            return None
        count = streak.held_back + 1
        streak.held_back = 0
        streak.gap_s = min(streak.gap_s * 2, self.max_gap_s)
        streak.next_line_at = now + streak.gap_s
        return count

    def recovered(self, kind: str, *, now: float) -> float | None:
        """``kind`` works again: how long it had been failing, or None if it was not."""
        streak = self._streaks.pop(kind, None)
        return None if streak is None else now - streak.since

    def next_gap_s(self, kind: str) -> float:
        """How long until the next line about ``kind`` at the earliest, for the line now."""
        streak = self._streaks.get(kind)
        return self.first_gap_s if streak is None else streak.gap_s


def repeat_note(count: int) -> str:
    """What a line that stands for ``count`` failures adds: `` (3 like it since the last
    line)``, or nothing for a single one."""
    return "" if count <= 1 else f" ({count - 1} more like it since the last line)"


class RepeatFilter(logging.Filter):
    """Thins out records of THINNED_LOGGERS that repeat, with :class:`LogBackoff`.

    Two records are the same kind when their logger and message match once numbers are
    taken out (``retried 6 times`` and ``retried 7 times`` are one kind). Records below
    WARNING pass untouched; so does everything from other loggers.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 backoff: LogBackoff | None = None) -> None:
        super().__init__()
        self._clock = clock
        self._backoff = backoff or LogBackoff()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(THINNED_LOGGERS):
            return True
        kind = f"{record.name}:{_NUMBERS.sub('N', record.getMessage())}"
        count = self._backoff.failed(kind, now=self._clock())
        if count is None:
            return False
        if count > 1:
            record.msg = record.getMessage() + repeat_note(count)
            record.args = None
        return True


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) only says a server could not be reached: a
    connection refused or reset, a timeout, Temporal answering UNAVAILABLE. Expected
    while the control plane is away, and no bug of ours."""
    for err in _chain(exc):
        if isinstance(err, RPCError) and err.status in UNREACHABLE_STATUSES:
            return True
        if isinstance(err, httpx.TransportError | ConnectionError | TimeoutError):
            return True
    return False


def one_line(exc: BaseException) -> str:
    """``ConnectError: All connection attempts failed``, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class OneLineFormatter(logging.Formatter):
    """The usual format, with an unreachable peer's exception (:func:`is_unreachable`)
    appended to the message in one line instead of a traceback. Any other exception keeps
    its traceback. Secrets are scrubbed from the whole of what it writes."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub_secrets(self._format(record))

    def _format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not is_unreachable(exc):
            return super().format(record)
        # A copy, so that any other handler still gets the exception itself.
        plain = logging.makeLogRecord(record.__dict__)
        plain.msg = f"{record.getMessage()} ({one_line(exc)})"
        plain.args = None
        plain.exc_info = None
        plain.exc_text = None
        return super().format(plain)


def forward_temporal_core_logs() -> None:
    """Send Temporal's core (Rust) logs through Python's logging, before any client
    exists: otherwise the core writes them to stderr itself, with colour codes, in its
    own format. Call once, at the start of a process (it replaces the default runtime,
    which clients created before keep)."""
    core_logger = logging.getLogger(TEMPORAL_CORE_LOGGER)
    Runtime.set_default(
        Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(
            filter=CORE_LOG_FILTER,
            # The logger name already carries the target; the message need not repeat it.
            forwarding=LogForwardingConfig(logger=core_logger,
                                           prepend_target_on_message=False)))),
        error_if_already_set=False)


def configure_logging(level: str) -> None:
    """Logging for a long-running process that must outlive its peers (the agent): our
    format, no colour codes, unreachable peers in one line, repeats thinned out."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    handler.addFilter(RepeatFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # One line per HTTP request drowns everything else at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    forward_temporal_core_logs()
