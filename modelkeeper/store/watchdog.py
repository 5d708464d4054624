"""The memory watchdog's state (migration 0023): each node's memory level and the last
replica its watchdog stopped, and each model's OOM calibration. The rules are
:mod:`modelkeeper.domain.watchdog`'s; this module only reads and writes.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from ..domain.capacity import CapacityClass
from ..domain.ids import DeploymentId, ModelId, ReplicaId
from ..domain.watchdog import Calibration, MemoryLevel, MemoryReport, OomKill, ProtectCandidate
from .eviction import LISTED_STATES, _policy


class WatchdogStore:
    """Node memory levels, watchdog actions and model calibrations, on the store's pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def record_memory_level(self, node_id: str,
                                  report: MemoryReport) -> MemoryLevel | None:
        """Write the node's level when it changed: the level it had before, or None when
        it is unchanged (or the node unknown), and nothing written. Runs on every heartbeat
        that carries a report: unchanged, it is an UPDATE that matches no row."""
        row = await self._pool.fetchrow(
            """
            WITH prev AS (
                SELECT memory_level FROM nodes WHERE node_id = $1 FOR NO KEY UPDATE
            )
            UPDATE nodes SET memory_level = $2, memory_level_since = now(),
                             memory_level_reason = $3,
                             memory_level_changes = nodes.memory_level_changes + 1
            FROM prev
            WHERE nodes.node_id = $1 AND prev.memory_level IS DISTINCT FROM $2
            RETURNING prev.memory_level AS previous
            """,
            node_id, report.level.value, report.reason)
        return None if row is None else MemoryLevel(row["previous"])

    async def protect_candidates(self, node_id: str) -> list[ProtectCandidate]:
        """The replicas claiming on ``node_id`` that the watchdog may stop: those serving,
        asleep or starting (the others are on their way out), with their deployment's
        class and policy and what each claims on this node."""
        rows = await self._pool.fetch(
            """
            SELECT r.replica_id, r.deployment_id, d.capacity_class, d.scaling::text AS scaling,
                   SUM(a.memory_bytes)::bigint AS memory_bytes
            FROM allocations a
            JOIN replicas r ON r.replica_id = a.replica_id
            JOIN deployments d ON d.deployment_id = r.deployment_id
            WHERE a.node_id = $1 AND r.state = ANY($2::text[])
            GROUP BY r.replica_id, r.deployment_id, d.capacity_class, d.scaling::text
            ORDER BY r.replica_id
            """,
            node_id, sorted(s.value for s in LISTED_STATES))
        return [ProtectCandidate(
            replica_id=ReplicaId(row["replica_id"]),
            deployment_id=DeploymentId(row["deployment_id"]),
            capacity_class=(None if row["capacity_class"] is None
                            else CapacityClass(row["capacity_class"])),
            policy=_policy(row["scaling"]), memory_bytes=row["memory_bytes"] or 0)
            for row in rows]

    async def last_action(self, node_id: str) -> tuple[bool, datetime | None]:
        """(whether the node is known, when its watchdog last stopped a replica)."""
        row = await self._pool.fetchrow(
            "SELECT watchdog_acted_at FROM nodes WHERE node_id = $1", node_id)
        return (False, None) if row is None else (True, row["watchdog_acted_at"])

    async def claim_action(self, node_id: str, *, last: datetime | None,
                           now: datetime) -> bool:
        """Mark that the watchdog acts on ``node_id`` at ``now``, if its last action is
        still ``last``: of two API processes that read the same ``last``, one acts."""
        done = await self._pool.fetchval(
            "UPDATE nodes SET watchdog_acted_at = $3 WHERE node_id = $1 "
            "AND watchdog_acted_at IS NOT DISTINCT FROM $2 RETURNING true",
            node_id, last, now)
        return bool(done)

    async def record_oom_kill(self, kill: OomKill) -> Calibration | None:
        """Raise the model's calibration to the kill's peak (keeping a larger one); count
        the kill once, however often its heartbeat was sent. None: the model is gone."""
        row = await self._pool.fetchrow(
            """
            INSERT INTO model_calibrations AS c
                (model_id, peak_rss_bytes, oom_kills, last_replica_id)
            SELECT $1, $2, 1, $3 WHERE EXISTS (SELECT 1 FROM models WHERE model_id = $1)
            ON CONFLICT (model_id) DO UPDATE SET
                peak_rss_bytes = GREATEST(c.peak_rss_bytes, EXCLUDED.peak_rss_bytes),
                oom_kills = c.oom_kills + CASE WHEN c.last_replica_id
                    IS DISTINCT FROM EXCLUDED.last_replica_id THEN 1 ELSE 0 END,
                last_replica_id = EXCLUDED.last_replica_id, last_at = now()
            RETURNING model_id, peak_rss_bytes, oom_kills, last_at
            """,
            kill.model_id, kill.peak_rss_bytes, kill.replica_id)
        return None if row is None else _calibration(row)

    async def calibration(self, model_id: str) -> Calibration | None:
        """The model's calibration; None when it was never killed for memory."""
        row = await self._pool.fetchrow(
            "SELECT model_id, peak_rss_bytes, oom_kills, last_at FROM model_calibrations "
            "WHERE model_id = $1", model_id)
        return None if row is None else _calibration(row)


def _calibration(row: asyncpg.Record) -> Calibration:
    return Calibration(model_id=ModelId(row["model_id"]), peak_rss_bytes=row["peak_rss_bytes"],
                       oom_kills=row["oom_kills"], last_at=row["last_at"])
