"""Quotas per scope of the tenancy tree (migration 0021), and what each owner holds.

The rules (a limit refuses, a guarantee protects, the rest is borrowed) are pure, in
:mod:`modelkeeper.domain.capacity`; this module only reads and writes the rows they take.
One of the stores on the pool :class:`~.stores.Store` owns (``store.quotas``).
"""

from __future__ import annotations

import asyncpg

from ..domain.capacity import Holding, Limit, Quota, Resources

_COLUMNS = ("scope, guarantee_memory_bytes, guarantee_gpus, guarantee_cpu_cores, "
            "limit_memory_bytes, limit_gpus, limit_cpu_cores")


def _quota(row: asyncpg.Record) -> Quota:
    return Quota(scope=row["scope"],
                 guarantee=Resources(memory_bytes=row["guarantee_memory_bytes"],
                                     gpus=row["guarantee_gpus"],
                                     cpu_cores=row["guarantee_cpu_cores"]),
                 limit=Limit(memory_bytes=row["limit_memory_bytes"], gpus=row["limit_gpus"],
                             cpu_cores=row["limit_cpu_cores"]))


class QuotasStore:
    """The ``quotas`` table, and the holdings summed from the replicas' claims."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def set_quota(self, quota: Quota) -> Quota:
        """Create or replace ``quota.scope``'s quota, whole: a part left out is no longer
        guaranteed (0) or limited (None)."""
        g, lim = quota.guarantee, quota.limit
        row = await self._pool.fetchrow(
            f"""
            INSERT INTO quotas ({_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)
            ON CONFLICT (scope) DO UPDATE SET
                guarantee_memory_bytes = EXCLUDED.guarantee_memory_bytes,
                guarantee_gpus = EXCLUDED.guarantee_gpus,
                guarantee_cpu_cores = EXCLUDED.guarantee_cpu_cores,
                limit_memory_bytes = EXCLUDED.limit_memory_bytes,
                limit_gpus = EXCLUDED.limit_gpus,
                limit_cpu_cores = EXCLUDED.limit_cpu_cores,
                updated_at = now()
            RETURNING {_COLUMNS}
            """,
            quota.scope, g.memory_bytes, g.gpus, g.cpu_cores, lim.memory_bytes, lim.gpus,
            lim.cpu_cores)
        assert row is not None
        return _quota(row)

    async def get_quota(self, scope: str) -> Quota | None:
        """``scope``'s quota; None when it has none."""
        row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM quotas WHERE scope = $1",
                                        scope)
        return None if row is None else _quota(row)

    async def list_quotas(self) -> list[Quota]:
        """Every quota, by scope: a parent before its children."""
        rows = await self._pool.fetch(f"SELECT {_COLUMNS} FROM quotas ORDER BY scope")
        return [_quota(row) for row in rows]

    async def delete_quota(self, scope: str) -> bool:
        """Remove ``scope``'s quota; False when it had none."""
        return await self._pool.fetchval(
            "DELETE FROM quotas WHERE scope = $1 RETURNING true", scope) is not None

    async def holdings(self, *, excluding: str | None = None) -> list[Holding]:
        """What each owner's replicas hold now, summed from their claims: memory, GPUs
        (each claimed GPU index counts one) and CPU cores. Deployments with no owner are
        left out (no scope counts them), and so is ``excluding``, a deployment whose own
        holding the caller replaces with what it asks (a scale, a change of owner)."""
        rows = await self._pool.fetch(
            """
            SELECT d.owner,
                   coalesce(sum(a.memory_bytes), 0)::bigint AS memory_bytes,
                   coalesce(sum(cardinality(a.gpu_indices)), 0)::bigint AS gpus,
                   coalesce(sum(a.cpu_cores), 0)::double precision AS cpu_cores
            FROM allocations a
            JOIN replicas r ON r.replica_id = a.replica_id
            JOIN deployments d ON d.deployment_id = r.deployment_id
            WHERE d.owner IS NOT NULL AND d.deployment_id IS DISTINCT FROM $1
            GROUP BY d.owner
            ORDER BY d.owner
            """,
            excluding)
        return [Holding(owner=row["owner"],
                        resources=Resources(memory_bytes=row["memory_bytes"],
                                            gpus=row["gpus"], cpu_cores=row["cpu_cores"]))
                for row in rows]
