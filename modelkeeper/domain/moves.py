"""Changes to what serves: the contract between the sagas and the deployment workflow.

A saga (workflows/restart.py, drain.py, switch.py) never starts, stops or watches a replica
itself. It asks the deployment workflow, the single writer of its replicas, through
updates whose inputs and answers are defined here:

* ``move`` with a :class:`MoveRequest`:
  - ``surge``: place one extra replica (optionally avoiding some nodes, optionally on
    another :class:`Generation`); it counts toward desired + surge, so the keeper does
    not scale it straight back down, until a ``retire`` that ``balances`` it, or its
    ``cancel_move``;
  - ``replace``: surge, then retire ``replica_id`` once the new one is ready (with
    ``stop_first``: retire first, then surge, for when both do not fit);
  - ``retire``: drain ``replica_id`` (it leaves routing, its in-flight requests finish
    within the grace period) and stop it.
* ``await_move`` with an :class:`AwaitMoveRequest`: a long poll that answers the move's
  :class:`MoveOutcome` once it has ended, or as it stands after ``wait_s``.
* ``cancel_move`` with a :class:`CancelMoveRequest`: the compensation. It retires what the
  move surged and keeps what it would have retired.
* ``set_generation`` with a :class:`SetGenerationRequest`: the model and engine arguments
  the deployment runs from now on (a switch's commit, or its rollback).

Move ids are the saga's workflow id plus its step, so a retried update (an activity retried
after a worker crash) finds its move in the registry and is answered again, never repeated.

Pure: no temporalio, httpx or asyncpg.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from .base import Tolerant
from .catalog import Generation
from .ids import DeploymentId, MoveId, NodeId, ReplicaId

# -- moves: the deployment workflow's side -----------------------------------------------


class MoveKind(StrEnum):
    SURGE = "surge"
    REPLACE = "replace"
    RETIRE = "retire"


class MoveState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # error says why (no room, the new replica failed to start, ...)
    CANCELLED = "cancelled"  # cancel_move: what it surged is retired


#: A move has ended in one of these; await_move answers at once.
MOVE_ENDED = frozenset({MoveState.SUCCEEDED, MoveState.FAILED, MoveState.CANCELLED})


class MoveRequest(Tolerant):
    """Input of the deployment workflow's ``move`` update."""

    move_id: MoveId = Field(min_length=1, max_length=300)
    kind: MoveKind
    #: replace and retire: the replica to retire.
    replica_id: ReplicaId | None = None
    #: surge and replace: the new replica goes on none of these (a drained node).
    avoid_nodes: list[NodeId] = Field(default_factory=list)
    #: surge and replace: run this instead of the deployment's current generation.
    generation: Generation | None = None
    #: replace: retire first, then surge (there is no room for both at once).
    stop_first: bool = False
    #: retire: ends the extra allowance of this surge move (surge, then retire another).
    balances: MoveId | None = None
    #: Why, for the replica's stop reason and the events ("restart/d1/3").
    reason: str = Field(default="", max_length=500)


class MoveOutcome(Tolerant):
    """A move as it stands: the answer of ``move``, ``await_move`` and ``cancel_move``."""

    move_id: MoveId
    kind: MoveKind
    state: MoveState
    #: The replica the move placed (surge, replace), once it has an id.
    surged: ReplicaId | None = None
    #: The replica the move retired or will retire (replace, retire).
    retired: ReplicaId | None = None
    error: str | None = None
    #: When the move was asked for and when it ended (workflow time): a stop-first replace's
    #: outage window is from the retire to the new replica's readiness, both shown here.
    started_at: datetime | None = None
    ended_at: datetime | None = None
    #: What happened, in order, for the saga's step ("stopped d1-r1 at ...; d1-r3 ready").
    detail: str = ""


class AwaitMoveRequest(Tolerant):
    """Input of ``await_move``: answer once the move has ended, or after ``wait_s``."""

    move_id: MoveId
    wait_s: float = Field(default=50.0, gt=0, le=300)


class CancelMoveRequest(Tolerant):
    """Input of ``cancel_move``."""

    move_id: MoveId


class SetGenerationRequest(Tolerant):
    """Input of ``set_generation``: the deployment runs this from now on. Replicas already
    running keep theirs until replaced (they show as outdated)."""

    move_id: MoveId
    generation: Generation


class ReplicaBrief(Tolerant):
    """One replica of a deployment as a saga sees it (activity ``deployment_replicas``)."""

    replica_id: ReplicaId
    phase: str
    nodes: list[NodeId] = Field(default_factory=list)
    generation: Generation | None = None
    #: Leased to this move (surged or being retired by it).
    move_id: MoveId | None = None


class DeploymentBrief(Tolerant):
    """A deployment as a saga sees it: its generation, desired count and replicas."""

    deployment_id: DeploymentId
    desired: int
    status: str
    deleting: bool = False
    generation: Generation
    replicas: list[ReplicaBrief] = Field(default_factory=list)


# -- the sagas' activities: inputs and results ---------------------------------------------


class MoveCall(Tolerant):
    """Input of ``request_move``: ask this deployment's workflow for a move."""

    deployment_id: DeploymentId
    request: MoveRequest


class AwaitMoveCall(Tolerant):
    """Input of ``await_move``: wait for a move of this deployment to end (the activity long-
    polls the ``await_move`` update and heartbeats until it has)."""

    deployment_id: DeploymentId
    request: AwaitMoveRequest


class CancelMoveCall(Tolerant):
    """Input of ``cancel_move``."""

    deployment_id: DeploymentId
    request: CancelMoveRequest


class SetGenerationCall(Tolerant):
    """Input of ``set_generation``."""

    deployment_id: DeploymentId
    request: SetGenerationRequest


class DescribeDeploymentInput(Tolerant):
    """Input of ``describe_deployment`` (answers a :class:`DeploymentBrief`)."""

    deployment_id: DeploymentId
