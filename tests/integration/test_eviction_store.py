"""Eviction's reads and its activity on a real PostgreSQL: ``find_eviction`` run as
Temporal runs it (``ActivityEnvironment``), on replicas placed by ``place_replica``.

* The candidates are read with their deployment's policy, their claims (a sleeping
  replica's shrunk claim) and the gateways' usage rows, by the freshness rule of drains:
  a ready replica's stale row is unknown, a sleeping replica's old row still counts.
* Every candidate refused is named with its reason; a replica starting, or of the
  deployment asking, is not a candidate at all.
* The activity claims nothing and stops nothing, and says so when the replica fits now.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from temporalio.testing import ActivityEnvironment

from activities.store import StoreActivities
from modelkeeper.domain.capacity import CapacityClass, Holding, Quota, Resources
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest, ReplicaStateUpdate
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.eviction import EvictionChoice, NoVictim, RefusalReason, VictimKind
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory, PortRange
from modelkeeper.domain.placement import PlacementRequest
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.store_activities import (
    EvictionFound,
    FindEvictionInput,
    PlaceReplicaInput,
)
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.eviction import read_asker, read_candidates, read_holdings

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=3600)
#: The settings' defaults: a row older than 5 flush intervals of 1 s is stale.
SETTINGS = Settings(database_url="postgresql://unused", settling_window_s=0)



def _attempt(activity_id: str) -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="deployment/d-asked",
                                   workflow_run_id="run-1", activity_id=activity_id)
    return env


async def _node(store: Store, node_id: str, memory_gib: int) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id,
        engine_ports=PortRange(low=20000, high=20999),
        inventory=Inventory(memory_total_bytes=memory_gib * GIB,
                            memory_available_bytes=memory_gib * GIB, cpu_count=16)),
        address="127.0.0.1")


async def _deployment(store: Store, db: asyncpg.Connection, deployment_id: str, *,
                      gib: int, policy: ScalingPolicy | None = ON_DEMAND, min_nodes: int = 1,
                      node_ids: list[str] | None = None) -> DeploymentSpec:
    """A deployment of its own model of ``gib`` GiB, with ``policy`` stored as the API
    stores it (the deployments.scaling column)."""
    model = CatalogModel(model_id=ModelId(f"m-{deployment_id}"), engine=EngineKind.SIM,
                         source="sim", memory_bytes=gib * GIB, min_nodes=min_nodes)
    await store.catalog.create_model(model)
    nodes = [NodeId(n) for n in node_ids] if node_ids is not None else None
    await store.deployments.create_deployment(
        DeploymentId(deployment_id),
        DeploymentRequest(model_id=model.model_id, min_nodes=min_nodes, node_ids=nodes),
        deployment_workflow_id(DeploymentId(deployment_id)))
    if policy is not None:
        await db.execute("UPDATE deployments SET scaling = $2::jsonb WHERE deployment_id = $1",
                         deployment_id, policy.model_dump_json())
    return DeploymentSpec(deployment_id=DeploymentId(deployment_id), model_id=model.model_id,
                          replicas=1, min_nodes=min_nodes, node_ids=nodes, scaling=policy)


async def _replica(store: Store, db: asyncpg.Connection, spec: DeploymentSpec,
                   replica_id: str, *, ready_min_ago: float | None = 60) -> None:
    """A replica of ``spec`` placed for real, ready since ``ready_min_ago`` (None: still
    starting)."""
    acts = StoreActivities(store, SETTINGS)
    placed = await _attempt(f"place-{replica_id}").run(acts.place_replica, PlaceReplicaInput(
        spec=spec, replica_id=ReplicaId(replica_id), start_timeout_s=60))
    assert placed.shards, placed.cant_place
    if ready_min_ago is None:
        return
    await store.deployments.record_replica_state(ReplicaStateUpdate(
        replica_id=ReplicaId(replica_id), state=ReplicaState.READY))
    await db.execute("UPDATE replicas SET ready_at = now() - make_interval(secs => $2) "
                     "WHERE replica_id = $1", replica_id, ready_min_ago * 60.0)


async def _usage(db: asyncpg.Connection, replica_id: str, *, in_flight: int = 0,
                 used_min_ago: float = 30, written_s_ago: float = 0,
                 gateway: str = "g1") -> None:
    """One gateway worker's row, written ``written_s_ago`` (the store's clock)."""
    await db.execute(
        "INSERT INTO replica_usage (gateway_id, replica_id, in_flight, last_used_at, "
        "updated_at, reporting_since) VALUES ($1, $2, $3, now() - make_interval(secs => $4), "
        "now() - make_interval(secs => $5), now() - interval '5 hours')",
        gateway, replica_id, in_flight, used_min_ago * 60.0, float(written_s_ago))


async def _find(store: Store, spec: DeploymentSpec) -> EvictionFound:
    return await _attempt("find").run(
        StoreActivities(store, SETTINGS).find_eviction,
        FindEvictionInput(spec=spec, replica_id=ReplicaId(f"{spec.deployment_id}-r9")))


async def _claims(db: asyncpg.Connection) -> list[tuple[str, str, int]]:
    rows = await db.fetch("SELECT replica_id, node_id, memory_bytes FROM allocations "
                          "ORDER BY replica_id, node_id")
    return [(r["replica_id"], r["node_id"], r["memory_bytes"]) for r in rows]


async def test_the_most_idle_on_demand_replica_is_chosen_and_nothing_is_claimed_or_stopped(
    store: Store, db: asyncpg.Connection,
) -> None:
    await _node(store, "n1", 16)
    old = await _deployment(store, db, "d-old", gib=8)
    recent = await _deployment(store, db, "d-recent", gib=8)
    asked = await _deployment(store, db, "d-asked", gib=8)
    await _replica(store, db, old, "r-old")
    await _replica(store, db, recent, "r-recent")
    await _usage(db, "r-old", used_min_ago=20)
    await _usage(db, "r-recent", used_min_ago=5)
    # Two workers report r-old: their counts are summed, their latest use is its use.
    await _usage(db, "r-old", used_min_ago=14.5, gateway="g2")
    before = await _claims(db)

    found = await _find(store, asked)
    choice = found.choice
    assert choice is not None and not found.fits_now
    assert (choice.replica_id, choice.node_id) == ("r-old", "n1")
    assert choice.freed_bytes == 8 * GIB and not choice.asleep
    assert 14.5 * 60 <= choice.idle_s < 15 * 60
    assert found.reason == choice.reason == (
        "evicted d-old (replica r-old, idle 14 min, 8.0 GiB on n1) to place d-asked")
    assert await _claims(db) == before
    assert {r.replica_id: r.state for r in await store.deployments.list_replicas()} == {
        "r-old": ReplicaState.READY, "r-recent": ReplicaState.READY}

    # Once the victim's workflow has stopped it, the replica fits: nothing more to evict.
    assert await store.deployments.release_replica("r-old")
    found = await _find(store, asked)
    assert found.choice is None and found.fits_now
    assert found.reason == "fits without evicting anything, on n1"


async def test_every_candidate_is_read_with_its_policy_claims_and_usage(
    store: Store, db: asyncpg.Connection,
) -> None:
    """n1 full of replicas that may not be evicted, each for its own reason; then a
    sleeping one whose only usage row is old (no gateway routes a sleeping replica, so
    none refreshes it): it counts, and that replica is chosen for what it keeps."""
    await _node(store, "n1", 20)
    await _node(store, "n2", 4)
    n1 = ["n1"]
    asleep = await _deployment(store, db, "d-asleep", gib=4, node_ids=n1)
    await _replica(store, db, asleep, "r-asleep")
    # Asleep: it keeps 2 GiB of weights of the 4 it held awake.
    await db.execute("UPDATE replicas SET state = 'sleeping' WHERE replica_id = 'r-asleep'")
    await db.execute("UPDATE allocations SET awake_memory_bytes = memory_bytes, "
                     "memory_bytes = $1 WHERE replica_id = 'r-asleep'", 2 * GIB)
    policies: dict[str, ScalingPolicy | None] = {
        "r-stale": ON_DEMAND, "r-none": ON_DEMAND, "r-busy": ON_DEMAND, "r-new": ON_DEMAND,
        "r-fixed": None, "r-promise": ScalingPolicy(min_replicas=1, max_replicas=2),
    }
    for replica_id, policy in policies.items():
        spec = await _deployment(store, db, f"d-{replica_id[2:]}", gib=2, node_ids=n1,
                                 policy=policy)
        await _replica(store, db, spec, replica_id,
                       ready_min_ago=1 if replica_id == "r-new" else 60)
    wide = await _deployment(store, db, "d-wide", gib=4, min_nodes=2)
    await _replica(store, db, wide, "r-wide")
    starting = await _deployment(store, db, "d-starting", gib=2, node_ids=n1)
    await _replica(store, db, starting, "r-starting", ready_min_ago=None)
    asked = await _deployment(store, db, "d-asked", gib=2, node_ids=n1)
    await _replica(store, db, asked, "r-own")
    for replica_id in ("r-busy", "r-new", "r-fixed", "r-promise", "r-wide", "r-own",
                       "r-starting"):
        await _usage(db, replica_id, in_flight=3 if replica_id == "r-busy" else 0)
    await _usage(db, "r-stale", written_s_ago=6)  # 5 flush intervals of 1 s: stale
    assert sum(m for _, n, m in await _claims(db) if n == "n1") == 20 * GIB  # n1 is full

    found = await _find(store, asked)
    assert found.choice is None and not found.fits_now
    assert {r.replica_id: r.reason_code for r in found.refusals} == {
        "r-asleep": RefusalReason.USAGE_UNKNOWN,  # no row at all
        "r-stale": RefusalReason.USAGE_UNKNOWN, "r-none": RefusalReason.USAGE_UNKNOWN,
        "r-busy": RefusalReason.IN_USE, "r-new": RefusalReason.PROTECTED,
        "r-fixed": RefusalReason.NOT_ON_DEMAND, "r-promise": RefusalReason.NOT_ON_DEMAND,
        "r-wide": RefusalReason.MULTI_NODE,
        # Listed, so the asker seeks again once it serves; the asker's own r-own is not.
        "r-starting": RefusalReason.NOT_SERVING,
    }
    assert "r-busy (d-busy): 3 request(s) in flight" in found.reason
    assert "r-promise (d-promise): min 1: a promise" in found.reason

    await _usage(db, "r-asleep", used_min_ago=40, written_s_ago=3600)
    found = await _find(store, asked)
    assert found.choice is not None
    assert (found.choice.replica_id, found.choice.asleep, found.choice.freed_bytes) == (
        "r-asleep", True, 2 * GIB)
    assert found.reason == ("evicted d-asleep (replica r-asleep, idle 40 min, asleep, 2.0 GiB on "
                      "n1) to place d-asked")



async def test_a_woken_replica_is_protected_again_from_its_wake(
    store: Store, db: asyncpg.Connection,
) -> None:
    """A wake makes a replica ready again, and the protection window counts from it: a
    replica asleep for an hour is not evicted the moment it wakes."""
    await _node(store, "n1", 16)
    spec = await _deployment(store, db, "d-old", gib=10)
    await _replica(store, db, spec, "r-old", ready_min_ago=60)
    for state in (ReplicaState.DRAINING, ReplicaState.SLEEPING, ReplicaState.READY):
        await store.deployments.record_replica_state(ReplicaStateUpdate(
            replica_id=ReplicaId("r-old"), state=state))
    woke = await db.fetchval("SELECT now() - ready_at FROM replicas WHERE replica_id = 'r-old'")
    assert woke < timedelta(minutes=1)
    await _usage(db, "r-old", used_min_ago=30)
    asking = await _deployment(store, db, "d-new", gib=10)
    found = await _find(store, asking)
    assert found.choice is None
    assert [r.reason_code for r in found.refusals] == [RefusalReason.PROTECTED]


async def test_a_model_asked_for_while_the_other_still_starts_seeks_again_soon(
    store: Store, db: asyncpg.Connection,
) -> None:
    """The other on-demand model holds the room but is still starting: not a victim yet,
    but listed, so the asker seeks again in RESEEK_S instead of reading cant_place until a
    node changes (the bench's evict run met it behind the settling window)."""
    from modelkeeper.domain.eviction import RESEEK_S

    await _node(store, "n1", 16)
    spec = await _deployment(store, db, "d-first", gib=10)
    await _replica(store, db, spec, "r-first", ready_min_ago=None)  # starting
    asking = await _deployment(store, db, "d-second", gib=10)
    before = await db.fetchval("SELECT now()")
    found = await _find(store, asking)
    assert found.choice is None and not found.fits_now
    assert [r.reason_code for r in found.refusals] == [RefusalReason.NOT_SERVING]
    assert found.retry_at is not None
    assert timedelta(0) < found.retry_at - before <= timedelta(seconds=RESEEK_S + 5)


async def test_candidates_and_the_asker_are_read_with_class_owner_and_counts(
    store: Store, db: asyncpg.Connection,
) -> None:
    """Preemption's fields come from the tables: a deployment's declared class, owner and
    awake replicas (ready or starting, not asleep); the asker's effective class, minimum
    and what its replica would hold; every owner's holdings; and the quotas given guard
    what is within a guarantee."""
    await _node(store, "n1", 16)
    await _node(store, "n2", 8)
    grown = ScalingPolicy(min_replicas=1, max_replicas=3)
    exp = await _deployment(store, db, "d-exp", gib=4, policy=grown, node_ids=["n1"])
    for r in ("r-exp1", "r-exp2", "r-exp3"):
        await _replica(store, db, exp, r)
    await db.execute("UPDATE replicas SET state = 'sleeping' WHERE replica_id = 'r-exp3'")
    await db.execute("UPDATE deployments SET capacity_class = 'opportunistic', "
                     "owner = 'org/b' WHERE deployment_id = 'd-exp'")
    other = await _deployment(store, db, "d-other", gib=4, policy=None, node_ids=["n1"])
    await _replica(store, db, other, "r-other")
    await _usage(db, "r-other", in_flight=1)
    crit = await _deployment(store, db, "d-crit", gib=8, policy=grown)
    await db.execute("UPDATE deployments SET capacity_class = 'critical', owner = 'org/a' "
                     "WHERE deployment_id = 'd-crit'")
    # n2 is full of a critical replica nobody owns: only n1's room can be made.
    filler = await _deployment(store, db, "d-filler", gib=8, policy=None, node_ids=["n2"])
    await _replica(store, db, filler, "r-filler")
    await db.execute("UPDATE deployments SET capacity_class = 'critical' "
                     "WHERE deployment_id = 'd-filler'")
    request = PlacementRequest(model_id=crit.model_id, memory_bytes=8 * GIB, cpu_cores=2.0)

    read = {str(c.replica_id): c for c in await read_candidates(
        db, for_deployment=DeploymentId("d-crit"), stale_after_s=5.0)}
    asker = await read_asker(db, DeploymentId("d-crit"), request)
    holdings = await read_holdings(db)
    exp1 = read["r-exp1"]
    assert (exp1.capacity_class, exp1.owner, exp1.deployment_replicas) == (
        CapacityClass.OPPORTUNISTIC, "org/b", 2)  # two awake; the sleeper is not counted
    assert exp1.beyond_min and read["r-exp3"].beyond_min
    fixed = read["r-other"]
    assert (fixed.capacity_class, fixed.runs_as, fixed.owner) == (
        None, CapacityClass.STANDARD, None)
    assert asker is not None
    assert (asker.capacity_class, asker.owner, asker.replicas, asker.min_replicas) == (
        CapacityClass.CRITICAL, "org/a", 0, 1)
    assert asker.holds == Resources(memory_bytes=8 * GIB, cpu_cores=2.0)
    assert holdings == [Holding(owner="org/b", resources=Resources(memory_bytes=12 * GIB))]

    async def find(*, preempting: bool = False, quotas: Sequence[Quota] = (),
                   ) -> EvictionChoice | NoVictim:
        return await store.placement.find_eviction(
            deployment_id=DeploymentId("d-crit"), request=request, now=datetime.now(UTC),
            unreachable_after_s=SETTINGS.node_unreachable_after_s,
            lost_after_s=SETTINGS.node_lost_after_s, stale_after_s=5.0, protect_s=300.0,
            preempting=preempting, quotas=quotas)

    # Eviction alone (issue 21's callers): nothing on n1 is idle on demand.
    assert isinstance(await find(), NoVictim)
    # Preempting: the lowest class first; d-exp's usage is unknown (not idle) and its
    # replicas are the same size, so by replica id: two of 4 GiB make the 8.
    found = await find(preempting=True)
    assert isinstance(found, EvictionChoice), found
    assert {v.replica_id: v.kind for v in found.victims} == {
        "r-exp1": VictimKind.PREEMPT, "r-exp2": VictimKind.PREEMPT}
    assert found.together and found.place_on == ["n1"]
    # org/b is guaranteed 8 GiB of the 12 it holds: one replica of 4 may go, not two; the
    # rest of the room is made by d-other, fixed and in use but standard, below critical.
    guarded = await find(preempting=True, quotas=[
        Quota(scope="org/b", guarantee=Resources(memory_bytes=8 * GIB))])
    assert isinstance(guarded, EvictionChoice), guarded
    assert [v.replica_id for v in guarded.victims] == ["r-exp1", "r-other"]
