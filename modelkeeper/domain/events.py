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
