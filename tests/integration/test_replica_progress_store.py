"""A start's progress in the store (migration 0028): kept only for a starting replica and
only from its own node's agent, written at most once a second unless its phase changed,
shown only while fresh and while the replica starts."""

from __future__ import annotations

import asyncpg
import pytest

from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.start_progress import StartProgress
from modelkeeper.store.stores import Store
from tests.support.gateway_support import add_deployment

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


async def _starting_replica(db: asyncpg.Connection) -> str:
    deployment_id = await add_deployment(db, "m", status="starting")
    await db.execute("INSERT INTO nodes (node_id, name) VALUES ('n-a', 'box-a'), "
                     "('n-b', 'box-b')")
    await db.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                     "VALUES ('r1', $1, 'starting')", deployment_id)
    await db.execute("INSERT INTO allocations (replica_id, node_id, rank, memory_bytes) "
                     "VALUES ('r1', 'n-a', 0, 1)")
    return deployment_id


def _fetching(done: int) -> StartProgress:
    return StartProgress(replica_id=ReplicaId("r1"), phase="fetching", bytes_done=done,
                         bytes_total=4 * MIB)


async def _row(db: asyncpg.Connection) -> asyncpg.Record | None:
    return await db.fetchrow("SELECT phase, progress->>'bytes_done' AS done, updated_at "
                             "FROM replica_progress WHERE replica_id = 'r1'")


async def test_progress_is_kept_bounded_and_shown_while_starting(
        store: Store, db: asyncpg.Connection) -> None:
    deployment_id = await _starting_replica(db)
    # Another node's agent speaks for nobody here.
    await store.deployments.record_start_progress("n-b", [_fetching(MIB)])
    assert await _row(db) is None
    await store.deployments.record_start_progress("n-a", [_fetching(MIB)])
    first = await _row(db)
    assert first is not None and first["done"] == str(MIB)
    # Within a second, a change of bytes is not written; a change of phase is.
    await store.deployments.record_start_progress("n-a", [_fetching(2 * MIB)])
    again = await _row(db)
    assert again is not None and again["done"] == str(MIB)
    await store.deployments.record_start_progress("n-a", [StartProgress(
        replica_id=ReplicaId("r1"), phase="queued", queue_position=1,
        waiting_for=[ReplicaId("r0")])])
    queued = await _row(db)
    assert queued is not None and queued["phase"] == "queued"
    # A second later the bytes are written again (the clock moved back by hand).
    await db.execute("UPDATE replica_progress SET updated_at = updated_at - interval '1.5 s'")
    await store.deployments.record_start_progress("n-a", [_fetching(3 * MIB)])
    later = await _row(db)
    assert later is not None and later["done"] == str(3 * MIB)

    view = await store.deployments.get_deployment(deployment_id)
    assert view is not None
    progress = view.replicas[0].progress
    assert progress is not None and progress.bytes_done == 3 * MIB
    assert progress.percent == 75.0 and progress.node_id == "n-a"
    assert progress.summary == "downloading 3.0 MiB of 4.0 MiB (75.0 %) on box-a"
    # Stale (its agent stopped reporting it): not shown.
    await db.execute("UPDATE replica_progress SET updated_at = updated_at - interval '11 s'")
    view = await store.deployments.get_deployment(deployment_id)
    assert view is not None and view.replicas[0].progress is None
    # Fresh again, but the replica is ready: not shown, and no more is written.
    await store.deployments.record_start_progress("n-a", [_fetching(4 * MIB)])
    await db.execute("UPDATE replicas SET state = 'ready' WHERE replica_id = 'r1'")
    view = await store.deployments.get_deployment(deployment_id)
    assert view is not None and view.replicas[0].progress is None
    assert view.replicas[0].shown_state == "ready"
    # Gone with its replica.
    await db.execute("DELETE FROM replicas WHERE replica_id = 'r1'")
    assert await _row(db) is None


async def test_the_home_of_a_replica_that_is_gone_comes_from_its_placement(
        store: Store, db: asyncpg.Connection) -> None:
    deployment_id = await _starting_replica(db)
    assert await store.deployments.replica_home("r1") == (deployment_id, ["n-a"])
    await db.execute(
        "INSERT INTO events (kind, message, deployment_id, replica_id, data) "
        "VALUES ('replica.placed', 'placed on n-a', $1, 'r1', '{\"nodes\": [\"n-a\"]}')",
        deployment_id)
    await db.execute("DELETE FROM replicas WHERE replica_id = 'r1'")
    assert await store.deployments.replica_home("r1") == (deployment_id, ["n-a"])
    assert await store.deployments.replica_home("r-unknown") is None
