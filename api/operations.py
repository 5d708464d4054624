"""Routes for the sagas: start a restart, switch, reconfigure or drain; list, show and
cancel them.

Each start inserts the operation's row first (``OperationsStore.begin_next``): the
database lets one saga run per deployment and per node, so a second request gets a 409
naming the running one before anything starts. Then the saga's workflow starts, under
the row's readable id (``restart/d1/3``), on the control queue; if that fails, the row is
marked failed, with the reason. The saga itself writes its steps and outcome to the row.

A row still ``running`` whose workflow has ended without writing its outcome (terminated
with the ``temporal`` CLI, or its start lost) would block its deployment or node for
good; a start refused by one, and a cancel of one, end it first (:func:`abandoned`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Self, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.exceptions import RequestValidationError
from pydantic import Field, StrictBool, ValidationError, model_validator
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.bounds import MAX_REPLICAS, JsonInt
from modelkeeper.domain.capacity import CapacityClass, OwnerPath
from modelkeeper.domain.catalog import DeploymentView
from modelkeeper.domain.demand import ScalingRequest
from modelkeeper.domain.engine_args import EngineConfigError, check_engine_arg_names
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.no_room import IF_NO_ROOM_HELP, MAX_PLAN_NUMBER, PLAN_HELP, IfNoRoom
from modelkeeper.domain.operations import (
    MAX_DRAIN_GRACE_S,
    DrainInput,
    OperationKind,
    OperationRecord,
    OperationState,
    RestartInput,
    SwitchInput,
)
from modelkeeper.domain.operators import Operator
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.names import CONTROL_TASK_QUEUE
from modelkeeper.store import OperationConflictError, OperationsStore, Store
from modelkeeper.store.operations import MAX_LIST_LIMIT, OperationNumberingError
from workflows.drain import DrainSaga
from workflows.restart import RestartSaga
from workflows.switch import SwitchSaga

from .auth import OperatorDep, change
from .deps import StoreDep, TemporalDep
from .problems import problems

router = APIRouter()

_I = TypeVar("_I")

#: A running row whose workflow Temporal does not know is left alone this long: the API
#: inserts the row before it starts the workflow, and a start in flight must not see its
#: row ended under it. Far above one start's round trip, and short enough that a row left
#: by an API that died between the two stops blocking its subject within a minute.
START_GRACE = timedelta(seconds=60)


async def _operations(store: StoreDep) -> OperationsStore:
    # async: a plain def would run in FastAPI's thread pool (see api/deps.py).
    return store.operations


OperationsDep = Annotated[OperationsStore, Depends(_operations)]


class OperationStarted(OperationRecord):
    """What a start answers (202): the operation's record and its workflow's id."""

    workflow_id: str


class SwitchRequest(Frozen):
    """POST /deployments/{id}/switch: the catalog model to serve under the same name."""

    model_id: ModelId


class ReconfigureRequest(Frozen):
    """POST /deployments/{id}/reconfigure: engine arguments to lay over the catalog
    entry's (the same allow-list applies)."""

    engine_args: dict[str, Any]


class DrainRequest(Frozen):
    """POST /nodes/{id}/drain (the body is optional); the limits are DrainInput's."""

    grace_s: float | None = Field(default=None, gt=0, le=MAX_DRAIN_GRACE_S)
    uncordon_on_cancel: StrictBool = False


