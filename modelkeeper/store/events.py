"""The audit log: events appended by the API and the keeper, read by the API.

A deployment's sweep appends its event in the sweep's own transaction
(:meth:`.deployments.DeploymentStore.sweep_deployment`), so it writes that row itself.
"""

from __future__ import annotations

import asyncpg

from ..domain.events import Event, NewEvent
from ..domain.notify import CantPlaceSeen
from ..domain.status import DeploymentStatus
from .pool import record


class EventStore:
    """The ``events`` table, on the pool :class:`~.stores.Store` owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def record_event(self, event: NewEvent, *,
                           idempotency_key: str | None = None) -> Event:
        """Append one entry to the audit log; with ``idempotency_key``, at most once.

        A second call with the same key (a retried activity whose first attempt committed)
        appends nothing and returns the entry the first call appended, as it was stored.
        Two calls racing with one key both return that one entry: the loser's INSERT waits
        on the unique index for the winner to commit, then reads what it committed.
        """
        row = await self._pool.fetchrow(
            """
            INSERT INTO events (kind, message, deployment_id, node_id, replica_id, data,
                                idempotency_key, actor)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
            ON CONFLICT (idempotency_key) DO NOTHING
            RETURNING event_id, at
            """,
            event.kind, event.message, event.deployment_id, event.node_id, event.replica_id,
            event.data, idempotency_key, event.actor,
        )
        if row is not None:
            return Event(**event.model_dump(), event_id=row["event_id"], at=row["at"])
        # A separate statement, so its snapshot includes the entry the INSERT waited for.
        stored = await self._pool.fetchrow(
            "SELECT event_id, at, kind, message, deployment_id, node_id, replica_id, data, "
            "actor FROM events WHERE idempotency_key = $1", idempotency_key)
        assert stored is not None  # events are append-only: a conflicting entry stays
        return Event(**record(stored))

    async def list_events(self, *, deployment_id: str | None = None,
                          limit: int = 100) -> list[Event]:
        """The newest ``limit`` audit entries, oldest first, optionally for one deployment."""
        rows = await self._pool.fetch(
            """
            SELECT * FROM (
                SELECT event_id, at, kind, message, deployment_id, node_id, replica_id, data,
                       actor
                FROM events
                WHERE $1::text IS NULL OR deployment_id = $1
                ORDER BY event_id DESC
                LIMIT $2
            ) newest ORDER BY event_id
            """,
            deployment_id, limit,
        )
        return [Event(**record(row)) for row in rows]

    async def cant_place_since(self, deployment_id: str) -> CantPlaceSeen:
        """When the deployment's current unplaceable stretch began: the first
        ``deployment.cant_place`` entry after its latest entry of another status (or its
        deletion); None when its latest status entry is not cant_place. Read from the
        audit log, which the keeper writes at every status it records, so no column
        tracks it; the index by deployment keeps it to the deployment's own entries."""
        cant_place = f"deployment.{DeploymentStatus.CANT_PLACE.value}"
        others = [f"deployment.{s.value}" for s in DeploymentStatus
                  if s is not DeploymentStatus.CANT_PLACE]
        row = await self._pool.fetchrow(
            """
            SELECT now() AS now,
                   (SELECT min(at) FROM events
                    WHERE deployment_id = $1 AND kind = $2 AND event_id > COALESCE(
                        (SELECT max(event_id) FROM events
                         WHERE deployment_id = $1 AND kind = ANY($3::text[])), 0)) AS since,
                   (SELECT placement_error FROM deployments
                    WHERE deployment_id = $1) AS reason
            """,
            deployment_id, cant_place, [*others, "deployment.deleted", "deployment.swept"])
        assert row is not None
        return CantPlaceSeen(since=row["since"], now=row["now"], reason=row["reason"])
