"""Routes for the model catalog, deployments, replicas and placement explanations."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.convertors import PathConvertor, register_url_convertor
from temporalio.api.errordetails.v1 import NotFoundFailure
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import FailureError
from temporalio.service import RPCError, RPCStatusCode

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.capacity import SetTenancyRequest
from modelkeeper.domain.catalog import (
    CatalogModel,
    DeploymentRequest,
    DeploymentView,
    ModelPatch,
    ModelSpec,
    PatchRefused,
    ReplicaView,
    ScaleRequest,
    engine_source_problem,
    estimate_memory_bytes,
    patched_spec,
    scaling_summary,
    spec_changes,
)
from modelkeeper.domain.demand import ScalingPolicy, SetPolicyRequest, SleepRequest, WakeRequest
from modelkeeper.domain.engine_args import EngineConfigError, check_engine_arg_names
from modelkeeper.domain.ids import DeploymentId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.operators import Operator, scope_refusal
from modelkeeper.domain.placement import explain
from modelkeeper.domain.profiles import ProfilePlacement, place_profiles, profile_candidates
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.sources import SourceKind, SourcePolicy, SourceRefused, check_source
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.watchdog import CalibrationView, calibration_view, with_calibration
from modelkeeper.infra import schedules
from modelkeeper.infra.model_files import NO_SUCH_FILE, resolve_model_path, source_policy
from modelkeeper.infra.temporal import execute_update
from modelkeeper.names import (
    CONTROL_TASK_QUEUE,
    deployment_workflow_id,
)
from modelkeeper.store import (
    DeploymentExistsError,
    ModelExistsError,
    ModelInUseError,
    Store,
    UnknownModelError,
)
from workflows.deployment import (
    MODEL_ID_KEY,
    STATUS_KEY,
    DeleteRequest,
    DeploymentInput,
    DeploymentWorkflow,
    deployment_handle,
)

from . import operations, quotas, room
from .auth import OperatorDep, change
from .deps import SettingsDep, StoreDep, TemporalDep
from .measured import ModelView
from .nodes import resolve_node_ids
from .problems import problems

#: A scale (or a policy, a sleep, a wake) is answered by the deployment's workflow within
#: a workflow task: seconds. With no control worker polling it would wait for ever; past
#: this the API answers 503.
UPDATE_ANSWER_TIMEOUT = timedelta(seconds=20)
#: A replica id as a client names one: the keeper's are far shorter ("d-<10 hex>-r12").
MAX_REPLICA_ID_CHARS = 128

router = APIRouter()
log = logging.getLogger(__name__)


class Accepted(BaseModel):
    """A request the keeper will carry out asynchronously."""

    deployment_id: str
    status: str


class ReplicaChoice(Frozen):
    """POST /deployments/{id}/sleep and /wake: one replica, or (none named) each that can."""

    replica_id: ReplicaId | None = Field(
        default=None, min_length=1, max_length=MAX_REPLICA_ID_CHARS,
        description="sleep: a ready replica (none: each ready one; an operator is not "
                    "held to the minimum); wake: a sleeping replica (none: each sleeping one)")


#: The status DELETE answers when it removed the row itself, its workflow being gone. Not
#: a DeploymentStatus: no deployment ever shows it.
DELETED = "deleted"


class NodeVerdict(BaseModel):
    """One node in a placement explanation."""

    node_id: str
    name: str
    fits: bool
    reason: str | None
    message: str


class Explanation(BaseModel):
    """GET /placement/explain: where a replica would go, or why it can't go anywhere."""

    model_id: str
    #: The deployment whose next replica it places (its labels, nodes and class apply);
    #: None: the model is not deployed, and only its own needs apply.
    deployment_id: str | None = None
    fits: bool
    nodes_chosen: list[str]
    summary: str | None
    nodes: list[NodeVerdict]
    #: When the replica would share a node with another replica of the model's deployment
    #: (no other node has room): which node, and each other node's reason; and the
    #: hardware profiles it would pass over, each with its reason.
    note: str | None = None
    #: The hardware profile it would run (``nodes`` are judged for it; when none fits,
    #: for the first tried, and ``summary`` names every profile); None: the model
    #: declares none.
    profile: str | None = None
    #: The model was killed for memory: what it was seen to take, and the memory placed
    #: for it now (OOM calibration, docs/capacity.md).
    calibration: CalibrationView | None = None


