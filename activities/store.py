"""Activities that read and write the PostgreSQL store (run by the control worker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from modelkeeper.domain.capacity import effective_class
from modelkeeper.domain.catalog import (
    CatalogModel,
    DeploymentStatusUpdate,
    Generation,
    ReplicaStateUpdate,
)
from modelkeeper.domain.draining import stale_after_s
from modelkeeper.domain.engine_args import EngineConfigError, check_engine_arg_names
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.domain.eviction import NoVictim, VictimKind
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.notify import parked_notice
from modelkeeper.domain.placement import CantPlace, Placement, PlacementRequest
from modelkeeper.domain.settling import SettlingWindow
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import (
    DeleteDeploymentInput,
    EvictionFound,
    EvictTarget,
    FindEvictionInput,
    PlaceReplicaInput,
    PlaceReplicaResult,
    PreemptTarget,
    RegrowClaimsInput,
    RegrowClaimsResult,
    ReleaseReplicaInput,
    RoomFound,
    ShrinkClaimsInput,
    WatchForRoomInput,
)
from modelkeeper.domain.watchdog import with_calibration
from modelkeeper.infra.notify import start_cant_place_watch, start_notice
from modelkeeper.infra.temporal import signal_unplaceable
from modelkeeper.names import (
    ACTIVITY_DELETE_DEPLOYMENT,
    ACTIVITY_FIND_EVICTION,
    ACTIVITY_PLACE_REPLICA,
    ACTIVITY_RECORD_DEPLOYMENT_STATUS,
    ACTIVITY_RECORD_EVENT,
    ACTIVITY_RECORD_REPLICA_STATE,
    ACTIVITY_REGROW_CLAIMS,
    ACTIVITY_RELEASE_REPLICA,
    ACTIVITY_SHRINK_CLAIMS,
    ACTIVITY_WATCH_FOR_ROOM,
    ERROR_ENGINE_CONFIG,
    ERROR_SETTLING,
    ERROR_UNKNOWN_MODEL,
)
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.holds import HoldClaim

log = logging.getLogger(__name__)

#: A placement refused while settling asks again after what is left of the window, but at
#: most this long: the window can end early (once the ready-node count holds steady), and
#: a second of delay is small against a window of seconds.
SETTLING_RETRY_MAX_S = 1.0
#: ... and at least this long, so a window ending now is not retried in a tight loop.
SETTLING_RETRY_MIN_S = 0.1
#: watch_for_room records a heartbeat this often while it waits (or a quarter of its
#: heartbeat timeout, if less): a local call; the SDK sends at most one a throttle
#: interval (0.8 x the timeout, at most 60 s), and the workflow's cancel comes back with
#: one that was sent.
ROOM_WATCH_BEAT_S = 5.0


class StoreActivities:
    """Activities bound to one store, one Temporal client and the worker's settings."""

    def __init__(self, store: Store, settings: Settings, client: Client | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._settings = settings
        self._client = client
        self._clock = clock
        self.settling = SettlingWindow(started_at=clock(), window_s=settings.settling_window_s)
        self._sampler: asyncio.Task[None] | None = None

    async def start_settling_sampler(self) -> None:
        """Sample the ready-node count until settled (the window needs to see changes as
        they happen, not only when a placement happens to ask)."""

        async def sample() -> None:
            while not self.settling.settled(self._clock()):
                self.settling.observe(await self._ready_nodes(), self._clock())
                await asyncio.sleep(0.5)

        self._sampler = asyncio.create_task(sample())

    async def stop_settling_sampler(self) -> None:
        """Stop the sampler (worker shutdown)."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler

    async def _ready_nodes(self) -> int:
        views = await self._store.placement.list_node_views(
            datetime.now(UTC), unreachable_after_s=self._settings.node_unreachable_after_s,
            lost_after_s=self._settings.node_lost_after_s)
        return sum(1 for v in views if v.state is NodeState.READY)

    async def _append(self, event: NewEvent) -> Event:
        """Append ``event`` once per activity: a retry, whose first attempt may have
        committed it, appends nothing (see :func:`_attempts_key`)."""
        return await self._store.events.record_event(event, idempotency_key=_attempts_key())

    @activity.defn(name=ACTIVITY_RECORD_EVENT)
    async def record_event(self, event: NewEvent) -> Event:
        """Append an entry to the audit log (once, however often it is retried)."""
        return await self._append(event)

    @activity.defn(name=ACTIVITY_PLACE_REPLICA)
    async def place_replica(self, request: PlaceReplicaInput) -> PlaceReplicaResult:
        """Pick nodes and claim their resources in one transaction.

        The replica runs ``request.generation`` (its model, its engine arguments over the
        catalog entry's) when given, else the deployment's model as the catalog has it;
        it goes on none of ``request.avoid_nodes``. A model missing from the catalog, or
        engine arguments its engine refuses, is a non-retryable error: retrying cannot
        fix either."""
        now = self._clock()
        if not self.settling.settled(now):
            # Retryable: the workflow's retry policy brings it back once settled. An
            # expected wait, not a failure: BENIGN keeps the SDK from logging it as a
            # WARNING with a traceback, and it is said here in one INFO line instead.
            message = (f"control plane settling: placement waits up to "
                       f"{self.settling.remaining_s(now):.1f}s more for agents to report in")
            log.info("%s: %s", request.replica_id, message)
            raise ApplicationError(
                message, type=ERROR_SETTLING, category=ApplicationErrorCategory.BENIGN,
                next_retry_delay=timedelta(
                    seconds=min(SETTLING_RETRY_MAX_S, self.settling.remaining_s(now))
                    or SETTLING_RETRY_MIN_S))
        spec = request.spec
        model = await self._runs(request.spec, request.generation)
        result = await self._store.placement.place_replica(
            deployment_id=spec.deployment_id, replica_id=request.replica_id,
            request=_placement_request(spec, model, avoid_nodes=request.avoid_nodes),
            model=model, now=datetime.now(UTC),
            unreachable_after_s=self._settings.node_unreachable_after_s,
            lost_after_s=self._settings.node_lost_after_s,
            start_timeout_s=request.start_timeout_s, generation=request.generation)
        if isinstance(result, CantPlace):
            return PlaceReplicaResult(cant_place=result.summary)
        # The engine serves the deployment's name (what clients send as ``model``, which
        # the gateway passes on), whatever catalog model the generation runs: a switch
        # changes the weights behind the name, not the name. vLLM refuses any other name.
        result = [s.model_copy(update={"model_id": spec.model_id}) for s in result]
        # Read back, not taken from this attempt: a retry whose first attempt committed
        # placed nothing now, and must answer the note that attempt found.
        note = await self._store.placement.replica_placement_note(request.replica_id)
        nodes = [s.node_id for s in result]
        await self._append(NewEvent(
            kind="replica.placed", deployment_id=spec.deployment_id,
            replica_id=request.replica_id,
            message=f"placed on {', '.join(nodes)}" + (f"; {note}" if note else ""),
            data={"nodes": nodes, "model_id": model.model_id, "note": note,
                  "generation": None if request.generation is None
                  else request.generation.number}))
        return PlaceReplicaResult(shards=result, note=note)

    @activity.defn(name=ACTIVITY_WATCH_FOR_ROOM)
    async def watch_for_room(self, request: WatchForRoomInput) -> RoomFound:
        """Wait until a replica of the deployment would fit, and say where.

        A dry run of placement (:meth:`PlacementStore.dry_run_placement`: place_replica's own
        :func:`place` on the nodes as they stand; no lock, no claim) after each wait of
        the can't-place schedule (``request.wait_s``: 30 s doubling to 10 min, carried on
        from the deployment's count of placements that found no room). It returns at the
        first that fits, and the workflow then places for real, as on a node change. So
        room that appears with no ``nodes_changed`` signal (the API was down) is found
        within the schedule's cap, at no cost in history events: the waiting is here, and
        heartbeats are not events.

        It heartbeats through each wait (how the workflow's cancel reaches it, and how a
        dead worker is noticed) with the number of dry runs done, so an attempt retried
        after a database error or a lost worker goes on with the schedule where it was.
        The first dry run comes only after the first wait: a watch that ends, is started
        again and finds "fits" where the placement says no cannot spin.
        """
        info = activity.info()
        done = info.heartbeat_details
        checks = int(done[0]) if done else 0
        beat_s = ROOM_WATCH_BEAT_S if info.heartbeat_timeout is None else min(
            ROOM_WATCH_BEAT_S, info.heartbeat_timeout.total_seconds() / 4)
        spec = request.spec
        loop = asyncio.get_running_loop()
        while True:
            deadline = loop.time() + request.wait_s(checks)
            while (left := deadline - loop.time()) > 0:
                activity.heartbeat(checks)
                await asyncio.sleep(min(left, beat_s))
            model = await self._runs(spec, request.generation)
            result = await self._store.placement.dry_run_placement(
                deployment_id=spec.deployment_id,
                request=_placement_request(spec, model, avoid_nodes=[]), now=datetime.now(UTC),
                unreachable_after_s=self._settings.node_unreachable_after_s,
                lost_after_s=self._settings.node_lost_after_s, model=model)
            checks += 1
            activity.heartbeat(checks)
            if isinstance(result, Placement):
                log.info("%s: room for a replica on %s (dry run %d)", spec.deployment_id,
                         ", ".join(result.node_ids), checks)
                return RoomFound(nodes=list(result.node_ids), checks=checks)

    @activity.defn(name=ACTIVITY_FIND_EVICTION)
    async def find_eviction(self, request: FindEvictionInput) -> EvictionFound:
        """Which idle replica of another on-demand deployment to stop so that a replica
        of ``request.spec`` fits (modelkeeper.domain.eviction has the rules), or why none.

        It claims nothing and stops nothing: the deployment asks the victim's workflow to
        retire it (an ``evict`` update), and places again once the room is freed, where
        placement's locked re-check decides. Usage rows count while younger than the
        drains' staleness (``STALE_AFTER_INTERVALS`` gateway flush intervals); a replica
        that began serving less than ``eviction_protect_s`` ago is never chosen."""
        spec = request.spec
        model = await self._runs(spec, request.generation)
        asking = _placement_request(spec, model, avoid_nodes=request.avoid_nodes)
        # The scopes' guarantees guard their replicas, and let a scope within its own
        # take back what others borrowed (modelkeeper.domain.eviction, rules 8 and 10).
        quotas = await self._store.quotas.list_quotas()
        result = await self._store.placement.find_eviction(
            deployment_id=spec.deployment_id, preempting=True, request=asking, quotas=quotas,
            now=datetime.now(UTC),
            unreachable_after_s=self._settings.node_unreachable_after_s,
            lost_after_s=self._settings.node_lost_after_s,
            stale_after_s=stale_after_s(self._settings.usage_flush_interval_s),
            protect_s=self._settings.eviction_protect_s)
        if isinstance(result, NoVictim):
            log.info("%s: nothing to evict for %s: %s", spec.deployment_id,
                     request.replica_id, result.reason)
            return EvictionFound(reason=result.reason, fits_now=result.fits_now,
                                 refusals=result.refusals, retry_at=result.retry_at)
        log.info("%s: %s", spec.deployment_id, result.reason)
        if not result.together:
            return EvictionFound(choice=result, reason=result.reason)
        # A preemption: the whole set stops together, each victim by its own kind, and
        # what the replica needs on the nodes it would go to is held for it until it
        # places (an idempotent replace, so a retried attempt holds it once). The need,
        # not what the victims free: room that was free already would otherwise go to
        # the first victim placing again, and the preemption would start over.
        victims = result.victims
        await self._store.placement.hold_room(
            deployment_id=spec.deployment_id,
            claims=[HoldClaim(node_id=node, memory_bytes=asking.shard_memory_bytes,
                              cpu_cores=asking.cpu_cores or 0.0)
                    for node in result.place_on],
            reason=result.reason, hold_s=self._settings.preempt_hold_s)
        await self._append(NewEvent(
            kind="deployment.preempting", deployment_id=spec.deployment_id,
            message=result.reason,
            data={"victims": [v.model_dump(mode="json") for v in victims]}))
        return EvictionFound(
            reason=result.reason,
            preempt=[PreemptTarget(replica_id=v.replica_id, deployment_id=v.deployment_id,
                                   reason=v.preempt_request(spec.deployment_id).reason)
                     for v in victims if v.kind is VictimKind.PREEMPT],
            also_evict=[EvictTarget(replica_id=v.replica_id, deployment_id=v.deployment_id,
                                    reason=result.reason)
                        for v in victims if v.kind is VictimKind.EVICT])

    async def _runs(self, spec: DeploymentSpec, generation: Generation | None
                    ) -> CatalogModel:
        """The catalog entry the replica runs, with the generation's engine arguments laid
        over the entry's and checked against its engine's allow-list, as the catalog checks
        an entry's own."""
        model_id = spec.model_id if generation is None else generation.model_id
        model = await self._store.catalog.get_model(model_id)
        if model is None:
            raise ApplicationError(f"model {model_id!r} is not in the catalog",
                                   type=ERROR_UNKNOWN_MODEL, non_retryable=True)
        # OOM calibration: a model killed for memory is claimed at what it was seen to
        # take (modelkeeper.domain.watchdog, rule 6), by every placement, dry run and
        # eviction search alike.
        model = with_calibration(model, await self._store.watchdog.calibration(model_id),
                                 margin=self._settings.oom_calibration_margin)
        if generation is None:
            return model
        engine_args = {**model.engine_args, **generation.engine_args}
        try:
            check_engine_arg_names(model.engine, engine_args)
        except EngineConfigError as exc:
            raise ApplicationError(
                f"generation {generation.number} of model {model_id!r}: {exc}",
                type=ERROR_ENGINE_CONFIG, non_retryable=True) from exc
        return model.model_copy(update={"engine_args": engine_args})

    @activity.defn(name=ACTIVITY_RECORD_REPLICA_STATE)
    async def record_replica_state(self, update: ReplicaStateUpdate) -> None:
        """Write a replica's state; the gateway hears of it through NOTIFY.

        An endpoint off its node's registered address or engine ports is not recorded
        (the store clears it, so no gateway routes there) and the refusal goes to the
        audit log, once however often this is retried.
        """
        refused = await self._store.deployments.record_replica_state(update)
        if refused is not None:
            log.warning("replica %s: endpoint refused: %s", refused.replica_id, refused.reason)
            await self._append(NewEvent(
                kind="replica.endpoint_refused", deployment_id=refused.deployment_id,
                replica_id=refused.replica_id, node_id=refused.node_id,
                message=f"endpoint {refused.endpoint!r} refused: {refused.reason}",
                data=refused.model_dump(mode="json")))

    @activity.defn(name=ACTIVITY_RELEASE_REPLICA)
    async def release_replica(self, request: ReleaseReplicaInput) -> None:
        """Delete a replica's row and claims, then tell the deployments waiting for room
        that memory was freed.

        It signals whether or not this attempt found the row: a retry may follow a first
        attempt that deleted it and failed before signalling, and a repeated signal costs
        a waiting deployment one placement attempt at most."""
        await self._store.deployments.release_replica(request.replica_id)
        await self._signal_waiting()

    @activity.defn(name=ACTIVITY_SHRINK_CLAIMS)
    async def shrink_claims(self, request: ShrinkClaimsInput) -> None:
        """The replica sleeps: its claims keep only its model's weights (the catalog's
        ``weights_bytes``; all of them where it gives none), then the deployments waiting
        for room are told memory was freed. Idempotent, like the signal after it (see
        release_replica)."""
        kept = await self._store.placement.replica_weights_bytes(request.replica_id)
        await self._store.placement.shrink_claims(request.replica_id, kept)
        if kept is not None:
            await self._signal_waiting()

    @activity.defn(name=ACTIVITY_REGROW_CLAIMS)
    async def regrow_claims(self, request: RegrowClaimsInput) -> RegrowClaimsResult:
        """Before a wake: grow the replica's claims back to what it claims awake, if every
        node has the difference free; else change nothing and say why (node, bytes needed,
        bytes free). A replica awake already is ok."""
        reason = await self._store.placement.regrow_claims(
            request.replica_id, now=datetime.now(UTC),
            unreachable_after_s=self._settings.node_unreachable_after_s,
            lost_after_s=self._settings.node_lost_after_s)
        return RegrowClaimsResult(ok=reason is None, reason=reason)

    @activity.defn(name=ACTIVITY_RECORD_DEPLOYMENT_STATUS)
    async def record_deployment_status(self, update: DeploymentStatusUpdate) -> None:
        """Write the keeper's status, and log it to the audit log."""
        await self._store.deployments.record_deployment_status(update)
        reason = update.placement_error if update.status is DeploymentStatus.CANT_PLACE \
            else update.last_failure
        await self._append(NewEvent(
            kind=f"deployment.{update.status.value}", deployment_id=update.deployment_id,
            message=update.status.value + (f": {reason}" if reason else ""),
            data=update.model_dump(mode="json")))
        await self._notify(update)

    async def _notify(self, update: DeploymentStatusUpdate) -> None:
        """A parked deployment is notified at once; an unplaceable one is watched, and
        notified only if it stays so (workflows/notify.py). After the event, so a notice
        never precedes its audit entry; an error here retries the whole activity, whose
        writes are idempotent, so the notice is not lost to a Temporal blip."""
        if self._client is None:
            return
        match update.status:
            case DeploymentStatus.PARKED:
                await start_notice(self._client, parked_notice(
                    update.deployment_id, update.last_failure, update.consecutive_failures,
                    now=datetime.now(UTC)), self._settings)
            case DeploymentStatus.CANT_PLACE:
                await start_cant_place_watch(self._client, update.deployment_id,
                                             self._settings)
            case _:
                pass

    @activity.defn(name=ACTIVITY_DELETE_DEPLOYMENT)
    async def delete_deployment(self, request: DeleteDeploymentInput) -> None:
        """Remove the deployment's row once nothing of it runs."""
        await self._store.deployments.delete_deployment_row(request.deployment_id)
        await self._append(NewEvent(
            kind="deployment.deleted", deployment_id=request.deployment_id,
            message="deleted; every replica it placed is stopped"))

    async def _signal_waiting(self) -> None:
        if self._client is None:
            return
        await signal_unplaceable(self._client,
                                 await self._store.deployments.deployment_ids_waiting_for_room())

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the worker to register."""
        return [self.record_event, self.place_replica, self.record_replica_state,
                self.release_replica, self.record_deployment_status, self.delete_deployment,
                self.shrink_claims, self.regrow_claims, self.find_eviction]

    def room_watches(self) -> list[Callable[..., Any]]:
        """The room watch, for the worker of ROOM_WATCH_TASK_QUEUE: long-lived, so kept
        off the control queue, whose slots the short store activities need."""
        return [self.watch_for_room]


def _placement_request(spec: DeploymentSpec, model: CatalogModel, *,
                       avoid_nodes: list[NodeId]) -> PlacementRequest:
    """What placement is asked for a replica of ``spec`` running ``model``: one request
    for place_replica and the room watch's dry run, so the two cannot disagree on it."""
    return PlacementRequest(
        model_id=model.model_id, memory_bytes=model.memory_bytes, cpu_cores=model.cpu_cores,
        gpus=model.gpus, min_nodes=max(spec.min_nodes, model.min_nodes),
        node_ids=spec.node_ids, labels=spec.labels, avoid_node_ids=avoid_nodes,
        deployment_id=spec.deployment_id,
        capacity_class=effective_class(spec.capacity_class, spec.scaling),
        owner=spec.owner, watts=model.watts, spread=spec.spread, engine=model.engine,
        engine_version=model.engine_version)


def _attempts_key() -> str:
    """The same key for every attempt of the running activity, and a different one for
    every other activity: Temporal keeps the workflow id, run id and activity id across
    the retries of one activity. The run id is in it because activity ids are only unique
    within a run: they start again after a continue-as-new."""
    info = activity.info()
    return f"{info.workflow_id}/{info.workflow_run_id}/{info.activity_id}"
