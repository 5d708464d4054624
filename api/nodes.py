"""Routes for nodes as operators see them: the list, one node, and the operator's settings
(labels, cordon). What agents send (registration, heartbeats) is in ``agents``; their
liveness stream in ``liveness``."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel

from modelkeeper.domain.nodes import (
    GpuInfo,
    NodeRecord,
    NodeState,
    NodeUpdate,
    node_state,
)
from modelkeeper.settings import Settings

from .deps import SettingsDep, StoreDep, TemporalDep
from .signals import signal_waiting_deployments

router = APIRouter()


class NodeInfo(BaseModel):
    """A node as `GET /nodes` shows it. Null memory means the agent does not report it."""

    node_id: str
    name: str
    state: NodeState
    memory_total_bytes: int | None
    memory_claimed_bytes: int
    memory_free_bytes: int | None
    memory_available_bytes: int | None
    cpu_count: int | None
    cpu_claimed: float
    gpus: list[GpuInfo]
    gpus_claimed: list[int]
    labels: dict[str, str]
    agent_labels: dict[str, str]
    operator_labels: dict[str, str]
    cordoned: bool
    cordon_reason: str | None
    last_seen: datetime
    #: Since when the liveness channel finds the node silent (its state is unreachable).
    silent_since: datetime | None = None


def node_info(record: NodeRecord, settings: Settings) -> NodeInfo:
    """The API's view of a stored node; its state is judged now, by the settings' timeouts."""
    total = record.memory_total_bytes
    return NodeInfo(
        node_id=record.node_id, name=record.name,
        state=node_state(record, datetime.now(UTC),
                         unreachable_after_s=settings.node_unreachable_after_s,
                         lost_after_s=settings.node_lost_after_s),
        memory_total_bytes=total, memory_claimed_bytes=record.memory_claimed_bytes,
        memory_free_bytes=None if total is None else total - record.memory_claimed_bytes,
        memory_available_bytes=record.memory_available_bytes,
        cpu_count=record.cpu_count, cpu_claimed=record.cpu_claimed, gpus=record.gpus,
        gpus_claimed=record.gpus_claimed, labels=record.labels,
        agent_labels=record.agent_labels, operator_labels=record.operator_labels,
        cordoned=record.cordoned, cordon_reason=record.cordon_reason,
        last_seen=record.last_seen, silent_since=record.silent_since)


@router.get("/nodes", response_model=list[NodeInfo])
async def list_nodes(store: StoreDep, settings: SettingsDep) -> list[NodeInfo]:
    """Every node: state, memory total/claimed/free, CPUs, labels, last seen."""
    return [node_info(n, settings) for n in await store.list_nodes()]


@router.get("/nodes/{node_id}", response_model=NodeInfo)
async def get_node(node_id: str, store: StoreDep, settings: SettingsDep) -> NodeInfo:
    """One node; 404 when unknown."""
    record = await store.get_node(node_id)
    if record is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    return node_info(record, settings)


@router.patch("/nodes/{node_id}", response_model=NodeInfo)
async def update_node(node_id: str, update: NodeUpdate, store: StoreDep, *,
                      temporal: TemporalDep, settings: SettingsDep) -> NodeInfo:
    """Operator settings: labels and cordon. They outrank the agent's own."""
    record = await store.update_node(node_id, update)
    if record is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    if update.cordoned is False or update.labels is not None:
        # Uncordoned or relabelled: a node a waiting deployment was refused may take it now.
        await signal_waiting_deployments(store, temporal)
    return node_info(record, settings)
