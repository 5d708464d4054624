"""place_replica for safe change (issue 10), through the activity on a real PostgreSQL:

* ``avoid_nodes``: a node being drained is never chosen, and says so when nothing fits;
* ``generation``: the replica runs that catalog model, with the generation's engine
  arguments laid over the entry's, and its row records what it runs; a refused argument
  or a model missing from the catalog is an error no retry can fix;
* spread: a deployment's replicas go on distinct nodes while room allows, and the one
  that must share says which node and why, the same on a retry;
* ``GET /placement/explain`` says when the next replica would share a node;
* the store's views: what each replica runs, and whether it is outdated against its
  deployment's generation; migration 0007 leaves older rows on generation 0.
"""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.store import StoreActivities
from api.deployments import explain_placement
from modelkeeper.domain.catalog import (
    CatalogModel,
    DeploymentRequest,
    DeploymentStatusUpdate,
    Generation,
)
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import PlaceReplicaInput, PlaceReplicaResult
from modelkeeper.names import ERROR_ENGINE_CONFIG, ERROR_UNKNOWN_MODEL, deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store, load_migrations
from modelkeeper.store.catalog import ModelInUseError

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
DEPLOYMENT = DeploymentId("d1")
#: The deployment's own model, and the one a switch moves it to.
CURRENT = ModelId("m-current")
NEXT = ModelId("m-next")


