"""Facility-aware placement through the store (migration 0020): node holds, power caps, a
model's declared watts recorded on its claims, and a deployment's spread stored."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import AgentRegistration, Inventory, NodeUpdate
from modelkeeper.domain.placement import CantPlace, Placement, PlacementRequest, RejectionReason
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.domain.topology import FACILITY_CAP_KEY, PDU_LABEL, Spread, TopologyKey
from modelkeeper.domain.units import GIB
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

UNREACHABLE_AFTER_S = 600.0
MODEL = ModelId("m")
DEP = DeploymentId("d1")


async def _setup(store: Store, *, watts: int | None) -> CatalogModel:
    for node_id in ("a", "b"):
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId(node_id), name=node_id, labels={PDU_LABEL: "p1"},
            inventory=Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                                cpu_count=16)))
    model = CatalogModel(model_id=MODEL, engine=EngineKind.SIM, source="org/model",
                         memory_bytes=2 * GIB, watts=watts)
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(
        DEP, DeploymentRequest(model_id=MODEL, spread=Spread(key=TopologyKey.RACK)), "wf-d1")
    return model


async def _place(store: Store, model: CatalogModel, replica: str, **fields: object
                 ) -> list[ShardSpec] | CantPlace:
    request = PlacementRequest.model_validate(
        {"model_id": MODEL, "memory_bytes": model.memory_bytes, "watts": model.watts,
         **fields})
    return await store.placement.place_replica(
        deployment_id=DEP, replica_id=ReplicaId(replica), request=request, model=model,
        now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=2 * UNREACHABLE_AFTER_S, start_timeout_s=300.0)


async def test_the_new_columns_round_trip(store: Store) -> None:
    model = await _setup(store, watts=350)
    stored = await store.catalog.get_model(MODEL)
    assert stored is not None and stored.watts == model.watts == 350
    spread = await store._pool.fetchval("SELECT spread FROM deployments WHERE deployment_id = $1",
                                        DEP)
    assert spread == {"key": "rack", "max_skew": 1}
    held = await store.nodes.update_node("a", NodeUpdate(hold_class=CapacityClass.CRITICAL,
                                                         hold_owner="acme/ml"))
    assert held is not None
    assert (held.hold_class, held.hold_owner) == (CapacityClass.CRITICAL, "acme/ml")
    listed = {n.node_id: n for n in await store.nodes.list_nodes()}
    assert (listed["a"].hold_class, listed["a"].hold_owner) == ("critical", "acme/ml")
    released = await store.nodes.update_node("a", NodeUpdate(release_hold=True))
    assert released is not None
    assert (released.hold_class, released.hold_owner) == (None, None)
    await store.nodes.set_power_cap("p1", 1000)
    await store.nodes.set_power_cap(FACILITY_CAP_KEY, 5000)
    await store.nodes.set_power_cap("p1", 900)
    assert await store.nodes.power_caps() == {"_facility": 5000, "p1": 900}
    await store.nodes.set_power_cap("p1", None)
    assert await store.nodes.power_caps() == {"_facility": 5000}


async def test_a_held_node_is_refused_to_a_foreign_class(store: Store) -> None:
    model = await _setup(store, watts=None)
    for node_id in ("a", "b"):
        await store.nodes.update_node(node_id, NodeUpdate(hold_class=CapacityClass.CRITICAL))
    refused = await _place(store, model, "d1-r1", capacity_class="standard")
    assert isinstance(refused, CantPlace)
    assert {r.reason_code for r in refused.rejections} == {RejectionReason.HELD}
    placed = await _place(store, model, "d1-r1", capacity_class="critical")
    assert isinstance(placed, list) and len(placed) == 1


async def test_power_caps_count_the_watts_recorded_on_claims(store: Store) -> None:
    model = await _setup(store, watts=400)
    await store.nodes.set_power_cap("p1", 1000)
    # Two shards of 400 W fit under 1000 W; the third would make 1200 W.
    for replica in ("d1-r1", "d1-r2"):
        assert isinstance(await _place(store, model, replica), list)
    watts = await store._pool.fetch("SELECT watts FROM allocations ORDER BY replica_id")
    assert [row["watts"] for row in watts] == [400, 400]
    refused = await _place(store, model, "d1-r3")
    assert isinstance(refused, CantPlace)
    assert refused.rejections[0].message == ("pdu p1 draws 800 W of its 1000 W cap, "
                                             "a shard adds 400 W")
    # The dry run reads the same caps and draws.
    dry = await store.placement.dry_run_placement(
        deployment_id=DEP, request=PlacementRequest(model_id=MODEL, memory_bytes=GIB,
                                                    watts=200),
        now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=2 * UNREACHABLE_AFTER_S)
    assert isinstance(dry, Placement)
