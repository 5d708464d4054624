"""Activities that read and write the PostgreSQL store."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import activity

from modelkeeper.domain import Event, NewEvent
from modelkeeper.store import Store

#: Store calls are short; a minute covers a slow database without hiding a dead one.
STORE_ACTIVITY_TIMEOUT = timedelta(seconds=30)


class StoreActivities:
    """Activities bound to one store connection pool."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @activity.defn(name="record_event")
    async def record_event(self, event: NewEvent) -> Event:
        """Append an entry to the audit log."""
        return await self._store.record_event(event)

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the worker to register."""
        return [self.record_event]