def field_error(field: str, value: Any, message: str) -> RequestValidationError:
    """A 422 in FastAPI's own shape, naming the field, the value and the rule."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", field),
                                    "msg": message, "input": value}])


def catalog_entry(spec: ModelSpec, policy: SourcePolicy) -> CatalogModel:
    """Validate a model declaration and fill in its memory; raises a 422 naming the field.

    The source is judged by the policy before anything else, and a path is read (for its
    size) only once it is known to lie under an allowed root: the API must not stat
    whatever path a client names on its own host.
    """
    verdict = check_source(policy, spec.source)
    if isinstance(verdict, SourceRefused):
        raise field_error("source", spec.source, verdict.message)
    if spec.secret is not None and verdict.kind is not SourceKind.URL:
        raise field_error("secret", spec.secret,
                          f"a secret is sent with a download, and source {spec.source!r} "
                          "is not a URL")
    if spec.sha256 is not None and verdict.kind is SourceKind.NAME:
        raise field_error("sha256", spec.sha256,
                          f"a sha256 checks one file, and source {spec.source!r} names no "
                          "file (give a URL or a path)")
    try:
        check_engine_arg_names(spec.engine, spec.engine_args, claim_bytes=spec.memory_bytes)
    except EngineConfigError as exc:
        raise field_error("engine_args", spec.engine_args, str(exc)) from None
    for i, profile in enumerate(spec.profiles):
        try:
            check_engine_arg_names(profile.engine, profile.engine_args,
                                   claim_bytes=profile.memory_bytes or spec.memory_bytes)
        except EngineConfigError as exc:
            raise field_error(f"profiles[{i}].engine_args", profile.engine_args,
                              str(exc)) from None
    # Its form, for each engine that would read it (the model's and each profile's): a
    # source an engine cannot read is refused now, not after its starts failed and were
    # retried.
    for field, engine in (("engine", spec.engine),
                          *((f"profiles[{i}].engine", p.engine)
                            for i, p in enumerate(spec.profiles))):
        problem = engine_source_problem(engine, spec.source)
        if problem is not None:
            raise field_error("source", spec.source,
                              problem if field == "engine" else f"{field}: {problem}")
    if spec.memory_bytes is not None:
        return CatalogModel(**spec.model_dump())
    if spec.engine is not EngineKind.LLAMACPP:
        raise field_error("memory_bytes", None,
                          f"required for engine {spec.engine.value!r}: only a local .gguf "
                          "file's size can be used to estimate it")
    try:
        path = resolve_model_path(spec.source, policy=policy)
    except EngineConfigError as exc:
        if exc.field == "source" and exc.reason == NO_SUCH_FILE:
            # The one local file the API reads: to estimate its memory. Any other path is
            # the nodes' to check (they may hold files this machine does not).
            raise field_error("source", spec.source,
                              f"{NO_SUCH_FILE} on the API's machine, which reads it to "
                              "estimate memory_bytes; declare memory_bytes when the file "
                              "is on the nodes only") from None
        raise field_error("memory_bytes", None,
                          f"cannot be estimated ({exc}); declare it") from None
    return CatalogModel(**{**spec.model_dump(),
                           "memory_bytes": estimate_memory_bytes(path.stat().st_size),
                           "memory_estimated": True})


# -- catalog ---------------------------------------------------------------------------

@router.post("/models", status_code=201, response_model=CatalogModel, responses=problems(409))
async def create_model(spec: ModelSpec, store: StoreDep, operator: OperatorDep, *,
                       settings: SettingsDep) -> CatalogModel:
    """Add a model to the catalog. Memory is estimated from the file when absent."""
    entry = catalog_entry(spec, source_policy(settings))
    try:
        created = await store.catalog.create_model(entry)
    except ModelExistsError:
        raise HTTPException(409, f"model {spec.model_id!r} is already in the catalog") \
            from None
    await store.events.record_event(change(operator, "model.added", f"model {created.model_id} "
                                           f"added ({created.engine.value}, {created.source})"))
    return created


@router.get("/models", response_model=list[CatalogModel])
async def list_models(store: StoreDep) -> list[CatalogModel]:
    """The catalog."""
    return await store.catalog.list_models()


@router.get("/models/{model_id:path}", response_model=ModelView, responses=problems(404),
            response_model_exclude_unset=True)
async def get_model(model_id: str, store: StoreDep, settings: SettingsDep) -> ModelView:
    """One catalog entry, with its measured capacity, and its OOM calibration when it
    was killed for memory; 404 when unknown."""
    model = await store.catalog.get_model(model_id)
    if model is None:
        raise HTTPException(404, f"model {model_id!r} is not in the catalog")
    fields: dict[str, Any] = {**model.model_dump(),
                              "measured": await store.measured.measured_of(model_id)}
    calibration = await store.watchdog.calibration(model_id)
    if calibration is not None:
        fields["calibration"] = calibration_view(
            model.memory_bytes, calibration, margin=settings.oom_calibration_margin)
    return ModelView.model_validate(fields)


class ModelChanged(Frozen):
    """PATCH /models/{id}: the entry as it is now, what changed, and the deployments that
    serve it: their replicas run the old spec (outdated) until restarted."""

    model: CatalogModel
    changes: list[str]
    deployments: list[str]
    #: How many deployments serve it (``deployments`` lists at most MAX_NAMED_DEPLOYMENTS).
    deployment_count: int


#: Deployments named in an answer about a model (a change, a refused removal): enough to
#: act on, bounded however many serve it.
MAX_NAMED_DEPLOYMENTS = 20


class CatalogPathConvertor(PathConvertor):
    """A model id in a path that may hold '/' (``org/name``), but never ends in one of the
    catalog's sub-resources: a PATCH of ``/models/x/capacity`` (which has no PATCH) is then
    a 405 naming the methods it has, not a 422 from this route's body."""

    regex = r".+(?<!/capacity)(?<!/headroom)(?<!/size)"


