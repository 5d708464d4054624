"""Rank 0's rendezvous, claimed by place_replica on a real PostgreSQL (migration 0024):
every shard of a multi-node replica gets rank 0's node address and a port of its engine
range; two replicas with rank 0 on one node never share a port; a retry gets the same
address; a released replica's port is free again; a node that cannot host a rendezvous
is named."""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.testing import ActivityEnvironment

from activities.store import StoreActivities
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, ReplicaStateUpdate
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory, PortRange
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.store_activities import PlaceReplicaInput, PlaceReplicaResult
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
MODEL = ModelId("m-two")
DEPLOYMENT = DeploymentId("d1")


async def _node(store: Store, name: str, address: str, ports: PortRange | None) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(name), name=name, engine_ports=ports,
        inventory=Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                            cpu_count=16)), address=address)


async def _deployment(store: Store, node_ids: list[str]) -> DeploymentSpec:
    await store.catalog.create_model(CatalogModel(
        model_id=MODEL, engine=EngineKind.SIM, source="sim", memory_bytes=2 * GIB,
        min_nodes=2))
    await store.deployments.create_deployment(DEPLOYMENT, DeploymentRequest(model_id=MODEL),
                                              deployment_workflow_id(DEPLOYMENT))
    return DeploymentSpec(deployment_id=DEPLOYMENT, model_id=MODEL, replicas=3, min_nodes=2,
                          node_ids=[NodeId(n) for n in node_ids])


async def _place(store: Store, spec: DeploymentSpec, replica_id: str) -> PlaceReplicaResult:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="deployment/d1",
                                   workflow_run_id="run-1", activity_id=replica_id)
    acts = StoreActivities(store, Settings(database_url="postgresql://unused",
                                           settling_window_s=0))
    result: PlaceReplicaResult = await env.run(acts.place_replica, PlaceReplicaInput(
        spec=spec, replica_id=ReplicaId(replica_id), start_timeout_s=60))
    return result


async def test_rank_0_rendezvous_ports_are_claimed_like_memory(store: Store) -> None:
    await _node(store, "a", "10.0.0.1", PortRange(low=20000, high=20002))
    await _node(store, "b", "fd00::2", PortRange(low=21000, high=21001))
    spec = await _deployment(store, ["a", "b"])

    leaders = []
    for replica in ("r1", "r2"):
        result = await _place(store, spec, replica)
        assert len(result.shards) == 2 and result.cant_place is None
        assert [s.rank for s in result.shards] == [0, 1]
        assert {s.leader_address for s in result.shards} == {result.shards[0].leader_address}
        leaders.append(result.shards[0].leader_address)
    # From the top of rank 0's node's range (the agent hands HTTP ports from the bottom),
    # a port per replica; an IPv6 address in brackets.
    by_node = {"a": "10.0.0.1:{}", "b": "[fd00::2]:{}"}
    high = {"a": 20002, "b": 21001}
    ports = []
    for leader, replica in zip(leaders, ("r1", "r2"), strict=True):
        row = await store._pool.fetchrow(
            "SELECT node_id, rendezvous_port FROM allocations "
            "WHERE replica_id = $1 AND rank = 0", replica)
        assert row is not None
        assert leader == by_node[row["node_id"]].format(row["rendezvous_port"])
        ports.append((row["node_id"], row["rendezvous_port"]))
    assert len(set(ports)) == 2
    for node, port in ports:
        assert port in (high[node], high[node] - 1)

    # A retry of a placed replica answers its claims: the same leader.
    again = await _place(store, spec, "r1")
    assert again.shards[0].leader_address == leaders[0]
    # Only rank 0 holds a port.
    assert await store._pool.fetchval(
        "SELECT count(*) FROM allocations WHERE rendezvous_port IS NOT NULL") == 2

    # Released, its port is free for the next replica.
    await store.deployments.release_replica("r1")
    r3 = await _place(store, spec, "r3")
    row = await store._pool.fetchrow(
        "SELECT node_id, rendezvous_port FROM allocations WHERE replica_id = 'r3' AND rank = 0")
    assert row is not None and (row["node_id"], row["rendezvous_port"]) not in ports[1:]
    assert r3.shards[1].leader_address == r3.shards[0].leader_address


async def test_a_node_that_cannot_host_a_rendezvous_gives_rank_0_to_another(
        store: Store) -> None:
    await _node(store, "a", "10.0.0.1", PortRange(low=20000, high=20009))
    # Placement puts rank 0 on the emptiest node: b, whose agent said nothing of its ports.
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("b"), name="b", inventory=Inventory(
            memory_total_bytes=128 * GIB, memory_available_bytes=128 * GIB, cpu_count=16)),
        address="10.0.0.2")
    spec = await _deployment(store, ["a", "b"])

    placed = await _place(store, spec, "r1")

    assert [(s.node_id, s.rank) for s in placed.shards] == [("a", 0), ("b", 1)]
    assert {s.leader_address for s in placed.shards} == {"10.0.0.1:20009"}
    rows = await store._pool.fetch(
        "SELECT node_id, rank, rendezvous_port FROM allocations ORDER BY rank")
    assert [(r["node_id"], r["rank"], r["rendezvous_port"]) for r in rows] == [
        ("a", 0, 20009), ("b", 1, None)]


async def test_no_node_that_can_host_a_rendezvous_is_a_refusal_naming_each(
        store: Store) -> None:
    await _node(store, "a", "10.0.0.1", PortRange(low=20000, high=20000))
    await _node(store, "b", "10.0.0.2", None)
    spec = await _deployment(store, ["a", "b"])
    first = await _place(store, spec, "r1")
    assert first.shards[0].leader_address == "10.0.0.1:20000"

    refused = await _place(store, spec, "r2")

    assert refused.cant_place is not None
    assert "node a: rank 0 of a multi-node replica needs a rendezvous port, and every " \
           "engine port 20000-20000 is another replica's" in refused.cant_place
    assert "node b: rank 0 of a multi-node replica needs the node's address and engine " \
           "ports, and its agent registered none" in refused.cant_place
    # Nothing of a refused placement is claimed.
    assert await store._pool.fetchval(
        "SELECT count(*) FROM allocations WHERE replica_id = 'r2'") == 0
    assert await store._pool.fetchval("SELECT count(*) FROM replicas") == 1


async def test_a_starting_replicas_shards_ready_is_kept_until_it_is_ready(
        store: Store) -> None:
    await _node(store, "a", "10.0.0.1", PortRange(low=20000, high=20009))
    await _node(store, "b", "10.0.0.2", PortRange(low=20000, high=20009))
    spec = await _deployment(store, ["a", "b"])
    await _place(store, spec, "r1")

    async def shown() -> int | None:
        [replica] = await store.deployments.list_replicas()
        return replica.shards_ready

    starting = ReplicaStateUpdate(replica_id=ReplicaId("r1"), state=ReplicaState.STARTING)
    await store.deployments.record_replica_state(starting.model_copy(update={"shards_ready": 1}))
    assert await shown() == 1
    # The keeper's own write of 'starting', which says nothing of shards, keeps it.
    await store.deployments.record_replica_state(starting)
    assert await shown() == 1
    await store.deployments.record_replica_state(
        ReplicaStateUpdate(replica_id=ReplicaId("r1"), state=ReplicaState.READY))
    assert await shown() is None
