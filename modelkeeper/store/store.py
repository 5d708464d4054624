"""All of modelkeeper's SQL: the migration runner and the queries.

Nothing else in the code base writes a query; components call methods here (activities
and the API through it), so a schema change touches one module and its migration.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import asyncpg

from ..domain import Event, NewEvent
from ..nodes import AgentRegistration, Inventory, NodeRecord, NodeUpdate

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

#: Advisory-lock key that serializes migration runs across processes. Any constant works as
#: long as nothing else uses it; this is b"mkschema" read as a big-endian int64.
_MIGRATION_LOCK_KEY = int.from_bytes(b"mkschema", "big", signed=True)

_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    """One versioned SQL file: ``NNNN_description.sql``."""

    version: int
    name: str
    sql: str


def load_migrations(folder: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migrations in ``folder``, in version order; versions must run 1, 2, 3... with no gap."""
    found: list[Migration] = []
    for path in sorted(folder.glob("*.sql")):
        match = _MIGRATION_NAME.match(path.name)
        if match is None:
            raise ValueError(f"migration file {path.name!r} is not named NNNN_description.sql")
        found.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise ValueError(
                f"migration versions must be consecutive from 1: expected {expected:04d}, "
                f"found {migration.version:04d}_{migration.name}.sql"
            )
    return found


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb columns come back as Python objects, not strings.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads,
                              schema="pg_catalog")


