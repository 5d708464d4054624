"""SwitchSaga: move a deployment to another model (switch) or other engine arguments
(reconfigure), replica by replica, with rollback.

Steps, each visible in the OperationRecord (workflows/saga.py says how they are shown):

1. ``begin_operation``: one saga per deployment; a second fails at once, naming the first.
2. The deployment's generation A, and B: number + 1, the model asked for (or A's), the
   engine arguments asked for (or A's).
3. For each replica, ready ones first: a ``replace`` on B (B starts beside A; A is retired
   once B serves). No room for both: a stop-first replace (A stops, then B starts), whose
   outage window is stated in the step.
4. The commit, once every replica runs B: ``set_generation(B)``. After it, a cancel is too
   late: the switch has happened.

**Rollback.** A move that fails for any reason but room (B crashes at start, say), a move
refused, or a cancel before the commit, undoes every step in reverse order, each a visible
step:

* ``cancel_move`` of the move that failed (or was in flight): B is retired, A kept;
* if that move had already retired its A (a stop-first), A comes back: the deployment
  places one on its current generation (A) itself when the held slot is freed, and the
  step says so; should it be short of its desired count, one replica on A is surged;
* each replace already completed is replaced back: its B by a replica on A.

The deployment's generation is A throughout (it changes only at the commit), so nothing
else needs restoring. The saga ends ``rolled_back`` with ``<B> failed: <why>``
(``cancelled`` after a cancel), or ``rollback_incomplete`` naming each part that could not
be restored. A cancel during the rollback does not interrupt it.

Workflow ids come from the starter: ``switch/<deployment>/<n>`` or
``reconfigure/<deployment>/<n>``. Patched since it was new: PATCH_SAGA_OUTCOME (saga.py,
"How a saga ends": rolled back completes, rollback_incomplete fails). Any change to the
order of its commands goes behind ``workflow.patched`` (tests/histories/saga_switch_*.json
replay it).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.catalog import Generation
    from modelkeeper.domain.ids import ReplicaId
    from modelkeeper.domain.moves import MoveKind, MoveRequest, MoveState
    from modelkeeper.domain.operations import (
        OperationKind,
        OperationRecord,
        OperationState,
        StepState,
        SwitchInput,
    )
    from modelkeeper.names import QUERY_OPERATION, WORKFLOW_SWITCH

# Not passed through: the sandbox re-imports it with each workflow, and checks it.
from .saga import AskedMove, Saga, UndoFailed, describe_failure, describe_outcome, new_record
from .saga_moves import STOPPING, generation_label, lives, next_replica, outage


def operation_kind(request: SwitchInput) -> OperationKind:
    """A switch names a model; a reconfigure only engine arguments."""
    return OperationKind.SWITCH if request.model_id is not None else OperationKind.RECONFIGURE


def static_summary(request: SwitchInput) -> str:
    """What the web UI's list of runs shows (the starter's static_summary)."""
    if request.model_id is not None:
        return (f"Switch of deployment {request.deployment_id} to model {request.model_id}, "
                f"replica by replica, with rollback")
    args = ", ".join(f"{k}={v}" for k, v in sorted((request.engine_args or {}).items()))
    return (f"Reconfigure of deployment {request.deployment_id} ({args}), replica by "
            f"replica, with rollback")


@workflow.defn(name=WORKFLOW_SWITCH)
class SwitchSaga:
    """Moves every replica of one deployment onto a new generation, or back."""

    @workflow.init
    def __init__(self, request: SwitchInput) -> None:
        # Built here, not in run: the query may be answered before run's first line.
        self._input = request
        kind = operation_kind(request)
        self._saga = Saga(
            new_record(kind, deployment_id=request.deployment_id,
                       summary=static_summary(request), requested_by=request.requested_by),
            title=f"**{kind.value.capitalize()}** of deployment `{request.deployment_id}`")
        #: A and B: known once the deployment has been described, before the first move.
        #: Until then there is nothing to roll back, and no label but the input's.
        self._old: Generation | None = None
        self._new: Generation | None = None
        #: Replaces that completed (their B serves), in order: the rollback undoes them.
        self._done: list[AskedMove] = []
        self._outages: list[str] = []
        #: The commit's step, once asked for: done means the switch has happened.
        self._commit: int | None = None

    @workflow.query(name=QUERY_OPERATION)
    def operation(self) -> OperationRecord:
        """The saga's record: its steps and how it stands."""
        return self._saga.record

    @workflow.run
    async def run(self, request: SwitchInput) -> OperationRecord:
        """Switch each replica, commit, or roll back; see the module docstring.
        ``request`` is the one ``__init__`` kept."""
        saga = self._saga
        try:
            await saga.begin()
            failed = await self._switch()
        except asyncio.CancelledError:
            if self._saga.done(self._commit):
                # Too late to cancel: the switch has happened.
                return await saga.finish(OperationState.SUCCEEDED,
                                         summary=self._summary("done"))
            lost = await saga.uninterrupted(self._roll_back(None))
            await saga.finish(
                OperationState.ROLLBACK_INCOMPLETE if lost else OperationState.CANCELLED,
                summary=self._summary("cancelled, rolled back in part" if lost
                                      else "cancelled"),
                error=f"cancelled; could not restore: {'; '.join(lost)}" if lost else None)
            raise
        if failed is None:
            return await saga.finish(OperationState.SUCCEEDED, summary=self._summary("done"))
        move, why = failed
        if not self._done and move is None:
            # Nothing was changed: nothing to roll back.
            await saga.finish(OperationState.FAILED, error=why,
                              summary=self._summary("failed"))
            return saga.outcome()
        lost = await saga.uninterrupted(self._roll_back(move))
        error = f"{self._label()} failed: {why}"
        if lost:
            await saga.finish(OperationState.ROLLBACK_INCOMPLETE,
                              error=f"{error}; could not restore: {'; '.join(lost)}",
                              summary=self._summary("rolled back in part"))
        else:
            await saga.finish(OperationState.ROLLED_BACK, error=error,
                              summary=self._summary("rolled back"))
        # Rolled back as designed: it completes with the record; incomplete: it fails.
        return saga.outcome()

    async def _switch(self) -> tuple[AskedMove | None, str] | None:
        """The forward steps. Returns the move that failed (None when nothing of it needs
        undoing) and why, or None once committed."""
        try:
            return await self._forward()
        except ActivityError as err:
            # Describing the deployment failed for good: it is gone.
            return None, describe_failure(err)

    async def _forward(self) -> tuple[AskedMove | None, str] | None:
        saga = self._saga
        deployment_id = self._input.deployment_id
        brief = await saga.describe(deployment_id)
        if brief.deleting:
            return None, f"deployment {deployment_id!r} is being deleted"
        old = brief.generation
        new = Generation(
            number=old.number + 1, model_id=self._input.model_id or old.model_id,
            engine_args=(self._input.engine_args if self._input.engine_args is not None
                         else old.engine_args))
        self._old, self._new = old, new
        saga.title = (f"**{saga.record.kind.value.capitalize()}** of deployment "
                      f"`{deployment_id}`: `{generation_label(old)}` (generation "
                      f"{old.number}) → `{generation_label(new)}` (generation {new.number})")
        saga.update(summary=self._summary("running"))
        tried: set[ReplicaId] = set()
        while (replica := next_replica(brief, new, tried=tried)) is not None:
            tried.add(replica.replica_id)
            move = await self._replace(replica.replica_id, new, undo=False)
            if not move.succeeded:
                return (None if move.refused else move), move.error
            self._done.append(move)
            saga.update(summary=self._summary("running"))
            brief = await saga.describe(deployment_id)
        self._commit = saga.step(f"commit: generation {new.number} ({generation_label(new)})")
        error = await saga.set_generation(deployment_id, new, step=self._commit)
        if error is not None:
            return None, f"the commit failed: {error}"
        return None

    async def _replace(self, replica_id: ReplicaId, generation: Generation, *,
                       undo: bool) -> AskedMove:
        """Replace one replica by one on ``generation``, beside it, or stop-first when
        there is no room for both (its outage stated in the step)."""
        saga = self._saga
        deployment_id = self._input.deployment_id
        label = generation_label(generation)
        prefix, name = ("undo-", "undo: ") if undo else ("", "")
        move = await saga.move(deployment_id, MoveRequest(
            move_id=saga.move_id(f"{prefix}replace-{replica_id}"), kind=MoveKind.REPLACE,
            replica_id=replica_id, generation=generation,
            reason=saga.record.operation_id), name=f"{name}replace {replica_id} with {label}")
        if not move.no_room:
            return move
        move = await saga.move(deployment_id, MoveRequest(
            move_id=saga.move_id(f"{prefix}replace-{replica_id}:stop-first"), kind=MoveKind.REPLACE,
            replica_id=replica_id, generation=generation, stop_first=True,
            reason=saga.record.operation_id),
            name=f"{name}replace {replica_id} with {label}, stopping it first (no room for both)")
        if move.succeeded:
            window = outage(move.outcome)
            self._outages.append(f"{replica_id}: {window}")
            saga.end_step(move.step, StepState.DONE, f"{describe_outcome(move)}; {window}")
        return move

    async def _roll_back(self, failed: AskedMove | None) -> list[str]:
        """Undo in reverse order: the failed (or, after a cancel, every open) move, then each
        completed replace. Returns each part that could not be restored."""
        old = self._old
        if old is None:
            return []  # cancelled before anything was asked for
        lost: list[str] = []
        undo = [failed] if failed is not None else self._saga.open_moves()
        for move in reversed(undo):
            lost += await self._undo_failed(move, old)
        for move in reversed(self._done):
            lost += await self._undo_done(move, old)
        return lost

    async def _undo_failed(self, move: AskedMove, old: Generation) -> list[str]:
        """cancel_move (B retired, A kept); if A was already retired, surge one on A."""
        saga = self._saga
        replica_id = move.request.replica_id
        undone = await saga.cancel(move)
        if isinstance(undone, UndoFailed):
            return [f"{move.request.move_id} not cancelled: {undone.reason}"]
        if undone.state is MoveState.SUCCEEDED:
            # It completed before the cancel took effect: undone like any completed one.
            self._done.append(move)
            return []
        if replica_id is None or not move.request.stop_first:
            return []
        try:
            brief = await saga.describe(move.deployment_id)
        except ActivityError as err:
            saga.end_step(move.step, StepState.UNDO_FAILED)
            return [f"{replica_id} (stopped for {move.request.move_id}) not restored: "
                    f"{describe_failure(err)}"]
        if lives(brief, replica_id):
            return []  # cancelled before it retired A
        live = [r.replica_id for r in brief.replicas if r.phase != STOPPING]
        if len(live) >= brief.desired:
            # The deployment refills the slot a failed stop-first held, on its current
            # generation (still A: it changes only at the commit). A surge now would be
            # one replica too many, holding the surge allowance the undos below need.
            step = saga.step(f"undo: restore {replica_id} on {generation_label(old)}")
            saga.end_step(step, StepState.DONE,
                          f"the deployment placed one on {generation_label(old)} itself: "
                          f"{len(live)}/{brief.desired} replicas ({', '.join(live)})")
            return []
        surge = await saga.move(move.deployment_id, MoveRequest(
            move_id=saga.move_id(f"undo-surge-{replica_id}"), kind=MoveKind.SURGE, generation=old,
            reason=saga.record.operation_id),
            name=f"undo: surge {generation_label(old)} for {replica_id}")
        if surge.succeeded:
            return []
        saga.end_step(move.step, StepState.UNDO_FAILED)
        return [f"{replica_id} (stopped for {move.request.move_id}) not restored: {surge.error}"]

    async def _undo_done(self, move: AskedMove, old: Generation) -> list[str]:
        """Replace the B a completed replace started by a replica on A."""
        saga = self._saga
        surged = move.outcome.surged if move.outcome is not None else None
        if surged is None:
            saga.end_step(move.step, StepState.UNDO_FAILED)
            return [f"{move.request.replica_id}: the replica that replaced it is unknown"]
        back = await self._replace(surged, old, undo=True)
        if back.succeeded:
            saga.end_step(move.step, StepState.UNDONE)
            return []
        saga.end_step(move.step, StepState.UNDO_FAILED)
        return [f"{surged} ({self._label()}) not replaced by {generation_label(old)}: "
                f"{back.error}"]

    def _label(self) -> str:
        if self._new is None:
            return self._input.model_id or "the new generation"
        return generation_label(self._new)

    def _summary(self, how: str) -> str:
        kind = self._saga.record.kind.value.capitalize()
        text = f"{kind} of {self._input.deployment_id} to {self._label()} {how}"
        if how in ("running", "done"):
            text += f": {len(self._done)} replica(s) on it"
        elif self._old is not None and how in ("rolled back", "cancelled"):
            text += f": every replica is back on {generation_label(self._old)}"
        if self._outages:
            text += "; stopped first: " + "; ".join(self._outages)
        return text
