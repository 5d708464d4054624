"""PlacementStore.place_replica under concurrency, on a real PostgreSQL.

What must hold while placements race each other and heartbeats:

* the claims on a node never exceed its capacity (memory, GPUs), however many placements
  run at once, and every replica that fits is placed;
* a heartbeat never waits behind a placement (at 1,000 nodes it used to: p99 5.5 s);
* two attempts for the same replica end with one set of claims, which both return;
* a retried call returns exactly the shard specs the first returned (gpu_memory_bytes too:
  vLLM and SGLang derive their memory fraction from it);
* two replicas of one deployment placed at once still go on distinct nodes when room
  allows: the one that read first's claim was not committed yet sees it under the lock;
* the placements of one process take turns, so none of them loses a race to another.

Calls race here from stores of their own (``racers``), as from control workers of their
own: through one store they would take turns.

To catch a placement with its transaction open, ``ClaimGate`` installs a trigger that makes
every allocation insert wait on an advisory lock the test holds: the placement has then
written its claims but not committed, the widest window a racing call could hit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import asyncpg
import pytest

from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, ReplicaView
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import AgentRegistration, GpuInfo, Inventory, PortRange
from modelkeeper.domain.placement import CantPlace, PlacementRequest, RejectionReason
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.store import Store, locks, placement

pytestmark = pytest.mark.timeout(60)

GIB = 1024**3
DEPLOYMENT = DeploymentId("d1")
#: Generous: these tests are about claims, not about nodes going silent.
UNREACHABLE_AFTER_S = 600.0
LOST_AFTER_S = 1200.0
#: How long a heartbeat may wait for a row lock before the test calls it a regression.
#: Long enough for a loaded 2-core machine, short enough that a regression fails fast.
HEARTBEAT_LOCK_TIMEOUT = "2s"
#: Key of the advisory lock ``ClaimGate`` holds (single-bigint form: nothing in the store
#: uses that form for anything but the migration lock, whose key differs).
GATE_KEY = 7_340_001


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads,
                              schema="pg_catalog")


@pytest.fixture
async def wide_store(database_url: str) -> AsyncIterator[Store]:
    """A store with enough connections for every racing call to hold one at once."""
    s = await Store.connect(database_url, min_size=1, max_size=32)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def racers(database_url: str) -> AsyncIterator[list[Store]]:
    """Twenty stores, each as a control worker of its own would hold: their placements
    race one another (one store's take turns)."""
    stores = [await Store.connect(database_url, min_size=1, max_size=2, migrate=False)
              for _ in range(20)]
    try:
        yield stores
    finally:
        for s in stores:
            await s.close()


@pytest.fixture
async def other_store(database_url: str) -> AsyncIterator[Store]:
    """A second worker's store, for the call that races the first."""
    s = await Store.connect(database_url, migrate=False)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def heartbeat_store(database_url: str) -> AsyncIterator[Store]:
    """A store whose statements give up on a row lock after HEARTBEAT_LOCK_TIMEOUT, so a
    heartbeat queued behind a placement fails the test instead of hanging it."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2,
                                     init=_init_connection,
                                     server_settings={"lock_timeout": HEARTBEAT_LOCK_TIMEOUT})
    s = Store(pool)
    try:
        yield s
    finally:
        await s.close()


class ClaimGate:
    """Holds every placement transaction open right after it inserts an allocation row
    (or, with ``table="events"``, a sweep's right after it deleted the deployment)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    @classmethod
    async def install(cls, database_url: str, table: str = "allocations") -> ClaimGate:
        conn = await asyncpg.connect(database_url)
        await conn.execute(f"""
            CREATE FUNCTION test_wait_at_gate() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM pg_advisory_xact_lock_shared({GATE_KEY});
                RETURN NULL;
            END $$;
            CREATE TRIGGER test_claim_gate AFTER INSERT ON {table}
                FOR EACH ROW EXECUTE FUNCTION test_wait_at_gate();
        """)
        await conn.execute("SELECT pg_advisory_lock($1)", GATE_KEY)
        return cls(conn)

    async def wait_for_waiters(self, count: int) -> None:
        """Until ``count`` sessions wait on an advisory lock (the gate, or a node's)."""
        for _ in range(500):
            waiting = await self._conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            if waiting >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"fewer than {count} sessions ever waited on an advisory lock")

    async def wait_for_row_waiters(self, count: int) -> None:
        """Until ``count`` sessions wait on a row (a lock that is not advisory)."""
        for _ in range(500):
            waiting = await self._conn.fetchval(
                "SELECT count(DISTINCT pid) FROM pg_locks "
                "WHERE locktype <> 'advisory' AND NOT granted")
            if waiting >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"fewer than {count} sessions ever waited on a row")

    async def open(self) -> None:
        await self._conn.execute("SELECT pg_advisory_unlock($1)", GATE_KEY)

    async def close(self) -> None:
        await self._conn.close()


