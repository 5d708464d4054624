"""What the saga workflows share: the step record, the move helpers, and how a cancel lands.
(What only the sagas that move replicas onto a new generation share, restart and switch,
is in saga_moves.py.)

A saga (restart.py, drain.py, switch.py) never touches a replica. It asks the deployment's
workflow for moves (:mod:`modelkeeper.domain.moves`) through activities called by method, through
their stubs (:mod:`activities.saga_stubs`: the modules that run them hold the store and the
deployment workflow), so mypy checks every input and result; and it shows every step, each
compensation included, in its :class:`OperationRecord`.

**The record.** :class:`Saga` holds the record; each step is appended (running), then
ended (done or failed). A compensation is a step of its own, named ``undo: ...``, that
ends done or failed; the step it compensates becomes ``undone`` or ``undo_failed``. Every
change is shown at once in the web UI's current details and written to the store by one
background writer (``record_operation``), which writes whatever is current when its last
write ends. So writes never overtake each other, a slow database never delays the saga, and
:meth:`Saga.flush` waits for the last one before the saga ends.

**How a saga ends.** Its outcome is the record (the store's, which the API and the CLI
read), and the workflow's status follows it: succeeded, failed as designed (nothing
changed, or compensated) and rolled back complete with the record as their result
(:meth:`Saga.outcome`); cancelled ends cancelled; rollback_incomplete, a failed compensation
and an error the saga did not expect (a store activity failing for good, another saga on
its subject) fail the workflow, since someone must look.

**Cancels.** Temporal delivers a workflow cancel once, to the main task, at whatever it
awaits. Two kinds of await must not be cut short:

* asking for something (a move, a cordon, the commit): cut short, the request may land or
  not, and the compensation could not know what to undo. These run :meth:`Saga.atomic`: to
  their end, and the cancel takes effect right after;
* the compensation itself: a rollback left half-way is worse than either end. It runs
  :meth:`Saga.uninterrupted`, and a cancel during it changes nothing.

Waiting (await_move's long poll, a timer, a describe) is cut short at once: it only reads.
A cancelled activity surfaces in the workflow as an ``ActivityError`` whose cause is a
cancel; :meth:`Saga.call` turns it into ``asyncio.CancelledError``, which each saga catches
in ``run``.

Deterministic: no I/O, no clock but ``workflow.now()``, tasks only through
``asyncio.create_task`` inside the workflow's own loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    TimeoutError,
    TimeoutType,
    is_cancelled_exception,
)

with workflow.unsafe.imports_passed_through():
    from activities.saga_stubs import MoveActivityStubs, OperationsActivityStubs
    from modelkeeper.domain.catalog import Generation
    from modelkeeper.domain.ids import DeploymentId, MoveId, NodeId, OperationId
    from modelkeeper.domain.moves import (
        MOVE_ENDED,
        AwaitMoveCall,
        AwaitMoveRequest,
        CancelMoveCall,
        CancelMoveRequest,
        DeploymentBrief,
        DescribeDeploymentInput,
        MoveCall,
        MoveOutcome,
        MoveRequest,
        MoveState,
        SetGenerationCall,
        SetGenerationRequest,
    )
    from modelkeeper.domain.operations import (
        OperationKind,
        OperationRecord,
        OperationState,
        OperationStep,
        StepState,
    )
    from modelkeeper.names import (
        CONTROL_TASK_QUEUE,
        ERROR_MOVE_REFUSED,
        ERROR_NO_DEPLOYMENT,
        ERROR_OPERATION_CONFLICT,
        ERROR_OPERATION_FAILED,
        PATCH_SAGA_OUTCOME,
    )

_T = TypeVar("_T")
_A = TypeVar("_A")

# Timeouts and retry policies of the sagas' activities, each named once beside its reason.

#: Store activities (begin_operation, record_operation, set_cordon, node_deployments) are
#: one short transaction each: 30 s covers a slow database without hiding a dead one.
STORE_TIMEOUT = timedelta(seconds=30)
#: ... retried quickly and for as long as it takes: a database restart must delay a saga,
#: not fail it half-way with nobody to compensate.
STORE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                          maximum_interval=timedelta(seconds=10))
#: begin_operation and record_operation likewise, except that another saga running on the
#: same deployment or node (OperationConflict) stays so: the saga fails at once, naming it.
OPERATION_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                          maximum_interval=timedelta(seconds=10),
                          non_retryable_error_types=[ERROR_OPERATION_CONFLICT])
#: request_move, cancel_move, set_generation and describe_deployment are one update or query
#: each, answered as soon as the deployment's worker runs a workflow task (milliseconds);
#: 30 s also covers a worker's backlog after a restart.
UPDATE_TIMEOUT = timedelta(seconds=30)
#: ... retried like the store: move ids make every update idempotent, so asking again after
#: a lost answer is safe. A refusal or a deployment that is gone is the deployment's
#: answer, not a fault: those are not retried.
UPDATE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                           maximum_interval=timedelta(seconds=10),
                           non_retryable_error_types=[ERROR_MOVE_REFUSED, ERROR_NO_DEPLOYMENT])
#: One await_move poll: the activity asks the deployment to answer within this (its
#: AwaitMoveRequest.wait_s); long enough that polling costs the deployment's history little.
AWAIT_POLL = timedelta(seconds=20)
#: The activity heartbeats every 2 s, during polls too (activities/moves.py): 10 s without
#: one means its worker is gone, and another worker retries the poll. Measured with a
#: kill -9 of the control worker mid-restart (bench/sagas): a 60 s timeout here held the
#: restart up for a minute after the worker came back.
AWAIT_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
#: A move ends by the deployment's own deadlines (placement's schedule-to-close, the start
#: timeout, the stop grace), and a start queued at a node's start-up gate waits its turn
#: on top: minutes, not hours. A day is only a backstop; the heartbeat notices a dead
#: worker, and an operator can cancel the saga at any time.
AWAIT_LIFETIME = timedelta(days=1)

#: A move that failed for want of room says so first (MoveOutcome.error): the sagas then try
#: a stop-first replace, or wait for room.
NO_ROOM = "no room"
#: The web UI's current details list at most this many steps (the newest): a drain of a
#: large node has hundreds, and the store's record keeps them all.
DETAILS_STEPS = 20

_STEP_MARKS = {StepState.RUNNING: "running", StepState.DONE: "done",
               StepState.FAILED: "failed", StepState.UNDONE: "undone",
               StepState.UNDO_FAILED: "undo failed"}


@dataclass
class AskedMove:
    """A move a saga asked for, and what it last heard of it."""

    deployment_id: DeploymentId
    request: MoveRequest
    #: Its step in the record.
    step: int
    #: As last heard (the request's answer, then await_move's).
    outcome: MoveOutcome | None = None
    #: The request was refused (or the deployment is gone): nothing started, nothing to
    #: undo.
    refused: str | None = None
    #: ... and the refusal's error type (ERROR_MOVE_REFUSED, ERROR_NO_DEPLOYMENT, ...).
    refused_type: str | None = None
    #: How await_move failed, if it did: the move's end is unknown.
    lost: str | None = None

    @property
    def ended(self) -> bool:
        return (self.refused is not None or self.lost is not None or (
            self.outcome is not None and self.outcome.state in MOVE_ENDED))

    @property
    def succeeded(self) -> bool:
        return self.outcome is not None and self.outcome.state is MoveState.SUCCEEDED \
            and self.lost is None

    @property
    def no_room(self) -> bool:
        """It failed because the new replica found no room (a stop-first may fit)."""
        return (self.outcome is not None and self.outcome.state is MoveState.FAILED
                and (self.outcome.error or "").lower().startswith(NO_ROOM))

    @property
    def error(self) -> str:
        """Why it did not succeed, in the deployment's words."""
        if self.refused is not None:
            return self.refused
        if self.lost is not None:
            return self.lost
        if self.outcome is None:
            return "no answer"
        return self.outcome.error or f"move {self.outcome.state.value}"


