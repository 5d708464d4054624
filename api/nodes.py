"""Routes for nodes: agent registration and heartbeats, and the operator's view and settings."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Response
from pydantic import BaseModel

from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.nodes import (
    AgentHeartbeat,
    AgentRegistration,
    AgentWelcome,
    GpuInfo,
    NodeRecord,
    NodeState,
    NodeUpdate,
    node_state,
)
from modelkeeper.names import node_task_queue
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


def check_join_token(authorization: str | None, settings: Settings) -> None:
    """401 unless the agent presents the join token (when one is set).

    Called from the route body rather than declared as a dependency: a dependency would be
    checked before the request body, turning a malformed body's 422 into a 401.
    """
    if settings.join_token is None:
        return
    if authorization != f"Bearer {settings.join_token}":
        raise HTTPException(401, "agent registration needs the join token "
                                 "(Authorization: Bearer <MODELKEEPER_JOIN_TOKEN>)")


@router.post("/nodes/register", response_model=AgentWelcome)
async def register_node(reg: AgentRegistration, store: StoreDep, temporal: TemporalDep, *,
                        settings: SettingsDep,
                        authorization: Annotated[str | None, Header()] = None,
                        ) -> AgentWelcome:
    """An agent (re)registers; the answer says where its worker must poll."""
    check_join_token(authorization, settings)
    await store.register_node(reg)
    # What it already runs is adopted by each owning deployment's probe, and stopped by
    # the agent itself if nobody watches it within its orphan grace; logged here so an
    # operator can see what came back with the node.
    await store.record_event(NewEvent(
        kind="node.registered", node_id=reg.node_id,
        message=f"node {reg.name} registered, running {len(reg.shards)} shard(s)",
        data={"shards": [r.model_dump(mode="json") for r in reg.shards]}))
    # A node joining is exactly when an unplaceable deployment may now fit.
    await signal_waiting_deployments(store, temporal)
    return AgentWelcome(
        node_id=reg.node_id,
        temporal_address=settings.agent_temporal_address or settings.temporal_address,
        temporal_namespace=settings.temporal_namespace,
        task_queue=node_task_queue(reg.node_id),
        heartbeat_interval_s=settings.heartbeat_interval_s)


@router.post("/nodes/{node_id}/heartbeat", status_code=204)
async def heartbeat_node(node_id: str, beat: AgentHeartbeat, store: StoreDep, *,
                         temporal: TemporalDep, settings: SettingsDep,
                         authorization: Annotated[str | None, Header()] = None,
                         ) -> Response:
    """An agent's periodic report; 404 tells it to register again. It also clears a
    liveness silence that began before it arrived (see ``Store.heartbeat_node``)."""
    received_at = datetime.now(UTC)
    check_join_token(authorization, settings)
    changed = await store.heartbeat_node(node_id, beat.inventory,
                                         settings.node_unreachable_after_s,
                                         received_at=received_at)
    if changed is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    if changed:
        # Memory reported (nodes join in pieces), or the node is back: retry now.
        await signal_waiting_deployments(store, temporal)
    return Response(status_code=204)


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
