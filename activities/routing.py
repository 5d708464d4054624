"""The routing activity (control worker): take a replica out of routing and wait, bounded
by a grace period, for the requests it has in flight to end, so that stopping its engine
afterwards cuts no request short.

What "drained" means is :func:`modelkeeper.domain.draining.check_drain`, a pure function
of the gateways' usage rows and the time; this module only reads the store and waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity

from modelkeeper.domain.draining import (
    Drained,
    DrainReplicaInput,
    DrainReplicaResult,
    GraceOver,
    StillDraining,
    check_drain,
    stale_after_s,
)
from modelkeeper.names import ACTIVITY_DRAIN_REPLICA
from modelkeeper.settings import Settings
from modelkeeper.store import Store

log = logging.getLogger(__name__)

#: How often a drain reads the usage rows. A gateway writes the row a drain waits for as
#: soon as the replica leaves routing and as soon as its last request ends (not at its
#: next tick), so the read is what delays the end: a fifth of a second adds little to a
#: stop, at five small indexed reads a second while a drain runs.
POLL_INTERVAL_S = 0.2
#: How often a drain heartbeats. Each heartbeat carries the mark time, so a retry goes on
#: with the same wait (and the same deadline) instead of starting a fresh one. The
#: workflow's heartbeat timeout must be several of these.
HEARTBEAT_INTERVAL_S = 1.0
#: The gateways' usage flush interval when the worker names none (the settings' default):
#: the drain must know it to tell a quiet gateway from one that is gone.
DEFAULT_USAGE_FLUSH_INTERVAL_S: float = Settings.model_fields["usage_flush_interval_s"].default


class RoutingActivities:
    """Activities that change what the gateways route to, bound to one store."""

    def __init__(self, store: Store, *,
                 usage_flush_interval_s: float = DEFAULT_USAGE_FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._flush_interval_s = usage_flush_interval_s
        self._clock = clock

    @activity.defn(name=ACTIVITY_DRAIN_REPLICA)
    async def drain_replica(self, request: DrainReplicaInput) -> DrainReplicaResult:
        """Mark the replica ``draining`` (the gateways stop sending it requests), then
        wait until every gateway reports 0 in flight for it in a row written after the
        mark, or until ``grace_s`` has passed since the mark.

        Idempotent: a retry marks nothing new and, from the heartbeat details, goes on
        with the first attempt's mark and deadline. A replica that is gone is drained at
        once. Heartbeats every :data:`HEARTBEAT_INTERVAL_S` while it waits.
        """
        replica_id = request.replica_id
        marked = await self._store.deployments.mark_replica_draining(replica_id)
        if marked is None:
            log.info("replica %s is gone: nothing to drain", replica_id)
            return DrainReplicaResult(waited_s=0.0, in_flight_left=0, timed_out=False)
        state, marked_now = marked
        marked_at = _first_mark(activity.info().heartbeat_details) or marked_now
        activity.heartbeat(marked_at.timestamp())
        last_beat = self._clock()
        log.info("draining replica %s (%s; grace %gs)", replica_id, state.value,
                 request.grace_s)
        # Older rows are gateways gone (rule 2 of check_drain): not worth reading.
        since = marked_at - timedelta(seconds=stale_after_s(self._flush_interval_s))
        while True:
            now, reports = await self._store.usage.replica_usage_since(replica_id, since)
            waited_s = (now - marked_at).total_seconds()
            match check_drain(reports, marked_at=marked_at, now=now, grace_s=request.grace_s,
                              flush_interval_s=self._flush_interval_s):
                case Drained(reason=reason):
                    log.info("replica %s drained after %.1fs: %s", replica_id, waited_s,
                             reason)
                    return DrainReplicaResult(waited_s=waited_s, in_flight_left=0,
                                              timed_out=False)
                case GraceOver(in_flight=in_flight, pending=pending):
                    log.warning("replica %s: grace of %gs over with %d request(s) in flight"
                                "%s; stopping it anyway", replica_id, request.grace_s,
                                in_flight, _pending_note(pending))
                    return DrainReplicaResult(waited_s=waited_s, in_flight_left=in_flight,
                                              timed_out=True)
                case StillDraining():
                    pass
            if self._clock() - last_beat >= HEARTBEAT_INTERVAL_S:
                activity.heartbeat(marked_at.timestamp())
                last_beat = self._clock()
            await asyncio.sleep(POLL_INTERVAL_S)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the worker to register."""
        return [self.drain_replica]


def _first_mark(details: Sequence[Any]) -> datetime | None:
    """The mark time an earlier attempt heartbeated (seconds since the epoch, store
    clock); None on a first attempt."""
    if details and isinstance(details[0], int | float) and not isinstance(details[0], bool):
        return datetime.fromtimestamp(details[0], UTC)
    return None


def _pending_note(pending: Sequence[str]) -> str:
    return f" ({len(pending)} gateway worker(s) not heard from since the mark)" if pending \
        else ""
