"""The append-only audit log's entries, before and after the store numbers them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from .base import Tolerant
from .ids import DeploymentId, NodeId, ReplicaId


class NewEvent(Tolerant):
    """An entry for the append-only audit log, before the store numbers it."""

    kind: str = Field(min_length=1, max_length=64)
    message: str
    deployment_id: DeploymentId | None = None
    node_id: NodeId | None = None
    replica_id: ReplicaId | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    #: The operator token's name behind a change made through the API; None for what the
    #: system records itself (the keeper, agents, the sweeper).
    actor: str | None = None


class Event(NewEvent):
    """An audit-log entry as stored."""

    event_id: int
    at: datetime


#: A kind filter ending in this matches every kind that starts with it (``replica.``
#: matches ``replica.ready`` and ``replica.failed``); any other filter matches one kind.
KIND_PREFIX_MARK = "."


class EventFilter(Tolerant):
    """Which audit entries a live stream (GET /events/stream) sends: those of one
    deployment, one node, one kind or kind prefix, or any combination (all must hold).
    None: any. Ids here, never names: the API resolves a name before it builds one."""

    deployment_id: DeploymentId | None = None
    node_id: NodeId | None = None
    #: An exact kind (``deployment.created``), or a prefix ending in ``.`` (``replica.``).
    kind: str | None = None

    @property
    def kind_prefix(self) -> str | None:
        """The prefix a kind must start with, when ``kind`` is one (ends in ``.``)."""
        if self.kind is not None and self.kind.endswith(KIND_PREFIX_MARK):
            return self.kind
        return None

    def matches(self, event: Event) -> bool:
        """Whether ``event`` passes every part of the filter that is set."""
        if self.deployment_id is not None and event.deployment_id != self.deployment_id:
            return False
        if self.node_id is not None and event.node_id != self.node_id:
            return False
        if self.kind is None:
            return True
        prefix = self.kind_prefix
        return event.kind.startswith(prefix) if prefix is not None else event.kind == self.kind
