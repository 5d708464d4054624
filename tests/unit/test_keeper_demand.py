"""The keeper following demand, stepped at chosen times: the demand half of
modelkeeper.domain.keeper (steps taken on the watch's view, sleep and wake, warm standbys,
evictions, schedule windows, statuses)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from modelkeeper.domain.demand import Add, Retire, ScalingPolicy, Sleep, Wake, WindowBounds
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    EVICTION_RECHECK_S,
    Action,
    DemandStepDue,
    DeploymentSpec,
    EvictAsked,
    EvictionSought,
    Exited,
    KeeperConfig,
    KeeperState,
    NodesChanged,
    Observation,
    Phase,
    Placed,
    PlaceReplica,
    PolicySet,
    Scale,
    SeekRoom,
    SleepAsked,
    SleepFailed,
    SleepReplica,
    Slept,
    Started,
    Stopped,
    StopReplica,
    Tick,
    Unplaceable,
    WakeAsked,
    WakeFailed,
    WakeReplica,
    WindowSet,
    Woke,
    decide,
    demand_view,
    details,
    follows_demand,
    next_wake,
    refuse_eviction,
    resume,
    status,
)
from modelkeeper.domain.status import DeploymentStatus

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CONFIG = KeeperConfig(backoff_jitter=0.0)
ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=2, idle_timeout_s=600,
                          sleep_after_s=60)


class Stepper:
    def __init__(self, policy: ScalingPolicy | None = ON_DEMAND, replicas: int = 0) -> None:
        self.now = T0
        start = policy.min_replicas if policy is not None else replicas
        self.state = KeeperState(spec=DeploymentSpec(
            deployment_id=DeploymentId("d"), model_id=ModelId("m"), replicas=start,
            scaling=policy))
        self.step()  # the first pass places what the count wants

    def step(self, obs: Observation | None = None, at: float | None = None) -> list[Action]:
        if at is not None:
            self.now = T0 + timedelta(seconds=at)
        self.state, actions = decide(self.state, obs or Tick(), self.now, CONFIG)
        return actions

    def due(self, step: Add | Retire | Sleep | Wake, at: float | None = None) -> list[Action]:
        """The watch found ``step`` on the keeper's view as it stands."""
        return self.step(DemandStepDue(view=demand_view(self.state), step=step), at)

    def serve(self, rid: str, *, node: str = "a", can_sleep: bool = True,
              at: float | None = None) -> None:
        self.step(Placed(replica_id=ReplicaId(rid), nodes=[NodeId(node)],
                         can_sleep=can_sleep), at)
        self.step(Started(replica_id=ReplicaId(rid), endpoint="http://e"), at)

    def phase(self, rid: str) -> Phase:
        return next(r.phase for r in self.state.replicas if r.replica_id == rid)


def test_an_on_demand_deployment_starts_idle_and_a_watch_runs_for_it() -> None:
    k = Stepper()
    assert k.step() == []
    assert status(k.state) is DeploymentStatus.IDLE
    assert follows_demand(k.state)


def test_a_fixed_deployment_runs_no_watch_and_min_max_0_is_stopped_not_idle() -> None:
    assert not follows_demand(Stepper(None, replicas=2).state)
    off = Stepper(ScalingPolicy(min_replicas=0, max_replicas=0))
    assert status(off.state) is DeploymentStatus.STOPPED


def test_an_add_from_zero_loads_once_and_says_who_asked() -> None:
    k = Stepper()
    actions = k.due(Add(reason="loading: 3 request(s) waiting"), at=5)
    assert [type(a) for a in actions] == [PlaceReplica]
    assert k.state.spec.replicas == 1
    assert k.state.loading_since == T0 + timedelta(seconds=5)
    assert status(k.state) is DeploymentStatus.LOADING
    assert "3 request(s) waiting" in (k.state.loading_reason or "")
    # A second add on the old view (a thousand requests) changes nothing: stale view.
    stale = DemandStepDue(view=demand_view(Stepper().state), step=Add(reason="again"))
    assert k.step(stale) == []
    assert k.state.spec.replicas == 1
    k.serve("d-r1")
    assert status(k.state) is DeploymentStatus.SERVING
    assert k.state.loading_since is None


def test_a_step_on_a_view_that_moved_on_is_dropped() -> None:
    k = Stepper()
    view = demand_view(k.state)
    k.step(PolicySet(policy=ON_DEMAND.model_copy(update={"max_replicas": 3})), at=1)
    assert k.step(DemandStepDue(view=view, step=Add(reason="x"))) == []
    assert k.state.spec.replicas == 0


