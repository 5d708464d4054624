"""The notification workflows' activities as they call them: names, inputs and results,
with no body (as :mod:`activities.saga_stubs` does for the sagas). ``activities.notify``
subclasses them with the store, the settings and HTTP, which workflows must not import.

Imports nothing but the domain, the names and ``temporalio.activity``, so a workflow may
pass it through its sandbox. The names are in every notification's history: keep them.
"""

from __future__ import annotations

from temporalio import activity

from modelkeeper.domain.notify import CantPlaceSeen, DeliverInput, Notice
from modelkeeper.names import (
    ACTIVITY_CANT_PLACE_SINCE,
    ACTIVITY_DELIVER_NOTICE,
    ACTIVITY_NOTIFY_TARGETS,
    ACTIVITY_SEND_NOTICE,
)


class NotifyActivityStubs:
    """What the notification workflows ask of the control worker."""

    @activity.defn(name=ACTIVITY_NOTIFY_TARGETS)
    async def notify_targets(self) -> list[str]:
        """The names of the targets the worker's settings list."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_DELIVER_NOTICE)
    async def deliver_notice(self, request: DeliverInput) -> int:
        """POST the notice to one target; the receiver's 2xx status."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_CANT_PLACE_SINCE)
    async def cant_place_since(self, deployment_id: str) -> CantPlaceSeen:
        """When the deployment's unplaceable stretch began, by the database's clock."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_SEND_NOTICE)
    async def send_notice(self, notice: Notice) -> bool:
        """Start the notice's own workflow (de-duplicated per hour)."""
        raise NotImplementedError
