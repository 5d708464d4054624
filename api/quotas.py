"""Routes for quotas per scope of the tenancy tree (docs/capacity.md, "Quotas"), and the
limit check every deployment and scale-up passes before it starts.

The rules are pure, in :mod:`modelkeeper.domain.capacity`: what a scope holds
(``held_by``), what it borrows (``borrowed``), which limit a change would pass
(``limit_breach``). The holdings are summed from the replicas' claims
(:meth:`modelkeeper.store.quotas.QuotasStore.holdings`).

A change that would pass a limit is refused with **409** (it conflicts with what the
scope holds now) and a body that names the numbers::

    {"detail": "scope 'acme/a' would pass its memory limit: it holds 16.0 GiB, ...",
     "quota": {"scope": "acme/a", "part": "memory", "held": ..., "asked": ..., "limit": ...}}
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.bounds import JsonInt
from modelkeeper.domain.capacity import (
    MAX_OWNER_LENGTH,
    MAX_QUOTA_REQUEST_BYTES,
    MAX_QUOTA_UNITS,
    OWNER_PATTERN,
    Holding,
    Limit,
    LimitBreach,
    Quota,
    Resources,
    at_limit,
    borrowed,
    held_by,
    limit_breach,
)
from modelkeeper.domain.catalog import CatalogModel
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.domain.notify import quota_notice
from modelkeeper.infra import notify
from modelkeeper.store import Store

from .auth import OperatorDep, change
from .deps import StoreDep
from .problems import problems

router = APIRouter()

#: A scope in a path: what an owner may be (org, org/team or org/team/project).
ScopePath = Annotated[str, Path(pattern=OWNER_PATTERN, max_length=MAX_OWNER_LENGTH)]


class GuaranteeSetting(Frozen):
    """A guarantee as an operator sends it: JSON numbers only (``true`` is not 1), a
    misspelt part a 422 naming it, and memory bounded where a JSON client agrees on the
    bound (``MAX_QUOTA_REQUEST_BYTES``)."""

    memory_bytes: JsonInt = Field(default=0, ge=0, le=MAX_QUOTA_REQUEST_BYTES)
    gpus: JsonInt = Field(default=0, ge=0, le=MAX_QUOTA_UNITS)
    cpu_cores: float = Field(default=0.0, ge=0, le=MAX_QUOTA_UNITS, strict=True)


class LimitSetting(Frozen):
    """A limit as an operator sends it, as :class:`GuaranteeSetting`; a part null or left
    out is unlimited."""

    memory_bytes: JsonInt | None = Field(default=None, ge=0, le=MAX_QUOTA_REQUEST_BYTES)
    gpus: JsonInt | None = Field(default=None, ge=0, le=MAX_QUOTA_UNITS)
    cpu_cores: float | None = Field(default=None, ge=0, le=MAX_QUOTA_UNITS, strict=True)


class QuotaSetting(Frozen):
    """PUT /quotas/{scope}: the whole quota. A part left out is not guaranteed (0) or not
    limited (null)."""

    guarantee: GuaranteeSetting = GuaranteeSetting()
    limit: LimitSetting = LimitSetting()


class QuotaView(BaseModel):
    """A scope's quota and where it stands: what it and the scopes beneath it hold, what
    of that is borrowed (beyond its guarantee), and the limit parts it has reached."""

    scope: str
    guarantee: Resources
    limit: Limit
    held: Resources
    borrowed: Resources
    at_limit: list[str]


class LimitProblem(BaseModel):
    """409: a deployment or a scale-up that would pass a scope's limit."""

    detail: str
    #: The limit passed, as numbers; absent on a 409 for another conflict (the
    #: deployment exists, a workflow's refusal).
    quota: LimitBreach | None = None


def replica_resources(model: CatalogModel, min_nodes: int) -> Resources:
    """What one replica of ``model`` claims, as placement claims it: its memory (split
    over its nodes), and its GPUs and cores on each of its ``min_nodes`` nodes."""
    nodes = max(min_nodes, model.min_nodes)
    return Resources(memory_bytes=model.memory_bytes, gpus=(model.gpus or 0) * nodes,
                     cpu_cores=(model.cpu_cores or 0.0) * nodes)


def times(resources: Resources, count: int) -> Resources:
    """``count`` replicas' worth of ``resources``."""
    return Resources(memory_bytes=resources.memory_bytes * count, gpus=resources.gpus * count,
                     cpu_cores=resources.cpu_cores * count)


async def refuse_over_limit(store: Store, owner: str | None, asking: Resources, *,
                            replacing: DeploymentId | None = None) -> None:
    """Raise a 409 naming the numbers if ``owner`` taking ``asking`` would pass a limit of
    any scope on its path. ``replacing``: a deployment whose own holding ``asking``
    replaces (its new count, or its whole self under a new owner), left out of what is
    held."""
    if owner is None:
        return
    quotas = await store.quotas.list_quotas()
    if not quotas:
        return
    breach = limit_breach(owner, asking, quotas,
                          await store.quotas.holdings(excluding=replacing))
    if breach is not None:
        raise QuotaExceeded(breach)