def test_add_never_goes_above_max_nor_retire_below_min() -> None:
    k = Stepper(ScalingPolicy(min_replicas=1, max_replicas=1))
    k.serve("d-r1")
    assert k.due(Add(reason="busy")) == []
    assert k.state.spec.replicas == 1
    k.due(Retire(replica_id=ReplicaId("d-r1"), reason="quiet"))
    assert k.state.spec.replicas == 1  # min 1: the count stays, the keeper replaces it


def test_idle_retire_drains_the_chosen_replica_and_ends_at_idle() -> None:
    k = Stepper()
    k.due(Add(reason="asked"))
    k.serve("d-r1")
    actions = k.due(Retire(replica_id=ReplicaId("d-r1"), reason="idle: unused for 10 min"),
                    at=700)
    assert actions == [StopReplica(replica_id=ReplicaId("d-r1"),
                                   reason="idle: unused for 10 min", drain=True)]
    assert k.state.spec.replicas == 0
    assert status(k.state) is DeploymentStatus.IDLE
    assert "idle: unused for 10 min" in (k.state.demand_note or "")


def test_sleep_then_wake_keeps_the_replica_and_counts_it() -> None:
    k = Stepper()
    k.due(Add(reason="asked"))
    k.serve("d-r1")
    actions = k.due(Sleep(replica_id=ReplicaId("d-r1"), reason="unused for 60 s"), at=100)
    assert actions == [SleepReplica(replica_id=ReplicaId("d-r1"), reason="unused for 60 s")]
    assert k.phase("d-r1") is Phase.SLEEPING
    assert status(k.state) is DeploymentStatus.SLEEPING
    # Nothing new is placed for a sleeping replica: it counts toward the desired number.
    assert not any(isinstance(a, PlaceReplica) for a in k.step(Tick(), at=101))
    # A wake asked before the sleep is done waits for it.
    assert k.due(Wake(replica_id=ReplicaId("d-r1"), reason="2 waiting"), at=102) == []
    actions = k.step(Slept(replica_id=ReplicaId("d-r1")), at=103)
    assert [type(a) for a in actions] == [WakeReplica]
    assert k.phase("d-r1") is Phase.WAKING
    assert status(k.state) is DeploymentStatus.LOADING
    k.step(Woke(replica_id=ReplicaId("d-r1")), at=104)
    assert k.phase("d-r1") is Phase.READY
    assert status(k.state) is DeploymentStatus.SERVING


def test_a_failed_sleep_or_wake_stops_the_replica_and_says_why() -> None:
    k = Stepper()
    k.due(Add(reason="asked"))
    k.serve("d-r1")
    k.due(Sleep(replica_id=ReplicaId("d-r1"), reason="idle"))
    actions = k.step(SleepFailed(replica_id=ReplicaId("d-r1"), error="HTTP 500"))
    assert any(isinstance(a, StopReplica) for a in actions)
    assert "sleep failed: HTTP 500" in (k.state.last_failure or "")
    k2 = Stepper()
    k2.due(Add(reason="asked"))
    k2.serve("d-r1")
    k2.step(SleepAsked(replica_id=ReplicaId("d-r1")))
    k2.step(Slept(replica_id=ReplicaId("d-r1")))
    k2.step(WakeAsked())
    actions = k2.step(WakeFailed(replica_id=ReplicaId("d-r1"), error="no room on a",
                                 no_room=True))
    assert any(isinstance(a, StopReplica) for a in actions)
    assert "wake failed: no room on a" in (k2.state.last_failure or "")


def test_an_engine_that_dies_asleep_is_lost_and_replaced() -> None:
    k = Stepper(ScalingPolicy(min_replicas=1, max_replicas=1))
    k.serve("d-r1")
    k.step(SleepAsked())
    k.step(Slept(replica_id=ReplicaId("d-r1")))
    actions = k.step(Exited(replica_id=ReplicaId("d-r1"), detail="exited 1"))
    assert any(isinstance(a, StopReplica) for a in actions)
    assert any(isinstance(a, PlaceReplica) for a in actions)