register_url_convertor("catalog_path", CatalogPathConvertor())


@router.patch("/models/{model_id:catalog_path}", response_model=ModelChanged,
              responses=problems(404))
async def change_model(model_id: str, patch: ModelPatch, store: StoreDep,
                       operator: OperatorDep, *, settings: SettingsDep) -> ModelChanged:
    """Change a model's memory, engine arguments or source while it may be deployed; the
    result is judged as ``POST /models`` judges a new entry (422 naming the field).
    Replicas running keep the old spec and show as outdated: a restart
    (``POST /deployments/{id}/restart``) rolls the change out."""
    model = await store.catalog.get_model(model_id)
    if model is None:
        raise HTTPException(404, f"model {model_id!r} is not in the catalog")
    try:
        fields = patched_spec(model, patch)
    except PatchRefused as exc:
        raise field_error(exc.field, exc.value, str(exc)) from None
    try:
        spec = ModelSpec.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) \
            from None
    entry = catalog_entry(spec, source_policy(settings))
    changes = spec_changes(model, entry)
    if changes:
        updated = await store.catalog.update_spec(entry)
        if updated is None:
            raise HTTPException(404, f"model {model_id!r} is not in the catalog")
        await store.events.record_event(change(
            operator, "model.changed", f"model {model_id} changed: {'; '.join(changes)}",
            data={"changes": changes}))
        model = updated
    named, count = await store.catalog.deployments_of(model_id, limit=MAX_NAMED_DEPLOYMENTS)
    return ModelChanged(model=model, changes=changes, deployments=named,
                        deployment_count=count)


@router.delete("/models/{model_id:path}", status_code=204, responses=problems(404, 409))
async def delete_model(model_id: str, store: StoreDep, operator: OperatorDep) -> None:
    """Remove a model; 409 while it is deployed, naming the deployments that serve it."""
    try:
        if not await store.catalog.delete_model(model_id):
            raise HTTPException(404, f"model {model_id!r} is not in the catalog")
    except ModelInUseError:
        named, count = await store.catalog.deployments_of(model_id,
                                                          limit=MAX_NAMED_DEPLOYMENTS)
        more = f" and {count - len(named)} more" if count > len(named) else ""
        which = (f"deployment(s) {', '.join(named)}{more} serve it" if named
                 else "a deployment serves it")
        raise HTTPException(409, f"model {model_id!r} is in use: {which}; delete them "
                                 "first (modelkeeper rm DEPLOYMENT)") from None
    await store.events.record_event(change(operator, "model.removed", f"model {model_id} removed"))


# -- deployments -----------------------------------------------------------------------

@router.post("/deployments", status_code=201, response_model=DeploymentView,
             responses={**problems(503), **quotas.LIMIT_RESPONSES})
async def create_deployment(request: DeploymentRequest, store: StoreDep,
                            temporal: TemporalDep, *, settings: SettingsDep,
                            operator: OperatorDep) -> DeploymentView | JSONResponse:
    """Keep a model served. 409 if it already has a deployment (also under a race), or if
    its replicas (a policy: its maximum) would pass a limit of a scope on its owner's
    path, with the numbers; with ``if_no_room: plan``, 409 with the plans that would make
    room when it does not fit, and ``plan: N`` applies one first (docs/capacity.md, "Fit
    plans")."""
    model = await store.catalog.get_model(request.model_id)
    if model is None:
        known = ", ".join(m.model_id for m in await store.catalog.list_models()) or "none"
        raise field_error("model_id", request.model_id,
                          f"unknown model_id; known models: {known}")
    if request.owner is None and operator.scope is not None:
        # A scoped token's deployment is its scope's unless it names one beneath.
        request = request.model_copy(update={"owner": operator.scope})
    _within_scope(operator, request.owner, action=f"deploy {request.model_id}",
                  what="the deployment")
    await quotas.refuse_over_limit(store, request.owner, quotas.times(
        quotas.replica_resources(model, request.min_nodes), _most_replicas(
            request.policy, request.initial_replicas)))
    if request.node_ids:
        # Names become ids here, once: the deployment keeps ids, which a node keeps when
        # it is renamed.
        request = request.model_copy(update={"node_ids": await resolve_node_ids(
            store, request.node_ids, loc=("body", "node_ids"))})
    if await store.deployments.get_deployment_by_model(request.model_id) is not None:
        # Before any plan is applied: room made for a deploy refused anyway is for nothing.
        raise HTTPException(409, f"model {request.model_id!r} already has a deployment")
    async with room.room_made(
            store=store, settings=settings, acts=RouteActs(store, temporal, operator),
            operator=operator, count=request.initial_replicas, if_no_room=request.if_no_room,
            plan=request.plan, what=f"a deployment of {request.model_id}",
            request=room.placement_request(model, min_nodes=request.min_nodes,
                                           node_ids=request.node_ids,
                                           labels=request.labels)) as refused:
        if refused is not None:
            return refused
        return await _create(request, model.min_nodes, store=store, temporal=temporal,
                             settings=settings, operator=operator)