def _inventory(memory_bytes: int, gpus: int = 0, gpu_memory: int = 80 * GIB) -> Inventory:
    return Inventory(memory_total_bytes=memory_bytes, memory_available_bytes=memory_bytes,
                     cpu_count=64,
                     gpus=[GpuInfo(index=i, name="H100", memory_bytes=gpu_memory)
                           for i in range(gpus)])


ENGINE_PORTS = PortRange(low=20000, high=20999)


async def _setup(store: Store, *, nodes: dict[str, Inventory], model: CatalogModel) -> None:
    for node_id, inv in nodes.items():
        # An address and engine ports, as every agent registers them: rank 0 of a
        # multi-node replica rendezvouses there.
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId(node_id), name=node_id, inventory=inv, engine_ports=ENGINE_PORTS),
            address="127.0.0.1")
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(
        DEPLOYMENT, DeploymentRequest(model_id=model.model_id), "wf-d1")


def _request(model: CatalogModel) -> PlacementRequest:
    return PlacementRequest(model_id=model.model_id, memory_bytes=model.memory_bytes,
                            cpu_cores=model.cpu_cores, gpus=model.gpus,
                            min_nodes=model.min_nodes)


async def _place(store: Store, model: CatalogModel, replica_id: str
                 ) -> list[ShardSpec] | CantPlace:
    return await store.placement.place_replica(
        deployment_id=DEPLOYMENT, replica_id=ReplicaId(replica_id), request=_request(model),
        model=model, now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=LOST_AFTER_S, start_timeout_s=300.0)


async def _allocations(store: Store) -> list[asyncpg.Record]:
    return await store._pool.fetch(
        "SELECT replica_id, node_id, rank, memory_bytes, gpu_indices FROM allocations "
        "ORDER BY replica_id, rank")


def _model(memory_gib: int, *, gpus: int | None = None, min_nodes: int = 1,
           engine: EngineKind = EngineKind.SIM, cpu_cores: float | None = None
           ) -> CatalogModel:
    return CatalogModel(model_id=ModelId("m"), engine=engine, source="org/model",
                        memory_bytes=memory_gib * GIB, gpus=gpus, min_nodes=min_nodes,
                        cpu_cores=cpu_cores)


@pytest.mark.parametrize("optimistic_attempts", [None, 0], ids=["default", "serialized-only"])
async def test_concurrent_placements_never_over_claim_memory(
        wide_store: Store, racers: list[Store], monkeypatch: pytest.MonkeyPatch,
        optimistic_attempts: int | None) -> None:
    # 5 nodes of 10 GiB, 4 GiB replicas: 2 fit per node, so 10 of 20 racing calls fit.
    if optimistic_attempts is not None:
        monkeypatch.setattr(placement, "_OPTIMISTIC_ATTEMPTS", optimistic_attempts)
    model = _model(4)
    await _setup(wide_store, nodes={f"n{i}": _inventory(10 * GIB) for i in range(5)},
                 model=model)

    results = await asyncio.gather(*(_place(racers[i], model, f"r{i:02d}") for i in range(20)))

    placed = {f"r{i:02d}": r for i, r in enumerate(results) if not isinstance(r, CantPlace)}
    refused = [r for r in results if isinstance(r, CantPlace)]
    assert len(placed) == 10, [r if isinstance(r, CantPlace) else r[0].node_id for r in results]
    assert len(refused) == 10
    for cant in refused:
        assert {r.reason_code for r in cant.rejections} == {RejectionReason.INSUFFICIENT_MEMORY}
    rows = await _allocations(wide_store)
    per_node = Counter[str]()
    for row in rows:
        per_node[row["node_id"]] += row["memory_bytes"]
    assert all(claimed <= 10 * GIB for claimed in per_node.values()), per_node
    # What each call returned is what it stored, and nothing else was stored.
    assert sorted((r["replica_id"], r["node_id"]) for r in rows) == sorted(
        (rid, shards[0].node_id) for rid, shards in placed.items())