def _attempt(activity_id: str) -> ActivityEnvironment:
    """One attempt of one activity of ``deployment/d1``; a retry keeps these ids."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="deployment/d1",
                                   workflow_run_id="run-1", activity_id=activity_id)
    return env


async def _node(store: Store, node_id: str, memory_bytes: int) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id,
        inventory=Inventory(memory_total_bytes=memory_bytes,
                            memory_available_bytes=memory_bytes, cpu_count=16)))


async def _deployment(store: Store) -> DeploymentSpec:
    """d1 serving CURRENT (1 GiB); NEXT (2 GiB) is in the catalog too."""
    await store.catalog.create_model(CatalogModel(
        model_id=CURRENT, engine=EngineKind.SIM, source="sim", memory_bytes=GIB,
        engine_args={"load_time_s": 0.5}))
    await store.catalog.create_model(CatalogModel(
        model_id=NEXT, engine=EngineKind.SIM, source="sim-next", memory_bytes=2 * GIB,
        engine_args={"load_time_s": 3, "tokens_per_second": 10}))
    await store.deployments.create_deployment(DEPLOYMENT, DeploymentRequest(model_id=CURRENT),
                                              deployment_workflow_id(DEPLOYMENT))
    return DeploymentSpec(deployment_id=DEPLOYMENT, model_id=CURRENT, replicas=1)


def _input(spec: DeploymentSpec, replica_id: str, *, avoid: list[str] | None = None,
           generation: Generation | None = None) -> PlaceReplicaInput:
    return PlaceReplicaInput(spec=spec, replica_id=ReplicaId(replica_id), start_timeout_s=60,
                             avoid_nodes=[NodeId(n) for n in avoid or []],
                             generation=generation)


async def _place(store: Store, request: PlaceReplicaInput, activity_id: str = "1"
                 ) -> PlaceReplicaResult:
    acts = StoreActivities(store, Settings(database_url="postgresql://unused",
                                           settling_window_s=0))
    result: PlaceReplicaResult = await _attempt(activity_id).run(acts.place_replica, request)
    return result


async def _refusal(store: Store, request: PlaceReplicaInput) -> ApplicationError:
    with pytest.raises(ApplicationError) as refused:
        await _place(store, request)
    assert refused.value.non_retryable
    return refused.value


# -- avoid_nodes and generation ---------------------------------------------------------

async def test_the_replica_runs_the_generation_and_avoids_the_drained_node(
        store: Store) -> None:
    # n1 is the tighter fit, which bin-packing takes; it is being drained.
    await _node(store, "n1", 8 * GIB)
    await _node(store, "n2", 64 * GIB)
    spec = await _deployment(store)
    generation = Generation(number=2, model_id=NEXT, engine_args={"tokens_per_second": 50})
    request = _input(spec, "r1", avoid=["n1"], generation=generation)

    result = await _place(store, request)

    [shard] = result.shards
    # The generation's weights, under the deployment's served name (what clients send).
    assert (shard.node_id, shard.model_id, shard.source) == ("n2", spec.model_id, "sim-next")
    assert shard.memory_bytes == 2 * GIB  # the generation's model's memory, not d1's
    assert shard.engine_args == {"load_time_s": 3, "tokens_per_second": 50}
    row = await store._pool.fetchrow(
        "SELECT generation, runs_model_id, engine_args FROM replicas WHERE replica_id = 'r1'")
    assert row is not None
    assert dict(row) == {"generation": 2, "runs_model_id": NEXT,
                         "engine_args": {"tokens_per_second": 50}}
    [view] = await store.deployments.list_replicas()
    assert (view.generation, view.runs_model_id, view.outdated) == (2, NEXT, False)
    # A retry whose first attempt committed answers the same shards, merged arguments too.
    assert await _place(store, request) == result


async def test_without_a_generation_the_deployments_model_runs_as_the_catalog_has_it(
        store: Store) -> None:
    await _node(store, "n1", 8 * GIB)
    await _node(store, "n2", 64 * GIB)
    spec = await _deployment(store)

    [shard] = (await _place(store, _input(spec, "r1"))).shards

    assert (shard.node_id, shard.model_id, shard.memory_bytes) == ("n1", CURRENT, GIB)
    assert shard.engine_args == {"load_time_s": 0.5}
    row = await store._pool.fetchrow(
        "SELECT generation, runs_model_id, engine_args FROM replicas WHERE replica_id = 'r1'")
    assert row is not None
    assert dict(row) == {"generation": 0, "runs_model_id": None, "engine_args": None}


async def test_avoiding_every_node_says_why_for_each(store: Store) -> None:
    await _node(store, "n1", 8 * GIB)
    await _node(store, "n2", 64 * GIB)
    spec = await _deployment(store)

    result = await _place(store, _input(spec, "r1", avoid=["n2", "n1"]))

    assert result.shards == []
    assert result.cant_place == (
        "node n1: avoided (being drained); node n2: avoided (being drained)")
    assert await store.deployments.list_replicas() == []


async def test_an_engine_argument_the_engine_refuses_is_not_retried(store: Store) -> None:
    await _node(store, "n1", 64 * GIB)
    spec = await _deployment(store)
    generation = Generation(number=1, model_id=NEXT, engine_args={"trust_remote_code": True})

    refused = await _refusal(store, _input(spec, "r1", generation=generation))

    assert refused.type == ERROR_ENGINE_CONFIG
    assert "engine_args.trust_remote_code=True: not an allowed sim argument" in str(refused)
    assert await store.deployments.list_replicas() == []


async def test_a_generation_of_a_model_not_in_the_catalog_is_not_retried(
        store: Store) -> None:
    await _node(store, "n1", 64 * GIB)
    spec = await _deployment(store)
    generation = Generation(number=1, model_id=ModelId("m-gone"))

    refused = await _refusal(store, _input(spec, "r1", generation=generation))

    assert refused.type == ERROR_UNKNOWN_MODEL
    assert "'m-gone' is not in the catalog" in str(refused)


# -- spread --------------------------------------------------------------------------------

async def test_replicas_spread_and_the_one_that_must_share_says_why(store: Store) -> None:
    # n1 is the tightest fit for every replica; n3 never has room.
    await _node(store, "n1", 4 * GIB)
    await _node(store, "n2", 64 * GIB)
    await _node(store, "n3", GIB // 2)
    spec = await _deployment(store)

    first = await _place(store, _input(spec, "r1"), "1")
    second = await _place(store, _input(spec, "r2"), "2")
    third = await _place(store, _input(spec, "r3"), "3")

    assert [s.node_id for s in first.shards] == ["n1"]
    assert ([s.node_id for s in second.shards], second.note) == (["n2"], None)
    assert [s.node_id for s in third.shards] == ["n1"]
    note = ("shares node n1 with another replica of d1: no other node has room "
            "(node n3: 0.5 GiB free, needs 1.0 GiB)")
    assert third.note == note
    # A retry whose first attempt committed answers the note that attempt found, though
    # the nodes look different now (n1 holds r3's claim as well).
    assert (await _place(store, _input(spec, "r3"), "3")).note == note
    placed = [e for e in await store.events.list_events(deployment_id=DEPLOYMENT)
              if e.kind == "replica.placed"]
    assert [e.message for e in placed] == [
        "placed on n1", "placed on n2", f"placed on n1; {note}"]
    assert placed[2].data["note"] == note


# -- the store's views ---------------------------------------------------------------------

async def test_replicas_on_an_older_generation_show_as_outdated(store: Store) -> None:
    await _node(store, "n1", 64 * GIB)
    spec = await _deployment(store)
    await _place(store, _input(spec, "r0"), "1")
    await _place(store, _input(spec, "r2", generation=Generation(number=2, model_id=CURRENT)),
                 "2")
    await _place(store, _input(spec, "r3", generation=Generation(number=3, model_id=NEXT)),
                 "3")
    # Before the deployment moves on, nothing is outdated.
    assert [r.outdated for r in await store.deployments.list_replicas()] == [False, False, False]

    await store.deployments.record_deployment_status(DeploymentStatusUpdate(
        deployment_id=DEPLOYMENT, status=DeploymentStatus.DEGRADED, placement_error=None,
        consecutive_failures=0, last_failure=None, desired_replicas=3, generation=3,
        runs_model_id=NEXT, placement_note="shares node n1 with another replica of d1"))

    view = await store.deployments.get_deployment(DEPLOYMENT)
    assert view is not None
    assert (view.model_id, view.generation, view.runs_model_id) == (CURRENT, 3, NEXT)
    assert view.placement_note == "shares node n1 with another replica of d1"
    assert [(r.replica_id, r.generation, r.runs_model_id, r.outdated)
            for r in view.replicas] == [
        ("r0", 0, None, True), ("r2", 2, CURRENT, True), ("r3", 3, NEXT, False)]
    assert [r.outdated for r in await store.deployments.list_replicas()] == [True, True, False]


async def test_a_model_a_replica_runs_cannot_leave_the_catalog(store: Store) -> None:
    await _node(store, "n1", 64 * GIB)
    spec = await _deployment(store)
    await _place(store, _input(spec, "r1", generation=Generation(number=1, model_id=NEXT)))

    with pytest.raises(ModelInUseError):
        await store.catalog.delete_model(NEXT)
    assert await store.deployments.release_replica("r1")
    assert await store.catalog.delete_model(NEXT)


async def test_migration_0007_puts_existing_replicas_on_generation_0(
        empty_database_url: str) -> None:
    before = [m for m in load_migrations() if m.version < 7]
    upto = [m for m in load_migrations() if m.version <= 7]
    async with await Store.connect(empty_database_url, migrate=False) as store:
        await store.migrate(before)
        # Rows as the code before 0007 wrote them, in SQL: today's store code writes
        # columns later migrations added.
        await store._pool.execute(
            "INSERT INTO models (model_id, engine, source, memory_bytes) "
            "VALUES ($1, 'sim', 'sim', $2)", CURRENT, GIB)
        await store._pool.execute(
            "INSERT INTO deployments (deployment_id, model_id, replicas, workflow_id) "
            "VALUES ($1, $2, 1, 'wf-d1')", DEPLOYMENT, CURRENT)
        await store._pool.execute(
            "INSERT INTO replicas (replica_id, deployment_id, state) VALUES ('r1', 'd1', 'ready')")

        assert await store.migrate(upto) == [7]
        await store.migrate()  # the rest, so today's reads find their columns

        view = await store.deployments.get_deployment(DEPLOYMENT)
    assert view is not None
    assert (view.generation, view.runs_model_id, view.placement_note) == (0, None, None)
    [replica] = view.replicas
    assert (replica.generation, replica.runs_model_id, replica.outdated) == (0, None, False)


async def test_explain_says_when_the_next_replica_would_share_a_node(store: Store) -> None:
    await _node(store, "n1", 4 * GIB)
    await _node(store, "n2", GIB // 2)
    spec = await _deployment(store)
    settings = Settings(database_url="postgresql://unused")

    before = await explain_placement(store, settings, CURRENT, node_ids=None, min_nodes=1)
    assert (before.nodes_chosen, before.note) == (["n1"], None)
    await _place(store, _input(spec, "r1"))
    after = await explain_placement(store, settings, CURRENT, node_ids=None, min_nodes=1)

    assert after.fits and after.nodes_chosen == ["n1"]
    assert after.note == ("shares node n1 with another replica of d1: no other node has "
                          "room (node n2: 0.5 GiB free, needs 1.0 GiB)")