async def _create(request: DeploymentRequest, model_min_nodes: int, *, store: Store,
                  temporal: TemporalDep, settings: SettingsDep,
                  operator: OperatorDep) -> DeploymentView:
    """The deployment's row, then its workflow, then the audit entry."""
    deployment_id = DeploymentId(f"d-{uuid.uuid4().hex[:10]}")
    workflow_id = deployment_workflow_id(deployment_id)
    try:
        await store.deployments.create_deployment(deployment_id, request, workflow_id)
    except DeploymentExistsError:
        raise HTTPException(409, f"model {request.model_id!r} already has a deployment") \
            from None
    except UnknownModelError:
        raise field_error("model_id", request.model_id, "unknown model_id") from None
    spec = DeploymentSpec(deployment_id=deployment_id, model_id=request.model_id,
                          replicas=request.initial_replicas,
                          min_nodes=max(request.min_nodes, model_min_nodes),
                          node_ids=request.node_ids, labels=request.labels,
                          scaling=request.policy, capacity_class=request.capacity_class,
                          owner=request.owner, spread=request.spread)
    try:
        await temporal.start_workflow(
            DeploymentWorkflow.run, DeploymentInput(spec=spec, tunables=settings.tunables()),
            id=workflow_id,
            task_queue=CONTROL_TASK_QUEUE,
            # The web UI's one-line summary of the run, set once: only what never changes
            # (a scale or a switch would make "2 replicas" or a model name a lie). The
            # workflow keeps its current details (status, replicas, nodes, the model it
            # runs now) true itself.
            static_summary=static_summary(deployment_id, request.model_id,
                                          operator.name),
            search_attributes=TypedSearchAttributes([
                SearchAttributePair(MODEL_ID_KEY, request.model_id),
                SearchAttributePair(STATUS_KEY, request.first_status.value)]))
    except RPCError as exc:
        # Nothing keeps the row without its workflow: remove it, report the outage.
        await store.deployments.delete_deployment_row(deployment_id)
        raise HTTPException(503, f"could not start the deployment's workflow: {exc}") \
            from None
    await store.events.record_event(change(operator, "deployment.created", _summary(request),
                                           deployment_id=deployment_id))
    view = await store.deployments.get_deployment(deployment_id)
    assert view is not None
    return view


@router.get("/deployments", response_model=list[DeploymentView])
async def list_deployments(store: StoreDep) -> list[DeploymentView]:
    """Every deployment, with status, reasons and replicas."""
    return await store.deployments.list_deployments()


@router.get("/deployments/{deployment_id}", response_model=DeploymentView,
            responses=problems(404))
async def get_deployment(deployment_id: str, store: StoreDep) -> DeploymentView:
    """One deployment; 404 when unknown."""
    return await _existing(store, deployment_id)


@router.delete("/deployments/{deployment_id}", status_code=202, response_model=Accepted,
               responses={200: {"model": Accepted, "description": "Its workflow was gone: "
                                "the API removed the deployment itself (status deleted)."},
                          **problems(404, 503)})
async def delete_deployment(deployment_id: str, store: StoreDep, temporal: TemporalDep, *,
                            response: Response, operator: OperatorDep) -> Accepted:
    """Stop and delete the replicas this deployment placed; repeating it is harmless.

    The workflow is signalled first, and the row shows ``deleting`` only once the signal
    is delivered: marked before a signal that then failed, a row stayed ``deleting`` with
    nothing to delete it, and the gateway answered its model "being deleted" for good.

    * Delivered: 202, ``deleting``. The workflow stops the replicas and removes the row.
    * Its workflow is gone (finished, terminated by hand, or never started because a create
      died between its row and its start): nothing else will ever remove the row, so this
      does, with the replicas' claims. 200, ``deleted``.
    * Any other failure (Temporal unreachable, or a namespace not found, where the workflow
      may run on): 503 saying the deployment was not deleted; it is left as it was, and
      repeating the request is safe.
    """
    view = await _existing(store, deployment_id)
    try:
        await deployment_handle(temporal, view.workflow_id).signal(
                DeploymentWorkflow.delete, DeleteRequest(requested_by=operator.name))
    except RPCError as exc:
        if not _workflow_not_found(exc):
            raise HTTPException(
                503, f"deployment {deployment_id!r} was not deleted: its workflow "
                f"{view.workflow_id!r} could not be signalled ({exc}); the deployment is "
                "unchanged, and repeating the request is safe") from exc
        await store.deployments.delete_deployment_row(deployment_id)
        await _remove_windows(temporal, view.deployment_id)
        await store.events.record_event(change(operator, "deployment.delete_requested",
                                               f"delete {deployment_id}: its workflow was gone, so "
                                               "its row and claims were removed here",
                                               deployment_id=view.deployment_id))
        response.status_code = 200
        return Accepted(deployment_id=deployment_id, status=DELETED)
    # After the signal: the workflow may have removed the row already, which is fine.
    await store.deployments.mark_deleting(deployment_id)
    await _remove_windows(temporal, view.deployment_id)
    await store.events.record_event(change(operator, "deployment.delete_requested",
                                           f"delete {deployment_id} ({view.model_id})",
                                           deployment_id=view.deployment_id))
    return Accepted(deployment_id=deployment_id, status=DeploymentStatus.DELETING.value)


