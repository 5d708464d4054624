"""Routes agents call: registration and heartbeats (their liveness stream is in
``liveness``). Kept apart from the operators' routes: agents authenticate as nodes, not as
operators."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Response

from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.nodes import AgentHeartbeat, AgentRegistration, AgentWelcome
from modelkeeper.names import node_task_queue
from modelkeeper.settings import Settings

from .deps import SettingsDep, StoreDep, TemporalDep
from .signals import signal_waiting_deployments

router = APIRouter()


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
