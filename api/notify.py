"""``POST /notify/test`` (admin): send a test notification to each configured target now,
and answer what each said (docs/operations.md, "Notifications").

Straight from the API, not through the notification workflow: the operator wants each
target's answer while waiting, and a test is worth nothing retried an hour later. The
targets are the API's own settings; the worker sends the real notices with its own, so
give both processes the same ones (`up` does).
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
from fastapi import APIRouter, HTTPException

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.notify import delivered, notice_workflow_id, trial_notice
from modelkeeper.infra.notify import (
    NotifyConfigError,
    configured_targets,
    post_notice,
    read_notify_secret,
)

from .auth import OperatorDep, change
from .deps import SettingsDep, StoreDep
from .problems import problems

router = APIRouter()


class TargetResult(Frozen):
    """What one target answered."""

    target: str
    format: str
    delivered: bool
    #: The HTTP status, or None when no answer came (refused, timed out).
    status: int | None
    detail: str


class NotifyTestResult(Frozen):
    """Each target's answer, in the settings' order."""

    results: list[TargetResult]


@router.post("/notify/test", response_model=NotifyTestResult, responses=problems(409))
async def notify_test(settings: SettingsDep, store: StoreDep,
                      operator: OperatorDep) -> NotifyTestResult:
    """Send a ``notify.test`` notice to every target; 409 when none is configured or the
    webhooks' secret cannot be read."""
    targets = configured_targets(settings)
    if not targets:
        raise HTTPException(409, "no notification target is configured: set "
                                 "MODELKEEPER_NOTIFY_WEBHOOK_URLS or "
                                 "MODELKEEPER_NOTIFY_SLACK_URLS for the API and the worker")
    try:
        secret = read_notify_secret(settings)
    except NotifyConfigError as err:
        raise HTTPException(409, str(err)) from None
    notice = trial_notice(now=datetime.now(UTC), actor=operator.name)
    workflow_id = notice_workflow_id(notice)
    results = []
    async with httpx.AsyncClient() as http:
        for target in targets:
            posted = await post_notice(http, target, notice, workflow_id=workflow_id,
                                       secret=secret)
            results.append(TargetResult(
                target=target.name, format=target.format.value,
                delivered=posted.status is not None and delivered(posted.status),
                status=posted.status, detail=posted.detail))
    await store.events.record_event(change(
        operator, "notify.test", "test notification: " + "; ".join(
            f"{r.target} {'delivered' if r.delivered else 'failed'}" for r in results),
        data={"results": [r.model_dump(mode="json") for r in results]}))
    return NotifyTestResult(results=results)
