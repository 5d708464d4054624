"""The notification workflows' activities (control queue): the targets, one delivery, and
the store read behind "cant_place for longer than N" (docs/operations.md,
"Notifications").

A delivery is at least once: a worker killed after the receiver answered but before
Temporal heard of it sends again, with the same ``Idempotency-Key``, so the receiver can
drop the repeat. Slack has no such key: a repeat there is possible, and rare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from modelkeeper.domain.notify import (
    CantPlaceSeen,
    DeliverInput,
    Notice,
    delivered,
    worth_retrying,
)
from modelkeeper.infra.notify import (
    configured_targets,
    post_notice,
    read_notify_secret,
    start_notice,
)
from modelkeeper.names import (
    ACTIVITY_CANT_PLACE_SINCE,
    ACTIVITY_DELIVER_NOTICE,
    ACTIVITY_NOTIFY_TARGETS,
    ACTIVITY_SEND_NOTICE,
    ERROR_NOTICE_REFUSED,
)
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from .notify_stubs import NotifyActivityStubs


class NotifyActivities(NotifyActivityStubs):
    """Bound to the worker's settings (the targets and secret), store and client."""

    def __init__(self, settings: Settings, store: Store, client: Client) -> None:
        self._settings = settings
        self._store = store
        self._client = client
        # Read at start: a worker with webhooks and no secret stops with one line.
        self._secret = read_notify_secret(settings)

    @activity.defn(name=ACTIVITY_NOTIFY_TARGETS)
    async def notify_targets(self) -> list[str]:
        """The names of the targets this worker's settings list (never their URLs, which
        would land in the history). Timeout: the store's 10 s; it reads no store."""
        return [t.name for t in configured_targets(self._settings)]

    @activity.defn(name=ACTIVITY_DELIVER_NOTICE)
    async def deliver_notice(self, request: DeliverInput) -> int:
        """POST the notice to the target named; its 2xx status.

        No answer, a 5xx, 408, 425 or 429 raises a retryable error (the workflow's policy
        backs off). Another 4xx raises non-retryable ``ERROR_NOTICE_REFUSED``: a wrong
        URL or a revoked hook does not mend itself. A target no longer in the settings
        (removed since the notice began) is refused too."""
        target = next((t for t in configured_targets(self._settings)
                       if t.name == request.target), None)
        if target is None:
            raise ApplicationError(f"target {request.target!r} is no longer configured",
                                   type=ERROR_NOTICE_REFUSED, non_retryable=True)
        async with httpx.AsyncClient() as http:
            result = await post_notice(http, target, request.notice,
                                       workflow_id=request.workflow_id, secret=self._secret)
        if result.status is not None and delivered(result.status):
            return result.status
        if result.status is None or worth_retrying(result.status):
            raise ApplicationError(f"not delivered, will retry: {result.detail}")
        raise ApplicationError(f"refused: {result.detail}", type=ERROR_NOTICE_REFUSED,
                               non_retryable=True)

    @activity.defn(name=ACTIVITY_CANT_PLACE_SINCE)
    async def cant_place_since(self, deployment_id: str) -> CantPlaceSeen:
        """When the deployment's current unplaceable stretch began (one read)."""
        return await self._store.events.cant_place_since(deployment_id)

    @activity.defn(name=ACTIVITY_SEND_NOTICE)
    async def send_notice(self, notice: Notice) -> bool:
        """Start the notice's workflow; False when it was sent this hour already."""
        return await start_notice(self._client, notice, self._settings)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the control worker to register."""
        return [self.notify_targets, self.deliver_notice, self.cant_place_since,
                self.send_notice]
