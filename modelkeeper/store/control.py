"""The control plane's SQL: catalog, nodes, deployments, replicas, placement, events.

Nothing outside the store writes a query; the API and the store activities call methods
here, so a schema change touches the store and its migration only. The migration runner
is :mod:`.schema`; the gateway's reads are :mod:`.routing`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Self

import asyncpg
import pydantic_core

from ..domain.catalog import (
    CatalogModel,
    DeploymentRequest,
    DeploymentStatusUpdate,
    DeploymentView,
    ReplicaStateUpdate,
    ReplicaView,
)
from ..domain.draining import UsageReport
from ..domain.events import Event, NewEvent
from ..domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from ..domain.nodes import (
    AgentRegistration,
    EndpointRefused,
    GpuInfo,
    HeartbeatRecorded,
    Inventory,
    NameTaken,
    NodeAuth,
    NodeRecord,
    NodeRegistered,
    NodeRemoval,
    NodeState,
    NodeUpdate,
    PortRange,
    effective_labels,
    endpoint_refusal,
    state_at,
)
from ..domain.ops import Generation
from ..domain.placement import (
    CantPlace,
    NodeView,
    Placement,
    PlacementRequest,
    ShardAssignment,
    explain,
    place,
)
from ..domain.shards import ShardSpec
from ..domain.status import WAITING_FOR_ROOM, DeploymentStatus, ReplicaState
from .schema import Migration, apply_migrations


class ModelExistsError(Exception):
    """A model with this id is already in the catalog."""


class ModelInUseError(Exception):
    """The model has a deployment; delete that first."""


class DeploymentExistsError(Exception):
    """The model already has a deployment (one per model)."""


class UnknownModelError(Exception):
    """No model with this id in the catalog."""



#: Advisory-lock namespaces for placement (the first key of the two-int form; the second is
#: :func:`_lock_key` of an id). Four ASCII bytes read as a big-endian int32, so they stay
#: apart from each other and from the migration lock, which uses the one-bigint form.
_NODE_LOCK_SPACE = int.from_bytes(b"mkNd", "big", signed=True)
_REPLICA_LOCK_SPACE = int.from_bytes(b"mkRp", "big", signed=True)
#: ... and for registration: a name's (or id's) holder is checked and written under its
#: lock, so two nodes registering one name at once cannot both find it free.
_NODE_NAME_LOCK_SPACE = int.from_bytes(b"mkNn", "big", signed=True)
#: The placement lock: every optimistic attempt holds it shared, the serialized last
#: attempt exclusively, which is what makes that attempt's snapshot exact.
_PLACEMENT_LOCK = (int.from_bytes(b"mkPl", "big", signed=True), 0)

#: One DEBUG line per placement, with its time split into waiting for a connection, waiting
#: for locks and the rest (bench/scale reads them). Its own logger, so that it can be
#: turned on without every other DEBUG line of the worker.
PLACEMENT_TIMING_LOGGER = "modelkeeper.store.placement"
_timing_log = logging.getLogger(PLACEMENT_TIMING_LOGGER)

#: Optimistic attempts before the serialized one. An attempt only fails when a racing
#: placement took the room on a node it chose, so some placement always makes progress; but
#: racers rank nodes alike, so the losers on one node tend to meet again on the next (20
#: calls racing for 5 equal nodes: 39 lost attempts, 10 calls serialized). Each attempt
#: reads every node; three bounds that waste before a call waits its turn instead.
#: Heartbeats wait for neither.
_OPTIMISTIC_ATTEMPTS = 3


def _decode_jsonb(text: str) -> Any:
    """A jsonb value as the Python value ``json.loads`` gives, three times faster.

    pydantic_core's parser: placement decodes three jsonb columns of every node, and with
    ``json.loads`` that was a fifth of its time at 1,000 nodes. The two agree on what
    PostgreSQL prints (big integers, float rounding, escapes: tests/integration/
    test_placement_views.py), except that this one refuses nesting deeper than 200
    levels, which only a model's free-form ``engine_args`` could reach: those go to
    ``json.loads``, so such a model stays readable.
    """
    try:
        return pydantic_core.from_json(text)
    except ValueError:
        return json.loads(text)


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb columns come back as Python objects, not strings.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=_decode_jsonb,
                              schema="pg_catalog")


class Store:
    """A pool of connections to modelkeeper's database and the queries over it."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        #: This process's placements take turns (see place_replica).
        self._placing = asyncio.Lock()
        #: The nodes' views as placement last read them (see _NodeViews).
        self._views = _NodeViews()

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 10,
                      migrate: bool = True) -> Self:
        """Open a pool to ``dsn`` and, unless told not to, bring the schema up to date."""
        pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size,
                                         init=_init_connection)
        store = cls(pool)
        if migrate:
            try:
                await store.migrate()
            except BaseException:
                await pool.close()
                raise
        return store

    async def close(self) -> None:
        """Close every connection."""
        await self._pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- schema ---------------------------------------------------------------------------

    async def migrate(self, migrations: list[Migration] | None = None) -> list[int]:
        """Apply the migrations not yet applied; return the versions this call applied.

        Safe to run from several processes at once (see :func:`.schema.apply_migrations`).
        """
        return await apply_migrations(self._pool, migrations)

    async def schema_versions(self) -> list[int]:
        """The migration versions recorded as applied."""
        rows = await self._pool.fetch("SELECT version FROM schema_version ORDER BY version")
        return [row["version"] for row in rows]

    async def ping(self) -> bool:
        """True when the database answers a trivial query."""
        return bool(await self._pool.fetchval("SELECT true"))

    # -- events ---------------------------------------------------------------------------

    async def record_event(self, event: NewEvent, *,
                           idempotency_key: str | None = None) -> Event:
        """Append one entry to the audit log; with ``idempotency_key``, at most once.

        A second call with the same key (a retried activity whose first attempt committed)
        appends nothing and returns the entry the first call appended, as it was stored.
        Two calls racing with one key both return that one entry: the loser's INSERT waits
        on the unique index for the winner to commit, then reads what it committed.
        """
        row = await self._pool.fetchrow(
            """
            INSERT INTO events (kind, message, deployment_id, node_id, replica_id, data,
                                idempotency_key, actor)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
            ON CONFLICT (idempotency_key) DO NOTHING
            RETURNING event_id, at
            """,
            event.kind, event.message, event.deployment_id, event.node_id, event.replica_id,
            event.data, idempotency_key, event.actor,
        )
        if row is not None:
            return Event(**event.model_dump(), event_id=row["event_id"], at=row["at"])
        # A separate statement, so its snapshot includes the entry the INSERT waited for.
        stored = await self._pool.fetchrow(
            "SELECT event_id, at, kind, message, deployment_id, node_id, replica_id, data, "
            "actor FROM events WHERE idempotency_key = $1", idempotency_key)
        assert stored is not None  # events are append-only: a conflicting entry stays
        return Event(**_record(stored))

    async def list_events(self, *, deployment_id: str | None = None,
                          limit: int = 100) -> list[Event]:
        """The newest ``limit`` audit entries, oldest first, optionally for one deployment."""
        rows = await self._pool.fetch(
            """
            SELECT * FROM (
                SELECT event_id, at, kind, message, deployment_id, node_id, replica_id, data,
                       actor
                FROM events
                WHERE $1::text IS NULL OR deployment_id = $1
                ORDER BY event_id DESC
                LIMIT $2
            ) newest ORDER BY event_id
            """,
            deployment_id, limit,
        )
        return [Event(**_record(row)) for row in rows]

    # -- nodes ----------------------------------------------------------------------------

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
            for key in sorted({_lock_key(reg.name), _lock_key(reg.node_id)}):
                await conn.execute("SELECT pg_advisory_xact_lock($1, $2)",
                                   _NODE_NAME_LOCK_SPACE, key)
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
                                   key_epoch)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
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
                        engine_ports=_port_range(row["engine_port_low"],
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
                       AS changed
            )
            -- The claims as of this statement's snapshot, which is taken after the
            -- heartbeat arrived: what the answer needs (HeartbeatAnswer: an engine that ran
            -- before the beat was sent and is not claimed now is released). The write
            -- above touches only the node's row, nothing a claim depends on, so reading
            -- them in the same statement answers what a read just after it would. An
            -- allocation's replica always exists (foreign key, ON DELETE CASCADE): no
            -- join needed.
            SELECT beat.changed,
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
                                 claimed_replica_ids=[ReplicaId(r) for r in row["claimed"]])

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
                                     ELSE COALESCE($4, cordon_reason) END
            WHERE node_id = $1 RETURNING node_id
            """,
            node_id, update.labels, update.cordoned, update.cordon_reason,
        )
        return None if row is None else await self.get_node(node_id)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        """One node with its claims; None when unknown."""
        row = await self._pool.fetchrow(
            _NODE_SELECT + " WHERE n.node_id = $1", node_id)
        return None if row is None else NodeRecord(**_record(row))

    async def list_node_views(self, now: datetime, *, unreachable_after_s: float,
                              lost_after_s: float) -> list[NodeView]:
        """Every node as placement sees it at ``now``, by name (what ``explain`` and the
        settling count read: the same read and conversion as placement's own)."""
        rows = await self._pool.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.name, n.node_id")
        return self._views.of(rows, now, unreachable_after_s=unreachable_after_s,
                              lost_after_s=lost_after_s, every_node=True)

    async def list_nodes(self) -> list[NodeRecord]:
        """Every node with what its replicas claim on it, by name."""
        rows = await self._pool.fetch(_NODE_SELECT + " ORDER BY n.name, n.node_id")
        return [NodeRecord(**_record(row)) for row in rows]

    # -- catalog --------------------------------------------------------------------------

    async def create_model(self, model: CatalogModel) -> CatalogModel:
        """Add a model; :class:`ModelExistsError` if the id is taken."""
        try:
            row = await self._pool.fetchrow(
                """
                INSERT INTO models (model_id, engine, source, memory_bytes, memory_estimated,
                                    cpu_cores, gpus, engine_args, min_nodes, sha256, secret,
                                    default_max_tokens, max_tokens_limit)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
                RETURNING created_at
                """,
                model.model_id, model.engine.value, model.source, model.memory_bytes,
                model.memory_estimated, model.cpu_cores, model.gpus, model.engine_args,
                model.min_nodes, model.sha256, model.secret, model.default_max_tokens,
                model.max_tokens_limit)
        except asyncpg.UniqueViolationError:
            raise ModelExistsError(model.model_id) from None
        assert row is not None
        return model.model_copy(update={"created_at": row["created_at"]})

    async def get_model(self, model_id: str) -> CatalogModel | None:
        """One catalog entry; None when unknown."""
        row = await self._pool.fetchrow("SELECT * FROM models WHERE model_id = $1", model_id)
        return None if row is None else _model(row)

    async def list_models(self) -> list[CatalogModel]:
        """The catalog, by id."""
        rows = await self._pool.fetch("SELECT * FROM models ORDER BY model_id")
        return [_model(row) for row in rows]

    async def delete_model(self, model_id: str) -> bool:
        """Remove a model; :class:`ModelInUseError` while it has a deployment."""
        try:
            done = await self._pool.execute("DELETE FROM models WHERE model_id = $1", model_id)
        except asyncpg.ForeignKeyViolationError:
            raise ModelInUseError(model_id) from None
        return bool(done.endswith(" 1"))

    # -- deployments ----------------------------------------------------------------------

    async def create_deployment(self, deployment_id: DeploymentId, request: DeploymentRequest,
                                workflow_id: str) -> None:
        """Insert a deployment. The unique model_id index makes racing creates end with one:
        the loser gets :class:`DeploymentExistsError`."""
        try:
            await self._pool.execute(
                """
                INSERT INTO deployments (deployment_id, model_id, replicas, min_nodes, node_ids,
                                         labels, status, workflow_id)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                """,
                deployment_id, request.model_id, request.replicas, request.min_nodes,
                request.node_ids, request.labels, DeploymentStatus.PLACING.value, workflow_id)
        except asyncpg.UniqueViolationError:
            raise DeploymentExistsError(request.model_id) from None
        except asyncpg.ForeignKeyViolationError:
            raise UnknownModelError(request.model_id) from None

    async def delete_deployment_row(self, deployment_id: str) -> None:
        """Remove a deployment and (by cascade) its replicas and their claims."""
        await self._pool.execute("DELETE FROM deployments WHERE deployment_id = $1",
                                 deployment_id)

    async def now(self) -> datetime:
        """The database's clock, which stamps every ``created_at``: an age measured against
        it does not depend on the caller's clock agreeing with the database's."""
        now: datetime = await self._pool.fetchval("SELECT now()")
        return now

    async def sweep_deployment(self, deployment_id: str, *, workflow_id: str,
                               event_for: Callable[[list[ReplicaView]], NewEvent],
                               ) -> Event | None:
        """Remove a deployment whose workflow is gone: its replicas (by cascade, their
        claims), then its row, and append ``event_for(the replicas removed)`` to the audit
        log, in one transaction. None when the row (of that workflow) is already gone,
        and then nothing is appended.

        Idempotent and safe to race: the row's lock makes a second sweeper wait, then find
        nothing. A placement still running for the deployment (an activity a terminate
        left behind) holds a key-share lock on the row from its replica's insert to its
        commit: the sweep waits for it and removes its claims too, or, first to the row,
        makes that insert fail on the missing row, so no claim outlives the sweep.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            locked = await conn.fetchval(
                "SELECT deployment_id FROM deployments "
                "WHERE deployment_id = $1 AND workflow_id = $2 FOR UPDATE",
                deployment_id, workflow_id)
            if locked is None:
                return None
            replicas = [ReplicaView(**_record(r)) for r in await conn.fetch(
                _REPLICA_SELECT + " WHERE r.deployment_id = $1 ORDER BY r.created_at",
                deployment_id)]
            await conn.execute("DELETE FROM replicas WHERE deployment_id = $1", deployment_id)
            await conn.execute("DELETE FROM deployments WHERE deployment_id = $1",
                               deployment_id)
            event = event_for(replicas)
            row = await conn.fetchrow(
                "INSERT INTO events (kind, message, deployment_id, node_id, replica_id, data) "
                "VALUES ($1, $2, $3, $4, $5, $6) RETURNING event_id, at",
                event.kind, event.message, event.deployment_id, event.node_id,
                event.replica_id, event.data)
            assert row is not None
            return Event(**event.model_dump(), event_id=row["event_id"], at=row["at"])

    async def mark_deleting(self, deployment_id: str) -> bool:
        """Show a deployment as deleting; False when it does not exist."""
        row = await self._pool.fetchval(
            "UPDATE deployments SET status = $2, updated_at = now() WHERE deployment_id = $1 "
            "RETURNING deployment_id", deployment_id, DeploymentStatus.DELETING.value)
        return row is not None

    async def set_desired_replicas(self, deployment_id: str, replicas: int) -> None:
        """Record a scale the keeper accepted."""
        await self._pool.execute(
            "UPDATE deployments SET replicas = $2, updated_at = now() WHERE deployment_id = $1",
            deployment_id, replicas)

    async def record_deployment_status(self, update: DeploymentStatusUpdate) -> None:
        """Write the keeper's status; the deleting status set by the API is kept. The
        generation, the model it runs and the placement note are written as they stand."""
        await self._pool.execute(
            """
            UPDATE deployments SET
                status = CASE WHEN status = 'deleting' THEN status ELSE $2 END,
                placement_error = $3, consecutive_failures = $4, last_failure = $5,
                replicas = $6, generation = $7, runs_model_id = $8, placement_note = $9,
                updated_at = now()
            WHERE deployment_id = $1
            """,
            update.deployment_id, update.status.value, update.placement_error,
            update.consecutive_failures, update.last_failure, update.desired_replicas,
            update.generation, update.runs_model_id, update.placement_note)

    async def get_deployment(self, deployment_id: str) -> DeploymentView | None:
        """One deployment with its replicas; None when unknown."""
        views = await self._deployments("WHERE d.deployment_id = $1", deployment_id)
        return views[0] if views else None

    async def get_deployment_by_model(self, model_id: str) -> DeploymentView | None:
        """The deployment of ``model_id``, if any."""
        views = await self._deployments("WHERE d.model_id = $1", model_id)
        return views[0] if views else None

    async def list_deployments(self) -> list[DeploymentView]:
        """Every deployment with its replicas."""
        return await self._deployments("")

    async def deployment_ids_with_status(self, *statuses: DeploymentStatus) -> list[str]:
        """Deployments currently showing any of ``statuses``."""
        rows = await self._pool.fetch(
            "SELECT deployment_id FROM deployments WHERE status = ANY($1::text[]) "
            "ORDER BY deployment_id", [s.value for s in statuses])
        return [row["deployment_id"] for row in rows]

    async def deployment_ids_waiting_for_room(self) -> list[str]:
        """Deployments that would place a replica if a node had room: those that found
        none (:data:`WAITING_FOR_ROOM`). Whoever frees or adds room signals these."""
        return await self.deployment_ids_with_status(*WAITING_FOR_ROOM)

    async def _deployments(self, where: str, *args: Any) -> list[DeploymentView]:
        rows = await self._pool.fetch(
            f"SELECT d.* FROM deployments d {where} ORDER BY d.created_at, d.deployment_id",
            *args)
        if not rows:
            return []
        ids = [row["deployment_id"] for row in rows]
        replica_rows = await self._pool.fetch(
            _REPLICA_SELECT + " WHERE r.deployment_id = ANY($1::text[]) ORDER BY r.created_at",
            ids)
        replicas: dict[str, list[ReplicaView]] = {i: [] for i in ids}
        for r in replica_rows:
            replicas[r["deployment_id"]].append(ReplicaView(**_record(r)))
        views = []
        for row in rows:
            reps = replicas[row["deployment_id"]]
            views.append(DeploymentView(
                deployment_id=row["deployment_id"], model_id=row["model_id"],
                status=row["status"], placement_error=row["placement_error"],
                desired_replicas=row["replicas"],
                ready_replicas=sum(1 for r in reps if r.state is ReplicaState.READY),
                consecutive_failures=row["consecutive_failures"],
                last_failure=row["last_failure"], min_nodes=row["min_nodes"],
                node_ids=row["node_ids"], labels=row["labels"], replicas=reps,
                workflow_id=row["workflow_id"], created_at=row["created_at"],
                updated_at=row["updated_at"], generation=row["generation"],
                runs_model_id=row["runs_model_id"], placement_note=row["placement_note"]))
        return views

    # -- replicas and placement -----------------------------------------------------------

    async def list_replicas(self) -> list[ReplicaView]:
        """Every replica of every deployment."""
        rows = await self._pool.fetch(_REPLICA_SELECT + " ORDER BY r.created_at")
        return [ReplicaView(**_record(r)) for r in rows]

    async def place_replica(self, *, deployment_id: DeploymentId, replica_id: ReplicaId,
                            request: PlacementRequest, model: CatalogModel,
                            now: datetime, unreachable_after_s: float, lost_after_s: float,
                            start_timeout_s: float, generation: Generation | None = None,
                            ) -> list[ShardSpec] | CantPlace:
        """Pick nodes and claim their memory (and CPUs, GPUs); never the same memory twice.

        ``model`` is what the replica runs, engine arguments already laid over the catalog
        entry's; ``generation`` (None: the deployment's model as the catalog has it, at
        generation 0) is recorded on the replica's row. The nodes already holding a replica
        of the deployment go to :func:`place` as ``sibling_node_ids``, so replicas spread;
        when this one must share a node, :meth:`replica_placement_note` says why.

        No node row is locked: heartbeats update those rows every few seconds, and when
        every placement locked every row, a heartbeat at 1,000 nodes waited p99 5.5 s behind
        placements. Instead each attempt, in one READ COMMITTED transaction:

        1. takes the replica's advisory lock and returns the claims already made for it,
           if any. Idempotent per replica id: a retried call, or a duplicate racing the
           first, waits for the first to commit and returns its claims, exactly as it
           returned them (``gpu_memory_bytes`` included);
        2. reads the nodes, and where the deployment's other replicas are, without row
           locks and runs :func:`place` on that snapshot;
        3. takes the advisory lock of each chosen node, in key order (two placements
           wanting the same nodes queue instead of deadlocking), re-reads those nodes and
           checks each shard still fits. Every claimer holds a node's lock from its check
           to its commit, so what this re-read shows cannot grow until this commit: no
           over-claim, and no replica of the deployment arriving unseen on a node chosen
           as free of them. If a racing placement took the room (or that node), the
           attempt rolls back and starts again from fresh state.

        Heartbeats and operator updates never take these locks, so they never wait for a
        placement; a capacity they change after the re-read counts as changed after the
        placement, as it always could. After :data:`_OPTIMISTIC_ATTEMPTS` lost races the
        last attempt takes the placement lock exclusively (the others hold it shared):
        no other placement runs until it commits, so its snapshot is exact and it ends with
        claims or a :class:`CantPlace`, never another retry. A :class:`CantPlace` from
        any attempt describes one consistent snapshot of the nodes.

        The placements of one process take turns, before they take a connection: racers
        rank the nodes alike (bin-packing sends every one of them to the same node), so
        concurrent attempts from one worker mostly lose to each other, and each waiting
        attempt held one of the pool's connections. A hundred deployments posted at once
        on 100 nodes placed 1.5 a second, p99 15 s, a quarter of them only at the
        serialized attempt, with the pool's ten connections held by placements waiting on
        locks (bench/scale). Placements from other processes race as described above.
        """
        args = _ClaimArgs(deployment_id=deployment_id, replica_id=replica_id, request=request,
                          model=model, now=now, unreachable_after_s=unreachable_after_s,
                          lost_after_s=lost_after_s, start_timeout_s=start_timeout_s,
                          generation=generation, cache=self._views)
        timing = _Timing()
        try:
            async with self._placing:
                timing.turn_wait_s = timing.since_start()
                async with self._pool.acquire() as conn:
                    timing.pool_wait_s = timing.since_start() - timing.turn_wait_s
                    for _ in range(_OPTIMISTIC_ATTEMPTS):
                        timing.attempts += 1
                        try:
                            timing.outcome = await _claim(conn, args, serialized=False,
                                                          timing=timing)
                            return timing.outcome
                        except _ClaimsMoved:
                            continue
                    timing.attempts += 1
                    timing.outcome = await _claim(conn, args, serialized=True,
                                                  timing=timing)
                    return timing.outcome
        finally:
            timing.log(replica_id)

    async def dry_run_placement(self, *, deployment_id: DeploymentId,
                                request: PlacementRequest, now: datetime,
                                unreachable_after_s: float, lost_after_s: float,
                                ) -> Placement | CantPlace:
        """Where :meth:`place_replica` would put a replica of the deployment now: the same
        :func:`place` on the same reads (the nodes with their claims, the deployment's
        other replicas' nodes), but with no lock taken and nothing claimed or written.

        A room watch asks this every few minutes per deployment that cannot be placed, so
        it must never wait behind a placement or a heartbeat, nor hold one up. The answer
        can be stale by the time it is read; only place_replica's locked re-check counts.
        """
        async with self._pool.acquire() as conn:
            siblings = await _sibling_nodes(conn, deployment_id)
            rows = await conn.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.node_id")
        request = request.model_copy(update={
            "deployment_id": deployment_id, "sibling_node_ids": sorted(siblings)})
        return place(request, self._views.of(rows, now, unreachable_after_s=unreachable_after_s,
                                             lost_after_s=lost_after_s, every_node=True))

    async def replica_placement_note(self, replica_id: str) -> str | None:
        """Why the replica shares a node with another replica of its deployment, as its
        placement found (None: it does not, or it is unknown). Written with its claims,
        so a retried placement reads what the first attempt found."""
        note: str | None = await self._pool.fetchval(
            "SELECT placement_note FROM replicas WHERE replica_id = $1", replica_id)
        return note

    async def record_replica_state(self, update: ReplicaStateUpdate
                                   ) -> EndpointRefused | None:
        """Write a replica's state (and endpoint once ready).

        An endpoint is recorded only on the address its rank 0's node registered from and
        in that node's declared engine ports (the gateway sends prompts and the replica's
        key there), together with that node and its key epoch (whose key the engine's
        derives from: the gateway cannot read nodes).
        Otherwise the state is still written, the endpoint is cleared, so no gateway
        routes to it, and the refusal is returned for the caller to record.
        """
        endpoint = update.endpoint
        refused: EndpointRefused | None = None
        node_id: str | None = None
        key_epoch: str | None = None
        if endpoint is not None:
            row = await self._pool.fetchrow(
                """
                SELECT r.deployment_id, n.node_id, n.address, n.engine_port_low,
                       n.engine_port_high, n.key_epoch
                FROM replicas r
                LEFT JOIN allocations a ON a.replica_id = r.replica_id AND a.rank = 0
                LEFT JOIN nodes n ON n.node_id = a.node_id
                WHERE r.replica_id = $1
                """, update.replica_id)
            if row is not None:  # else the replica is gone: the UPDATE below is a no-op
                node_id = row["node_id"]
                key_epoch = row["key_epoch"]
                reason = ("the replica holds no claim for its rank 0"
                          if row["node_id"] is None else
                          endpoint_refusal(endpoint, address=row["address"],
                                           engine_ports=_port_range(row["engine_port_low"],
                                                                    row["engine_port_high"])))
                if reason is not None:
                    refused = EndpointRefused(replica_id=update.replica_id,
                                              deployment_id=row["deployment_id"],
                                              node_id=row["node_id"], endpoint=endpoint,
                                              reason=reason)
                    endpoint = None
        await self._pool.execute(
            """
            UPDATE replicas SET state = $2,
                   endpoint = CASE WHEN $4 THEN NULL ELSE COALESCE($3, endpoint) END,
                   endpoint_node_id = CASE WHEN $4 THEN NULL
                                           WHEN $3 IS NULL THEN endpoint_node_id
                                           ELSE $5 END,
                   endpoint_node_epoch = CASE WHEN $4 THEN NULL
                                              WHEN $3 IS NULL THEN endpoint_node_epoch
                                              ELSE $6 END,
                   ready_at = CASE WHEN $2 = 'ready' AND ready_at IS NULL THEN now()
                                   ELSE ready_at END,
                   left_routing_at = CASE WHEN $2 = 'ready' THEN NULL
                                          WHEN state = 'ready' THEN clock_timestamp()
                                          ELSE left_routing_at END
            WHERE replica_id = $1
            """,
            update.replica_id, update.state.value, endpoint, refused is not None, node_id,
            key_epoch)
        return refused

    async def release_replica(self, replica_id: str) -> bool:
        """Delete a replica and (by cascade) its claims; True if it existed."""
        done = await self._pool.execute("DELETE FROM replicas WHERE replica_id = $1",
                                        replica_id)
        return bool(done.endswith(" 1"))

    # -- draining -------------------------------------------------------------------------

    async def mark_replica_draining(self, replica_id: str
                                    ) -> tuple[ReplicaState, datetime] | None:
        """Take a replica out of routing by marking it ``draining``: only ``ready`` is
        routed, and the gateways hear of the change through NOTIFY (migration 0002).

        Idempotent: a replica already ``draining`` or ``stopping`` is left as it is (a
        stop under way never goes back to draining), and so notifies nobody. Returns the
        replica's state after the call and the time from which a usage row counts: the
        store's clock read once this change has committed, so a row stamped later was
        written by a worker that could see it; or, for a replica already out of routing,
        when it left (``left_routing_at``). None when the replica is gone.
        """
        async with self._pool.acquire() as conn:
            # Out of routing already (the keeper's stopping write came first): count from
            # then (migration 0009), not from now.
            left = await conn.fetchval(
                "SELECT left_routing_at FROM replicas WHERE replica_id = $1", replica_id)
            await conn.execute(
                "UPDATE replicas SET state = $2, "
                "       left_routing_at = CASE WHEN state = 'ready' THEN clock_timestamp()"
                "                              ELSE left_routing_at END "
                "WHERE replica_id = $1 AND state <> ALL($3::text[])",
                replica_id, ReplicaState.DRAINING.value,
                [ReplicaState.DRAINING.value, ReplicaState.STOPPING.value])
            # A statement of its own, after the UPDATE's commit: a clock read inside the
            # UPDATE could precede its commit, and a usage write starting in between would
            # be stamped after the mark while still seeing the replica ready. (A time
            # stamped by another writer's UPDATE has that window, microseconds wide.)
            row = await conn.fetchrow(
                "SELECT state, clock_timestamp() AS at FROM replicas WHERE replica_id = $1",
                replica_id)
        if row is None:
            return None
        return ReplicaState(row["state"]), left if left is not None else row["at"]

    async def replica_usage_since(self, replica_id: str, since: datetime
                                  ) -> tuple[datetime, list[UsageReport]]:
        """The store's clock now, and each gateway worker's usage row of ``replica_id``
        written after ``since`` (a drain reads how many requests are still in flight)."""
        row = await self._pool.fetchrow(
            """
            SELECT clock_timestamp() AS now,
                   array_agg(gateway_id ORDER BY gateway_id) AS gateway_ids,
                   array_agg(in_flight ORDER BY gateway_id) AS in_flight,
                   array_agg(updated_at ORDER BY gateway_id) AS updated_at
            FROM replica_usage WHERE replica_id = $1 AND updated_at > $2
            """,
            replica_id, since)
        assert row is not None  # an aggregate without GROUP BY always returns one row
        reports = [UsageReport(gateway_id=g, in_flight=n, updated_at=at)
                   for g, n, at in zip(row["gateway_ids"] or [], row["in_flight"] or [],
                                       row["updated_at"] or [], strict=True)]
        return row["now"], reports


#: Each node's claims summed by two subqueries per node: cheap for a few nodes, and what
#: every read of whole :class:`NodeRecord` rows uses.
_CLAIMS_PER_NODE = """
    LEFT JOIN LATERAL (
        SELECT SUM(a.memory_bytes)::bigint AS memory_claimed_bytes,
               SUM(a.cpu_cores)::float8 AS cpu_claimed
        FROM allocations a WHERE a.node_id = n.node_id
    ) c ON true
    LEFT JOIN LATERAL (
        SELECT array_agg(i ORDER BY i) AS gpus_claimed
        FROM allocations a, unnest(a.gpu_indices) AS i WHERE a.node_id = n.node_id
    ) g ON true
