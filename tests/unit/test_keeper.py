"""The keeper stepped at chosen times: each rule of modelkeeper.domain.keeper."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from modelkeeper.domain.catalog import DeploymentRequest, ScaleRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    Action,
    Delete,
    DeploymentSpec,
    Exited,
    Finish,
    KeeperConfig,
    KeeperState,
    NodesChanged,
    Observation,
    Phase,
    Placed,
    PlacementCrashed,
    PlaceReplica,
    ProbeReplica,
    ProbeResult,
    Retry,
    Scale,
    Silent,
    Started,
    StartFailed,
    StartReplica,
    Stopped,
    StopReplica,
    Tick,
    Unplaceable,
    WatchReplica,
    backoff_s,
    decide,
    details,
    next_wake,
    overview,
    resume,
    room_watch_goes_on,
    room_watch_start,
    room_watch_wait_s,
    status,
    waiting_for_room,
)
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import WatchForRoomInput

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CONFIG = KeeperConfig(backoff_jitter=0.0)


class Stepper:
    """Steps the keeper, keeping time and collecting actions."""

    def __init__(self, replicas: int = 1, config: KeeperConfig = CONFIG) -> None:
        self.now = T0
        self.config = config
        self.state = KeeperState(spec=DeploymentSpec(
            deployment_id=DeploymentId("d"), model_id=ModelId("m"), replicas=replicas))
        self.actions: list[Action] = []

    def step(self, obs: Observation | None = None, at: float | None = None) -> list[Action]:
        if at is not None:
            self.now = T0 + timedelta(seconds=at)
        self.state, actions = decide(self.state, obs or Tick(), self.now, self.config)
        self.actions += actions
        return actions

    def serve(self, rid: str, at: float | None = None, node: str = "a") -> None:
        self.step(Placed(replica_id=ReplicaId(rid), nodes=[NodeId(node)]), at)
        self.step(Started(replica_id=ReplicaId(rid), endpoint="http://e"), at)

    def phases(self) -> dict[str, Phase]:
        return {r.replica_id: r.phase for r in self.state.replicas}

    @property
    def status(self) -> DeploymentStatus:
        return status(self.state)


def rid(n: int) -> ReplicaId:
    return ReplicaId(f"d-r{n}")


def test_first_tick_places_one_replica_and_serving_follows() -> None:
    k = Stepper()
    assert k.step() == [PlaceReplica(replica_id=rid(1))]
    assert k.status is DeploymentStatus.PLACING
    assert k.step(Placed(replica_id=rid(1), nodes=[NodeId("a")])) == [
        StartReplica(replica_id=rid(1))]
    assert k.status is DeploymentStatus.STARTING
    assert k.step(Started(replica_id=rid(1), endpoint="http://e")) == [
        WatchReplica(replica_id=rid(1))]
    assert k.status is DeploymentStatus.SERVING


def test_one_placement_in_flight_at_a_time() -> None:
    k = Stepper(replicas=3)
    assert k.step() == [PlaceReplica(replica_id=rid(1))]
    assert k.step() == [] and k.step(at=100) == []  # still waiting on the first
    assert k.step(Placed(replica_id=rid(1), nodes=[NodeId("a")])) == [
        StartReplica(replica_id=rid(1)), PlaceReplica(replica_id=rid(2))]


def test_backoff_sequence_and_reset_after_ready() -> None:
    assert [backoff_s(n, CONFIG, 0.5) for n in range(1, 6)] == [10, 20, 40, 60, 60]
    k = Stepper()
    k.step()
    waits = []
    for n in range(1, 4):
        r = rid(n)
        k.step(Placed(replica_id=r, nodes=[NodeId("a")]))
        k.step(StartFailed(replica_id=r, error="boom"))
        k.step(Stopped(replica_id=r))
        assert k.state.next_attempt_at is not None
        waits.append((k.state.next_attempt_at - k.now).total_seconds())
        # Not a second early...
        k.now = k.state.next_attempt_at - timedelta(seconds=1)
        assert k.step() == []
        # ...and placed again once due.
        k.now += timedelta(seconds=1)
        assert k.step() == [PlaceReplica(replica_id=rid(n + 1))]
    assert waits == [10, 20, 40]
    assert k.state.consecutive_failures == 3
    k.serve("d-r4")
    assert k.state.consecutive_failures == 0
    # Lost after ready: replaced at once, no backoff.
    acts = k.step(Exited(replica_id=rid(4), detail="SIGKILL"))
    assert acts == [StopReplica(replica_id=rid(4), reason="lost: SIGKILL"),
                    PlaceReplica(replica_id=rid(5))]


def test_jitter_spreads_waits() -> None:
    config = KeeperConfig(backoff_jitter=0.2)
    assert backoff_s(1, config, 0.0) == pytest.approx(9.0)
    assert backoff_s(1, config, 0.999) == pytest.approx(11.0, abs=0.01)


def test_parks_after_five_failed_starts_and_retry_unparks() -> None:
    k = Stepper()
    k.step()
    for n in range(1, 6):
        k.step(Placed(replica_id=rid(n), nodes=[NodeId("a")]))
        k.step(StartFailed(replica_id=rid(n), error=f"exit {n}"))
        k.step(Stopped(replica_id=rid(n)))
        if n < 5:
            assert k.step(at=10_000 * n) == [PlaceReplica(replica_id=rid(n + 1))]
    assert k.status is DeploymentStatus.PARKED
    assert k.state.last_failure == "exit 5"
    assert k.step(at=10**6) == []  # stays parked, however long
    assert next_wake(k.state, CONFIG) is None
    assert k.step(Retry()) == [PlaceReplica(replica_id=rid(6))]
    assert k.state.consecutive_failures == 0


def test_spec_change_unparks() -> None:
    k = Stepper()
    k.state = k.state.model_copy(update={"parked": True, "consecutive_failures": 5})
    assert k.step() == []
    assert k.step(Scale(replicas=2)) == [PlaceReplica(replica_id=rid(1))]


def test_cant_place_records_reason_and_retries_on_node_change_or_timer() -> None:
    k = Stepper()
    k.step()
    k.step(Unplaceable(replica_id=rid(1), reason="node b: 8.0 GiB free, needs 24.0 GiB"))
    assert k.status is DeploymentStatus.CANT_PLACE
    assert k.state.placement_error == "node b: 8.0 GiB free, needs 24.0 GiB"
    # The timer is the hourly backstop (the room watch backs off outside the keeper).
    assert k.step(at=3599) == []
    assert k.step(at=3600) == [PlaceReplica(replica_id=rid(2))]
    k.step(Unplaceable(replica_id=rid(2), reason="node b: cordoned"))
    assert k.state.placement_error == "node b: cordoned"  # the reason follows the nodes
    # A node change retries at once (nodes join in pieces: memory arrives after the node).
    assert k.step(NodesChanged(), at=3601) == [PlaceReplica(replica_id=rid(3))]
    k.step(Placed(replica_id=rid(3), nodes=[NodeId("c")]))
    assert k.state.placement_error is None


def test_node_change_does_not_skip_a_failure_backoff() -> None:
    k = Stepper()
    k.step()
    k.step(Placed(replica_id=rid(1), nodes=[NodeId("a")]))
    k.step(StartFailed(replica_id=rid(1), error="x"))
    k.step(Stopped(replica_id=rid(1)))
    assert k.step(NodesChanged(), at=1) == []


def test_crashing_placement_is_recorded_and_retried_later() -> None:
    k = Stepper()
    k.step()
    k.step(PlacementCrashed(replica_id=rid(1), error="database down"))
    assert "database down" in (k.state.last_failure or "")
    assert k.step(at=1) == []
    assert k.step(at=30) == [PlaceReplica(replica_id=rid(2))]


def unplaceable_until_due(k: Stepper, n: int, at: float) -> float:
    """Placement ``d-r<n>`` finds no room at ``at``; steps to the moment the blind retry is
    due (nothing a second before, ``d-r<n+1>`` placed then) and returns the wait."""
    assert k.step(Unplaceable(replica_id=rid(n), reason="node b: full"), at=at) == []
    assert k.status is DeploymentStatus.CANT_PLACE
    wake = next_wake(k.state, k.config)
    assert wake is not None
    wait = (wake - k.now).total_seconds()
    assert k.step(at=at + wait - 1) == []
    assert k.step(at=at + wait) == [PlaceReplica(replica_id=rid(n + 1))]
    return wait


def test_a_crashed_placement_waits_30_s_and_keeps_the_cant_place_count() -> None:
    k = Stepper()
    k.step(at=0)
    at = 0.0
    for n in range(1, 4):
        at += unplaceable_until_due(k, n, at)  # d-r4 placed at 10,800 (hourly backstop)
    k.step(PlacementCrashed(replica_id=rid(4), error="database down"), at=at)
    assert next_wake(k.state, k.config) == T0 + timedelta(seconds=at + 30)
    assert k.step(at=at + 30) == [PlaceReplica(replica_id=rid(5))]
    k.step(Unplaceable(replica_id=rid(5), reason="node b: full"), at=at + 30)
    assert k.state.unplaceable_in_a_row == 4  # the 4th no-room in a row


def test_two_stage_expiry_agent_comes_back_in_time() -> None:
    k = Stepper()
    k.step()
    k.serve("d-r1")
    # Probed, and a replacement surged beside it (placed at once).
    assert k.step(Silent(replica_id=rid(1)), at=100) == [ProbeReplica(replica_id=rid(1)),
                                                         PlaceReplica(replica_id=rid(2))]
    assert k.state.replicas[0].phase is Phase.UNREACHABLE
    assert k.status is not DeploymentStatus.SERVING  # routed around meanwhile
    k.step(ProbeResult(replica_id=rid(1), running=None), at=101)
    assert k.step(at=102) == []
    assert k.step(at=103) == [ProbeReplica(replica_id=rid(1))]  # probing continues
    acts = k.step(ProbeResult(replica_id=rid(1), running=True), at=110)
    assert acts == [WatchReplica(replica_id=rid(1))]  # adopted, not rebuilt
    assert k.status is DeploymentStatus.SERVING
    assert not any(isinstance(a, StopReplica) and a.replica_id == rid(1) for a in k.actions)


def test_two_stage_expiry_agent_never_comes_back() -> None:
    k = Stepper()
    k.step()
    k.serve("d-r1")
    k.step(Silent(replica_id=rid(1)), at=100)
    k.step(ProbeResult(replica_id=rid(1), running=None), at=101)
    assert next_wake(k.state, CONFIG) == T0 + timedelta(seconds=103)
    assert not any(isinstance(a, StopReplica) for a in k.step(at=114.9))
    acts = k.step(at=115)
    assert StopReplica(replica_id=rid(1), reason="lost: no word from its node for 15s") in acts
    assert PlaceReplica(replica_id=rid(2)) in k.actions  # surged when it went silent


def test_agent_back_without_the_engine_is_lost_at_once() -> None:
    k = Stepper()
    k.step()
    k.serve("d-r1")
    k.step(Silent(replica_id=rid(1)), at=100)
    acts = k.step(ProbeResult(replica_id=rid(1), running=False), at=101)
    assert acts[0] == StopReplica(replica_id=rid(1),
                                  reason="lost: its agent no longer runs it")
    assert PlaceReplica(replica_id=rid(2)) in k.actions  # surged when it went silent


def test_delete_stops_everything_and_finishes_once() -> None:
    k = Stepper(replicas=2)
    k.step()
    k.serve("d-r1")  # places r2 meanwhile
    assert k.state.replicas[-1].phase is Phase.PLACING
    acts = k.step(Delete())
    assert acts == [StopReplica(replica_id=rid(1), reason="deployment deleted", drain=True)]
    assert k.status is DeploymentStatus.DELETING
    # The placement on its way lands after the delete: it is stopped too.
    acts = k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")]))
    assert acts == [StopReplica(replica_id=rid(2), reason="deployment deleted")]
    assert k.step(Delete()) == []  # a double delete is harmless
    k.step(Stopped(replica_id=rid(1)))
    assert k.step(Stopped(replica_id=rid(2))) == [Finish()]
    assert k.step() == [] and k.step(Delete()) == []


def test_delete_with_placement_that_found_no_room() -> None:
    k = Stepper()
    k.step()
    k.step(Delete())
    assert k.step(Unplaceable(replica_id=rid(1), reason="no nodes registered")) == [Finish()]


def test_scale_up_and_down_retires_least_useful_first() -> None:
    k = Stepper(replicas=1)
    k.step()
    k.serve("d-r1")
    k.step(Scale(replicas=3))
    k.serve("d-r2")
    k.step(Placed(replica_id=rid(3), nodes=[NodeId("c")]))  # starting, not ready
    acts = k.step(Scale(replicas=1))
    assert acts == [StopReplica(replica_id=rid(3), reason="scaled down"),
                    StopReplica(replica_id=rid(2), reason="scaled down", drain=True)]
    assert [r.replica_id for r in k.state.replicas if r.phase is Phase.READY] == [rid(1)]


def test_never_touches_replicas_it_did_not_place() -> None:
    k = Stepper()
    k.step()
    k.serve("d-r1")
    before = k.state
    for obs in (Exited(replica_id=ReplicaId("other"), detail="x"),
                Silent(replica_id=ReplicaId("other")),
                Stopped(replica_id=ReplicaId("other")),
                Started(replica_id=ReplicaId("other"), endpoint="http://x")):
        assert k.step(obs) == []
    assert k.state == before


def test_late_results_for_stopped_replicas_change_nothing() -> None:
    k = Stepper()
    k.step()
    k.step(Placed(replica_id=rid(1), nodes=[NodeId("a")]))
    k.step(Scale(replicas=0))
    assert k.state.replicas[0].phase is Phase.STOPPING
    assert k.step(Started(replica_id=rid(1), endpoint="http://late")) == []
    assert k.step(StartFailed(replica_id=rid(1), error="late")) == []
    assert k.state.consecutive_failures == 0


def test_resume_reissues_in_flight_work() -> None:
    k = Stepper(replicas=2)
    k.step()
    k.serve("d-r1")
    assert resume(k.state) == [WatchReplica(replica_id=rid(1)), PlaceReplica(replica_id=rid(2))]


def test_state_does_not_grow_over_many_failures() -> None:
    k = Stepper()
    k.step()
    for n in range(1, 200):
        k.step(Placed(replica_id=rid(n), nodes=[NodeId("a")]))
        k.step(Started(replica_id=rid(n), endpoint="http://e"))
        k.step(Exited(replica_id=rid(n), detail="crash"))
        k.step(Stopped(replica_id=rid(n)))
    assert len(k.state.replicas) == 1
    assert len(k.state.model_dump_json()) < 2000


def test_scaled_away_placement_is_stopped_on_landing_or_kept_if_wanted_again() -> None:
    k = Stepper(replicas=2)
    k.step()
    k.serve("d-r1")  # r2's placement is now in flight
    assert k.step(Scale(replicas=1)) == []  # the serving replica is kept
    assert k.state.replicas[1].retiring
    assert k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")])) == [
        StopReplica(replica_id=rid(2), reason="scaled down")]
    # Same again, but the serving one dies before the placement lands: keep the new one.
    k.step(Stopped(replica_id=rid(2)))
    k.step(Scale(replicas=2))
    k.step(Scale(replicas=1))
    assert k.state.replicas[-1].retiring
    k.step(Exited(replica_id=rid(1), detail="crash"))
    assert not k.state.replicas[-1].retiring
    assert k.step(Placed(replica_id=rid(3), nodes=[NodeId("b")])) == [
        StartReplica(replica_id=rid(3))]


def test_delete_marks_an_in_flight_placement_as_on_its_way_out() -> None:
    k = Stepper(replicas=1)
    k.step()
    k.step(Delete())
    assert k.state.replicas[0].retiring  # not wanted, whatever the spec says after
    k.step(Scale(replicas=0))
    assert k.step(Placed(replica_id=rid(1), nodes=[NodeId("a")])) == [
        StopReplica(replica_id=rid(1), reason="deployment deleted")]


# -- surge on unreachable, and the precise statuses -----------------------------------------


def serving_one(config: KeeperConfig = CONFIG) -> Stepper:
    """One replica, d-r1 on node a, serving since t=0."""
    k = Stepper(config=config)
    k.step(at=0)
    k.serve("d-r1", at=0)
    assert k.status is DeploymentStatus.SERVING
    return k


def test_silent_replica_gets_a_replacement_at_once_with_surge_on() -> None:
    k = serving_one()
    acts = k.step(Silent(replica_id=rid(1)), at=100)
    assert acts == [ProbeReplica(replica_id=rid(1)), PlaceReplica(replica_id=rid(2))]
    # Still routed around, still probed, and not torn down.
    assert k.phases() == {rid(1): Phase.UNREACHABLE, rid(2): Phase.PLACING}
    # Not beside the original: if node a is only slow, its agent vouches for d-r1.
    assert k.state.replicas[-1].avoid_nodes == ["a"]
    assert k.status is DeploymentStatus.DEGRADED
    assert k.state.last_failure == "d-r1 unreachable: no heartbeat from a"
    assert k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")]), at=101) == [
        StartReplica(replica_id=rid(2))]
    assert k.status is DeploymentStatus.DEGRADED  # degraded outranks starting


def test_vouched_while_the_replacement_starts_keeps_the_original() -> None:
    k = serving_one()
    k.step(Silent(replica_id=rid(1)), at=100)
    k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")]), at=101)
    acts = k.step(ProbeResult(replica_id=rid(1), running=True), at=103)
    assert acts == [WatchReplica(replica_id=rid(1)),
                    StopReplica(replica_id=rid(2), reason="not needed: d-r1 is back")]
    assert k.phases() == {rid(1): Phase.READY, rid(2): Phase.STOPPING}
    assert k.status is DeploymentStatus.SERVING
    # The retired replacement's late start result changes nothing.
    assert k.step(Started(replica_id=rid(2), endpoint="http://late"), at=104) == []
    assert k.step(Stopped(replica_id=rid(2)), at=105) == []
    assert k.phases() == {rid(1): Phase.READY}
    assert k.state.consecutive_failures == 0


def test_vouched_while_the_replacement_is_placing_stops_it_on_landing() -> None:
    k = serving_one()
    k.step(Silent(replica_id=rid(1)), at=100)
    assert k.step(ProbeResult(replica_id=rid(1), running=True), at=101) == [
        WatchReplica(replica_id=rid(1))]
    assert k.state.replicas[1].retiring and k.status is DeploymentStatus.SERVING
    assert k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")]), at=102) == [
        StopReplica(replica_id=rid(2), reason="not needed: d-r1 is back")]


def test_replacement_ready_retires_the_original_and_a_late_vouch_changes_nothing() -> None:
    k = serving_one()
    k.step(Silent(replica_id=rid(1)), at=100)
    k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")]), at=101)
    acts = k.step(Started(replica_id=rid(2), endpoint="http://e2"), at=110)
    assert acts == [WatchReplica(replica_id=rid(2)),
                    StopReplica(replica_id=rid(1), reason="replaced while unreachable")]
    assert k.status is DeploymentStatus.SERVING
    assert k.step(ProbeResult(replica_id=rid(1), running=True), at=111) == []
    assert k.step(Stopped(replica_id=rid(1)), at=112) == []
    assert k.phases() == {rid(2): Phase.READY}


def test_lost_while_the_replacement_starts_places_nothing_more() -> None:
    k = serving_one()
    k.step(Silent(replica_id=rid(1)), at=100)
    k.step(Placed(replica_id=rid(2), nodes=[NodeId("b")]), at=101)
    acts = k.step(at=115)
    assert acts == [StopReplica(replica_id=rid(1),
                                reason="lost: no word from its node for 15s")]
    assert k.status is DeploymentStatus.STARTING


def test_unplaceable_surge_counts_no_failure_and_waits_for_lost() -> None:
    config = CONFIG.model_copy(update={"park_after": 1})
    k = serving_one(config)
    k.step(Silent(replica_id=rid(1)), at=100)
    assert k.step(Unplaceable(replica_id=rid(2), reason="node b: 2.0 GiB free, needs 8.0 GiB"),
                  at=101) == []
    assert k.state.consecutive_failures == 0 and not k.state.parked
    assert k.state.placement_error is None and k.state.placement_retry_at is None
    assert k.status is DeploymentStatus.DEGRADED  # not cant_place: d-r1 may come back
    assert k.state.last_failure == (
        "no room for a replacement of unreachable d-r1: node b: 2.0 GiB free, needs 8.0 GiB")
    # No surge again until the lost timer (or a node change): the probe keeps going.
    assert next_wake(k.state, config) == T0 + timedelta(seconds=115)
    assert k.step(at=114) == []
    # Lost: replaced as without the flag, at once (the surge's timer does not hold it).
    assert k.step(at=115) == [
        StopReplica(replica_id=rid(1), reason="lost: no word from its node for 15s"),
        PlaceReplica(replica_id=rid(3))]
    # That placement is an ordinary one: no room is cant_place again.
    k.step(Unplaceable(replica_id=rid(3), reason="node b: full"), at=116)
    assert k.status is DeploymentStatus.CANT_PLACE and k.state.placement_error == "node b: full"


def test_unplaceable_surge_is_retried_when_the_nodes_change() -> None:
    k = serving_one()
    k.step(Silent(replica_id=rid(1)), at=100)
    k.step(Unplaceable(replica_id=rid(2), reason="full"), at=101)
    assert k.step(NodesChanged(), at=102) == [PlaceReplica(replica_id=rid(3))]
    # A crashed surge placement is not a failure either.
    k.step(PlacementCrashed(replica_id=rid(3), error="database down"), at=103)
    assert k.state.placement_retry_at is None and k.status is DeploymentStatus.DEGRADED
    assert k.step(at=110) == []


def test_surge_never_exceeds_desired_plus_unreachable() -> None:
    k = Stepper(replicas=2)
    k.step(at=0)
    k.serve("d-r1", at=0)
    k.serve("d-r2", at=0, node="b")
    k.step(Silent(replica_id=rid(1)), at=10)  # places r3
    k.step(Silent(replica_id=rid(2)), at=10)  # r3 still placing: one at a time
    assert [a for a in k.actions if isinstance(a, PlaceReplica)][-1] == PlaceReplica(
        replica_id=rid(3))
    assert k.step(Placed(replica_id=rid(3), nodes=[NodeId("c")]), at=11) == [
        StartReplica(replica_id=rid(3)), PlaceReplica(replica_id=rid(4))]
    k.step(Placed(replica_id=rid(4), nodes=[NodeId("c")]), at=12)
    assert len(k.state.replicas) == 4  # 2 desired + 2 unreachable
    assert k.step(at=13) == []
    assert k.status is DeploymentStatus.DEGRADED
    # One replacement ready: not enough yet to retire either original.
    assert k.step(Started(replica_id=rid(3), endpoint="http://e3"), at=20) == [
        WatchReplica(replica_id=rid(3))]
    acts = k.step(Started(replica_id=rid(4), endpoint="http://e4"), at=21)
    assert acts == [WatchReplica(replica_id=rid(4)),
                    StopReplica(replica_id=rid(1), reason="replaced while unreachable"),
                    StopReplica(replica_id=rid(2), reason="replaced while unreachable")]


def test_scale_down_with_surge_on_retires_the_replacement_then_the_unreachable() -> None:
    k = Stepper(replicas=2)
    k.step(at=0)
    k.serve("d-r1", at=0)
    k.serve("d-r2", at=0, node="b")
    k.step(Silent(replica_id=rid(1)), at=10)
    k.step(Placed(replica_id=rid(3), nodes=[NodeId("c")]), at=11)
    acts = k.step(Scale(replicas=1), at=12)
    assert acts == [StopReplica(replica_id=rid(1), reason="replaced while unreachable"),
                    StopReplica(replica_id=rid(3), reason="scaled down")]
    assert k.status is DeploymentStatus.SERVING


def test_status_precedence_and_stopped() -> None:
    k = Stepper(replicas=2)
    k.step(at=0)
    k.serve("d-r1", at=0)
    k.step(Unplaceable(replica_id=rid(2), reason="full"), at=1)
    assert k.status is DeploymentStatus.CANT_PLACE
    k.step(Silent(replica_id=rid(1)), at=2)  # no surge yet: r2's cant-place timer holds
    assert k.status is DeploymentStatus.DEGRADED  # degraded outranks cant_place
    k.step(Scale(replicas=0), at=3)
    assert k.status is DeploymentStatus.STOPPED
    k.step(Delete(), at=4)
    assert k.status is DeploymentStatus.DELETING
    fresh = Stepper(replicas=0, config=CONFIG)
    assert fresh.step() == [] and fresh.status is DeploymentStatus.STOPPED
    k = serving_one()
    k.state = k.state.model_copy(update={"parked": True})
    k.step(Silent(replica_id=rid(1)), at=5)
    assert k.status is DeploymentStatus.PARKED  # parked outranks degraded


def test_overview_publishes_status_counts_and_every_node_holding_a_claim() -> None:
    k = Stepper(replicas=2)
    k.step(at=0)
    assert overview(k.state).model_dump() == {
        "status": DeploymentStatus.PLACING, "ready": 0, "desired": 2, "node_ids": []}
    k.serve("d-r1", at=0, node="b")
    k.serve("d-r2", at=0, node="a")
    k.step(Silent(replica_id=rid(1)), at=5)
    view = overview(k.state)
    assert (view.status, view.ready, view.desired) == (DeploymentStatus.DEGRADED, 1, 2)
    assert view.node_ids == ["a", "b"]  # the unreachable one still holds its claim
    k.step(Scale(replicas=1), at=6)  # r1 (unreachable) stops; it holds b until stopped
    assert overview(k.state).node_ids == ["a", "b"]
    k.step(Stopped(replica_id=rid(1)), at=7)
    assert overview(k.state).node_ids == ["a"]


def test_details_are_short_markdown_with_replicas_and_reasons() -> None:
    k = serving_one()
    text = details(k.state)
    assert text.splitlines()[0] == "**serving**: 1/1 ready, model `m`"
    assert "| d-r1 | ready | a |" in text
    k.step(Exited(replica_id=rid(1), detail="killed by SIGKILL"))
    k.step(Unplaceable(replica_id=rid(2), reason="x" * 4000))
    text = details(k.state)
    assert "| d-r1 | stopping | a |" in text
    assert "Last failure: killed by SIGKILL" in text
    assert "Can't place: " + "x" * 300 + "..." in text
    assert len(text) < 1000


def test_carried_state_ignores_unknown_keys_and_operator_input_does_not() -> None:
    """A newer worker's state decodes in this one (continue-as-new, a rollback); a
    misspelt key in what an operator sends stays an error."""
    k = serving_one()
    raw = k.state.model_dump(mode="json")
    raw["added_later"] = 1
    raw["spec"]["added_later"] = 1
    raw["replicas"][0]["added_later"] = 1
    assert KeeperState.model_validate(raw) == k.state
    assert KeeperConfig.model_validate({"lost_after_s": 3, "added_later": 1}).lost_after_s == 3
    with pytest.raises(ValidationError, match="replica"):
        ScaleRequest.model_validate({"replica": 2})
    with pytest.raises(ValidationError, match="replica"):
        DeploymentRequest.model_validate({"model_id": "m", "replica": 2})
    with pytest.raises(ValidationError):  # observations never leave a run: still strict
        Silent.model_validate({"replica_id": "d-r1", "added_later": 1})


# -- the room watch: the backed-off retry outside the workflow's history ---------------------

def test_the_room_watch_schedule_carries_on_the_backoff_up_to_10_minutes() -> None:
    def waits(unplaceable: int, checks: int, config: KeeperConfig = CONFIG) -> list[float]:
        return [room_watch_wait_s(unplaceable, check, first_s=config.cant_place_retry_s,
                                  max_s=config.room_watch_max_s) for check in range(checks)]

    # After the first placement that found no room: 30 s, doubling, every 10 min.
    assert waits(1, 8) == [30, 60, 120, 240, 480, 600, 600, 600]
    # A watch started again (continue-as-new, a dry run the placement contradicted) goes
    # on from the count: after 3 in a row, as the blind retry would have waited.
    assert waits(3, 4) == [120, 240, 480, 600]
    # A count of 0 (no placement refused yet) starts at 30 s.
    assert waits(0, 3) == [30, 30, 60]
    # Months of it stay at the cap; a cap below the first wait never spins.
    assert room_watch_wait_s(10**6, 10**6, first_s=30, max_s=600) == 600
    assert room_watch_wait_s(5, 0, first_s=30, max_s=1) == 30
    watch = WatchForRoomInput(spec=DeploymentSpec(deployment_id=DeploymentId("d"),
                                                  model_id=ModelId("m"), replicas=1),
                              unplaceable=2, first_wait_s=30, max_wait_s=600)
    assert [watch.wait_s(check) for check in range(5)] == [60, 120, 240, 480, 600]


def test_with_the_room_watch_the_blind_retry_is_an_hourly_backstop() -> None:
    k = Stepper()
    k.step(at=0)
    at = 0.0
    for n in range(1, 4):
        wait = unplaceable_until_due(k, n, at)
        assert wait == 3600
        at += wait
    assert k.state.unplaceable_in_a_row == 3  # counted, for the watch's schedule


def test_a_room_watch_runs_while_the_deployment_waits_for_room_and_starts_between_placements(
) -> None:
    k = Stepper(replicas=2)
    k.step(at=0)
    assert not waiting_for_room(k.state)  # placing, never refused yet
    k.step(Unplaceable(replica_id=rid(1), reason="node a: full"), at=1)
    assert waiting_for_room(k.state)
    assert room_watch_start(k.state) == 1
    # The watch found room: a retry at once, as for a node change. While it is out the
    # watch that runs goes on, and none is started (its answer may change the count).
    assert k.step(NodesChanged(), at=100) == [PlaceReplica(replica_id=rid(2))]
    assert waiting_for_room(k.state)
    assert room_watch_goes_on(k.state, 1)
    assert room_watch_start(k.state) is None
    k.step(Unplaceable(replica_id=rid(2), reason="node a: full"), at=101)
    assert room_watch_start(k.state) == 2  # one more: the next waits longer
    # Room for one of the two: the wait for room is over (the second's placement clears
    # the error only once it is placed; meanwhile one replica is wanted and placing).
    k.step(NodesChanged(), at=200)
    k.serve(str(rid(3)), at=201)
    assert not waiting_for_room(k.state)
    assert k.state.placement_error is None
    # The second replica finds no room: waiting again, from a count that starts over.
    k.step(Unplaceable(replica_id=rid(4), reason="node a: full"), at=202)
    assert room_watch_start(k.state) == 1
    # The hourly backstop finds no room either: the count goes on, and so does the watch.
    wake = next_wake(k.state, k.config)
    assert wake == T0 + timedelta(seconds=202 + 3600)
    assert k.step(at=3802) == [PlaceReplica(replica_id=rid(5))]
    k.step(Unplaceable(replica_id=rid(5), reason="node a: full"), at=3803)
    assert k.state.unplaceable_in_a_row == 2
    assert room_watch_goes_on(k.state, 1)
    k.step(Retry(), at=10_000)
    assert not room_watch_goes_on(k.state, 1)


@pytest.mark.parametrize("end", ["scaled down", "deleted", "parked"])
def test_no_room_watch_once_nothing_waits_for_room(end: str) -> None:
    k = Stepper()
    k.step(at=0)
    k.step(Unplaceable(replica_id=rid(1), reason="node a: full"), at=1)
    # Waiting for room until the end comes.
    assert waiting_for_room(k.state)
    assert room_watch_start(k.state) == 1
    match end:
        case "scaled down":
            k.step(Scale(replicas=0), at=2)
        case "deleted":
            k.step(Delete(), at=2)
        case "parked":
            k.state = k.state.model_copy(update={"parked": True})
    assert not waiting_for_room(k.state)
    assert room_watch_start(k.state) is None
