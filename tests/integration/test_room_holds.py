"""Room held for a preemptor (modelkeeper.store.holds) on a real PostgreSQL: placement,
its dry run and the eviction's reads count another deployment's hold as claimed, the
holder's own do not, the holder's placement deletes its holds, and a hold expires."""

from __future__ import annotations

import dataclasses

import asyncpg
import pytest
from temporalio.testing import ActivityEnvironment

from activities.store import StoreActivities
from modelkeeper.domain.capacity import CapacityClass, Quota, Resources
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, ReplicaStateUpdate
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.placement import Placement, PlacementRequest
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.store_activities import (
    FindEvictionInput,
    PlaceReplicaInput,
    PlaceReplicaResult,
)
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.holds import HoldClaim

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
SETTINGS = Settings(database_url="postgresql://unused", settling_window_s=0)



async def _deployment(store: Store, deployment_id: str, gib: int, *,
                      capacity_class: CapacityClass | None = None,
                      node_ids: list[NodeId] | None = None,
                      owner: str | None = None) -> DeploymentSpec:
    model = CatalogModel(model_id=ModelId(f"m-{deployment_id}"), engine=EngineKind.SIM,
                         source="sim", memory_bytes=gib * GIB)
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(
        DeploymentId(deployment_id),
        DeploymentRequest(model_id=model.model_id, capacity_class=capacity_class,
                          node_ids=node_ids, owner=owner),
        deployment_workflow_id(DeploymentId(deployment_id)))
    return DeploymentSpec(deployment_id=DeploymentId(deployment_id), model_id=model.model_id,
                          replicas=1, capacity_class=capacity_class, node_ids=node_ids,
                          owner=owner)


def _env(activity_id: str, deployment_id: str = "d") -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=f"deployment/{deployment_id}",
                                   workflow_run_id="run-1", activity_id=activity_id)
    return env


async def _place(store: Store, spec: DeploymentSpec, replica_id: str) -> PlaceReplicaResult:
    return await _env(f"place-{replica_id}", spec.deployment_id).run(
        StoreActivities(store, SETTINGS).place_replica, PlaceReplicaInput(
            spec=spec, replica_id=ReplicaId(replica_id), start_timeout_s=60))


async def test_held_room_is_claimed_for_all_but_its_holder_until_it_places(
        store: Store, db: asyncpg.Connection) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                            cpu_count=16)))
    holder = await _deployment(store, "d-holder", 6)
    other = await _deployment(store, "d-other", 4)
    await store.placement.hold_room(deployment_id=holder.deployment_id,
                    claims=[HoldClaim(node_id=NodeId("n1"), memory_bytes=6 * GIB)],
                    reason="preempted o-r1 for d-holder", hold_s=120)

    # 8 GiB free, 6 held for d-holder: 4 GiB fits nowhere for anyone else.
    refused = await _place(store, other, "d-other-r1")
    assert not refused.shards and refused.cant_place is not None
    assert "2.0 GiB free" in refused.cant_place
    dry = await store.placement.dry_run_placement(
        deployment_id=other.deployment_id,
        request=PlacementRequest(model_id=other.model_id, memory_bytes=4 * GIB),
        now=await db.fetchval("SELECT now()"), unreachable_after_s=60, lost_after_s=120)
    assert not isinstance(dry, Placement)

    # The holder places into its own hold, which goes with it.
    placed = await _place(store, holder, "d-holder-r1")
    assert placed.shards
    assert await db.fetchval("SELECT count(*) FROM room_holds") == 0


async def test_an_expired_hold_holds_nothing(store: Store, db: asyncpg.Connection) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                            cpu_count=16)))
    holder = await _deployment(store, "d-holder", 6)
    other = await _deployment(store, "d-other", 4)
    await store.placement.hold_room(deployment_id=holder.deployment_id,
                    claims=[HoldClaim(node_id=NodeId("n1"), memory_bytes=6 * GIB)],
                    reason="preempted o-r1 for d-holder", hold_s=120)
    await db.execute("UPDATE room_holds SET expires_at = now() - interval '1 second'")
    assert (await _place(store, other, "d-other-r1")).shards


