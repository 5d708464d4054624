"""Changes to what serves: the contract between the sagas and the deployment workflow.

A saga (workflows/restart.py, drain.py, switch.py) never starts, stops or watches a replica
itself. It asks the deployment workflow, the single writer of its replicas, through
updates whose inputs and answers are defined here:

* ``op`` with an :class:`OpRequest`:
  - ``surge``: place one extra replica (optionally avoiding some nodes, optionally on
    another :class:`Generation`); it counts toward desired + surge, so the keeper does
    not scale it straight back down, until a ``retire`` that ``balances`` it, or its
    ``cancel_op``;
  - ``replace``: surge, then retire ``replica_id`` once the new one is ready (with
    ``stop_first``: retire first, then surge, for when both do not fit);
  - ``retire``: drain ``replica_id`` (it leaves routing, its in-flight requests finish
    within the grace period) and stop it.
* ``await_op`` with an :class:`AwaitOpRequest`: a long poll that answers the op's
  :class:`OpOutcome` once it has ended, or as it stands after ``wait_s``.
* ``cancel_op`` with a :class:`CancelOpRequest`: the compensation. It retires what the
  op surged and keeps what it would have retired.
* ``set_generation`` with a :class:`SetGenerationRequest`: the model and engine arguments
  the deployment runs from now on (a switch's commit, or its rollback).

Op ids are the saga's workflow id plus its step, so a retried update (an activity retried
after a worker crash) finds its op in the registry and is answered again, never repeated.

Pure: no temporalio, httpx or asyncpg.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import Field

from .base import Tolerant
from .ids import DeploymentId, ModelId, NodeId, OperationId, OpId, ReplicaId

# -- what a replica runs -------------------------------------------------------------------


class Generation(Tolerant):
    """What a replica runs: a catalog model, with engine arguments laid over the catalog
    entry's. The deployment's served name (what clients send as ``model``) does not change
    with it: a switch changes the model behind the name."""

    #: Counts changes of the deployment (a restart, a switch, a reconfigure each take the
    #: next), so "every replica is on the new generation" can be checked.
    number: int = 0
    model_id: ModelId
    #: Laid over the catalog entry's engine_args (the same allow-list applies).
    engine_args: dict[str, Any] = Field(default_factory=dict)


# -- ops: the deployment workflow's side ---------------------------------------------------


class OpKind(StrEnum):
    SURGE = "surge"
    REPLACE = "replace"
    RETIRE = "retire"


class OpState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # error says why (no room, the new replica failed to start, ...)
    CANCELLED = "cancelled"  # cancel_op: what it surged is retired


#: An op has ended in one of these; await_op answers at once.
OP_ENDED = frozenset({OpState.SUCCEEDED, OpState.FAILED, OpState.CANCELLED})


class OpRequest(Tolerant):
    """Input of the deployment workflow's ``op`` update."""

    op_id: OpId = Field(min_length=1, max_length=300)
    kind: OpKind
    #: replace and retire: the replica to retire.
    replica_id: ReplicaId | None = None
    #: surge and replace: the new replica goes on none of these (a drained node).
    avoid_nodes: list[NodeId] = Field(default_factory=list)
    #: surge and replace: run this instead of the deployment's current generation.
    generation: Generation | None = None
    #: replace: retire first, then surge (there is no room for both at once).
    stop_first: bool = False
    #: retire: ends the extra allowance of this surge op (surge, then retire another).
    balances: OpId | None = None
    #: Why, for the replica's stop reason and the events ("restart/d1/3").
    reason: str = Field(default="", max_length=500)


class OpOutcome(Tolerant):
    """An op as it stands: the answer of ``op``, ``await_op`` and ``cancel_op``."""

    op_id: OpId
    kind: OpKind
    state: OpState
    #: The replica the op placed (surge, replace), once it has an id.
    surged: ReplicaId | None = None
    #: The replica the op retired or will retire (replace, retire).
    retired: ReplicaId | None = None
    error: str | None = None
    #: When the op was asked for and when it ended (workflow time): a stop-first replace's
    #: outage window is from the retire to the new replica's readiness, both shown here.
    started_at: datetime | None = None
    ended_at: datetime | None = None
    #: What happened, in order, for the saga's step ("stopped d1-r1 at ...; d1-r3 ready").
    detail: str = ""


class AwaitOpRequest(Tolerant):
    """Input of ``await_op``: answer once the op has ended, or after ``wait_s``."""

    op_id: OpId
    wait_s: float = Field(default=50.0, gt=0, le=300)


class CancelOpRequest(Tolerant):
    """Input of ``cancel_op``."""

    op_id: OpId


class SetGenerationRequest(Tolerant):
    """Input of ``set_generation``: the deployment runs this from now on. Replicas already
    running keep theirs until replaced (they show as outdated)."""

    op_id: OpId
    generation: Generation