@router.post("/deployments/{deployment_id}/retry", status_code=202, response_model=Accepted,
             responses=problems(404, 503))
async def retry_deployment(deployment_id: str, store: StoreDep,
                           temporal: TemporalDep, operator: OperatorDep) -> Accepted:
    """Un-park a parked deployment."""
    view = await _existing(store, deployment_id)
    try:
        await deployment_handle(temporal, view.workflow_id).signal(DeploymentWorkflow.retry)
    except RPCError as exc:
        if _workflow_not_found(exc):
            raise HTTPException(409, f"deployment {deployment_id} has no running workflow "
                                     "(it is being removed)") from None
        raise HTTPException(503, f"Temporal did not take the retry: {exc.message}") from None
    await store.events.record_event(change(operator, "deployment.retry_requested",
                                           f"retry {deployment_id} (it was {view.status.value})",
                                           deployment_id=view.deployment_id))
    return Accepted(deployment_id=deployment_id, status=view.status.value)


@router.patch("/deployments/{deployment_id}",
              response_model=DeploymentView | operations.OperationStarted,
              responses={202: {"model": operations.OperationStarted,
                               "description": "engine_args given: a reconfigure started."},
                         **problems(404, 503), **quotas.LIMIT_RESPONSES})
async def scale_deployment(deployment_id: str, patch: operations.DeploymentPatch,
                           store: StoreDep, *, temporal: TemporalDep, response: Response,
                           operator: OperatorDep, settings: SettingsDep,
                           ) -> DeploymentView | operations.OperationStarted | JSONResponse:
    """Change the replica count or the scaling policy (Temporal updates, validated by the
    workflow), or, given ``engine_args``, start a reconfigure as POST .../reconfigure does
    (202), or the owner and/or the class. A scale-up (a count, or a policy's maximum,
    above what it was) or a new owner is refused with a 409 naming the numbers when it
    would pass a limit of a scope on the owner's path. A scale-up takes ``if_no_room``
    and ``plan`` as a deploy does."""
    if patch.tenancy:
        return await _set_tenancy(deployment_id, patch, store=store, temporal=temporal,
                                  operator=operator)
    if patch.engine_args is not None:
        response.status_code = 202
        return await operations.start_reconfigure(deployment_id, patch.engine_args,
                                                  store=store, temporal=temporal,
                                                  operator=operator)
    if patch.scaling is not None:
        return await _set_policy(deployment_id, patch.scaling.policy(), store=store,
                                 temporal=temporal, operator=operator)
    assert patch.replicas is not None  # DeploymentPatch holds exactly one of the three
    view = await _existing(store, deployment_id)
    await _refuse_scale_over_limit(store, view, patch.replicas)
    model = await store.catalog.get_model(view.runs_model_id or view.model_id)
    if model is None:  # a model in use cannot be removed from the catalog
        raise HTTPException(409, f"deployment {deployment_id} runs a model that is not in "
                                 "the catalog")
    async with room.room_made(
            store=store, settings=settings, acts=RouteActs(store, temporal, operator),
            operator=operator, count=patch.replicas - view.desired_replicas,
            if_no_room=patch.if_no_room, plan=patch.plan,
            what=f"scaling {deployment_id} to {patch.replicas}",
            for_deployment=view.deployment_id,
            request=room.placement_request(model, min_nodes=view.min_nodes,
                                           node_ids=view.node_ids, labels=view.labels,
                                           deployment=view)) as refused:
        if refused is not None:
            return refused
        await _scale(view, patch.replicas, store=store, temporal=temporal, operator=operator)
    return await _existing(store, deployment_id)


async def _scale(view: DeploymentView, replicas: int, *, store: Store, temporal: TemporalDep,
                 operator: OperatorDep) -> None:
    """The scale path: the workflow's ``scale`` update, then the row and the audit log."""
    request = ScaleRequest(replicas=replicas)
    with _answered(view.deployment_id, "scale"):
        await execute_update(
            deployment_handle(temporal, view.workflow_id),
            DeploymentWorkflow.scale, request, rpc_timeout=UPDATE_ANSWER_TIMEOUT)
    await store.deployments.set_desired_replicas(view.deployment_id, request.replicas)
    await store.events.record_event(change(operator, "deployment.scaled",
                                           f"scale {view.deployment_id} from "
                                           f"{view.desired_replicas} to "
                                           f"{request.replicas} replica(s)",
                                           deployment_id=view.deployment_id))


class RouteActs:
    """A fit plan's actions and their undos (api/room.py) through these routes' own
    paths: the same workflow updates, the same refusals and the same audit entries as an
    operator's sleep, wake and scale."""

    def __init__(self, store: Store, temporal: Client, operator: Operator) -> None:
        self._store, self._temporal, self._operator = store, temporal, operator

    async def sleep(self, deployment_id: DeploymentId, replica_id: str) -> None:
        await sleep_deployment(deployment_id, self._store, self._temporal,
                               operator=self._operator,
                               choice=ReplicaChoice(replica_id=ReplicaId(replica_id)))

    async def wake(self, deployment_id: DeploymentId, replica_id: str) -> None:
        await wake_deployment(deployment_id, self._store, self._temporal,
                              operator=self._operator,
                              choice=ReplicaChoice(replica_id=ReplicaId(replica_id)))

    async def scale(self, deployment_id: DeploymentId, replicas: int) -> None:
        await _scale(await _existing(self._store, deployment_id), replicas,
                     store=self._store, temporal=self._temporal, operator=self._operator)


