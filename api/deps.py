"""FastAPI dependencies shared by the route modules."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from temporalio.client import Client

from modelkeeper.store import Store


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _temporal(request: Request) -> Client:
    client: Client = request.app.state.temporal
    return client


StoreDep = Annotated[Store, Depends(_store)]
TemporalDep = Annotated[Client, Depends(_temporal)]
