"""The schedule windows' hands (run by the control worker): open or close a window on a
deployment, and remove the schedules of a window whose deployment is gone.

A window's schedules start a WindowWorkflow (workflows/window.py), which cannot send the
deployment an update itself: it asks through :meth:`WindowActivities.apply_window`, one
``set_window`` update by method, with the sagas' error mapping
(:func:`activities.moves.ask_deployment`): a deployment that is not running is
``ERROR_NO_DEPLOYMENT``, a refusal (a deployment being deleted: ``ERROR_DELETING``) is
non-retryable with the workflow's own words, anything else is retried.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.client import Client

from modelkeeper.domain.schedules import WindowInput
from modelkeeper.infra import schedules
from modelkeeper.infra.temporal import execute_update
from modelkeeper.names import ACTIVITY_APPLY_WINDOW, ACTIVITY_DROP_WINDOW, UPDATE_SET_WINDOW
from workflows.deployment import DeploymentWorkflow, deployment_handle

from .moves import ask_deployment
from .saga_stubs import WindowActivityStubs


class WindowActivities(WindowActivityStubs):
    """Activities bound to one Temporal client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn(name=ACTIVITY_APPLY_WINDOW)
    async def apply_window(self, request: WindowInput) -> int:
        """Open or close the window; the replica count the deployment wants now. A retry
        asks again under the same update id (the firing's run id), and is answered, never
        applied twice.

        The run id, not the workflow id: a schedule names each run it starts by its time to
        the second, so two firings within one second share a workflow id, and the server
        answers an update id it has seen with that update's outcome, even from a closed
        workflow. The second firing was answered the first one's "2 replica(s) wanted" for
        a deployment already deleted, and left its schedules behind (test_window, in busy
        full suites)."""
        handle = deployment_handle(self._client, request.workflow_id)
        return await ask_deployment(request.deployment_id, execute_update(
            handle, DeploymentWorkflow.set_window, request.request,
            id=f"{UPDATE_SET_WINDOW}:{activity.info().workflow_run_id}"))

    @activity.defn(name=ACTIVITY_DROP_WINDOW)
    async def drop_window(self, request: WindowInput) -> bool:
        """Remove both schedules of the window; whether any were left."""
        return await schedules.delete_window(self._client, request.deployment_id,
                                             request.bounds.name)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the worker to register."""
        return [self.apply_window, self.drop_window]
