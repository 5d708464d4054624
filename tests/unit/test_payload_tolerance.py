"""Every payload an activity takes or returns ignores fields it does not know.

During a rolling upgrade the workflow worker, the control activities and the agents run
different versions: a newer workflow sends an older agent (or control worker) an input with
a field it has not heard of, and an older activity answers a newer workflow. A strict
model would fail that activity on decode, and it is retried until its timeout: a start
that never happens, a store write that never lands. So each one is a ``Tolerant`` model
(modelkeeper/domain/base.py). This test finds the payloads from the activity definitions
themselves, so a new activity with a strict payload fails it.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel

from activities.moves import MoveActivities
from activities.node import NodeActivities
from activities.operations import OperationsActivities
from activities.routing import RoutingActivities
from activities.store import StoreActivities

GROUPS = [StoreActivities, RoutingActivities, OperationsActivities, MoveActivities,
          NodeActivities]


def _models(hint: Any) -> list[type[BaseModel]]:
    """The pydantic models in a type hint (``list[X]``, ``X | None`` included)."""
    if inspect.isclass(hint) and issubclass(hint, BaseModel):
        return [hint]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is not None:
        return [m for arg in typing.get_args(hint) for m in _models(arg)]
    return []


def _payloads() -> list[tuple[str, type[BaseModel]]]:
    found = []
    for group in GROUPS:
        for name, fn in inspect.getmembers(group, inspect.isfunction):
            if not hasattr(fn, "__temporal_activity_definition"):
                continue
            hints = typing.get_type_hints(fn)
            for hint in hints.values():
                found += [(f"{group.__name__}.{name}", m) for m in _models(hint)]
    return found


PAYLOADS = _payloads()


def test_the_activities_are_found() -> None:
    # Guards the finder itself: were it to find nothing, the test below would pass empty.
    names = {where.split(".")[1] for where, _ in PAYLOADS}
    assert {"place_replica", "start_shard", "record_event", "drain_replica"} <= names


@pytest.mark.parametrize(("where", "model"), PAYLOADS,
                         ids=[f"{w}:{m.__name__}" for w, m in PAYLOADS])
def test_an_activity_payload_ignores_fields_it_does_not_know(
        where: str, model: type[BaseModel]) -> None:
    assert model.model_config.get("extra") == "ignore", (
        f"{model.__name__} ({where}) refuses unknown fields: make it Tolerant")
