"""Measured capacity on the API: what ``modelkeeper bench`` found a replica of a model
serves (PUT and GET ``/models/{id}/capacity``), and ``/models/{id}/size``, how many
replicas a target rate needs against the room there is (docs/capacity.md).

Included before the catalog's routes (``create_app``): ``/models/{model_id:path}`` would
otherwise take ``x/capacity`` as a model id.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException, Query
from pydantic import Field

from modelkeeper.domain.bounds import MAX_REPLICAS
from modelkeeper.domain.catalog import CatalogModel
from modelkeeper.domain.measured import (
    CapacityReport,
    MeasuredCapacity,
    SizeAnswer,
    measured_of,
    most_cautious,
    size,
)
from modelkeeper.domain.sizing import room_for
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.watchdog import CalibrationView
from modelkeeper.store import Store

from .auth import OperatorDep, change
from .deps import SettingsDep, StoreDep
from .problems import problems
from .room import placement_request

router = APIRouter(tags=["capacity"])

#: The most requests/s ``size`` is asked about: a million a second is beyond any one
#: model's fleet; more is a typo.
MAX_SIZE_RPS = 1e6
#: Replicas in flight or serving: they already take their share of the target.
_COUNTED = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.SLEEPING})


class ModelView(CatalogModel):
    """GET /models/{id}: the catalog entry, what a replica was measured to serve, and
    its OOM calibration when it has one (the key is absent otherwise)."""

    #: One per profile measured; empty: never measured.
    measured: list[MeasuredCapacity] = Field(default_factory=list)
    calibration: CalibrationView | None = None


async def _model(store: Store, model_id: str) -> CatalogModel:
    model = await store.catalog.get_model(model_id)
    if model is None:
        raise HTTPException(404, f"model {model_id!r} is not in the catalog")
    return model


@router.put("/models/{model_id:path}/capacity", response_model=MeasuredCapacity,
            responses=problems(404))
async def put_capacity(model_id: str, report: CapacityReport, store: StoreDep,
                       operator: OperatorDep) -> MeasuredCapacity:
    """Store what ``bench`` measured one replica of the model to serve (it replaces the
    profile's earlier measurement); per GPU or per core from the catalog's resources."""
    model = await _model(store, model_id)
    measured = await store.measured.put_measured(measured_of(
        report, model_id=model.model_id, engine=model.engine, gpus=model.gpus,
        cpu_cores=model.cpu_cores, at=datetime.now(UTC)))
    per = ("" if measured.unit is None else
           f", {measured.tokens_per_s_per_unit:.1f} tokens/s per {measured.unit.value}")
    await store.events.record_event(change(
        operator, "model.measured",
        f"model {model_id}{' as ' + report.profile if report.profile else ''} measured: "
        f"{measured.concurrency} concurrent request(s) per replica within TTFT p95 "
        f"{report.objective.ttft_p95_s:g} s and inter-token p95 "
        f"{report.objective.itl_p95_s:g} s, {measured.tokens_per_s:.1f} tokens/s{per}",
        data=measured.model_dump(mode="json")))
    return measured


@router.get("/models/{model_id:path}/capacity", response_model=list[MeasuredCapacity],
            responses=problems(404))
async def get_capacity(model_id: str, store: StoreDep) -> list[MeasuredCapacity]:
    """The model's measurements, one per profile (none: never measured)."""
    await _model(store, model_id)
    return await store.measured.measured_of(model_id)


@router.get("/models/{model_id:path}/size", response_model=SizeAnswer,
            responses=problems(404, 409))
async def size_model(model_id: str, store: StoreDep, settings: SettingsDep, *,
                     rps: float = Query(gt=0, le=MAX_SIZE_RPS, allow_inf_nan=False),
                     profile: str | None = Query(default=None, max_length=64)) -> SizeAnswer:
    """How many replicas ``rps`` requests/s need by the model's measured capacity, how
    many there are, and how many more fit now (placement on a copy of the nodes). 409
    when the model was never measured (``modelkeeper bench`` measures it)."""
    model = await _model(store, model_id)
    measurements = await store.measured.measured_of(model_id)
    if profile is not None:
        measurements = [m for m in measurements if m.profile == profile]
    capacity = most_cautious(measurements)
    if capacity is None:
        which = f" as profile {profile!r}" if profile is not None else ""
        raise HTTPException(409, f"model {model_id!r} has no measured capacity{which}: "
                                 f"`modelkeeper bench {model_id}` measures it (deployed "
                                 "and ready)")
    deployment = await store.deployments.get_deployment_by_model(model_id)
    now = 0 if deployment is None else sum(
        1 for r in deployment.replicas if r.state in _COUNTED)
    wanted = size(capacity, rps=rps, replicas_now=now, fit_now=0).more_needed
    # Placed as explain places one replica (the deployment's nodes count as siblings).
    request = placement_request(
        model, min_nodes=model.min_nodes if deployment is None else deployment.min_nodes,
        node_ids=None if deployment is None else deployment.node_ids,
        labels={} if deployment is None else deployment.labels, deployment=deployment)
    views = await store.placement.list_node_views(
        datetime.now(UTC), unreachable_after_s=settings.node_unreachable_after_s,
        lost_after_s=settings.node_lost_after_s)
    # Bounded: a node that reports no memory fits any replica, and a deployment never
    # holds more than MAX_REPLICAS anyway.
    return size(capacity, rps=rps, replicas_now=now,
                fit_now=room_for(request, views, limit=min(wanted, MAX_REPLICAS)))
