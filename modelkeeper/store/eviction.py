"""The replicas eviction may choose from (:mod:`modelkeeper.domain.eviction`), read with
their deployment's scaling policy, their claims and the gateways' usage of them.

One query, run by :meth:`.placement.PlacementStore.find_eviction` in the same snapshot as
the nodes it reads, so that the nodes' summed claims include exactly the candidates'
claims that the choice removes on its copy.

Only ``ready``, ``sleeping`` and ``starting`` replicas of other deployments are read: the
others (draining, stopping, unreachable) are on their way out, and their release tells
the asking deployment anyway. A starting one is refused (rule 4) but soon serves: listed,
it tells the asker to seek again rather than give up (a model asked for while the other
one still loads would otherwise read cant_place until a node changed). The policy and the
single-node rules are left to the choice, which names each replica it refuses and why.

Each candidate also carries what preemption reads of it (issue 22): its deployment's
declared class and owner, and how many awake replicas (ready or starting) that deployment
runs, which :attr:`~modelkeeper.domain.eviction.Candidate.beyond_min` compares with its
policy's minimum. :func:`read_asker` reads the same of the deployment asking, and
:func:`read_holdings` what every owner's replicas hold, for the quotas' guarantees.

Usage follows the freshness rule of :mod:`modelkeeper.domain.draining`: a gateway
worker's row of a ready replica counts while it is younger than
:func:`~modelkeeper.domain.draining.stale_after_s` (a worker routing it writes one every
flush interval); a replica with no such row is unknown, never idle. A sleeping replica is
routed by no gateway, so none refreshes its rows: its rows count whatever their age (its
last use is still its last use), and a sleeping replica with no row at all (every worker
that served it has since stopped) is unknown too.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg
from pydantic import ValidationError

from ..domain.capacity import CapacityClass, Holding, Resources, effective_class
from ..domain.demand import ReplicaUse, ScalingPolicy
from ..domain.eviction import EVICTABLE_STATES, Asker, Candidate, VictimClaim
from ..domain.ids import DeploymentId, NodeId, ReplicaId
from ..domain.placement import PlacementRequest
from ..domain.status import ReplicaState

#: The replicas a deployment's minimum counts: those serving or on their way (a minimum
#: promises replicas that serve; a sleeper beside them is not one, nor one draining).
AWAKE_STATES = frozenset({ReplicaState.READY, ReplicaState.STARTING})

#: What the query lists: the states eviction may choose from, and starting (refused, but
#: a reason to seek again soon).
LISTED_STATES = EVICTABLE_STATES | {ReplicaState.STARTING}

#: The candidates: one row per claim, each with its replica, its deployment's policy and
#: the replica's usage summed over the rows that count (``reported`` 0: none counts).
#: ``$1`` the deployment asking, ``$2`` the states, ``$3`` the seconds after which a ready
#: replica's row is stale, ``$4`` the states counted awake; "now" is the transaction's,
#: the store clock that stamped the rows.
_CANDIDATES = """
    SELECT r.replica_id, r.deployment_id, r.state, r.ready_at,
           d.scaling::text AS scaling, d.capacity_class, d.owner,
           COALESCE(w.awake, 0)::int AS awake,
           a.node_id, a.memory_bytes, a.cpu_cores::float8 AS cpu_cores, a.gpu_indices,
           a.awake_memory_bytes,
           u.reported, u.in_flight, u.last_used_at, u.reporting_since
    FROM replicas r
    JOIN deployments d ON d.deployment_id = r.deployment_id
    JOIN allocations a ON a.replica_id = r.replica_id
    LEFT JOIN LATERAL (
        SELECT count(*) AS reported, COALESCE(SUM(ru.in_flight), 0)::int AS in_flight,
               MAX(ru.last_used_at) AS last_used_at,
               MAX(ru.reporting_since) AS reporting_since
        FROM replica_usage ru
        WHERE ru.replica_id = r.replica_id
          AND (r.state = 'sleeping'
               OR ru.updated_at > now() - make_interval(secs => $3::float8))
    ) u ON true
    LEFT JOIN (
        SELECT deployment_id, count(*) AS awake FROM replicas
        WHERE state = ANY($4::text[]) GROUP BY deployment_id
    ) w ON w.deployment_id = r.deployment_id
    WHERE r.deployment_id <> $1 AND r.state = ANY($2::text[])
    ORDER BY r.replica_id, a.rank
