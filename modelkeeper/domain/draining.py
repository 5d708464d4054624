"""Graceful stop: a replica leaves routing, its in-flight requests finish (bounded by a
grace period), then its engine stops. Pure: what the gateways' usage rows say, at a time.

The ``drain_replica`` activity marks the replica ``draining`` (only ``ready`` replicas are
routed, so every gateway drops it on the store's notification), then reads the replica's
usage rows, one per gateway worker, until :func:`check_drain` says it is drained or the
grace period is over. Every time here is the store's clock (the mark and the rows are
stamped by it), so no clock skew between hosts enters the decision.

The rules, in order, each with its test in ``tests/unit/test_draining.py``:

1. A row written after the mark is *fresh*. The store keeps a row of a replica that is no
   longer routable only from a worker that has already taken it out of routing (see
   ``RoutingStore.write_usage``), so a fresh count can only fall: 0 is final for that
   worker.
2. A row written before the mark, but less than :data:`STALE_AFTER_INTERVALS` flush
   intervals before now, is *pending*: a live worker that has not reported since the mark
   (its notification or its next flush is on the way), and may still hold requests. An
   older row is a worker that died without clearing its rows: ignored.
3. Drained: nothing pending, and every fresh row says 0. At once when there is a fresh
   row; otherwise once one flush interval has passed since the mark (a worker that routes
   a replica writes a row for it every interval, so that long a silence means none does).
4. Grace over, once ``grace_s`` has passed since the mark: what the fresh and pending rows
   still count is left in flight.
5. Otherwise: still draining.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from pydantic import Field

from .base import Frozen, Tolerant
from .ids import ReplicaId

#: The grace period when the caller names none: long enough for a typical chat completion
#: to finish, short enough that a stop (or a rolling restart of many replicas) is not held
#: up for long by one stuck stream.
DEFAULT_GRACE_S = 30.0
#: No grace beyond an hour: a request open that long is stuck, not finishing.
MAX_GRACE_S = 3600.0
#: A worker's row this many flush intervals old is a worker that is gone (it died without
#: clearing its rows, or lost the store): it writes every interval while alive, so five
#: missed ticks are not a hiccup. Bounds how long a dead worker's row holds up a drain.
STALE_AFTER_INTERVALS = 5


class DrainReplicaInput(Tolerant):
    """Input of ``drain_replica``."""

    replica_id: ReplicaId
    #: How long in-flight requests may take to finish, counted from the mark.
    grace_s: float = Field(default=DEFAULT_GRACE_S, gt=0, le=MAX_GRACE_S)


class DrainReplicaResult(Tolerant):
    """How a drain ended: drained (``in_flight_left`` 0) or its grace period over."""

    #: Seconds from the mark to the end (the first attempt's mark, on a retry).
    waited_s: float
    #: Requests the gateways still had open at the end; 0 unless timed out.
    in_flight_left: int
    timed_out: bool


class UsageReport(Frozen):
    """One gateway worker's usage row of one replica, as the store holds it."""

    gateway_id: str
    in_flight: int = Field(ge=0)
    #: When the worker last wrote it (store clock).
    updated_at: datetime


class Drained(Frozen):
    """No gateway holds a request at the replica any more."""

    reason: str


class GraceOver(Frozen):
    """The grace period is over with requests still open (or unaccounted for)."""

    in_flight: int
    #: Workers that had not reported since the mark.
    pending: tuple[str, ...]


class StillDraining(Frozen):
    """Keep waiting."""

    in_flight: int
    pending: tuple[str, ...]


DrainVerdict = Drained | GraceOver | StillDraining


def stale_after_s(flush_interval_s: float) -> float:
    """How old a worker's row must be to count as a worker gone (rule 2)."""
    return STALE_AFTER_INTERVALS * flush_interval_s


def check_drain(reports: Sequence[UsageReport], *, marked_at: datetime, now: datetime,
                grace_s: float, flush_interval_s: float) -> DrainVerdict:
    """Whether a replica marked draining at ``marked_at`` is drained at ``now``, going by
    its usage rows; the rules are in the module docstring."""
    stale_before = now - timedelta(seconds=stale_after_s(flush_interval_s))
    fresh = [r for r in reports if r.updated_at > marked_at]
    pending = [r for r in reports if stale_before < r.updated_at <= marked_at]
    in_flight = sum(r.in_flight for r in fresh) + sum(r.in_flight for r in pending)
    if not pending and in_flight == 0:
        if fresh:
            return Drained(reason=f"{len(fresh)} gateway worker(s) report 0 in flight")
        waited = now - marked_at
        if waited >= timedelta(seconds=flush_interval_s):
            return Drained(reason=f"no gateway worker reported it in {waited.total_seconds():.1f}s "
                           f"(one flush interval: {flush_interval_s:g}s)")
    pending_ids = tuple(r.gateway_id for r in pending)
    if now - marked_at >= timedelta(seconds=grace_s):
        return GraceOver(in_flight=in_flight, pending=pending_ids)
    return StillDraining(in_flight=in_flight, pending=pending_ids)
