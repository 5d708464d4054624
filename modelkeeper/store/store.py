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


def _record(row: asyncpg.Record) -> dict[str, Any]:
    return dict(row.items())
