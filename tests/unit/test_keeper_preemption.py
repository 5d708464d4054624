"""The keeper's half of preemption (issue 22), stepped at chosen times: a deployment that
fits nowhere seeks room once per run of failures (behind the 0.3 patch), a preempted
replica is drained with the short grace and its count kept, the deployment says who took
its room and places again by itself."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    Action,
    DeploymentSpec,
    EvictionSought,
    KeeperConfig,
    KeeperState,
    NodesChanged,
    Observation,
    Phase,
    Placed,
    PlaceReplica,
    PreemptAsked,
    Retry,
    SeekRoom,
    Started,
    Stopped,
    StopReplica,
    TenancySet,
    Tick,
    Unplaceable,
    decide,
    refuse_preemption,
    status,
)
from modelkeeper.domain.status import DeploymentStatus

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PATCHED = KeeperConfig(backoff_jitter=0.0, preemption=True)
REASON = "preempted by d-crit (critical) for its replica d-crit-r1"


class Stepper:
    def __init__(self, *, replicas: int = 1, config: KeeperConfig = PATCHED,
                 capacity_class: CapacityClass | None = None) -> None:
        self.now = T0
        self.config = config
        self.state = KeeperState(spec=DeploymentSpec(
            deployment_id=DeploymentId("d"), model_id=ModelId("m"), replicas=replicas,
            capacity_class=capacity_class))
        self.actions = self.step()

    def step(self, obs: Observation | None = None, at: float | None = None) -> list[Action]:
        if at is not None:
            self.now = T0 + timedelta(seconds=at)
        self.state, actions = decide(self.state, obs or Tick(), self.now, self.config)
        return actions

    def placing(self) -> ReplicaId:
        return next(r.replica_id for r in self.state.replicas if r.phase is Phase.PLACING)

    def serve(self, rid: ReplicaId, node: str = "a") -> None:
        self.step(Placed(replica_id=rid, nodes=[NodeId(node)]))
        self.step(Started(replica_id=rid, endpoint="http://e"))


def test_a_placement_that_finds_no_room_seeks_it_once_per_run_of_failures() -> None:
    k = Stepper(capacity_class=CapacityClass.CRITICAL)
    assert SeekRoom() in k.step(Unplaceable(replica_id=k.placing(), reason="full"))
    assert k.state.seeking_room
    k.step(EvictionSought(reason="nothing it outranks makes the room"), at=1)
    assert not k.state.seeking_room
    # The room watch's retries find no room again: the same answer, not sought again.
    k.step(NodesChanged(), at=2)
    assert SeekRoom() not in k.step(Unplaceable(replica_id=k.placing(), reason="full"), at=3)
    # An operator's retry starts a new run of failures: sought again.
    k.step(Retry(), at=4)
    assert SeekRoom() in k.step(Unplaceable(replica_id=k.placing(), reason="full"), at=5)


def test_without_the_patch_a_fixed_deployment_only_waits_as_0_2_did() -> None:
    k = Stepper(config=KeeperConfig(backoff_jitter=0.0))
    assert SeekRoom() not in k.step(Unplaceable(replica_id=k.placing(), reason="full"))


def test_victims_asked_leave_the_preemptor_waiting_and_saying_why() -> None:
    k = Stepper(capacity_class=CapacityClass.CRITICAL)
    k.step(Unplaceable(replica_id=k.placing(), reason="node a: 1 GiB free, 4 GiB needed"))
    k.step(EvictionSought(reason="preempting o-r1 and o-r2 (opportunistic) to place d",
                          preempting=[ReplicaId("o-r1"), ReplicaId("o-r2")]), at=1)
    assert status(k.state) is DeploymentStatus.CANT_PLACE
    assert k.state.placement_error == ("making room: preempting o-r1 and o-r2 "
                                       "(opportunistic) to place d")
    # The victims' release signals it (nodes changed): it places.
    actions = k.step(NodesChanged(), at=12)
    assert any(isinstance(a, PlaceReplica) for a in actions)
    k.serve(k.placing())
    assert status(k.state) is DeploymentStatus.SERVING
    assert k.state.placement_error is None


def test_a_preempted_replica_drains_briefly_keeps_its_count_and_waits_for_room() -> None:
    k = Stepper(replicas=2)
    first = k.placing()
    k.serve(first)
    second = k.placing()
    k.serve(second, node="b")
    assert status(k.state) is DeploymentStatus.SERVING
    actions = k.step(PreemptAsked(replica_id=first, by=DeploymentId("d-crit"), reason=REASON),
                     at=10)
    stops = [a for a in actions if isinstance(a, StopReplica)]
    assert stops == [StopReplica(replica_id=first, reason=REASON, drain=True,
                                 grace_s=PATCHED.preempt_grace_s)]
    assert k.state.spec.replicas == 2  # the count is kept: it is owed
    assert k.state.demand_note == REASON
    k.step(Stopped(replica_id=first), at=11)
    # A replacement is placed at once; the room is held for d-crit, so none is found.
    replacement = k.placing()
    actions = k.step(Unplaceable(replica_id=replacement, reason="node a: full"), at=11)
    # Preempted: it does not seek room back (two deployments would take turns).
    assert SeekRoom() not in actions
    assert k.state.placement_error == f"{REASON}; waiting for room: node a: full"
    assert status(k.state) is DeploymentStatus.CANT_PLACE  # as for any replica owed
    # Room returns (the preemptor deleted): placed again by itself, the reason gone.
    k.step(NodesChanged(), at=600)
    k.serve(k.placing())
    assert status(k.state) is DeploymentStatus.SERVING
    assert k.state.preempted is None and k.state.placement_error is None


def test_a_preemption_of_a_replica_not_ready_or_leased_is_refused() -> None:
    k = Stepper()
    rid = k.placing()
    assert refuse_preemption(k.state, rid) is not None  # still placing
    assert k.step(PreemptAsked(replica_id=rid, reason=REASON)) == []
    k.serve(rid)
    assert refuse_preemption(k.state, rid) is None
    assert refuse_preemption(k.state, ReplicaId("d-r9")) is not None


def test_a_new_owner_and_class_change_what_it_asks_as_and_nothing_running() -> None:
    k = Stepper()
    k.serve(k.placing())
    before = list(k.state.replicas)
    assert k.step(TenancySet(owner="acme/b", capacity_class=CapacityClass.CRITICAL)) == []
    assert (k.state.spec.owner, k.state.spec.capacity_class) == ("acme/b",
                                                                 CapacityClass.CRITICAL)
    assert k.state.replicas == before
    # A part not given is unchanged.
    k.step(TenancySet(capacity_class=CapacityClass.STANDARD))
    assert (k.state.spec.owner, k.state.spec.capacity_class) == ("acme/b",
                                                                 CapacityClass.STANDARD)
