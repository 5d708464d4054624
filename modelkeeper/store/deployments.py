"""Deployments and their replicas: the rows the API creates and the keeper keeps, each
replica's state and endpoint, its removal, and its leaving routing for a drain.

A replica's row and claims are first written by placement
(:meth:`.placement.PlacementStore.place_replica`); everything after that is here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from ..domain.capacity import CapacityClass, effective_class
from ..domain.catalog import (
    DeploymentRequest,
    DeploymentStatusUpdate,
    DeploymentView,
    ReplicaStateUpdate,
    ReplicaView,
    current_placement_note,
)
from ..domain.demand import ScalingPolicy
from ..domain.events import Event, NewEvent
from ..domain.ids import DeploymentId, NodeId
from ..domain.nodes import EndpointRefused, endpoint_refusal
from ..domain.start_progress import (
    PROGRESS_FRESH_S,
    PROGRESS_MIN_WRITE_GAP_S,
    PROGRESS_REFRESH_S,
    StartProgress,
    shown,
)
from ..domain.status import WAITING_FOR_ROOM, DeploymentStatus, ReplicaState
from .pool import port_range, record


class DeploymentExistsError(Exception):
    """The model already has a deployment (one per model)."""


class UnknownModelError(Exception):
    """No model with this id in the catalog."""


class DeploymentStore:
    """The ``deployments`` and ``replicas`` tables, on the pool :class:`~.stores.Store`
    owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create_deployment(self, deployment_id: DeploymentId, request: DeploymentRequest,
                                workflow_id: str) -> None:
        """Insert a deployment. The unique model_id index makes racing creates end with one:
        the loser gets :class:`DeploymentExistsError`."""
        try:
            await self._pool.execute(
                """
                INSERT INTO deployments (deployment_id, model_id, replicas, min_nodes, node_ids,
                                         labels, status, workflow_id, scaling,
                                         capacity_class, owner, spread)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
                """,
                deployment_id, request.model_id, request.initial_replicas, request.min_nodes,
                request.node_ids, request.labels, request.first_status.value, workflow_id,
                _policy_json(request.policy),
                None if request.capacity_class is None else request.capacity_class.value,
                request.owner,
                None if request.spread is None else request.spread.model_dump(mode="json"))
        except asyncpg.UniqueViolationError:
            raise DeploymentExistsError(request.model_id) from None
        except asyncpg.ForeignKeyViolationError:
            raise UnknownModelError(request.model_id) from None

    async def delete_deployment_row(self, deployment_id: str) -> None:
        """Remove a deployment and (by cascade) its replicas and their claims."""
        await self._pool.execute("DELETE FROM deployments WHERE deployment_id = $1",
                                 deployment_id)

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
            replicas = [_replica_view(r) for r in await conn.fetch(
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
        """Record a scale the keeper accepted. A count is min = max = that count: the
        scaling policy goes, as in the keeper (whose next write shows an open schedule
        window's bounds, if one is open)."""
        await self._pool.execute(
            "UPDATE deployments SET replicas = $2, scaling = NULL, updated_at = now() "
            "WHERE deployment_id = $1", deployment_id, replicas)

    async def set_tenancy(self, deployment_id: str, *, owner: str | None,
                          capacity_class: CapacityClass | None) -> None:
        """Record a new owner and/or class (PATCH); a None leaves that column as it is."""
        await self._pool.execute(
            "UPDATE deployments SET owner = coalesce($2, owner), "
            "capacity_class = coalesce($3, capacity_class), updated_at = now() "
            "WHERE deployment_id = $1", deployment_id, owner,
            None if capacity_class is None else capacity_class.value)

    async def set_scaling(self, deployment_id: str, policy: ScalingPolicy,
                          replicas: int) -> None:
        """Record a scaling policy the keeper accepted, and the replicas it wants under it
        (the keeper's next status write says the same, a schedule window applied)."""
        await self._pool.execute(
            "UPDATE deployments SET scaling = $2, replicas = $3, updated_at = now() "
            "WHERE deployment_id = $1", deployment_id, _policy_json(policy), replicas)

    async def record_deployment_status(self, update: DeploymentStatusUpdate) -> None:
        """Write the keeper's status; the deleting status set by the API is kept. The
        generation, the model it runs and the placement note are written as they stand."""
        await self._pool.execute(
            """
            UPDATE deployments SET
                status = CASE WHEN status = 'deleting' THEN status ELSE $2 END,
                placement_error = $3, consecutive_failures = $4, last_failure = $5,
                -- The generation a failure was first written on (a failure written again
                -- keeps it): one older than the deployment's is over.
                last_failure_generation = CASE
                    WHEN $5::text IS NULL THEN NULL
                    WHEN last_failure IS DISTINCT FROM $5::text THEN $7
                    ELSE last_failure_generation END,
                replicas = $6, generation = $7, runs_model_id = $8, placement_note = $9,
                scaling = $10, loading_since = $11, loading_reason = $12,
                demand_note = $13, updated_at = now()
            WHERE deployment_id = $1
            """,
            update.deployment_id, update.status.value, update.placement_error,
            update.consecutive_failures, update.last_failure, update.desired_replicas,
            update.generation, update.runs_model_id, update.placement_note,
            update.scaling,
            update.loading_since, update.loading_reason, update.demand_note)

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
        none (:data:`WAITING_FOR_ROOM`), and those serving whose warm standby found none
        (a placement error beside another status). Whoever frees or adds room signals
        these."""
        rows = await self._pool.fetch(
            "SELECT deployment_id FROM deployments WHERE status = ANY($1::text[]) "
            "OR placement_error IS NOT NULL ORDER BY deployment_id",
            [s.value for s in WAITING_FOR_ROOM])
        return [row["deployment_id"] for row in rows]

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
            replicas[r["deployment_id"]].append(_replica_view(r))
        views = []
        for row in rows:
            reps = replicas[row["deployment_id"]]
            views.append(DeploymentView(
                deployment_id=row["deployment_id"], model_id=row["model_id"],
                status=row["status"], placement_error=row["placement_error"],
                desired_replicas=row["replicas"],
                ready_replicas=sum(1 for r in reps if r.state is ReplicaState.READY),
                consecutive_failures=row["consecutive_failures"],
                last_failure=row["last_failure"],
                last_failure_generation=row["last_failure_generation"],
                min_nodes=row["min_nodes"],
                node_ids=row["node_ids"], labels=row["labels"], replicas=reps,
                workflow_id=row["workflow_id"], created_at=row["created_at"],
                updated_at=row["updated_at"], generation=row["generation"],
                runs_model_id=row["runs_model_id"],
                placement_note=current_placement_note(row["placement_note"], reps),
                scaling=row["scaling"], loading_since=row["loading_since"],
                loading_reason=row["loading_reason"], demand_note=row["demand_note"],
                capacity_class=row["capacity_class"], owner=row["owner"],
                runs_as=effective_class(
                    None if row["capacity_class"] is None
                    else CapacityClass(row["capacity_class"]),
                    None if row["scaling"] is None else ScalingPolicy(**row["scaling"]))))
        return views

    # -- replicas -------------------------------------------------------------------------

    async def list_replicas(self) -> list[ReplicaView]:
        """Every replica of every deployment."""
        rows = await self._pool.fetch(_REPLICA_SELECT + " ORDER BY r.created_at")
        return [_replica_view(r) for r in rows]

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
                                           engine_ports=port_range(row["engine_port_low"],
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
                   -- A wake makes it ready again: from then on it serves, and the
                   -- eviction's protection window counts from it.
                   ready_at = CASE WHEN $2 = 'ready'
                                        AND (ready_at IS NULL OR state = 'sleeping')
                                   THEN now() ELSE ready_at END,
                   left_routing_at = CASE WHEN $2 = 'ready' THEN NULL
                                          WHEN state = 'ready' THEN clock_timestamp()
                                          ELSE left_routing_at END,
                   -- Kept by a write of 'starting' that does not say (the keeper's
                   -- own, which may land after the workflow's progress), gone after.
                   shards_ready = CASE WHEN $2 = 'starting'
                                       THEN COALESCE($7, shards_ready) END,
                   -- A relaunch's note stays with the replica once said (a write that
                   -- says none, the workflow's start progress, keeps it).
                   relaunch_note = COALESCE($8, relaunch_note)
            WHERE replica_id = $1
            """,
            update.replica_id, update.state.value, endpoint, refused is not None, node_id,
            key_epoch, update.shards_ready, update.relaunch_note)
        return refused

    async def record_start_progress(self, node_id: str,
                                    starts: Sequence[StartProgress]) -> None:
        """Keep the progress ``node_id``'s agent reports for its starts.

        Only for a replica that is starting and allocated to that node: an agent speaks
        for its own replicas only. Written only when it changed, and then at most once
        per PROGRESS_MIN_WRITE_GAP_S per replica unless its phase changed; an unchanged
        one is written again after PROGRESS_REFRESH_S, so that a long wait in the queue
        stays fresh (PROGRESS_FRESH_S) without a write per heartbeat.
        """
        if not starts:
            return
        await self._pool.execute(
            """
            INSERT INTO replica_progress (replica_id, node_id, phase, progress, updated_at)
            SELECT DISTINCT ON (s.value->>'replica_id')
                   s.value->>'replica_id', $1, s.value->>'phase', s.value, now()
            FROM jsonb_array_elements($2::jsonb) AS s
            JOIN replicas r ON r.replica_id = s.value->>'replica_id' AND r.state = 'starting'
            JOIN allocations a ON a.replica_id = r.replica_id AND a.node_id = $1
            ON CONFLICT (replica_id) DO UPDATE
               SET node_id = EXCLUDED.node_id, phase = EXCLUDED.phase,
                   progress = EXCLUDED.progress, updated_at = EXCLUDED.updated_at
             WHERE replica_progress.phase IS DISTINCT FROM EXCLUDED.phase
                OR replica_progress.node_id IS DISTINCT FROM EXCLUDED.node_id
                OR (replica_progress.progress IS DISTINCT FROM EXCLUDED.progress
                    AND replica_progress.updated_at
                        <= EXCLUDED.updated_at - make_interval(secs => $3))
                OR replica_progress.updated_at <= EXCLUDED.updated_at - make_interval(secs => $4)
            """,
            node_id, [s.model_dump(mode="json") for s in starts],
            PROGRESS_MIN_WRITE_GAP_S, PROGRESS_REFRESH_S)

    async def replica_home(self, replica_id: str
                           ) -> tuple[str | None, list[NodeId]] | None:
        """A replica's deployment and its nodes in rank order: from its claims while it
        is placed, else from the last ``replica.placed`` event (a replica that failed or
        was replaced: its log stays on its node). None when neither knows it."""
        row = await self._pool.fetchrow(
            """
            SELECT r.deployment_id,
                   (SELECT array_agg(a.node_id ORDER BY a.rank) FROM allocations a
                    WHERE a.replica_id = r.replica_id) AS nodes
            FROM replicas r WHERE r.replica_id = $1
            """, replica_id)
        if row is not None and row["nodes"]:
            return row["deployment_id"], [NodeId(n) for n in row["nodes"]]
        placed = await self._pool.fetchrow(
            "SELECT deployment_id, data->'nodes' AS nodes FROM events "
            "WHERE replica_id = $1 AND kind = 'replica.placed' "
            "ORDER BY event_id DESC LIMIT 1", replica_id)
        if placed is None or not isinstance(placed["nodes"], list):
            return None
        return placed["deployment_id"], [NodeId(str(n)) for n in placed["nodes"]]

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
                # Sleeping is out of routing too: a drain before a sleep must not leave
                # it marked draining once the keeper has written sleeping.
                [ReplicaState.DRAINING.value, ReplicaState.STOPPING.value,
                 ReplicaState.SLEEPING.value])
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


