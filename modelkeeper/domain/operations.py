"""Operations: what an operator asks of the control plane (restart, drain, switch,
reconfigure), each run by a saga workflow (workflows/restart.py, drain.py, switch.py) and
kept as one row of the ``operations`` table (:mod:`modelkeeper.store.operations`).

Here: the record the store keeps and ``GET /operations`` shows, each saga's input, and the
inputs and results of the sagas' store activities (activities/operations.py). What a saga
asks of a deployment's workflow, the moves, is :mod:`modelkeeper.domain.moves`.

Pure: no temporalio, httpx or asyncpg.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import Field

from .base import Tolerant
from .ids import DeploymentId, ModelId, NodeId, OperationId, ReplicaId


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
    """One visible step of a saga (a move, a cordon, a compensation)."""

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


# -- the sagas' store activities: inputs and results ---------------------------------------


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
