"""The keeper's moves (surge, replace, retire, cancel, generations) stepped at chosen times:
each rule of the "Moves" section of modelkeeper.domain.keeper."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from modelkeeper.domain.catalog import Generation
from modelkeeper.domain.ids import ModelId, MoveId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    EVICTION_RECHECK_S,
    Action,
    Delete,
    EvictionSought,
    Exited,
    GenerationSet,
    KeeperConfig,
    MoveAsked,
    MoveCancelled,
    NodesChanged,
    Phase,
    Placed,
    PlaceReplica,
    Scale,
    SeekRoom,
    Started,
    StartFailed,
    Stopped,
    StopReplica,
    Tick,
    Unplaceable,
    brief,
    move_outcome,
    next_wake,
    outdated,
    refuse_move,
    status,
)
from modelkeeper.domain.moves import MoveKind, MoveRequest, MoveState
from modelkeeper.domain.status import DeploymentStatus

from .test_keeper import T0, Stepper

pytestmark = pytest.mark.timeout(30)

#: The keeper as the workflow runs it (no backoff jitter, for exact times).
GRACEFUL = KeeperConfig(backoff_jitter=0.0)
B = Generation(number=1, model_id=ModelId("b"))


def serving(replicas: int = 2) -> Stepper:
    """A deployment with ``replicas`` ready replicas d-r1.. on nodes a, b, ..."""
    keeper = Stepper(replicas, GRACEFUL)
    for i in range(1, replicas + 1):
        keeper.step()
        keeper.serve(f"d-r{i}", node="abcdefg"[i - 1])
    assert status(keeper.state) is DeploymentStatus.SERVING
    keeper.actions.clear()
    return keeper


def ask(keeper: Stepper, move_id: str, kind: MoveKind, **fields: Any) -> list[Action]:
    request = MoveRequest(move_id=MoveId(move_id), kind=kind, **fields)
    assert refuse_move(keeper.state, request, keeper.config) is None
    return keeper.step(MoveAsked(request=request))


def outcome_state(keeper: Stepper, move_id: str) -> MoveState:
    outcome = move_outcome(keeper.state, MoveId(move_id))
    assert outcome is not None
    return outcome.state


def phase(keeper: Stepper, rid: str) -> Phase | None:
    return next((r.phase for r in keeper.state.replicas if r.replica_id == rid), None)


def test_replace_surges_then_drains_and_retires_the_old_one_once_the_new_is_ready() -> None:
    keeper = serving(2)
    actions = ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"),
                  generation=B, avoid_nodes=[NodeId("a")])
    assert actions == [PlaceReplica(replica_id=ReplicaId("d-r3"))]
    new = next(r for r in keeper.state.replicas if r.replica_id == "d-r3")
    assert new.generation == B and new.avoid_nodes == ["a"] and new.move_id == "s:1"
    # The surge is not scaled back down while it places and starts, and d-r1 keeps serving.
    keeper.step(Placed(replica_id=ReplicaId("d-r3"), nodes=[NodeId("c")]))
    assert phase(keeper, "d-r1") is Phase.READY
    assert outcome_state(keeper, "s:1") is MoveState.RUNNING
    actions = keeper.step(Started(replica_id=ReplicaId("d-r3"), endpoint="http://c"))
    assert [a for a in actions if isinstance(a, StopReplica)] == [StopReplica(
        replica_id=ReplicaId("d-r1"), reason="replaced by d-r3", drain=True)]
    assert outcome_state(keeper, "s:1") is MoveState.RUNNING  # until d-r1 has stopped
    keeper.step(Stopped(replica_id=ReplicaId("d-r1")))
    outcome = move_outcome(keeper.state, MoveId("s:1"))
    assert outcome is not None and outcome.state is MoveState.SUCCEEDED
    assert outcome.surged == "d-r3" and outcome.retired == "d-r1"
    assert "d-r3 ready on c" in outcome.detail
    # Nothing more is placed or stopped: two replicas, as desired.
    assert [r.replica_id for r in keeper.state.replicas] == ["d-r2", "d-r3"]
    assert keeper.step() == []


def test_a_retried_move_is_answered_again_and_changes_nothing() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    before = keeper.state
    assert keeper.step(MoveAsked(request=MoveRequest(
        move_id=MoveId("s:1"), kind=MoveKind.REPLACE, replica_id=ReplicaId("d-r1")))) == []
    assert keeper.state == before


def test_stop_first_retires_first_holds_the_slot_and_places_once_the_old_has_stopped() -> None:
    keeper = serving(1)
    actions = ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"),
                  generation=B, stop_first=True)
    assert actions == [StopReplica(replica_id=ReplicaId("d-r1"), reason="s:1", drain=True)]
    # While d-r1 stops, nothing is placed: not the new one (no room for both), and not one
    # of the old generation to fill the slot.
    assert keeper.step() == []
    actions = keeper.step(Stopped(replica_id=ReplicaId("d-r1")))
    assert actions == [PlaceReplica(replica_id=ReplicaId("d-r2"))]
    keeper.serve("d-r2")
    assert outcome_state(keeper, "s:1") is MoveState.SUCCEEDED
    assert keeper.step() == []
    assert status(keeper.state) is DeploymentStatus.SERVING


def test_a_failed_stop_first_frees_its_slot_and_the_old_generation_comes_back() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"), generation=B,
        stop_first=True)
    keeper.step(Stopped(replica_id=ReplicaId("d-r1")))
    keeper.step(Placed(replica_id=ReplicaId("d-r2"), nodes=[NodeId("a")]))
    actions = keeper.step(StartFailed(replica_id=ReplicaId("d-r2"), error="crashed"))
    outcome = move_outcome(keeper.state, MoveId("s:1"))
    assert outcome is not None and outcome.state is MoveState.FAILED
    assert outcome.error == "start failed: crashed"
    # Not a failed start of the deployment: no backoff, no count.
    assert keeper.state.consecutive_failures == 0
    assert StopReplica(replica_id=ReplicaId("d-r2"), reason="start failed") in actions
    keeper.step(Stopped(replica_id=ReplicaId("d-r2")))
    placed = [a for a in keeper.actions if isinstance(a, PlaceReplica)]
    assert placed[-1] == PlaceReplica(replica_id=ReplicaId("d-r3"))
    restored = next(r for r in keeper.state.replicas if r.replica_id == "d-r3")
    assert restored.generation is None and restored.move_id is None  # the deployment's own


def test_a_surge_without_room_fails_the_move_and_not_the_deployment() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.SURGE)
    keeper.step(Unplaceable(replica_id=ReplicaId("d-r2"), reason="a: full"))
    outcome = move_outcome(keeper.state, MoveId("s:1"))
    assert outcome is not None and outcome.state is MoveState.FAILED
    assert outcome.error == "no room: a: full"
    assert status(keeper.state) is DeploymentStatus.SERVING
    assert keeper.state.placement_error is None


def test_a_surge_is_not_scaled_back_down_until_a_retire_balances_it() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.SURGE, avoid_nodes=[NodeId("a")])
    keeper.serve("d-r2", node="b")
    assert outcome_state(keeper, "s:1") is MoveState.SUCCEEDED
    assert keeper.step() == []  # two ready for one desired, and nothing retired
    actions = ask(keeper, "s:2", MoveKind.RETIRE, replica_id=ReplicaId("d-r1"),
                  balances=MoveId("s:1"))
    assert actions == [StopReplica(replica_id=ReplicaId("d-r1"), reason="s:2", drain=True)]
    keeper.step(Stopped(replica_id=ReplicaId("d-r1")))
    assert outcome_state(keeper, "s:2") is MoveState.SUCCEEDED
    assert [(r.replica_id, r.move_id) for r in keeper.state.replicas] == [("d-r2", None)]
    assert keeper.step() == []


def test_cancel_retires_what_was_surged_and_keeps_what_would_have_been_retired() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"), generation=B)
    keeper.step(Placed(replica_id=ReplicaId("d-r2"), nodes=[NodeId("b")]))
    actions = keeper.step(MoveCancelled(move_id=MoveId("s:1")))
    assert actions == [StopReplica(replica_id=ReplicaId("d-r2"), reason="cancelled: s:1")]
    assert outcome_state(keeper, "s:1") is MoveState.CANCELLED
    assert phase(keeper, "d-r1") is Phase.READY
    keeper.step(Stopped(replica_id=ReplicaId("d-r2")))
    assert keeper.step() == []


def test_cancel_of_a_placement_in_flight_stops_it_when_it_lands() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.SURGE)
    assert keeper.step(MoveCancelled(move_id=MoveId("s:1"))) == []
    actions = keeper.step(Placed(replica_id=ReplicaId("d-r2"), nodes=[NodeId("b")]))
    assert actions == [StopReplica(replica_id=ReplicaId("d-r2"), reason="cancelled: s:1")]


def test_validators_refuse_with_a_reason() -> None:
    keeper = serving(2)
    def refusal(**fields: Any) -> str | None:
        return refuse_move(keeper.state, MoveRequest(**fields), keeper.config)
    assert refusal(move_id="x", kind=MoveKind.RETIRE, replica_id="zz") == (
        "replica_id: zz is not a live replica of d (live: d-r1, d-r2)")
    assert refusal(move_id="x", kind=MoveKind.REPLACE) == "replica_id: required for a replace"
    ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    assert refusal(move_id="x", kind=MoveKind.RETIRE, replica_id="d-r1") == (
        "replica_id: d-r1 is leased to move s:1")
    assert refusal(move_id="x", kind=MoveKind.SURGE) == (
        "d already surges 1 replica(s) (s:1); max_surge is 1")
    assert refusal(move_id="s:1", kind=MoveKind.RETIRE, replica_id="d-r2") == (
        "move_id: s:1 is already a replace on d")
    assert refusal(move_id="s:1", kind=MoveKind.REPLACE, replica_id="d-r1") is None  # a retry
    keeper.step(Delete())
    assert refusal(move_id="y", kind=MoveKind.RETIRE, replica_id="d-r2") == (
        "deployment d is being deleted; it takes no moves")
    assert outcome_state(keeper, "s:1") is MoveState.FAILED


def test_generations_mark_older_replicas_outdated_and_new_ones_run_the_new() -> None:
    keeper = serving(2)
    keeper.step(GenerationSet(move_id=MoveId("s:9"), generation=B))
    assert outdated(keeper.state) == ["d-r1", "d-r2"]
    view = brief(keeper.state)
    assert view.generation == B
    assert [r.generation for r in view.replicas] == [Generation(model_id=ModelId("m"))] * 2
    keeper.step(Scale(replicas=3))
    new = keeper.state.replicas[-1]
    assert new.phase is Phase.PLACING and new.generation == B


def test_a_replaced_replica_lost_meanwhile_ends_the_move_when_the_new_one_is_ready() -> None:
    keeper = serving(1)
    ask(keeper, "s:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    keeper.step(Placed(replica_id=ReplicaId("d-r2"), nodes=[NodeId("b")]))
    keeper.step(Exited(replica_id=ReplicaId("d-r1"), detail="killed"))
    keeper.step(Stopped(replica_id=ReplicaId("d-r1")))
    keeper.step(Started(replica_id=ReplicaId("d-r2"), endpoint="http://b"))
    assert outcome_state(keeper, "s:1") is MoveState.SUCCEEDED
    # The keeper replaced the lost d-r1 meanwhile (d-r3, still placing): with d-r2 handed
    # over it is one too many, and is stopped when it lands.
    assert [(r.replica_id, r.phase, r.retiring) for r in keeper.state.replicas] == [
        ("d-r2", Phase.READY, False), ("d-r3", Phase.PLACING, True)]


# -- a restart borrows a lower class's room (issue 22, patch capacity-preemption) --------

PREEMPTING = KeeperConfig(backoff_jitter=0.0, preemption=True)


def serving_preempting() -> Stepper:
    keeper = Stepper(1, PREEMPTING)
    keeper.step()
    keeper.serve("d-r1", node="a")
    keeper.actions.clear()
    return keeper


def test_a_restart_without_room_borrows_it_and_goes_on_when_the_victims_free_it() -> None:
    keeper = serving_preempting()
    ask(keeper, "r:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    actions = keeper.step(Unplaceable(replica_id=ReplicaId("d-r2"), reason="a: full"), at=1)
    # Room is sought once; the move waits (it does not fail, nor place again at once).
    assert SeekRoom() in actions and outcome_state(keeper, "r:1") is MoveState.RUNNING
    assert not any(isinstance(a, PlaceReplica) for a in keeper.step(Tick(), at=2))
    keeper.step(EvictionSought(reason="preempting o-r1 (opportunistic) to place d",
                               preempting=[ReplicaId("o-r1")]), at=2)
    # Serving still, the old replica serves; the reason is shown beside it.
    assert status(keeper.state) is DeploymentStatus.SERVING
    assert "making room: preempting o-r1" in (keeper.state.placement_error or "")
    # The victim's release (a node change): the move's replica is placed again.
    actions = keeper.step(NodesChanged(), at=12)
    assert PlaceReplica(replica_id=ReplicaId("d-r3")) in actions
    keeper.serve("d-r3", node="a")
    # The old one is retired: its room goes back to whoever waits for it.
    assert phase(keeper, "d-r1") is Phase.STOPPING
    assert keeper.state.placement_error is None


def test_a_restart_with_nothing_to_stop_fails_as_before_and_a_slow_release_times_out() -> None:
    keeper = serving_preempting()
    ask(keeper, "r:1", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    keeper.step(Unplaceable(replica_id=ReplicaId("d-r2"), reason="a: full"), at=1)
    keeper.step(EvictionSought(reason="nothing it outranks makes the room"), at=2)
    assert outcome_state(keeper, "r:1") is MoveState.FAILED
    # Victims asked, but their room never comes: the move fails after the recheck.
    keeper = serving_preempting()
    ask(keeper, "r:2", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    keeper.step(Unplaceable(replica_id=ReplicaId("d-r2"), reason="a: full"), at=1)
    keeper.step(EvictionSought(reason="preempting o-r1", preempting=[ReplicaId("o-r1")]),
                at=2)
    assert next_wake(keeper.state, keeper.config) == T0 + timedelta(
        seconds=1 + EVICTION_RECHECK_S)
    keeper.step(Tick(), at=1 + EVICTION_RECHECK_S)
    assert outcome_state(keeper, "r:2") is MoveState.FAILED
    # Without the patch (0.2's histories): no room fails the move at once.
    keeper = Stepper(1, GRACEFUL)
    keeper.step()
    keeper.serve("d-r1")
    ask(keeper, "r:3", MoveKind.REPLACE, replica_id=ReplicaId("d-r1"))
    assert SeekRoom() not in keeper.step(Unplaceable(replica_id=ReplicaId("d-r2"),
                                                     reason="a: full"))
    assert outcome_state(keeper, "r:3") is MoveState.FAILED
