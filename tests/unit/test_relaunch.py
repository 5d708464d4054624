"""Relaunch in place (modelkeeper.domain.relaunch): each rule of the verdict, the keeper
stepped through relaunches, their bound and what follows, and a property test of the
bound over random crash times."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    Action,
    DeploymentSpec,
    Exited,
    KeeperConfig,
    KeeperState,
    Observation,
    Phase,
    Placed,
    PlaceReplica,
    RelaunchReplica,
    Replica,
    Scale,
    Silent,
    Started,
    StartFailed,
    StartReplica,
    Stopped,
    StopReplica,
    Tick,
    WatchReplica,
    decide,
    details,
    resume,
    status,
    stored_state,
)
from modelkeeper.domain.relaunch import Relaunch, Replace, recent, relaunch_verdict
from modelkeeper.domain.shards import ExitKind
from modelkeeper.domain.status import DeploymentStatus, ReplicaState
from modelkeeper.domain.tunables import Tunables

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
N1 = NodeId("n1")
#: As the workflow runs it once the patch is on: 3 relaunches in 600 s, the defaults.
ON = KeeperConfig(backoff_jitter=0.0, relaunch=True)
SIGKILL = "signalled: killed by SIGKILL"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# -- the verdict -------------------------------------------------------------------------


def verdict(*, nodes: list[NodeId] | None = None, kind: ExitKind | None = ExitKind.SIGNALLED,
            before: Sequence[float] = (), now: float = 1000.0, tries: int = 3,
            window_s: float = 600.0) -> Relaunch | Replace:
    return relaunch_verdict(nodes=nodes or [N1], exit_kind=kind,
                            relaunched_at=[at(s) for s in before], now=at(now), tries=tries,
                            window_s=window_s)


def test_defaults_are_three_tries_in_ten_minutes_and_the_keeper_takes_them() -> None:
    assert (Tunables().relaunch_tries, Tunables().relaunch_window_s) == (3, 600.0)
    config = KeeperConfig.of(Tunables(relaunch_tries=5, relaunch_window_s=60.0))
    assert (config.relaunch_tries, config.relaunch_window_s) == (5, 60.0)
    # The patch decides, not the tunables: off until the workflow says it is on.
    assert config.relaunch is False


def test_a_first_exit_is_relaunched_on_its_node_and_says_which_try() -> None:
    got = verdict(now=10)
    assert got == Relaunch(attempt=1, tries=3, window_s=600.0, relaunched_at=[at(10)],
                           note="relaunched in place on n1, try 1 of 3 in 600 s")
    # An exit whose kind the agent did not say is relaunched as well.
    assert isinstance(verdict(kind=None), Relaunch)
    for kind in (ExitKind.ERROR, ExitKind.CLEAN, ExitKind.VANISHED, ExitKind.UNKNOWN_SHARD):
        assert isinstance(verdict(kind=kind), Relaunch), kind


def test_rule_1_a_replica_over_several_nodes_is_replaced_whole_without_a_word() -> None:
    assert verdict(nodes=[N1, NodeId("n2")]) == Replace(reason=None)


def test_rule_2_an_oom_kill_is_placed_again_with_its_measured_memory() -> None:
    got = verdict(kind=ExitKind.OOM_KILLED)
    assert isinstance(got, Replace)
    assert got.reason == ("not relaunched in place: killed for memory, it is placed again "
                          "with the memory it was measured to need")


def test_rule_3_at_most_tries_in_the_window_then_placed_again() -> None:
    assert verdict(before=[500, 700], now=800) == Relaunch(
        attempt=3, tries=3, window_s=600.0, relaunched_at=[at(500), at(700), at(800)],
        note="relaunched in place on n1, try 3 of 3 in 600 s")
    got = verdict(before=[500, 700, 800], now=900)
    assert got == Replace(reason="not relaunched in place: 3 relaunch(es) in the last 600 s "
                                 "already (at most 3), so it is placed again")


def test_rule_3_the_window_slides_an_old_relaunch_no_longer_counts() -> None:
    # 0 is 600 s before 600: out of the window (only younger ones count), and forgotten.
    got = verdict(before=[0, 100, 200], now=600)
    assert isinstance(got, Relaunch)
    assert (got.attempt, got.relaunched_at) == (3, [at(100), at(200), at(600)])
    assert isinstance(verdict(before=[1, 100, 200], now=600), Replace)
    assert recent([at(0), at(599), at(1)], at(600), 600.0) == [at(1), at(599)]


def test_one_try_in_a_short_window() -> None:
    assert isinstance(verdict(before=[], tries=1, window_s=5, now=0), Relaunch)
    assert isinstance(verdict(before=[0], tries=1, window_s=5, now=4), Replace)
    assert isinstance(verdict(before=[0], tries=1, window_s=5, now=5), Relaunch)


# -- the keeper ----------------------------------------------------------------------------


class Keeper:
    """One deployment's keeper, stepped at chosen times."""

    def __init__(self, config: KeeperConfig = ON, replicas: int = 1) -> None:
        self.config = config
        self.now = T0
        self.state = KeeperState(spec=DeploymentSpec(
            deployment_id=DeploymentId("d"), model_id=ModelId("m"), replicas=replicas))

    def step(self, obs: Observation | None = None, at_s: float | None = None) -> list[Action]:
        if at_s is not None:
            self.now = at(at_s)
        self.state, actions = decide(self.state, obs or Tick(), self.now, self.config)
        return actions

    def replica(self, rid: str) -> Replica:
        return next(r for r in self.state.replicas if r.replica_id == rid)

    def serve(self, rid: str, nodes: list[NodeId] | None = None) -> None:
        """Place (if not asked already), start and serve ``rid``."""
        self.step()
        assert self.replica(rid).phase is Phase.PLACING
        self.step(Placed(replica_id=ReplicaId(rid), nodes=nodes or [N1]))
        self.step(Started(replica_id=ReplicaId(rid), endpoint="http://h:20001"))

    def exit(self, rid: str, at_s: float, kind: ExitKind | None = ExitKind.SIGNALLED,
             detail: str = SIGKILL) -> list[Action]:
        return self.step(Exited(replica_id=ReplicaId(rid), detail=detail, exit_kind=kind),
                         at_s)


