"""The store sweep: remove what a deployment whose workflow is gone left in the store.

A terminate (the web UI's *Terminate*, ``temporal workflow terminate``) runs no workflow
code, so the deployment's row, its replicas and their claims on node memory stay behind
(docs/keeper.md, "Cancel and terminate"). The control worker runs :func:`run` in the
background: every ``sweep_interval_s`` one pass (:func:`sweep_once`) lists the deployment
rows, describes each one's workflow by id, and removes those :func:`decide` gives up.

:func:`decide` is pure (the row, what Temporal said, and ``now``, the database's clock);
its rules, in order, each with its test in ``tests/integration/test_sweep.py``:

1. A row younger than :data:`SWEEP_GRACE_S` is kept, whatever Temporal says: the API
   writes the row first and starts the workflow after.
2. A row whose workflow is closed (terminated, failed, timed out; canceled or completed
   too, which remove the row before they close, but for a cancel from before
   ``cancel-as-delete``) is swept: nothing that runs will ever remove it.
3. A row with no workflow by its id is swept: a create that died between the row and the
   start (the API removes the row itself when the start fails, not when it dies), or a
   closed run past the namespace's retention.
4. Every other row is kept: its workflow runs (or continued as new, or shows a status
   this version does not know), and owns its rows.

Acting is safe from several workers at once: :meth:`DeploymentStore.sweep_deployment` removes a row
and appends its ``deployment.swept`` event in one transaction, or finds the row gone and
does nothing, so a row is swept, and its event recorded, once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from functools import partial

from temporalio.api.errordetails.v1 import NotFoundFailure
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.domain.catalog import DeploymentView, ReplicaView
from modelkeeper.domain.events import Event, NewEvent
from modelkeeper.infra.temporal import signal_unplaceable
from modelkeeper.store import Store

log = logging.getLogger(__name__)

#: A row this young is never swept. The API writes the row, then starts its workflow with
#: one RPC, which the client retries for at most 10 s (the SDK's default RetryConfig) and
#: after which the API removes the row itself; 60 s is six times that. Sweeping a row whose
#: workflow then starts would leave that workflow placing for a deployment that is gone.
SWEEP_GRACE_S = 60.0

#: The statuses of a run that has ended: nothing of it will touch the store again.
CLOSED: frozenset[WorkflowExecutionStatus] = frozenset({
    WorkflowExecutionStatus.TERMINATED, WorkflowExecutionStatus.FAILED,
    WorkflowExecutionStatus.TIMED_OUT, WorkflowExecutionStatus.CANCELED,
    WorkflowExecutionStatus.COMPLETED,
})


class NotFound(Enum):
    """Temporal has no workflow by the row's workflow id (not a namespace it lacks)."""

    NOT_FOUND = "not found"


#: What describing a row's workflow showed: its latest run's status (None when the server
#: gave none), or that there is no such workflow.
WorkflowSeen = WorkflowExecutionStatus | NotFound | None


@dataclass(frozen=True)
class Keep:
    """The row stays; ``reason`` says why."""

    reason: str


@dataclass(frozen=True)
class Sweep:
    """The row goes, with its replicas and their claims. ``workflow`` names what Temporal
    showed (``terminated``, ``not found``, ...); ``reason`` is the sentence for the log."""

    workflow: str
    reason: str


def decide(row: DeploymentView, workflow: WorkflowSeen, now: datetime, *,
           grace_s: float = SWEEP_GRACE_S) -> Keep | Sweep:
    """Whether a pass sweeps ``row`` (the rules are in the module docstring)."""
    age = now - row.created_at
    if age < timedelta(seconds=grace_s):
        return Keep(f"created {age.total_seconds():.0f}s ago, within the {grace_s:.0f}s "
                    "grace in which its workflow may still be starting")
    match workflow:
        case NotFound.NOT_FOUND:
            return Sweep("not found", f"no workflow {row.workflow_id!r} exists "
                         f"{age.total_seconds():.0f}s after the row was written")
        case WorkflowExecutionStatus() if workflow in CLOSED:
            name = workflow.name.lower().replace("_", " ")
            return Sweep(name, f"its workflow {row.workflow_id!r} is closed: {name}")
        case WorkflowExecutionStatus():
            return Keep(f"its workflow {row.workflow_id!r} is "
                        f"{workflow.name.lower().replace('_', ' ')}")
        case None:
            return Keep(f"its workflow {row.workflow_id!r} shows no status")


def swept_event(row: DeploymentView, verdict: Sweep,
                replicas: list[ReplicaView]) -> NewEvent:
    """The audit entry of a sweep, naming why and what it removed."""
    nodes = sorted({n for r in replicas for n in r.nodes})
    released = (f"{len(replicas)} replica(s) and their claims on {', '.join(nodes)}"
                if nodes else f"{len(replicas)} replica(s), holding no claims")
    return NewEvent(
        kind="deployment.swept", deployment_id=row.deployment_id,
        message=f"swept: {verdict.reason}; removed the row and {released}",
        data={"workflow_id": row.workflow_id, "workflow": verdict.workflow,
              "status": row.status.value,
              "replicas": [r.replica_id for r in replicas], "nodes": nodes})


async def describe(client: Client, workflow_id: str) -> WorkflowSeen:
    """The status of the latest run of ``workflow_id``. Raises :class:`RPCError` for
    anything but a missing workflow: a missing namespace is a misconfigured client, whose
    workflows may well run on."""
    try:
        return (await client.get_workflow_handle(workflow_id).describe()).status
    except RPCError as exc:
        if exc.status is RPCStatusCode.NOT_FOUND and any(
                detail.Is(NotFoundFailure.DESCRIPTOR) for detail in exc.grpc_status.details):
            return NotFound.NOT_FOUND
        raise


async def sweep_once(store: Store, client: Client, *,
                     grace_s: float = SWEEP_GRACE_S) -> list[Event]:
    """One pass: sweep every deployment :func:`decide` gives up; return their events
    (none for a row another worker swept first). Deployments waiting for room are told
    when claims were removed."""
    now = await store.now()  # before the rows: a row written meanwhile counts as young
    events = []
    for row in await store.deployments.list_deployments():
        verdict = decide(row, await describe(client, row.workflow_id), now, grace_s=grace_s)
        if isinstance(verdict, Keep):
            log.debug("store sweep keeps %s: %s", row.deployment_id, verdict.reason)
            continue
        event = await store.deployments.sweep_deployment(
            row.deployment_id, workflow_id=row.workflow_id,
            event_for=partial(swept_event, row, verdict))
        if event is None:
            continue  # another worker swept it first, or its own workflow removed it
        log.warning("%s %s", row.deployment_id, event.message)
        events.append(event)
    if any(e.data["nodes"] for e in events):
        await signal_unplaceable(client, await store.deployments.deployment_ids_waiting_for_room())
    return events


async def run(store: Store, client: Client, *, interval_s: float) -> None:
    """Sweep now and then every ``interval_s`` until cancelled. A pass that fails (the
    database or Temporal unreachable) is logged and tried again at the next interval: a
    janitor's failure must not take the control worker down with it."""
    while True:
        try:
            await sweep_once(store, client)
        except Exception:
            log.exception("store sweep failed; next pass in %.0fs", interval_s)
        await asyncio.sleep(interval_s)