"""


async def read_candidates(conn: asyncpg.Connection, *, for_deployment: DeploymentId,
                          stale_after_s: float) -> list[Candidate]:
    """Every ready or sleeping replica of a deployment other than ``for_deployment``, as
    the choice reads it (see the module docstring)."""
    rows = await conn.fetch(_CANDIDATES, for_deployment,
                            sorted(s.value for s in LISTED_STATES), stale_after_s,
                            sorted(s.value for s in AWAKE_STATES))
    by_replica: dict[str, list[asyncpg.Record]] = {}
    for row in rows:
        by_replica.setdefault(row["replica_id"], []).append(row)
    return [_candidate(claims) for claims in by_replica.values()]


def _policy(text: str | None) -> ScalingPolicy | None:
    """The stored policy; None for none, and for one this version cannot read (a policy
    it cannot read is not one it may break: such a deployment is kept, not evicted)."""
    if text is None:
        return None
    try:
        return ScalingPolicy.model_validate_json(text)
    except ValidationError:
        return None


def _candidate(rows: Sequence[asyncpg.Record]) -> Candidate:
    first = rows[0]
    use = None
    if first["reported"]:
        use = ReplicaUse(replica_id=ReplicaId(first["replica_id"]),
                         in_flight=first["in_flight"], last_used_at=first["last_used_at"],
                         reporting_since=first["reporting_since"])
    return Candidate(
        replica_id=ReplicaId(first["replica_id"]),
        deployment_id=DeploymentId(first["deployment_id"]),
        policy=_policy(first["scaling"]), state=ReplicaState(first["state"]),
        ready_at=first["ready_at"], use=use,
        capacity_class=_capacity_class(first["capacity_class"]), owner=first["owner"],
        deployment_replicas=first["awake"],
        claims=[VictimClaim(node_id=NodeId(r["node_id"]), memory_bytes=r["memory_bytes"],
                            cpu_cores=r["cpu_cores"], gpu_indices=list(r["gpu_indices"]),
                            awake_memory_bytes=r["awake_memory_bytes"])
                for r in rows])


def _capacity_class(text: str | None) -> CapacityClass | None:
    """The stored class (the column's CHECK keeps it one of the three)."""
    return CapacityClass(text) if text is not None else None


#: The deployment asking, as preemption reads it: its class, owner, policy, fixed count
#: (its minimum when it has no policy) and awake replicas (``$2`` the awake states).
_ASKER = """
    SELECT d.capacity_class, d.owner, d.scaling::text AS scaling, d.replicas,
           (SELECT count(*) FROM replicas r
            WHERE r.deployment_id = d.deployment_id AND r.state = ANY($2::text[]))::int
               AS awake
    FROM deployments d WHERE d.deployment_id = $1
"""


async def read_asker(conn: asyncpg.Connection, deployment_id: DeploymentId,
                     request: PlacementRequest) -> Asker | None:
    """The deployment asking for room for ``request`` (one replica), or None when it is
    gone. Its minimum is its policy's, or its fixed count with no policy (a promise to
    run that many); what the replica would hold is the request's, all shards together."""
    row = await conn.fetchrow(_ASKER, deployment_id, sorted(s.value for s in AWAKE_STATES))
    if row is None:
        return None
    policy = _policy(row["scaling"])
    shards = request.min_nodes
    return Asker(
        deployment_id=deployment_id,
        capacity_class=effective_class(_capacity_class(row["capacity_class"]), policy),
        owner=row["owner"], replicas=row["awake"],
        min_replicas=policy.min_replicas if policy is not None else row["replicas"],
        holds=Resources(memory_bytes=request.memory_bytes,
                        gpus=request.shard_gpus * shards,
                        cpu_cores=(request.cpu_cores or 0.0) * shards))


#: What every owner's replicas hold now (their claims), one row per owner; replicas of
#: deployments with no owner belong to no scope and are not read.
_HOLDINGS = """
    SELECT d.owner, SUM(a.memory_bytes)::bigint AS memory_bytes,
           SUM(cardinality(a.gpu_indices))::int AS gpus,
           SUM(a.cpu_cores)::float8 AS cpu_cores
    FROM allocations a
    JOIN replicas r ON r.replica_id = a.replica_id
    JOIN deployments d ON d.deployment_id = r.deployment_id
    WHERE d.owner IS NOT NULL
    GROUP BY d.owner ORDER BY d.owner
"""


async def read_holdings(conn: asyncpg.Connection) -> list[Holding]:
    """What each owner's replicas hold, summed per owner (what
    :func:`~modelkeeper.domain.capacity.held_by` sums per scope)."""
    return [Holding(owner=r["owner"],
                    resources=Resources(memory_bytes=r["memory_bytes"], gpus=r["gpus"],
                                        cpu_cores=r["cpu_cores"]))
            for r in await conn.fetch(_HOLDINGS)]
