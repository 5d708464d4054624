"""FastAPI dependencies shared by the route modules.

The routers are module-level, so what a route needs comes from the application's state
(set by ``create_app`` and its lifespan) rather than from a closure.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from temporalio.client import Client

from modelkeeper.settings import Settings
from modelkeeper.store import Store

# Each is ``async def``, though none awaits: FastAPI runs a plain ``def`` dependency in its
# thread pool, a thread hand-off each, queued behind the pool's 40 threads. Three of them
# per heartbeat were 22,000 hand-offs in a minute of a 100-node fleet (bench/scale's
# profile of the API).

async def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def _temporal(request: Request) -> Client:
    client: Client = request.app.state.temporal
    return client


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(_store)]
TemporalDep = Annotated[Client, Depends(_temporal)]
SettingsDep = Annotated[Settings, Depends(_settings)]
