"""The store against a real PostgreSQL: migrations and the audit log."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.store import Migration, Store, load_migrations

pytestmark = pytest.mark.timeout(60)

TABLES = {"nodes", "models", "deployments", "replicas", "allocations", "events", "schema_version"}


async def test_migrations_create_every_table_and_record_versions(empty_database_url: str) -> None:
    async with await Store.connect(empty_database_url) as store:
        assert await store.schema_versions() == [m.version for m in load_migrations()]
    conn = await asyncpg.connect(empty_database_url)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await conn.close()
    assert {row["tablename"] for row in rows} >= TABLES


async def test_migrate_is_idempotent(empty_database_url: str) -> None:
    async with await Store.connect(empty_database_url, migrate=False) as store:
        first = await store.migrate()
        second = await store.migrate()
    assert first == [m.version for m in load_migrations()]
    assert second == []


async def test_concurrent_migrations_apply_each_version_once(empty_database_url: str) -> None:
    # A slow migration widens the window in which two unlocked runners would both apply it.
    slow = [*load_migrations(),
            Migration(len(load_migrations()) + 1, "slow_probe",
                      "SELECT pg_sleep(0.3); CREATE TABLE probe (id int);")]
    stores = [await Store.connect(empty_database_url, migrate=False) for _ in range(4)]
    try:
        results = await asyncio.gather(*(s.migrate(slow) for s in stores))
        applied = sorted(v for r in results for v in r)
        assert applied == [m.version for m in slow], results
        assert await stores[0].schema_versions() == [m.version for m in slow]
    finally:
        for s in stores:
            await s.close()


def test_migration_files_are_consecutive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "0003_c.sql").write_text("SELECT 1;")
    with pytest.raises(ValueError, match="expected 0002"):
        load_migrations(tmp_path)


async def test_events_are_append_only(store: Store) -> None:
    event = await store.record_event(
        NewEvent(kind="deployment.created", message="created", deployment_id=DeploymentId("d1"),
                 data={"replicas": 2})
    )
    await store.record_event(NewEvent(kind="other", message="other"))
    events = await store.list_events(deployment_id="d1")
    assert [e.event_id for e in events] == [event.event_id]
    assert events[0].data == {"replicas": 2}
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await store._pool.execute("DELETE FROM events")


async def test_each_test_gets_a_fresh_database(store: Store) -> None:
    # If databases leaked between tests, the event above would be visible here.
    assert await store.list_events() == []
