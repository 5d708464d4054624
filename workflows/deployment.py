"""DeploymentWorkflow: one long-running workflow per deployment keeps its model served.

Thin by design. It feeds observations (activity results, signals, timer ticks) to the pure
keeper (:func:`modelkeeper.domain.keeper.decide`) and carries out the actions it returns as
activities: placement on the control queue, engine work on each node's own queue. Its
whole state is one model (:class:`DeploymentWorkflowState`), which continue-as-new carries.

A cancel (web UI, ``temporal workflow cancel``) is handled as a delete: every replica
placed is stopped and released and the deployment's row deleted, then the workflow ends as
cancelled. A terminate runs no workflow code at all: docs/keeper.md says what it leaves.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from datetime import timedelta
from typing import Any, assert_never

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from pydantic import Field, ValidationError, field_validator

    from modelkeeper.domain.base import Tolerant
    from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate, ScaleRequest
    from modelkeeper.domain.control import (
        DeleteDeploymentInput,
        PlaceReplicaInput,
        PlaceReplicaResult,
        ReleaseReplicaInput,
        RoomFound,
        WatchForRoomInput,
    )
    from modelkeeper.domain.draining import DrainReplicaInput
    from modelkeeper.domain.events import NewEvent
    from modelkeeper.domain.ids import DeploymentId, OpId, ReplicaId
    from modelkeeper.domain.keeper import (
        Action,
        Delete,
        DeploymentSpec,
        Exited,
        Finish,
        GenerationSet,
        KeeperConfig,
        KeeperState,
        NodesChanged,
        Observation,
        OpAsked,
        OpCancelled,
        Phase,
        Placed,
        PlacementCrashed,
        PlaceReplica,
        ProbeReplica,
        ProbeResult,
        Retry,
        Scale,
        Silent,
        Started,
        StartFailed,
        StartReplica,
        Stopped,
        StopReplica,
        Tick,
        Unplaceable,
        WatchReplica,
        brief,
        current_generation,
        decide,
        details,
        next_wake,
        op_outcome,
        overview,
        placement_note,
        refuse_op,
        resume,
        room_watch_goes_on,
        room_watch_start,
        status,
        stored_state,
    )
    from modelkeeper.domain.nodes import NodeSilentInput
    from modelkeeper.domain.ops import (
        OP_ENDED,
        AwaitOpRequest,
        CancelOpRequest,
        DeploymentBrief,
        OpOutcome,
        OpRequest,
        SetGenerationRequest,
    )
    from modelkeeper.domain.shards import (
        ShardEndpoint,
        ShardExit,
        ShardReport,
        ShardSpec,
        StartShardInput,
        StopShardInput,
        WatchShardInput,
    )
    from modelkeeper.domain.status import DeploymentStatus
    from modelkeeper.names import (
        ACTIVITY_DELETE_DEPLOYMENT,
        ACTIVITY_DRAIN_REPLICA,
        ACTIVITY_LIST_SHARDS,
        ACTIVITY_PLACE_REPLICA,
        ACTIVITY_RECORD_DEPLOYMENT_STATUS,
        ACTIVITY_RECORD_EVENT,
        ACTIVITY_RECORD_REPLICA_STATE,
        ACTIVITY_RELEASE_REPLICA,
        ACTIVITY_START_SHARD,
        ACTIVITY_STOP_SHARD,
        ACTIVITY_WATCH_FOR_ROOM,
        ACTIVITY_WATCH_SHARD,
        CONTROL_TASK_QUEUE,
        ERROR_DELETING,
        ERROR_OP_REFUSED,
        ERROR_UNKNOWN_MODEL,
        QUERY_BRIEF,
        QUERY_STATUS,
        ROOM_WATCH_TASK_QUEUE,
        SIGNAL_DELETE,
        SIGNAL_NODE_SILENT,
        SIGNAL_NODES_CHANGED,
        SIGNAL_RETRY,
        UPDATE_AWAIT_OP,
        UPDATE_CANCEL_OP,
        UPDATE_OP,
        UPDATE_SCALE,
        UPDATE_SET_GENERATION,
        node_task_queue,
    )

#: The key of the room watch's task among the workflow's tasks (never a replica id).
ROOM_WATCH_TASK = "__room_watch__"

# Search attributes (registered on the server: modelkeeper.names.SEARCH_ATTRIBUTES).
MODEL_ID_KEY = SearchAttributeKey.for_keyword("ModelId")
STATUS_KEY = SearchAttributeKey.for_keyword("DeploymentStatus")
READY_KEY = SearchAttributeKey.for_int("ReadyReplicas")
DESIRED_KEY = SearchAttributeKey.for_int("DesiredReplicas")
NODES_KEY = SearchAttributeKey.for_keyword_list("NodeIds")

# Timeouts and retry policies, each named once beside the reason for its value. Those a
# deployment may set (from settings, or a test) are the fields of WorkflowTimings below.

#: Store activities (place_replica included) are one short transaction each: 30 s covers a
#: slow database without hiding a dead one, which STORE_RETRY (or PLACE_RETRY) waits out.
STORE_TIMEOUT = timedelta(seconds=30)
#: Store activities retry quickly and for a long time: a database restart must delay the
#: keeper, not fail it.
STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                          maximum_interval=timedelta(seconds=10))
#: place_replica retries every second, flat, for timings.place_schedule_to_close_s: a
#: settling control plane names its own next retry (ERROR_SETTLING) and a database blip is
#: short. A model missing from the catalog stays missing, so that error is not retried.
PLACE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=1.0,
                          non_retryable_error_types=[ERROR_UNKNOWN_MODEL])
#: Node activities are not retried by Temporal: the keeper decides what a failure means.
ONCE = RetryPolicy(maximum_attempts=1)
#: ... except stop_shard, tried twice: a stop is harmless to repeat (the agent answers for
#: a shard it no longer runs) and one more try rides out a lost answer. Past that, the
#: agent's orphan reaper stops an engine nobody watches (see _stop).
STOP_RETRY = RetryPolicy(maximum_attempts=2)
#: start_shard heartbeats through fetch, launch and load (every 0.25 s while it waits for
#: the engine to answer); 10 s of silence means the node or its agent is gone.
START_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
#: start_shard and stop_shard each end by a deadline their agent keeps (the spec's start
#: timeout; the stop's grace period, then SIGKILL). Temporal's start-to-close is that
#: deadline plus this slack, so the agent's own answer (a start timeout with the engine's
#: log, an exit after the kill) arrives before a bare Temporal timeout would.
AGENT_DEADLINE_SLACK = timedelta(seconds=30)
#: ... and a start may first wait at its node's start-up gate (agent/startup_gate.py) for
#: up to half its start timeout, which does not count against that timeout: the deadline
#: is the start timeout times this, plus the slack. (Timeouts are not part of replay: a
#: history recorded with the old deadline replays.)
START_QUEUE_ALLOWANCE = 1.5
#: A watch lasts as long as its engine runs, for months: its heartbeat timeout, not its
#: start-to-close, notices a dead node. Ten years stands for "unbounded".
WATCH_LIFETIME = timedelta(days=3650)
#: watch_for_room runs as long as the deployment cannot be placed, for months maybe: its
#: heartbeat timeout notices a dead worker, and the workflow cancels it when the wait ends.
ROOM_WATCH_LIFETIME = WATCH_LIFETIME
#: ... retried for ever, like a store write: a database outage or a lost worker must not
#: end the watch (a retry goes on with its schedule; retries add no history events). A
#: model gone from the catalog is not retried (as place_replica): the workflow then
#: places at once, and the placement's failure says why.
ROOM_WATCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                               maximum_interval=timedelta(seconds=60),
                               non_retryable_error_types=[ERROR_UNKNOWN_MODEL])
#: drain_replica waits up to the grace period for in-flight requests; it heartbeats each
#: second, so 10 s of silence means the control worker died (another picks it up, and the
#: retry goes on with the same wait). Its start-to-close is the grace plus this slack.
DRAIN_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
DRAIN_SLACK = timedelta(seconds=30)
#: A drain is a courtesy to in-flight requests: tried three times, then the stop goes on
#: (a database outage must not keep a retired replica running).
DRAIN_RETRY = RetryPolicy(maximum_attempts=3)
#: An engine's exit or failed start keeps this many of its last log lines in its audit
#: event (GET /events?deployment_id=...): what an agent sends (ShardExit.log_tail), and
#: a bound should one ever send more, since the event is an activity input in history.
EVENT_LOG_LINES = 200


#: The DeploymentStatus search attribute of a deployment that is gone (not a
#: DeploymentStatus: nothing in the store or the API ever shows it).
FINAL_STATUS = "deleted"


class WorkflowTimings(Tolerant):
    """Activity timeouts, fixed at start so replays do not depend on a worker's env.

    Fields, not constants: they travel in the workflow's state (continue-as-new carries
    them), and the API sets watch_heartbeat_timeout_s from settings. Renaming or removing
    one changes the state's shape, which running workflows must still decode.
    """

    #: A watch silent this long marks its replica silent (probed, routed around). Set from
    #: settings: 3 s with 1 s heartbeats detects a kill -9 in 2-3 s (docs/keeper.md).
    watch_heartbeat_timeout_s: float = 3.0
    #: A node queue nobody polls fails a start or watch this fast (a dead agent).
    node_schedule_to_start_s: float = 10.0
    #: A probe (list_shards) asks a live agent what it runs, answered in milliseconds; 2 s
    #: bounds queueing and answer alike, so probing a dead node ends fast (docs/keeper.md).
    probe_timeout_s: float = 2.0
    #: An engine not ready this long after launch is stopped by its agent and the start
    #: fails (ShardSpec.start_timeout_s, the same default): large models load for minutes.
    start_timeout_s: float = 600.0
    #: A stop sends SIGTERM, then SIGKILL after this long: time for an engine to exit
    #: cleanly, short enough that a delete or a replacement does not wait on a hung one.
    stop_grace_s: float = 10.0
    #: place_replica keeps retrying through the settling window (15 s by default) and
    #: database blips; five minutes also outlasts a database restart.
    place_schedule_to_close_s: float = 300.0
    #: Continue-as-new past this many history events even if the server has not yet
    #: suggested it; keeps replays fast. (Tests set it low to exercise the path.)
    continue_as_new_after_events: int = 10_000
    #: A graceful stop waits this long at most for a retired replica's in-flight requests
    #: (the issue's default; a long generation is cut off past it).
    drain_grace_s: float = 30.0
    #: A room watch silent this long is retried (its worker died). The SDK sends one
    #: heartbeat per 0.8 x this, at most one a minute: 60 RPCs an hour per deployment
    #: that cannot be placed, and a cancel reaches the watch within a minute.
    room_watch_heartbeat_timeout_s: float = 120.0


class DeploymentWorkflowState(Tolerant):
    """Everything the workflow knows; continue-as-new passes exactly this.

    Tolerant of unknown keys, as is everything in it (modelkeeper.domain.base.Tolerant):
    a worker rolled back past a new field must still decode the state a newer one carried
    over, or the workflow task fails for ever.
    """

    keeper: KeeperState
    config: KeeperConfig = Field(default_factory=KeeperConfig)
    timings: WorkflowTimings = Field(default_factory=WorkflowTimings)
    #: Shard specs of each placed replica (from place_replica), by replica id.
    shards: dict[str, list[ShardSpec]] = Field(default_factory=dict)
    #: What was last written to the store, so only changes are written.
    written_status: DeploymentStatusUpdate | None = None
    written_replicas: dict[str, str] = Field(default_factory=dict)
    #: When false, no search attributes are upserted (the time-skipping test server
    #: has none registered).
    search_attributes: bool = True

    @field_validator("written_status", mode="before")
    @classmethod
    def _drop_unknown_status_keys(cls, value: Any) -> Any:
        # DeploymentStatusUpdate is also the store activity's input, which stays strict;
        # as carried state it must tolerate a field a newer worker added.
        if isinstance(value, dict):
            known = DeploymentStatusUpdate.model_fields
            return {k: v for k, v in value.items() if k in known}
        return value


class DeploymentInput(Tolerant):
    """The workflow's input: a fresh spec, or the state carried by continue-as-new."""

    state: DeploymentWorkflowState