def test_a_warm_standby_is_placed_away_slept_and_woken_for_a_lost_replica() -> None:
    k = Stepper(ScalingPolicy(min_replicas=1, max_replicas=1, warm_standby=1))
    k.serve("d-r1", node="a")
    # Whole again: the standby is placed, avoiding node a.
    placed = [r for r in k.state.replicas if r.standby]
    assert len(placed) == 1 and placed[0].avoid_nodes == [NodeId("a")]
    k.step(Placed(replica_id=placed[0].replica_id, nodes=[NodeId("b")], can_sleep=True))
    actions = k.step(Started(replica_id=placed[0].replica_id, endpoint="http://b"))
    assert any(isinstance(a, SleepReplica) for a in actions)
    k.step(Slept(replica_id=placed[0].replica_id))
    assert status(k.state) is DeploymentStatus.SERVING
    # The serving replica dies: the standby is woken in its place, no load.
    actions = k.step(Exited(replica_id=ReplicaId("d-r1"), detail="killed"))
    assert [a for a in actions if isinstance(a, WakeReplica)] == [
        WakeReplica(replica_id=placed[0].replica_id,
                    reason="a serving replica is short: the warm standby takes its place")]
    # What is placed now is the next standby, not a serving replica.
    new = {a.replica_id for a in actions if isinstance(a, PlaceReplica)}
    assert all(r.standby for r in k.state.replicas if r.replica_id in new)


def test_eviction_is_refused_for_a_promise_and_taken_for_on_demand() -> None:
    fixed = Stepper(ScalingPolicy(min_replicas=1, max_replicas=2))
    fixed.serve("d-r1")
    assert "promise" in (refuse_eviction(fixed.state, ReplicaId("d-r1")) or "")
    k = Stepper()
    k.due(Add(reason="asked"))
    k.serve("d-r1")
    assert refuse_eviction(k.state, ReplicaId("d-r1")) is None
    assert refuse_eviction(k.state, ReplicaId("d-r9")) is not None
    actions = k.step(EvictAsked(replica_id=ReplicaId("d-r1"), for_deployment=DeploymentId("e"),
                                reason="evicted d-r1 idle 14 min to place e"))
    assert any(isinstance(a, StopReplica) and a.drain for a in actions)
    assert k.state.spec.replicas == 0
    assert "evicted d-r1 idle 14 min" in (k.state.demand_note or "")


def test_a_loading_model_that_fits_nowhere_seeks_one_eviction_at_a_time() -> None:
    k = Stepper()
    k.due(Add(reason="asked"))
    rid = next(r.replica_id for r in k.state.replicas)
    actions = k.step(Unplaceable(replica_id=rid, reason="node a: 1 GiB free, 2 GiB needed"))
    assert SeekRoom() in actions
    assert k.state.seeking_room
    # Room is being sought: still loading (the gateway holds requests), not hopeless.
    assert status(k.state) is DeploymentStatus.LOADING
    # Nothing evictable until a protection window ends at 300 s: loading, sought again.
    k.step(EvictionSought(reason="d-x-r1 protected", retry_at=T0 + timedelta(seconds=300)),
           at=1)
    assert status(k.state) is DeploymentStatus.LOADING
    assert "waiting for room until" in (k.state.loading_reason or "")
    assert SeekRoom() not in k.step(Tick(), at=299)
    assert SeekRoom() in k.step(Tick(), at=300)
    # A victim asked: loading until placed, sought again if the room does not come.
    k.step(EvictionSought(victim=ReplicaId("d-x-r1"), reason="evicted d-x-r1 to place d"),
           at=301)
    assert k.state.evicting == "d-x-r1" and status(k.state) is DeploymentStatus.LOADING
    assert SeekRoom() in k.step(Tick(), at=301 + EVICTION_RECHECK_S)
    # No way to room at all: cant_place, answered at once with the reason.
    k.step(EvictionSought(reason="none of 1 replica(s) may be evicted"), at=400)
    assert status(k.state) is DeploymentStatus.CANT_PLACE
    # A fixed deployment that cannot place seeks none.
    fixed = Stepper(None, replicas=1)
    rid = next(r.replica_id for r in fixed.state.replicas)
    assert SeekRoom() not in fixed.step(Unplaceable(replica_id=rid, reason="full"))


def test_a_window_raises_the_count_and_closing_it_returns_to_the_policy() -> None:
    k = Stepper()
    actions = k.step(WindowSet(window=WindowBounds(name="day", min_replicas=2,
                                                   max_replicas=3)), at=10)
    assert sum(isinstance(a, PlaceReplica) for a in actions) == 1  # one at a time
    assert k.state.spec.replicas == 2
    assert demand_view(k.state).policy.min_replicas == 2
    # A close for another window changes nothing; its own close returns to min 0..max 2.
    k.step(WindowSet(closing="night"))
    assert k.state.window is not None
    k.step(WindowSet(closing="day"), at=20)
    assert k.state.window is None and k.state.spec.replicas == 2  # within 0..2: kept
    assert "window day closed" in (k.state.demand_note or "")


