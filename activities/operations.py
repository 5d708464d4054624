"""The sagas' activities that keep their record and the cordon in the store (control queue).

A saga (workflows/restart.py, drain.py, switch.py) calls these by method, through their
stubs (:mod:`activities.saga_stubs`: workflows must not import the store); each is one or
two short queries, so a start-to-close of 10 s is plenty, and each is idempotent, so the
caller may retry it freely (only ``begin_operation``'s conflict is final: it is raised
non-retryable).

The API inserts an operation's row before it starts the saga; a saga started with the
``temporal`` CLI has none, and its ``begin_operation`` inserts it. Either way the saga
calls ``begin_operation`` first and ``record_operation`` at each step.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from modelkeeper.domain.nodes import NodeUpdate
from modelkeeper.domain.notify import rollback_notice
from modelkeeper.domain.operations import (
    NodeDeploymentsInput,
    NodeReplica,
    OperationRecord,
    OperationState,
    SetCordonInput,
)
from modelkeeper.infra.notify import start_notice
from modelkeeper.infra.temporal import signal_unplaceable
from modelkeeper.names import (
    ACTIVITY_BEGIN_OPERATION,
    ACTIVITY_NODE_DEPLOYMENTS,
    ACTIVITY_RECORD_OPERATION,
    ACTIVITY_SET_CORDON,
    ERROR_OPERATION_CONFLICT,
)
from modelkeeper.settings import Settings
from modelkeeper.store import OperationConflictError, Store

from .saga_stubs import OperationsActivityStubs


class OperationsActivities(OperationsActivityStubs):
    """The operations' activities, bound to one store and one Temporal client."""

    def __init__(self, store: Store, client: Client, settings: Settings | None = None) -> None:
        self._store = store
        self._operations = store.operations
        self._client = client
        #: None: no notifications (tests that need none).
        self._settings = settings

    @activity.defn(name=ACTIVITY_BEGIN_OPERATION)
    async def begin_operation(self, record: OperationRecord) -> OperationRecord:
        """Insert the saga's record, or answer the one already stored under its id (the
        API's, or this activity's first attempt) as it stands.

        Another operation running on the same deployment or node raises a non-retryable
        ``ERROR_OPERATION_CONFLICT`` naming it, with its id and kind as details: retrying
        cannot help while it runs. Timeout: 10 s start-to-close.
        """
        try:
            return await self._operations.begin(record)
        except OperationConflictError as exc:
            raise _conflict(exc) from exc

    @activity.defn(name=ACTIVITY_RECORD_OPERATION)
    async def record_operation(self, record: OperationRecord) -> None:
        """Write the saga's state, summary, steps and error (an upsert: a retry writes the
        same again). Timeout: 10 s start-to-close.

        A running record whose row was ended meanwhile (the API judged its start failed)
        while another operation began on its subject raises the same non-retryable
        conflict as ``begin_operation``: two sagas must not both run on one subject."""
        try:
            await self._operations.save(record)
        except OperationConflictError as exc:
            raise _conflict(exc) from exc
        if record.state is OperationState.ROLLBACK_INCOMPLETE and self._settings is not None:
            # A saga may record its end more than once (a retry): the notice is
            # de-duplicated per hour by its id.
            await start_notice(self._client, rollback_notice(
                record.operation_id, record.kind.value, record.error,
                deployment_id=record.deployment_id, node_id=record.node_id,
                now=datetime.now(UTC)), self._settings)

    @activity.defn(name=ACTIVITY_SET_CORDON)
    async def set_cordon(self, request: SetCordonInput) -> bool:
        """Cordon or uncordon a node, as ``PATCH /nodes/{id}`` does; False when the node
        is unknown. A cordon is the operator's setting, so it survives the agent's
        re-registration. Timeout: 10 s start-to-close.

        An uncordon tells the deployments waiting for room that the node may take them,
        as the API does; a retry signals again, which costs a waiting deployment one
        placement attempt at most.
        """
        update = NodeUpdate(cordoned=request.cordoned,
                            cordon_reason=request.reason if request.cordoned else None)
        if await self._store.nodes.update_node(request.node_id, update) is None:
            return False
        if not request.cordoned:
            await signal_unplaceable(
                self._client, await self._store.deployments.deployment_ids_waiting_for_room())
        return True

    @activity.defn(name=ACTIVITY_NODE_DEPLOYMENTS)
    async def node_deployments(self, request: NodeDeploymentsInput) -> list[NodeReplica]:
        """The replicas holding a claim on the node, in any state, by deployment and then
        replica id (a read: nothing to repeat). Timeout: 10 s start-to-close."""
        on_node = await self._store.nodes.replicas_on_node(request.node_id)
        return [NodeReplica(deployment_id=deployment_id, replica_id=replica_id)
                for deployment_id, replicas in on_node.items() for replica_id in replicas]

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the control worker to register."""
        return [self.begin_operation, self.record_operation, self.set_cordon,
                self.node_deployments]


def _conflict(exc: OperationConflictError) -> ApplicationError:
    """The store's conflict as the sagas match it: final, naming the running operation,
    with its id and kind as details."""
    return ApplicationError(str(exc), exc.running.operation_id, exc.running.kind.value,
                            type=ERROR_OPERATION_CONFLICT, non_retryable=True)
