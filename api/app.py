"""`modelkeeper api`: the FastAPI application.

The routes live on module-level routers (``monitoring``, ``agents`` and ``liveness`` (what
agents call), ``nodes``, ``measured``, ``deployments``,
``operations``, ``windows``, ``quotas``) and reach the store, Temporal and the settings through the
dependencies in ``deps``, all read from ``app.state``: building an app is only wiring.

Who may call what is wired here too (``auth``): every route answers only to the allowed
Host names, and the operators' routers need an operator token, checked before anything of
the request is read; health and the agents' routes do not. Then the bounds on what any
client sends (``limits``): bodies, and strings the store cannot hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from modelkeeper import __version__
from modelkeeper.domain.liveness import Deadlines
from modelkeeper.infra import temporal as temporal_client
from modelkeeper.infra.network import is_wildcard
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from . import (
    agents,
    auth,
    deployments,
    limits,
    liveness,
    measured,
    monitoring,
    nodes,
    notify,
    operations,
    quotas,
    room,
    spec,
    swagger,
    windows,
)

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    """The API application, bound to the store and Temporal named by ``settings``."""
    app = FastAPI(title="modelkeeper", version=__version__, lifespan=_lifespan,
                  # FastAPI's pages load their scripts from a CDN: swagger serves its own.
                  docs_url=None, redoc_url=None,
                  # Every string a route reads refused with a 422 if the store cannot
                  # hold it (NUL, lone surrogates), before any route sees it.
                  dependencies=[Depends(limits.refuse_unstorable)])
    app.state.settings = settings
    swagger.install(app)
    spec.install(app)
    if not settings.api_auth:
        log.warning("api_auth is off: anyone who reaches this API may deploy, delete and "
                    "cordon without a token")
    # On the router, not per route: a route added to an operator router later is guarded.
    guarded = [Depends(auth.require_operator)]
    routers = [(monitoring.health, False), (monitoring.router, True), (agents.router, False),
               (nodes.router, True), (liveness.router, False),
               # Before deployments: its /models/{model_id:path} would take x/headroom and
               # x/capacity as model ids.
               (room.router, True), (measured.router, True), (deployments.router, True),
               (operations.router, True), (windows.router, True), (quotas.router, True),
               (notify.router, True)]
    for router, operators in routers:
        if operators:
            app.include_router(router, dependencies=guarded, responses=auth.AUTH_RESPONSES)
        else:
            app.include_router(router)
    # Middleware, innermost first. The body limit, sparing only the liveness streams (and
    # 422s that echo any input); outside it, the operators' token, checked before anything
    # of a body is read; outermost, the Host, refused before any token lookup.
    app.add_exception_handler(quotas.QuotaExceeded, quotas.quota_exceeded)
    limits.install(app, streams=liveness.router.routes)
    app.add_middleware(auth.OperatorsFirst, routes=[
        (route, operators) for router, operators in routers for route in router.routes])
    app.add_middleware(auth.HostAllowlist, allowed=auth.allowed_hosts(settings),
                       own_addresses=auth.OwnAddresses() if is_wildcard(settings.bind_host)
                       else None)
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
    follow = liveness.Liveness(deadlines=Deadlines(
        silent_after_s=settings.node_silent_after_s,
        max_silent_after_s=settings.node_silent_after_max_s,
        calm_after_s=settings.node_silent_calm_after_s))
    restore_signals = liveness.end_streams_on_shutdown_signal(follow)
    lag = asyncio.create_task(follow.lag.run(), name="loop-lag")
    try:
        app.state.store = store
        app.state.liveness = follow
        app.state.temporal = await temporal_client.connect(
            settings.temporal_address, settings.temporal_namespace,
            security=temporal_client.security_from_settings(settings), wait=30)
        yield
    finally:
        follow.closing.set()
        lag.cancel()
        restore_signals()
        await store.close()
