"""A per-replica circuit breaker.

Closed: the replica takes traffic. After ``failures_to_open`` failures in a row it opens
and takes none for ``open_s``. Then it is half-open: one trial request goes through; a
success closes it, a failure opens it again for twice as long (up to ``max_open_s``), so
a replica that stays broken costs one failed request per period instead of one per
request.

Pure and clock-driven (callers pass ``time.monotonic()`` values), so tests step it.
"""

from __future__ import annotations

from enum import IntEnum


class BreakerState(IntEnum):
    """The breaker's state; the value is what the ``breaker_state`` metric shows."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Breaker:
    """One replica's breaker. Not thread-safe: the gateway runs one event loop per process."""

    __slots__ = ("_open_for", "_trial_running", "failures", "failures_to_open", "max_open_s",
                 "open_s", "opened_until", "state", "trials")

    def __init__(self, failures_to_open: int, open_s: float, max_open_s: float = 60.0) -> None:
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.max_open_s = max(max_open_s, open_s)
        self.state = BreakerState.CLOSED
        #: Failures in a row since the last success.
        self.failures = 0
        #: When an open breaker lets its next trial through (monotonic seconds).
        self.opened_until = 0.0
        self._open_for = open_s
        self._trial_running = False
        #: Trial requests ever let through: a request that gave up on this replica sees
        #: by this count that it has been tried again since (and may have recovered).
        self.trials = 0

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now."""
        if self.state is BreakerState.CLOSED:
            return True
        if self._trial_running:
            return False
        return self.state is BreakerState.HALF_OPEN or now >= self.opened_until

    def begin(self, now: float) -> None:
        """A request is being sent (after :meth:`allows` said yes)."""
        if self.state is BreakerState.CLOSED or (
                self.state is BreakerState.OPEN and now < self.opened_until):
            return
        # Open and due, or half-open: this request is the one trial.
        self.state = BreakerState.HALF_OPEN
        self._trial_running = True
        self.trials += 1

    def success(self) -> None:
        """The replica answered: close."""
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._open_for = self.open_s
        self._trial_running = False

    def failure(self, now: float) -> None:
        """The replica failed a request."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            # The trial failed: stay out longer this time.
            self._open_for = min(self._open_for * 2, self.max_open_s)
            self._open(now)
        elif self.state is BreakerState.CLOSED and self.failures >= self.failures_to_open:
            self._open(now)
        # Already open: a request that began before it opened failed too; nothing changes.

    def abandon(self) -> None:
        """A request ended with no verdict (its client left): free the trial slot."""
        self._trial_running = False

    def next_trial_at(self) -> float | None:
        """When an open breaker will let a trial through; None unless open."""
        return self.opened_until if self.state is BreakerState.OPEN else None

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_until = now + self._open_for
        self._trial_running = False