"""

#: The claim columns both node reads end their column list with.
_CLAIM_COLUMNS = """
           COALESCE(c.memory_claimed_bytes, 0) AS memory_claimed_bytes,
           COALESCE(c.cpu_claimed, 0) AS cpu_claimed,
           COALESCE(g.gpus_claimed, '{}') AS gpus_claimed
"""

_NODE_SELECT = """
    SELECT n.node_id, n.name, n.agent_labels, n.operator_labels, n.cordoned, n.cordon_reason,
           n.memory_total_bytes, n.memory_available_bytes, n.cpu_count, n.gpus, n.last_seen,
           n.registered_at, n.silent_since,""" + _CLAIM_COLUMNS + """
    FROM nodes n""" + _CLAIMS_PER_NODE

#: Only the columns :class:`NodeView` is built from (:func:`_placement_view`).
#: The jsonb columns come as their text: :class:`_NodeViews` compares it to tell an
#: unchanged node, and decodes it only for a node that changed.
_PLACEMENT_COLUMNS = """
    SELECT n.node_id, n.name, n.agent_labels::text AS agent_labels,
           n.operator_labels::text AS operator_labels, n.cordoned,
           n.memory_total_bytes, n.cpu_count, n.gpus::text AS gpus, n.last_seen,
           n.silent_since,
