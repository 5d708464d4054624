"""Room held for a deployment that preempted others to make it (``room_holds``, 0018).

A preemption stops replicas so that another deployment's replica fits. Between the
victims' release and that placement the room is free for anyone: the victims' own
deployments, which keep their counts and place again at once, would take it back, and the
preemption would start over (each round draining replicas for nothing). So the room is
held: every placement but the holder's counts a hold as claimed, and the holder's own
placement deletes its holds. A hold expires (``expires_at``, on the store's clock) so that
a holder that never places (deleted, or its placement failed another way) cannot keep the
room for ever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg

from ..domain.ids import DeploymentId, NodeId
from ..domain.placement import NodeView


@dataclass
class Held:
    """What the holds of other deployments take on one node."""

    memory_bytes: int = 0
    cpu_cores: float = 0.0
    gpu_indices: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class HoldClaim:
    """One victim claim to hold: what stopping it frees on its node."""

    node_id: NodeId
    memory_bytes: int
    cpu_cores: float = 0.0
    gpu_indices: tuple[int, ...] = ()


async def holds_against(conn: asyncpg.Connection | asyncpg.Pool,
                        deployment_id: DeploymentId | None) -> dict[NodeId, Held]:
    """The unexpired holds of every deployment but ``deployment_id`` (None: every
    deployment's), per node. The table holds a few rows at most (one per victim claim of
    a preemption in progress), so they are summed here rather than in SQL."""
    rows = await conn.fetch(
        "SELECT node_id, memory_bytes, cpu_cores, gpu_indices FROM room_holds "
        "WHERE expires_at > now() AND deployment_id IS DISTINCT FROM $1", deployment_id)
    held: dict[NodeId, Held] = {}
    for row in rows:
        node = held.setdefault(NodeId(row["node_id"]), Held())
        node.memory_bytes += row["memory_bytes"]
        node.cpu_cores += float(row["cpu_cores"])
        node.gpu_indices.update(row["gpu_indices"])
    return held


def with_holds(views: Sequence[NodeView], held: dict[NodeId, Held]) -> list[NodeView]:
    """The nodes with the holds counted as claims."""
    if not held:
        return list(views)
    out = []
    for view in views:
        hold = held.get(view.node_id)
        if hold is None:
            out.append(view)
            continue
        out.append(view.model_copy(update={
            "memory_claimed_bytes": view.memory_claimed_bytes + hold.memory_bytes,
            "cpu_claimed": view.cpu_claimed + hold.cpu_cores,
            "gpu_claimed": sorted(set(view.gpu_claimed) | hold.gpu_indices)}))
    return out


async def hold_room(pool: asyncpg.Pool, *, deployment_id: DeploymentId,
                    claims: Sequence[HoldClaim], reason: str, hold_s: float) -> None:
    """Hold the room ``claims`` free for ``deployment_id`` for ``hold_s`` seconds, in
    place of any holds it had (a new preemption replaces the last one's)."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("DELETE FROM room_holds WHERE deployment_id = $1", deployment_id)
        await conn.executemany(
            "INSERT INTO room_holds (deployment_id, node_id, memory_bytes, cpu_cores, "
            "gpu_indices, reason, expires_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))",
            [(deployment_id, c.node_id, c.memory_bytes, c.cpu_cores, list(c.gpu_indices),
              reason, hold_s) for c in claims])


async def release_holds(conn: asyncpg.Connection | asyncpg.Pool,
                        deployment_id: DeploymentId) -> None:
    """The holder placed (or gave up): its room is its claims' now, or free."""
    await conn.execute("DELETE FROM room_holds WHERE deployment_id = $1", deployment_id)
