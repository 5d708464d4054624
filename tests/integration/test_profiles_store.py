"""Hardware profiles on a real PostgreSQL: the catalog keeps a model's profiles, and
PlacementStore.place_replica passes over a profile no node can hold (a GPU that no node
has) for the next, records the profile on the replica and hands the shards that profile's
engine arguments and memory, also on a retried call; the room watch's dry run tries the
profiles too, and the can't-place reason names each."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, HardwareProfile
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.placement import CantPlace, Placement, PlacementRequest
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.domain.units import GIB
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

UNREACHABLE_AFTER_S = 6.0
LOST_AFTER_S = 60.0

#: First a sim that wants a GPU (no node here has one), then a sim on CPU with its own
#: memory, cores and engine arguments.
GPU = HardwareProfile(name="sim-gpu", engine=EngineKind.SIM, gpus=1, priority=10,
                      engine_args={"tokens_per_second": 900.0})
CPU = HardwareProfile(name="sim-cpu", engine=EngineKind.SIM, memory_bytes=3 * GIB,
                      cpu_cores=2.0, engine_args={"tokens_per_second": 40.0,
                                                  "load_time_s": 0.5})


async def _node(store: Store, node_id: str, memory_gib: int) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id, labels={},
        inventory=Inventory(memory_total_bytes=memory_gib * GIB,
                            memory_available_bytes=memory_gib * GIB, cpu_count=8)))


async def _model(store: Store, *profiles: HardwareProfile) -> CatalogModel:
    return await store.catalog.create_model(CatalogModel(
        model_id=ModelId("m"), engine=EngineKind.SIM, source="sim", memory_bytes=2 * GIB,
        engine_args={"hang": True}, profiles=list(profiles)))


async def _deployment(store: Store) -> DeploymentId:
    deployment = DeploymentId("d-m")
    await store.deployments.create_deployment(
        deployment, DeploymentRequest(model_id=ModelId("m")), f"wf-{deployment}")
    return deployment


def _request(model: CatalogModel) -> PlacementRequest:
    """What the activity asks (activities/store.py _placement_request): the model's own
    fields; the profiles are the store's to try."""
    return PlacementRequest(model_id=model.model_id, memory_bytes=model.memory_bytes,
                            cpu_cores=model.cpu_cores, gpus=model.gpus)


async def _place(store: Store, model: CatalogModel, deployment: DeploymentId
                 ) -> list[ShardSpec] | CantPlace:
    return await store.placement.place_replica(
        deployment_id=deployment, replica_id=ReplicaId("r-1"), request=_request(model),
        model=model, now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=LOST_AFTER_S, start_timeout_s=60.0)


async def test_the_catalog_keeps_a_models_profiles(store: Store) -> None:
    created = await _model(store, GPU, CPU)
    assert (await store.catalog.get_model("m")) == created.model_copy(
        update={"created_at": created.created_at})
    assert [m.profiles for m in await store.catalog.list_models()] == [[GPU, CPU]]


async def test_a_profile_no_node_holds_is_passed_over_for_the_next(store: Store) -> None:
    await _node(store, "n1", 16)
    model = await _model(store, CPU, GPU)  # declared second, tried first: priority 10
    deployment = await _deployment(store)
    shards = await _place(store, model, deployment)
    assert not isinstance(shards, CantPlace), shards.summary
    [shard] = shards
    # The shard runs the CPU profile: its memory, cores and engine arguments.
    assert (shard.engine, shard.memory_bytes, shard.cpu_cores, shard.gpu_indices) == (
        EngineKind.SIM, 3 * GIB, 2.0, [])
    assert shard.engine_args == CPU.engine_args
    [replica] = await store.deployments.list_replicas()
    assert replica.profile == "sim-cpu"
    view = await store.deployments.get_deployment(deployment)
    assert view is not None and [r.profile for r in view.replicas] == ["sim-cpu"]
    assert await store.placement.replica_placement_note(ReplicaId("r-1")) == (
        "runs profile sim-cpu, passed over profile sim-gpu: node n1: 0 of 0 GPUs free, "
        "needs 1")
    # A retried call returns the claims it made, as the same profile runs them.
    assert await _place(store, model, deployment) == shards
    claimed = await store._pool.fetchrow(
        "SELECT memory_bytes, cpu_cores FROM allocations WHERE replica_id = 'r-1'")
    assert (claimed["memory_bytes"], claimed["cpu_cores"]) == (3 * GIB, 2.0)


async def test_a_model_without_profiles_records_none(store: Store) -> None:
    await _node(store, "n1", 16)
    model = await _model(store)
    shards = await _place(store, model, await _deployment(store))
    assert not isinstance(shards, CantPlace), shards.summary
    assert [s.engine_args for s in shards] == [{"hang": True}]
    assert [s.memory_bytes for s in shards] == [2 * GIB]
    assert [r.profile for r in await store.deployments.list_replicas()] == [None]


async def test_none_fits_names_every_profile_and_the_dry_run_agrees(store: Store) -> None:
    await _node(store, "n1", 2)
    model = await _model(store, GPU, CPU)
    deployment = await _deployment(store)
    expected = ("profile sim-gpu: node n1: 0 of 0 GPUs free, needs 1; "
                "profile sim-cpu: node n1: 2.0 GiB free, needs 3.0 GiB")
    result = await _place(store, model, deployment)
    assert isinstance(result, CantPlace) and result.summary == expected
    assert await store.deployments.list_replicas() == []
    dry = await store.placement.dry_run_placement(
        deployment_id=deployment, request=_request(model), now=datetime.now(UTC),
        unreachable_after_s=UNREACHABLE_AFTER_S, lost_after_s=LOST_AFTER_S, model=model)
    assert isinstance(dry, CantPlace) and dry.summary == expected
    # Room for the CPU profile: the dry run finds it, as the placement then does.
    await _node(store, "n2", 16)
    dry = await store.placement.dry_run_placement(
        deployment_id=deployment, request=_request(model), now=datetime.now(UTC),
        unreachable_after_s=UNREACHABLE_AFTER_S, lost_after_s=LOST_AFTER_S, model=model)
    assert isinstance(dry, Placement) and dry.node_ids == ["n2"]
    placed = await _place(store, model, deployment)
    assert not isinstance(placed, CantPlace) and [s.node_id for s in placed] == ["n2"]
