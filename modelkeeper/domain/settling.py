"""The settling window of a fresh control-plane worker. Pure.

A worker that has just started knows nothing about the fleet: agents are still
reconnecting (on a backoff of their own) and reporting what they already run. Placing
now would put replicas on whatever fraction of the fleet answered first. So placement
waits until the window has passed, or until the count of ready nodes has held steady
for half of it; either door alone is wrong (a fixed wait costs every restart the whole
window; waiting only for a steady count hangs on a fleet that never fully returns).
A steady count of no ready node does not open the early door: no agent has reported yet
(after a restart of `up`, the local agent's first heartbeat can come 10 s after the
worker's start on a loaded machine), and placing then can only answer "can't place:
unreachable" for nodes that are about to report. Only placement waits: adoption and
watches do not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SettlingWindow:
    """Tracks ready-node counts seen since the worker started (times in seconds)."""

    started_at: float
    window_s: float
    last_count: int | None = None
    last_change_at: float | None = None

    def observe(self, count: int, now: float) -> None:
        """Record the ready-node count seen at ``now``."""
        if count != self.last_count:
            self.last_count = count
            self.last_change_at = now

    def settled(self, now: float) -> bool:
        """True once placement may go ahead."""
        if now - self.started_at >= self.window_s:
            return True
        if self.last_change_at is None or not self.last_count:
            return False
        return now - self.last_change_at >= self.window_s / 2

    def remaining_s(self, now: float) -> float:
        """Seconds until the window ends at the latest."""
        return max(0.0, self.started_at + self.window_s - now)