async def _set_policy(deployment_id: str, policy: ScalingPolicy, *, store: Store,
                      temporal: TemporalDep, operator: OperatorDep) -> DeploymentView:
    """PATCH with ``scaling``: the workflow's ``set_policy`` update, then the row (the
    policy, and the replicas the keeper wants under it) and the audit log."""
    view = await _existing(store, deployment_id)
    await _refuse_scale_over_limit(store, view, policy.max_replicas)
    with _answered(deployment_id, "scaling policy"):
        replicas = await execute_update(
            deployment_handle(temporal, view.workflow_id),
            DeploymentWorkflow.set_policy, SetPolicyRequest(policy=policy, actor=operator.name),
            rpc_timeout=UPDATE_ANSWER_TIMEOUT)
    await store.deployments.set_scaling(deployment_id, policy, replicas)
    was = (scaling_summary(view.scaling) if view.scaling is not None
           else f"fixed at {view.desired_replicas}")
    await store.events.record_event(change(
        operator, "deployment.policy_set",
        f"set {deployment_id}'s scaling to {scaling_summary(policy)} (was {was}); "
        f"{replicas} replica(s) wanted", deployment_id=view.deployment_id,
        data={"scaling": policy.model_dump(mode="json")}))
    return await _existing(store, deployment_id)


def _most_replicas(policy: ScalingPolicy | None, replicas: int) -> int:
    """The most replicas a deployment may run: its policy's maximum, else its count. A
    limit counts this, since on-demand replicas start without asking."""
    return replicas if policy is None else policy.max_replicas


def _within_scope(operator: Operator, owner: str | None, *, action: str, what: str) -> None:
    """A 403 naming the scope when ``operator``'s token is bound to one that ``owner`` is
    not within: "token 'x' cannot {action}: ... and {what} is owned by ..."."""
    why = scope_refusal(operator.scope, owner, what)
    if why is not None:
        raise HTTPException(403, f"token {operator.name!r} cannot {action}: {why}")


async def _refuse_scale_over_limit(store: Store, view: DeploymentView, replicas: int) -> None:
    """A scale-up to at most ``replicas`` is refused (409) when the owner's scopes would
    pass a limit; a scale-down never is, even past a limit lowered since."""
    if view.owner is None or replicas <= _most_replicas(view.scaling, view.desired_replicas):
        return
    model = await store.catalog.get_model(view.runs_model_id or view.model_id)
    if model is None:
        return  # a model cannot be removed while deployed: nothing to count
    await quotas.refuse_over_limit(
        store, view.owner, quotas.times(quotas.replica_resources(model, view.min_nodes),
                                        replicas), replacing=view.deployment_id)


async def _set_tenancy(deployment_id: str, patch: operations.DeploymentPatch, *,
                       store: Store, temporal: Client, operator: Operator) -> DeploymentView:
    """PATCH with ``owner`` and/or ``capacity_class``: the workflow's ``set_tenancy``
    update (what its placements and preemptions ask as from now on), then the row and the
    audit log. A new owner must be within the token's scope, and takes the deployment's
    replicas (its most) under its scopes' limits. Replicas running stay where they are."""
    view = await _existing(store, deployment_id)
    if patch.owner is not None and patch.owner != view.owner:
        _within_scope(operator, patch.owner,
                      action=f"move deployment {deployment_id} to {patch.owner!r}",
                      what="the deployment, once moved,")
        model = await store.catalog.get_model(view.runs_model_id or view.model_id)
        if model is not None:
            await quotas.refuse_over_limit(
                store, patch.owner,
                quotas.times(quotas.replica_resources(model, view.min_nodes),
                             _most_replicas(view.scaling, view.desired_replicas)),
                replacing=view.deployment_id)
    with _answered(deployment_id, "owner and class"):
        await execute_update(
            deployment_handle(temporal, view.workflow_id),
            DeploymentWorkflow.set_tenancy,
            SetTenancyRequest(owner=patch.owner, capacity_class=patch.capacity_class),
            rpc_timeout=UPDATE_ANSWER_TIMEOUT)
    await store.deployments.set_tenancy(deployment_id, owner=patch.owner,
                                        capacity_class=patch.capacity_class)
    changed = []
    if patch.owner is not None:
        changed.append(f"owner {view.owner or 'none'} -> {patch.owner}")
    if patch.capacity_class is not None:
        was = view.capacity_class.value if view.capacity_class else "unset"
        changed.append(f"class {was} -> {patch.capacity_class.value}")
    await store.events.record_event(change(
        operator, "deployment.tenancy_set", f"{deployment_id}: {', '.join(changed)}",
        deployment_id=view.deployment_id,
        data=patch.model_dump(mode="json", include={"owner", "capacity_class"},
                              exclude_none=True)))
    return await _existing(store, deployment_id)


