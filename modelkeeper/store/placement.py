"""Placement and its claims: where a replica goes, and the memory, CPUs and GPUs it claims
there, never the same twice.

The locks placement takes, and why heartbeats never wait for them, are documented once,
at :meth:`PlacementStore.place_replica`; their keys are :mod:`.locks`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from ..domain.capacity import Quota
from ..domain.catalog import CatalogModel, Generation
from ..domain.eviction import EvictionChoice, NoVictim, choose_victim
from ..domain.fit_plans import NOT_DEPLOYED
from ..domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from ..domain.nodes import GpuInfo, NodeState, effective_labels, state_at
from ..domain.placement import (
    CantPlace,
    NodeView,
    Placement,
    PlacementRequest,
    Rejection,
    RejectionReason,
    ShardAssignment,
    explain,
    place,
)
from ..domain.profiles import (
    ProfileCandidate,
    ProfilePlacement,
    place_profiles,
    profile_candidates,
    profile_model,
)
from ..domain.shards import (
    EngineKind,
    ShardSpec,
    format_address,
    rendezvous_port,
    share_of,
)
from ..domain.status import ReplicaState
from ..domain.topology import FACILITY_CAP_KEY
from ..domain.units import format_gib
from .eviction import read_asker, read_candidates, read_holdings
from .holds import HoldClaim, hold_room, holds_against, release_holds, with_holds
from .locks import NODE_LOCK_SPACE, PLACEMENT_LOCK, REPLICA_LOCK_SPACE, lock_key
from .nodes import CLAIM_COLUMNS, CLAIMS_PER_NODE
from .pool import decode_jsonb
from .room import RoomSnapshot, read_held, read_holders

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


class PlacementStore:
    """Placement's reads and claims on the pool :class:`~.stores.Store` owns."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        #: This process's placements take turns (see place_replica).
        self._placing = asyncio.Lock()
        #: The nodes' views as placement last read them (see _NodeViews).
        self._views = _NodeViews()

    async def list_node_views(self, now: datetime, *, unreachable_after_s: float,
                              lost_after_s: float) -> list[NodeView]:
        """Every node as placement sees it at ``now``, by name (what ``explain`` and the
        settling count read: the same read and conversion as placement's own)."""
        rows = await self._pool.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.name, n.node_id")
        return self._views.of(rows, now, unreachable_after_s=unreachable_after_s,
                              lost_after_s=lost_after_s, every_node=True)

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
                                model: CatalogModel | None = None,
                                ) -> Placement | CantPlace:
        """Where :meth:`place_replica` would put a replica of the deployment now: the same
        :func:`place` on the same reads (the nodes with their claims, the deployment's
        other replicas' nodes), but with no lock taken and nothing claimed or written.
        With ``model``, its hardware profiles are tried as place_replica tries them.

        A room watch asks this every few minutes per deployment that cannot be placed, so
        it must never wait behind a placement or a heartbeat, nor hold one up. The answer
        can be stale by the time it is read; only place_replica's locked re-check counts.
        """
        async with self._pool.acquire() as conn:
            request = await _with_facts(conn, request, deployment_id)
            rows = await conn.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.node_id")
            held = await holds_against(conn, deployment_id)
        views = with_holds(self._views.of(
            rows, now, unreachable_after_s=unreachable_after_s, lost_after_s=lost_after_s,
            every_node=True), held)
        if model is None:
            return place(request, views)
        chosen = place_profiles(profile_candidates(model, request), views)
        return chosen.placement if isinstance(chosen, ProfilePlacement) else chosen

    async def replica_weights_bytes(self, replica_id: ReplicaId) -> int | None:
        """What a sleeping replica keeps: the ``weights_bytes`` of the catalog model it
        runs (its generation's, else its deployment's); None when the catalog gives none,
        or the replica is gone."""
        kept: int | None = await self._pool.fetchval(
            "SELECT m.weights_bytes FROM replicas r "
            "JOIN deployments d ON d.deployment_id = r.deployment_id "
            "JOIN models m ON m.model_id = COALESCE(r.runs_model_id, d.model_id) "
            "WHERE r.replica_id = $1", replica_id)
        return kept

    async def shrink_claims(self, replica_id: ReplicaId, keep_bytes: int | None) -> None:
        """The replica sleeps: each of its claims keeps at most its share of
        ``keep_bytes`` (in proportion to what it claims awake: :func:`share_of`; None:
        all of it, so nothing is freed), and remembers its awake amount in
        ``awake_memory_bytes``, what a wake takes back.

        Idempotent: the shares are computed from the awake amounts, so a retry, or a
        second sleep, writes the same. Nothing can over-claim by shrinking, so only the
        replica's lock is taken (a regrow of it waits, or is waited for); no node's.
        Every sum of claims (placement's, ``GET /nodes``') reads ``memory_bytes``, so a
        sleeping claim counts there as only what it keeps.
        """
        async with self._pool.acquire() as conn, conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)",
                               REPLICA_LOCK_SPACE, lock_key(replica_id))
            rows = await conn.fetch(
                "SELECT node_id, COALESCE(awake_memory_bytes, memory_bytes) AS awake "
                "FROM allocations WHERE replica_id = $1", replica_id)
            whole = sum(row["awake"] for row in rows)
            for row in rows:
                kept = row["awake"] if keep_bytes is None else min(
                    row["awake"], share_of(max(0, keep_bytes), row["awake"], whole))
                await conn.execute(
                    "UPDATE allocations SET memory_bytes = $3, awake_memory_bytes = $4 "
                    "WHERE replica_id = $1 AND node_id = $2",
                    replica_id, row["node_id"], kept, row["awake"])

    async def regrow_claims(self, replica_id: ReplicaId, *, now: datetime,
                            unreachable_after_s: float, lost_after_s: float) -> str | None:
        """The replica wakes: grow each claim back to its awake amount if every node has
        the difference free, and answer None; otherwise change nothing and answer why,
        naming the node, the bytes needed and the bytes free. None too for a replica
        awake already (or gone): there is nothing to take back.

        Under place_replica's locks, in its order (see there): the replica's, the
        placement lock shared, then the nodes' in key order. Every claimer holds a node's
        lock from its check to its commit, so the free memory read under them cannot
        shrink before this commit: two wakes, or a wake and a placement, never take the
        same memory. Free memory is placement's own (:attr:`NodeView.memory_free_bytes`
        of the same read), where a sleeping claim counts as what it keeps.
        """
        async with self._pool.acquire() as conn, conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT pg_advisory_xact_lock($1, $2)",
                               REPLICA_LOCK_SPACE, lock_key(replica_id))
            rows = await conn.fetch(
                "SELECT node_id, memory_bytes, awake_memory_bytes FROM allocations "
                "WHERE replica_id = $1 AND awake_memory_bytes IS NOT NULL ORDER BY rank",
                replica_id)
            if not rows:
                return None
            await conn.execute("SELECT pg_advisory_xact_lock_shared($1, $2)", *PLACEMENT_LOCK)
            for key in sorted({lock_key(row["node_id"]) for row in rows}):
                await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", NODE_LOCK_SPACE, key)
            views = {v.node_id: v for v in self._views.of(
                await conn.fetch(_PLACEMENT_NODES_BY_ID, [row["node_id"] for row in rows]),
                now, unreachable_after_s=unreachable_after_s, lost_after_s=lost_after_s,
                every_node=False)}
            reason = _wake_shortfall(replica_id, [
                (NodeId(row["node_id"]), row["awake_memory_bytes"] - row["memory_bytes"])
                for row in rows], views)
            if reason is not None:
                return reason
            await conn.execute(
                "UPDATE allocations SET memory_bytes = awake_memory_bytes, "
                "awake_memory_bytes = NULL WHERE replica_id = $1 "
                "AND awake_memory_bytes IS NOT NULL", replica_id)
            return None
    async def find_eviction(self, *, deployment_id: DeploymentId,
                            request: PlacementRequest, now: datetime,
                            unreachable_after_s: float, lost_after_s: float,
                            stale_after_s: float, protect_s: float,
                            preempting: bool = False, quotas: Sequence[Quota] = (),
                            ) -> EvictionChoice | NoVictim:
        """Which replica of another on-demand deployment to stop so that a replica of
        this one (``request``) fits: :func:`choose_victim` on the nodes and the
        candidates (:func:`.eviction.read_candidates`, usage rows older than
        ``stale_after_s`` not counted) as they stand.

        Like :meth:`dry_run_placement`, it takes no lock and claims nothing: only a
        placement's locked re-check counts, after the victim's own workflow has stopped it.
        It reads in one REPEATABLE READ snapshot, so that the nodes' summed claims hold
        exactly the candidates' claims that the choice removes on its copy. Idle time and
        protection are measured on the store's clock, which stamped the usage rows and
        ``ready_at``; node states on ``now``, as every placement's are.

        ``preempting`` turns on preemption (issue 22): the deployment asking is read in
        the same snapshot (:func:`.eviction.read_asker`: its class, owner, minimum and
        awake replicas), so lower classes, replicas grown under load and borrowed room
        may be chosen too. ``quotas`` (the scopes' guarantees) guard replicas within
        their owner's guarantee; what each owner holds is read with the rest
        (:func:`.eviction.read_holdings`) whenever quotas are given.
        """
        async with self._pool.acquire() as conn, conn.transaction(
                isolation="repeatable_read", readonly=True):
            store_now: datetime = await conn.fetchval("SELECT now()")
            request = await _with_facts(conn, request, deployment_id)
            rows = await conn.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.node_id")
            candidates = await read_candidates(conn, for_deployment=deployment_id,
                                               stale_after_s=stale_after_s)
            held = await holds_against(conn, deployment_id)
            asker = (await read_asker(conn, deployment_id, request) if preempting
                     else None)
            holdings = await read_holdings(conn) if quotas else []
        nodes = with_holds(self._views.of(rows, now, unreachable_after_s=unreachable_after_s,
                                          lost_after_s=lost_after_s, every_node=True), held)
        return choose_victim(request, nodes, candidates, for_deployment=deployment_id,
                             now=store_now, protect_s=protect_s, asker=asker,
                             quotas=quotas, holdings=holdings)

    async def hold_room(self, *, deployment_id: DeploymentId, claims: Sequence[HoldClaim],
                        reason: str, hold_s: float) -> None:
        """Hold what ``claims`` free for ``deployment_id`` (a preemption's victims), so
        that no other placement takes it first (:mod:`.holds`)."""
        await hold_room(self._pool, deployment_id=deployment_id, claims=claims,
                        reason=reason, hold_s=hold_s)

    async def replica_placement_note(self, replica_id: str) -> str | None:
        """Why the replica shares a node with another replica of its deployment, as its
        placement found (None: it does not, or it is unknown). Written with its claims,
        so a retried placement reads what the first attempt found."""
        note: str | None = await self._pool.fetchval(
            "SELECT placement_note FROM replicas WHERE replica_id = $1", replica_id)
        return note

    async def read_room(self, *, now: datetime, unreachable_after_s: float,
                        lost_after_s: float, stale_after_s: float,
                        for_deployment: DeploymentId = NOT_DEPLOYED) -> RoomSnapshot:
        """The nodes, every replica eviction lists (but ``for_deployment``'s) with its
        claims and usage, and the deployments a fit plan may act on, in one REPEATABLE
        READ snapshot as :meth:`find_eviction` reads them (:mod:`.room`). No lock, nothing
        written: what headroom, fit plans and the fleet summary read."""
        async with self._pool.acquire() as conn, conn.transaction(
                isolation="repeatable_read", readonly=True):
            store_now: datetime = await conn.fetchval("SELECT now()")
            rows = await conn.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.node_id")
            candidates = await read_candidates(conn, for_deployment=for_deployment,
                                               stale_after_s=stale_after_s)
            holders = await read_holders(conn)
            held = await read_held(conn)
        nodes = self._views.of(rows, now, unreachable_after_s=unreachable_after_s,
                               lost_after_s=lost_after_s, every_node=True)
        return RoomSnapshot(at=store_now, nodes=nodes, candidates=candidates,
                            holders=holders, held=held)


