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

from ..domain.demand import ReplicaUse, ScalingPolicy
from ..domain.eviction import EVICTABLE_STATES, Candidate, VictimClaim
from ..domain.ids import DeploymentId, NodeId, ReplicaId
from ..domain.status import ReplicaState

#: What the query lists: the states eviction may choose from, and starting (refused, but
#: a reason to seek again soon).
LISTED_STATES = EVICTABLE_STATES | {ReplicaState.STARTING}

#: The candidates: one row per claim, each with its replica, its deployment's policy and
#: the replica's usage summed over the rows that count (``reported`` 0: none counts).
#: ``$1`` the deployment asking, ``$2`` the states, ``$3`` the seconds after which a ready
#: replica's row is stale; "now" is the transaction's, the store clock that stamped the
#: rows.
_CANDIDATES = """
    SELECT r.replica_id, r.deployment_id, r.state, r.ready_at,
           d.scaling::text AS scaling,
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
    WHERE r.deployment_id <> $1 AND r.state = ANY($2::text[])
    ORDER BY r.replica_id, a.rank
"""


async def read_candidates(conn: asyncpg.Connection, *, for_deployment: DeploymentId,
                          stale_after_s: float) -> list[Candidate]:
    """Every ready or sleeping replica of a deployment other than ``for_deployment``, as
    the choice reads it (see the module docstring)."""
    rows = await conn.fetch(_CANDIDATES, for_deployment,
                            sorted(s.value for s in LISTED_STATES), stale_after_s)
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
        claims=[VictimClaim(node_id=NodeId(r["node_id"]), memory_bytes=r["memory_bytes"],
                            cpu_cores=r["cpu_cores"], gpu_indices=list(r["gpu_indices"]),
                            awake_memory_bytes=r["awake_memory_bytes"])
                for r in rows])