@router.post("/deployments/{deployment_id}/sleep", status_code=202, response_model=Accepted,
             responses=problems(404, 409, 503))
async def sleep_deployment(deployment_id: str, store: StoreDep, temporal: TemporalDep, *,
                           operator: OperatorDep, choice: ReplicaChoice | None = None,
                           ) -> Accepted:
    """Put a ready replica (none named: each ready one) to sleep: it keeps its
    weights and frees its KV cache, and a request wakes it (docs/demand.md). 409 with the
    workflow's sentence when none can sleep (llama.cpp cannot: scale it down instead)."""
    choice = choice or ReplicaChoice()
    view = await _existing(store, deployment_id)
    with _answered(deployment_id, "sleep"):
        await execute_update(
            deployment_handle(temporal, view.workflow_id),
            DeploymentWorkflow.sleep,
            SleepRequest(replica_id=choice.replica_id, actor=operator.name),
            rpc_timeout=UPDATE_ANSWER_TIMEOUT)
    which = choice.replica_id or "each ready replica"
    await store.events.record_event(change(operator, "deployment.sleep_requested",
                                           f"sleep {deployment_id}: {which}",
                                           deployment_id=view.deployment_id))
    return Accepted(deployment_id=deployment_id, status=view.status.value)


@router.post("/deployments/{deployment_id}/wake", status_code=202, response_model=Accepted,
             responses=problems(404, 409, 503))
async def wake_deployment(deployment_id: str, store: StoreDep, temporal: TemporalDep, *,
                          operator: OperatorDep, choice: ReplicaChoice | None = None,
                          ) -> Accepted:
    """Wake a sleeping replica (none named: each sleeping one)."""
    choice = choice or ReplicaChoice()
    view = await _existing(store, deployment_id)
    with _answered(deployment_id, "wake"):
        await execute_update(
            deployment_handle(temporal, view.workflow_id),
            DeploymentWorkflow.wake,
            WakeRequest(replica_id=choice.replica_id, actor=operator.name),
            rpc_timeout=UPDATE_ANSWER_TIMEOUT)
    which = choice.replica_id or "each sleeping replica"
    await store.events.record_event(change(operator, "deployment.wake_requested",
                                           f"wake {deployment_id}: {which}",
                                           deployment_id=view.deployment_id))
    return Accepted(deployment_id=deployment_id, status=view.status.value)


@contextmanager
def _answered(deployment_id: str, what: str) -> Iterator[None]:
    """An update to a deployment's workflow, its failures as answers: the workflow's
    refusal (its validator's sentence) is a 409, as is a workflow that is gone; no answer
    in ``UPDATE_ANSWER_TIMEOUT`` is a 503."""
    try:
        yield
    except WorkflowUpdateFailedError as exc:
        # The validator's sentence as it wrote it, without its error type in front.
        cause = exc.cause
        raise HTTPException(409, cause.message if isinstance(cause, FailureError)
                            else str(exc)) from None
    except RPCError as exc:
        if _workflow_not_found(exc):
            raise HTTPException(409, f"deployment {deployment_id} has no running workflow "
                                     "(it is being removed)") from None
        raise HTTPException(503, f"the deployment's workflow did not take the {what} in "
                                 f"{UPDATE_ANSWER_TIMEOUT.total_seconds():.0f}s: is a "
                                 f"control worker running? ({exc.message})") from None


# -- replicas and placement ------------------------------------------------------------

@router.get("/replicas", response_model=list[ReplicaView])
async def list_replicas(store: StoreDep) -> list[ReplicaView]:
    """Every replica: id, nodes, state, endpoint, started_at."""
    return await store.deployments.list_replicas()


