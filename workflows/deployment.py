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
from collections.abc import Callable
from typing import Any, TypeVar, assert_never

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.capacity import PreemptRequest, SetTenancyRequest
    from modelkeeper.domain.catalog import ScaleRequest
    from modelkeeper.domain.demand import (
        DemandView,
        EvictRequest,
        Pressure,
        SetPolicyRequest,
        SetWindowRequest,
        SleepRequest,
        WakeRequest,
    )
    from modelkeeper.domain.events import NewEvent
    from modelkeeper.domain.ids import DeploymentId, MoveId, ReplicaId
    from modelkeeper.domain.keeper import (
        Action,
        Delete,
        DemandStepDue,
        EvictAsked,
        EvictionSought,
        Finish,
        GenerationSet,
        KeeperConfig,
        KeeperState,
        MoveAsked,
        MoveCancelled,
        NodesChanged,
        Observation,
        Placed,
        PlacementCrashed,
        PlaceReplica,
        PolicySet,
        PreemptAsked,
        ProbeReplica,
        ProbeResult,
        RelaunchReplica,
        Retry,
        Scale,
        SeekRoom,
        Silent,
        SleepAsked,
        SleepFailed,
        SleepReplica,
        Slept,
        StartReplica,
        Stopped,
        StopReplica,
        TenancySet,
        Tick,
        Unplaceable,
        WakeAsked,
        WakeReplica,
        WatchReplica,
        WindowSet,
        brief,
        decide,
        demand_view,
        follows_demand,
        move_outcome,
        next_wake,
        refuse_move,
        resume,
        room_watch_goes_on,
        room_watch_start,
        status,
    )
    from modelkeeper.domain.moves import (
        MOVE_ENDED,
        AwaitMoveRequest,
        CancelMoveRequest,
        DeploymentBrief,
        MoveOutcome,
        MoveRequest,
        SetGenerationRequest,
    )
    from modelkeeper.domain.nodes import NodeSilentInput
    from modelkeeper.domain.shards import ShardSpec, can_sleep
    from modelkeeper.names import (
        ERROR_DELETING,
        ERROR_MOVE_REFUSED,
        PATCH_PREEMPTION,
        PATCH_RELAUNCH,
        QUERY_BRIEF,
        QUERY_STATUS,
        SIGNAL_DELETE,
        SIGNAL_EVICT,
        SIGNAL_NODE_SILENT,
        SIGNAL_NODES_CHANGED,
        SIGNAL_PREEMPT,
        SIGNAL_RETRY,
        UPDATE_AWAIT_MOVE,
        UPDATE_CANCEL_MOVE,
        UPDATE_MOVE,
        UPDATE_SCALE,
        UPDATE_SET_GENERATION,
        UPDATE_SET_POLICY,
        UPDATE_SET_TENANCY,
        UPDATE_SET_WINDOW,
        UPDATE_SLEEP,
        UPDATE_WAKE,
        deployment_workflow_id,
    )

from . import deployment_hops as hops
from .deployment_state import (
    DESIRED_KEY,
    FINAL_STATUS,
    MODEL_ID_KEY,
    NODES_KEY,
    READY_KEY,
    STATUS_KEY,
    DeleteRequest,
    DeploymentInput,
    DeploymentWorkflowState,
    NodesChangedInput,
    WorkflowStatus,
    deleted_result,
    deletion,
)
from .deployment_writer import StoreWriter, publish_search_attributes, show_details

#: The key of the room watch's task among the workflow's tasks (never a replica id).
ROOM_WATCH_TASK = "__room_watch__"
#: ... and the usage watch's (modelkeeper.domain.demand), and an eviction being sought.
DEMAND_WATCH_TASK = "__demand_watch__"
SEEK_ROOM_TASK = "__seek_room__"
#: What a victim's deployment is signalled with: an eviction or a preemption.
_Victim = TypeVar("_Victim", EvictRequest, PreemptRequest)

