"""The sagas' hands on a deployment: activities that ask its workflow for moves (run by the
control worker).

A Python workflow cannot send an update to another workflow, so a saga (workflows/restart.py,
drain.py, switch.py) asks through these. Each is one update or query of the deployment's
workflow (``deployment/<id>``), the single writer of its replicas, called by method
(``DeploymentWorkflow.move``), so mypy checks what goes in and comes back; none touches a
replica itself. The contract is :mod:`modelkeeper.domain.moves`; the sagas call these through
their stubs (:mod:`activities.saga_stubs`).

Failures a retry cannot mend are non-retryable, with the deployment's own words:

* the workflow refused the update (its validator: an unknown replica, one leased to another
  move, the surge limit, a deployment being deleted): ``ERROR_MOVE_REFUSED`` (or the type the
  workflow gave), with its message;
* the workflow is not running (deleted, never started): ``ERROR_NO_DEPLOYMENT``, naming the
  deployment.

Anything else (the server unreachable, an RPC timeout, the deployment's worker down) is
raised as it is and retried by the saga's retry policy: asking again is safe, since move ids
make every update idempotent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio import activity
from temporalio.api.errordetails.v1 import NamespaceNotFoundFailure
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.domain.ids import DeploymentId
from modelkeeper.domain.moves import (
    MOVE_ENDED,
    AwaitMoveCall,
    CancelMoveCall,
    DeploymentBrief,
    DescribeDeploymentInput,
    MoveCall,
    MoveOutcome,
    SetGenerationCall,
)
from modelkeeper.infra.temporal import execute_update
from modelkeeper.names import (
    ACTIVITY_AWAIT_MOVE,
    ACTIVITY_CANCEL_MOVE,
    ACTIVITY_DESCRIBE_DEPLOYMENT,
    ACTIVITY_REQUEST_MOVE,
    ACTIVITY_SET_GENERATION,
    ERROR_MOVE_REFUSED,
    ERROR_NO_DEPLOYMENT,
    UPDATE_CANCEL_MOVE,
    UPDATE_MOVE,
    UPDATE_SET_GENERATION,
    deployment_workflow_id,
)
from workflows.deployment import DeploymentWorkflow

from .saga_stubs import MoveActivityStubs

_R = TypeVar("_R")

#: What the server says of an update to a workflow that has closed, or that closed while
#: the update was in flight. Matched in lower case: it is text, not a code.
_COMPLETED_MARKERS = ("workflow execution already completed",
                      "workflow completed before the update completed")


#: await_move heartbeats this often, during a poll as well as between polls; the saga's
#: heartbeat timeout (workflows/saga.py AWAIT_HEARTBEAT_TIMEOUT) is several of these.
AWAIT_HEARTBEAT_EVERY_S = 2.0


class MoveActivities(MoveActivityStubs):
    """Activities bound to one Temporal client: each asks one deployment's workflow."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def _handle(self, deployment_id: DeploymentId) -> WorkflowHandle[DeploymentWorkflow, Any]:
        # By workflow id alone: the latest run, whatever continue-as-new has done.
        return self._client.get_workflow_handle_for(DeploymentWorkflow.run,
                                                    deployment_workflow_id(deployment_id))

    async def _update(self, deployment_id: DeploymentId, update: Awaitable[_R]) -> _R:
        return await ask_deployment(deployment_id, update)

    @activity.defn(name=ACTIVITY_REQUEST_MOVE)
    async def request_move(self, call: MoveCall) -> MoveOutcome:
        """Ask for a surge, replace or retire; answers the move as it stands (usually
        running). A retry asks again with the same move id and is answered, never repeated."""
        return await self._update(call.deployment_id, execute_update(
            self._handle(call.deployment_id), DeploymentWorkflow.move, call.request,
            id=f"{UPDATE_MOVE}:{call.request.move_id}"))

    @activity.defn(name=ACTIVITY_AWAIT_MOVE)
    async def await_move(self, call: AwaitMoveCall) -> MoveOutcome:
        """Long-poll the move until it has ended, heartbeating between polls.

        Each poll is one ``await_move`` update that answers within ``call.request.wait_s``;
        the saga's heartbeat timeout outlasts one. It only reads, so a retry (after a
        worker crash or a missed heartbeat) simply polls again. No update id: each poll
        must be answered afresh, not from the server's memory of the first."""
        while True:
            poll = asyncio.ensure_future(self._update(call.deployment_id, execute_update(
                self._handle(call.deployment_id), DeploymentWorkflow.await_move,
                call.request)))
            try:
                # Heartbeat while the poll waits too: the saga's heartbeat timeout can then
                # be short, and a worker killed mid-poll is replaced in seconds.
                while not poll.done():
                    activity.heartbeat("polling")
                    await asyncio.wait({poll}, timeout=AWAIT_HEARTBEAT_EVERY_S)
            finally:
                poll.cancel()
            outcome = poll.result()
            if outcome.state in MOVE_ENDED:
                return outcome
            activity.heartbeat(outcome.state.value)

    @activity.defn(name=ACTIVITY_CANCEL_MOVE)
    async def cancel_move(self, call: CancelMoveCall) -> MoveOutcome:
        """The compensation: retire what the move surged, keep what it would have
        retired. Answers the move as it stands after the cancel."""
        return await self._update(call.deployment_id, execute_update(
            self._handle(call.deployment_id), DeploymentWorkflow.cancel_move, call.request,
            id=f"{UPDATE_CANCEL_MOVE}:{call.request.move_id}"))

    @activity.defn(name=ACTIVITY_SET_GENERATION)
    async def set_generation(self, call: SetGenerationCall) -> None:
        """Set what the deployment runs from now on (a switch's commit, or a restart's)."""
        await self._update(call.deployment_id, execute_update(
            self._handle(call.deployment_id), DeploymentWorkflow.set_generation,
            call.request, id=f"{UPDATE_SET_GENERATION}:{call.request.move_id}"))

    @activity.defn(name=ACTIVITY_DESCRIBE_DEPLOYMENT)
    async def describe_deployment(self, request: DescribeDeploymentInput) -> DeploymentBrief:
        """The deployment as a saga sees it: generation, desired count, replicas."""
        try:
            brief = await self._handle(request.deployment_id).query(DeploymentWorkflow.brief)
        except RPCError as err:
            if _not_running(err):
                raise _no_deployment(request.deployment_id) from err
            raise
        return brief

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the worker to register."""
        return [self.request_move, self.await_move, self.cancel_move, self.set_generation,
                self.describe_deployment]


async def ask_deployment(deployment_id: DeploymentId, update: Awaitable[_R]) -> _R:
    """One update of a deployment's workflow (``execute_update`` by method, so mypy checks
    it), its refusals and a closed workflow turned into non-retryable errors (the module
    docstring says which). The schedule windows' activity (activities/windows.py) asks
    through it too."""
    try:
        result = await update
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if _says_completed(str(cause)):
            raise _no_deployment(deployment_id) from err
        if isinstance(cause, ApplicationError):
            # The workflow's own answer (its validator or handler): asking again asks
            # the same question of the same state.
            raise ApplicationError(cause.message, type=cause.type or ERROR_MOVE_REFUSED,
                                   non_retryable=True) from err
        raise
    except RPCError as err:
        if _not_running(err):
            raise _no_deployment(deployment_id) from err
        raise
    return result


def _says_completed(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _COMPLETED_MARKERS)


def _not_running(err: RPCError) -> bool:
    """Whether the error says the deployment's workflow is not there to answer.

    A NOT_FOUND that names the namespace is a misconfigured client, not a missing
    deployment: it stays retryable (and visible) rather than failing every saga."""
    if err.status is not RPCStatusCode.NOT_FOUND:
        return _says_completed(err.message)
    return not any(detail.Is(NamespaceNotFoundFailure.DESCRIPTOR)
                   for detail in err.grpc_status.details)


def _no_deployment(deployment_id: DeploymentId) -> ApplicationError:
    return ApplicationError(
        f"deployment {deployment_id!r} has no running workflow "
        f"({deployment_workflow_id(deployment_id)}): it was deleted or never started",
        type=ERROR_NO_DEPLOYMENT, non_retryable=True)