@dataclass(frozen=True)
class UndoFailed:
    """A compensation that could not be carried out, and why."""

    reason: str


class Saga:
    """One saga's record, its moves and how a cancel lands (the module docstring says why).

    Built in the workflow's ``@workflow.init``, so handlers (the ``operation`` query) never
    see it half-built; its writer starts with :meth:`begin`.
    """

    def __init__(self, record: OperationRecord, *, title: str) -> None:
        self.record = record
        #: The first line of the web UI's current details (markdown).
        self.title = title
        self.moves: list[AskedMove] = []
        self._version = 0  # changes made to the record
        self._written = 0  # changes the store has
        self._writer: asyncio.Task[None] | None = None
        self._show()

    # -- the record -----------------------------------------------------------------------

    def step(self, name: str, detail: str = "") -> int:
        """Append a running step; returns its index."""
        now = workflow.now()
        steps = [*self.record.steps, OperationStep(name=name, state=StepState.RUNNING,
                                                   detail=detail, started_at=now)]
        self._change(steps=steps)
        return len(steps) - 1

    def done(self, index: int | None) -> bool:
        """Whether the step at ``index`` (None: not asked for yet) has ended done."""
        return index is not None and self.record.steps[index].state is StepState.DONE

    def end_step(self, index: int, state: StepState, detail: str | None = None) -> None:
        """End a step (done or failed), or mark one compensated (undone, undo_failed)."""
        step = self.record.steps[index]
        changes: dict[str, Any] = {"state": state}
        if detail is not None:
            changes["detail"] = detail
        if step.ended_at is None:
            changes["ended_at"] = workflow.now()
        steps = list(self.record.steps)
        steps[index] = step.model_copy(update=changes)
        self._change(steps=steps)

    def update(self, **changes: Any) -> None:
        """Change the record's own fields (state, summary, error)."""
        self._change(**changes)

    def _change(self, **changes: Any) -> None:
        self.record = self.record.model_copy(update={**changes, "updated_at": workflow.now()})
        self._version += 1
        self._show()

    def _show(self) -> None:
        """The web UI's current details (no command: replay is unaffected)."""
        text = details(self.record, title=self.title)
        if text != workflow.get_current_details():
            workflow.set_current_details(text)

    async def _write(self) -> None:
        while True:
            await workflow.wait_condition(lambda: self._written < self._version)
            version, record = self._version, self.record
            await workflow.execute_activity_method(
                OperationsActivityStubs.record_operation, record, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=STORE_TIMEOUT, retry_policy=OPERATION_RETRY)
            self._written = version

    async def flush(self) -> None:
        """Wait until the store has the record as it is now."""
        if self._writer is None:
            return
        writer = self._writer
        await workflow.wait_condition(lambda: self._written >= self._version or writer.done())
        self.check_writer()

    def check_writer(self) -> None:
        """Raise what the writer failed with, if it did: only a conflict can (another saga
        took the subject after the API judged this one's start failed), and then this saga
        must ask for nothing more. Checked before every move and at the end."""
        writer = self._writer
        if writer is None or not writer.done():
            return
        err = writer.exception()
        conflict = _conflict(err) if isinstance(err, ActivityError) else None
        if conflict is not None:
            raise conflict from err
        writer.result()

    # -- beginning and ending --------------------------------------------------------------

    async def begin(self) -> None:
        """Register the operation (begin_operation), then start writing the record.

        Another saga on the same deployment or node is a non-retryable OperationConflict:
        the saga fails with the store's message, which names the running one."""
        try:
            stored: OperationRecord | None = await self.atomic(self.call(
                OperationsActivityStubs.begin_operation, self.record,
                retry_policy=OPERATION_RETRY))
        except ActivityError as err:
            conflict = _conflict(err)
            if conflict is not None:
                raise conflict from err
            raise
        else:
            if stored is not None and stored.created_at is not None:
                # The API inserted the row when it was asked: that is when it began.
                self.record = self.record.model_copy(update={"created_at": stored.created_at})
        finally:
            if self._writer is None:
                # Also after a cancel during the begin: the record must say cancelled.
                self._writer = asyncio.create_task(self._write())

    async def finish(self, state: OperationState, *, error: str | None = None,
                     summary: str | None = None) -> OperationRecord:
        """Record how the saga ended and wait until the store has it."""
        for index, step in enumerate(self.record.steps):
            if step.state is StepState.RUNNING:
                # Cut short by a cancel (a wait, a read): it neither did nor undid anything.
                cut = f"cut short: {state.value}"
                self.end_step(index, StepState.FAILED,
                              f"{step.detail}; {cut}" if step.detail else cut)
        changes: dict[str, Any] = {"state": state, "error": error}
        if summary is not None:
            changes["summary"] = summary
        self.update(**changes)
        await self.uninterrupted(self.flush())
        return self.record

    def needs_repair(self) -> bool:
        """Whether the saga left something half-done for an operator to repair: the
        rollback was incomplete, or a compensation failed."""
        return (self.record.state is OperationState.ROLLBACK_INCOMPLETE
                or any(s.state is StepState.UNDO_FAILED for s in self.record.steps))

    def outcome(self) -> OperationRecord:
        """How the workflow ends once :meth:`finish` recorded a failed (or rolled back)
        state that the saga handled as designed: it completes with the record as its
        result, so the web UI shows the outcome, not a failure with a Python stack trace.
        Raises :meth:`failure` when the saga needs repair (:meth:`needs_repair`), and in
        a run begun before PATCH_SAGA_OUTCOME, where every failed state failed the
        workflow. The store's record says failed or rolled back either way: the API, the
        CLI and ``--wait`` read that, never the workflow's status.

        The patch is read only here, where the completion command differs (complete, not
        fail); the condition before it reads only the record, so it is deterministic."""
        if not self.needs_repair() and workflow.patched(PATCH_SAGA_OUTCOME):
            return self.record
        raise self.failure()

    def failure(self) -> ApplicationError:
        """What the workflow fails with once :meth:`finish` recorded a failed state that
        needs repair, or an error the saga did not expect."""
        return ApplicationError(self.record.error or self.record.state.value,
                                self.record.model_dump(mode="json"),
                                type=ERROR_OPERATION_FAILED, non_retryable=True)

    # -- how a cancel lands -----------------------------------------------------------------

    async def atomic(self, awaitable: Awaitable[_T]) -> _T:
        """Run to the end even if the saga is cancelled meanwhile; the cancel then takes
        effect right after (asyncio.CancelledError), once the caller knows what happened.
        For requests: cut short, one might land or not, unknown to the compensation."""
        task = asyncio.ensure_future(awaitable)
        cancelled = await _wait_out(task)
        if cancelled:
            if not task.cancelled() and task.exception() is not None:
                raise asyncio.CancelledError() from task.exception()
            raise asyncio.CancelledError()
        return task.result()

    async def uninterrupted(self, awaitable: Awaitable[_T]) -> _T:
        """Run to the end; a cancel meanwhile changes nothing. For the compensation: a
        rollback left half-way is worse than either end."""
        task = asyncio.ensure_future(awaitable)
        await _wait_out(task)
        return task.result()

    # -- activities and moves ----------------------------------------------------------------

    async def call(self, activity: Callable[[Any, _A], Awaitable[_T]], arg: _A, *,
                   start_to_close: timedelta = STORE_TIMEOUT,
                   retry_policy: RetryPolicy = STORE_RETRY,
                   heartbeat_timeout: timedelta | None = None) -> _T:
        """One activity on the control queue, by method (a stub's: activities.saga_stubs).
        A cancel of the saga that cancelled it is raised as asyncio.CancelledError (see
        the module docstring)."""
        try:
            return await workflow.execute_activity_method(
                activity, arg, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=start_to_close, retry_policy=retry_policy,
                heartbeat_timeout=heartbeat_timeout)
        except ActivityError as err:
            if is_cancelled_exception(err):
                raise asyncio.CancelledError() from err
            raise

    def move_id(self, step: str) -> MoveId:
        """The move id of one of this saga's steps: its workflow id and the step."""
        return MoveId(f"{self.record.operation_id}:{step}")

    async def describe(self, deployment_id: DeploymentId) -> DeploymentBrief:
        """The deployment as it stands (describe_deployment)."""
        return await self.call(
            MoveActivityStubs.describe_deployment,
            DescribeDeploymentInput(deployment_id=deployment_id),
            start_to_close=UPDATE_TIMEOUT, retry_policy=UPDATE_RETRY)

    async def move(self, deployment_id: DeploymentId, request: MoveRequest, *,
                 name: str) -> AskedMove:
        """Ask for a move as a step called ``name`` and wait until it has ended.

        The request is atomic; the wait is not: a cancel during it leaves the move running
        (not ended), for the compensation to cancel. The step ends done when the move
        succeeded, else failed with its error."""
        self.check_writer()
        step = self.step(name)
        move = AskedMove(deployment_id=deployment_id, request=request, step=step)
        self.moves.append(move)
        await self.atomic(self._request(move))
        if move.refused is not None:
            self.end_step(step, StepState.FAILED, f"refused: {move.refused}")
            return move
        if not move.ended:
            move.outcome = await self._await(move)
        self.end_step(step, StepState.DONE if move.succeeded else StepState.FAILED,
                      describe_outcome(move))
        return move

    async def _request(self, move: AskedMove) -> None:
        try:
            move.outcome = await self.call(
                MoveActivityStubs.request_move, MoveCall(deployment_id=move.deployment_id,
                                                    request=move.request),
                start_to_close=UPDATE_TIMEOUT, retry_policy=UPDATE_RETRY)
        except ActivityError as err:
            move.refused = describe_failure(err)
            if isinstance(err.cause, ApplicationError):
                move.refused_type = err.cause.type

    async def _await(self, move: AskedMove) -> MoveOutcome | None:
        """Until the move ends (await_move long-polls and heartbeats). Failing that (the
        deployment gone meanwhile), the move is marked lost: its end is unknown."""
        try:
            outcome = await self.call(
                MoveActivityStubs.await_move, AwaitMoveCall(
                    deployment_id=move.deployment_id,
                    request=AwaitMoveRequest(move_id=move.request.move_id,
                                           wait_s=AWAIT_POLL.total_seconds())),
                start_to_close=AWAIT_LIFETIME, retry_policy=UPDATE_RETRY,
                heartbeat_timeout=AWAIT_HEARTBEAT_TIMEOUT)
        except ActivityError as err:
            move.lost = f"its outcome is unknown: {describe_failure(err)}"
            return move.outcome
        return outcome

    def open_moves(self) -> list[AskedMove]:
        """Moves asked for and not known to have ended, oldest first."""
        return [move for move in self.moves if not move.ended]

    async def cancel(self, move: AskedMove) -> MoveOutcome | UndoFailed:
        """The compensation of ``move`` (cancel_move) as a step ``undo: cancel <its step>``,
        waiting until the cancel has ended. The move's own step becomes undone (or
        undo_failed).

        Answers the move as it stands after the cancel: ``succeeded`` when it had already
        succeeded (nothing to undo by a cancel; a switch then replaces it back)."""
        step = self.step(f"undo: cancel {self.record.steps[move.step].name}")
        try:
            outcome = await self.call(
                MoveActivityStubs.cancel_move,
                CancelMoveCall(deployment_id=move.deployment_id,
                             request=CancelMoveRequest(move_id=move.request.move_id)),
                start_to_close=UPDATE_TIMEOUT, retry_policy=UPDATE_RETRY)
        except ActivityError as err:
            reason = describe_failure(err)
            self.end_step(step, StepState.FAILED, reason)
            self.end_step(move.step, StepState.UNDO_FAILED)
            return UndoFailed(reason=reason)
        if outcome.state not in MOVE_ENDED:
            cancelled = AskedMove(deployment_id=move.deployment_id, request=move.request, step=step,
                           outcome=outcome)
            awaited = await self._await(cancelled)
            if cancelled.lost is not None or awaited is None:
                reason = cancelled.lost or "no answer"
                self.end_step(step, StepState.FAILED, reason)
                self.end_step(move.step, StepState.UNDO_FAILED)
                return UndoFailed(reason=reason)
            outcome = awaited
        move.outcome = outcome
        move.lost = None
        if outcome.state is MoveState.SUCCEEDED:
            self.end_step(step, StepState.DONE,
                          f"too late to cancel: it had succeeded; {outcome.detail}".rstrip("; "))
            return outcome
        self.end_step(step, StepState.DONE, outcome.detail or (
            "cancelled: what it placed is retired, what it would have retired is kept"
            if outcome.state is MoveState.CANCELLED
            else f"it had {outcome.state.value}: what it placed is retired"))
        self.end_step(move.step, StepState.UNDONE)
        return outcome

    async def set_generation(self, deployment_id: DeploymentId, generation: Generation, *,
                             step: int) -> str | None:
        """set_generation as the step ``step`` (already appended, so a caller can tell
        after a cancel whether it was done). Atomic: a commit cut short might land or not.
        Returns why it failed, or None."""
        self.check_writer()
        call = SetGenerationCall(deployment_id=deployment_id, request=SetGenerationRequest(
            move_id=self.move_id(f"generation-{generation.number}"), generation=generation))
        return await self.atomic(self._set_generation(call, step))

    async def _set_generation(self, call: SetGenerationCall, step: int) -> str | None:
        try:
            await self.call(MoveActivityStubs.set_generation, call,
                            start_to_close=UPDATE_TIMEOUT, retry_policy=UPDATE_RETRY)
        except ActivityError as err:
            error = describe_failure(err)
            self.end_step(step, StepState.FAILED, error)
            return error
        self.end_step(step, StepState.DONE, f"the deployment runs generation "
                                            f"{call.request.generation.number} from now on")
        return None


