"""Nodes and their liveness: registration, credentials, heartbeats, silences, operator
settings, removal, and the node records the API shows.

No statement here takes a placement lock (a registration takes only its name's, from
:mod:`.locks`), so a heartbeat or an operator's update never waits for a placement. The
lock protocol is documented once, at :meth:`.placement.PlacementStore.place_replica`.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from ..domain.ids import DeploymentId, NodeId, ReplicaId
from ..domain.nodes import (
    AgentRegistration,
    HeartbeatRecorded,
    Inventory,
    NameTaken,
    NodeAuth,
    NodeRecord,
    NodeRegistered,
    NodeRemoval,
    NodeUpdate,
)
from ..domain.watchdog import MemoryLevel
from .locks import NODE_NAME_LOCK_SPACE, lock_key
from .pool import port_range, record


class NodeStore:
    """The ``nodes`` table, on the pool :class:`~.stores.Store` owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def register_node(self, reg: AgentRegistration, *, address: str | None = None,
                            credential_sha256: str | None = None,
                            key_epoch: str | None = None) -> NodeRegistered | NameTaken:
        """Insert or refresh a node from its agent's registration, unless another node has
        its name, or its name as id, or its id as name (:class:`NameTaken`, nothing
        written): an operator names a node by id or name, and each must name one node.
        Names registered twice before that rule stay until one of the nodes is removed;
        neither may register under it meanwhile.

        Operator labels and the cordon are left untouched: they outrank the agent's view
        and survive re-registration. A liveness silence is left too: the agent's liveness
        stream, which it opens right after, or its next heartbeat clears it.

        ``address``: where the registration came from (the API decides it, see
        :func:`~modelkeeper.domain.nodes.node_address`); None leaves the stored one.
        ``credential_sha256``: a credential just issued; None leaves the stored one.
        ``key_epoch``: the epoch of a node that joins now, written only when this inserts
        the node: a re-registration keeps the one it joined with, since its running
        engines hold keys derived from it (migration 0015). The declared engine ports are
        always replaced by the registration's. The caller has authenticated the agent:
        nothing here checks it.
        """
        inv = reg.inventory
        ports = reg.engine_ports
        async with self._pool.acquire() as conn, conn.transaction():
            # Ids and names are one space (an operator names a node by either), so both
            # are locked, in one order so that two registrations queue, never deadlock.
            for key in sorted({lock_key(reg.name), lock_key(reg.node_id)}):
                await conn.execute("SELECT pg_advisory_xact_lock($1, $2)",
                                   NODE_NAME_LOCK_SPACE, key)
            taken = await conn.fetchrow(
                """
                SELECT node_id, CASE WHEN name = $1 THEN 'node_id' ELSE 'name' END AS field
                FROM nodes
                WHERE node_id <> $1 AND (name = $2 OR node_id = $2 OR name = $1)
                ORDER BY node_id LIMIT 1
                """, reg.node_id, reg.name)
            if taken is not None:
                field = taken["field"]
                return NameTaken(field=field,
                                 value=reg.node_id if field == "node_id" else reg.name,
                                 holder=NodeId(taken["node_id"]))
            epoch: str | None = await conn.fetchval(
                """
                INSERT INTO nodes (node_id, name, agent_labels, memory_total_bytes,
                                   memory_available_bytes, cpu_count, gpus, address,
                                   engine_port_low, engine_port_high, credential_sha256,
                                   key_epoch, engines)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
                ON CONFLICT (node_id) DO UPDATE SET
                    name = EXCLUDED.name,
                    agent_labels = EXCLUDED.agent_labels,
                    memory_total_bytes = EXCLUDED.memory_total_bytes,
                    memory_available_bytes = EXCLUDED.memory_available_bytes,
                    cpu_count = EXCLUDED.cpu_count,
                    gpus = EXCLUDED.gpus,
                    address = COALESCE(EXCLUDED.address, nodes.address),
                    engine_port_low = EXCLUDED.engine_port_low,
                    engine_port_high = EXCLUDED.engine_port_high,
                    engines = EXCLUDED.engines,
                    credential_sha256 = COALESCE(EXCLUDED.credential_sha256,
                                                 nodes.credential_sha256),
                    credential_confirmed_at = CASE WHEN EXCLUDED.credential_sha256 IS NULL
                                                   THEN nodes.credential_confirmed_at END,
                    registered_at = now(),
                    last_seen = now()
                RETURNING key_epoch
                """,
                reg.node_id, reg.name, reg.labels, inv.memory_total_bytes,
                inv.memory_available_bytes, inv.cpu_count,
                [g.model_dump() for g in inv.gpus], address,
                None if ports is None else ports.low, None if ports is None else ports.high,
                credential_sha256, key_epoch,
                None if reg.engines is None else {k.value: v for k, v in reg.engines.items()},
            )
        return NodeRegistered(key_epoch=epoch)

    async def node_auth(self, node_id: str) -> NodeAuth | None:
        """What authenticates ``node_id`` and bounds what it reports; None when unknown."""
        row = await self._pool.fetchrow(
            "SELECT node_id, name, credential_sha256, "
            "       credential_confirmed_at IS NOT NULL AS credential_confirmed, address, "
            "       engine_port_low, engine_port_high "
            "FROM nodes WHERE node_id = $1", node_id)
        if row is None:
            return None
        return NodeAuth(node_id=row["node_id"], name=row["name"],
                        credential_sha256=row["credential_sha256"],
                        credential_confirmed=row["credential_confirmed"],
                        address=row["address"],
                        engine_ports=port_range(row["engine_port_low"],
                                                 row["engine_port_high"]))

    async def delete_node(self, node_id: str, *, force: bool = False) -> NodeRemoval | None:
        """Remove a node (an operator's ``DELETE /nodes/{id}``); None when unknown.

        Refused (``removed`` False) while replicas hold claims on it, unless ``force``:
        then their claims on it go with it, and the caller tells their deployments. The
        row lock keeps a placement from claiming on the node meanwhile (its claim's
        foreign key waits for it, then fails, and the placement is retried elsewhere).
        """
        async with self._pool.acquire() as conn, conn.transaction():
            name = await conn.fetchval(
                "SELECT name FROM nodes WHERE node_id = $1 FOR UPDATE", node_id)
            if name is None:
                return None
            rows = await conn.fetch(
                """
                SELECT r.deployment_id, array_agg(a.replica_id ORDER BY a.replica_id) AS ids
                FROM allocations a JOIN replicas r USING (replica_id)
                WHERE a.node_id = $1
                GROUP BY r.deployment_id ORDER BY r.deployment_id
                """, node_id)
            replicas = {DeploymentId(row["deployment_id"]):
                        [ReplicaId(r) for r in row["ids"]] for row in rows}
            if replicas and not force:
                return NodeRemoval(node_id=NodeId(node_id), name=name, removed=False,
                                   replicas=replicas)
            await conn.execute("DELETE FROM allocations WHERE node_id = $1", node_id)
            await conn.execute("DELETE FROM nodes WHERE node_id = $1", node_id)
        return NodeRemoval(node_id=NodeId(node_id), name=name, removed=True,
                           replicas=replicas)

    async def heartbeat_node(self, node_id: str, inv: Inventory,
                             unreachable_after_s: float, *,
                             received_at: datetime | None = None) -> bool | None:
        """:meth:`authenticated_heartbeat` for a caller that has authenticated the node
        itself (tests, tools): the same statement, without the credential check and
        without confirming a credential. None: the node is unknown. Otherwise whether
        something placement uses changed."""
        recorded = await self._heartbeat(node_id, None, inv, unreachable_after_s,
                                         received_at=received_at)
        return None if recorded is None else recorded.changed

    async def authenticated_heartbeat(self, node_id: str, credential_sha256: str,
                                      inv: Inventory, unreachable_after_s: float, *,
                                      received_at: datetime | None = None,
                                      ) -> HeartbeatRecorded | None:
        """A heartbeat of ``node_id`` whose presented credential has the digest
        ``credential_sha256`` (:func:`credential_digest` of it), authenticated, written,
        confirmed and answered in one statement. Every node sends one every couple of
        seconds; the four round trips it took before (the credential, the write, its
        confirmation, the claims, each with the pool's reset) were most of what a
        heartbeat cost the API.

        None, and nothing written: the node is unknown, has no credential, or has
        another. The caller tells which with :meth:`node_auth` (a refusal is rare).

        Otherwise: the inventory and ``last_seen`` are written; a silence
        (:meth:`mark_node_silent`) is cleared only if it began no later than
        ``received_at`` (default: now), since a heartbeat sent just before a kill -9, and
        written just after the liveness channel saw the kill, must not clear it; the
        credential is confirmed (the first time). ``changed`` says whether something
        placement uses changed (capacity, or the node is back after going quiet or
        silent), so waiting deployments should retry now; the claimed replicas are read
        after the heartbeat arrived.
        """
        return await self._heartbeat(node_id, credential_sha256, inv, unreachable_after_s,
                                     received_at=received_at)

    async def _heartbeat(self, node_id: str, credential_sha256: str | None, inv: Inventory,
                         unreachable_after_s: float, *,
                         received_at: datetime | None) -> HeartbeatRecorded | None:
        """The heartbeat statement; ``credential_sha256`` None: no credential checked."""
        row = await self._pool.fetchrow(
            """
            WITH prev AS (
                -- The credential is compared here, in the row lock's own WHERE: a row
                -- whose digest is not the presented one is never locked, so never written.
                -- Under READ COMMITTED a row another transaction changed meanwhile (a
                -- re-registration issuing a new credential) is checked again in its newest
                -- version before it is locked, so the digest compared is the one the row
                -- holds when it is written; the UPDATE repeats the test all the same.
                -- Compared in SQL rather than with credential_matches (constant time):
                -- what the comparison's time could tell is how much of the stored digest
                -- a guess's digest shares, which leads no closer to the credential (256
                -- random bits; one with a given digest is a preimage of SHA-256).
                -- NO KEY UPDATE, the lock the UPDATE itself takes: it keeps two heartbeats
                -- of one node from reading the same prev, and unlike FOR UPDATE it does not
                -- conflict with the KEY SHARE lock an allocation's foreign key holds on the
                -- row, so a heartbeat never waits for a placement claiming on its node.
                SELECT memory_total_bytes, cpu_count, gpus, last_seen, silent_since FROM nodes
                WHERE node_id = $1 AND ($8::text IS NULL OR credential_sha256 = $8)
                FOR NO KEY UPDATE
            ), beat AS (
                UPDATE nodes SET memory_total_bytes = $2, memory_available_bytes = $3,
                                 cpu_count = $4, gpus = $5, last_seen = now(),
                                 silent_since = CASE
                                     WHEN prev.silent_since <= COALESCE($7::timestamptz, now())
                                     THEN NULL ELSE prev.silent_since END,
                                 credential_confirmed_at = CASE
                                     WHEN $8::text IS NULL THEN nodes.credential_confirmed_at
                                     ELSE COALESCE(nodes.credential_confirmed_at, now()) END
                FROM prev
                WHERE nodes.node_id = $1 AND ($8::text IS NULL OR nodes.credential_sha256 = $8)
                RETURNING prev.memory_total_bytes IS DISTINCT FROM $2
                       OR prev.cpu_count IS DISTINCT FROM $4
                       OR prev.gpus IS DISTINCT FROM $5::jsonb
                       OR prev.last_seen < now() - make_interval(secs => $6)
                       OR (prev.silent_since IS NOT NULL AND nodes.silent_since IS NULL)
                       AS changed,
                       nodes.memory_level
            )
            -- The claims as of this statement's snapshot, which is taken after the
            -- heartbeat arrived: what the answer needs (HeartbeatAnswer: an engine that ran
            -- before the beat was sent and is not claimed now is released). The write
            -- above touches only the node's row, nothing a claim depends on, so reading
            -- them in the same statement answers what a read just after it would. An
            -- allocation's replica always exists (foreign key, ON DELETE CASCADE): no
            -- join needed.
            SELECT beat.changed, beat.memory_level,
                   ARRAY(SELECT replica_id FROM allocations WHERE node_id = $1) AS claimed
            FROM beat
            """,
            node_id, inv.memory_total_bytes, inv.memory_available_bytes, inv.cpu_count,
            [g.model_dump() for g in inv.gpus], unreachable_after_s, received_at,
            credential_sha256,
        )
        if row is None:
            return None
        return HeartbeatRecorded(changed=bool(row["changed"]),
                                 claimed_replica_ids=[ReplicaId(r) for r in row["claimed"]],
                                 memory_level=MemoryLevel(row["memory_level"]))

    async def mark_node_silent(self, node_id: str, *, since: datetime) -> bool:
        """Record that the liveness channel found the node silent: placement treats it as
        unreachable from now on. An earlier, uncleared silence keeps its time. False when
        the node is unknown. One UPDATE, which (like a heartbeat's) never waits for a
        placement claiming on the node."""
        row = await self._pool.fetchval(
            "UPDATE nodes SET silent_since = COALESCE(silent_since, $2) "
            "WHERE node_id = $1 RETURNING node_id", node_id, since)
        return row is not None

    async def mark_node_alive(self, node_id: str, *, at: datetime) -> bool | None:
        """The node showed life at ``at`` (a liveness stream opened, or a ping ended a
        silence): clear a silence that began no later. None: the node is unknown. True: a
        silence was cleared, so placement may use the node again. Writes nothing when the
        node was not silent."""
        row = await self._pool.fetchrow(
            """
            WITH cleared AS (
                UPDATE nodes SET silent_since = NULL
                WHERE node_id = $1 AND silent_since <= $2
                RETURNING node_id
            )
            SELECT EXISTS (SELECT 1 FROM cleared) AS cleared FROM nodes WHERE node_id = $1
            """,
            node_id, at)
        return None if row is None else bool(row["cleared"])

    async def replicas_on_node(self, node_id: str) -> dict[DeploymentId, list[ReplicaId]]:
        """The replicas holding a claim on ``node_id``, in any state, by deployment."""
        rows = await self._pool.fetch(
            """
            SELECT r.deployment_id, array_agg(a.replica_id ORDER BY a.replica_id) AS replicas
            FROM allocations a JOIN replicas r USING (replica_id)
            WHERE a.node_id = $1
            GROUP BY r.deployment_id ORDER BY r.deployment_id
            """,
            node_id)
        return {DeploymentId(row["deployment_id"]): [ReplicaId(r) for r in row["replicas"]]
                for row in rows}

    async def update_node(self, node_id: str, update: NodeUpdate) -> NodeRecord | None:
        """Apply operator settings; None when the node is unknown."""
        row = await self._pool.fetchval(
            """
            UPDATE nodes SET
                operator_labels = COALESCE($2, operator_labels),
                cordoned = COALESCE($3, cordoned),
                cordon_reason = CASE WHEN $3 IS FALSE THEN NULL
                                     ELSE COALESCE($4, cordon_reason) END,
                hold_class = CASE WHEN $7 THEN NULL ELSE COALESCE($5, hold_class) END,
                hold_owner = CASE WHEN $7 THEN NULL ELSE COALESCE($6, hold_owner) END
            WHERE node_id = $1 RETURNING node_id
            """,
            node_id, update.labels, update.cordoned, update.cordon_reason,
            None if update.hold_class is None else update.hold_class.value,
            update.hold_owner, update.release_hold is True,
        )
        return None if row is None else await self.get_node(node_id)

    async def set_power_cap(self, pdu: str, watts: int | None) -> None:
        """Set a PDU's power cap (the facility's under ``FACILITY_CAP_KEY``), or remove it
        with None."""
        if watts is None:
            await self._pool.execute("DELETE FROM power_caps WHERE pdu = $1", pdu)
            return
        await self._pool.execute(
            "INSERT INTO power_caps (pdu, watts) VALUES ($1, $2) ON CONFLICT (pdu) "
            "DO UPDATE SET watts = EXCLUDED.watts, updated_at = now()", pdu, watts)

    async def power_caps(self) -> dict[str, int]:
        """Every power cap in force, by PDU name (the facility's under its key)."""
        rows = await self._pool.fetch("SELECT pdu, watts FROM power_caps ORDER BY pdu")
        return {row["pdu"]: row["watts"] for row in rows}

    async def get_node(self, node_id: str) -> NodeRecord | None:
        """One node with its claims; None when unknown."""
        row = await self._pool.fetchrow(
            _NODE_SELECT + " WHERE n.node_id = $1", node_id)
        return None if row is None else NodeRecord(**record(row))

    async def list_nodes(self) -> list[NodeRecord]:
        """Every node with what its replicas claim on it, by name."""
        rows = await self._pool.fetch(_ALL_NODES_SELECT + " ORDER BY n.name, n.node_id")
        return [NodeRecord(**record(row)) for row in rows]

