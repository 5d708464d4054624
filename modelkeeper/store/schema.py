"""The schema: versioned migrations under ``migrations/`` and the runner that applies them.

Each component applies pending migrations when it starts; the queries themselves live in
the control plane's stores (:mod:`.control`) and :mod:`.routing` (the gateway's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

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


async def apply_migrations(pool: asyncpg.Pool, migrations: list[Migration] | None = None
                           ) -> list[int]:
    """Apply the migrations not yet applied; return the versions this call applied.

    Safe to run from several processes at once: a transaction-scoped advisory lock makes
    the second wait for the first and then find nothing left to do.
    """
    todo = load_migrations() if migrations is None else migrations
    applied_now: list[int] = []
    async with pool.acquire() as conn, conn.transaction():
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