def test_an_exit_after_ready_is_relaunched_in_place_out_of_routing_until_ready() -> None:
    k = Keeper()
    k.serve("d-r1")
    note = (f"engine exited ({SIGKILL}); relaunched in place on n1, try 1 of 3 in 600 s")
    # Relaunched: not stopped, not released, nothing placed.
    assert k.exit("d-r1", 10) == [RelaunchReplica(
        replica_id=ReplicaId("d-r1"), reason=note, attempt=1, tries=3, window_s=600.0)]
    r1 = k.replica("d-r1")
    assert (r1.phase, r1.nodes, r1.relaunching, r1.relaunch_note) == (
        Phase.STARTING, [N1], True, note)
    # Its stored state takes it out of routing (only ready is routed); the deployment
    # says why it starts.
    assert stored_state(r1) is ReplicaState.STARTING
    assert status(k.state) is DeploymentStatus.STARTING
    assert k.state.last_failure == f"d-r1: {note}"
    assert "d-r1 | starting (relaunching in place) | n1" in details(k.state)
    # Nothing is placed meanwhile, at any time: it still counts.
    assert k.step(at_s=100) == []
    # A restart of the workflow re-asks its start (idempotent on the agent).
    assert resume(k.state) == [StartReplica(replica_id=ReplicaId("d-r1"))]

    # Ready again, maybe on another port: routed again, and watched.
    assert k.step(Started(replica_id=ReplicaId("d-r1"), endpoint="http://h:20002"),
                  at_s=103) == [WatchReplica(replica_id=ReplicaId("d-r1"))]
    r1 = k.replica("d-r1")
    assert (r1.phase, r1.endpoint, r1.relaunching, r1.ready_at) == (
        Phase.READY, "http://h:20002", False, at(103))
    # The note stays with the replica (its stored state says it was relaunched).
    assert r1.relaunch_note == note and r1.relaunched_at == [at(10)]
    assert status(k.state) is DeploymentStatus.SERVING
    assert k.state.consecutive_failures == 0


