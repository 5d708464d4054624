"""The deployment workflow's one store writer, and what the deployment shows outside the
store (the web UI's details, the search attributes).

Apart from the workflow class (workflows/deployment.py) because it is a concern of its own:
the loop decides and acts, and this follows the state to the store. It issues only the
store activities (:func:`.deployment_hops.write`) and search-attribute upserts, in the
same order the workflow issued them when they were its methods, so replay is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate
    from modelkeeper.domain.events import NewEvent
    from modelkeeper.domain.keeper import current_generation, details
    from modelkeeper.names import PATCH_MODEL_ID_FOLLOWS_SWITCH

from . import deployment_hops as hops
from .deployment_state import (
    MODEL_ID_KEY,
    DeploymentWorkflowState,
    normalised,
    search_attributes,
    unwritten,
)


class StateHolder(Protocol):
    """The workflow as the writer sees it: the one state, which the writer reads and, once a
    write lands, notes as written."""

    state: DeploymentWorkflowState

    def settle(self) -> None:
        """Wake the workflow's loop (the writer ended: a write failed for good)."""


class StoreWriter:
    """The one store writer, a task of its own.

    It writes one thing at a time, always what is due now (:meth:`_next`), so a state that
    passed while a write was in flight is never written: after an outage it writes the
    latest replica states and status, not each one in between. No decision waits for it:
    store activities retry for ever (STORE_RETRY), and an outage holds up only this task
    (and the finish and continue-as-new, which wait for :meth:`idle`).

    The order that matters still holds. A replica's state is written only once it is
    placed (place_replica created its row), and an UPDATE of a row release_replica has
    deleted changes nothing. The finish waits for the writer to be idle and closes the store
    to it (:meth:`close`) before it deletes the deployment's row, so no status comes after
    the delete. Continue-as-new waits for it too, so the state carried over says what was
    written and no audit event is left behind.

    The wait's condition runs on each workflow task: it reads only the state, so it is
    deterministic, and it is cheap (a few replicas, one status). It needs no state of its
    own beyond the fields below: what to write is the difference between the keeper's state
    and what the state says was written (written_status, written_replicas).
    """

    def __init__(self, holder: StateHolder) -> None:
        self._holder = holder
        self._task: asyncio.Task[None] | None = None
        self._writing = False  # a write is in flight
        self._events: list[NewEvent] = []  # audit events not yet appended, oldest first
        self._closed = False  # the deployment's row is being deleted: no more writes

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def record(self, event: NewEvent) -> None:
        """Append an audit event, after the ones already waiting."""
        self._events.append(event)

    def idle(self) -> bool:
        """Nothing in flight and nothing due."""
        return not self._writing and self._next() is None

    def raise_failure(self) -> None:
        """A write that failed for good fails the run."""
        if self._task is not None and self._task.done():
            self._task.result()

    async def close(self) -> None:
        """Wait for the last write (the deleting status, any audit event), then write no
        more: the deployment's row is about to be deleted."""
        await workflow.wait_condition(self.idle)
        self._closed = True

    async def _run(self) -> None:
        try:
            while True:
                await workflow.wait_condition(lambda: self._next() is not None)
                self._writing = True
                while (write := self._next()) is not None:
                    await self._write(write)
                self._writing = False
        finally:
            # It ended: a write failed for good. Wake the loop, which raises the error.
            self._holder.settle()

    def _next(self) -> hops.StoreWrite | None:
        """What the store should be told next: an audit event (oldest first), then a
        replica whose stored state differs from its phase (in the keeper's order), then
        the status if it differs from the one last written. None when it is up to date, or
        once the finish has closed the store."""
        if self._closed:
            return None
        if self._events:
            return self._events[0]
        # The status is written after the finish too (the deleting status), until close.
        return unwritten(self._holder.state)

    async def _write(self, write: hops.StoreWrite) -> None:
        """Carry out one write and note it as written in the state."""
        await hops.write(write)
        state = self._holder.state
        match write:
            case NewEvent():
                self._events.remove(write)
            case ReplicaStateUpdate():
                written = {**state.written_replicas, write.replica_id: write.state.value}
                state = state.model_copy(update={"written_replicas": written})
            case DeploymentStatusUpdate():
                state = state.model_copy(update={"written_status": write})
        # Replicas the keeper has dropped meanwhile are forgotten: their rows are gone.
        live = {r.replica_id for r in state.keeper.replicas}
        written = {k: v for k, v in state.written_replicas.items() if k in live}
        self._holder.state = state.model_copy(update={"written_replicas": written})


def show_details(state: DeploymentWorkflowState) -> None:
    """The web UI's current details (no command: replay is unaffected)."""
    text = details(state.keeper)
    if text != workflow.get_current_details():
        workflow.set_current_details(text)


def publish_search_attributes(state: DeploymentWorkflowState) -> None:
    """Upsert the published numbers that changed, before (or without waiting for) the store
    writes: a database outage holds those up, not these. Compared with the workflow's own
    search attributes, which the SDK updates on each upsert and replays alike, so the state
    needs no copy of them."""
    if not state.search_attributes or state.keeper.finished:
        return
    current = workflow.info().typed_search_attributes
    changed = [u for u in search_attributes(state.keeper)
               if normalised(current.get(u.key)) != normalised(u.value)]
    # ModelId (set at start by the API) follows a switch: the list of runs shows the model
    # the deployment runs now. Patched where it differs, the only case whose commands
    # change; the condition reads the replayed search attributes, so it is deterministic.
    model = current_generation(state.keeper).model_id
    if current.get(MODEL_ID_KEY) != model and workflow.patched(PATCH_MODEL_ID_FOLLOWS_SWITCH):
        changed.append(MODEL_ID_KEY.value_set(model))
    if changed:
        workflow.upsert_search_attributes(changed)
