"""A sleeping replica's claims on a real PostgreSQL (PlacementStore.shrink_claims and
regrow_claims, and the store activities over them): asleep, a claim keeps only its share of
the model's weights and every free-memory figure counts only that; a wake grows it back
when the room is still there, and says why not, changing nothing, when another replica
took it meanwhile."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from temporalio.testing import ActivityEnvironment

from activities.store import StoreActivities
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, ModelSpec
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import AgentRegistration, Inventory, PortRange
from modelkeeper.domain.placement import CantPlace, PlacementRequest
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.domain.store_activities import (
    RegrowClaimsInput,
    RegrowClaimsResult,
    ShrinkClaimsInput,
)
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
UNREACHABLE_AFTER_S = 6.0
LOST_AFTER_S = 60.0


async def _node(store: Store, node_id: str, memory_gib: int) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id, labels={},
        engine_ports=PortRange(low=20000, high=20999),
        inventory=Inventory(memory_total_bytes=memory_gib * GIB,
                            memory_available_bytes=memory_gib * GIB, cpu_count=8)),
        address="127.0.0.1")


async def _model(store: Store, name: str, *, memory_gib: int, weights_gib: int | None,
                 min_nodes: int = 1, engine_args: dict[str, int] | None = None
                 ) -> CatalogModel:
    return await store.catalog.create_model(CatalogModel(
        model_id=ModelId(name), engine=EngineKind.SIM, source="sim",
        memory_bytes=memory_gib * GIB, min_nodes=min_nodes, engine_args=engine_args or {},
        weights_bytes=None if weights_gib is None else weights_gib * GIB))


async def _place(store: Store, model: CatalogModel, n: int, *,
                 nodes: list[str] | None = None) -> list[ShardSpec] | CantPlace:
    deployment = DeploymentId(f"d-{model.model_id}-{n}")
    await store.deployments.create_deployment(
        deployment, DeploymentRequest(model_id=model.model_id, min_nodes=model.min_nodes),
        f"wf-{deployment}")
    return await store.placement.place_replica(
        deployment_id=deployment, replica_id=ReplicaId(f"r-{model.model_id}-{n}"),
        request=PlacementRequest(
            model_id=model.model_id, memory_bytes=model.memory_bytes,
            min_nodes=model.min_nodes,
            node_ids=None if nodes is None else [NodeId(x) for x in nodes]),
        model=model, now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=LOST_AFTER_S, start_timeout_s=60.0)


async def _placed(store: Store, model: CatalogModel, n: int, *,
                  nodes: list[str] | None = None) -> list[ShardSpec]:
    shards = await _place(store, model, n, nodes=nodes)
    assert not isinstance(shards, CantPlace), shards.summary
    return shards


async def _claims(store: Store, replica_id: str) -> dict[str, tuple[int, int | None]]:
    rows = await store._pool.fetch(
        "SELECT node_id, memory_bytes, awake_memory_bytes FROM allocations "
        "WHERE replica_id = $1", replica_id)
    return {r["node_id"]: (r["memory_bytes"], r["awake_memory_bytes"]) for r in rows}


async def _free(store: Store, node_id: str) -> int | None:
    """The node's free memory as GET /nodes shows it (total less the summed claims)."""
    [record] = [n for n in await store.nodes.list_nodes() if n.node_id == node_id]
    assert record.memory_total_bytes is not None
    return record.memory_total_bytes - record.memory_claimed_bytes


async def _regrow(store: Store, replica_id: str) -> str | None:
    return await store.placement.regrow_claims(
        ReplicaId(replica_id), now=datetime.now(UTC),
        unreachable_after_s=UNREACHABLE_AFTER_S, lost_after_s=LOST_AFTER_S)


async def test_a_sleeping_claim_keeps_its_weights_and_frees_the_rest(store: Store) -> None:
    await _node(store, "n1", 10)
    model = await _model(store, "big", memory_gib=8, weights_gib=3)
    assert not isinstance(await _place(store, model, 1), CantPlace)
    assert await _free(store, "n1") == 2 * GIB

    await store.placement.shrink_claims(ReplicaId("r-big-1"), 3 * GIB)
    assert await _claims(store, "r-big-1") == {"n1": (3 * GIB, 8 * GIB)}
    # Idempotent: a retry, or a second sleep, writes the same.
    await store.placement.shrink_claims(ReplicaId("r-big-1"), 3 * GIB)
    assert await _claims(store, "r-big-1") == {"n1": (3 * GIB, 8 * GIB)}
    # GET /nodes and placement both count the sleeping claim as what it keeps.
    assert await _free(store, "n1") == 7 * GIB
    other = await _model(store, "five", memory_gib=5, weights_gib=None)
    assert not isinstance(await _place(store, other, 1), CantPlace)
    assert await _free(store, "n1") == 2 * GIB

    # The wake needs 5 GiB back and 2 are free: refused, with the figures, and nothing
    # changed.
    reason = await _regrow(store, "r-big-1")
    assert reason is not None
    assert "n1" in reason and str(5 * GIB) in reason and str(2 * GIB) in reason
    assert await _claims(store, "r-big-1") == {"n1": (3 * GIB, 8 * GIB)}

    # Once the room is back, the wake takes it; a second regrow (retried) is a no-op.
    await store.deployments.release_replica("r-five-1")
    assert await _regrow(store, "r-big-1") is None
    assert await _claims(store, "r-big-1") == {"n1": (8 * GIB, None)}
    assert await _regrow(store, "r-big-1") is None
    assert await _free(store, "n1") == 2 * GIB