async def test_concurrent_multi_node_placements_claim_each_gpu_once(
        wide_store: Store, racers: list[Store]) -> None:
    # 6 nodes with 2 GPUs each; 2-shard replicas with 1 GPU per shard: 12 GPUs hold 6
    # replicas. Racing calls lock overlapping node sets, in rank order emptiest first, so
    # this also shows the locks are taken in an order that cannot deadlock.
    model = _model(2, gpus=1, min_nodes=2)
    await _setup(wide_store, nodes={f"n{i}": _inventory(512 * GIB, gpus=2) for i in range(6)},
                 model=model)

    results = await asyncio.gather(*(_place(racers[i], model, f"r{i:02d}") for i in range(12)))

    assert sum(not isinstance(r, CantPlace) for r in results) == 6
    claimed = [(row["node_id"], i) for row in await _allocations(wide_store)
               for i in row["gpu_indices"]]
    assert len(claimed) == 12
    assert len(set(claimed)) == 12, Counter(claimed).most_common(3)


async def test_heartbeat_of_an_unclaimed_node_does_not_wait_for_an_open_placement(
        store: Store, heartbeat_store: Store, database_url: str) -> None:
    model = _model(4)
    inv = _inventory(10 * GIB)
    await _setup(store, nodes={"a": inv, "b": inv}, model=model)
    gate = await ClaimGate.install(database_url)
    try:
        placing = asyncio.create_task(_place(store, model, "r1"))
        await gate.wait_for_waiters(1)  # claims written on a, transaction open

        # Node b is not being claimed from: its heartbeat must not queue behind r1.
        assert await heartbeat_store.nodes.heartbeat_node("b", inv, UNREACHABLE_AFTER_S) is False
        assert not placing.done()

        await gate.open()
        shards = await placing
    finally:
        await gate.close()
    assert not isinstance(shards, CantPlace)
    assert [s.node_id for s in shards] == ["a"]


async def test_heartbeat_of_the_node_being_claimed_does_not_wait_either(
        store: Store, heartbeat_store: Store, database_url: str) -> None:
    # The allocation's foreign key takes a KEY SHARE lock on the node row. A heartbeat
    # that locks the row FOR UPDATE conflicts with it and waits out the placement.
    model = _model(4)
    inv = _inventory(10 * GIB)
    await _setup(store, nodes={"a": inv}, model=model)
    gate = await ClaimGate.install(database_url)
    try:
        placing = asyncio.create_task(_place(store, model, "r1"))
        await gate.wait_for_waiters(1)

        assert await heartbeat_store.nodes.heartbeat_node("a", inv, UNREACHABLE_AFTER_S) is False
        assert not placing.done()

        await gate.open()
        shards = await placing
    finally:
        await gate.close()
    assert not isinstance(shards, CantPlace)


@pytest.mark.parametrize("optimistic_attempts", [None, 1], ids=["default", "then-serialized"])
async def test_placement_re_checks_claims_committed_while_it_waited(
        store: Store, other_store: Store, database_url: str,
        monkeypatch: pytest.MonkeyPatch, optimistic_attempts: int | None) -> None:
    # r2 reads the nodes while r1's claim on a is written but not committed, so r2's
    # snapshot shows a empty and picks it too. Room on a is for one replica: r2 must see
    # r1's claim once r1 commits and go to b instead of over-claiming a.
    if optimistic_attempts is not None:
        monkeypatch.setattr(placement, "_OPTIMISTIC_ATTEMPTS", optimistic_attempts)
    model = _model(6)
    inv = _inventory(10 * GIB)
    await _setup(store, nodes={"a": inv, "b": inv}, model=model)
    gate = await ClaimGate.install(database_url)
    try:
        first = asyncio.create_task(_place(store, model, "r1"))
        await gate.wait_for_waiters(1)
        second = asyncio.create_task(_place(other_store, model, "r2"))
        await gate.wait_for_waiters(2)  # r2 has read, placed, and waits for a's lock
        await gate.open()
        r1, r2 = await asyncio.gather(first, second)
    finally:
        await gate.close()
    assert not isinstance(r1, CantPlace) and not isinstance(r2, CantPlace)
    assert [s.node_id for s in r1] == ["a"]
    assert [s.node_id for s in r2] == ["b"]


