"""The deployment workflow calls activities through typed stubs (activities/stubs.py): each
must carry its implementation's registered name and signature, or mypy checks a call
against a shape no worker runs."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest
from temporalio import activity

from activities import stubs
from activities.demand import DemandActivities
from activities.node import NodeActivities, NodeLogActivities
from activities.routing import RoutingActivities
from activities.store import StoreActivities

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {
    **{name: getattr(StoreActivities, name) for name in (
        "place_replica", "watch_for_room", "record_event", "record_replica_state",
        "release_replica", "record_deployment_status", "delete_deployment",
        "shrink_claims", "regrow_claims", "find_eviction")},
    "drain_replica": RoutingActivities.drain_replica,
    "watch_demand": DemandActivities.watch_demand,
    **{name: getattr(NodeActivities, name) for name in (
        "start_shard", "watch_shard", "stop_shard", "sleep_shard", "wake_shard",
        "list_shards")},
    "read_engine_log": NodeLogActivities.read_engine_log,
}


def _stubs() -> list[str]:
    return sorted(name for name, value in vars(stubs).items()
                  if callable(value) and activity._Definition.from_callable(value) is not None)


def test_every_stub_has_an_implementation() -> None:
    assert _stubs() == sorted(IMPLEMENTATIONS)


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_a_stub_matches_its_implementation(name: str) -> None:
    stub, real = getattr(stubs, name), IMPLEMENTATIONS[name]
    stub_defn = activity._Definition.must_from_callable(stub)
    real_defn = activity._Definition.must_from_callable(real)
    assert stub_defn.name == real_defn.name
    stub_hints, real_hints = typing.get_type_hints(stub), typing.get_type_hints(real)
    assert stub_hints.pop("return") == real_hints.pop("return")
    # The same inputs, in order (the implementation's ``self`` aside).
    real_params = [p for p in inspect.signature(real).parameters if p != "self"]
    assert [stub_hints[p] for p in inspect.signature(stub).parameters] == [
        real_hints[p] for p in real_params]


def test_a_stub_never_runs() -> None:
    with pytest.raises(NotImplementedError, match="stub"):
        stubs._stub("x")