@router.get("/placement/explain", response_model=Explanation, responses=problems(404))
async def explain_placement(
    store: StoreDep, settings: SettingsDep, model_id: str | None = None, *,
    deployment_id: str | None = None,
    node_ids: list[str] | None = Query(default=None),  # noqa: B008 - FastAPI's idiom
    min_nodes: int = Query(default=1, ge=1, le=64),
) -> Explanation:
    """Dry run: where one replica would go now, or every node and why it was rejected.
    Of a deployment (``deployment_id``), or of the deployment of ``model_id`` when it has
    one, it asks as that deployment's workflow would: the model it runs, its labels,
    nodes, minimum of nodes, class and owner; its replicas' nodes count as placement
    counts them (a node without one is preferred; the note says when the replica would
    have to share). ``node_ids`` narrows the nodes further."""
    deployment = None
    if deployment_id is not None:
        deployment = await store.deployments.get_deployment(deployment_id)
        if deployment is None:
            raise HTTPException(404, f"deployment {deployment_id!r} does not exist")
        if model_id is not None and model_id not in (deployment.model_id,
                                                     deployment.runs_model_id):
            raise RequestValidationError([{
                "type": "value_error", "loc": ("query", "model_id"), "input": model_id,
                "msg": f"deployment {deployment_id} runs {_runs_of(deployment)}, not this "
                       "model: give that, or no model_id"}])
        model_id = _runs_of(deployment)
    elif model_id is None:
        raise RequestValidationError([{
            "type": "missing", "loc": ("query", "model_id"), "input": None,
            "msg": "give model_id or deployment_id: the model or the deployment whose next "
                   "replica to place"}])
    else:
        deployment = await store.deployments.get_deployment_by_model(model_id)
    model = await store.catalog.get_model(model_id)
    if model is None:
        raise HTTPException(404, f"model {model_id!r} is not in the catalog")
    calibration = await store.watchdog.calibration(model_id)
    shown = None if calibration is None else calibration_view(
        model.memory_bytes, calibration, margin=settings.oom_calibration_margin)
    # Placement claims the calibrated memory (activities.store): so does its dry run.
    model = with_calibration(model, calibration, margin=settings.oom_calibration_margin)
    asked = await resolve_node_ids(store, node_ids, loc=("query", "node_ids")) \
        if node_ids else None
    if deployment is not None and deployment.node_ids:
        # Its own nodes, narrowed to those asked about.
        asked = [n for n in deployment.node_ids if asked is None or n in asked]
    request = room.placement_request(
        model, min_nodes=max(min_nodes, 1 if deployment is None else deployment.min_nodes),
        node_ids=asked, labels={} if deployment is None else deployment.labels,
        deployment=deployment)
    if deployment is not None:
        request = request.model_copy(update={"capacity_class": deployment.runs_as,
                                             "owner": deployment.owner})
    views = await store.placement.list_node_views(
        datetime.now(UTC), unreachable_after_s=settings.node_unreachable_after_s,
        lost_after_s=settings.node_lost_after_s)
    candidates = profile_candidates(model, request)
    result = place_profiles(candidates, views)
    if isinstance(result, ProfilePlacement):
        judged = result.candidate
        chosen, summary, note = list(result.placement.node_ids), None, result.note
    else:
        judged = next((c for c in candidates if c.refused is None), candidates[0])
        chosen, summary, note = [], result.summary, None
    decisions = explain(judged.request, views)
    return Explanation(
        model_id=model_id,
        deployment_id=None if deployment is None else deployment.deployment_id,
        fits=bool(chosen), nodes_chosen=chosen, summary=summary, note=note,
        profile=judged.name,
        calibration=shown,
        nodes=[NodeVerdict(node_id=d.node_id, name=d.node_name, fits=d.fits,
                           reason=d.rejection.reason_code.value if d.rejection else None,
                           message=d.message) for d in decisions])


async def _remove_windows(temporal: Client, deployment_id: DeploymentId) -> None:
    """Remove a deleted deployment's schedule windows (api/windows.py). Best effort: the
    delete stands whatever happens here, and a window left over removes its own schedules
    when it next fires and finds no deployment (workflows/window.py)."""
    try:
        removed = await schedules.delete_windows(temporal, deployment_id)
    except RPCError as exc:
        log.warning("the windows of deleted deployment %s were not removed (%s); each "
                    "removes itself when it next fires", deployment_id, exc.message)
        return
    if removed:
        log.info("removed the windows of deleted deployment %s: %s", deployment_id,
                 ", ".join(removed))


def _workflow_not_found(exc: RPCError) -> bool:
    """Whether the error says the workflow does not exist (Temporal's NotFoundFailure).
    A NOT_FOUND can name the namespace instead: that is a misconfigured client, and the
    workflow may well be running, so its row must not be removed."""
    return exc.status is RPCStatusCode.NOT_FOUND and any(
        detail.Is(NotFoundFailure.DESCRIPTOR) for detail in exc.grpc_status.details)


async def _existing(store: Store, deployment_id: str) -> DeploymentView:
    view = await store.deployments.get_deployment(deployment_id)
    if view is None:
        raise HTTPException(404, f"deployment {deployment_id!r} does not exist")
    return view


def _runs_of(deployment: DeploymentView) -> str:
    """The catalog model a deployment's new replicas run (after a switch, not its name)."""
    return deployment.runs_model_id or deployment.model_id


def static_summary(deployment_id: DeploymentId, model_id: str, created_by: str) -> str:
    """The run's static summary: what is true for as long as it runs (who created it, for
    which catalog model); what changes is in its current details."""
    return (f"Deployment {deployment_id}, created for model {model_id} by {created_by}; "
            "its current details say how it stands now")


def _summary(request: DeploymentRequest) -> str:
    """What an operator reads first in the web UI's list of runs."""
    where = ""
    if request.node_ids:
        where += f" on {', '.join(request.node_ids)}"
    if request.labels:
        where += " where " + ", ".join(f"{k}={v}" for k, v in sorted(request.labels.items()))
    policy = request.policy
    if policy is not None:
        demand = " on demand" if policy.on_demand else ""
        return (f"keep {request.model_id} served{demand}: replicas "
                f"{scaling_summary(policy)}{where}")
    count = request.initial_replicas
    plural = "replica" if count == 1 else "replicas"
    return f"keep {request.model_id} served: {count} {plural}{where}"