def new_record(kind: OperationKind, *, summary: str, requested_by: str,
               deployment_id: DeploymentId | None = None,
               node_id: NodeId | None = None) -> OperationRecord:
    """A saga's record as it begins: its id is its workflow id (``restart/d1/3``)."""
    now = workflow.now()
    return OperationRecord(operation_id=OperationId(workflow.info().workflow_id), kind=kind,
                           deployment_id=deployment_id, node_id=node_id, summary=summary,
                           requested_by=requested_by, created_at=now, updated_at=now)


# -- text ----------------------------------------------------------------------------------

def details(record: OperationRecord, *, title: str) -> str:
    """The web UI's current details: what the saga is for, how it stands, its steps."""
    lines = [title, "", f"State: **{record.state.value}**"]
    if record.summary:
        lines.append(record.summary)
    if record.error:
        lines.append(f"Error: {record.error}")
    steps = record.steps
    if steps:
        lines.append("")
        if len(steps) > DETAILS_STEPS:
            lines.append(f"({len(steps) - DETAILS_STEPS} earlier steps)")
        for step in steps[-DETAILS_STEPS:]:
            line = f"- {_STEP_MARKS[step.state]}: {step.name}"
            lines.append(f"{line}: {step.detail}" if step.detail else line)
    return "\n".join(lines)