class DeploymentPatch(Frozen):
    """PATCH /deployments/{id}: one of a replica count (scale: min = max = N), a scaling
    policy (docs/demand.md), engine arguments (a reconfigure, as POST
    /deployments/{id}/reconfigure), or its tenancy: an owner and/or a capacity class
    (docs/capacity.md)."""

    replicas: JsonInt | None = Field(default=None, ge=0, le=MAX_REPLICAS)
    scaling: ScalingRequest | None = None
    engine_args: dict[str, Any] | None = None
    #: A scale-up (``replicas``) without room: as POST /deployments (docs/capacity.md).
    if_no_room: IfNoRoom = Field(default=IfNoRoom.QUEUE, description=IF_NO_ROOM_HELP)
    plan: JsonInt | None = Field(default=None, ge=1, le=MAX_PLAN_NUMBER,
                                 description=PLAN_HELP)
    owner: OwnerPath | None = Field(
        default=None, description="move it to this scope of the tenancy tree: org, "
                                  "org/team or org/team/project")
    capacity_class: CapacityClass | None = Field(
        default=None, description="what may be stopped to place it: critical, standard "
                                  "or opportunistic")

    @model_validator(mode="after")
    def _one_change(self) -> Self:
        given = [name for name in ("replicas", "scaling", "engine_args")
                 if getattr(self, name) is not None]
        if self.tenancy:
            given.append("owner/capacity_class")
        if len(given) != 1:
            raise ValueError("give one of replicas (scale), scaling (a policy), "
                             "engine_args (reconfigure) or owner and/or capacity_class; "
                             + (f"got {' and '.join(given)}" if given else "got none"))
        if self.replicas is None and (self.plan is not None
                                      or self.if_no_room is not IfNoRoom.QUEUE):
            raise ValueError("if_no_room and plan go with replicas (a scale-up); "
                             f"got them with {given[0]}")
        return self

    @property
    def tenancy(self) -> bool:
        """Whether it changes the owner or the class."""
        return self.owner is not None or self.capacity_class is not None


# -- starts ----------------------------------------------------------------------------

@router.post("/deployments/{deployment_id}/restart", status_code=202,
             response_model=OperationStarted, responses=problems(404, 409, 503))
async def restart_deployment(deployment_id: str, store: StoreDep,
                             temporal: TemporalDep, *, operator: OperatorDep
                             ) -> OperationStarted:
    """Replace each replica in turn beside itself (RestartSaga)."""
    view = await _changeable(store, deployment_id)
    plural = "replica" if view.desired_replicas == 1 else "replicas"
    summary = (f"restart {view.deployment_id} ({_runs(view)}): replace its "
               f"{view.desired_replicas} {plural} one at a time")
    return await _start(
        store, temporal, kind=OperationKind.RESTART, deployment_id=view.deployment_id,
        workflow=RestartSaga.run, summary=summary, operator=operator,
        arg=RestartInput(deployment_id=view.deployment_id, requested_by=operator.name))


@router.post("/deployments/{deployment_id}/switch", status_code=202,
             response_model=OperationStarted, responses=problems(404, 409, 503))
async def switch_deployment(deployment_id: str, request: SwitchRequest, store: StoreDep, *,
                            temporal: TemporalDep, operator: OperatorDep) -> OperationStarted:
    """Serve another catalog model under the same name, with rollback (SwitchSaga)."""
    view = await _changeable(store, deployment_id)
    if await store.catalog.get_model(request.model_id) is None:
        known = ", ".join(m.model_id for m in await store.catalog.list_models()) or "none"
        raise _field_error("model_id", request.model_id,
                           f"unknown model_id; known models: {known}")
    if request.model_id == _runs(view):
        raise HTTPException(409, f"deployment {deployment_id!r} already runs "
                                 f"{request.model_id!r}: nothing to switch")
    summary = f"switch {view.deployment_id} from {_runs(view)} to {request.model_id}"
    return await _start(
        store, temporal, kind=OperationKind.SWITCH, deployment_id=view.deployment_id,
        workflow=SwitchSaga.run, summary=summary, operator=operator,
        arg=SwitchInput(deployment_id=view.deployment_id, model_id=request.model_id,
                        requested_by=operator.name))


@router.post("/deployments/{deployment_id}/reconfigure", status_code=202,
             response_model=OperationStarted, responses=problems(404, 409, 503))