class ReplicaBrief(Tolerant):
    """One replica of a deployment as a saga sees it (activity ``deployment_replicas``)."""

    replica_id: ReplicaId
    phase: str
    nodes: list[NodeId] = Field(default_factory=list)
    generation: Generation | None = None
    #: Leased to this op (surged or being retired by it).
    op_id: OpId | None = None


class DeploymentBrief(Tolerant):
    """A deployment as a saga sees it: its generation, desired count and replicas."""

    deployment_id: DeploymentId
    desired: int
    status: str
    deleting: bool = False
    generation: Generation
    replicas: list[ReplicaBrief] = Field(default_factory=list)


# -- operations: the sagas' side -----------------------------------------------------------


class OperationKind(StrEnum):
    RESTART = "restart"
    DRAIN = "drain"
    SWITCH = "switch"
    RECONFIGURE = "reconfigure"


class OperationState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # nothing to undo, or undone
    ROLLED_BACK = "rolled_back"  # it failed and every step was undone
    ROLLBACK_INCOMPLETE = "rollback_incomplete"  # an undo failed: error names each part
    CANCELLED = "cancelled"


class StepState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    UNDONE = "undone"  # compensated
    UNDO_FAILED = "undo_failed"


class OperationStep(Tolerant):
    """One visible step of a saga (an op, a cordon, a compensation)."""

    name: str
    state: StepState
    detail: str = ""
    started_at: datetime | None = None
    ended_at: datetime | None = None


class OperationRecord(Tolerant):
    """A saga as the store keeps it and GET /operations shows it."""

    operation_id: OperationId
    kind: OperationKind
    #: The deployment it changes (restart, switch, reconfigure), or None (drain).
    deployment_id: DeploymentId | None = None
    #: The node it empties (drain).
    node_id: NodeId | None = None
    state: OperationState = OperationState.RUNNING
    summary: str = ""
    steps: list[OperationStep] = Field(default_factory=list)
    error: str | None = None
    #: Who asked (an operator token's name, later; "temporal" when started by the CLI).
    requested_by: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None


class RestartInput(Tolerant):
    """RestartSaga: replace each replica in turn, each on the deployment's next generation."""

    deployment_id: DeploymentId
    requested_by: str = ""


#: The longest a drain may give its replicas to move: a day. A drain is a maintenance
#: window's step; one left waiting longer holds its node cordoned and forgotten.
MAX_DRAIN_GRACE_S = 86_400.0


class DrainInput(Tolerant):
    """DrainSaga: cordon the node, replace each replica on it elsewhere within
    ``grace_s``; a replica with nowhere else to go is stopped at the end, with that
    reason."""

    node_id: NodeId
    grace_s: float = Field(default=300.0, gt=0, le=MAX_DRAIN_GRACE_S)
    #: Cancelling the drain uncordons the node too.
    uncordon_on_cancel: bool = False
    requested_by: str = ""


class SwitchInput(Tolerant):
    """SwitchSaga: move the deployment to another model (switch) or other engine arguments
    (reconfigure), replica by replica, with rollback."""

    deployment_id: DeploymentId
    model_id: ModelId | None = None
    engine_args: dict[str, Any] | None = None
    requested_by: str = ""


# -- the sagas' activities: inputs and results ---------------------------------------------


class OpCall(Tolerant):
    """Input of ``request_op``: ask this deployment's workflow for an op."""

    deployment_id: DeploymentId
    request: OpRequest


class AwaitOpCall(Tolerant):
    """Input of ``await_op``: wait for an op of this deployment to end (the activity long-
    polls the ``await_op`` update and heartbeats until it has)."""

    deployment_id: DeploymentId
    request: AwaitOpRequest


class CancelOpCall(Tolerant):
    """Input of ``cancel_op``."""

    deployment_id: DeploymentId
    request: CancelOpRequest


class SetGenerationCall(Tolerant):
    """Input of ``set_generation``."""

    deployment_id: DeploymentId
    request: SetGenerationRequest


class DescribeDeploymentInput(Tolerant):
    """Input of ``describe_deployment`` (answers a :class:`DeploymentBrief`)."""

    deployment_id: DeploymentId


class SetCordonInput(Tolerant):
    """Input of ``set_cordon``: cordon (or uncordon) a node, with the reason shown."""

    node_id: NodeId
    cordoned: bool
    reason: str | None = None


class NodeDeploymentsInput(Tolerant):
    """Input of ``node_deployments``: which replicas hold a claim on this node."""

    node_id: NodeId


class NodeReplica(Tolerant):
    """One replica holding a claim on a node (``node_deployments`` answers a list)."""

    deployment_id: DeploymentId
    replica_id: ReplicaId