def test_one_exit_more_than_the_tries_in_the_window_places_it_again_as_before() -> None:
    k = Keeper()
    k.serve("d-r1")
    for n, t in enumerate((10, 20, 30), start=1):
        [action] = k.exit("d-r1", t)
        assert isinstance(action, RelaunchReplica) and action.attempt == n
        k.step(Started(replica_id=ReplicaId("d-r1"), endpoint="http://h:20001"), t + 2)
    why = (f"{SIGKILL}; not relaunched in place: 3 relaunch(es) in the last 600 s already "
           "(at most 3), so it is placed again")
    assert k.exit("d-r1", 40) == [StopReplica(replica_id=ReplicaId("d-r1"),
                                              reason=f"lost: {why}"),
                                  PlaceReplica(replica_id=ReplicaId("d-r2"))]
    assert k.state.last_failure == why and k.state.consecutive_failures == 0
    k.step(Stopped(replica_id=ReplicaId("d-r1")))
    # The new replica starts with a whole budget: its own tries.
    k.step(Placed(replica_id=ReplicaId("d-r2"), nodes=[NodeId("n2")]))
    k.step(Started(replica_id=ReplicaId("d-r2"), endpoint="http://h2:20001"))
    [action] = k.exit("d-r2", 50)
    assert isinstance(action, RelaunchReplica) and action.attempt == 1


def test_an_exit_an_hour_after_the_last_relaunch_has_its_tries_again() -> None:
    k = Keeper()
    k.serve("d-r1")
    for t in (10, 20, 30):
        k.exit("d-r1", t)
        k.step(Started(replica_id=ReplicaId("d-r1"), endpoint="http://h:20001"), t + 2)
    [action] = k.exit("d-r1", 3600)
    assert isinstance(action, RelaunchReplica) and action.attempt == 1
    assert k.replica("d-r1").relaunched_at == [at(3600)]


def test_a_relaunch_that_does_not_become_ready_is_lost_after_ready_not_a_failed_start(
) -> None:
    k = Keeper()
    k.serve("d-r1")
    k.exit("d-r1", 10)
    actions = k.step(StartFailed(replica_id=ReplicaId("d-r1"), error="exited with code 1"),
                     at_s=12)
    # Replaced at once: no failed-start count, no backoff.
    why = "relaunch in place failed: exited with code 1"
    assert actions == [StopReplica(replica_id=ReplicaId("d-r1"), reason=f"lost: {why}"),
                       PlaceReplica(replica_id=ReplicaId("d-r2"))]
    assert (k.state.consecutive_failures, k.state.next_attempt_at) == (0, None)
    assert k.state.last_failure == why


def test_an_engine_that_never_became_ready_is_not_relaunched() -> None:
    """The start-failure path stands: stopped, counted, backed off."""
    k = Keeper()
    k.step()
    k.step(Placed(replica_id=ReplicaId("d-r1"), nodes=[N1]))
    actions = k.step(StartFailed(replica_id=ReplicaId("d-r1"), error="exited with code 1"))
    assert actions == [StopReplica(replica_id=ReplicaId("d-r1"), reason="start failed")]
    assert k.state.consecutive_failures == 1 and k.state.next_attempt_at is not None


