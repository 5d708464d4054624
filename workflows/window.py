"""WindowWorkflow: a schedule window opens or closes on a deployment.

Each window of a deployment is two Temporal Schedules (modelkeeper.infra.schedules), one
at the window's open (its start less its prewarm), one at its close, in its time zone. Each
firing starts one of these, which asks the deployment's workflow for ``set_window``
through an activity (a workflow cannot send another workflow an update;
activities/windows.py), and ends with a sentence the web UI shows as its result:

1. ``apply_window``: the window's bounds while it is open (the count rises to its minimum
   at once), or its close (ignored by the deployment if another window opened since).
2. The deployment is gone (``NoDeployment``) or being deleted (``Deleting``): the window
   has nothing left to bound, so ``drop_window`` removes its two schedules, and the run
   ends saying so. The API removes them when it deletes a deployment; this catches a
   window its listing missed, and a deployment terminated by hand.

Any other failure is retried (the update is idempotent under the run's id) until the run
times out (modelkeeper.infra.schedules.WINDOW_RUN_TIMEOUT); the next firing asks again.

A brand-new workflow type: nothing to patch yet. A change to its commands from here on
goes behind ``workflow.patched``.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.saga_stubs import WindowActivityStubs
    from modelkeeper.domain.schedules import WindowInput
    from modelkeeper.names import (
        CONTROL_TASK_QUEUE,
        ERROR_DELETING,
        ERROR_NO_DEPLOYMENT,
        WORKFLOW_WINDOW,
    )

# Not passed through: the sandbox re-imports it with each workflow, and checks it.
from .saga import STORE_RETRY, STORE_TIMEOUT, UPDATE_RETRY, UPDATE_TIMEOUT

#: The deployment's answers that end the window rather than fail the run.
GONE = frozenset({ERROR_NO_DEPLOYMENT, ERROR_DELETING})


@workflow.defn(name=WORKFLOW_WINDOW)
class WindowWorkflow:
    """One firing of a window's open or close schedule."""

    @workflow.run
    async def run(self, request: WindowInput) -> str:
        name, deployment = request.bounds.name, request.deployment_id
        try:
            wanted = await workflow.execute_activity_method(
                WindowActivityStubs.apply_window, request, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=UPDATE_TIMEOUT, retry_policy=UPDATE_RETRY)
        except ActivityError as err:
            cause = err.cause
            if not (isinstance(cause, ApplicationError) and cause.type in GONE):
                raise
            # Removing schedules is one RPC each to the server, like a store write.
            await workflow.execute_activity_method(
                WindowActivityStubs.drop_window, request, task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
            return (f"window {name}: deployment {deployment} is gone ({cause.message}); "
                    "its schedules were removed")
        if request.edge == "open":
            return f"window {name} open on {deployment}: {wanted} replica(s) wanted"
        return f"window {name} closed on {deployment}: {wanted} replica(s) wanted"