@workflow.defn(name="DeploymentWorkflow")
class DeploymentWorkflow:
    """Keeps one deployment's replicas placed, started and watched until it is deleted."""

    @workflow.init
    def __init__(self, request: DeploymentInput) -> None:
        # The whole state is built here, from the input, and never in run: the SDK runs the
        # signal and update handlers (validators included) of the first workflow task
        # before run's first line, so in run they would see half-built state. No commands
        # here: activities and timers start in run.
        self.state: DeploymentWorkflowState = request.carried or DeploymentWorkflowState(
            keeper=KeeperState(spec=request.spec), config=KeeperConfig.of(request.tunables),
            tunables=request.tunables, search_attributes=request.search_attributes)
        self._inbox: list[Observation] = []
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._busy: set[str] = set()  # replicas with a place/start/stop in flight
        self._settled = False  # set when busy work ends, to re-check finish/continue
        # The one store writer (deployment_writer), started in run.
        self._writer = StoreWriter(self)
        # The count of placements in a row that found no room the running room watch
        # started from (its schedule's start), to notice an operator's retry resetting it.
        self._room_watch_from = 0
        # Observations decided so far: a handler that queued one waits until it is past
        # this count, so it answers from the state that includes it.
        self._decided = 0
        # Continue-as-new is due: long polls (await_move) answer now, so that every handler
        # can finish and the run can continue.
        self._continuing = False
        # The view the running usage watch was started on: a new one starts when the
        # keeper's view moves on (its step would be dropped anyway).
        self._demand_watch_view: DemandView | None = None
        # What the last watch remembered of each rule's period, for the next one: a step
        # applied must not start a rule's period again (lost on continue-as-new: a period
        # then starts over, which only delays a step).
        self._demand_pressure = Pressure()

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
    def delete(self, request: DeleteRequest | None = None) -> None:
        """Stop every replica this deployment placed, then end, with a result that says
        who deleted it (``request``: an older API sends none)."""
        self._note_deletion(request.requested_by if request is not None else "")
        self._inbox.append(Delete())

    def _note_deletion(self, requested_by: str) -> None:
        """Keep the first delete's who, when and what it stops, for the run's result (no
        command: replay is unaffected)."""
        if self.state.deletion is None:
            self.state = self.state.model_copy(update={"deletion": deletion(
                self.state.keeper, requested_by=requested_by, now=workflow.now())})

    @workflow.update(name=UPDATE_SCALE)
    async def scale(self, request: ScaleRequest) -> int:
        """Change the replica count; returns the new desired count."""
        self._inbox.append(Scale(replicas=request.replicas))
        return request.replicas

    @scale.validator
    def _validate_scale(self, request: ScaleRequest) -> None:
        if self.state.keeper.deleting:
            raise ApplicationError("deployment is being deleted; it cannot be scaled",
                                   type=ERROR_DELETING)

    # -- demand (modelkeeper.domain.demand) ----------------------------------------------

    @workflow.update(name=UPDATE_SET_POLICY)
    async def set_policy(self, request: SetPolicyRequest) -> int:
        """A new scaling policy; returns the replica count wanted under it."""
        await self._decide_now(PolicySet(policy=request.policy, actor=request.actor))
        return self.state.keeper.spec.replicas

    @set_policy.validator
    def _validate_set_policy(self, request: SetPolicyRequest) -> None:
        self._not_deleting()

    @workflow.update(name=UPDATE_SET_TENANCY)
    async def set_tenancy(self, request: SetTenancyRequest) -> None:
        """A new owner and/or class: what this deployment asks as from now on."""
        await self._decide_now(TenancySet(owner=request.owner,
                                          capacity_class=request.capacity_class))

    @set_tenancy.validator
    def _validate_set_tenancy(self, request: SetTenancyRequest) -> None:
        self._not_deleting()

    @workflow.update(name=UPDATE_SET_WINDOW)
    async def set_window(self, request: SetWindowRequest) -> int:
        """A schedule window opens or closes; returns the replica count wanted now."""
        await self._decide_now(WindowSet(window=request.window, closing=request.closing))
        return self.state.keeper.spec.replicas

    @set_window.validator
    def _validate_set_window(self, request: SetWindowRequest) -> None:
        self._not_deleting()

    @workflow.update(name=UPDATE_SLEEP)
    async def sleep(self, request: SleepRequest) -> None:
        """Put a ready replica (or each) to sleep."""
        await self._decide_now(SleepAsked(replica_id=request.replica_id, actor=request.actor))

    @sleep.validator
    def _validate_sleep(self, request: SleepRequest) -> None:
        self._not_deleting()
        keeper = self.state.keeper
        if not any(r.can_sleep for r in keeper.replicas
                   if request.replica_id in (None, r.replica_id)):
            raise ApplicationError(
                f"replica_id: {request.replica_id or 'any'} is not a replica of "
                f"{keeper.spec.deployment_id} whose engine can sleep (llama.cpp cannot: "
                "scale it down instead)", type=ERROR_MOVE_REFUSED, non_retryable=True)

    @workflow.update(name=UPDATE_WAKE)
    async def wake(self, request: WakeRequest) -> None:
        """Wake a sleeping replica (or each)."""
        await self._decide_now(WakeAsked(replica_id=request.replica_id, actor=request.actor))

    @wake.validator
    def _validate_wake(self, request: WakeRequest) -> None:
        self._not_deleting()

    @workflow.signal(name=SIGNAL_EVICT)
    def evict(self, request: EvictRequest) -> None:
        """Another deployment asked for this replica's room (it chose it as idle). The
        keeper checks it again (refuse_eviction): a replica used since, or a deployment no
        longer on demand, keeps it."""
        self._inbox.append(EvictAsked(replica_id=request.replica_id,
                                      for_deployment=request.for_deployment,
                                      reason=request.reason))

    @workflow.signal(name=SIGNAL_PREEMPT)
    def preempt(self, request: PreemptRequest) -> None:
        """Something that outranks this replica needs its room (another deployment's
        placement, or the memory watchdog): the keeper drains it with a short grace and
        keeps the count, waiting for room to return (refuse_preemption: a replica no
        longer ready, or leased to a saga, is kept)."""
        self._inbox.append(PreemptAsked(replica_id=request.replica_id, by=request.by,
                                        reason=request.reason))

    def _not_deleting(self) -> None:
        if self.state.keeper.deleting:
            raise ApplicationError(
                f"deployment {self.state.keeper.spec.deployment_id} is being deleted",
                type=ERROR_DELETING, non_retryable=True)

    # -- moves: what sagas ask for (modelkeeper.domain.moves) ---------------------------------

    @workflow.update(name=UPDATE_MOVE)
    async def move(self, request: MoveRequest) -> MoveOutcome:
        """Surge, replace or retire; answers the move as it stands once it is registered (a
        retried request is answered again and changes nothing)."""
        if move_outcome(self.state.keeper, request.move_id) is None:
            await self._decide_now(MoveAsked(request=request))
        return self._outcome(request.move_id)

    @move.validator
    def _validate_move(self, request: MoveRequest) -> None:
        reason = refuse_move(self.state.keeper, request, self.state.config)
        if reason is not None:
            raise ApplicationError(reason, type=ERROR_MOVE_REFUSED, non_retryable=True)

    @workflow.update(name=UPDATE_AWAIT_MOVE)
    async def await_move(self, request: AwaitMoveRequest) -> MoveOutcome:
        """A long poll: the move once it has ended, or as it stands after ``wait_s`` (or
        sooner, when the run is about to continue as new)."""
        def ended() -> bool:
            outcome = move_outcome(self.state.keeper, request.move_id)
            return outcome is None or outcome.state in MOVE_ENDED or self._continuing
        with contextlib.suppress(builtins.TimeoutError):
            await workflow.wait_condition(ended, timeout=request.wait_s)
        return self._outcome(request.move_id)

    @await_move.validator
    def _validate_await_move(self, request: AwaitMoveRequest) -> None:
        self._known_move(request.move_id)

    @workflow.update(name=UPDATE_CANCEL_MOVE)
    async def cancel_move(self, request: CancelMoveRequest) -> MoveOutcome:
        """The compensation: retire what the move surged, keep what it would have retired."""
        await self._decide_now(MoveCancelled(move_id=request.move_id))
        return self._outcome(request.move_id)

    @cancel_move.validator
    def _validate_cancel_move(self, request: CancelMoveRequest) -> None:
        self._known_move(request.move_id)

    @workflow.update(name=UPDATE_SET_GENERATION)
    async def set_generation(self, request: SetGenerationRequest) -> None:
        """New replicas run ``request.generation`` from now on."""
        await self._decide_now(GenerationSet(move_id=request.move_id,
                                             generation=request.generation))

    @set_generation.validator
    def _validate_set_generation(self, request: SetGenerationRequest) -> None:
        if self.state.keeper.deleting:
            raise ApplicationError(
                f"deployment {self.state.keeper.spec.deployment_id} is being deleted",
                type=ERROR_DELETING, non_retryable=True)

    @workflow.query(name=QUERY_BRIEF)
    def brief(self) -> DeploymentBrief:
        """The deployment as a saga sees it: generation, desired count, replicas."""
        return brief(self.state.keeper)

    async def _decide_now(self, observation: Observation) -> None:
        """Queue ``observation`` and wait until the loop has decided it."""
        self._inbox.append(observation)
        target = self._decided + len(self._inbox)
        await workflow.wait_condition(lambda: self._decided >= target)

    def _outcome(self, move_id: MoveId) -> MoveOutcome:
        outcome = move_outcome(self.state.keeper, move_id)
        if outcome is None:
            # Registered moves leave the registry only long after they end (MOVES_KEPT).
            raise ApplicationError(f"move_id: {move_id} is not a move of "
                                   f"{self.state.keeper.spec.deployment_id} (any more)",
                                   type=ERROR_MOVE_REFUSED, non_retryable=True)
        return outcome

    def _known_move(self, move_id: MoveId) -> None:
        if move_outcome(self.state.keeper, move_id) is None:
            known = ", ".join(move.move_id for move in self.state.keeper.moves) or "none"
            raise ApplicationError(
                f"move_id: {move_id} is not a move of {self.state.keeper.spec.deployment_id} "
                f"(known: {known})", type=ERROR_MOVE_REFUSED, non_retryable=True)

    @workflow.query(name=QUERY_STATUS)
    def status(self) -> WorkflowStatus:
        """The keeper's state and the status it implies."""
        return WorkflowStatus(status=status(self.state.keeper),
                              keeper=self.state.keeper)

    def settle(self) -> None:
        """Wake the loop to re-check (the writer calls it when it ends)."""
        self._settled = True

    # -- the loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, request: DeploymentInput) -> str:
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

        "Write what changed" is the background writer's (:class:`StoreWriter`):
        the loop only publishes the search attributes and goes on.
        """
        # Patch 1 of 0.3 (docs/keeper.md, "Patches and replay"): a deployment that fits
        # nowhere seeks room from what it outranks (find_eviction), where 0.2 only waited.
        # Patch 2: an engine that exits after ready is relaunched in place first, where
        # it was replaced at once. Each read once, before any command, in this order: a
        # run replaying an older history keeps its path to its end; its next run
        # (continue-as-new) takes the new one.
        preemption = workflow.patched(PATCH_PREEMPTION)
        relaunch = workflow.patched(PATCH_RELAUNCH)
        self.state = self.state.model_copy(update={"config": self.state.config.model_copy(
            update={"preemption": preemption, "relaunch": relaunch})})
        self._writer.start()
        for action in resume(self.state.keeper):
            self._launch(action)
        self._inbox.append(Tick())
        try:
            await self._loop()
        except asyncio.CancelledError:
            self._note_deletion("a workflow cancel")
            self._inbox.append(Delete())
            await self._loop()
            raise
        # Deleted: the result says by whom and what it stopped (the web UI shows it; the
        # completion command is the same as when it returned None, so replay holds).
        return deleted_result(self.state.keeper, self.state.deletion)

    async def _loop(self) -> None:
        """Until the deployment is deleted and nothing is in flight (or it continues as
        new)."""
        while True:
            await self._drain_inbox()
            self._follow_room_watch()
            self._follow_demand_watch()
            show_details(self.state)
            # The writer follows the state on its own; only these are set here.
            publish_search_attributes(self.state)
            state = self.state
            if state.keeper.finished and not self._busy and self._writer.idle():
                return
            info = workflow.info()
            waiting_for_writer = False
            if not self._busy and not state.keeper.finished and (
                    info.is_continue_as_new_suggested()
                    or info.get_current_history_length()
                    >= state.tunables.continue_as_new_after_events):
                self._continuing = True
                if not self._writer.idle():
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
                    for_writer and self._writer.idle())

            try:
                await workflow.wait_condition(woken, timeout=timeout)
            except builtins.TimeoutError:
                self._inbox.append(Tick())
            self._writer.raise_failure()
            # Cleared only after waking: a task may end while we write to the store, and
            # clearing before the wait would lose that wake-up.
            self._settled = False

    async def _drain_inbox(self) -> None:
        while self._inbox:
            observation = self._inbox.pop(0)
            before = self.state.keeper
            keeper, actions = decide(before, observation, workflow.now(),
                                     self.state.config, workflow.random().random())
            self.state = self.state.model_copy(update={"keeper": keeper})
            if keeper.demand_note != before.demand_note and keeper.demand_note:
                # Each demand step, with the load behind it, is an audit event (GET
                # /events), as well as the deployment's demand note.
                self._writer.record(NewEvent(
                    kind="deployment.demand", deployment_id=keeper.spec.deployment_id,
                    message=keeper.demand_note))
            self._decided += 1
            for action in actions:
                self._launch(action)

    async def _continue_as_new(self) -> None:
        # Watches and probes are re-opened by resume() in the next run.
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        state = self.state
        workflow.continue_as_new(DeploymentInput(
            spec=state.keeper.spec, tunables=state.tunables,
            search_attributes=state.search_attributes, carried=state))

    # -- the room watch: waiting for room outside the history ------------------------------

    def _follow_room_watch(self) -> None:
        """Start or cancel the room watch as the keeper's state says.

        Cancelled once the deployment no longer waits for room (placed, scaled down,
        deleted, parked) or an operator's retry reset the count; continue-as-new cancels
        it with every other task, and the next run starts it again from the carried count.
        A new one starts only while no placement is in flight (room_watch_start), so it
        starts from the count that placement's answer leaves.
        """
        keeper = self.state.keeper
        running = [t for t in self._tasks.get(ROOM_WATCH_TASK, []) if not t.done()]
        if running and not room_watch_goes_on(keeper, self._room_watch_from):
            for task in running:
                task.cancel()
            running = []
        if not running and (start := room_watch_start(keeper)) is not None:
            self._room_watch_from = start
            self._spawn(ROOM_WATCH_TASK, self._watch_for_room(start))

    async def _watch_for_room(self, unplaceable: int) -> None:
        """Run watch_for_room until it finds room, then retry at once, as on a node change.

        A watch that fails for good (the model left the catalog) retries at once too: the
        placement then fails and says why. Neither can spin: a watch answers only after
        its first wait, at least cant_place_retry_s.
        """
        with contextlib.suppress(ActivityError):
            found = await hops.watch_for_room(self.state.keeper.spec, unplaceable,
                                              config=self.state.config,
                                              tunables=self.state.tunables)
            workflow.logger.info("room for a replica on %s", ", ".join(found.nodes))
        self._inbox.append(NodesChanged())

    # -- the usage watch: following demand outside the history ----------------------------

    def _follow_demand_watch(self) -> None:
        """Run one usage watch on the keeper's current view while the deployment follows
        demand; a view that moved on gets a new watch (the old one's step would be
        dropped). Each restart costs a few history events, and the view moves only when
        a replica changes phase or the count changes: bounded per scaling step."""
        keeper = self.state.keeper
        running = [t for t in self._tasks.get(DEMAND_WATCH_TASK, []) if not t.done()]
        view = demand_view(keeper) if follows_demand(keeper) else None
        if running and view != self._demand_watch_view:
            for task in running:
                task.cancel()
            running = []
        if not running and view is not None:
            self._demand_watch_view = view
            self._spawn(DEMAND_WATCH_TASK, self._watch_demand(view))

    async def _watch_demand(self, view: DemandView) -> None:
        """Until a step is due on ``view``; then the keeper decides on it. A watch that
        fails for good is started again by the next pass of the loop."""
        try:
            found = await hops.watch_demand(view, self._demand_pressure,
                                            self.state.tunables)
        except ActivityError as exc:
            if not isinstance(exc.cause, CancelledError):  # cancelled: a new view came
                workflow.logger.warning("usage watch failed: %s", hops.describe(exc))
            self._demand_watch_view = None
            return
        workflow.logger.info("demand: %s", found.step.reason)
        self._demand_pressure = found.pressure
        self._inbox.append(DemandStepDue(view=found.view, step=found.step))

    # -- carrying out actions ------------------------------------------------------------

    def _launch(self, action: Action) -> None:
        match action:
            case PlaceReplica():
                self._spawn(action.replica_id, self._place(action.replica_id), busy=True)
            case StartReplica():
                self._spawn(action.replica_id, self._start(action.replica_id), busy=True)
            case RelaunchReplica():
                # The same start, on the shards it has (same nodes, same claim): its watch
                # ended with the exit, so nothing else runs for it.
                self._writer.record(NewEvent(
                    kind="replica.relaunched", deployment_id=self.state.keeper.spec.deployment_id,
                    replica_id=action.replica_id, message=action.reason,
                    data={"attempt": action.attempt, "tries": action.tries,
                          "window_s": action.window_s,
                          "nodes": [s.node_id for s in self._replica_nodes(action.replica_id)]}))
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
                self._spawn(action.replica_id,
                            self._stop(action.replica_id, drain=action.drain,
                                       grace_s=action.grace_s),
                            busy=True)
            case Finish():
                self._spawn("__finish__", self._finish(), busy=True)
            case SleepReplica():
                self._spawn(action.replica_id, self._sleep(action.replica_id), busy=True)
            case WakeReplica():
                self._spawn(action.replica_id, self._wake(action.replica_id), busy=True)
            case SeekRoom():
                self._spawn(SEEK_ROOM_TASK, self._seek_room(), busy=True)
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
        return self.state.shards.get(replica_id, [])

    async def _place(self, replica_id: ReplicaId) -> None:
        replica = next((r for r in self.state.keeper.replicas if r.replica_id == replica_id),
                       None)
        try:
            result = await hops.place(self.state.keeper.spec, replica_id, replica,
                                      self.state.tunables)
        except ActivityError as exc:
            await hops.release_crashed_placement(replica_id, exc)
            self._inbox.append(PlacementCrashed(replica_id=replica_id, error=hops.describe(exc)))
            return
        if result.cant_place is not None:
            self._inbox.append(Unplaceable(replica_id=replica_id, reason=result.cant_place))
            return
        shards = dict(self.state.shards)
        shards[replica_id] = result.shards
        self.state = self.state.model_copy(update={"shards": shards})
        self._inbox.append(Placed(replica_id=replica_id,
                                  nodes=[s.node_id for s in result.shards], note=result.note,
                                  can_sleep=all(can_sleep(s.engine) for s in result.shards)))

    async def _start(self, replica_id: ReplicaId) -> None:
        self._observe(*await hops.start(replica_id, self.state.keeper.spec.deployment_id,
                                        self._replica_nodes(replica_id), self.state.tunables))

    async def _watch(self, replica_id: ReplicaId) -> None:
        watched = await hops.watch(replica_id, self.state.keeper.spec.deployment_id,
                                   self._replica_nodes(replica_id), self.state.tunables)
        if watched is not None:
            self._observe(*watched)

    def _observe(self, observation: Observation, event: NewEvent | None) -> None:
        """Queue what an engine's start or watch came to, and its audit event if any."""
        if event is not None:
            self._writer.record(event)
        self._inbox.append(observation)

    async def _probe(self, replica_id: ReplicaId) -> None:
        running = await hops.runs(replica_id, self._replica_nodes(replica_id),
                                  self.state.tunables)
        self._inbox.append(ProbeResult(replica_id=replica_id, running=running))

    async def _stop(self, replica_id: ReplicaId, *, drain: bool = False,
                    grace_s: float | None = None) -> None:
        if drain:
            await hops.drain(replica_id, self.state.tunables, grace_s=grace_s)
        # The claim is released whether or not the nodes answered.
        await hops.stop_shards(replica_id, self._replica_nodes(replica_id), self.state.tunables)
        await hops.release(replica_id)
        shards = {k: v for k, v in self.state.shards.items() if k != replica_id}
        self.state = self.state.model_copy(update={"shards": shards})
        self._inbox.append(Stopped(replica_id=replica_id))

    async def _sleep(self, replica_id: ReplicaId) -> None:
        """Out of routing (drained), each engine asleep, the claims shrunk to what sleep
        keeps."""
        error = await hops.sleep(replica_id, self._replica_nodes(replica_id),
                                 self.state.tunables)
        self._inbox.append(Slept(replica_id=replica_id) if error is None
                           else SleepFailed(replica_id=replica_id, error=error))

    async def _wake(self, replica_id: ReplicaId) -> None:
        """The claims grown back if the room is still free, then each engine woken."""
        self._inbox.append(await hops.wake(replica_id, self._replica_nodes(replica_id),
                                           self.state.tunables))

    async def _seek_room(self) -> None:
        """Find what may be stopped so that a replica of ours fits (find_eviction, on the
        capacity rules), and ask each victim's deployment for it: an idle on-demand one
        is evicted (``evict``), one this deployment outranks is preempted (``preempt``),
        all of a preemption's set together (pruned by the rules: each is needed), its room
        held for us until we place. Signals, through no activity: a workflow may signal
        another, and a victim refuses what is no longer true of its replica."""
        keeper = self.state.keeper
        me = keeper.spec.deployment_id
        found = await hops.find_eviction(keeper.spec, keeper.next_replica_seq)
        choice = found.choice
        workflow.logger.info("eviction: %s", found.reason)
        evictions = [(t.deployment_id, EvictRequest(replica_id=t.replica_id,
                                                    for_deployment=me, reason=t.reason))
                     for t in found.also_evict]
        if choice is not None:
            evictions.append((choice.deployment_id, EvictRequest(
                replica_id=choice.replica_id, for_deployment=me, reason=found.reason)))
        for deployment_id, evict in evictions:
            await self._ask_victim(deployment_id, DeploymentWorkflow.evict, evict)
        for target in found.preempt:
            await self._ask_victim(target.deployment_id, DeploymentWorkflow.preempt,
                                   PreemptRequest(replica_id=target.replica_id, by=me,
                                                  reason=target.reason))
        # The reason becomes the demand note, and so an audit event (_drain_inbox).
        self._inbox.append(EvictionSought(
            victim=choice.replica_id if choice else None, reason=found.reason,
            retry_at=found.retry_at,
            preempting=[*(t.replica_id for t in found.preempt),
                        *(t.replica_id for t in found.also_evict)]))
        if found.fits_now:
            self._inbox.append(NodesChanged())

    async def _ask_victim(self, deployment_id: DeploymentId,
                          signal: Callable[[DeploymentWorkflow, _Victim], None],
                          request: _Victim) -> None:
        try:
            await workflow.get_external_workflow_handle(
                deployment_workflow_id(deployment_id)).signal(signal, request)
        except ApplicationError as exc:
            # The victim's deployment ended meanwhile: its room is freed anyway.
            workflow.logger.info("%s not delivered to %s: %s", signal.__name__,
                                 deployment_id, exc)

    async def _finish(self) -> None:
        # The deleting status (and any audit event) first; nothing after the delete.
        await self._writer.close()
        await hops.delete_deployment(self.state.keeper.spec.deployment_id)
        if self.state.search_attributes:
            workflow.upsert_search_attributes([STATUS_KEY.value_set(FINAL_STATUS)])


__all__ = ["DESIRED_KEY", "MODEL_ID_KEY", "NODES_KEY", "READY_KEY", "STATUS_KEY",
           "DeleteRequest", "DeploymentInput", "DeploymentWorkflow", "DeploymentWorkflowState",
           "WorkflowStatus"]
