"""The sagas' activities as the sagas call them: each one's name, input and result, with
no body.

A saga calls ``workflow.execute_activity_method(OpsActivityStubs.request_op, call, ...)``,
so mypy checks the input and the result of every hop. The classes that run them subclass
these (``activities.ops.OpsActivities``, ``activities.operations.OperationsActivities``),
so mypy checks each implementation against its stub too. They cannot be the sagas' own
references: ``activities.operations`` holds the store (workflows must not import it, even
through another module), and ``activities.ops`` imports the deployment workflow to call its
updates by method, which would make ``workflows`` import itself.

The names are recorded in every saga's history: a rename breaks the replay of a saga in
flight (tests/histories/saga_*.json replay them). Imports nothing but the domain, the names
and ``temporalio.activity``, so a workflow may pass it through its sandbox.
"""

from __future__ import annotations

from temporalio import activity

from modelkeeper.domain.ops import (
    AwaitOpCall,
    CancelOpCall,
    DeploymentBrief,
    DescribeDeploymentInput,
    NodeDeploymentsInput,
    NodeReplica,
    OpCall,
    OperationRecord,
    OpOutcome,
    SetCordonInput,
    SetGenerationCall,
)
from modelkeeper.names import (
    ACTIVITY_AWAIT_OP,
    ACTIVITY_BEGIN_OPERATION,
    ACTIVITY_CANCEL_OP,
    ACTIVITY_DESCRIBE_DEPLOYMENT,
    ACTIVITY_NODE_DEPLOYMENTS,
    ACTIVITY_RECORD_OPERATION,
    ACTIVITY_REQUEST_OP,
    ACTIVITY_SET_CORDON,
    ACTIVITY_SET_GENERATION,
)


class OpsActivityStubs:
    """What a saga asks of a deployment's workflow; ``activities.ops`` says how each fails."""

    @activity.defn(name=ACTIVITY_REQUEST_OP)
    async def request_op(self, call: OpCall) -> OpOutcome:
        """Ask for a surge, replace or retire; answers the op as it stands."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_AWAIT_OP)
    async def await_op(self, call: AwaitOpCall) -> OpOutcome:
        """Long-poll the op until it has ended, heartbeating."""
        raise NotImplementedError

    @activity.defn(name=ACTIVITY_CANCEL_OP)
    async def cancel_op(self, call: CancelOpCall) -> OpOutcome:
        """The compensation of an op; answers the op as it stands after the cancel."""
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
