"""Usage for idle stop and autoscaling: each tick, one batch to the store.

Requests only touch counters in memory (the endpoint's in-flight count and last-used
time, the model's waiting count); this task copies them to the store once per tick, so
the database sees one write per worker per tick however many requests there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime

import asyncpg

from modelkeeper.store.routing import DeploymentUsage, ReplicaUsage, RoutingStore

from .table import RoutingTable

log = logging.getLogger(__name__)


def _when(timestamp: float) -> datetime | None:
    return datetime.fromtimestamp(timestamp, UTC) if timestamp else None


def snapshot(table: RoutingTable) -> tuple[list[ReplicaUsage], list[DeploymentUsage]]:
    """The usage rows describing ``table`` right now."""
    replicas = [ReplicaUsage(e.replica_id, e.in_flight, _when(e.last_used))
                for e in table.endpoints()]
    deployments = [DeploymentUsage(m.route.deployment_id, m.waiting, _when(m.last_request))
                   for m in table.models.values()]
    return replicas, deployments


class UsageReporter:
    """Writes one worker's usage every ``interval_s``, and deletes it at close."""

    def __init__(self, routes: RoutingStore, table: RoutingTable, gateway_id: str,
                 interval_s: float) -> None:
        self._routes = routes
        self._table = table
        self._gateway_id = gateway_id
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        #: Completed flushes (tests wait on it).
        self.flushes = 0
        self._failing_since: float | None = None

    def start(self) -> None:
        """Start the ticking task."""
        self._task = asyncio.create_task(self._run(), name="usage-reporter")

    async def flush(self) -> None:
        """Write the current usage now."""
        replicas, deployments = snapshot(self._table)
        await self._routes.write_usage(self._gateway_id, replicas, deployments)
        self.flushes += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
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

    async def close(self) -> None:
        """Stop ticking and remove this worker's rows: it holds no requests any more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await asyncio.wait_for(self._routes.clear_usage(self._gateway_id), 5)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            log.warning("could not remove this worker's usage rows (%s); they go stale", exc)
