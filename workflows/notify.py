"""The notification workflows (docs/operations.md, "Notifications").

:class:`NotifyWorkflow` delivers one notice to every configured target, one activity per
target, each retried on its own: a receiver that is down for an hour gets the notice when
it is back, and one target's outage does not resend to the others. Its id,
``notify/<kind>/<subject>/<yyyymmddhh>``, is the de-duplication: whoever starts it
(:func:`modelkeeper.infra.notify.start_notice`) is refused a second start within the hour.
The notice lives in the workflow's input from the start, so a worker killed mid-delivery
costs a retry on the next worker, not the notice.

:class:`CantPlaceWatch` waits out a deployment's unplaceable stretch with a durable timer
and sends the ``deployment.cant_place`` notice only if the stretch lasted
``notify_cant_place_after_s`` without a break.

Neither touches a deployment's workflow: the keeper's status activity starts them, so the
deployment workflow's command sequence (and its replay) is unchanged.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.notify_stubs import NotifyActivityStubs
    from modelkeeper.domain.notify import (
        POST_TIMEOUT_S,
        CantPlaceWatchInput,
        DeliverInput,
        Due,
        Notice,
        Recovered,
        WaitFor,
        cant_place_notice,
        cant_place_verdict,
    )
    from modelkeeper.names import (
        CONTROL_TASK_QUEUE,
        ERROR_NOTICE_REFUSED,
        WORKFLOW_CANT_PLACE_WATCH,
        WORKFLOW_NOTIFY,
    )

# Not passed through: the sandbox re-imports it with each workflow, and checks it.
from .saga import STORE_RETRY, STORE_TIMEOUT

#: One POST (POST_TIMEOUT_S) and 5 s for the worker's own work. Also how long a delivery
#: held by a worker that died waits before the next worker tries it.
DELIVER_TIMEOUT = timedelta(seconds=POST_TIMEOUT_S + 5)
#: A receiver down or busy is tried again after 5 s, then less often, at most every
#: 10 min; a refusal for good (a wrong URL, a revoked hook) is not retried.
DELIVER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=5), backoff_coefficient=2.0,
                            maximum_interval=timedelta(minutes=10),
                            non_retryable_error_types=[ERROR_NOTICE_REFUSED])
#: A notice still undelivered after a day is given up: what it said is stale, and the
#: workflow fails, naming the target, for someone to see in the web UI.
DELIVER_GIVE_UP = timedelta(days=1)


@workflow.defn(name=WORKFLOW_NOTIFY)
class NotifyWorkflow:
    """One notice to every target the worker's settings name."""

    @workflow.run
    async def run(self, notice: Notice) -> str:
        targets = await workflow.execute_activity_method(
            NotifyActivityStubs.notify_targets, task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=STORE_TIMEOUT, retry_policy=STORE_RETRY)
        workflow_id = workflow.info().workflow_id
        results = await asyncio.gather(*(
            workflow.execute_activity_method(
                NotifyActivityStubs.deliver_notice,
                DeliverInput(notice=notice, workflow_id=workflow_id, target=target),
                task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=DELIVER_TIMEOUT,
                schedule_to_close_timeout=DELIVER_GIVE_UP, retry_policy=DELIVER_RETRY)
            for target in targets), return_exceptions=True)
        failed = []
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, ActivityError):
                cause = result.cause
                failed.append(f"{target}: "
                              f"{cause.message if isinstance(cause, ApplicationError) else result}")
            elif isinstance(result, BaseException):
                raise result  # a cancel: not the receiver's answer
        if failed:
            raise ApplicationError(f"{notice.kind.value} {notice.subject} not delivered to "
                                   + "; ".join(failed), non_retryable=True)
        return (f"{notice.kind.value} {notice.subject} delivered to "
                f"{', '.join(targets) if targets else 'no target (none configured)'}")


@workflow.defn(name=WORKFLOW_CANT_PLACE_WATCH)
class CantPlaceWatch:
    """Sleep until the deployment has been unplaceable ``after_s``, look again, and notify
    when it still is, without a break since."""

    @workflow.run
    async def run(self, request: CantPlaceWatchInput) -> str:
        while True:
            seen = await workflow.execute_activity_method(
                NotifyActivityStubs.cant_place_since, request.deployment_id,
                task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
                retry_policy=STORE_RETRY)
            match cant_place_verdict(seen.since, seen.now, after_s=request.after_s):
                case Recovered():
                    return f"{request.deployment_id} is placeable again (or gone)"
                case WaitFor(seconds=seconds):
                    if workflow.info().is_continue_as_new_suggested():
                        workflow.continue_as_new(request)
                    await workflow.sleep(timedelta(seconds=seconds))
                case Due(since=since):
                    notice = cant_place_notice(request.deployment_id, since, seen.now,
                                               seen.reason)
                    sent = await workflow.execute_activity_method(
                        NotifyActivityStubs.send_notice, notice,
                        task_queue=CONTROL_TASK_QUEUE, start_to_close_timeout=STORE_TIMEOUT,
                        retry_policy=STORE_RETRY)
                    return f"{notice.message} ({'sent' if sent else 'sent this hour already'})"