class QuotaExceeded(Exception):
    """A change that would pass a limit: answered 409 by :func:`quota_exceeded`, its body
    carrying the breach as numbers beside its sentence."""

    def __init__(self, breach: LimitBreach) -> None:
        super().__init__(breach.message)
        self.breach = breach


async def quota_exceeded(request: Request, exc: Exception) -> JSONResponse:
    """The app's handler of :class:`QuotaExceeded` (``create_app`` installs it); it also
    notifies (docs/operations.md, "Notifications"), at most once an hour per scope and
    part."""
    assert isinstance(exc, QuotaExceeded)
    breach = exc.breach
    await notify.notice_or_log(request.app.state.temporal, quota_notice(
        breach.scope, breach.part, breach.message, breach.model_dump(mode="json"),
        now=datetime.now(UTC)), request.app.state.settings)
    return JSONResponse(LimitProblem(detail=exc.breach.message, quota=exc.breach)
                        .model_dump(mode="json"), status_code=409)


LIMIT_RESPONSES: dict[int | str, dict[str, object]] = {
    409: {"model": LimitProblem,
          "description": "Conflict: already exists, in use or deleting; or a scope's limit "
                         "would be passed (the body's quota names scope, part, held, asked "
                         "and limit)."}}


async def _view(store: Store, quota: Quota) -> QuotaView:
    quotas = await store.quotas.list_quotas()
    return _views([quota], quotas, await store.quotas.holdings())[0]


def _views(shown: list[Quota], quotas: list[Quota], holdings: list[Holding]
           ) -> list[QuotaView]:
    views = []
    for quota in shown:
        held = held_by(quota.scope, holdings)
        views.append(QuotaView(scope=quota.scope, guarantee=quota.guarantee,
                               limit=quota.limit, held=held,
                               borrowed=borrowed(quota.scope, quotas, holdings),
                               at_limit=at_limit(held, quota.limit)))
    return views


async def quota_views(store: Store) -> list[QuotaView]:
    """Every quota and where it stands (GET /quotas, and the metrics)."""
    quotas = await store.quotas.list_quotas()
    return _views(quotas, quotas, await store.quotas.holdings())


@router.put("/quotas/{scope:path}", response_model=QuotaView)
async def set_quota(scope: ScopePath, setting: QuotaSetting, store: StoreDep,
                    operator: OperatorDep) -> QuotaView:
    """Set a scope's guarantee and limit, whole. A limit below what the scope holds now
    stops nothing running; it refuses what would add to it."""
    quota = await store.quotas.set_quota(Quota(
        scope=scope, guarantee=Resources(**setting.guarantee.model_dump()),
        limit=Limit(**setting.limit.model_dump())))
    await store.events.record_event(change(
        operator, "quota.set", f"quota of {scope}: guarantee "
        f"{quota.guarantee.describe()}, limit {_describe_limit(quota.limit)}",
        data=quota.model_dump(mode="json")))
    return await _view(store, quota)


@router.get("/quotas", response_model=list[QuotaView])
async def list_quotas(store: StoreDep) -> list[QuotaView]:
    """Every scope's quota: guarantee, limit, held, borrowed and the parts at the limit."""
    return await quota_views(store)


@router.get("/quotas/{scope:path}", response_model=QuotaView, responses=problems(404))
async def get_quota(scope: ScopePath, store: StoreDep) -> QuotaView:
    """One scope's quota and where it stands; 404 when it has none."""
    quota = await store.quotas.get_quota(scope)
    if quota is None:
        raise HTTPException(404, f"scope {scope!r} has no quota")
    return await _view(store, quota)


@router.delete("/quotas/{scope:path}", status_code=204, responses=problems(404))
async def delete_quota(scope: ScopePath, store: StoreDep, operator: OperatorDep) -> None:
    """Remove a scope's quota: it is no longer guaranteed or limited."""
    if not await store.quotas.delete_quota(scope):
        raise HTTPException(404, f"scope {scope!r} has no quota")
    await store.events.record_event(change(operator, "quota.removed",
                                           f"quota of {scope} removed"))


def _describe_limit(limit: Limit) -> str:
    parts = []
    if limit.memory_bytes is not None:
        parts.append(Resources(memory_bytes=limit.memory_bytes).describe())
    if limit.gpus is not None:
        parts.append(f"{limit.gpus} GPUs")
    if limit.cpu_cores is not None:
        parts.append(f"{limit.cpu_cores:g} cores")
    return ", ".join(parts) or "none"
