"""Seeing the room: the fleet summary (``GET /fleet``), headroom (``GET
/deployments/{id}/headroom``, ``GET /models/{id}/headroom``), and fit plans: a deploy or
a scale-up that does not fit answers 409 with plans, and ``plan: N`` applies one with
undo (docs/capacity.md, "Seeing the room" and "Fit plans").

The decisions are pure (:mod:`modelkeeper.domain.fleet`,
:mod:`modelkeeper.domain.fit_plans`); this module reads the snapshot, takes the lock and
carries out a plan's actions through the routes' own paths (:class:`Acts`, which
``api/deployments.py`` provides), so each action and each undo is the same workflow
update and the same audit entry as an operator's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from modelkeeper.domain.capacity import Resources, effective_class
from modelkeeper.domain.catalog import CatalogModel, DeploymentView
from modelkeeper.domain.draining import stale_after_s
from modelkeeper.domain.eviction import Asker
from modelkeeper.domain.fit_plans import (
    NOT_DEPLOYED,
    ActionKind,
    FitPlan,
    PlanAction,
    fit_plans,
    fits,
    room_after,
)
from modelkeeper.domain.fleet import FleetNode, FleetSummary, summarise
from modelkeeper.domain.headroom import Headroom, headroom
from modelkeeper.domain.ids import DeploymentId, NodeId
from modelkeeper.domain.no_room import IfNoRoom
from modelkeeper.domain.nodes import node_state
from modelkeeper.domain.operators import Operator
from modelkeeper.domain.placement import PlacementRequest
from modelkeeper.domain.status import ReplicaState
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.room import RoomSnapshot

from .auth import change
from .deps import SettingsDep, StoreDep
from .problems import problems

router = APIRouter()
log = logging.getLogger(__name__)


class HeadroomView(BaseModel):
    """GET .../headroom: how many more replicas fit, now and by stopping which."""

    model_id: str
    deployment_id: str | None
    memory_bytes: int
    #: More replicas in all: fitting now, plus by stopping others.
    total: int
    headroom: Headroom


class Acts(Protocol):
    """How a plan's actions are carried out: the routes' own paths. Each raises an
    HTTPException (409 refused, 503 not answered) when the workflow does not take it."""

    async def sleep(self, deployment_id: DeploymentId, replica_id: str) -> None: ...

    async def wake(self, deployment_id: DeploymentId, replica_id: str) -> None: ...

    async def scale(self, deployment_id: DeploymentId, replicas: int) -> None: ...


# -- reads ------------------------------------------------------------------------------

async def read_room(store: Store, settings: Settings, *,
                    for_deployment: DeploymentId = NOT_DEPLOYED) -> RoomSnapshot:
    """The snapshot every surface here decides on."""
    return await store.placement.read_room(
        now=datetime.now(UTC), unreachable_after_s=settings.node_unreachable_after_s,
        lost_after_s=settings.node_lost_after_s,
        stale_after_s=stale_after_s(settings.usage_flush_interval_s),
        for_deployment=for_deployment)


@router.get("/fleet", response_model=FleetSummary)
async def fleet(store: StoreDep, settings: SettingsDep) -> FleetSummary:
    """The fleet at a glance: capacity used and free (memory, GPUs per class), free whole
    nodes, counts, what cannot be placed and what nobody asked for lately."""
    snapshot = await read_room(store, settings)
    now = datetime.now(UTC)
    nodes = [FleetNode(record=r, state=node_state(
        r, now, unreachable_after_s=settings.node_unreachable_after_s,
        lost_after_s=settings.node_lost_after_s)) for r in await store.nodes.list_nodes()]
    return summarise(nodes=nodes, deployments=await store.deployments.list_deployments(),
                     usage=snapshot.candidates,
                     models_in_catalog=len(await store.catalog.list_models()),
                     now=snapshot.at)


def placement_request(model: CatalogModel, *, min_nodes: int,
                      node_ids: Sequence[NodeId] | None, labels: dict[str, str],
                      deployment: DeploymentView | None = None) -> PlacementRequest:
    """One replica of ``model`` as its deployment's workflow would ask for it."""
    return PlacementRequest(
        model_id=model.model_id, memory_bytes=model.memory_bytes, cpu_cores=model.cpu_cores,
        gpus=model.gpus, min_nodes=max(min_nodes, model.min_nodes),
        engine=model.engine, engine_version=model.engine_version,
        node_ids=None if node_ids is None else list(node_ids), labels=labels,
        deployment_id=None if deployment is None else deployment.deployment_id,
        sibling_node_ids=[] if deployment is None else
        sorted({n for r in deployment.replicas for n in r.nodes}))