#: Only the columns :class:`NodeView` is built from (:func:`_placement_view`).
#: The jsonb columns come as their text: :class:`_NodeViews` compares it to tell an
#: unchanged node, and decodes it only for a node that changed.
_PLACEMENT_COLUMNS = """
    SELECT n.node_id, n.name, n.agent_labels::text AS agent_labels,
           n.operator_labels::text AS operator_labels, n.cordoned,
           n.memory_total_bytes, n.cpu_count, n.gpus::text AS gpus, n.last_seen,
           n.silent_since, n.hold_class, n.hold_owner, n.engines::text AS engines,
           COALESCE(c.watts_claimed, 0) AS watts_claimed,
""" + CLAIM_COLUMNS

#: The nodes as placement reads them (a sleeping claim counting as what it keeps, as in
#: :data:`.nodes.CLAIMS_PER_NODE`): each node's claims summed in one pass over the
#: claims grouped by node, where :data:`.nodes.CLAIMS_PER_NODE` sums them with two
#: subqueries per node: at 1,000 nodes and 200 claims those took 19 ms of the server's
#: time, this 0.6 ms. GPU indices are gathered apart from the sums: joined to them,
#: ``unnest`` would count a claim's memory once per GPU it holds.
_PLACEMENT_NODE_SELECT = _PLACEMENT_COLUMNS + """
    FROM nodes n
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

#: The same for a few nodes (place_replica's re-read of the nodes it chose, ``$1``): per
#: node, which for a handful of nodes costs less than grouping every claim. The same
#: columns, so :func:`_placement_view` reads both.
_PLACEMENT_NODES_BY_ID = (_PLACEMENT_COLUMNS + "    FROM nodes n" + CLAIMS_PER_NODE
                          + "    WHERE n.node_id = ANY($1::text[])\n")


@dataclass
class _Timing:
    """Where one :meth:`PlacementStore.place_replica` call spent its time (perf_counter
    seconds)."""

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
    """What one placement attempt needs (the arguments of
    :meth:`PlacementStore.place_replica`)."""

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

    def candidates(self, request: PlacementRequest) -> list[ProfileCandidate]:
        """The model's hardware profiles to try, each asked as ``request`` with its
        resources; the generation's engine arguments over each profile's."""
        return profile_candidates(self.model, request, overrides=self._overrides)

    def runs(self, profile: str | None) -> CatalogModel:
        """The model as the replica's recorded profile runs it (a retry's claims): the
        model itself when none was recorded, or the profile is no longer declared."""
        declared = {p.name: p for p in self.model.profiles}
        return profile_model(self.model, declared.get(profile or ""),
                             overrides=self._overrides)

    @property
    def _overrides(self) -> dict[str, Any]:
        return {} if self.generation is None else self.generation.engine_args


async def _claim(conn: asyncpg.Connection, args: _ClaimArgs, *,
                 serialized: bool, timing: _Timing) -> list[ShardSpec] | CantPlace:
    """One attempt of :meth:`PlacementStore.place_replica` (see there for the design).
    Raises :class:`_ClaimsMoved`, having rolled back, when an optimistic attempt lost a
    race."""
    # READ COMMITTED, stated because correctness rests on it: each statement after a lock
    # sees every claim committed before the lock was granted. A REPEATABLE READ snapshot
    # taken before the wait would hide them and over-claim.
    async with conn.transaction(isolation="read_committed"):
        # Before the "already placed?" check, so two attempts for one replica cannot both
        # pass it: the second waits here and then finds the first one's claims.
        await timing.lock(conn, "SELECT pg_advisory_xact_lock($1, $2)",
                          REPLICA_LOCK_SPACE, lock_key(args.replica_id))
        # A sleeping claim answers with what it claims awake: that is what its shard runs.
        existing = await conn.fetch(
            "SELECT a.*, COALESCE(a.awake_memory_bytes, a.memory_bytes) AS awake_bytes, "
            "r.profile, n.address FROM allocations a JOIN replicas r USING (replica_id) "
            "JOIN nodes n ON n.node_id = a.node_id "
            "WHERE a.replica_id = $1 ORDER BY a.rank", args.replica_id)
        if existing:
            runs = args.runs(existing[0]["profile"])
            rank0 = existing[0]
            stored = (None if len(existing) == 1 or rank0["address"] is None
                      or rank0["rendezvous_port"] is None
                      else format_address(rank0["address"], rank0["rendezvous_port"]))
            return [_shard_spec(args.replica_id, runs, a["node_id"], a["rank"],
                                len(existing), a["awake_bytes"], float(a["cpu_cores"]),
                                list(a["gpu_indices"]), a["gpu_memory_bytes"],
                                args.start_timeout_s, leader_address=stored)
                    for a in existing]
        # Power caps and spread count across nodes (a PDU's draw, a domain's shards), which
        # the chosen nodes' locks do not cover: such a placement takes the placement lock
        # exclusively, so that its snapshot is exact.
        serialized = serialized or _counts_across_nodes(args.request)
        lock = "pg_advisory_xact_lock" if serialized else "pg_advisory_xact_lock_shared"
        await timing.lock(conn, f"SELECT {lock}($1, $2)", *PLACEMENT_LOCK)
        request = await _with_facts(conn, args.request, args.deployment_id)
        siblings = set(request.sibling_node_ids)
        # Room another deployment preempted for counts as claimed (modelkeeper.store.holds).
        held = await holds_against(conn, args.deployment_id)
        # Hardware profiles (modelkeeper.domain.profiles): the first that fits, its
        # request checked again below and its model what the shards run.
        chosen = place_profiles(args.candidates(request), with_holds(args.views(
            await conn.fetch(_PLACEMENT_NODE_SELECT + " ORDER BY n.node_id"), every_node=True),
            held))
        if isinstance(chosen, CantPlace):
            return chosen
        result, request, runs = chosen.placement, chosen.candidate.request, chosen.candidate.model
        if not serialized:
            # Sorted keys, not rank order: two snapshots can rank the same nodes in opposite
            # orders, and two placements taking them so would each hold what the other
            # waits for. In one order they queue instead.
            for key in sorted({lock_key(a.node_id) for a in result.assignments}):
                await timing.lock(conn, "SELECT pg_advisory_xact_lock($1, $2)",
                                  NODE_LOCK_SPACE, key)
            fresh = {v.node_id: v for v in with_holds(args.views(await conn.fetch(
                _PLACEMENT_NODES_BY_ID, result.node_ids), every_node=False),
                await holds_against(conn, args.deployment_id))}
            if not all(_fits_now(request, a, fresh.get(a.node_id))
                       for a in result.assignments):
                raise _ClaimsMoved(args.replica_id)
            # A replica of the deployment placed since the read, on a node chosen as free
            # of them: spread would have gone elsewhere. Its placer held that node's lock
            # until it committed, so this read sees it.
            arrived = await _sibling_nodes(conn, args.deployment_id) - siblings
            if arrived & set(result.node_ids):
                raise _ClaimsMoved(args.replica_id)
        # Rank 0's rendezvous, for a replica of several shards (docs/engines.md).
        leader: str | None = None
        leader_port: int | None = None
        if len(result.assignments) > 1:
            rendezvous = await _claim_rendezvous(conn, result.node_ids)
            if isinstance(rendezvous, CantPlace):
                return rendezvous
            rank0, leader, leader_port = (rendezvous[0], format_address(*rendezvous[1:]),
                                          rendezvous[2])
            result = _with_rank0(result, rank0)
        gen = args.generation
        await conn.execute(
            "INSERT INTO replicas (replica_id, deployment_id, state, started_at, generation, "
            "runs_model_id, engine_args, placement_note, profile) "
            "VALUES ($1, $2, $3, now(), $4, $5, $6, $7, $8)",
            args.replica_id, args.deployment_id, ReplicaState.STARTING.value,
            0 if gen is None else gen.number, None if gen is None else gen.model_id,
            None if gen is None else gen.engine_args, chosen.note, chosen.candidate.name)
        shards = []
        for a in result.assignments:
            await conn.execute(
                "INSERT INTO allocations (replica_id, node_id, rank, memory_bytes, "
                "cpu_cores, gpu_indices, gpu_memory_bytes, watts, rendezvous_port) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                args.replica_id, a.node_id, a.rank, a.memory_bytes, a.cpu_cores,
                a.gpu_indices, a.gpu_memory_bytes, a.watts,
                leader_port if a.rank == 0 else None)
            shards.append(_shard_spec(args.replica_id, runs, a.node_id, a.rank,
                                      len(result.assignments), a.memory_bytes, a.cpu_cores,
                                      a.gpu_indices, a.gpu_memory_bytes, args.start_timeout_s,
                                      leader_address=leader))
        # The room held for it (a preemption) is its claims' now.
        await release_holds(conn, args.deployment_id)
        return shards


async def _claim_rendezvous(conn: asyncpg.Connection, node_ids: list[NodeId],
                            ) -> tuple[NodeId, str, int] | CantPlace:
    """Rank 0's node and rendezvous among the replica's ``node_ids`` (rank order, rank 0
    first, as placement wants it): the first that can host one, with its registered address
    and a port of its engine range that no other replica's rendezvous holds
    (:func:`rendezvous_port`). Another of the chosen nodes takes rank 0 only when placement's
    own rank 0 cannot (an agent that registered no ports, a range all rendezvous).

    Called under the chosen nodes' locks (or the placement lock held exclusively), which
    every other claim of a port there also holds: the read and the insert that follows see
    every such port."""
    rows = {row["node_id"]: row for row in await conn.fetch(
        "SELECT n.node_id, n.name, n.address, n.engine_port_low, n.engine_port_high, "
        "COALESCE((SELECT array_agg(a.rendezvous_port) FROM allocations a "
        "          WHERE a.node_id = n.node_id AND a.rendezvous_port IS NOT NULL), "
        "         '{}') AS taken "
        "FROM nodes n WHERE n.node_id = ANY($1::text[])", node_ids)}
    rejections = []
    for node_id in node_ids:
        row = rows[node_id]  # placed there in this transaction; nodes are not deleted
        low, high = row["engine_port_low"], row["engine_port_high"]
        port = None if low is None else rendezvous_port(low, high, set(row["taken"]))
        if row["address"] is not None and port is not None:
            return node_id, row["address"], port
        # An agent that registered without ports or address is older than either field:
        # it could not host rank 0 anyway (it knows no rendezvous).
        message = ("rank 0 of a multi-node replica needs the node's address and engine "
                   "ports, and its agent registered none" if row["address"] is None
                   or low is None else
                   f"rank 0 of a multi-node replica needs a rendezvous port, and every "
                   f"engine port {low}-{high} is another replica's")
        rejections.append(Rejection(node_id=node_id, node_name=row["name"],
                                    reason_code=RejectionReason.NO_RENDEZVOUS,
                                    message=message))
    return CantPlace(rejections=rejections, needed_nodes=1,
                     summary="; ".join(f"node {r.node_name}: {r.message}" for r in rejections))


def _with_rank0(placement: Placement, node_id: NodeId) -> Placement:
    """``placement`` with ``node_id``'s shard as rank 0 and the others after it in their
    order; itself when that is rank 0 already."""
    if placement.assignments[0].node_id == node_id:
        return placement
    ordered = sorted(placement.assignments, key=lambda a: (a.node_id != node_id, a.rank))
    return placement.model_copy(update={"assignments": [
        a.model_copy(update={"rank": rank}) for rank, a in enumerate(ordered)]})


def _counts_across_nodes(request: PlacementRequest) -> bool:
    """Whether placement rules 9 or 10 may apply: a declared draw, or a spread."""
    return bool(request.watts) or request.spread is not None


async def _with_facts(conn: asyncpg.Connection, request: PlacementRequest,
                      deployment_id: DeploymentId) -> PlacementRequest:
    """``request`` with what the store knows of the deployment and the facility: the
    nodes holding its replicas (and how many shards each: a spread counts them), and the
    power caps in force when the replica declares watts."""
    rows = await conn.fetch(
        "SELECT a.node_id, count(*)::int AS shards FROM allocations a "
        "JOIN replicas r USING (replica_id) WHERE r.deployment_id = $1 GROUP BY a.node_id",
        deployment_id)
    shards = {NodeId(row["node_id"]): row["shards"] for row in rows}
    update: dict[str, Any] = {"deployment_id": deployment_id,
                              "sibling_node_ids": sorted(shards), "sibling_shards": shards}
    if request.watts:
        caps = {row["pdu"]: row["watts"]
                for row in await conn.fetch("SELECT pdu, watts FROM power_caps")}
        update["facility_cap_watts"] = caps.pop(FACILITY_CAP_KEY, None)
        update["pdu_caps_watts"] = caps
    return request.model_copy(update=update)


async def _sibling_nodes(conn: asyncpg.Connection, deployment_id: DeploymentId
                         ) -> set[NodeId]:
    """The nodes holding a claim of any replica of the deployment, in any state."""
    rows = await conn.fetch(
        "SELECT DISTINCT a.node_id FROM allocations a JOIN replicas r USING (replica_id) "
        "WHERE r.deployment_id = $1", deployment_id)
    return {NodeId(row["node_id"]) for row in rows}


def _wake_shortfall(replica_id: ReplicaId, wanted: list[tuple[NodeId, int]],
                    views: dict[NodeId, NodeView]) -> str | None:
    """Why the replica cannot take back ``wanted`` (per node, the bytes beyond what its
    claim keeps asleep), or None when every node has them free. A node that reports no
    memory fits, as in placement."""
    for node_id, needed in wanted:
        view = views.get(node_id)
        free = None if view is None else view.memory_free_bytes
        if free is None or needed <= free:
            continue
        name = node_id if view is None else f"{view.name} ({node_id})"
        return (f"{replica_id} cannot wake: node {name} has {format_gib(free)} "
                f"({free} bytes) free, and waking takes back {format_gib(needed)} "
                f"({needed} bytes)")
    return None


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
        "labels": effective_labels(decode_jsonb(row["agent_labels"]),
                                   decode_jsonb(row["operator_labels"])),
        "memory_total_bytes": row["memory_total_bytes"],
        "memory_claimed_bytes": row["memory_claimed_bytes"],
        "cpu_count": row["cpu_count"], "cpu_claimed": row["cpu_claimed"],
        # GpuView has no name: the agent's GPU name is not placement's business.
        "gpus": [{"index": g["index"], "memory_bytes": g["memory_bytes"],
                  "healthy": g.get("healthy", _GPU_HEALTHY_DEFAULT)}
                 for g in decode_jsonb(row["gpus"])],
        "gpu_claimed": row["gpus_claimed"],
        "hold_class": row["hold_class"], "hold_owner": row["hold_owner"],
        "watts_claimed": row["watts_claimed"],
        "engines": None if row["engines"] is None else decode_jsonb(row["engines"]),
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
                   row["cpu_claimed"], row["gpus"], row["gpus_claimed"], row["hold_class"],
                   row["hold_owner"], row["watts_claimed"], row["engines"])
            known = self._by_node.get(row["node_id"])
            view = known[1] if known is not None and known[0] == key \
                else _placement_view(row, state)
            kept[row["node_id"]] = (key, view)
            views.append(view)
        self._by_node = kept
        return views


def _shard_engine_args(model: CatalogModel, memory_bytes: int) -> dict[str, Any]:
    """The engine arguments of one shard of ``model`` claiming ``memory_bytes``: the
    catalog's, and for the sim the ``weights_bytes`` it keeps asleep when the catalog gives
    the model's: the same share of what it holds as the model's weights are of its claim,
    so the sim frees what :meth:`PlacementStore.shrink_claims` frees (it may hold less
    than its claim: ``engine_args.memory_bytes``)."""
    args = model.engine_args
    if model.engine is not EngineKind.SIM or model.weights_bytes is None \
            or "weights_bytes" in args:
        return args
    held = args.get("memory_bytes")
    if isinstance(held, bool) or not isinstance(held, int):
        held = memory_bytes
    return {**args, "weights_bytes": share_of(model.weights_bytes, held, model.memory_bytes)}


def _shard_spec(replica_id: ReplicaId, model: CatalogModel, node_id: NodeId, rank: int,
                world_size: int, memory_bytes: int, cpu_cores: float, gpu_indices: list[int],
                gpu_memory_bytes: int | None, start_timeout_s: float, *,
                leader_address: str | None) -> ShardSpec:
    return ShardSpec(
        replica_id=replica_id, model_id=ModelId(model.model_id), node_id=node_id,
        engine=model.engine, source=model.source, sha256=model.sha256, secret=model.secret,
        rank=rank, world_size=world_size, leader_address=leader_address,
        memory_bytes=memory_bytes, gpu_memory_bytes=gpu_memory_bytes,
        gpu_indices=gpu_indices, cpu_cores=cpu_cores or None,
        engine_args=_shard_engine_args(model, memory_bytes), start_timeout_s=start_timeout_s)
