"""Usage for idle stop and autoscaling: each tick, one batch to the store.

Requests only touch counters in memory (the endpoint's in-flight count and last-used
time, the model's waiting count); this task copies them to the store once per tick, so
the database sees one write per worker per tick however many requests there are.

Three moments do not wait for the tick (:meth:`UsageReporter.nudge`): a replica leaving
routing, and the last request of a replica out of routing ending, since a drain waits for
just those rows; and a first request held for a model none of whose replicas is ready,
since its waiting count rising from 0 in the store is what asks the control plane to load
or wake it (the demand trigger of migration 0016), and a tick would be added to every
load. The first two happen once per replica that leaves, the third once per model each
time its held requests rise from none, never per request. :class:`UsageTracker` hears
of all three, and keeps each replica's metric series in step with its entering and
leaving routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from modelkeeper.store.routing import DeploymentUsage, ReplicaUsage, RoutingStore

from .breaker import BreakerState
from .engine_queue import EngineQueues
from .metrics import GatewayMetrics
from .table import Endpoint, ModelRoute, RoutingTable, TableChange

log = logging.getLogger(__name__)


def _when(timestamp: float) -> datetime | None:
    return datetime.fromtimestamp(timestamp, UTC) if timestamp else None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The usage rows describing a table at one moment."""

    #: Replicas routed to.
    replicas: list[ReplicaUsage]
    #: Replicas out of routing with a count not yet written down to 0.
    leaving: list[ReplicaUsage]
    deployments: list[DeploymentUsage]
    #: Endpoints out of routing counted at 0 here: once written, the table forgets them.
    done: list[Endpoint]
    #: Models with requests turned away "loading" counted as waiting here, and how many:
    #: once written, they are not counted again.
    turned_away: list[tuple[ModelRoute, int]]


def _add(row: ReplicaUsage | None, endpoint: Endpoint) -> ReplicaUsage:
    """``row`` with ``endpoint``'s requests added: one replica can have an endpoint in
    routing and one leaving (it moved), or several leaving, and the store keeps one row
    per worker and replica."""
    if row is None:
        # Out of routing, its engine's queue is no longer asked: unknown.
        return ReplicaUsage(endpoint.replica_id, endpoint.in_flight, _when(endpoint.last_used))
    last = _when(endpoint.last_used)
    if row.last_used_at is not None and (last is None or row.last_used_at > last):
        last = row.last_used_at
    return ReplicaUsage(row.replica_id, row.in_flight + endpoint.in_flight, last,
                        row.engine_waiting)


def snapshot(table: RoutingTable) -> Snapshot:
    """The usage rows describing ``table`` right now."""
    routed = {e.replica_id: ReplicaUsage(e.replica_id, e.in_flight, _when(e.last_used),
                                         e.engine_waiting)
              for e in table.endpoints()}
    leaving: dict[str, ReplicaUsage] = {}
    done: list[Endpoint] = []
    for endpoint in table.leaving:
        if endpoint.in_flight == 0:
            done.append(endpoint)
        # Counted in the routed row if the replica is routed again (at a new address):
        # that row is the one the store checks against the replica's state.
        rows = routed if endpoint.replica_id in routed else leaving
        rows[endpoint.replica_id] = _add(rows.get(endpoint.replica_id), endpoint)
    # A request turned away "loading" without a hold (a load wait of 0) counts as waiting
    # in one write: its demand reaches the store as a held request's does.
    deployments = [DeploymentUsage(m.route.deployment_id, m.waiting + m.turned_away,
                                   _when(m.last_request))
                   for m in table.models.values()]
    turned_away = [(m, m.turned_away) for m in table.models.values() if m.turned_away]
    return Snapshot(list(routed.values()), list(leaving.values()), deployments, done,
                    turned_away)