def test_a_window_on_a_fixed_deployment_closes_back_to_its_count() -> None:
    k = Stepper(None, replicas=1)
    k.step(WindowSet(window=WindowBounds(name="day", min_replicas=3, max_replicas=3)))
    assert k.state.spec.replicas == 3
    k.step(WindowSet(closing="day"))
    assert k.state.spec.replicas == 1


def test_scale_is_min_equals_max_and_drops_the_policy() -> None:
    k = Stepper()
    k.step(Scale(replicas=3))
    assert k.state.spec.scaling is None and k.state.spec.replicas == 3
    assert not follows_demand(k.state)


def test_resume_reissues_sleeps_and_wakes_in_flight() -> None:
    k = Stepper()
    k.due(Add(reason="asked"))
    k.serve("d-r1")
    k.step(SleepAsked())
    kinds = [type(a).__name__ for a in resume(k.state)]
    assert kinds == ["WatchReplica", "SleepReplica"]
    k.step(Slept(replica_id=ReplicaId("d-r1")))
    k.step(WakeAsked())
    kinds = [type(a).__name__ for a in resume(k.state)]
    assert kinds == ["WatchReplica", "WakeReplica"]


def test_details_show_the_policy_and_the_last_step() -> None:
    k = Stepper()
    k.due(Add(reason="loading: 1 request(s) waiting"))
    text = details(k.state)
    assert "Scaling: min 0, max 2, idle stop after 600 s, sleep after 60 s" in text
    assert "Loading: loading: 1 request(s) waiting" in text


def test_an_addition_wakes_a_sleeping_replica_before_it_loads_one() -> None:
    k = Stepper(ScalingPolicy(min_replicas=1, max_replicas=3, sleep_after_s=60))
    k.serve("d-r1")
    k.step(PolicySet(policy=ScalingPolicy(min_replicas=0, max_replicas=3, sleep_after_s=60)))
    k.due(Add(reason="busy"))
    second = next(r.replica_id for r in k.state.replicas if r.replica_id != "d-r1")
    k.serve(second)
    k.due(Sleep(replica_id=ReplicaId(second), reason="unused"))
    k.step(Slept(replica_id=ReplicaId(second)))
    actions = k.due(Add(reason="3 waiting on 1 ready"))
    assert [type(a) for a in actions] == [WakeReplica]
    assert k.state.spec.replicas == 2


def test_a_standby_that_finds_no_room_says_so_and_is_placed_when_room_comes() -> None:
    k = Stepper(ScalingPolicy(min_replicas=1, max_replicas=1, warm_standby=1))
    k.serve("d-r1", node="a")
    standby = next(r.replica_id for r in k.state.replicas if r.standby)
    k.step(Unplaceable(replica_id=standby, reason="node b: avoided"), at=1)
    assert status(k.state) is DeploymentStatus.SERVING
    assert "no room for a warm standby: node b: avoided" in (k.state.placement_error or "")
    assert next_wake(k.state, CONFIG) == T0 + timedelta(
        seconds=1 + CONFIG.cant_place_backstop_s)
    actions = k.step(NodesChanged(), at=2)  # a node joined: the store tells it at once
    assert any(isinstance(a, PlaceReplica) for a in actions)
    assert any(r.standby and r.phase is Phase.PLACING for r in k.state.replicas)


def test_asked_for_while_its_last_replica_stops_it_loads_again_once_the_room_is_back() -> None:
    k = Stepper(ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=60))
    k.due(Add(reason="asked"))
    k.serve("d-r1")
    k.due(Retire(replica_id=ReplicaId("d-r1"), reason="idle"), at=100)
    assert status(k.state) is DeploymentStatus.IDLE
    assert follows_demand(k.state)  # the watch stays open while d-r1 stops
    k.due(Add(reason="asked again"), at=101)
    placing = next(r.replica_id for r in k.state.replicas if r.phase is Phase.PLACING)
    k.step(Unplaceable(replica_id=placing, reason="node a: d-r1's claim"), at=101)
    # Its own replica's room is on its way: loading, not cant_place.
    assert status(k.state) is DeploymentStatus.LOADING
    actions = k.step(Stopped(replica_id=ReplicaId("d-r1")), at=102)
    assert any(isinstance(a, PlaceReplica) for a in actions)