""" + _CLAIM_COLUMNS

#: The nodes as placement reads them: each node's claims summed in one pass over the
#: claims grouped by node, where :data:`_CLAIMS_PER_NODE` sums them with two subqueries per
#: node: at 1,000 nodes and 200 claims those took 19 ms of the server's time, this 0.6 ms.
#: GPU indices are gathered apart from the sums: joined to them, ``unnest`` would count a
#: claim's memory once per GPU it holds.
_PLACEMENT_NODE_SELECT = _PLACEMENT_COLUMNS + """
    FROM nodes n
    LEFT JOIN (
        SELECT a.node_id, SUM(a.memory_bytes)::bigint AS memory_claimed_bytes,
               SUM(a.cpu_cores)::float8 AS cpu_claimed
        FROM allocations a GROUP BY a.node_id
    ) c ON c.node_id = n.node_id
    LEFT JOIN (
        SELECT a.node_id, array_agg(i ORDER BY i) AS gpus_claimed
        FROM allocations a, unnest(a.gpu_indices) AS i GROUP BY a.node_id
    ) g ON g.node_id = n.node_id
"""

#: The same for a few nodes (place_replica's re-read of the nodes it chose, ``$1``): per
#: node, which for a handful of nodes costs less than grouping every claim. The same
#: columns, so :func:`_placement_view` reads both.
_PLACEMENT_NODES_BY_ID = (_PLACEMENT_COLUMNS + "    FROM nodes n" + _CLAIMS_PER_NODE
                          + "    WHERE n.node_id = ANY($1::text[])\n")


_REPLICA_SELECT = """
    SELECT r.replica_id, r.deployment_id, d.model_id, r.state, r.endpoint, r.started_at,
           r.ready_at, r.generation, r.runs_model_id, r.generation < d.generation AS outdated,
           COALESCE((SELECT array_agg(a.node_id ORDER BY a.rank) FROM allocations a
                     WHERE a.replica_id = r.replica_id), '{}') AS nodes
    FROM replicas r JOIN deployments d USING (deployment_id)