class UsageReporter:
    """Writes one worker's usage every ``interval_s``, and deletes it at close."""

    def __init__(self, routes: RoutingStore, table: RoutingTable, gateway_id: str,
                 interval_s: float, *, queues: EngineQueues | None = None) -> None:
        self._routes = routes
        self._table = table
        self._gateway_id = gateway_id
        self._interval_s = interval_s
        #: Scraped once per tick, never per nudge: a storm of nudges asks no engine more.
        self._queues = queues
        self._next_scrape = 0.0
        self._task: asyncio.Task[None] | None = None
        #: Completed flushes (tests wait on it).
        self.flushes = 0
        self._failing_since: float | None = None
        #: Set by :meth:`nudge`: flush now instead of at the end of the tick.
        self._wake = asyncio.Event()

    def start(self) -> None:
        """Start the ticking task."""
        if self._queues is not None:
            self._queues.open()
        self._task = asyncio.create_task(self._run(), name="usage-reporter")

    def nudge(self) -> None:
        """Flush as soon as possible rather than at the next tick: a replica left routing,
        or the last request of one out of routing ended, and a drain waits for that row;
        or a model with no ready replica is asked for. Nudges before or during a flush
        bring one more flush, not one each."""
        self._wake.set()

    async def flush(self) -> None:
        """Write the current usage now."""
        rows = snapshot(self._table)
        await self._routes.write_usage(self._gateway_id, rows.replicas, rows.deployments,
                                       leaving=rows.leaving)
        # Only once written: after a failed write, they are reported again next time.
        self._table.forget_left(rows.done)
        for entry, count in rows.turned_away:
            entry.turned_away -= count
        self.flushes += 1

    async def _run(self) -> None:
        while True:
            ticked = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._wake.wait()
                    ticked = False
            self._wake.clear()
            self._scrape_queues(ticked=ticked)
            try:
                await self.flush()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                    TimeoutError) as exc:
                # Usage is advisory: serving goes on without it. Say so once per outage.
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    log.warning("cannot write usage to the store (%s); will keep trying", exc)
                continue
            if self._failing_since is not None:
                log.info("writing usage again after %.0fs",
                         time.monotonic() - self._failing_since)
                self._failing_since = None

    def _scrape_queues(self, *, ticked: bool) -> None:
        """Start a round of engine queue scrapes on a tick, or on a nudge once a tick has
        passed since the last round (nudges in a row must not starve them). The answers
        land on the endpoints as they come: each write takes the latest."""
        now = time.monotonic()
        if self._queues is None or (not ticked and now < self._next_scrape):
            return
        self._next_scrape = now + self._interval_s
        self._queues.scrape()

    async def close(self) -> None:
        """Stop ticking and remove this worker's rows: it holds no requests any more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._queues is not None:
            await self._queues.close()
        try:
            await asyncio.wait_for(self._routes.clear_usage(self._gateway_id), 5)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            log.warning("could not remove this worker's usage rows (%s); they go stale", exc)


class UsageTracker:
    """This worker's usage as replicas come and go: the reporter that writes it (from
    :meth:`start`), nudged when a drain waits for a row, and each replica's metric
    series, which start when it enters routing and go once it has left with nothing open.
    """

    def __init__(self, table: RoutingTable, metrics: GatewayMetrics, *, gateway_id: str,
                 interval_s: float, queues: EngineQueues | None = None) -> None:
        self._table = table
        self._metrics = metrics
        self._gateway_id = gateway_id
        self._interval_s = interval_s
        self._queues = queues
        #: None until :meth:`start`: before it there is no store to write to.
        self.reporter: UsageReporter | None = None

    def start(self, routes: RoutingStore) -> None:
        """Start writing usage to ``routes`` once per tick."""
        self.reporter = UsageReporter(routes, self._table, self._gateway_id,
                                      self._interval_s, queues=self._queues)
        self.reporter.start()

    async def close(self) -> None:
        """Stop writing, and remove this worker's rows."""
        if self.reporter is not None:
            await self.reporter.close()

    def applied(self, change: TableChange) -> None:
        """An update of the table from the store put replicas in or out of routing."""
        for endpoint in change.added:
            self._metrics.set_breaker(endpoint.replica_id, BreakerState.CLOSED)
            log.info("routing %s to replica %s at %s", endpoint.model, endpoint.replica_id,
                     endpoint.url)
        for endpoint in change.removed:
            if endpoint.in_flight == 0:
                # With requests still open its series goes when they end (left), or the
                # gauge would be counted down from nothing.
                self._metrics.forget_replica(endpoint.model, endpoint.replica_id)
            log.info("replica %s of %s is out of routing (%d request(s) in flight)",
                     endpoint.replica_id, endpoint.model, endpoint.in_flight)
        if change.removed and self.reporter is not None:
            # A drain waits for this worker's row written after the replica left routing.
            self.reporter.nudge()

    def demand(self, entry: ModelRoute) -> None:
        """A request is held for ``entry``, none of whose replicas is ready, and no other
        of this worker's was: write its waiting count now, which asks the control plane
        to load or wake it, rather than at the next tick."""
        log.debug("%s asked for with no ready replica: writing its waiting count now",
                  entry.route.model_id)
        if self.reporter is not None:
            self.reporter.nudge()

    def left(self, endpoint: Endpoint) -> None:
        """The last request of an endpoint out of routing ended: write that down now (a
        drain is waiting for it) and drop its series, unless the replica is routed again
        at another address, whose series it shares."""
        if self.reporter is not None:
            self.reporter.nudge()
        entry = self._table.models.get(endpoint.model)
        if entry is None or all(e.replica_id != endpoint.replica_id for e in entry.endpoints):
            self._metrics.forget_replica(endpoint.model, endpoint.replica_id)
