"""What the room surfaces read (``GET /fleet``, headroom, fit plans;
:mod:`modelkeeper.domain.fleet` and :mod:`modelkeeper.domain.fit_plans` decide on it):
the nodes as placement sees them, every listed replica with its claims and usage as
eviction reads them, and the deployments a plan may act on, in one snapshot.

Read by :meth:`.placement.PlacementStore.read_room`, which owns the nodes' query and its
cache of views; the candidates are :func:`.eviction.read_candidates` asked for no
deployment in particular, so that the nodes' summed claims hold exactly the claims a
copy removes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from ..domain.eviction import Candidate, VictimClaim
from ..domain.fit_plans import Held, Holder
from ..domain.ids import DeploymentId, NodeId, ReplicaId
from ..domain.placement import NodeView
from ..domain.shards import EngineKind, can_sleep
from ..domain.status import ReplicaState
from .locks import FIT_PLAN_LOCK

#: Each deployment with its count, whether it has a scaling policy (one this version
#: cannot read is a policy still), and its model's engine and ``weights_bytes`` (what a
#: sleeping replica keeps). The model is the one it runs (a switch's).
_HOLDERS = """
    SELECT d.deployment_id, d.replicas, d.scaling IS NULL AS fixed_count, m.engine,
           m.weights_bytes
    FROM deployments d
    JOIN models m ON m.model_id = COALESCE(d.runs_model_id, d.model_id)
    ORDER BY d.deployment_id
"""

#: Every claim with its replica's state, whatever the state.
_HELD = """
    SELECT r.replica_id, r.state, a.node_id, a.memory_bytes,
           a.cpu_cores::float8 AS cpu_cores, a.gpu_indices
    FROM replicas r JOIN allocations a ON a.replica_id = r.replica_id
    ORDER BY r.replica_id, a.rank
"""


@dataclass(frozen=True)
class RoomSnapshot:
    """One consistent read of what room there is and who holds it."""

    #: The store's clock when it was read (idle times are measured on it).
    at: datetime
    nodes: list[NodeView]
    candidates: list[Candidate]
    holders: list[Holder]
    #: Every replica holding claims, in any state.
    held: list[Held]


async def read_holders(conn: asyncpg.Connection) -> list[Holder]:
    """Every deployment as a fit plan reads it."""
    holders = []
    for row in await conn.fetch(_HOLDERS):
        keeps = row["weights_bytes"] if can_sleep(EngineKind(row["engine"])) else None
        holders.append(Holder(deployment_id=DeploymentId(row["deployment_id"]),
                              desired_replicas=row["replicas"],
                              fixed_count=row["fixed_count"], sleep_keeps_bytes=keeps))
    return holders


async def read_held(conn: asyncpg.Connection) -> list[Held]:
    """Every replica holding claims, with its state."""
    by_replica: dict[str, list[asyncpg.Record]] = {}
    for row in await conn.fetch(_HELD):
        by_replica.setdefault(row["replica_id"], []).append(row)
    return [Held(replica_id=ReplicaId(rows[0]["replica_id"]),
                 state=ReplicaState(rows[0]["state"]),
                 claims=[VictimClaim(node_id=NodeId(r["node_id"]),
                                     memory_bytes=r["memory_bytes"], cpu_cores=r["cpu_cores"],
                                     gpu_indices=list(r["gpu_indices"])) for r in rows])
            for rows in by_replica.values()]


class RoomStore:
    """The fit-plan lock on the pool :class:`~.stores.Store` owns (the room's reads are
    :meth:`.placement.PlacementStore.read_room`, beside the nodes' query they share)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @asynccontextmanager
    async def plan_lock(self) -> AsyncIterator[None]:
        """Hold :data:`~.locks.FIT_PLAN_LOCK` for the block: a transaction-scoped advisory
        lock on a connection of its own, so a process that dies lets go of it with its
        connection. Placements never take it: it orders plans among themselves, and a
        plan re-checks its room after its actions (``api/room.py``)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", *FIT_PLAN_LOCK)
            yield
