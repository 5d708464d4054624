"""When ``--wait`` is over and how it ended (modelkeeper.domain.waiting): pure, from
the deployment or operation as the API shows it."""

from __future__ import annotations

from typing import Any

import pytest

from modelkeeper.domain.waiting import (
    STALE_STATUS_GRACE_S,
    Goal,
    Outcome,
    Waiting,
    judge_deployment,
    judge_operation,
)


def deployment(status: str, ready: int, desired: int, *replicas: tuple[str, str],
               **more: Any) -> dict[str, Any]:
    return {"deployment_id": "d1", "model_id": "sim-1g", "status": status,
            "ready_replicas": ready, "desired_replicas": desired,
            "consecutive_failures": more.pop("failures", 0),
            "last_failure": more.pop("last_failure", None),
            "placement_error": more.pop("placement_error", None),
            "replicas": [{"replica_id": r, "state": s} for r, s in replicas], **more}


READY = Waiting(Goal.READY, started_at=0.0, first_status="placing")


@pytest.mark.parametrize(("shown", "outcome"), [
    (deployment("placing", 0, 2), None),
    (deployment("starting", 1, 2, ("r1", "ready"), ("r2", "starting")), None),
    (deployment("serving", 2, 2, ("r1", "ready"), ("r2", "ready")),
     Outcome(True, "serving, 2/2 ready")),
    # A scale-down: 2 wanted, the third still stopping.
    (deployment("serving", 2, 2, ("r1", "ready"), ("r2", "ready"), ("r3", "stopping")), None),
    (deployment("stopped", 0, 0), Outcome(True, "stopped, 0 replicas wanted")),
    (deployment("parked", 0, 1, failures=5, last_failure="exit 1: no such file"),
     Outcome(False, "parked after 5 failed start(s): exit 1: no such file")),
    (deployment("cant_place", 0, 9, placement_error="node vm: 1.0 GiB free, needs 2.0 GiB"),
     Outcome(False, "cannot be placed: node vm: 1.0 GiB free, needs 2.0 GiB")),
    (deployment("deleting", 0, 0), Outcome(False, "the deployment is being deleted")),
    (None, Outcome(False, "the deployment was deleted")),
])
def test_a_deploy_or_scale_waits_for_every_replica_ready_and_fails_at_an_end_that_is_not(
        shown: dict[str, Any] | None, outcome: Outcome | None) -> None:
    assert judge_deployment(READY, shown, now=1.0) == outcome


def test_a_failing_status_from_before_the_command_is_believed_once_it_moved_or_later(
        ) -> None:
    """A retry answers while the deployment is still parked: that is the past."""
    retry = Waiting(Goal.READY, started_at=100.0, first_status="parked")
    parked = deployment("parked", 0, 1, failures=5)
    assert judge_deployment(retry, parked, now=101.0) is None
    moved = retry.seen("placing")
    assert moved.moved and judge_deployment(moved, parked, now=101.0) is not None
    late = judge_deployment(retry, parked, now=100.0 + STALE_STATUS_GRACE_S)
    assert late is not None and not late.ok


def test_rm_waits_until_the_deployment_is_gone() -> None:
    gone = Waiting(Goal.GONE, started_at=0.0, first_status="deleting")
    assert judge_deployment(gone, deployment("deleting", 1, 0, ("r1", "stopping")),
                            now=1.0) is None
    assert judge_deployment(gone, None, now=2.0) == Outcome(True, "deleted")


def test_sleep_and_wake_wait_for_the_replica_they_named() -> None:
    sleep = Waiting(Goal.ASLEEP, started_at=0.0, first_status="serving", replica_id="r2")
    draining = deployment("serving", 1, 2, ("r1", "ready"), ("r2", "draining"))
    asleep = deployment("serving", 1, 2, ("r1", "ready"), ("r2", "sleeping"))
    assert judge_deployment(sleep, draining, now=1.0) is None
    assert judge_deployment(sleep, asleep, now=1.0) == Outcome(True, "replica r2 is asleep")
    wake = Waiting(Goal.READY, started_at=0.0, first_status="serving", replica_id="r2")
    assert judge_deployment(wake, asleep, now=1.0) is None
    assert judge_deployment(wake, deployment("serving", 2, 2, ("r1", "ready"),
                                             ("r2", "ready")), now=1.0) == \
        Outcome(True, "replica r2 is ready")
    assert judge_deployment(wake, deployment("serving", 1, 1, ("r1", "ready")), now=1.0) == \
        Outcome(False, "replica r2 is gone")


def test_a_sleep_that_puts_none_to_sleep_fails_once_believed() -> None:
    sleep = Waiting(Goal.ASLEEP, started_at=0.0, first_status="serving")
    awake = deployment("serving", 1, 1, ("r1", "ready"))
    assert judge_deployment(sleep, awake, now=1.0) is None
    late = judge_deployment(sleep, awake, now=STALE_STATUS_GRACE_S)
    assert late is not None and not late.ok


@pytest.mark.parametrize(("state", "error", "outcome"), [
    ("running", None, None),
    ("succeeded", None, Outcome(True, "switch/d1/1 succeeded")),
    ("rolled_back", "the new replica failed: exit 1",
     Outcome(False, "switch/d1/1 rolled_back: the new replica failed: exit 1")),
    ("failed", "no room", Outcome(False, "switch/d1/1 failed: no room")),
    ("cancelled", None, Outcome(False, "switch/d1/1 cancelled")),
    ("rollback_incomplete", "r3 still there",
     Outcome(False, "switch/d1/1 rollback_incomplete: r3 still there")),
])
def test_a_saga_succeeds_only_when_it_succeeded(state: str, error: str | None,
                                                outcome: Outcome | None) -> None:
    assert judge_operation({"operation_id": "switch/d1/1", "state": state,
                            "error": error}) == outcome