async def reconfigure_deployment(deployment_id: str, request: ReconfigureRequest,
                                 store: StoreDep, *, temporal: TemporalDep,
                                 operator: OperatorDep) -> OperationStarted:
    """Run the same model with other engine arguments, with rollback (SwitchSaga)."""
    return await start_reconfigure(deployment_id, request.engine_args, store=store,
                                   temporal=temporal, operator=operator)


async def start_reconfigure(deployment_id: str, engine_args: dict[str, Any], *,
                            store: Store, temporal: Client,
                            operator: Operator) -> OperationStarted:
    """A reconfigure, from POST .../reconfigure or PATCH /deployments/{id}: 422 naming
    an argument the model's engine does not allow."""
    view = await _changeable(store, deployment_id)
    if not engine_args:
        raise _field_error("engine_args", engine_args,
                           "give at least one engine argument to change")
    model = await store.catalog.get_model(_runs(view))
    assert model is not None  # a model a deployment runs cannot leave the catalog
    try:
        check_engine_arg_names(model.engine, engine_args)
    except EngineConfigError as exc:
        raise _field_error("engine_args", engine_args, str(exc)) from None
    shown = ", ".join(f"{k}={v}" for k, v in sorted(engine_args.items()))
    return await _start(
        store, temporal, kind=OperationKind.RECONFIGURE, deployment_id=view.deployment_id,
        workflow=SwitchSaga.run, summary=f"reconfigure {view.deployment_id} "
                                         f"({model.model_id}): {shown}",
        operator=operator,
        arg=SwitchInput(deployment_id=view.deployment_id, engine_args=engine_args,
                        requested_by=operator.name))


@router.post("/nodes/{node_id}/drain", status_code=202, response_model=OperationStarted,
             responses=problems(404, 409, 503))
async def drain_node(node_id: str, store: StoreDep, temporal: TemporalDep, *,
                     operator: OperatorDep,
                     request: DrainRequest | None = None) -> OperationStarted:
    """Cordon the node and move each replica on it elsewhere (DrainSaga)."""
    node = await store.nodes.get_node(node_id)
    if node is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    request = request or DrainRequest()
    try:
        # The contract's own limits and default grace apply: validated there, named here.
        arg = DrainInput.model_validate({"node_id": node_id, "requested_by": operator.name,
                                         **request.model_dump(exclude_none=True)})
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    on_node = await store.nodes.replicas_on_node(node_id)
    replicas = sum(len(r) for r in on_node.values())
    summary = (f"drain node {node.name} ({node_id}): move its {replicas} replica(s) of "
               f"{len(on_node)} deployment(s) elsewhere within {arg.grace_s:g}s")
    return await _start(store, temporal, kind=OperationKind.DRAIN, node_id=arg.node_id,
                        workflow=DrainSaga.run, summary=summary, arg=arg, operator=operator)


async def _start(store: Store, temporal: Client, *, kind: OperationKind,
                 workflow: Callable[[Any, _I], Awaitable[OperationRecord]], arg: _I,
                 summary: str, operator: Operator,
                 deployment_id: DeploymentId | None = None,
                 node_id: NodeId | None = None) -> OperationStarted:
    """Insert the operation's row (409 while another runs on its subject), then start its
    workflow (a saga's ``run``, so mypy checks ``arg`` against it) under the row's id; a
    failed start ends the row as failed (503)."""
    operations = store.operations
    subject = node_id if kind is OperationKind.DRAIN else deployment_id
    assert subject is not None  # each route names the one its kind needs
    record = await _begin(operations, temporal, kind=kind, subject=subject, summary=summary,
                          deployment_id=deployment_id, node_id=node_id,
                          requested_by=operator.name)
    try:
        await temporal.start_workflow(workflow, arg, id=record.operation_id,
                                      task_queue=CONTROL_TASK_QUEUE,
                                      # The web UI's one line for the run: what, and which
                                      # model or node; the saga keeps its details current.
                                      static_summary=summary)
    except (RPCError, WorkflowAlreadyStartedError) as exc:
        await operations.finish_if_running(record.operation_id, OperationState.FAILED,
                                    f"its workflow could not be started: {exc}")
        raise HTTPException(503, f"{record.operation_id} was not started: its workflow "
                                 f"could not be started ({exc}); nothing changed, and "
                                 "repeating the request is safe") from exc
    await store.events.record_event(change(operator, "operation.started",
                                           f"{record.operation_id} started: {summary}",
                                           deployment_id=deployment_id, node_id=node_id,
                                           data={"operation_id": record.operation_id}))
    return OperationStarted(**record.model_dump(), workflow_id=record.operation_id)


