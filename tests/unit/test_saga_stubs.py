"""The sagas (and the schedule windows' workflow) call their activities through stubs
(activities/saga_stubs.py); the worker registers the classes that run them. mypy checks
each implementation's signature against its stub; these check what mypy cannot: that each
runs under its stub's name (the name a saga's history records), and that the worker
registers every one."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio import activity

from activities.moves import MoveActivities
from activities.operations import OperationsActivities
from activities.saga_stubs import (
    MoveActivityStubs,
    OperationsActivityStubs,
    WindowActivityStubs,
)
from activities.windows import WindowActivities

PAIRS: list[tuple[type[Any], type[Any]]] = [
    (MoveActivityStubs, MoveActivities),
    (OperationsActivityStubs, OperationsActivities),
    (WindowActivityStubs, WindowActivities),
]


def _stubs(stub: type[Any]) -> list[str]:
    return [name for name, fn in vars(stub).items()
            if activity._Definition.from_callable(fn) is not None]


@pytest.mark.parametrize(("stub", "runner"), PAIRS, ids=lambda c: c.__name__)
def test_each_activity_runs_under_its_stubs_name(stub: type[Any], runner: type[Any]) -> None:
    names = _stubs(stub)
    assert names
    for name in names:
        stubbed = activity._Definition.must_from_callable(getattr(stub, name))
        run = activity._Definition.must_from_callable(getattr(runner, name))
        assert run.fn is not stubbed.fn, f"{runner.__name__}.{name} does not override it"
        assert (run.name, run.arg_types, run.ret_type) == (
            stubbed.name, stubbed.arg_types, stubbed.ret_type)


@pytest.mark.parametrize(("stub", "runner"), PAIRS, ids=lambda c: c.__name__)
def test_the_worker_registers_every_stubbed_activity(stub: type[Any],
                                                     runner: type[Any]) -> None:
    instance = runner.__new__(runner)  # all() only lists bound methods: no client, no store
    registered = {activity._Definition.must_from_callable(fn).name for fn in instance.all()}
    assert {activity._Definition.must_from_callable(getattr(stub, n)).name
            for n in _stubs(stub)} <= registered
