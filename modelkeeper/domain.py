"""Domain models shared by every component. Pure: no temporalio, httpx or asyncpg here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .ids import DeploymentId, NodeId, ReplicaId


class Frozen(BaseModel):
    """Base for value objects: immutable, and strict about unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class NewEvent(Frozen):
    """An entry for the append-only audit log, before the store numbers it."""

    kind: str = Field(min_length=1, max_length=64)
    message: str
    deployment_id: DeploymentId | None = None
    node_id: NodeId | None = None
    replica_id: ReplicaId | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class Event(NewEvent):
    """An audit-log entry as stored."""

    event_id: int
    at: datetime