async def test_a_critical_deployment_preempts_what_makes_its_room_and_holds_it(
        store: Store, db: asyncpg.Connection) -> None:
    """find_eviction as the activity runs it: the opportunistic replicas of one node make
    a 2 GiB critical replica's room (n1's two, or n2's one beside its free GiB), each is
    named for the preempt signal, and the room is held for the critical one until it
    places: a victim placing again first finds none."""
    for node in ("n1", "n2"):
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId(node), name=node,
            inventory=Inventory(memory_total_bytes=2 * GIB, memory_available_bytes=2 * GIB,
                                cpu_count=16)))
    low = []
    for name, node in (("d-a", "n1"), ("d-b", "n1"), ("d-c", "n2")):
        spec = await _deployment(store, name, 1, capacity_class=CapacityClass.OPPORTUNISTIC,
                                 node_ids=[NodeId(node)])
        assert (await _place(store, spec, f"{name}-r1")).shards
        await store.deployments.record_replica_state(ReplicaStateUpdate(
            replica_id=ReplicaId(f"{name}-r1"), state=ReplicaState.READY))
        low.append(spec)
    crit = await _deployment(store, "d-crit", 2, capacity_class=CapacityClass.CRITICAL)
    found = await _env("find").run(StoreActivities(store, SETTINGS).find_eviction,
                                   FindEvictionInput(spec=crit,
                                                     replica_id=ReplicaId("d-crit-r1")))
    assert found.choice is None
    assert sorted(t.replica_id for t in found.preempt) in (["d-a-r1", "d-b-r1"],
                                                           ["d-c-r1"]), found
    assert all(t.reason.startswith("preempted by d-crit") for t in found.preempt)
    # What the critical replica needs is held on the node it will go to (not only what
    # the victims free: n2's free 1 GiB would go to the first victim placing again).
    held = await db.fetch("SELECT deployment_id, node_id, memory_bytes FROM room_holds")
    assert [(r["deployment_id"], r["memory_bytes"]) for r in held] == [("d-crit", 2 * GIB)]
    # The victims stop (their deployments' workflows do it): the room is the holder's.
    for target in found.preempt:
        assert await store.deployments.release_replica(target.replica_id)
    victim = next(s for s in low if s.deployment_id == found.preempt[0].deployment_id)
    assert not (await _place(store, victim, f"{victim.deployment_id}-r2")).shards
    assert (await _place(store, crit, "d-crit-r1")).shards
    assert await db.fetchval("SELECT count(*) FROM room_holds") == 0


async def test_a_scope_within_its_guarantee_takes_back_what_another_borrowed(
        store: Store, db: asyncpg.Connection) -> None:
    """Team a is guaranteed 2 GiB; team b, promised nothing, fills the node with
    standard replicas. a's standard deployment is outranked by nobody, yet its replica
    takes back b's borrowed room (rule 10), read through the activity with the quotas
    table; a replica within its own guarantee would not be taken."""
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=2 * GIB, memory_available_bytes=2 * GIB,
                            cpu_count=16)))
    await store.quotas.set_quota(Quota(scope="a", guarantee=Resources(memory_bytes=2 * GIB)))
    for name in ("d-b1", "d-b2"):
        spec = await _deployment(store, name, 1, owner="b")
        assert (await _place(store, spec, f"{name}-r1")).shards
        await store.deployments.record_replica_state(ReplicaStateUpdate(
            replica_id=ReplicaId(f"{name}-r1"), state=ReplicaState.READY))
    asking = await _deployment(store, "d-a", 2, owner="a")
    found = await _env("find").run(StoreActivities(store, SETTINGS).find_eviction,
                                   FindEvictionInput(spec=asking,
                                                     replica_id=ReplicaId("d-a-r1")))
    assert sorted(t.replica_id for t in found.preempt) == ["d-b1-r1", "d-b2-r1"], found
    # Once a holds its guarantee, b's deployment is refused a's room back.
    await store.quotas.set_quota(Quota(scope="b", guarantee=Resources(memory_bytes=2 * GIB)))
    await db.execute("DELETE FROM room_holds")
    found = await _env("find-2").run(StoreActivities(store, SETTINGS).find_eviction,
                                     FindEvictionInput(spec=asking,
                                                       replica_id=ReplicaId("d-a-r1")))
    assert found.preempt == [] and found.choice is None
