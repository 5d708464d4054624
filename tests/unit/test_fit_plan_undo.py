"""A fit plan's undo (api/room.py ``undo_all``): every applied action undone in reverse
order, each through the same path as an operator's (a sleep by a wake, a scale-down by
scaling back), and each undo that fails reported in ``rollback_incomplete`` with why,
while the others are still undone. The paths are recorded here instead of sent to
Temporal: what is tested is the order and the report (the API test on PostgreSQL and
Temporal, tests/integration/test_api_room.py, undoes a real scale-down)."""

from __future__ import annotations

import pytest
from fastapi import HTTPException

from api.room import undo_all
from modelkeeper.domain.fit_plans import ActionKind, PlanAction
from modelkeeper.domain.ids import DeploymentId, NodeId, ReplicaId

pytestmark = pytest.mark.timeout(10)


class Recorded:
    """The routes' paths as calls, one of them refused as the workflow would refuse it."""

    def __init__(self, refuse: str | None = None) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.refuse = refuse

    def _call(self, verb: str, deployment_id: str, arg: object) -> None:
        self.calls.append((verb, deployment_id, arg))
        if deployment_id == self.refuse:
            raise HTTPException(409, f"deployment {deployment_id} has no running workflow "
                                     "(it is being removed)")

    async def sleep(self, deployment_id: DeploymentId, replica_id: str) -> None:
        self._call("sleep", deployment_id, replica_id)

    async def wake(self, deployment_id: DeploymentId, replica_id: str) -> None:
        self._call("wake", deployment_id, replica_id)

    async def scale(self, deployment_id: DeploymentId, replicas: int) -> None:
        self._call("scale", deployment_id, replicas)


SLEEP = PlanAction(kind=ActionKind.SLEEP, deployment_id=DeploymentId("d-a"),
                   replica_id=ReplicaId("d-a-r1"), node_id=NodeId("n1"), frees_bytes=1,
                   text="sleep d-a's replica d-a-r1")
DOWN = PlanAction(kind=ActionKind.SCALE_DOWN, deployment_id=DeploymentId("d-b"),
                  replica_id=ReplicaId("d-b-r2"), node_id=NodeId("n1"), frees_bytes=1,
                  replicas_from=2, replicas_to=1, text="scale d-b down from 2 to 1")


async def test_undone_in_reverse_through_the_opposite_paths() -> None:
    acts = Recorded()
    assert await undo_all(acts, [SLEEP, DOWN]) == []
    assert acts.calls == [("scale", "d-b", 2), ("wake", "d-a", "d-a-r1")]


async def test_an_undo_that_fails_is_reported_and_the_rest_still_undone() -> None:
    acts = Recorded(refuse="d-b")
    assert await undo_all(acts, [SLEEP, DOWN]) == [
        {"action": "scale d-b down from 2 to 1",
         "error": "deployment d-b has no running workflow (it is being removed)"}]
    assert acts.calls == [("scale", "d-b", 2), ("wake", "d-a", "d-a-r1")]
