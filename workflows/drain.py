"""DrainSaga: empty a node for maintenance, each replica replaced elsewhere first.

Steps, each visible in the OperationRecord (workflows/saga.py says how they are shown):

1. ``begin_operation``: one saga per node; a second fails at once, naming the first.
2. Cordon the node (``set_cordon``, reason ``draining: <workflow id>``): nothing new is
   placed there. It stays cordoned when the drain ends: that is the point.
3. The replicas holding a claim on it (``node_deployments``), and the deadline: now plus
   the grace period.
4. For each replica, in turn: a ``replace`` that avoids the node (the new copy elsewhere,
   the old retired once the new one serves).
5. A replica whose replacement found no room elsewhere (or failed to start, its new copy
   then cancelled, or was refused, say while another saga's move ran on its deployment) is
   tried again once the deadline comes (a durable timer), once. Still no room (or failing):
   it is retired, with the reason ``drain of <node>: no room elsewhere: <why>``. So an
   outage for want of room is bounded by the grace period, and stated. Refused again: it
   is left there, and the drain ends failed naming it. A replica whose deployment was
   deleted meanwhile goes with it.
6. What is left is judged by the node, not by the replica ids listed at step 3: after the
   first pass, at the deadline, and again before the drain ends failed, it lists what the
   node holds now (``node_deployments``). A replica tried before and no longer there has
   left it by another operation (a restart or switch replaced it meanwhile: the drain was
   refused while that saga's move held it, and its id is gone now); one there that was
   never tried (placed by such a move before the cordon took hold) is replaced too.
   (Patched, PATCH_DRAIN_BY_NODE: before, a replica refused twice was "still there"
   even when another saga had moved it off.)

A replacement that is still loading when the deadline passes is awaited: its old replica
serves meanwhile, and stopping that one would be the outage a drain exists to avoid.

Cancelling the drain (``temporal workflow cancel``) cancels every move not yet ended
(``cancel_move``: a replacement not yet ready is retired, its old replica kept), uncordons
the node only if the input asked for it, and ends the saga cancelled.

Workflow ids come from the starter: ``drain/<node>/<n>``. Patched since it was new:
PATCH_DRAIN_BY_NODE (step 6) and PATCH_SAGA_OUTCOME (saga.py, "How a saga ends"). Any
change to the order of its commands goes behind ``workflow.patched``
(tests/histories/saga_drain_*.json replay it).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.saga_stubs import OperationsActivityStubs
    from modelkeeper.domain.ids import ReplicaId
    from modelkeeper.domain.moves import MoveKind, MoveRequest
    from modelkeeper.domain.operations import (
        DrainInput,
        NodeDeploymentsInput,
        NodeReplica,
        OperationKind,
        OperationRecord,
        OperationState,
        SetCordonInput,
        StepState,
    )
    from modelkeeper.names import (
        ERROR_NO_DEPLOYMENT,
        PATCH_DRAIN_BY_NODE,
        QUERY_OPERATION,
        WORKFLOW_DRAIN,
    )

# Not passed through: the sandbox re-imports it with each workflow, and checks it.
from .saga import (
    AskedMove,
    Saga,
    UndoFailed,
    describe_failure,
    new_record,
)


def static_summary(request: DrainInput) -> str:
    """What the web UI's list of runs shows for a drain (the starter's static_summary)."""
    return (f"Drain of node {request.node_id}: each replica moved elsewhere within "
            f"{request.grace_s:.0f} s")


@workflow.defn(name=WORKFLOW_DRAIN)
class DrainSaga:
    """Empties one node: cordon, replace each replica elsewhere, retire what cannot move."""

    @workflow.init
    def __init__(self, request: DrainInput) -> None:
        # Built here, not in run: the query may be answered before run's first line.
        self._input = request
        self._saga = Saga(
            new_record(OperationKind.DRAIN, node_id=request.node_id,
                       summary=static_summary(request), requested_by=request.requested_by),
            title=f"**Drain** of node `{request.node_id}`")
        self._cordon_step: int | None = None
        self._moved: list[ReplicaId] = []
        #: Replicas stopped with nowhere to go, and why.
        self._retired: dict[ReplicaId, str] = {}
        #: Replicas still on the node at the end, and why.
        self._left: dict[ReplicaId, str] = {}
        #: Replicas whose deployment was deleted meanwhile: they stop with it.
        self._gone: list[ReplicaId] = []
        #: Replicas that left the node by another operation (PATCH_DRAIN_BY_NODE).
        self._elsewhere: list[ReplicaId] = []
        #: Whether this run judges by the node (PATCH_DRAIN_BY_NODE), once it has asked.
        self._by_node = False

    @workflow.query(name=QUERY_OPERATION)
    def operation(self) -> OperationRecord:
        """The saga's record: its steps and how it stands."""
        return self._saga.record

    @workflow.run
    async def run(self, request: DrainInput) -> OperationRecord:
        """Cordon, move, retire what cannot move; see the module docstring. ``request`` is
        the one ``__init__`` kept."""
        saga = self._saga
        try:
            await saga.begin()
            error = await self._drain()
        except asyncio.CancelledError:
            failed = await saga.uninterrupted(self._undo())
            await saga.finish(
                OperationState.CANCELLED, summary=self._summary("cancelled"),
                error=f"could not undo: {'; '.join(failed)}" if failed else None)
            raise
        except ActivityError as err:
            # A store activity failed for good (not a database outage: those are retried).
            await saga.finish(OperationState.FAILED, error=describe_failure(err),
                              summary=self._summary("failed"))
            raise saga.failure() from err
        if error is not None:
            await saga.finish(OperationState.FAILED, error=error,
                              summary=self._summary("failed"))
            return saga.outcome()
        if self._left and self._by_node:
            await self._recheck_left()
        if self._left:
            await saga.finish(
                OperationState.FAILED, summary=self._summary("failed"),
                error=f"still on {request.node_id}: " + "; ".join(
                    f"{r}: {why}" for r, why in self._left.items()))
            return saga.outcome()
        return await saga.finish(OperationState.SUCCEEDED, summary=self._summary("done"))

    async def _drain(self) -> str | None:
        """The forward steps; returns why the drain could not begin, or None."""
        saga = self._saga
        node = self._input.node_id
        self._cordon_step = step = saga.step(f"cordon {node}")

        async def cordon() -> bool:
            known = await saga.call(
                OperationsActivityStubs.set_cordon, SetCordonInput(
                    node_id=node, cordoned=True,
                    reason=f"draining: {saga.record.operation_id}"))
            if known is False:
                saga.end_step(step, StepState.FAILED, f"node_id: {node} is not a known node")
                return False
            saga.end_step(step, StepState.DONE, "nothing new is placed there")
            return True

        # Atomic: a cordon cut short could land after the uncordon of a cancel.
        if not await saga.atomic(cordon()):
            return f"node_id: {node} is not a known node"
        claims = await saga.call(OperationsActivityStubs.node_deployments,
                                 NodeDeploymentsInput(node_id=node))
        # A replica with several shards on the node is listed once per shard.
        replicas = list({c.replica_id: c for c in claims}.values())
        deadline = workflow.now() + timedelta(seconds=self._input.grace_s)
        saga.update(summary=self._summary("running"))
        later: list[NodeReplica] = []
        for replica in replicas:
            move = await self._replace(replica, at_deadline=False)
            if move is not None:
                later.append(replica)
        tried = {r.replica_id for r in replicas}
        # Read once, here, for the rest of the run: a run replaying an older history keeps
        # the old path to its end.
        self._by_node = workflow.patched(PATCH_DRAIN_BY_NODE)
        if self._by_node:
            # Placed there before the cordon took hold, by another saga's move: moved too.
            newcomers = [r for rid, r in (await self._on_node()).items() if rid not in tried]
            if newcomers:
                check = saga.step(f"check what {node} holds now")
                saga.end_step(check, StepState.DONE, _node_check([], newcomers))
            for replica in newcomers:
                tried.add(replica.replica_id)
                move = await self._replace(replica, at_deadline=False)
                if move is not None:
                    later.append(replica)
        if not later:
            return None
        wait = (deadline - workflow.now()).total_seconds()
        if wait > 0:
            step = saga.step(f"wait until {deadline:%H:%M:%S} for room elsewhere",
                             ", ".join(r.replica_id for r in later))
            await workflow.sleep(wait)
            saga.end_step(step, StepState.DONE)
        if self._by_node:
            later = await self._by_the_node(later, tried=tried)
        for replica in later:
            move = await self._replace(replica, at_deadline=True)
            if move is not None:
                await self._retire(replica, move)
        return None

    async def _replace(self, replica: NodeReplica, *, at_deadline: bool) -> AskedMove | None:
        """Replace ``replica`` off the node. Returns the move to try again (or, at the
        deadline, to retire) for: it found no room, or its new copy failed and was
        cancelled, or (before the deadline) it was refused, say while another saga's move
        on the deployment ran. Else None: moved, gone with its deployment, or left."""
        saga = self._saga
        node = self._input.node_id
        rid = replica.replica_id
        name = f"replace {rid} ({replica.deployment_id}) off {node}"
        if at_deadline:
            name += " at the deadline"
        suffix = ":retry" if at_deadline else ""
        move = await saga.move(replica.deployment_id, MoveRequest(
            move_id=saga.move_id(f"replace-{rid}{suffix}"), kind=MoveKind.REPLACE, replica_id=rid,
            avoid_nodes=[node], reason=saga.record.operation_id), name=name)
        if move.succeeded:
            self._moved.append(rid)
            saga.update(summary=self._summary("running"))
            return None
        if move.refused_type == ERROR_NO_DEPLOYMENT:
            # Deleted meanwhile: its replicas stop with it, nothing to move.
            self._gone.append(rid)
            saga.end_step(move.step, StepState.DONE, f"nothing to move: {move.refused}")
            return None
        if move.refused is not None:
            if at_deadline:
                self._left[rid] = move.refused
                return None
            return move
        if not move.no_room:
            # Its new copy failed: retire it (the compensation), keep the old one serving
            # until the deadline.
            await saga.uninterrupted(saga.cancel(move))
        return move

    async def _on_node(self) -> dict[ReplicaId, NodeReplica]:
        """The replicas holding a claim on the node now."""
        claims = await self._saga.call(OperationsActivityStubs.node_deployments,
                                       NodeDeploymentsInput(node_id=self._input.node_id))
        return {c.replica_id: c for c in claims}

    async def _by_the_node(self, later: list[NodeReplica], *,
                           tried: set[ReplicaId]) -> list[NodeReplica]:
        """What the deadline's pass should try: of ``later``, the replicas still on the
        node, and any there that was never tried (placed by another saga's move before the
        cordon). A replica of ``later`` gone from the node left it by another operation."""
        saga = self._saga
        node = self._input.node_id
        step = saga.step(f"check what {node} holds now")
        on_node = await self._on_node()
        left = [r for r in later if r.replica_id in on_node]
        for replica in later:
            if replica.replica_id not in on_node:
                self._elsewhere.append(replica.replica_id)
        newcomers = [r for rid, r in on_node.items() if rid not in tried]
        saga.end_step(step, StepState.DONE, _node_check(self._elsewhere, newcomers))
        saga.update(summary=self._summary("running"))
        return left + newcomers

    async def _recheck_left(self) -> None:
        """Before ending failed: a replica named as left that the node no longer holds
        left it by another operation meanwhile (a saga's move that held it ended)."""
        saga = self._saga
        step = saga.step(f"check what {self._input.node_id} still holds")
        on_node = await self._on_node()
        gone = [rid for rid in self._left if rid not in on_node]
        for rid in gone:
            del self._left[rid]
            self._elsewhere.append(rid)
        saga.end_step(step, StepState.DONE, _node_check(gone, []))

    async def _retire(self, replica: NodeReplica, replacement: AskedMove) -> None:
        """Stop a replica that has nowhere else to go, saying why."""
        saga = self._saga
        node = self._input.node_id
        rid = replica.replica_id
        why = "no room elsewhere" if replacement.no_room else "its replacement failed"
        reason = f"drain of {node}: {why}: {replacement.error}"
        move = await saga.move(replica.deployment_id, MoveRequest(
            move_id=saga.move_id(f"retire-{rid}"), kind=MoveKind.RETIRE, replica_id=rid,
            reason=reason), name=f"retire {rid} ({replica.deployment_id})")
        if move.succeeded:
            self._retired[rid] = reason
            saga.end_step(move.step, StepState.DONE, reason)
        else:
            self._left[rid] = f"could not retire: {move.error}"
        saga.update(summary=self._summary("running"))

    async def _undo(self) -> list[str]:
        """The compensation of a cancel: cancel what is in flight, uncordon if asked.
        Returns what could not be undone."""
        saga = self._saga
        failed = []
        for move in saga.open_moves():
            undone = await saga.cancel(move)
            if isinstance(undone, UndoFailed):
                failed.append(f"{move.request.move_id}: {undone.reason}")
        if self._input.uncordon_on_cancel and self._cordon_step is not None:
            node = self._input.node_id
            step = saga.step(f"undo: uncordon {node}")
            try:
                await saga.call(OperationsActivityStubs.set_cordon,
                                SetCordonInput(node_id=node, cordoned=False))
            except ActivityError as err:
                saga.end_step(step, StepState.FAILED, describe_failure(err))
                saga.end_step(self._cordon_step, StepState.UNDO_FAILED)
                failed.append(f"uncordon {node}: {describe_failure(err)}")
            else:
                saga.end_step(step, StepState.DONE)
                saga.end_step(self._cordon_step, StepState.UNDONE)
        return failed

    def _summary(self, how: str) -> str:
        text = f"Drain of {self._input.node_id} {how}: {len(self._moved)} replica(s) moved"
        if self._retired:
            text += (f", {len(self._retired)} stopped with nowhere to go ("
                     + "; ".join(f"{r}: {why}" for r, why in self._retired.items()) + ")")
        if self._elsewhere:
            text += f", {len(self._elsewhere)} moved off by another operation"
        if self._gone:
            text += f", {len(self._gone)} deleted with their deployment"
        if self._left:
            text += f", {len(self._left)} still there"
        return text


def _node_check(elsewhere: list[ReplicaId], newcomers: list[NodeReplica]) -> str:
    """A node check's step detail: what left the node meanwhile, and what came."""
    parts = []
    if elsewhere:
        parts.append(f"moved off by another operation: {', '.join(elsewhere)}")
    if newcomers:
        parts.append("placed there meanwhile, to be replaced too: "
                     + ", ".join(f"{r.replica_id} ({r.deployment_id})" for r in newcomers))
    return "; ".join(parts) or "as listed"
