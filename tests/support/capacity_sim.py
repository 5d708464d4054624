"""Builders for the capacity rules' tests (tests/unit/test_preemption.py,
tests/unit/test_capacity_sim.py): nodes, candidates, askers and the property checks the
seeded simulation runs, as plain functions so the mutation checks can run them too."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from modelkeeper.domain.capacity import (
    CapacityClass,
    Holding,
    Quota,
    Resources,
    held_by,
    outranks,
    within,
    within_guarantee,
)
from modelkeeper.domain.demand import ReplicaUse, ScalingPolicy
from modelkeeper.domain.eviction import (
    Asker,
    Candidate,
    EvictionChoice,
    NoVictim,
    VictimClaim,
    VictimKind,
    choose_victim,
    without,
)
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.placement import NodeView, Placement, PlacementRequest, place
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.units import GIB

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PROTECT_S = 300.0
ASKER = DeploymentId("d-asked")
ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=4, idle_timeout_s=3600)
STEADY = ScalingPolicy(min_replicas=1, max_replicas=4)


def node(node_id: str, *, mem_gib: int = 16, claimed_gib: int = 0) -> NodeView:
    return NodeView(node_id=NodeId(node_id), name=node_id, state=NodeState.READY,
                    memory_total_bytes=mem_gib * GIB, memory_claimed_bytes=claimed_gib * GIB)


def nodes_holding(candidates: Sequence[Candidate], *, mem_gib: int = 16,
                  names: Sequence[str] = ("n1",)) -> list[NodeView]:
    """Nodes ``names``, each claimed exactly by the candidates on it."""
    return [node(n, mem_gib=mem_gib,
                 claimed_gib=sum(cl.memory_bytes for c in candidates for cl in c.claims
                                 if cl.node_id == n) // GIB)
            for n in names]


def asking(mem_gib: int = 8, min_nodes: int = 1) -> PlacementRequest:
    return PlacementRequest(model_id=ModelId("m-asked"), memory_bytes=mem_gib * GIB,
                            min_nodes=min_nodes, deployment_id=ASKER)


def asker(cls: CapacityClass = CapacityClass.STANDARD, *, owner: str | None = None,
          replicas: int = 0, min_replicas: int = 0, mem_gib: int = 8) -> Asker:
    return Asker(deployment_id=ASKER, capacity_class=cls, owner=owner, replicas=replicas,
                 min_replicas=min_replicas, holds=Resources(memory_bytes=mem_gib * GIB))


def candidate(replica_id: str, *, deployment: str | None = None, on: str = "n1",
              gib: int = 8, idle_min: float = 30, in_flight: int = 0,
              policy: ScalingPolicy | None = ON_DEMAND,
              cls: CapacityClass | None = None, owner: str | None = None,
              running: int = 1, state: ReplicaState = ReplicaState.READY,
              ready_min_ago: float = 60, known: bool = True) -> Candidate:
    return Candidate(
        replica_id=ReplicaId(replica_id),
        deployment_id=DeploymentId(deployment or f"d-{replica_id}"),
        policy=policy, state=state, ready_at=NOW - timedelta(minutes=ready_min_ago),
        claims=[VictimClaim(node_id=NodeId(on), memory_bytes=gib * GIB)],
        use=ReplicaUse(replica_id=ReplicaId(replica_id), in_flight=in_flight,
                       last_used_at=NOW - timedelta(minutes=idle_min),
                       reporting_since=NOW - timedelta(hours=5)) if known else None,
        capacity_class=cls, owner=owner, deployment_replicas=running)


def holdings_of(candidates: Sequence[Candidate], *extra: Holding) -> list[Holding]:
    """One holding per candidate, and ``extra`` (the asker's own replicas)."""
    return [Holding(owner=c.owner, resources=c.holds) for c in candidates] + list(extra)


def choose(request: PlacementRequest, nodes: Sequence[NodeView],
           candidates: Sequence[Candidate], *, who: Asker | None = None,
           quotas: Sequence[Quota] = (), holdings: Sequence[Holding] | None = None,
           ) -> EvictionChoice | NoVictim:
    return choose_victim(request, nodes, candidates, for_deployment=ASKER, now=NOW,
                         protect_s=PROTECT_S, asker=who, quotas=quotas,
                         holdings=holdings_of(candidates) if holdings is None else holdings)


# -- the properties the simulation checks ----------------------------------------------------

def victims_of(result: EvictionChoice, candidates: Sequence[Candidate]) -> list[Candidate]:
    by_id = {c.replica_id: c for c in candidates}
    return [by_id[v.replica_id] for v in result.victims]


def class_violations(result: EvictionChoice | NoVictim, candidates: Sequence[Candidate], *,
                     who: Asker, quotas: Sequence[Quota], holdings: Sequence[Holding],
                     ) -> list[str]:
    """Victims of a higher class than the asker's: allowed only as borrowed room taken
    back for a scope within its own guarantee (rule 10)."""
    if isinstance(result, NoVictim):
        return []
    reclaiming = within_guarantee(who.owner, who.holds, quotas, holdings)
    return [f"{c.replica_id} ({c.runs_as.value}) stopped for {who.capacity_class.value}"
            for c in victims_of(result, candidates)
            if outranks(c.runs_as, who.capacity_class) and not reclaiming]


def guarantee_violations(result: EvictionChoice | NoVictim, candidates: Sequence[Candidate],
                         *, who: Asker | None, quotas: Sequence[Quota],
                         holdings: Sequence[Holding]) -> list[str]:
    """Guaranteed scopes (the asker not beneath them) that the victims take below their
    guarantee in a part the victims hold."""
    if isinstance(result, NoVictim):
        return []
    victims = victims_of(result, candidates)
    found = []
    for quota in quotas:
        if quota.guarantee.empty or (who is not None and who.owner is not None
                                     and within(who.owner, quota.scope)):
            continue
        mine = [v for v in victims if v.owner is not None and within(v.owner, quota.scope)]
        if not mine:
            continue
        taken = sum((v.holds for v in mine), Resources())
        held = held_by(quota.scope, holdings)
        g = quota.guarantee
        if taken.memory_bytes and held.memory_bytes - taken.memory_bytes < g.memory_bytes:
            found.append(f"{quota.scope}: memory taken below its guarantee")
        if taken.gpus and held.gpus - taken.gpus < g.gpus:
            found.append(f"{quota.scope}: gpus taken below its guarantee")
    return found


def room_violations(result: EvictionChoice | NoVictim, candidates: Sequence[Candidate],
                    request: PlacementRequest, nodes: Sequence[NodeView]) -> list[str]:
    """Victims that do not make the room, or a set with a victim it does not need."""
    if isinstance(result, NoVictim):
        fits = isinstance(place(request, nodes), Placement)
        return [] if result.fits_now == fits else ["fits_now is wrong"]
    victims = victims_of(result, candidates)
    found = []
    if not isinstance(place(request, without(nodes, victims)), Placement):
        found.append("the victims do not make the room")
    if len(victims) > 1:
        for v in victims:
            rest = [x for x in victims if x is not v]
            if isinstance(place(request, without(nodes, rest)), Placement):
                found.append(f"{v.replica_id} is not needed")
    return found


def kind_violations(result: EvictionChoice | NoVictim, candidates: Sequence[Candidate],
                    ) -> list[str]:
    """An evicted (count lowered) victim that is not idle on demand, or a set with a
    preemption not marked to be stopped together."""
    if isinstance(result, NoVictim):
        return []
    found = []
    for v, c in zip(result.victims, victims_of(result, candidates), strict=True):
        if v.kind is VictimKind.EVICT and not (
                c.policy is not None and c.policy.min_replicas == 0 and c.use is not None
                and c.use.in_flight == 0):
            found.append(f"{c.replica_id} evicted but not idle on demand")
    preempts = any(v.kind is VictimKind.PREEMPT for v in result.victims)
    if preempts != result.together:
        found.append("together does not say whether a victim is preempted")
    return found