def describe_outcome(move: AskedMove) -> str:
    """A step's detail for a move: what happened, in the deployment's words."""
    outcome = move.outcome
    if move.lost is not None:
        return move.lost
    if outcome is None:
        return move.error
    parts = []
    if outcome.surged and outcome.state is MoveState.SUCCEEDED:
        parts.append(f"{outcome.surged} ready")
    if outcome.retired and outcome.state is MoveState.SUCCEEDED:
        parts.append(f"{outcome.retired} retired")
    if outcome.state is not MoveState.SUCCEEDED:
        parts.append(f"{outcome.state.value}: {move.error}")
    if outcome.detail:
        parts.append(outcome.detail)
    return "; ".join(parts)


async def _wait_out(task: asyncio.Future[Any]) -> bool:
    """Wait for ``task``; a cancel of the waiting task does not reach it (workflow.wait
    never cancels what it waits for). Returns whether a cancel came meanwhile."""
    cancelled = False
    while not task.done():
        try:
            await workflow.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


def _conflict(err: ActivityError) -> ApplicationError | None:
    """The store's OperationConflict (another saga runs on this subject) as the saga's own
    failure, with the store's message, which names the other saga; None for another
    error."""
    cause = err.cause
    if isinstance(cause, ApplicationError) and cause.type == ERROR_OPERATION_CONFLICT:
        return ApplicationError(cause.message, type=ERROR_OPERATION_CONFLICT,
                                non_retryable=True)
    return None


def describe_failure(err: ActivityError) -> str:
    """The innermost message of an activity failure, for a step's detail."""
    cause = err.cause
    if isinstance(cause, TimeoutError):
        kind = {TimeoutType.HEARTBEAT: "its worker went silent",
                TimeoutType.SCHEDULE_TO_START: "no worker picked it up in time"}.get(
                    cause.type or TimeoutType.START_TO_CLOSE, "it took too long")
        return f"{err.activity_type} timed out: {kind}"
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause or err)