async def _headroom(store: Store, settings: Settings, model: CatalogModel,
                    deployment: DeploymentView | None) -> HeadroomView:
    """Headroom on the capacity rules (modelkeeper.domain.headroom): the deployment asks
    as its class and owner, within its scope's limits; a model not deployed yet asks as
    a fixed deployment with no owner would (standard)."""
    for_deployment = NOT_DEPLOYED if deployment is None else deployment.deployment_id
    request = placement_request(
        model, min_nodes=1 if deployment is None else deployment.min_nodes,
        node_ids=None if deployment is None else deployment.node_ids,
        labels={} if deployment is None else deployment.labels, deployment=deployment)
    snapshot = await read_room(store, settings, for_deployment=for_deployment)
    shards = request.min_nodes
    asker = Asker(
        deployment_id=for_deployment,
        capacity_class=(effective_class(None, None) if deployment is None
                        else deployment.runs_as),
        owner=None if deployment is None else deployment.owner,
        replicas=0 if deployment is None else sum(
            1 for r in deployment.replicas if r.state in _AWAKE),
        min_replicas=0 if deployment is None else (
            deployment.scaling.min_replicas if deployment.scaling is not None
            else deployment.desired_replicas),
        holds=Resources(memory_bytes=request.memory_bytes,
                        gpus=request.shard_gpus * shards,
                        cpu_cores=(request.cpu_cores or 0.0) * shards))
    found = headroom(request, snapshot.nodes, snapshot.candidates,
                     for_deployment=for_deployment, now=snapshot.at,
                     protect_s=settings.eviction_protect_s, asker=asker,
                     quotas=await store.quotas.list_quotas(),
                     holdings=await store.quotas.holdings())
    return HeadroomView(model_id=model.model_id, memory_bytes=model.memory_bytes,
                        deployment_id=None if deployment is None else deployment.deployment_id,
                        total=found.total, headroom=found)


#: A deployment's replicas that count as running for its minimum (ready or on the way).
_AWAKE = frozenset({ReplicaState.READY, ReplicaState.STARTING})


@router.get("/deployments/{deployment_id}/headroom", response_model=HeadroomView,
            responses=problems(404))
async def deployment_headroom(deployment_id: str, store: StoreDep,
                              settings: SettingsDep) -> HeadroomView:
    """How many more replicas of the deployment fit now, and how many more by stopping
    others, naming for each exactly the replicas that make its room."""
    view = await store.deployments.get_deployment(deployment_id)
    if view is None:
        raise HTTPException(404, f"deployment {deployment_id!r} does not exist")
    model = await store.catalog.get_model(view.runs_model_id or view.model_id)
    if model is None:
        raise HTTPException(404, f"deployment {deployment_id!r} runs model "
                                 f"{view.runs_model_id or view.model_id!r}, which is not in "
                                 "the catalog")
    return await _headroom(store, settings, model, view)


@router.get("/models/{model_id:path}/headroom", response_model=HeadroomView,
            responses=problems(404))
async def model_headroom(model_id: str, store: StoreDep,
                         settings: SettingsDep) -> HeadroomView:
    """Headroom for a catalog model: its deployment's, when it has one; else for a
    replica of its catalog memory, as a first deploy would ask."""
    model = await store.catalog.get_model(model_id)
    if model is None:
        raise HTTPException(404, f"model {model_id!r} is not in the catalog")
    return await _headroom(store, settings, model,
                           await store.deployments.get_deployment_by_model(model_id))


# -- fit plans --------------------------------------------------------------------------

class NoRoom(BaseModel):
    """The body of a 409 for want of room."""

    detail: str
    plans: list[FitPlan]
    #: Set when a plan was applied and then undone: each action undone, in order.
    undone: list[PlanAction] = Field(default_factory=list)
    #: The undos that failed: what could not be restored, and why. Empty: all restored.
    rollback_incomplete: list[dict[str, str]] = Field(default_factory=list)


def _plans_text(plans: Sequence[FitPlan]) -> str:
    if not plans:
        return ("no plan makes room: nothing an operator may sleep or scale down frees "
                "enough (see GET /fleet and the headroom)")
    return "; ".join(f"plan {p.number}: {p.text}" for p in plans)


def _refused(head: str, plans: Sequence[FitPlan], *, undone: Sequence[PlanAction] = (),
             incomplete: Sequence[dict[str, str]] = ()) -> JSONResponse:
    body = NoRoom(detail=f"{head}; {_plans_text(plans)}", plans=list(plans),
                  undone=list(undone), rollback_incomplete=list(incomplete))
    return JSONResponse(status_code=409, content=body.model_dump(mode="json"))


async def _do(acts: Acts, action: PlanAction) -> None:
    match action.kind:
        case ActionKind.SLEEP:
            await acts.sleep(action.deployment_id, action.replica_id)
        case ActionKind.SCALE_DOWN:
            assert action.replicas_to is not None
            await acts.scale(action.deployment_id, action.replicas_to)


