"""`modelkeeper api`: the FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated

from fastapi import FastAPI, Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from modelkeeper import __version__
from modelkeeper.domain.catalog import DeploymentView
from modelkeeper.domain.events import Event, NewEvent
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
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.infra import temporal as temporal_client
from modelkeeper.infra.temporal import signal_unplaceable
from modelkeeper.names import CONTROL_TASK_QUEUE, node_task_queue
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from .deployments import add_deployment_routes
from .deps import StoreDep, TemporalDep


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


class Health(BaseModel):
    """What /healthz reports: each dependency, and whether a control worker polls."""

    status: str
    version: str
    database: bool
    temporal: bool
    control_workers: int


def create_app(settings: Settings) -> FastAPI:
    """The API application, bound to the store and Temporal named by ``settings``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.database_url is None:
            raise SystemExit("modelkeeper api: set MODELKEEPER_DATABASE_URL")
        store = await Store.connect(settings.database_url)
        try:
            app.state.store = store
            app.state.temporal = await temporal_client.connect(
                settings.temporal_address, settings.temporal_namespace, wait=30)
            yield
        finally:
            await store.close()

    app = FastAPI(title="modelkeeper", version=__version__, lifespan=lifespan)

    @app.get("/healthz", response_model=Health)
    async def healthz(response: Response, store: StoreDep, temporal: TemporalDep) -> Health:
        """Liveness of the API and its dependencies; 503 when one is down."""
        database_ok = await store.ping()
        try:
            workers = await _control_pollers(temporal, settings.temporal_namespace)
            temporal_ok = True
        except RPCError:
            workers, temporal_ok = 0, False
        ok = database_ok and temporal_ok
        if not ok:
            response.status_code = 503
        return Health(status="ok" if ok else "degraded", version=__version__,
                      database=database_ok, temporal=temporal_ok, control_workers=workers)

    def node_info(record: NodeRecord) -> NodeInfo:
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
            last_seen=record.last_seen)

    def check_join_token(authorization: str | None) -> None:
        if settings.join_token is None:
            return
        if authorization != f"Bearer {settings.join_token}":
            raise HTTPException(401, "agent registration needs the join token "
                                     "(Authorization: Bearer <MODELKEEPER_JOIN_TOKEN>)")

    @app.post("/nodes/register", response_model=AgentWelcome)
    async def register_node(reg: AgentRegistration, store: StoreDep, temporal: TemporalDep,
                            authorization: Annotated[str | None, Header()] = None,
                            ) -> AgentWelcome:
        """An agent (re)registers; the answer says where its worker must poll."""
        check_join_token(authorization)
        await store.register_node(reg)
        # What it already runs is adopted by each owning deployment's probe, and stopped by
        # the agent itself if nobody watches it within its orphan grace; logged here so an
        # operator can see what came back with the node.
        await store.record_event(NewEvent(
            kind="node.registered", node_id=reg.node_id,
            message=f"node {reg.name} registered, running {len(reg.shards)} shard(s)",
            data={"shards": [r.model_dump(mode="json") for r in reg.shards]}))
        # A node joining is exactly when an unplaceable deployment may now fit.
        await signal_unplaceable(temporal, await store.deployment_ids_with_status(
            DeploymentStatus.CANT_PLACE))
        return AgentWelcome(
            node_id=reg.node_id,
            temporal_address=settings.agent_temporal_address or settings.temporal_address,
            temporal_namespace=settings.temporal_namespace,
            task_queue=node_task_queue(reg.node_id),
            heartbeat_interval_s=settings.heartbeat_interval_s)

    @app.post("/nodes/{node_id}/heartbeat", status_code=204)
    async def heartbeat_node(node_id: str, beat: AgentHeartbeat, store: StoreDep,
                             temporal: TemporalDep,
                             authorization: Annotated[str | None, Header()] = None,
                             ) -> Response:
        """An agent's periodic report; 404 tells it to register again."""
        check_join_token(authorization)
        changed = await store.heartbeat_node(node_id, beat.inventory,
                                             settings.node_unreachable_after_s)
        if changed is None:
            raise HTTPException(404, f"node {node_id!r} is not registered")
        if changed:
            # Memory reported (nodes join in pieces), or the node is back: retry now.
            await signal_unplaceable(temporal, await store.deployment_ids_with_status(
                DeploymentStatus.CANT_PLACE))
        return Response(status_code=204)

    @app.get("/nodes", response_model=list[NodeInfo])
    async def list_nodes(store: StoreDep) -> list[NodeInfo]:
        """Every node: state, memory total/claimed/free, CPUs, labels, last seen."""
        return [node_info(n) for n in await store.list_nodes()]

    @app.get("/nodes/{node_id}", response_model=NodeInfo)
    async def get_node(node_id: str, store: StoreDep) -> NodeInfo:
        """One node; 404 when unknown."""
        record = await store.get_node(node_id)
        if record is None:
            raise HTTPException(404, f"node {node_id!r} is not registered")
        return node_info(record)

    @app.patch("/nodes/{node_id}", response_model=NodeInfo)
    async def update_node(node_id: str, update: NodeUpdate, store: StoreDep,
                          temporal: TemporalDep) -> NodeInfo:
        """Operator settings: labels and cordon. They outrank the agent's own."""
        record = await store.update_node(node_id, update)
        if record is None:
            raise HTTPException(404, f"node {node_id!r} is not registered")
        if update.cordoned is False or update.labels is not None:
            await signal_unplaceable(temporal, await store.deployment_ids_with_status(
                DeploymentStatus.CANT_PLACE))
        return node_info(record)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(store: StoreDep) -> Response:
        """Prometheus gauges per deployment, read from the store at scrape time."""
        return Response(deployment_metrics(await store.list_deployments()),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/events", response_model=list[Event])
    async def list_events(store: StoreDep, deployment_id: str | None = None,
                          limit: int = 100) -> list[Event]:
        """The audit log, newest ``limit`` entries, oldest first."""
        return await store.list_events(deployment_id=deployment_id, limit=limit)

    add_deployment_routes(app, settings)
    return app


def deployment_metrics(deployments: list[DeploymentView]) -> bytes:
    """The deployment gauges in Prometheus' text format.

    Every deployment has every series, zeros included: an alert on "ready == 0 while
    desired > 0" must be able to fire, which it cannot on a series that vanishes.
    """
    registry = CollectorRegistry()
    labels = ["deployment_id", "model_id"]
    desired = Gauge("modelkeeper_deployment_desired_replicas", "Replicas asked for.",
                    labels, registry=registry)
    ready = Gauge("modelkeeper_deployment_ready_replicas", "Replicas ready to serve.",
                  labels, registry=registry)
    parked = Gauge("modelkeeper_deployment_parked", "1 when parked after failed starts.",
                   labels, registry=registry)
    cant_place = Gauge("modelkeeper_deployment_cant_place", "1 when nothing fits.",
                       labels, registry=registry)
    failures = Gauge("modelkeeper_deployment_consecutive_failures",
                     "Failed starts in a row.", labels, registry=registry)
    for d in deployments:
        key = (d.deployment_id, d.model_id)
        desired.labels(*key).set(d.desired_replicas)
        ready.labels(*key).set(d.ready_replicas)
        parked.labels(*key).set(int(d.status is DeploymentStatus.PARKED))
        cant_place.labels(*key).set(int(d.status is DeploymentStatus.CANT_PLACE))
        failures.labels(*key).set(d.consecutive_failures)
    return generate_latest(registry)


async def _control_pollers(client: Client, namespace: str) -> int:
    """How many worker identities poll the control task queue (activities or workflows)."""
    identities: set[str] = set()
    for queue_type in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
                       TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
        resp = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(namespace=namespace,
                                     task_queue=TaskQueue(name=CONTROL_TASK_QUEUE),
                                     task_queue_type=queue_type)
        )
        identities.update(p.identity for p in resp.pollers)
    return len(identities)