async def _begin(operations: OperationsStore, temporal: Client, *, kind: OperationKind,
                 subject: str, summary: str, deployment_id: DeploymentId | None,
                 node_id: NodeId | None, requested_by: str) -> OperationRecord:
    """The new operation's row; 409 naming the one that runs on ``subject``. A running
    one whose workflow has ended without recording it is ended first, once."""
    for attempt in range(2):
        try:
            return await operations.begin_next(kind, subject, deployment_id=deployment_id,
                                        node_id=node_id, summary=summary,
                                        requested_by=requested_by)
        except OperationConflictError as exc:
            if attempt == 1 or await _end_if_abandoned(operations, temporal, exc.running) is None:
                raise HTTPException(409, str(exc)) from None
        except OperationNumberingError as exc:
            raise HTTPException(409, f"{kind.value} of {subject} was not started: {exc}; "
                                     "repeating the request is safe") from None
    raise AssertionError("unreachable: the second attempt returns or raises")


# -- list, show, cancel ----------------------------------------------------------------

@router.get("/operations", response_model=list[OperationRecord])
async def list_operations(
    operations: OperationsDep, store: StoreDep, *, deployment: str | None = None,
    node: str | None = None, state: OperationState | None = None,
    limit: int = Query(default=50, ge=1, le=MAX_LIST_LIMIT),
) -> list[OperationRecord]:
    """The newest operations first, optionally of one deployment (by id or model id, as
    everywhere else), node (by id or name) or state. A value that names nothing there is
    now is taken as an id: a deleted deployment's or removed node's operations stay."""
    if deployment is not None and await store.deployments.get_deployment(deployment) is None:
        by_model = await store.deployments.get_deployment_by_model(deployment)
        if by_model is not None:
            deployment = by_model.deployment_id
    if node is not None:
        nodes = await store.nodes.list_nodes()
        named = [n.node_id for n in nodes if n.name == node]
        if node not in {n.node_id for n in nodes} and len(named) == 1:
            node = named[0]
    return await operations.list_operations(deployment_id=deployment, node_id=node, state=state,
                                            limit=limit)


@router.get("/operations/{operation_id:path}", response_model=OperationRecord,
            responses=problems(404))
async def get_operation(operation_id: str, operations: OperationsDep) -> OperationRecord:
    """One operation with its steps and outcome; 404 when unknown."""
    return await _existing(operations, operation_id)


@router.post("/operations/{operation_id:path}/cancel", status_code=202,
             response_model=OperationRecord, responses=problems(404, 409, 503))
async def cancel_operation(operation_id: str, operations: OperationsDep, temporal: TemporalDep, *,
                           store: StoreDep, operator: OperatorDep) -> OperationRecord:
    """Ask the saga to stop and undo what it started (a Temporal cancellation: the saga
    runs its compensations and records ``cancelled``). 409 once it has ended."""
    record = await _existing(operations, operation_id)
    if record.state is OperationState.RUNNING:
        record = await _end_if_abandoned(operations, temporal, record) or record
    if record.state is not OperationState.RUNNING:
        raise HTTPException(409, _ended(record))
    try:
        await temporal.get_workflow_handle(operation_id).cancel()
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:
            raise HTTPException(503, f"{operation_id} was not cancelled: its workflow "
                                     f"could not be reached ({exc}); repeating the request "
                                     "is safe") from exc
        # It ended between the look and the cancel: say how, as the saga recorded it.
        ended = await _end_if_abandoned(operations, temporal, record) \
            or await _existing(operations, operation_id)
        raise HTTPException(409, _ended(ended)) from None
    await store.events.record_event(change(
        operator, "operation.cancel_requested", f"cancel {operation_id}: {record.summary}",
        deployment_id=record.deployment_id, node_id=record.node_id,
        data={"operation_id": operation_id}))
    return record


