"""Routes for a deployment's schedule windows (scaling by the clock).

A window is two Temporal Schedules (modelkeeper.infra.schedules, the one place that makes,
lists and removes them); these routes only check the deployment and answer. Admins add
and remove windows, viewers list them (``auth``: by method).

* ``POST /deployments/{id}/windows``: 201 with the window as listed. Added while inside
  it (its prewarm included), the window is opened at once with the deployment's own
  ``set_window`` update, as its open schedule would have; that failing removes the
  schedules again, so the window is added whole or not at all.
* ``GET /deployments/{id}/windows``: each window, whether it is open now, and when its
  schedules fire next.
* ``DELETE /deployments/{id}/windows/{name}``: 204; 404 when there is no such window. A
  window open at the time stays open until the deployment's policy changes (its close is
  gone with it): remove windows outside their hours, or scale after.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from modelkeeper.domain.catalog import DeploymentView
from modelkeeper.domain.demand import SetWindowRequest
from modelkeeper.domain.schedules import (
    MAX_WINDOW_NAME_CHARS,
    WINDOW_NAME_PATTERN,
    ScheduleWindow,
    WindowView,
    describe,
    open_at,
)
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.infra import schedules
from modelkeeper.infra.temporal import execute_update
from modelkeeper.names import window_schedule_id
from modelkeeper.store import Store
from workflows.deployment import DeploymentWorkflow, deployment_handle

from .auth import OperatorDep, change
from .deployments import UPDATE_ANSWER_TIMEOUT
from .deps import StoreDep, TemporalDep
from .problems import problems

router = APIRouter()

WindowName = Annotated[str, Path(min_length=1, max_length=MAX_WINDOW_NAME_CHARS,
                                  pattern=WINDOW_NAME_PATTERN)]


@router.post("/deployments/{deployment_id}/windows", status_code=201,
             response_model=WindowView, responses=problems(404, 409, 503))
async def add_window(deployment_id: str, window: ScheduleWindow, store: StoreDep, *,
                     temporal: TemporalDep, operator: OperatorDep) -> WindowView:
    """Bound the deployment by the window's min and max on its days and hours (in its
    time zone), opening ``prewarm_s`` early; 409 if the name is taken."""
    view = await _changeable(store, deployment_id)
    try:
        await schedules.create_window(temporal, window, deployment_id=view.deployment_id,
                                      workflow_id=view.workflow_id)
    except schedules.WindowExistsError as exc:
        raise HTTPException(409, str(exc)) from None
    except RPCError as exc:
        raise HTTPException(503, f"window {window.name!r} was not added: Temporal did not "
                                 f"take its schedules ({exc.message})") from None
    now = datetime.now(UTC)
    opened = ""
    if open_at(window, now):
        try:
            wanted = await _open_now(temporal, view, window)
        except HTTPException:
            await schedules.delete_window(temporal, view.deployment_id, window.name)
            raise
        opened = f"; inside it now, so opened at once ({wanted} replica(s) wanted)"
    await store.events.record_event(change(
        operator, "deployment.window_added",
        f"window {describe(window)} added to {deployment_id}{opened}",
        deployment_id=view.deployment_id, data={"window": window.model_dump(mode="json")}))
    listed = await schedules.list_windows(temporal, view.deployment_id, now=now)
    found = next((w for w in listed if w.window.name == window.name), None)
    if found is None:  # visibility lags its schedules: answer what was made
        found = WindowView(
            deployment_id=view.deployment_id, window=window, open_now=open_at(window, now),
            open_schedule_id=window_schedule_id(view.deployment_id, window.name, "open"),
            close_schedule_id=window_schedule_id(view.deployment_id, window.name, "close"))
    return found


@router.get("/deployments/{deployment_id}/windows", response_model=list[WindowView],
            responses=problems(404, 503))
async def list_windows(deployment_id: str, store: StoreDep,
                       temporal: TemporalDep) -> list[WindowView]:
    """The deployment's windows by name: open now or not, and when each opens and closes
    next."""
    view = await _existing(store, deployment_id)
    try:
        return await schedules.list_windows(temporal, view.deployment_id,
                                            now=datetime.now(UTC))
    except RPCError as exc:
        raise HTTPException(503, f"Temporal did not list the schedules of {deployment_id}: "
                                 f"{exc.message}") from None


@router.delete("/deployments/{deployment_id}/windows/{name}", status_code=204,
               responses=problems(404, 503))
async def remove_window(deployment_id: str, name: WindowName, store: StoreDep, *,
                        temporal: TemporalDep, operator: OperatorDep) -> None:
    """Remove the window's two schedules; 404 if it has none."""
    view = await _existing(store, deployment_id)
    try:
        existed = await schedules.delete_window(temporal, view.deployment_id, name)
    except RPCError as exc:
        raise HTTPException(503, f"window {name!r} was not removed: Temporal did not delete "
                                 f"its schedules ({exc.message})") from None
    if not existed:
        raise HTTPException(404, f"deployment {deployment_id} has no window named {name!r}")
    await store.events.record_event(change(operator, "deployment.window_removed",
                                           f"window {name} removed from {deployment_id}",
                                           deployment_id=view.deployment_id))


async def _open_now(temporal: Client, view: DeploymentView, window: ScheduleWindow) -> int:
    """Open the window on the deployment, as its open schedule does; the count it wants."""
    handle = deployment_handle(temporal, view.workflow_id)
    try:
        return await execute_update(handle, DeploymentWorkflow.set_window,
                                    SetWindowRequest(window=window.bounds),
                                    rpc_timeout=UPDATE_ANSWER_TIMEOUT)
    except WorkflowUpdateFailedError as exc:
        raise HTTPException(409, f"window {window.name!r} was not added: the deployment "
                                 f"refused to open it ({exc.cause or exc})") from None
    except RPCError as exc:
        raise HTTPException(503, f"window {window.name!r} was not added: the deployment's "
                                 f"workflow did not open it in "
                                 f"{UPDATE_ANSWER_TIMEOUT.total_seconds():.0f}s "
                                 f"({exc.message})") from None


async def _existing(store: Store, deployment_id: str) -> DeploymentView:
    view = await store.deployments.get_deployment(deployment_id)
    if view is None:
        raise HTTPException(404, f"deployment {deployment_id!r} does not exist")
    return view


async def _changeable(store: Store, deployment_id: str) -> DeploymentView:
    view = await _existing(store, deployment_id)
    if view.status is DeploymentStatus.DELETING:
        raise HTTPException(409, f"deployment {deployment_id!r} is deleting: no window can "
                                 "be added")
    return view