class Store:
    """A pool of connections to modelkeeper's database and the queries over it."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 10,
                      migrate: bool = True) -> Self:
        """Open a pool to ``dsn`` and, unless told not to, bring the schema up to date."""
        pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size,
                                         init=_init_connection)
        store = cls(pool)
        if migrate:
            try:
                await store.migrate()
            except BaseException:
                await pool.close()
                raise
        return store

    async def close(self) -> None:
        """Close every connection."""
        await self._pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- schema ---------------------------------------------------------------------------

    async def migrate(self, migrations: list[Migration] | None = None) -> list[int]:
        """Apply the migrations not yet applied; return the versions this call applied.

        Safe to run from several processes at once: a transaction-scoped advisory lock makes
        the second wait for the first and then find nothing left to do.
        """
        todo = load_migrations() if migrations is None else migrations
        applied_now: list[int] = []
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK_KEY)
            await conn.execute(
                """
                CREATE TABLE IF NOT EXISTS schema_version (
                    version     integer PRIMARY KEY,
                    name        text NOT NULL,
                    applied_at  timestamptz NOT NULL DEFAULT now()
                )
                """
            )
            rows = await conn.fetch("SELECT version FROM schema_version")
            done = {row["version"] for row in rows}
            for migration in todo:
                if migration.version in done:
                    continue
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_version (version, name) VALUES ($1, $2)",
                    migration.version, migration.name,
                )
                applied_now.append(migration.version)
        return applied_now

    async def schema_versions(self) -> list[int]:
        """The migration versions recorded as applied."""
        rows = await self._pool.fetch("SELECT version FROM schema_version ORDER BY version")
        return [row["version"] for row in rows]

    async def ping(self) -> bool:
        """True when the database answers a trivial query."""
        return bool(await self._pool.fetchval("SELECT true"))

    # -- events ---------------------------------------------------------------------------

    async def record_event(self, event: NewEvent) -> Event:
        """Append one entry to the audit log."""
        row = await self._pool.fetchrow(
            """
            INSERT INTO events (kind, message, deployment_id, node_id, replica_id, data)
            VALUES ($1, $2, $3, $4, $5, $6)
            RETURNING event_id, at
            """,
            event.kind, event.message, event.deployment_id, event.node_id, event.replica_id,
            event.data,
        )
        assert row is not None
        return Event(**event.model_dump(), event_id=row["event_id"], at=row["at"])

    async def list_events(self, *, deployment_id: str | None = None,
                          limit: int = 100) -> list[Event]:
        """The newest ``limit`` audit entries, oldest first, optionally for one deployment."""
        rows = await self._pool.fetch(
            """
            SELECT * FROM (
                SELECT event_id, at, kind, message, deployment_id, node_id, replica_id, data
                FROM events
                WHERE $1::text IS NULL OR deployment_id = $1
                ORDER BY event_id DESC
                LIMIT $2
            ) newest ORDER BY event_id
            """,
            deployment_id, limit,
        )
        return [Event(**_record(row)) for row in rows]

    # -- nodes ----------------------------------------------------------------------------

    async def register_node(self, reg: AgentRegistration) -> NodeRecord:
        """Insert or refresh a node from its agent's registration.

        Operator labels and the cordon are left untouched: they outrank the agent's view
        and survive re-registration.
        """
        inv = reg.inventory
        await self._pool.execute(
            """
            INSERT INTO nodes (node_id, name, agent_labels, memory_total_bytes,
                               memory_available_bytes, cpu_count, gpus)
            VALUES ($1, $2, $3, $4, $5, $6, $7)
            ON CONFLICT (node_id) DO UPDATE SET
                name = EXCLUDED.name,
                agent_labels = EXCLUDED.agent_labels,
                memory_total_bytes = EXCLUDED.memory_total_bytes,
                memory_available_bytes = EXCLUDED.memory_available_bytes,
                cpu_count = EXCLUDED.cpu_count,
                gpus = EXCLUDED.gpus,
                registered_at = now(),
                last_seen = now()
            """,
            reg.node_id, reg.name, reg.labels, inv.memory_total_bytes,
            inv.memory_available_bytes, inv.cpu_count,
            [g.model_dump() for g in inv.gpus],
        )
        node = await self.get_node(reg.node_id)
        assert node is not None
        return node

    async def heartbeat_node(self, node_id: str, inv: Inventory) -> bool:
        """Record a heartbeat; False when the node is unknown (the agent must register)."""
        row = await self._pool.fetchval(
            """
            UPDATE nodes SET memory_total_bytes = $2, memory_available_bytes = $3,
                             cpu_count = $4, gpus = $5, last_seen = now()
            WHERE node_id = $1 RETURNING node_id
            """,
            node_id, inv.memory_total_bytes, inv.memory_available_bytes, inv.cpu_count,
            [g.model_dump() for g in inv.gpus],
        )
        return row is not None

    async def update_node(self, node_id: str, update: NodeUpdate) -> NodeRecord | None:
        """Apply operator settings; None when the node is unknown."""
        row = await self._pool.fetchval(
            """
            UPDATE nodes SET
                operator_labels = COALESCE($2, operator_labels),
                cordoned = COALESCE($3, cordoned),
                cordon_reason = CASE WHEN $3 IS FALSE THEN NULL
                                     ELSE COALESCE($4, cordon_reason) END
            WHERE node_id = $1 RETURNING node_id
            """,
            node_id, update.labels, update.cordoned, update.cordon_reason,
        )
        return None if row is None else await self.get_node(node_id)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        """One node with its claims; None when unknown."""
        row = await self._pool.fetchrow(
            _NODE_SELECT + " WHERE n.node_id = $1", node_id)
        return None if row is None else NodeRecord(**_record(row))

    async def list_nodes(self) -> list[NodeRecord]:
        """Every node with what its replicas claim on it, by name."""
        rows = await self._pool.fetch(_NODE_SELECT + " ORDER BY n.name, n.node_id")
        return [NodeRecord(**_record(row)) for row in rows]


_NODE_SELECT = """
    SELECT n.node_id, n.name, n.agent_labels, n.operator_labels, n.cordoned, n.cordon_reason,
           n.memory_total_bytes, n.memory_available_bytes, n.cpu_count, n.gpus, n.last_seen,
           n.registered_at,
           COALESCE(c.memory_claimed_bytes, 0) AS memory_claimed_bytes,
           COALESCE(c.cpu_claimed, 0) AS cpu_claimed,
           COALESCE(g.gpus_claimed, '{}') AS gpus_claimed
    FROM nodes n
    LEFT JOIN LATERAL (
        SELECT SUM(a.memory_bytes)::bigint AS memory_claimed_bytes,
               SUM(a.cpu_cores)::float8 AS cpu_claimed
        FROM allocations a WHERE a.node_id = n.node_id
    ) c ON true
    LEFT JOIN LATERAL (
        SELECT array_agg(i ORDER BY i) AS gpus_claimed
        FROM allocations a, unnest(a.gpu_indices) AS i WHERE a.node_id = n.node_id
    ) g ON true
"""


def _record(row: asyncpg.Record) -> dict[str, Any]:
    return dict(row.items())