def _ended(record: OperationRecord) -> str:
    why = f": {record.error}" if record.error else ""
    return (f"{record.operation_id} already ended ({record.state.value}{why}); "
            "nothing to cancel")


# -- abandoned rows --------------------------------------------------------------------

def abandoned(record: OperationRecord, status: WorkflowExecutionStatus | None, *,
              now: datetime) -> tuple[OperationState, str] | None:
    """How to end a running row whose workflow is in ``status`` (None: Temporal does not
    know it), and why; None while it may still record its own outcome.

    Pure, so each case has its test: a workflow that runs (or continued as new) is left
    alone; one unknown to Temporal is left alone for :data:`START_GRACE` after the row was
    inserted (its start may be in flight); one that ended without recording its outcome
    ends its row: ``cancelled`` for a cancellation, ``failed`` otherwise.
    """
    match status:
        case WorkflowExecutionStatus.RUNNING | WorkflowExecutionStatus.CONTINUED_AS_NEW:
            return None
        case None:
            if record.created_at is not None and now - record.created_at < START_GRACE:
                return None
            return OperationState.FAILED, (
                f"its workflow {record.operation_id} does not exist (never started, or "
                "ended and past Temporal's retention)")
        case WorkflowExecutionStatus.CANCELED:
            return OperationState.CANCELLED, (
                "its workflow was cancelled before it recorded its outcome")
        case _:
            return OperationState.FAILED, (
                f"its workflow ended {status.name.lower()} without recording its outcome")


async def _end_if_abandoned(operations: OperationsStore, temporal: Client,
                            record: OperationRecord) -> OperationRecord | None:
    """End ``record`` if :func:`abandoned` says so: its row as it stands after (another
    writer's outcome wins). None when its workflow may still record one."""
    try:
        status = (await temporal.get_workflow_handle(record.operation_id).describe()).status
    except RPCError as exc:
        if exc.status is not RPCStatusCode.NOT_FOUND:
            return None  # Temporal unreachable: the row is not ours to judge
        status = None
    ending = abandoned(record, status, now=datetime.now(UTC))
    if ending is None:
        return None
    return await operations.finish_if_running(record.operation_id, *ending)


# -- helpers ---------------------------------------------------------------------------

async def _changeable(store: Store, deployment_id: str) -> DeploymentView:
    """The deployment a saga would change: 404 when unknown, 409 while it is deleting."""
    view = await store.deployments.get_deployment(deployment_id)
    if view is None:
        raise HTTPException(404, f"deployment {deployment_id!r} does not exist")
    if view.status is DeploymentStatus.DELETING:
        raise HTTPException(409, f"deployment {deployment_id!r} is deleting: "
                                 "nothing can be changed")
    return view


def _runs(view: DeploymentView) -> ModelId:
    """The catalog model behind the deployment's served name now."""
    return view.runs_model_id or view.model_id


async def _existing(operations: OperationsStore, operation_id: str) -> OperationRecord:
    record = await operations.get(operation_id)
    if record is None:
        raise HTTPException(404, f"operation {operation_id!r} does not exist")
    return record


def _field_error(field: str, value: Any, message: str) -> RequestValidationError:
    """A 422 in FastAPI's own shape, naming the field, the value and the rule (as
    ``deployments.field_error``, which this module cannot import: that one imports this)."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", field),
                                    "msg": message, "input": value}])