@pytest.mark.parametrize("optimistic_attempts", [None, 0], ids=["default", "serialized-only"])
async def test_racing_replicas_of_one_deployment_still_spread(
        store: Store, other_store: Store, database_url: str,
        monkeypatch: pytest.MonkeyPatch, optimistic_attempts: int | None) -> None:
    # Room on a for both: r2's snapshot shows a free of replicas (r1's claim is written, not
    # committed) and picks it, the lower id of two equal nodes. Under a's lock it must see
    # r1 there and go to b, which spread prefers; memory alone would let it stay on a.
    if optimistic_attempts is not None:
        monkeypatch.setattr(placement, "_OPTIMISTIC_ATTEMPTS", optimistic_attempts)
    model = _model(2)
    inv = _inventory(64 * GIB)
    await _setup(store, nodes={"a": inv, "b": inv}, model=model)
    gate = await ClaimGate.install(database_url)
    try:
        first = asyncio.create_task(_place(store, model, "r1"))
        await gate.wait_for_waiters(1)
        second = asyncio.create_task(_place(other_store, model, "r2"))
        await gate.wait_for_waiters(2)  # r2 waits for a's lock (or, serialized, its turn)
        await gate.open()
        r1, r2 = await asyncio.gather(first, second)
    finally:
        await gate.close()
    assert not isinstance(r1, CantPlace) and not isinstance(r2, CantPlace)
    assert [s.node_id for s in r1] == ["a"]
    assert [s.node_id for s in r2] == ["b"]
    assert await store.placement.replica_placement_note("r2") is None


async def test_placements_ranking_nodes_in_opposite_orders_do_not_deadlock(
        store: Store, other_store: Store, heartbeat_store: Store, database_url: str) -> None:
    # r1 reads a emptier than b and ranks them [a, b]; a heartbeat then shrinks a, so r2
    # ranks them [b, a]. Were node locks taken in rank order, r1 would hold a waiting for b
    # while r2 held b waiting for a. The test holds both locks, as a racing placement
    # would, until both calls wait, then lets go of both at once.
    model = _model(10, min_nodes=2)
    await _setup(store, nodes={"a": _inventory(100 * GIB), "b": _inventory(90 * GIB)},
                 model=model)
    holder = await asyncpg.connect(database_url)
    try:
        for node_id in ("a", "b"):
            await holder.execute("SELECT pg_advisory_lock($1, $2)",
                                 locks.NODE_LOCK_SPACE, locks.lock_key(node_id))
        gate = ClaimGate(holder)
        first = asyncio.create_task(_place(store, model, "r1"))
        await gate.wait_for_waiters(1)
        await heartbeat_store.nodes.heartbeat_node("a", _inventory(50 * GIB), UNREACHABLE_AFTER_S)
        second = asyncio.create_task(_place(other_store, model, "r2"))
        await gate.wait_for_waiters(2)
        await holder.execute("SELECT pg_advisory_unlock_all()")
        r1, r2 = await asyncio.gather(first, second)
    finally:
        await holder.close()
    assert not isinstance(r1, CantPlace) and not isinstance(r2, CantPlace)
    assert [s.node_id for s in r1] == ["a", "b"]
    assert [s.node_id for s in r2] == ["b", "a"]


async def test_concurrent_duplicate_placements_return_the_same_claims(
        wide_store: Store, racers: list[Store]) -> None:
    # Two attempts for one replica (an activity retried while the first still runs) must
    # end with one set of claims that both return, never a unique violation or two sets.
    model = _model(4)
    await _setup(wide_store, nodes={f"n{i}": _inventory(64 * GIB) for i in range(3)},
                 model=model)
    for round_ in range(5):
        rid = f"r{round_}"
        first, second = await asyncio.gather(_place(racers[0], model, rid),
                                             _place(racers[1], model, rid))
        assert not isinstance(first, CantPlace)
        assert first == second
        rows = [r for r in await _allocations(wide_store) if r["replica_id"] == rid]
        assert [(r["node_id"], r["rank"]) for r in rows] == [(first[0].node_id, 0)]


_TIMING = re.compile(r"replica=(\S+) .* attempts=(\d+) outcome=(\w+)")