#: Each node's claims summed by two subqueries per node: cheap for a few nodes, and what
#: every read of whole :class:`NodeRecord` rows uses. A sleeping claim's ``memory_bytes``
#: is what it keeps asleep (its awake amount waits in ``awake_memory_bytes``), so the sum,
#: and the free memory ``GET /nodes`` shows from it, count only that.
CLAIMS_PER_NODE = """
    LEFT JOIN LATERAL (
        SELECT SUM(a.memory_bytes)::bigint AS memory_claimed_bytes,
               SUM(a.cpu_cores)::float8 AS cpu_claimed, SUM(a.watts)::bigint AS watts_claimed
        FROM allocations a WHERE a.node_id = n.node_id
    ) c ON true
    LEFT JOIN LATERAL (
        SELECT array_agg(i ORDER BY i) AS gpus_claimed
        FROM allocations a, unnest(a.gpu_indices) AS i WHERE a.node_id = n.node_id
    ) g ON true
"""

#: The claim columns both node reads end their column list with.
CLAIM_COLUMNS = """
           COALESCE(c.memory_claimed_bytes, 0) AS memory_claimed_bytes,
           COALESCE(c.cpu_claimed, 0) AS cpu_claimed,
           COALESCE(g.gpus_claimed, '{}') AS gpus_claimed
"""

