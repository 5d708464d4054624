"""RestartSaga: a rolling restart, one replica at a time, without an outage where room
allows.

Steps, each visible in the OperationRecord (workflows/saga.py says how they are shown):

1. ``begin_operation``: one saga per deployment; a second fails at once, naming the first.
2. The deployment's generation, and the next one (the same model and arguments, number + 1).
3. For each replica, ready ones first: a ``replace`` on the next generation (the new copy
   beside the old, the old retired once the new serves). No room for a second copy: the
   replica is restarted in place (a stop-first replace), and its outage window is stated in
   the step and the summary.
4. ``set_generation``: the deployment runs the next generation from now on.

A replace that fails for any other reason is compensated by ``cancel_move`` (the new copy is
retired, the old one keeps serving), and the restart ends failed with the reason: its
workflow completes with that record (saga.py, "How a saga ends"), unless the compensation
failed. Replicas
already restarted stay as they are: the same model and arguments. A cancel cancels the move
in flight the same way and ends the saga cancelled.

Workflow ids come from the starter: ``restart/<deployment>/<n>``
(:func:`modelkeeper.names.operation_workflow_id`). Patched since it was new:
PATCH_SAGA_OUTCOME (saga.py, "How a saga ends"). Any change to the order of its commands
goes behind ``workflow.patched`` (tests/histories/saga_restart_*.json replay it).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.catalog import Generation
    from modelkeeper.domain.ids import ReplicaId
    from modelkeeper.domain.moves import MoveKind, MoveRequest
    from modelkeeper.domain.operations import (
        OperationKind,
        OperationRecord,
        OperationState,
        RestartInput,
        StepState,
    )
    from modelkeeper.names import QUERY_OPERATION, WORKFLOW_RESTART

# Not passed through: the sandbox re-imports it with each workflow, and checks it.
from .saga import Saga, UndoFailed, describe_failure, describe_outcome, new_record
from .saga_moves import next_replica, outage


def static_summary(request: RestartInput) -> str:
    """What the web UI's list of runs shows for a restart (the starter's static_summary)."""
    return f"Rolling restart of deployment {request.deployment_id}, one replica at a time"


@workflow.defn(name=WORKFLOW_RESTART)
class RestartSaga:
    """Restarts every replica of one deployment, one at a time."""

    @workflow.init
    def __init__(self, request: RestartInput) -> None:
        # Built here, not in run: the query may be answered before run's first line.
        self._input = request
        self._saga = Saga(
            new_record(OperationKind.RESTART, deployment_id=request.deployment_id,
                       summary=static_summary(request), requested_by=request.requested_by),
            title=f"**Restart** of deployment `{request.deployment_id}`")
        self._restarted: list[ReplicaId] = []
        self._outages: list[str] = []
        #: The set_generation step, once asked for: done means the restart has happened.
        self._commit: int | None = None

    @workflow.query(name=QUERY_OPERATION)
    def operation(self) -> OperationRecord:
        """The saga's record: its steps and how it stands."""
        return self._saga.record

    @workflow.run
    async def run(self, request: RestartInput) -> OperationRecord:
        """Restart each replica, then set the generation; see the module docstring.
        ``request`` is the one ``__init__`` kept."""
        saga = self._saga
        try:
            await saga.begin()
            error = await self._restart()
        except asyncio.CancelledError:
            if saga.done(self._commit):
                # Too late to cancel: every replica is restarted and the generation set.
                return await saga.finish(OperationState.SUCCEEDED,
                                         summary=self._summary("done"))
            failed = [f"{r.reason}" for r in await saga.uninterrupted(self._cancel_open_moves())]
            await saga.finish(
                OperationState.CANCELLED, summary=self._summary("cancelled"),
                error=f"could not undo: {'; '.join(failed)}" if failed else None)
            raise
        except ActivityError as err:
            # An activity that is not a move failed for good (the deployment is gone).
            error = describe_failure(err)
        if error is not None:
            await saga.finish(OperationState.FAILED, error=error,
                              summary=self._summary("failed"))
            return saga.outcome()
        return await saga.finish(OperationState.SUCCEEDED, summary=self._summary("done"))

    async def _restart(self) -> str | None:
        """The forward steps; returns why the restart failed, or None."""
        saga = self._saga
        deployment_id = self._input.deployment_id
        brief = await saga.describe(deployment_id)
        if brief.deleting:
            return f"deployment {deployment_id!r} is being deleted"
        current = brief.generation
        new = current.model_copy(update={"number": current.number + 1})
        saga.title = (f"**Restart** of deployment `{deployment_id}` (model "
                      f"`{current.model_id}`): generation {current.number} → {new.number}")
        saga.update(summary=self._summary("running"))
        tried: set[ReplicaId] = set()
        while (replica := next_replica(brief, new, tried=tried)) is not None:
            tried.add(replica.replica_id)
            error = await self._restart_one(replica.replica_id, new)
            if error is not None:
                return error
            self._restarted.append(replica.replica_id)
            saga.update(summary=self._summary("running"))
            brief = await saga.describe(deployment_id)
        self._commit = saga.step(f"set generation {new.number}")
        return await saga.set_generation(deployment_id, new, step=self._commit)

    async def _restart_one(self, replica_id: ReplicaId, new: Generation) -> str | None:
        """Replace one replica beside itself, or in place when there is no room for a
        second copy; compensate a failure. Returns why it failed, or None."""
        saga = self._saga
        deployment_id = self._input.deployment_id
        reason = saga.record.operation_id
        move = await saga.move(deployment_id, MoveRequest(
            move_id=saga.move_id(f"replace-{replica_id}"), kind=MoveKind.REPLACE,
            replica_id=replica_id, generation=new, reason=reason),
            name=f"replace {replica_id}")
        if move.no_room:
            move = await saga.move(deployment_id, MoveRequest(
                move_id=saga.move_id(f"replace-{replica_id}:stop-first"), kind=MoveKind.REPLACE,
                replica_id=replica_id, generation=new, stop_first=True, reason=reason),
                name=f"replace {replica_id} in place (no room for a second copy)")
            if move.succeeded:
                window = outage(move.outcome)
                self._outages.append(f"{replica_id} restarted in place, {window}")
                saga.end_step(move.step, StepState.DONE, f"{describe_outcome(move)}; {window}")
        if move.succeeded:
            return None
        error = f"replacing {replica_id} failed: {move.error}"
        if move.refused is None:
            # The compensation: the new copy is retired, the old one keeps serving.
            undone = await saga.uninterrupted(saga.cancel(move))
            if isinstance(undone, UndoFailed):
                error += f"; could not undo: {undone.reason}"
        return error

    async def _cancel_open_moves(self) -> list[UndoFailed]:
        failed = []
        for move in self._saga.open_moves():
            undone = await self._saga.cancel(move)
            if isinstance(undone, UndoFailed):
                failed.append(undone)
        return failed

    def _summary(self, how: str) -> str:
        done = f"{len(self._restarted)} replica(s) restarted"
        if self._restarted:
            done += f" ({', '.join(self._restarted)})"
        text = f"Restart of {self._input.deployment_id} {how}: {done}"
        if self._outages:
            text += "; " + "; ".join(self._outages)
        return text
