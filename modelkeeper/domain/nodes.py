"""Nodes: what agents report, what operators set, and the node state. Pure."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from .base import Frozen, Tolerant
from .ids import NodeId, ReplicaId
from .shards import ShardReport


class NodeState(StrEnum):
    """A node's state as placement and the API see it."""

    READY = "ready"
    UNREACHABLE = "unreachable"
    LOST = "lost"
    CORDONED = "cordoned"


class GpuInfo(Frozen):
    """One GPU as the agent reports it."""

    index: int = Field(ge=0)
    name: str
    memory_bytes: int = Field(ge=0)
    healthy: bool = True


class Inventory(Frozen):
    """A node's capacity. ``None`` memory means unknown (an older agent), shown as "-"."""

    memory_total_bytes: int | None = Field(default=None, ge=0)
    memory_available_bytes: int | None = Field(default=None, ge=0)
    cpu_count: int | None = Field(default=None, ge=0)
    gpus: list[GpuInfo] = Field(default_factory=list)


class AgentRegistration(Frozen):
    """What an agent sends when it (re)registers."""

    node_id: NodeId = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=253)
    labels: dict[str, str] = Field(default_factory=dict)
    inventory: Inventory
    shards: list[ShardReport] = Field(default_factory=list)
    agent_version: str = ""


class AgentHeartbeat(Frozen):
    """An agent's periodic report."""

    inventory: Inventory
    shards: list[ShardReport] = Field(default_factory=list)


class AgentWelcome(Frozen):
    """The API's answer to a registration: where the agent's worker must poll."""

    node_id: NodeId
    temporal_address: str
    temporal_namespace: str
    task_queue: str
    heartbeat_interval_s: float


class NodeRecord(Frozen):
    """A node as stored, with what its replicas claim on it."""

    node_id: NodeId
    name: str
    agent_labels: dict[str, str]
    operator_labels: dict[str, str]
    cordoned: bool
    cordon_reason: str | None
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    cpu_count: int | None
    gpus: list[GpuInfo]
    last_seen: datetime
    registered_at: datetime
    #: When the API's liveness channel found the node silent; None while it is not.
    silent_since: datetime | None = None
    memory_claimed_bytes: int = 0
    cpu_claimed: float = 0.0
    gpus_claimed: list[int] = Field(default_factory=list)

    @property
    def labels(self) -> dict[str, str]:
        """Effective labels: the operator's outrank the agent's."""
        return {**self.agent_labels, **self.operator_labels}


class NodeUpdate(Frozen):
    """Operator settings for a node (PATCH /nodes/{id}); both survive re-registration."""

    labels: dict[str, str] | None = None
    cordoned: bool | None = None
    cordon_reason: str | None = Field(default=None, max_length=500)


class NodeSilentInput(Tolerant):
    """Payload of the ``node_silent`` signal (``names.SIGNAL_NODE_SILENT``): the API found
    ``node_id`` silent, and these replicas of the signalled deployment hold a claim there.

    Tolerant: the API and the workflow's worker may run different versions.
    """

    node_id: NodeId
    replica_ids: list[ReplicaId]


def node_state(record: NodeRecord, now: datetime, *, unreachable_after_s: float,
               lost_after_s: float) -> NodeState:
    """The node's state at ``now`` from its last heartbeat, its liveness and its cordon.

    1. Lost: no heartbeat for ``lost_after_s``. Lost outranks cordoned: an operator looking
       at a cordoned node that stopped reporting must see that it is gone, not just fenced
       off.
    2. Cordoned.
    3. Unreachable: no heartbeat for ``unreachable_after_s``, or found silent by the
       liveness channel (``silent_since``), which notices a dead agent in about a second
       rather than after several missed heartbeats.
    4. Ready.
    """
    quiet = (now - record.last_seen).total_seconds()
    if quiet >= lost_after_s:
        return NodeState.LOST
    if record.cordoned:
        return NodeState.CORDONED
    if quiet >= unreachable_after_s or record.silent_since is not None:
        return NodeState.UNREACHABLE
    return NodeState.READY
