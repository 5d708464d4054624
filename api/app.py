"""`modelkeeper api`: the FastAPI application.

The routes live on module-level routers (``monitoring``, ``agents`` and ``liveness`` (what
agents call), ``nodes``, ``deployments``,
``operations``) and reach the store, Temporal and the settings through the dependencies in
``deps``, all read from ``app.state``: building an app is only wiring.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from modelkeeper import __version__
from modelkeeper.infra import temporal as temporal_client
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from . import agents, deployments, liveness, monitoring, nodes, operations


def create_app(settings: Settings) -> FastAPI:
    """The API application, bound to the store and Temporal named by ``settings``."""
    app = FastAPI(title="modelkeeper", version=__version__, lifespan=_lifespan)
    app.state.settings = settings
    app.include_router(monitoring.router)
    app.include_router(agents.router)
    app.include_router(nodes.router)
    app.include_router(liveness.router)
    app.include_router(deployments.router)
    app.include_router(operations.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Connect the store and Temporal for the app's lifetime; the routes find them on state.

    Also the nodes' liveness (in memory), whose streams end as soon as a shutdown signal
    arrives (see :func:`liveness.end_streams_on_shutdown_signal`).
    """
    settings: Settings = app.state.settings
    if settings.database_url is None:
        raise SystemExit("modelkeeper api: set MODELKEEPER_DATABASE_URL")
    store = await Store.connect(settings.database_url)
    follow = liveness.Liveness(silent_after_s=settings.node_silent_after_s)
    restore_signals = liveness.end_streams_on_shutdown_signal(follow)
    try:
        app.state.store = store
        app.state.liveness = follow
        app.state.temporal = await temporal_client.connect(
            settings.temporal_address, settings.temporal_namespace, wait=30)
        yield
    finally:
        follow.closing.set()
        restore_signals()
        await store.close()