async def _undo(acts: Acts, action: PlanAction) -> None:
    match action.kind:
        case ActionKind.SLEEP:
            await acts.wake(action.deployment_id, action.replica_id)
        case ActionKind.SCALE_DOWN:
            assert action.replicas_from is not None
            await acts.scale(action.deployment_id, action.replicas_from)


async def undo_all(acts: Acts, applied: Sequence[PlanAction]) -> list[dict[str, str]]:
    """Undo ``applied`` in reverse order; what could not be restored, and why."""
    incomplete = []
    for action in reversed(applied):
        try:
            await _undo(acts, action)
        except HTTPException as exc:
            incomplete.append({"action": action.text, "error": str(exc.detail)})
    return incomplete


@asynccontextmanager
async def room_made(*, store: Store, settings: Settings, acts: Acts, operator: Operator,
                    request: PlacementRequest, count: int, if_no_room: IfNoRoom,
                    plan: int | None, what: str,
                    for_deployment: DeploymentId = NOT_DEPLOYED,
                    ) -> AsyncIterator[JSONResponse | None]:
    """Around a deploy (or a scale-up) of ``count`` replicas like ``request``: yields
    None to go ahead, or the 409 to answer instead.

    * It fits on the ready nodes, or ``queue`` without a plan: go ahead, as ever.
    * ``plan`` mode without a plan: 409 with the plans (:func:`fit_plans`).
    * ``plan: N``: under the plan lock (one plan applied at a time, in every API
      process), its actions are applied in order through ``acts``; then the room is
      checked on a fresh snapshot (:func:`room_after`). If an action fails, or the room
      is not made, every applied action is undone in reverse and the 409 says what was
      undone and what could not be restored (``rollback_incomplete``). Else the caller
      goes ahead still under the lock (a failure there undoes the plan too).
    """
    if count < 1 or (plan is None and if_no_room is IfNoRoom.QUEUE):
        yield None
        return
    snapshot = await read_room(store, settings, for_deployment=for_deployment)
    if fits(request, snapshot.nodes, count):
        yield None
        return
    plans = fit_plans(request, snapshot.nodes, snapshot.candidates, snapshot.holders,
                      count=count, for_deployment=for_deployment)
    head = f"{what} does not fit on the ready nodes"
    if plan is None:
        yield _refused(head, plans)
        return
    if plan > len(plans):
        yield _refused(f"{head}, and plan {plan} is not one of the {len(plans)} plan(s) "
                       "there are now", plans)
        return
    chosen = plans[plan - 1]
    async with store.room.plan_lock():
        applied: list[PlanAction] = []
        failed: str | None = None
        for action in chosen.actions:
            try:
                await _do(acts, action)
            except HTTPException as exc:
                failed = f"{action.text} failed ({exc.detail})"
                break
            applied.append(action)
        if failed is None:
            fresh = await read_room(store, settings, for_deployment=for_deployment)
            if not room_after(chosen, request, fresh.nodes, fresh.held, count=count):
                failed = "the room is not made any more (something else took it)"
        if failed is not None:
            incomplete = await undo_all(acts, applied)
            await _audit_undone(store, operator, chosen, what=what, why=failed,
                                incomplete=incomplete)
            again = await read_room(store, settings, for_deployment=for_deployment)
            yield _refused(f"plan {plan} was undone: {failed}", fit_plans(
                request, again.nodes, again.candidates, again.holders, count=count,
                for_deployment=for_deployment), undone=applied, incomplete=incomplete)
            return
        await store.events.record_event(change(
            operator, "plan.applied", f"plan {plan} applied to make room for {what}: "
            f"{chosen.text}", data={"plan": chosen.model_dump(mode="json")}))
        done = False
        try:
            yield None
            done = True
        finally:
            if not done:
                # The deploy itself failed (its row or its workflow): the room it was made
                # for is not needed. Undone; the failure goes on as it was.
                incomplete = await undo_all(acts, applied)
                await _audit_undone(store, operator, chosen, what=what,
                                    why=f"{what} failed after it", incomplete=incomplete)


async def _audit_undone(store: Store, operator: Operator, plan: FitPlan, *, what: str,
                        why: str, incomplete: Sequence[dict[str, Any]]) -> None:
    lost = "; ".join(f"{i['action']}: {i['error']}" for i in incomplete)
    message = f"plan {plan.number} for {what} undone: {why}"
    if lost:
        message += f"; rollback incomplete: {lost}"
    await store.events.record_event(change(
        operator, "plan.undone", message,
        data={"plan": plan.model_dump(mode="json"), "rollback_incomplete": list(incomplete)}))
