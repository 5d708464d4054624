"""The gateways' usage rows as the control plane reads them: what a drain waits on.

The gateway writes these rows through :mod:`.routing`, on its own pool; a drain takes its
replica out of routing first (:meth:`.deployments.DeploymentStore.mark_replica_draining`,
which answers the time from which a row counts).
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from ..domain.draining import UsageReport


class UsageStore:
    """The ``replica_usage`` table, read on the pool :class:`~.stores.Store` owns."""

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
