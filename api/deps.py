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


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _temporal(request: Request) -> Client:
    client: Client = request.app.state.temporal
    return client


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(_store)]
TemporalDep = Annotated[Client, Depends(_temporal)]
SettingsDep = Annotated[Settings, Depends(_settings)]
