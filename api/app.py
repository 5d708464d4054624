"""`modelkeeper api`: the FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from modelkeeper import __version__, temporal_client
from modelkeeper.domain import Event
from modelkeeper.names import CONTROL_TASK_QUEUE
from modelkeeper.settings import Settings
from modelkeeper.store import Store


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
            app.state.temporal = await temporal_client.connect(settings, wait=30)
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

    @app.get("/events", response_model=list[Event])
    async def list_events(store: StoreDep, deployment_id: str | None = None,
                          limit: int = 100) -> list[Event]:
        """The audit log, newest ``limit`` entries, oldest first."""
        return await store.list_events(deployment_id=deployment_id, limit=limit)

    return app


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _temporal(request: Request) -> Client:
    client: Client = request.app.state.temporal
    return client


StoreDep = Annotated[Store, Depends(_store)]
TemporalDep = Annotated[Client, Depends(_temporal)]


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