@pytest.mark.parametrize(("config", "nodes", "kind", "why"), [
    # The patch off (a history recorded before it replays): replaced, as before.
    (KeeperConfig(backoff_jitter=0.0), [N1], ExitKind.SIGNALLED, SIGKILL),
    # Relaunching turned off.
    (KeeperConfig(backoff_jitter=0.0, relaunch=True, relaunch_tries=0), [N1],
     ExitKind.SIGNALLED, SIGKILL),
    # Over two nodes: replaced whole, and the reason is the exit's alone.
    (ON, [N1, NodeId("n2")], ExitKind.SIGNALLED, SIGKILL),
    (ON, [N1], ExitKind.OOM_KILLED,
     f"{SIGKILL}; not relaunched in place: killed for memory, it is placed again with the "
     "memory it was measured to need"),
])
def test_replaced_at_once_where_no_relaunch_is_due(
    config: KeeperConfig, nodes: list[NodeId], kind: ExitKind, why: str,
) -> None:
    k = Keeper(config)
    k.serve("d-r1", nodes=nodes)
    assert k.exit("d-r1", 10, kind=kind) == [
        StopReplica(replica_id=ReplicaId("d-r1"), reason=f"lost: {why}"),
        PlaceReplica(replica_id=ReplicaId("d-r2"))]


def test_an_unreachable_replica_whose_engine_exits_is_replaced_not_relaunched() -> None:
    k = Keeper()
    k.serve("d-r1")
    k.step(Silent(replica_id=ReplicaId("d-r1")), 5)
    actions = k.exit("d-r1", 6)
    assert StopReplica(replica_id=ReplicaId("d-r1"), reason=f"lost: {SIGKILL}") in actions
    assert not any(isinstance(a, RelaunchReplica) for a in actions)


def test_a_relaunching_replica_is_the_first_retired_by_a_scale_down() -> None:
    k = Keeper(replicas=2)
    k.serve("d-r1")
    k.serve("d-r2")
    k.exit("d-r2", 10)
    actions = k.step(Scale(replicas=1), 11)
    assert actions == [StopReplica(replica_id=ReplicaId("d-r2"), reason="scaled down")]


# -- the bound, over random crash times --------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(min_value=0.5, max_value=400.0), min_size=1, max_size=40),
       tries=st.integers(min_value=1, max_value=4),
       window_s=st.sampled_from([5.0, 60.0, 600.0]))
def test_never_more_than_tries_relaunches_in_any_window_and_never_fewer(
    gaps: list[float], tries: int, window_s: float,
) -> None:
    """Engines crash at random times, each relaunch ready 0.5 s later: each replica is
    relaunched at most ``tries`` times in any ``window_s``, and it is given up only when
    the window already holds ``tries`` relaunches of it."""
    config = KeeperConfig(backoff_jitter=0.0, relaunch=True, relaunch_tries=tries,
                          relaunch_window_s=window_s)
    k = Keeper(config)
    k.serve("d-r1")
    relaunches: dict[str, list[datetime]] = {}
    window = timedelta(seconds=window_s)
    t = 0.0
    for gap in gaps:
        t += gap + 0.5
        [live] = [r for r in k.state.replicas if r.phase is Phase.READY]
        before = [s for s in relaunches.get(live.replica_id, []) if s > at(t) - window]
        actions = k.exit(live.replica_id, t)
        if any(isinstance(a, RelaunchReplica) for a in actions):
            assert len(before) < tries
            relaunches.setdefault(live.replica_id, []).append(at(t))
            k.step(Started(replica_id=live.replica_id, endpoint="http://h:1"), t + 0.5)
        else:
            assert len(before) == tries, (before, t)
            [place] = [a for a in actions if isinstance(a, PlaceReplica)]
            k.step(Stopped(replica_id=live.replica_id), t)
            k.step(Placed(replica_id=place.replica_id, nodes=[N1]), t)
            k.step(Started(replica_id=place.replica_id, endpoint="http://h:1"), t + 0.5)
    for times in relaunches.values():
        for start in times:
            assert len([s for s in times if start <= s < start + window]) <= tries
