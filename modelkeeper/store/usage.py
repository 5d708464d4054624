"""The gateways' usage rows as the control plane reads them: what a drain waits on, and
what a usage watch samples.

The gateway writes these rows through :mod:`.routing`, on its own pool; a drain takes its
replica out of routing first (:meth:`.deployments.DeploymentStore.mark_replica_draining`,
which answers the time from which a row counts). A usage watch reads every row written
within :func:`~modelkeeper.domain.draining.stale_after_s` of now (a worker that stopped
writing longer ago is gone, as a drain judges it too).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import asyncpg

from ..domain.demand import DemandSample, ReplicaUse
from ..domain.draining import UsageReport, stale_after_s
from ..domain.ids import DeploymentId, ReplicaId


class UsageStore:
    """The ``replica_usage`` and ``deployment_usage`` tables, read on the pool
    :class:`~.stores.Store` owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def replica_usage_since(self, replica_id: str, since: datetime
                                  ) -> tuple[datetime, list[UsageReport]]:
        """The store's clock now, and each gateway worker's usage row of ``replica_id``
        written after ``since`` (a drain reads how many requests are still in flight)."""
        row = await self._pool.fetchrow(
            """
            SELECT clock_timestamp() AS now,
                   array_agg(gateway_id ORDER BY gateway_id) AS gateway_ids,
                   array_agg(in_flight ORDER BY gateway_id) AS in_flight,
                   array_agg(updated_at ORDER BY gateway_id) AS updated_at
            FROM replica_usage WHERE replica_id = $1 AND updated_at > $2
            """,
            replica_id, since)
        assert row is not None  # an aggregate without GROUP BY always returns one row
        reports = [UsageReport(gateway_id=g, in_flight=n, updated_at=at)
                   for g, n, at in zip(row["gateway_ids"] or [], row["in_flight"] or [],
                                       row["updated_at"] or [], strict=True)]
        return row["now"], reports

    async def demand_samples(self, deployment_ids: Collection[DeploymentId], *,
                             flush_interval_s: float) -> dict[DeploymentId, DemandSample]:
        """What the gateways report of each of ``deployment_ids`` now, in one query.

        Only rows fresher than :func:`stale_after_s` of the gateways' flush interval
        count (older ones are workers gone). Per replica, summed over the workers with a
        fresh row: in flight summed, last used and ``reporting_since`` the latest (rule 1
        of :mod:`modelkeeper.domain.demand`: it knows nothing from before the last worker
        began reporting). A replica no worker reports freshly is left out: unknown, not
        idle. Per deployment: waiting summed, last request the latest, and the engines'
        queues summed over its replicas, each replica's the largest any worker scraped
        (every worker scrapes the same engine, so a sum over workers would count one
        queue once per worker; the largest, so that a worker whose scrape failed or lags
        does not hide it; unknown counts as none); the model's measured concurrency,
        the least of its profiles' (None when never measured). Every id asked
        for gets a sample (an empty one when nothing reports it), stamped with the
        store's clock, the clock the rows' ``updated_at`` come from.
        """
        if not deployment_ids:
            return {}
        # now() is the statement's start: one instant for the freshness bound and `at`.
        rows = await self._pool.fetch(
            """
            WITH wanted AS (SELECT DISTINCT unnest($1::text[]) AS deployment_id),
            uses AS (
                SELECT r.deployment_id, u.replica_id,
                       sum(u.in_flight)::int AS in_flight,
                       max(u.last_used_at) AS last_used_at,
                       max(u.reporting_since) AS reporting_since,
                       -- Every worker scrapes the same engine: its queue once, not
                       -- once per worker. NULL (unknown) where none knows it.
                       max(u.engine_waiting) AS engine_waiting
                FROM replica_usage u JOIN replicas r USING (replica_id)
                WHERE r.deployment_id = ANY($1::text[])
                  AND u.updated_at > now() - make_interval(secs => $2)
                GROUP BY r.deployment_id, u.replica_id),
            waits AS (
                SELECT deployment_id, sum(waiting)::int AS waiting,
                       max(last_request_at) AS last_request_at
                FROM deployment_usage
                WHERE deployment_id = ANY($1::text[])
                  AND updated_at > now() - make_interval(secs => $2)
                GROUP BY deployment_id)
            SELECT w.deployment_id, now() AS now,
                   -- What one replica was measured to serve: the least of the model's
                   -- profiles (modelkeeper.domain.measured.most_cautious).
                   -- (of the catalog model it runs: a switch changes it.)
                   (SELECT min(mc.concurrency) FROM deployments d
                    JOIN measured_capacity mc
                        ON mc.model_id = COALESCE(d.runs_model_id, d.model_id)
                    WHERE d.deployment_id = w.deployment_id) AS measured_concurrency,
                   coalesce(min(waits.waiting), 0) AS waiting,
                   min(waits.last_request_at) AS last_request_at,
                   coalesce(sum(uses.engine_waiting), 0)::int AS engine_waiting,
                   array_agg(uses.replica_id ORDER BY uses.replica_id)
                       FILTER (WHERE uses.replica_id IS NOT NULL) AS replica_ids,
                   array_agg(uses.in_flight ORDER BY uses.replica_id)
                       FILTER (WHERE uses.replica_id IS NOT NULL) AS in_flight,
                   array_agg(uses.last_used_at ORDER BY uses.replica_id)
                       FILTER (WHERE uses.replica_id IS NOT NULL) AS last_used_at,
                   array_agg(uses.reporting_since ORDER BY uses.replica_id)
                       FILTER (WHERE uses.replica_id IS NOT NULL) AS reporting_since
            FROM wanted w
            LEFT JOIN waits USING (deployment_id)
            LEFT JOIN uses USING (deployment_id)
            GROUP BY w.deployment_id
            """,
            list(deployment_ids), stale_after_s(flush_interval_s))
        return {DeploymentId(row["deployment_id"]): DemandSample(
            at=row["now"], waiting=row["waiting"], last_request_at=row["last_request_at"],
            engine_waiting=row["engine_waiting"],
            measured_concurrency=row["measured_concurrency"],
            replicas=[ReplicaUse(replica_id=ReplicaId(r), in_flight=n, last_used_at=used,
                                 reporting_since=since)
                      for r, n, used, since in zip(
                          row["replica_ids"] or [], row["in_flight"] or [],
                          row["last_used_at"] or [], row["reporting_since"] or [],
                          strict=True)]) for row in rows}