async def test_a_retried_placement_of_a_sleeping_replica_answers_its_awake_claim(
        store: Store) -> None:
    await _node(store, "n1", 10)
    model = await _model(store, "big", memory_gib=8, weights_gib=3)
    [first] = await _placed(store, model, 1)
    await store.placement.shrink_claims(ReplicaId("r-big-1"), 3 * GIB)
    again = await store.placement.place_replica(
        deployment_id=DeploymentId("d-big-1"), replica_id=ReplicaId("r-big-1"),
        request=PlacementRequest(model_id=model.model_id, memory_bytes=model.memory_bytes),
        model=model, now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=LOST_AFTER_S, start_timeout_s=60.0)
    assert not isinstance(again, CantPlace)
    assert [s.memory_bytes for s in again] == [first.memory_bytes] == [8 * GIB]


async def test_each_shard_keeps_its_share_and_the_sim_frees_as_much(store: Store) -> None:
    await _node(store, "n1", 10)
    await _node(store, "n2", 10)
    model = await _model(store, "split", memory_gib=8, weights_gib=2, min_nodes=2)
    shards = await _placed(store, model, 1)
    # The sim's shards keep the same share of what they hold as the claims keep.
    assert [s.engine_args["weights_bytes"] for s in shards] == [1 * GIB, 1 * GIB]
    await store.placement.shrink_claims(ReplicaId("r-split-1"), 2 * GIB)
    assert await _claims(store, "r-split-1") == {"n1": (1 * GIB, 4 * GIB),
                                                 "n2": (1 * GIB, 4 * GIB)}
    # A sim holding less than its claim (engine_args.memory_bytes) keeps the same share.
    small = await _model(store, "small", memory_gib=4, weights_gib=1,
                         engine_args={"memory_bytes": 64 << 20})
    [shard] = await _placed(store, small, 1, nodes=["n1"])
    assert shard.engine_args["weights_bytes"] == 16 << 20


async def test_no_weights_in_the_catalog_frees_nothing(store: Store) -> None:
    await _node(store, "n1", 10)
    model = await _model(store, "plain", memory_gib=8, weights_gib=None)
    [shard] = await _placed(store, model, 1)
    assert "weights_bytes" not in shard.engine_args
    await store.placement.shrink_claims(ReplicaId("r-plain-1"), None)
    assert await _claims(store, "r-plain-1") == {"n1": (8 * GIB, 8 * GIB)}
    assert await _regrow(store, "r-plain-1") is None
    assert await _claims(store, "r-plain-1") == {"n1": (8 * GIB, None)}


async def test_the_catalog_keeps_weights_bytes(store: Store) -> None:
    created = await store.catalog.create_model(CatalogModel(**ModelSpec(
        model_id=ModelId("w"), engine=EngineKind.VLLM, source="org/w", memory_bytes=8 * GIB,
        weights_bytes=5 * GIB).model_dump()))
    read = await store.catalog.get_model("w")
    assert read is not None and read.weights_bytes == created.weights_bytes == 5 * GIB


async def test_the_activities_shrink_to_the_catalog_weights_and_regrow(store: Store) -> None:
    await _node(store, "n1", 10)
    model = await _model(store, "big", memory_gib=8, weights_gib=3)
    assert not isinstance(await _place(store, model, 1), CantPlace)
    activities = StoreActivities(store, Settings())
    env = ActivityEnvironment()
    await env.run(activities.shrink_claims, ShrinkClaimsInput(replica_id=ReplicaId("r-big-1")))
    assert await _claims(store, "r-big-1") == {"n1": (3 * GIB, 8 * GIB)}
    # Another replica takes the room meanwhile: the wake is refused, with the reason.
    hog = await _model(store, "hog", memory_gib=6, weights_gib=None)
    assert not isinstance(await _place(store, hog, 1), CantPlace)
    refused = await env.run(activities.regrow_claims,
                            RegrowClaimsInput(replica_id=ReplicaId("r-big-1")))
    assert isinstance(refused, RegrowClaimsResult)
    assert not refused.ok and refused.reason is not None and "n1" in refused.reason
    await store.deployments.release_replica("r-hog-1")
    grown = await env.run(activities.regrow_claims,
                          RegrowClaimsInput(replica_id=ReplicaId("r-big-1")))
    assert grown == RegrowClaimsResult(ok=True, reason=None)
    assert await _claims(store, "r-big-1") == {"n1": (8 * GIB, None)}