"""


def _record(row: asyncpg.Record) -> dict[str, Any]:
    return dict(row.items())


def _port_range(low: int | None, high: int | None) -> PortRange | None:
    return None if low is None or high is None else PortRange(low=low, high=high)


@dataclass
class _Timing:
    """Where one :meth:`Store.place_replica` call spent its time (perf_counter seconds)."""

    started: float = field(default_factory=time.perf_counter)
    #: Waiting for this process's earlier placements to end (its turn).
    turn_wait_s: float = 0.0
    pool_wait_s: float = 0.0
    lock_wait_s: float = 0.0
    attempts: int = 0
    outcome: list[ShardSpec] | CantPlace | None = None

    def since_start(self) -> float:
        return time.perf_counter() - self.started

    async def lock(self, conn: asyncpg.Connection, query: str, *args: Any) -> None:
        """Run a lock statement, counting the time it waits."""
        began = time.perf_counter()
        try:
            await conn.execute(query, *args)
        finally:
            self.lock_wait_s += time.perf_counter() - began

    def log(self, replica_id: str) -> None:
        if not _timing_log.isEnabledFor(logging.DEBUG):
            return
        outcome = ("error" if self.outcome is None else
                   "cant_place" if isinstance(self.outcome, CantPlace) else "placed")
        _timing_log.debug(
            "placement timing replica=%s total_ms=%.2f turn_wait_ms=%.2f pool_wait_ms=%.2f "
            "lock_wait_ms=%.2f attempts=%d outcome=%s", replica_id, self.since_start() * 1e3,
            self.turn_wait_s * 1e3, self.pool_wait_s * 1e3, self.lock_wait_s * 1e3, self.attempts,
            outcome)


class _ClaimsMoved(Exception):
    """A chosen node lost the room between the unlocked read and its lock: retry."""


@dataclass(frozen=True)
class _ClaimArgs:
    """What one placement attempt needs (the arguments of :meth:`Store.place_replica`)."""

    deployment_id: DeploymentId
    replica_id: ReplicaId
    request: PlacementRequest
    model: CatalogModel
    now: datetime
    unreachable_after_s: float
    lost_after_s: float
    start_timeout_s: float
    generation: Generation | None
    cache: _NodeViews

    def views(self, records: list[asyncpg.Record], *, every_node: bool) -> list[NodeView]:
        return self.cache.of(records, self.now, unreachable_after_s=self.unreachable_after_s,
                             lost_after_s=self.lost_after_s, every_node=every_node)


def _lock_key(entity_id: str) -> int:
    """The second key of an id's advisory lock. Stable across processes (unlike hash()); two
    ids that collide only share a lock, which costs waiting, never correctness."""
    return int.from_bytes(hashlib.blake2b(entity_id.encode(), digest_size=4).digest(),
                          "big", signed=True)


async def _claim(conn: asyncpg.Connection, args: _ClaimArgs, *,
                 serialized: bool, timing: _Timing) -> list[ShardSpec] | CantPlace:
    """One attempt of :meth:`Store.place_replica` (see there for the design). Raises
    :class:`_ClaimsMoved`, having rolled back, when an optimistic attempt lost a race."""
    # READ COMMITTED, stated because correctness rests on it: each statement after a lock
    # sees every claim committed before the lock was granted. A REPEATABLE READ snapshot
    # taken before the wait would hide them and over-claim.
    async with conn.transaction(isolation="read_committed"):
        # Before the "already placed?" check, so two attempts for one replica cannot both
        # pass it: the second waits here and then finds the first one's claims.
        await timing.lock(conn, "SELECT pg_advisory_xact_lock($1, $2)",
                          _REPLICA_LOCK_SPACE, _lock_key(args.replica_id))
        existing = await conn.fetch(
            "SELECT * FROM allocations WHERE replica_id = $1 ORDER BY rank", args.replica_id)
        if existing:
            return [_shard_spec(args.replica_id, args.model, a["node_id"], a["rank"],
                                len(existing), a["memory_bytes"], float(a["cpu_cores"]),
                                list(a["gpu_indices"]), a["gpu_memory_bytes"],
                                args.start_timeout_s)
                    for a in existing]
        lock = "pg_advisory_xact_lock" if serialized else "pg_advisory_xact_lock_shared"
        await timing.lock(conn, f"SELECT {lock}($1, $2)", *_PLACEMENT_LOCK)
        siblings = await _sibling_nodes(conn, args.deployment_id)
        request = args.request.model_copy(update={
            "deployment_id": args.deployment_id, "sibling_node_ids": sorted(siblings)})
        result = place(request, args.views(
            await conn.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.node_id"), every_node=True))
        if isinstance(result, CantPlace):
            return result
        if not serialized:
            # Sorted keys, not rank order: two snapshots can rank the same nodes in opposite
            # orders, and two placements taking them so would each hold what the other
            # waits for. In one order they queue instead.
            for key in sorted({_lock_key(a.node_id) for a in result.assignments}):
                await timing.lock(conn, "SELECT pg_advisory_xact_lock($1, $2)",
                                  _NODE_LOCK_SPACE, key)
            fresh = {v.node_id: v for v in args.views(await conn.fetch(
                _PLACEMENT_NODES_BY_ID, result.node_ids), every_node=False)}
            if not all(_fits_now(request, a, fresh.get(a.node_id))
                       for a in result.assignments):
                raise _ClaimsMoved(args.replica_id)
            # A replica of the deployment placed since the read, on a node chosen as free
            # of them: spread would have gone elsewhere. Its placer held that node's lock
            # until it committed, so this read sees it.
            arrived = await _sibling_nodes(conn, args.deployment_id) - siblings
            if arrived & set(result.node_ids):
                raise _ClaimsMoved(args.replica_id)
        gen = args.generation
        await conn.execute(
            "INSERT INTO replicas (replica_id, deployment_id, state, started_at, generation, "
            "runs_model_id, engine_args, placement_note) "
            "VALUES ($1, $2, $3, now(), $4, $5, $6, $7)",
            args.replica_id, args.deployment_id, ReplicaState.STARTING.value,
            0 if gen is None else gen.number, None if gen is None else gen.model_id,
            None if gen is None else gen.engine_args, result.note)
        shards = []
        for a in result.assignments:
            await conn.execute(
                "INSERT INTO allocations (replica_id, node_id, rank, memory_bytes, "
                "cpu_cores, gpu_indices, gpu_memory_bytes) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7)",
                args.replica_id, a.node_id, a.rank, a.memory_bytes, a.cpu_cores,
                a.gpu_indices, a.gpu_memory_bytes)
            shards.append(_shard_spec(args.replica_id, args.model, a.node_id, a.rank,
                                      len(result.assignments), a.memory_bytes, a.cpu_cores,
                                      a.gpu_indices, a.gpu_memory_bytes, args.start_timeout_s))
        return shards


async def _sibling_nodes(conn: asyncpg.Connection, deployment_id: DeploymentId
                         ) -> set[NodeId]:
    """The nodes holding a claim of any replica of the deployment, in any state."""
    rows = await conn.fetch(
        "SELECT DISTINCT a.node_id FROM allocations a JOIN replicas r USING (replica_id) "
        "WHERE r.deployment_id = $1", deployment_id)
    return {NodeId(row["node_id"]) for row in rows}


def _fits_now(request: PlacementRequest, shard: ShardAssignment, node: NodeView | None
              ) -> bool:
    """Whether ``shard`` still fits on ``node`` as re-read under its lock: the node passes
    every rule of :func:`place` again, the shard's GPUs are still free, and their memory is
    what the shard was given. False for a node that is gone."""
    if node is None:
        return False
    [decision] = explain(request, [node])
    gpu_memory = {g.index: g.memory_bytes for g in node.gpus}
    return (decision.fits and set(shard.gpu_indices) <= set(node.free_gpu_indices)
            and shard.gpu_memory_bytes == (
                sum(gpu_memory[i] for i in shard.gpu_indices) if shard.gpu_indices else None))


#: A stored GPU without ``healthy`` is healthy, as :class:`GpuInfo` reads it (every GPU
#: written since the field exists has it).
_GPU_HEALTHY_DEFAULT: bool = GpuInfo.model_fields["healthy"].default


def _placement_view(row: asyncpg.Record, state: NodeState) -> NodeView:
    """A node as placement sees it in ``state``, from a row of
    :data:`_PLACEMENT_NODE_SELECT`: what building a :class:`NodeRecord` from the row and
    then the view from it gives, in one validation instead of two.

    Skipping the record's validation skips nothing that can fail here: every value in the
    row was validated by the model that wrote it (a registration's or a heartbeat's
    inventory, an operator's update). :class:`NodeView`'s own validation is kept: it is
    what sorts the GPUs and the claims and refuses a GPU index reported twice, and it
    costs less than ``model_construct`` would (that one runs in Python; measured, 30 %
    slower). The labels come from the domain's rule (:func:`effective_labels`), as
    :attr:`NodeRecord.labels` does.
    """
    return NodeView.model_validate({
        "node_id": row["node_id"], "name": row["name"], "state": state,
        "labels": effective_labels(_decode_jsonb(row["agent_labels"]),
                                   _decode_jsonb(row["operator_labels"])),
        "memory_total_bytes": row["memory_total_bytes"],
        "memory_claimed_bytes": row["memory_claimed_bytes"],
        "cpu_count": row["cpu_count"], "cpu_claimed": row["cpu_claimed"],
        # GpuView has no name: the agent's GPU name is not placement's business.
        "gpus": [{"index": g["index"], "memory_bytes": g["memory_bytes"],
                  "healthy": g.get("healthy", _GPU_HEALTHY_DEFAULT)}
                 for g in _decode_jsonb(row["gpus"])],
        "gpu_claimed": row["gpus_claimed"],
    })


class _NodeViews:
    """The :class:`NodeView` of each node, kept from one read of the nodes to the next and
    reused while everything it is built from is unchanged.

    Placement reads every node on every call. At 1,000 nodes, building the views (decoding
    three jsonb columns, validating a model) was half of a placement's time, yet between
    two placements few nodes change: a heartbeat moves ``last_seen`` (only the state,
    computed anew each time, reads it) and the memory available (placement does not read
    it). A view is reused only when the state and every other column it is built from are
    equal to the last read's; the jsonb columns are compared as PostgreSQL prints them
    (jsonb's text is canonical: equal values print alike). Views are frozen, so sharing
    one between calls shares nothing a caller can change.

    One event loop reads and writes it, and :meth:`of` does not await: no lock needed. A
    read of every node keeps exactly the nodes it saw, so a removed node is not kept.
    """

    def __init__(self) -> None:
        self._by_node: dict[str, tuple[tuple[object, ...], NodeView]] = {}

    def of(self, rows: Sequence[asyncpg.Record], now: datetime, *,
           unreachable_after_s: float, lost_after_s: float,
           every_node: bool) -> list[NodeView]:
        """The views of ``rows`` (of :data:`_PLACEMENT_COLUMNS`) at ``now``;
        ``every_node``: the rows are the whole table."""
        kept = {} if every_node else self._by_node
        views = []
        for row in rows:
            state = state_at(now, last_seen=row["last_seen"], cordoned=row["cordoned"],
                             silent_since=row["silent_since"],
                             unreachable_after_s=unreachable_after_s,
                             lost_after_s=lost_after_s)
            key = (state, row["name"], row["agent_labels"], row["operator_labels"],
                   row["memory_total_bytes"], row["memory_claimed_bytes"], row["cpu_count"],
                   row["cpu_claimed"], row["gpus"], row["gpus_claimed"])
            known = self._by_node.get(row["node_id"])
            view = known[1] if known is not None and known[0] == key \
                else _placement_view(row, state)
            kept[row["node_id"]] = (key, view)
            views.append(view)
        self._by_node = kept
        return views


def _model(row: asyncpg.Record) -> CatalogModel:
    data = _record(row)
    if data.get("cpu_cores") is not None:
        data["cpu_cores"] = float(data["cpu_cores"])
    return CatalogModel(**data)


def _shard_spec(replica_id: ReplicaId, model: CatalogModel, node_id: NodeId, rank: int,
                world_size: int, memory_bytes: int, cpu_cores: float, gpu_indices: list[int],
                gpu_memory_bytes: int | None, start_timeout_s: float) -> ShardSpec:
    return ShardSpec(
        replica_id=replica_id, model_id=ModelId(model.model_id), node_id=node_id,
        engine=model.engine, source=model.source, sha256=model.sha256, secret=model.secret,
        rank=rank, world_size=world_size,
        memory_bytes=memory_bytes, gpu_memory_bytes=gpu_memory_bytes,
        gpu_indices=gpu_indices, cpu_cores=cpu_cores or None,
        engine_args=model.engine_args, start_timeout_s=start_timeout_s)