class WorkflowStatus(Tolerant):
    """What the `status` query answers (to an API that may run another version)."""

    status: DeploymentStatus
    keeper: KeeperState


class NodesChangedInput(Tolerant):
    """Signal payload of `nodes_changed` (none needed yet; a model keeps it extensible,
    and a sender one version ahead may add a field)."""

    reason: str = ""


@workflow.defn(name="DeploymentWorkflow")
class DeploymentWorkflow:
    """Keeps one deployment's replicas placed, started and watched until it is deleted."""

    @workflow.init
    def __init__(self, request: DeploymentInput) -> None:
        # The whole state is built here, from the input, and never in run: the SDK runs the
        # signal and update handlers (validators included) of the first workflow task
        # before run's first line, so in run they would see half-built state. It only
        # copies the input: commands (activities, timers) start in run, as before.
        self._state: DeploymentWorkflowState = request.state
        self._inbox: list[Observation] = []
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._busy: set[str] = set()  # replicas with a place/start/stop in flight
        self._settled = False  # set when busy work ends, to re-check finish/continue
        # The background store writer, started in run. It needs
        # no state of its own beyond these: what to write is the difference between the
        # keeper's state and what the state says was written (written_status,
        # written_replicas), and continue-as-new waits until it is idle.
        self._writer: asyncio.Task[None] | None = None
        self._writing = False  # a write is in flight
        self._events: list[NewEvent] = []  # audit events not yet appended, oldest first
        self._store_closed = False  # the deployment's row is being deleted: no more writes
        # The count of placements in a row that found no room the running room watch
        # started from (its schedule's start), to notice an operator's retry resetting it.
        self._room_watch_from = 0
        # Observations decided so far: a handler that queued one waits until it is past
        # this count, so it answers from the state that includes it.
        self._decided = 0
        # Continue-as-new is due: long polls (await_op) answer now, so that every handler
        # can finish and the run can continue.
        self._continuing = False

    # -- signals, updates, queries -------------------------------------------------------

    @workflow.signal(name=SIGNAL_NODES_CHANGED)
    def nodes_changed(self, _: NodesChangedInput | None = None) -> None:
        """Nodes joined, reported memory, freed memory or were uncordoned."""
        self._inbox.append(NodesChanged())

    @workflow.signal(name=SIGNAL_NODE_SILENT)
    def node_silent(self, request: NodeSilentInput) -> None:
        """The API found a node silent; these replicas of this deployment hold a claim
        there. Each is observed Silent (unreachable, probed), as if its watch had timed
        out; the keeper ignores one that is not ready or not ours."""
        self._inbox.extend(Silent(replica_id=r) for r in request.replica_ids)

    @workflow.signal(name=SIGNAL_RETRY)
    def retry(self) -> None:
        """Un-park (POST /deployments/{id}/retry)."""
        self._inbox.append(Retry())

    @workflow.signal(name=SIGNAL_DELETE)
    def delete(self) -> None:
        """Stop every replica this deployment placed, then end."""
        self._inbox.append(Delete())

    @workflow.update(name=UPDATE_SCALE)
    async def scale(self, request: ScaleRequest) -> int:
        """Change the replica count; returns the new desired count."""
        self._inbox.append(Scale(replicas=request.replicas))
        return request.replicas

    @scale.validator
    def _validate_scale(self, request: ScaleRequest) -> None:
        if self._state.keeper.deleting:
            raise ApplicationError("deployment is being deleted; it cannot be scaled",
                                   type=ERROR_DELETING)

    # -- ops: what sagas ask for (modelkeeper.domain.ops) ---------------------------------

    @workflow.update(name=UPDATE_OP)
    async def op(self, request: OpRequest) -> OpOutcome:
        """Surge, replace or retire; answers the op as it stands once it is registered (a
        retried request is answered again and changes nothing)."""
        if op_outcome(self._state.keeper, request.op_id) is None:
            await self._decide_now(OpAsked(request=request))
        return self._outcome(request.op_id)

    @op.validator
    def _validate_op(self, request: OpRequest) -> None:
        reason = refuse_op(self._state.keeper, request, self._state.config)
        if reason is not None:
            raise ApplicationError(reason, type=ERROR_OP_REFUSED, non_retryable=True)

    @workflow.update(name=UPDATE_AWAIT_OP)
    async def await_op(self, request: AwaitOpRequest) -> OpOutcome:
        """A long poll: the op once it has ended, or as it stands after ``wait_s`` (or
        sooner, when the run is about to continue as new)."""
        def ended() -> bool:
            outcome = op_outcome(self._state.keeper, request.op_id)
            return outcome is None or outcome.state in OP_ENDED or self._continuing
        with contextlib.suppress(builtins.TimeoutError):
            await workflow.wait_condition(ended, timeout=request.wait_s)
        return self._outcome(request.op_id)

    @await_op.validator
    def _validate_await_op(self, request: AwaitOpRequest) -> None:
        self._known_op(request.op_id)

    @workflow.update(name=UPDATE_CANCEL_OP)
    async def cancel_op(self, request: CancelOpRequest) -> OpOutcome:
        """The compensation: retire what the op surged, keep what it would have retired."""
        await self._decide_now(OpCancelled(op_id=request.op_id))
        return self._outcome(request.op_id)

    @cancel_op.validator
    def _validate_cancel_op(self, request: CancelOpRequest) -> None:
        self._known_op(request.op_id)

    @workflow.update(name=UPDATE_SET_GENERATION)
    async def set_generation(self, request: SetGenerationRequest) -> None:
        """New replicas run ``request.generation`` from now on."""
        await self._decide_now(GenerationSet(op_id=request.op_id,
                                             generation=request.generation))

    @set_generation.validator
    def _validate_set_generation(self, request: SetGenerationRequest) -> None:
        if self._state.keeper.deleting:
            raise ApplicationError(
                f"deployment {self._state.keeper.spec.deployment_id} is being deleted",
                type=ERROR_DELETING, non_retryable=True)

    @workflow.query(name=QUERY_BRIEF)
    def brief(self) -> DeploymentBrief:
        """The deployment as a saga sees it: generation, desired count, replicas."""
        return brief(self._state.keeper)

    async def _decide_now(self, observation: Observation) -> None:
        """Queue ``observation`` and wait until the loop has decided it."""
        self._inbox.append(observation)
        target = self._decided + len(self._inbox)
        await workflow.wait_condition(lambda: self._decided >= target)

    def _outcome(self, op_id: OpId) -> OpOutcome:
        outcome = op_outcome(self._state.keeper, op_id)
        if outcome is None:
            # Registered ops leave the registry only long after they end (OPS_KEPT).
            raise ApplicationError(f"op_id: {op_id} is not an op of "
                                   f"{self._state.keeper.spec.deployment_id} (any more)",
                                   type=ERROR_OP_REFUSED, non_retryable=True)
        return outcome

    def _known_op(self, op_id: OpId) -> None:
        if op_outcome(self._state.keeper, op_id) is None:
            known = ", ".join(op.op_id for op in self._state.keeper.ops) or "none"
            raise ApplicationError(
                f"op_id: {op_id} is not an op of {self._state.keeper.spec.deployment_id} "
                f"(known: {known})", type=ERROR_OP_REFUSED, non_retryable=True)

    @workflow.query(name=QUERY_STATUS)
    def status(self) -> WorkflowStatus:
        """The keeper's state and the status it implies."""
        return WorkflowStatus(status=status(self._state.keeper),
                              keeper=self._state.keeper)

    # -- the loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, request: DeploymentInput) -> None:
        """Loop: decide, act, write what changed, wait for the next observation or timer.

        ``request`` is unused: ``__init__`` built the state from it (``@workflow.init``
        requires both to take the same input).

        A cancel is handled as a delete. The SDK delivers it as one asyncio.CancelledError
        to this task alone, at whatever it awaits (the wait for the next observation); the
        activities the other tasks run, the background writer's included, are untouched.
        Once caught, the loop goes on uncancelled: it stops and releases every replica,
        deletes the row, and only then is the cancellation re-raised, so the workflow
        closes as cancelled with nothing left behind. A second cancel request is not
        delivered again (the server records one), so nothing interrupts that cleanup but
        a terminate (docs/keeper.md, "Cancel and terminate").

        "Write what changed" is the background writer's (:meth:`_write_in_background`):
        the loop only publishes the search attributes and goes on.
        """
        self._writer = asyncio.create_task(self._write_in_background())
        for action in resume(self._state.keeper):
            self._launch(action)
        self._inbox.append(Tick())
        try:
            await self._loop()
        except asyncio.CancelledError:
            self._inbox.append(Delete())
            await self._loop()
            raise

    async def _loop(self) -> None:
        """Until the deployment is deleted and nothing is in flight (or it continues as
        new)."""
        while True:
            await self._drain_inbox()
            self._follow_room_watch()
            self._show_details()
            # The writer follows the state on its own; only these are set here.
            self._publish_search_attributes()
            state = self._state
            if state.keeper.finished and not self._busy and self._writer_idle():
                return
            info = workflow.info()
            waiting_for_writer = False
            if not self._busy and not state.keeper.finished and (
                    info.is_continue_as_new_suggested()
                    or info.get_current_history_length()
                    >= state.timings.continue_as_new_after_events):
                self._continuing = True
                if not self._writer_idle():
                    # A write in flight, or one due: the state carried over would say it
                    # is unwritten and the next run would write it again, and an audit
                    # event not yet appended would be lost. Wait for the writer.
                    waiting_for_writer = True
                elif not self._inbox and workflow.all_handlers_finished():
                    # Nothing waits to be decided and no handler is half-way: the state
                    # carried over is the whole truth. Otherwise loop once more first.
                    await self._continue_as_new()
            wake = next_wake(state.keeper, state.config)
            timeout = None
            if wake is not None:
                timeout = max((wake - workflow.now()).total_seconds(), 0.001)

            def woken(for_writer: bool = waiting_for_writer) -> bool:
                return bool(self._inbox) or self._settled or (
                    for_writer and self._writer_idle())

            try:
                await workflow.wait_condition(woken, timeout=timeout)
            except builtins.TimeoutError:
                self._inbox.append(Tick())
            if self._writer is not None and self._writer.done():
                self._writer.result()  # a write that failed for good fails the run, as before
            # Cleared only after waking: a task may end while we write to the store, and
            # clearing before the wait would lose that wake-up.
            self._settled = False

    async def _drain_inbox(self) -> None:
        while self._inbox:
            observation = self._inbox.pop(0)
            keeper, actions = decide(self._state.keeper, observation, workflow.now(),
                                     self._state.config, workflow.random().random())
            self._state = self._state.model_copy(update={"keeper": keeper})
            self._decided += 1
            for action in actions:
                self._launch(action)

    async def _continue_as_new(self) -> None:
        # Watches and probes are re-opened by resume() in the next run.
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        workflow.continue_as_new(DeploymentInput(state=self._state))

    # -- what the deployment shows: web UI details, search attributes, the store ---------

    def _show_details(self) -> None:
        """The web UI's current details (no command: replay is unaffected)."""
        text = details(self._state.keeper)
        if text != workflow.get_current_details():
            workflow.set_current_details(text)

    def _upsert_search_attributes(self) -> None:
        """Upsert the published numbers that changed since the last upsert (or the start).

        Compared with the workflow's own search attributes, which the SDK updates on each
        upsert and replays alike, so the state needs no copy of them. An empty NodeIds is
        unset rather than set to [], so "none" reads the same before and after a restart.
        """
        view = overview(self._state.keeper)
        updates: list[SearchAttributeUpdate[Any]] = [
            STATUS_KEY.value_set(view.status.value), READY_KEY.value_set(view.ready),
            DESIRED_KEY.value_set(view.desired),
            NODES_KEY.value_set(view.node_ids) if view.node_ids else NODES_KEY.value_unset()]
        current = workflow.info().typed_search_attributes
        changed = [u for u in updates if _normalised(current.get(u.key)) != _normalised(u.value)]
        if changed:
            workflow.upsert_search_attributes(changed)

    def _publish_search_attributes(self) -> None:
        """Upsert what changed, before (or without waiting for) the store writes: a
        database outage holds those up, not these."""
        if self._state.search_attributes and not self._state.keeper.finished:
            self._upsert_search_attributes()

    def _current_status(self) -> DeploymentStatusUpdate:
        keeper = self._state.keeper
        runs = current_generation(keeper)
        return DeploymentStatusUpdate(
            deployment_id=keeper.spec.deployment_id,
            status=status(keeper),
            placement_error=keeper.placement_error,
            consecutive_failures=keeper.consecutive_failures,
            last_failure=keeper.last_failure, desired_replicas=keeper.spec.replicas,
            # Defaults (0, None) until a generation is set or a replica shares a node, so
            # a history recorded before them writes what it wrote.
            generation=runs.number,
            runs_model_id=runs.model_id if keeper.spec.generation is not None else None,
            placement_note=placement_note(keeper))

    async def _write_in_background(self) -> None:
        """The one store writer, a task of its own.

        It writes one thing at a time, always what is due now (:meth:`_next_write`), so a
        state that passed while a write was in flight is never written: after an outage it
        writes the latest replica states and status, not each one in between. No decision
        waits for it: store activities retry for ever (STORE_RETRY), and an outage holds
        up only this task (and the finish and continue-as-new, below).

        The order that matters still holds. A replica's state is written only once it is
        placed (place_replica created its row), and an UPDATE of a row release_replica has
        deleted changes nothing. The finish waits for the writer to be idle and closes the
        store to it before it deletes the deployment's row (:meth:`_finish`), so no status
        comes after the delete. Continue-as-new waits for it too (:meth:`_loop`), so the
        state carried over says what was written and no audit event is left behind.

        The wait's condition runs on each workflow task: it reads only the state, so it is
        deterministic, and it is cheap (a few replicas, one status).
        """
        try:
            while True:
                await workflow.wait_condition(lambda: self._next_write() is not None)
                self._writing = True
                while (write := self._next_write()) is not None:
                    await self._write(write)
                self._writing = False
        finally:
            # It ended: a write failed for good. Wake the loop, which raises the error.
            self._settled = True

    def _writer_idle(self) -> bool:
        """Nothing in flight and nothing due."""
        return not self._writing and self._next_write() is None

    def _next_write(self) -> NewEvent | ReplicaStateUpdate | DeploymentStatusUpdate | None:
        """What the store should be told next: an audit event (oldest first), then a
        replica whose stored state differs from its phase (in the keeper's order), then
        the status if it differs from the one last written. None when it is up to date, or
        once the finish has closed the store."""
        if self._store_closed:
            return None
        if self._events:
            return self._events[0]
        written = self._state.written_replicas
        for replica in self._state.keeper.replicas:
            stored = stored_state(replica.phase)
            if stored is not None and written.get(replica.replica_id) != stored.value:
                return ReplicaStateUpdate(replica_id=replica.replica_id, state=stored,
                                          endpoint=replica.endpoint)
        current = self._current_status()
        # Written after the finish too (the deleting status), until _finish closes the
        # store: it waits for this write first.
        return current if current != self._state.written_status else None

    async def _write(self, write: NewEvent | ReplicaStateUpdate | DeploymentStatusUpdate) -> None:
        """Carry out one write and note it as written in the state."""
        match write:
            case NewEvent():
                await workflow.execute_activity(
                    ACTIVITY_RECORD_EVENT, write, task_queue=CONTROL_TASK_QUEUE,
                    start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
                self._events.remove(write)
            case ReplicaStateUpdate():
                await workflow.execute_activity(
                    ACTIVITY_RECORD_REPLICA_STATE, write, task_queue=CONTROL_TASK_QUEUE,
                    start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
                written = {**self._state.written_replicas,
                           write.replica_id: write.state.value}
                self._state = self._state.model_copy(update={"written_replicas": written})
            case DeploymentStatusUpdate():
                await workflow.execute_activity(
                    ACTIVITY_RECORD_DEPLOYMENT_STATUS, write, task_queue=CONTROL_TASK_QUEUE,
                    start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
                self._state = self._state.model_copy(update={"written_status": write})
            case _:
                assert_never(write)
        # Replicas the keeper has dropped meanwhile are forgotten: their rows are gone.
        live = {r.replica_id for r in self._state.keeper.replicas}
        written = {k: v for k, v in self._state.written_replicas.items() if k in live}
        self._state = self._state.model_copy(update={"written_replicas": written})

    # -- the room watch: waiting for room outside the history ------------------------------

    def _follow_room_watch(self) -> None:
        """Start or cancel the room watch as the keeper's state says.

        Cancelled once the deployment no longer waits for room (placed, scaled down,
        deleted, parked) or an operator's retry reset the count; continue-as-new cancels
        it with every other task, and the next run starts it again from the carried count.
        A new one starts only while no placement is in flight (room_watch_start), so it
        starts from the count that placement's answer leaves.
        """
        keeper, config = self._state.keeper, self._state.config
        running = [t for t in self._tasks.get(ROOM_WATCH_TASK, []) if not t.done()]
        if running and not room_watch_goes_on(keeper, config, self._room_watch_from):
            for task in running:
                task.cancel()
            running = []
        if not running and (start := room_watch_start(keeper, config)) is not None:
            self._room_watch_from = start
            self._spawn(ROOM_WATCH_TASK, self._watch_for_room(start))

    async def _watch_for_room(self, unplaceable: int) -> None:
        """Run watch_for_room until it finds room, then retry at once, as on a node change.

        A watch that fails for good (the model left the catalog) retries at once too: the
        placement then fails and says why. Neither can spin: a watch answers only after
        its first wait, at least cant_place_retry_s.
        """
        keeper, config = self._state.keeper, self._state.config
        with contextlib.suppress(ActivityError):
            found: RoomFound = await workflow.execute_activity(
                ACTIVITY_WATCH_FOR_ROOM,
                WatchForRoomInput(spec=keeper.spec, generation=keeper.spec.generation,
                                  unplaceable=unplaceable,
                                  first_wait_s=config.cant_place_retry_s,
                                  max_wait_s=config.room_watch_max_s),
                result_type=RoomFound, task_queue=ROOM_WATCH_TASK_QUEUE,
                start_to_close_timeout=ROOM_WATCH_LIFETIME,
                heartbeat_timeout=timedelta(
                    seconds=self._state.timings.room_watch_heartbeat_timeout_s),
                retry_policy=ROOM_WATCH_RETRY)
            workflow.logger.info("room for a replica on %s", ", ".join(found.nodes))
        self._inbox.append(NodesChanged())

    # -- carrying out actions ------------------------------------------------------------

    def _launch(self, action: Action) -> None:
        match action:
            case PlaceReplica():
                self._spawn(action.replica_id, self._place(action.replica_id), busy=True)
            case StartReplica():
                self._spawn(action.replica_id, self._start(action.replica_id), busy=True)
            case WatchReplica():
                self._spawn(action.replica_id, self._watch(action.replica_id))
            case ProbeReplica():
                # Made unreachable by node_silent, its watch may still run: the probe
                # decides now, and a late Silent from that watch would undo it.
                for task in self._tasks.pop(action.replica_id, []):
                    task.cancel()
                self._spawn(action.replica_id, self._probe(action.replica_id))
            case StopReplica():
                # Whatever runs for this replica (a start, a watch) is superseded by the
                # stop.
                for task in self._tasks.pop(action.replica_id, []):
                    task.cancel()
                self._spawn(action.replica_id, self._stop(action.replica_id, drain=action.drain),
                            busy=True)
            case Finish():
                self._spawn("__finish__", self._finish(), busy=True)
            case _:
                # mypy proves this unreachable; a new action type fails the type check.
                assert_never(action)

    def _spawn(self, key: str, coro: Any, *, busy: bool = False) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.setdefault(key, []).append(task)
        if busy:
            self._busy.add(key)

        def done(t: asyncio.Task[None]) -> None:
            tasks = self._tasks.get(key, [])
            if t in tasks:
                tasks.remove(t)
            if busy and not any(not x.done() for x in tasks if x is not t):
                self._busy.discard(key)
                self._settled = True

        task.add_done_callback(done)

    def _replica_nodes(self, replica_id: str) -> list[ShardSpec]:
        return self._state.shards.get(replica_id, [])

    async def _place(self, replica_id: ReplicaId) -> None:
        replica = next((r for r in self._state.keeper.replicas if r.replica_id == replica_id),
                       None)
        try:
            result: PlaceReplicaResult = await workflow.execute_activity(
                ACTIVITY_PLACE_REPLICA,
                PlaceReplicaInput(spec=self._state.keeper.spec, replica_id=replica_id,
                                  start_timeout_s=self._state.timings.start_timeout_s,
                                  avoid_nodes=replica.avoid_nodes if replica else [],
                                  generation=replica.generation if replica else None),
                result_type=PlaceReplicaResult, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=STORE_TIMEOUT,
                schedule_to_close_timeout=timedelta(
                    seconds=self._state.timings.place_schedule_to_close_s),
                retry_policy=PLACE_RETRY)
        except ActivityError as exc:
            await self._release_crashed_placement(replica_id, exc)
            self._inbox.append(PlacementCrashed(replica_id=replica_id, error=_describe(exc)))
            return
        if result.cant_place is not None:
            self._inbox.append(Unplaceable(replica_id=replica_id, reason=result.cant_place))
            return
        shards = dict(self._state.shards)
        shards[replica_id] = result.shards
        self._state = self._state.model_copy(update={"shards": shards})
        self._inbox.append(Placed(replica_id=replica_id,
                                  nodes=[s.node_id for s in result.shards], note=result.note))

    async def _release_crashed_placement(self, replica_id: ReplicaId,
                                         exc: ActivityError) -> None:
        """Release whatever a failed placement may have claimed for ``replica_id``.

        An attempt can commit its claims and still fail as far as the workflow knows (its
        answer lost, or the schedule-to-close timeout firing while it ran); the keeper
        forgets the replica id on PlacementCrashed, so nothing else would release them.
        release_replica is idempotent: it deletes the row and claims if there are any.
        After a timeout the last attempt may still be inside its transaction, for up to
        its start-to-close (STORE_TIMEOUT): the release waits that long first, so it comes
        after that commit, not before. Meanwhile the replica still counts as placing, so
        no other placement of this deployment starts.
        """
        if isinstance(exc.cause, TimeoutError):
            await workflow.sleep(STORE_TIMEOUT)
        await self._release(replica_id)

    async def _start(self, replica_id: ReplicaId) -> None:
        timings = self._state.timings
        specs = self._replica_nodes(replica_id)
        # Workers before rank 0 would matter for engines whose ranks rendezvous; all
        # start together here and rank 0 is the endpoint.
        tasks = [asyncio.create_task(workflow.execute_activity(
            ACTIVITY_START_SHARD, StartShardInput(spec=spec), result_type=ShardEndpoint,
            task_queue=node_task_queue(spec.node_id),
            schedule_to_start_timeout=timedelta(seconds=timings.node_schedule_to_start_s),
            start_to_close_timeout=timedelta(
                seconds=spec.start_timeout_s * START_QUEUE_ALLOWANCE) + AGENT_DEADLINE_SLACK,
            heartbeat_timeout=START_HEARTBEAT_TIMEOUT, retry_policy=ONCE)) for spec in specs]
        try:
            endpoints: list[ShardEndpoint] = []
            for task in tasks:
                endpoints.append(await task)
        except ActivityError as exc:
            _cancel_all(tasks)
            error = _describe(exc)
            self._events.append(_engine_log_event(
                "replica.start_failed", self._state.keeper.spec.deployment_id,
                replica_id, message=error, ended=_start_exit(exc)))
            self._inbox.append(StartFailed(replica_id=replica_id, error=error))
            return
        except asyncio.CancelledError:
            _cancel_all(tasks)
            raise
        rank0 = next(e for e in endpoints if e.rank == 0)
        self._inbox.append(Started(replica_id=replica_id, endpoint=rank0.url or ""))

    async def _watch(self, replica_id: ReplicaId) -> None:
        timings = self._state.timings
        tasks = [asyncio.create_task(workflow.execute_activity(
            ACTIVITY_WATCH_SHARD, WatchShardInput(replica_id=replica_id), result_type=ShardExit,
            task_queue=node_task_queue(spec.node_id),
            schedule_to_start_timeout=timedelta(seconds=timings.node_schedule_to_start_s),
            start_to_close_timeout=WATCH_LIFETIME,
            heartbeat_timeout=timedelta(seconds=timings.watch_heartbeat_timeout_s),
            retry_policy=ONCE)) for spec in self._replica_nodes(replica_id)]
        if not tasks:
            return
        try:
            done, pending = await workflow.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _cancel_all(tasks)
            raise
        _cancel_all(list(pending))
        first = next(iter(done))
        try:
            ended = first.result()
        except ActivityError:
            # A missed heartbeat, a queue nobody polls, an agent shutting down: the node
            # went quiet. Not lost yet: the keeper probes before giving up on it.
            self._inbox.append(Silent(replica_id=replica_id))
            return
        detail = f"{ended.kind.value}: {ended.detail}"
        self._events.append(_engine_log_event(
            "replica.exited", self._state.keeper.spec.deployment_id, replica_id,
            message=detail, ended=ended))
        self._inbox.append(Exited(replica_id=replica_id, detail=detail))

    async def _probe(self, replica_id: ReplicaId) -> None:
        timeout = timedelta(seconds=self._state.timings.probe_timeout_s)
        running: bool | None = True
        for spec in self._replica_nodes(replica_id):
            try:
                reports: list[ShardReport] = await workflow.execute_activity(
                    ACTIVITY_LIST_SHARDS, result_type=list[ShardReport],
                    task_queue=node_task_queue(spec.node_id),
                    schedule_to_start_timeout=timeout, start_to_close_timeout=timeout,
                    retry_policy=ONCE)
            except ActivityError:
                running = None
                break
            if not any(r.replica_id == replica_id for r in reports):
                running = False
                break
        self._inbox.append(ProbeResult(replica_id=replica_id, running=running))

    async def _stop(self, replica_id: ReplicaId, *, drain: bool = False) -> None:
        timings = self._state.timings
        if drain:
            # Out of routing first, and its in-flight requests finish (bounded by the
            # grace period); a drain that fails for good does not hold up the stop.
            with contextlib.suppress(ActivityError):
                await workflow.execute_activity(
                    ACTIVITY_DRAIN_REPLICA,
                    DrainReplicaInput(replica_id=replica_id, grace_s=timings.drain_grace_s),
                    task_queue=CONTROL_TASK_QUEUE,
                    start_to_close_timeout=timedelta(seconds=timings.drain_grace_s)
                    + DRAIN_SLACK, heartbeat_timeout=DRAIN_HEARTBEAT_TIMEOUT,
                    retry_policy=DRAIN_RETRY)
        stops = [asyncio.create_task(workflow.execute_activity(
            ACTIVITY_STOP_SHARD,
            StopShardInput(replica_id=replica_id, grace_s=timings.stop_grace_s),
            result_type=ShardExit, task_queue=node_task_queue(spec.node_id),
            schedule_to_start_timeout=timedelta(seconds=timings.node_schedule_to_start_s),
            start_to_close_timeout=timedelta(seconds=timings.stop_grace_s) + AGENT_DEADLINE_SLACK,
            retry_policy=STOP_RETRY))
            for spec in self._replica_nodes(replica_id)]
        for task in stops:
            # A node that is gone or silent cannot answer: its agent's orphan reaper stops
            # the engine once nobody watches it. The claim is released either way.
            with contextlib.suppress(ActivityError):
                await task
        await self._release(replica_id)
        shards = {k: v for k, v in self._state.shards.items() if k != replica_id}
        self._state = self._state.model_copy(update={"shards": shards})
        self._inbox.append(Stopped(replica_id=replica_id))

    async def _release(self, replica_id: ReplicaId) -> None:
        """Delete the replica's row and claims, if any (idempotent)."""
        await workflow.execute_activity(
            ACTIVITY_RELEASE_REPLICA, ReleaseReplicaInput(replica_id=replica_id),
            task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
            retry_policy=STORE_RETRY)

    async def _finish(self) -> None:
        # The deleting status (and any audit event) first; nothing after the delete.
        await workflow.wait_condition(self._writer_idle)
        self._store_closed = True
        await workflow.execute_activity(
            ACTIVITY_DELETE_DEPLOYMENT,
            DeleteDeploymentInput(deployment_id=self._state.keeper.spec.deployment_id),
            task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
            retry_policy=STORE_RETRY)
        if self._state.search_attributes:
            workflow.upsert_search_attributes([STATUS_KEY.value_set(FINAL_STATUS)])


def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel activity tasks whose outcome no longer matters, consuming their errors so
    a cancelled activity is not reported as an exception nobody retrieved."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _normalised(value: Any) -> Any:
    """A search attribute's value for comparison: a keyword list as a plain list."""
    return list(value) if isinstance(value, list | tuple) else value


def _describe(exc: ActivityError) -> str:
    """The innermost message of an activity failure, for last_failure and events."""
    cause = exc.cause
    if isinstance(cause, TimeoutError):
        kind = {TimeoutType.SCHEDULE_TO_START: "no agent picked it up in time",
                TimeoutType.HEARTBEAT: "its node went silent",
                TimeoutType.START_TO_CLOSE: "it took too long",
                TimeoutType.SCHEDULE_TO_CLOSE: "it took too long"}.get(
                    cause.type or TimeoutType.START_TO_CLOSE, "timeout")
        return f"{exc.activity_type} timed out: {kind}"
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause or exc)


def _start_exit(exc: ActivityError) -> ShardExit | None:
    """How the engine of a failed start ended, with its log: the agent's ShardExit, the
    first detail of its ApplicationError (activities/node.py). None for a failure without
    one (a timeout, a bad engine config), or one this worker cannot read."""
    cause = exc.cause
    if not isinstance(cause, ApplicationError) or not cause.details:
        return None
    try:
        return ShardExit.model_validate(cause.details[0])
    except ValidationError:
        return None


def _engine_log_event(kind: str, deployment_id: DeploymentId, replica_id: ReplicaId, *,
                      message: str, ended: ShardExit | None) -> NewEvent:
    """The audit event for an engine that exited or failed to start, with its last
    EVENT_LOG_LINES log lines (none when the failure came without them)."""
    data: dict[str, Any] = {"log": []}
    if ended is not None:
        data = {"exit_kind": ended.kind.value, "exit_code": ended.exit_code,
                "signal": ended.signal, "log": ended.log_tail[-EVENT_LOG_LINES:]}
    return NewEvent(kind=kind, deployment_id=deployment_id, replica_id=replica_id,
                    message=message, data=data)


def initial_state(spec: DeploymentSpec, config: KeeperConfig, timings: WorkflowTimings,
                  *, search_attributes: bool = True) -> DeploymentWorkflowState:
    """The state a new deployment's workflow starts from."""
    return DeploymentWorkflowState(keeper=KeeperState(spec=spec), config=config,
                                   timings=timings, search_attributes=search_attributes)


__all__ = ["DESIRED_KEY", "MODEL_ID_KEY", "NODES_KEY", "READY_KEY", "STATUS_KEY",
           "DeploymentInput", "DeploymentWorkflow",
           "DeploymentWorkflowState", "Phase", "WorkflowTimings", "initial_state"]