_NODE_COLUMNS = """
    SELECT n.node_id, n.name, n.agent_labels, n.operator_labels, n.cordoned, n.cordon_reason,
           n.memory_total_bytes, n.memory_available_bytes, n.cpu_count, n.gpus, n.last_seen,
           n.registered_at, n.silent_since, n.memory_level, n.memory_level_since,
           n.memory_level_reason, n.memory_level_changes, n.hold_class, n.hold_owner,
           n.engines,""" + CLAIM_COLUMNS + """
    FROM nodes n"""

#: One node (or a few): its claims summed per node.
_NODE_SELECT = _NODE_COLUMNS + CLAIMS_PER_NODE

#: Every node: the same sums in one pass over the claims grouped by node, as placement
#: reads its nodes (store/placement.py). Per node, 300 nodes' read took 39 ms of the
#: server's time, grouped 2 ms (bench/results/console.md), on every GET /nodes, GET
#: /fleet and console page that lists the nodes.
_ALL_NODES_SELECT = _NODE_COLUMNS + """
    LEFT JOIN (
        SELECT a.node_id, SUM(a.memory_bytes)::bigint AS memory_claimed_bytes,
               SUM(a.cpu_cores)::float8 AS cpu_claimed, SUM(a.watts)::bigint AS watts_claimed
        FROM allocations a GROUP BY a.node_id
    ) c ON c.node_id = n.node_id
    LEFT JOIN (
        SELECT a.node_id, array_agg(i ORDER BY i) AS gpus_claimed
        FROM allocations a, unnest(a.gpu_indices) AS i GROUP BY a.node_id
    ) g ON g.node_id = n.node_id
"""