async def test_one_workers_placements_take_turns_and_none_loses_a_race(
        wide_store: Store, caplog: pytest.LogCaptureFixture) -> None:
    # Bin-packing sends every racer to the same node: from one worker, twenty calls at
    # once lost race after race (bench/scale). Taking turns, each claims at its first try.
    model = _model(4)
    await _setup(wide_store, nodes={f"n{i}": _inventory(10 * GIB) for i in range(5)},
                 model=model)
    caplog.set_level(logging.DEBUG, logger=placement.PLACEMENT_TIMING_LOGGER)

    results = await asyncio.gather(*(_place(wide_store, model, f"r{i:02d}") for i in range(20)))

    assert sum(not isinstance(r, CantPlace) for r in results) == 10
    timings = [m.groups() for r in caplog.records
               if r.name == placement.PLACEMENT_TIMING_LOGGER
               and (m := _TIMING.search(r.getMessage())) is not None]
    assert len(timings) == 20
    assert {attempts for _, attempts, _ in timings} == {"1"}, timings


async def test_retried_gpu_placement_returns_the_same_shard_specs(store: Store) -> None:
    # vLLM and SGLang turn memory_bytes into a GPU memory fraction with gpu_memory_bytes;
    # a retried call that rebuilt the specs without it made the engine refuse to start.
    model = _model(60, gpus=2, min_nodes=2, engine=EngineKind.VLLM, cpu_cores=2.5)
    await _setup(store, nodes={"a": _inventory(512 * GIB, gpus=4, gpu_memory=80 * GIB),
                               "b": _inventory(256 * GIB, gpus=4, gpu_memory=40 * GIB)},
                 model=model)

    first = await _place(store, model, "r1")
    again = await _place(store, model, "r1")

    assert not isinstance(first, CantPlace)
    assert {s.node_id: s.gpu_memory_bytes for s in first} == {"a": 160 * GIB, "b": 80 * GIB}
    assert again == first
    assert len(await _allocations(store)) == 2


# -- the store sweep (worker/sweep.py) racing a placement a terminate left running --------

def _swept(seen: list[list[str]]) -> Callable[[list[ReplicaView]], NewEvent]:
    def event_for(replicas: list[ReplicaView]) -> NewEvent:
        seen.append([r.replica_id for r in replicas])
        return NewEvent(kind="deployment.swept", deployment_id=DEPLOYMENT,
                        message="swept by the test")
    return event_for


async def test_a_sweep_waits_for_an_open_placement_and_removes_its_claims(
        wide_store: Store, database_url: str) -> None:
    model = _model(4)
    await _setup(wide_store, nodes={"a": _inventory(10 * GIB)}, model=model)
    gate = await ClaimGate.install(database_url)
    seen: list[list[str]] = []
    try:
        placing = asyncio.create_task(_place(wide_store, model, "r1"))
        await gate.wait_for_waiters(1)  # r1's replica row and claim written, not committed
        sweeping = asyncio.create_task(wide_store.deployments.sweep_deployment(
            DEPLOYMENT, workflow_id="wf-d1", event_for=_swept(seen)))
        # The sweep waits on the deployment's row, which r1's insert holds key-share.
        await gate.wait_for_row_waiters(1)
        assert not sweeping.done()
        await gate.open()
        shards = await placing
        event = await sweeping
    finally:
        await gate.close()
    assert isinstance(shards, list) and [s.node_id for s in shards] == ["a"]
    # The sweep saw the claim committed while it waited, and removed it with the row.
    assert event is not None and seen == [["r1"]]
    assert await _allocations(wide_store) == []
    assert await wide_store.deployments.get_deployment(DEPLOYMENT) is None


async def test_a_placement_that_arrives_during_a_sweep_claims_nothing(
        wide_store: Store, database_url: str) -> None:
    model = _model(4)
    await _setup(wide_store, nodes={"a": _inventory(10 * GIB)}, model=model)
    gate = await ClaimGate.install(database_url, table="events")
    seen: list[list[str]] = []
    try:
        sweeping = asyncio.create_task(wide_store.deployments.sweep_deployment(
            DEPLOYMENT, workflow_id="wf-d1", event_for=_swept(seen)))
        await gate.wait_for_waiters(1)  # the row deleted, the sweep not committed
        placing = asyncio.create_task(_place(wide_store, model, "r1"))
        # Its replica insert checks the deployment row the sweep deleted: it waits.
        await gate.wait_for_row_waiters(1)
        assert not placing.done()
        await gate.open()
        assert await sweeping is not None
        with pytest.raises(asyncpg.ForeignKeyViolationError):
            await placing
    finally:
        await gate.close()
    assert seen == [[]]
    assert await _allocations(wide_store) == []
    assert await wide_store.deployments.list_replicas() == []
