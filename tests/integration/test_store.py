"""The store against a real PostgreSQL: migrations, the audit log, and the authenticated
heartbeat (one statement that writes nothing unless the credential is the node's)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import (
    AgentRegistration,
    GpuInfo,
    HeartbeatRecorded,
    Inventory,
    credential_digest,
)
from modelkeeper.domain.placement import PlacementRequest
from modelkeeper.domain.shards import EngineKind
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
    event = await store.events.record_event(
        NewEvent(kind="deployment.created", message="created", deployment_id=DeploymentId("d1"),
                 data={"replicas": 2})
    )
    await store.events.record_event(NewEvent(kind="other", message="other"))
    events = await store.events.list_events(deployment_id="d1")
    assert [e.event_id for e in events] == [event.event_id]
    assert events[0].data == {"replicas": 2}
    with pytest.raises(asyncpg.RaiseError, match="append-only"):
        await store._pool.execute("DELETE FROM events")


async def test_each_test_gets_a_fresh_database(store: Store) -> None:
    # If databases leaked between tests, the event above would be visible here.
    assert await store.events.list_events() == []


# -- the authenticated heartbeat ----------------------------------------------------------

GIB = 1024**3
UNREACHABLE_AFTER_S = 600.0
CREDENTIAL = "node-a-credential"
OTHER_CREDENTIAL = "node-b-credential"


def _inventory(memory_gib: int) -> Inventory:
    return Inventory(memory_total_bytes=memory_gib * GIB,
                     memory_available_bytes=memory_gib * GIB, cpu_count=16,
                     gpus=[GpuInfo(index=0, name="H100", memory_bytes=80 * GIB)])


async def _node_row(store: Store, node_id: str) -> dict[str, Any]:
    row = await store._pool.fetchrow("SELECT * FROM nodes WHERE node_id = $1", node_id)
    assert row is not None
    return dict(row)


async def _two_nodes_one_with_claims(store: Store) -> list[ReplicaId]:
    """Node a (credential CREDENTIAL) holding two replicas' claims, node b (credential
    OTHER_CREDENTIAL) none, node c no credential at all; the replicas a holds."""
    for node_id, credential in (("a", CREDENTIAL), ("b", OTHER_CREDENTIAL), ("c", None)):
        await store.nodes.register_node(
            AgentRegistration(node_id=NodeId(node_id), name=node_id,
                              inventory=_inventory(8 if node_id == "a" else 1)),
            credential_sha256=None if credential is None else credential_digest(credential))
    model = CatalogModel(model_id=ModelId("m"), engine=EngineKind.SIM, source="org/model",
                         memory_bytes=2 * GIB)
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(
        DeploymentId("d1"), DeploymentRequest(model_id=model.model_id), "wf-d1")
    placed = []
    for replica_id in ("d1-r2", "d1-r1"):  # only a has room for them
        shards = await store.placement.place_replica(
            deployment_id=DeploymentId("d1"), replica_id=ReplicaId(replica_id),
            request=PlacementRequest(model_id=model.model_id, memory_bytes=2 * GIB),
            model=model, now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
            lost_after_s=2 * UNREACHABLE_AFTER_S, start_timeout_s=300.0)
        assert isinstance(shards, list) and [s.node_id for s in shards] == ["a"], shards
        placed.append(ReplicaId(replica_id))
    return placed


@pytest.mark.parametrize(("node_id", "credential"), [
    ("a", OTHER_CREDENTIAL),  # another node's credential
    ("a", "no-such-credential"),
    ("c", CREDENTIAL),  # a node without a credential
    ("zz", CREDENTIAL),  # an unknown node
], ids=["another-nodes", "wrong", "node-without-one", "unknown-node"])
async def test_an_authenticated_heartbeat_with_a_wrong_credential_writes_nothing(
        store: Store, node_id: str, credential: str) -> None:
    await _two_nodes_one_with_claims(store)
    await store.nodes.mark_node_silent("a", since=datetime.now(UTC) - timedelta(seconds=5))
    before = {n: await _node_row(store, n) for n in ("a", "b", "c")}
    await asyncio.sleep(0.01)  # so that a write of last_seen = now() would show
    assert await store.nodes.authenticated_heartbeat(
        node_id, credential_digest(credential), _inventory(64), UNREACHABLE_AFTER_S) is None
    assert {n: await _node_row(store, n) for n in ("a", "b", "c")} == before
    assert before["a"]["credential_confirmed_at"] is None  # not confirmed either


async def test_an_authenticated_heartbeat_writes_confirms_and_answers_the_claims(
        store: Store) -> None:
    claimed = await _two_nodes_one_with_claims(store)
    silent_at = datetime.now(UTC) - timedelta(seconds=5)
    await store.nodes.mark_node_silent("a", since=silent_at)
    before = await _node_row(store, "a")

    recorded = await store.nodes.authenticated_heartbeat(
        "a", credential_digest(CREDENTIAL), _inventory(16), UNREACHABLE_AFTER_S,
        received_at=datetime.now(UTC))
    assert isinstance(recorded, HeartbeatRecorded)
    assert recorded.changed  # more memory, and back from a silence
    assert sorted(recorded.claimed_replica_ids) == sorted(claimed)
    after = await _node_row(store, "a")
    assert after["memory_total_bytes"] == 16 * GIB
    assert after["last_seen"] > before["last_seen"]
    assert after["silent_since"] is None
    assert after["credential_confirmed_at"] is not None
    auth = await store.nodes.node_auth("a")
    assert auth is not None and auth.credential_confirmed

    # The same report again: nothing placement uses changed; the confirmation keeps its time.
    again = await store.nodes.authenticated_heartbeat(
        "a", credential_digest(CREDENTIAL), _inventory(16), UNREACHABLE_AFTER_S)
    assert again is not None and not again.changed
    assert sorted(again.claimed_replica_ids) == sorted(claimed)
    confirmed_at = (await _node_row(store, "a"))["credential_confirmed_at"]
    assert confirmed_at == after["credential_confirmed_at"]

    # A node with no claims answers none; the answer is what replicas_on_node reads.
    other = await store.nodes.authenticated_heartbeat(
        "b", credential_digest(OTHER_CREDENTIAL), _inventory(1), UNREACHABLE_AFTER_S)
    assert other == HeartbeatRecorded(changed=False, claimed_replica_ids=[])
    on_a = await store.nodes.replicas_on_node("a")
    assert sorted(r for rs in on_a.values() for r in rs) == sorted(recorded.claimed_replica_ids)