def _policy_json(policy: ScalingPolicy | None) -> dict[str, Any] | None:
    """A policy as the ``scaling`` column holds it (the keeper writes the same shape)."""
    return None if policy is None else policy.model_dump(mode="json")


_REPLICA_SELECT = f"""
    SELECT r.replica_id, r.deployment_id, d.model_id, r.state, r.endpoint, r.started_at,
           r.ready_at, r.generation, r.runs_model_id,
           -- Outdated: placed on an older generation, or before its model's spec changed
           -- (PATCH /models/{id}): placement reads the catalog when it inserts the row.
           (r.generation < d.generation
            OR COALESCE(r.created_at < m.spec_changed_at, false)) AS outdated,
           r.profile, r.shards_ready, r.relaunch_note,
           COALESCE((SELECT array_agg(a.node_id ORDER BY a.rank) FROM allocations a
                     WHERE a.replica_id = r.replica_id), '{{}}') AS nodes,
           p.progress AS progress_reported, p.node_id AS progress_node_id,
           p.updated_at AS progress_at,
           (SELECT n.name FROM nodes n WHERE n.node_id = p.node_id) AS progress_node_name
    FROM replicas r JOIN deployments d USING (deployment_id)
    -- A start's progress only while it starts, and only while its agent still says it
    -- (start_progress.PROGRESS_FRESH_S): a start that ended leaves nothing stale.
    LEFT JOIN replica_progress p
           ON p.replica_id = r.replica_id AND r.state = 'starting'
          AND p.updated_at > now() - make_interval(secs => {PROGRESS_FRESH_S})
    LEFT JOIN models m ON m.model_id = COALESCE(r.runs_model_id, d.model_id)
"""


def _replica_view(row: asyncpg.Record) -> ReplicaView:
    """A replica row of :data:`_REPLICA_SELECT` as the API shows it."""
    fields = record(row)
    reported = fields.pop("progress_reported")
    node_id = fields.pop("progress_node_id")
    at = fields.pop("progress_at")
    name = fields.pop("progress_node_name")
    if reported is not None:
        fields["progress"] = shown(StartProgress.model_validate(reported),
                                   node_id=NodeId(node_id), node_name=name or node_id,
                                   updated_at=at)
    return ReplicaView(**fields)
