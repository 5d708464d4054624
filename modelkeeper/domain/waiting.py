"""When a command's ``--wait`` is over, and how it ended: pure, judged from what the API
shows (a deployment as GET /deployments/{id} has it, an operation as GET /operations/{id}
has it), with the time as an argument.

Each started work has its goal (:class:`Goal`):

- ``ready`` (deploy, scale, retry, wake): every desired replica ready, none still
  starting, draining or stopping (a scale-down waits for its stops), none asleep; or,
  desired 0, the deployment at rest (stopped, idle, sleeping). It fails when the
  deployment is parked, cannot be placed, or is being deleted.
- ``asleep`` (sleep): no replica draining or stopping, and one asleep (the one named).
- ``gone`` (rm): the deployment no longer exists.
- ``operation`` (restart, switch, reconfigure, drain): the saga ended; only
  ``succeeded`` is a success, and a rollback, a failure or a cancel says why.

A failing status the deployment already had when the command answered (a retry's
``parked``, a scale's ``cant_place`` of before) may be the past rather than the outcome:
it is believed once the status has moved on, or :data:`STALE_STATUS_GRACE_S` after the
start, when the keeper has had time to act on the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .operations import OperationState
from .status import DeploymentStatus, ReplicaState

#: How long a failing status seen in the command's own answer is taken as the state from
#: before it: a retry or a scale reaches the deployment's workflow within a second or two.
STALE_STATUS_GRACE_S = 5.0

#: Replica states that mean work is still under way (a start, a drain, a stop).
_MOVING = {ReplicaState.STARTING, ReplicaState.DRAINING, ReplicaState.STOPPING}
#: Statuses a deployment with nothing desired rests in.
_AT_REST = {DeploymentStatus.STOPPED, DeploymentStatus.IDLE, DeploymentStatus.SLEEPING}


class Goal(StrEnum):
    READY = "ready"
    ASLEEP = "asleep"
    GONE = "gone"
    OPERATION = "operation"


@dataclass(frozen=True)
class Outcome:
    """How the wait ended: ``ok`` or not, and one line saying why."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class Waiting:
    """What the wait watches; ``first_status``: the deployment's status in the command's
    answer (None: unknown), ``replica_id``: the one replica a sleep or wake named."""

    goal: Goal
    started_at: float
    first_status: str | None = None
    replica_id: str | None = None
    #: Whether the deployment's status has changed since the command's answer.
    moved: bool = False

    def seen(self, status: str) -> Waiting:
        """This wait once ``status`` was seen: moved on when it differs from the first."""
        if self.moved or status == self.first_status:
            return self
        return Waiting(self.goal, self.started_at, self.first_status, self.replica_id,
                       moved=True)


def judge_deployment(waiting: Waiting, deployment: dict[str, Any] | None, *,
                     now: float) -> Outcome | None:
    """The outcome of a deployment's wait, or None while it goes on. ``deployment``: as
    GET /deployments/{id} answers (None: 404, it is gone)."""
    if deployment is None:
        if waiting.goal is Goal.GONE:
            return Outcome(True, "deleted")
        return Outcome(False, "the deployment was deleted")
    status = DeploymentStatus(deployment["status"])
    replicas = deployment.get("replicas", [])
    states = [ReplicaState(r["state"]) for r in replicas]
    failing = _failing(deployment, status)
    believed = (waiting.moved or status.value != waiting.first_status
                or now - waiting.started_at >= STALE_STATUS_GRACE_S)
    match waiting.goal:
        case Goal.GONE:
            return None
        case Goal.READY:
            if failing is not None:
                return Outcome(False, failing) if believed else None
            if waiting.replica_id is not None:
                state = _state_of(replicas, waiting.replica_id)
                if state is None:
                    return Outcome(False, f"replica {waiting.replica_id} is gone")
                return (Outcome(True, f"replica {waiting.replica_id} is ready")
                        if state is ReplicaState.READY else None)
            desired, ready = deployment["desired_replicas"], deployment["ready_replicas"]
            if any(s in _MOVING or s is ReplicaState.SLEEPING for s in states):
                return None
            if desired == 0 and status in _AT_REST:
                return Outcome(True, f"{status.value}, 0 replicas wanted")
            if status is DeploymentStatus.SERVING and ready == desired:
                return Outcome(True, f"serving, {ready}/{desired} ready")
            return None
        case Goal.ASLEEP:
            if failing is not None and believed:
                return Outcome(False, failing)
            if waiting.replica_id is not None:
                state = _state_of(replicas, waiting.replica_id)
                if state is None:
                    return Outcome(False, f"replica {waiting.replica_id} is gone")
                return (Outcome(True, f"replica {waiting.replica_id} is asleep")
                        if state is ReplicaState.SLEEPING else None)
            if any(s in _MOVING for s in states):
                return None
            asleep = sum(1 for s in states if s is ReplicaState.SLEEPING)
            if asleep:
                return Outcome(True, f"{asleep} replica(s) asleep, "
                                     f"{deployment['ready_replicas']} ready")
            return Outcome(False, "no replica went to sleep (each ready one is within "
                                  "its minimum, or none sleeps on this engine)") \
                if believed else None
        case Goal.OPERATION:
            raise ValueError("an operation's wait is judged by judge_operation")


def judge_operation(operation: dict[str, Any]) -> Outcome | None:
    """The outcome of a saga's wait, from GET /operations/{id}; None while it runs."""
    state = OperationState(operation["state"])
    why = f": {operation['error']}" if operation.get("error") else ""
    match state:
        case OperationState.RUNNING:
            return None
        case OperationState.SUCCEEDED:
            return Outcome(True, f"{operation['operation_id']} succeeded")
        case _:
            return Outcome(False, f"{operation['operation_id']} {state.value}{why}")


def _failing(deployment: dict[str, Any], status: DeploymentStatus) -> str | None:
    """Why the deployment's status is an end that is not success; None when it is not."""
    match status:
        case DeploymentStatus.PARKED:
            last = deployment.get("last_failure")
            return (f"parked after {deployment['consecutive_failures']} failed start(s)"
                    + (f": {last}" if last else ""))
        case DeploymentStatus.CANT_PLACE:
            return f"cannot be placed: {deployment.get('placement_error') or 'no room'}"
        case DeploymentStatus.DELETING:
            return "the deployment is being deleted"
        case _:
            return None


def _state_of(replicas: list[dict[str, Any]], replica_id: str) -> ReplicaState | None:
    return next((ReplicaState(r["state"]) for r in replicas
                 if r["replica_id"] == replica_id), None)
