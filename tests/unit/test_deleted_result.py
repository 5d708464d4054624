"""The deployment workflow's result once deleted (workflows/deployment_state.py): a
sentence for the web UI, from the delete as the workflow received it."""

from __future__ import annotations

from datetime import UTC, datetime

from modelkeeper.domain.ids import DeploymentId, ModelId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec, KeeperState, Phase, Replica
from workflows.deployment_state import Deletion, deleted_result, deletion

AT = datetime(2026, 12, 4, 18, 20, 5, tzinfo=UTC)


def _keeper(*nodes: list[str]) -> KeeperState:
    spec = DeploymentSpec(deployment_id=DeploymentId("d-1"), model_id=ModelId("sim-a"),
                          replicas=len(nodes))
    return KeeperState(spec=spec, replicas=[
        Replica(replica_id=ReplicaId(f"d-1-r{i}"), nodes=n,
                phase=Phase.READY if n else Phase.PLACING) for i, n in enumerate(nodes)])


def test_it_names_who_when_and_the_replicas_that_held_a_place() -> None:
    keeper = _keeper(["n1"], ["n2"], [])  # the third was never placed: nothing to stop
    asked = deletion(keeper, requested_by="alice", now=AT)
    assert deleted_result(keeper, asked) == (
        "Deployment d-1 (sim-a) deleted by alice at 2026-12-04 18:20:05 UTC: "
        "2 replicas stopped")


def test_one_replica_and_an_unnamed_requester() -> None:
    keeper = _keeper(["n1"])
    assert deleted_result(keeper, Deletion(at=AT, replicas=1)) == (
        "Deployment d-1 (sim-a) deleted at 2026-12-04 18:20:05 UTC: 1 replica stopped")
    assert deleted_result(keeper, None) == "Deployment d-1 (sim-a) deleted"
