"""The sagas' activities as the sagas call them (and the schedule windows' workflow its
own, :class:`WindowActivityStubs`): each one's name, input and result, with no body.

A saga calls ``workflow.execute_activity_method(MoveActivityStubs.request_move, call, ...)``,
so mypy checks the input and the result of every hop. The classes that run them subclass
these (``activities.moves.MoveActivities``, ``activities.operations.OperationsActivities``),
so mypy checks each implementation against its stub too. They cannot be the sagas' own
references: ``activities.operations`` holds the store (workflows must not import it, even
through another module), and ``activities.moves`` imports the deployment workflow to call its
updates by method, which would make ``workflows`` import itself.

The names are recorded in every saga's history: a rename breaks the replay of a saga in
flight (tests/histories/saga_*.json replay them). Imports nothing but the domain, the names
and ``temporalio.activity``, so a workflow may pass it through its sandbox.
"""

from __future__ import annotations

from temporalio import activity

from modelkeeper.domain.moves import (
    AwaitMoveCall,
    CancelMoveCall,
    DeploymentBrief,
    DescribeDeploymentInput,
    MoveCall,
    MoveOutcome,
    SetGenerationCall,
)
from modelkeeper.domain.operations import (
    NodeDeploymentsInput,
    NodeReplica,
    OperationRecord,
    SetCordonInput,
)
from modelkeeper.domain.schedules import WindowInput
from modelkeeper.names import (
    ACTIVITY_APPLY_WINDOW,
    ACTIVITY_AWAIT_MOVE,
    ACTIVITY_BEGIN_OPERATION,
    ACTIVITY_CANCEL_MOVE,
    ACTIVITY_DESCRIBE_DEPLOYMENT,
    ACTIVITY_DROP_WINDOW,
    ACTIVITY_NODE_DEPLOYMENTS,
    ACTIVITY_RECORD_OPERATION,
    ACTIVITY_REQUEST_MOVE,
    ACTIVITY_SET_CORDON,
    ACTIVITY_SET_GENERATION,
)


class MoveActivityStubs:
    """What a saga asks of a deployment's workflow; ``activities.moves`` says how each fails."""

    @activity.defn(name=ACTIVITY_REQUEST_MOVE)
    async def request_move(self, call: MoveCall) -> MoveOutcome:
        """Ask for a surge, replace or retire; answers the move as it stands."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_AWAIT_MOVE)
    async def await_move(self, call: AwaitMoveCall) -> MoveOutcome:
        """Long-poll the move until it has ended, heartbeating."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_CANCEL_MOVE)
    async def cancel_move(self, call: CancelMoveCall) -> MoveOutcome:
        """The compensation of a move; answers the move as it stands after the cancel."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_SET_GENERATION)
    async def set_generation(self, call: SetGenerationCall) -> None:
        """Set what the deployment runs from now on."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_DESCRIBE_DEPLOYMENT)
    async def describe_deployment(self, request: DescribeDeploymentInput) -> DeploymentBrief:
        """The deployment as a saga sees it."""
        raise NotImplementedError


class OperationsActivityStubs:
    """What a saga keeps in the store: its record and the cordon."""

    @activity.defn(name=ACTIVITY_BEGIN_OPERATION)
    async def begin_operation(self, record: OperationRecord) -> OperationRecord:
        """Insert the saga's record, or answer the one stored under its id."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_RECORD_OPERATION)
    async def record_operation(self, record: OperationRecord) -> None:
        """Write the saga's state, summary, steps and error."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_SET_CORDON)
    async def set_cordon(self, request: SetCordonInput) -> bool:
        """Cordon or uncordon a node; False when the node is unknown."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_NODE_DEPLOYMENTS)
    async def node_deployments(self, request: NodeDeploymentsInput) -> list[NodeReplica]:
        """The replicas holding a claim on the node."""
        raise NotImplementedError


class WindowActivityStubs:
    """What a schedule window's workflow (workflows/window.py) asks: the same hands as the
    sagas', on one update (``activities.windows`` runs them)."""

    @activity.defn(name=ACTIVITY_APPLY_WINDOW)
    async def apply_window(self, request: WindowInput) -> int:
        """Open or close the window on the deployment; the replica count it wants now."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_DROP_WINDOW)
    async def drop_window(self, request: WindowInput) -> bool:
        """Remove the window's schedules (its deployment is gone); whether any were left."""
        raise NotImplementedError
