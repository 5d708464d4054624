"""Who may hold the cluster's capacity, and who yields it: capacity classes, owners in a
tenancy tree, and their quotas. Pure: values and arithmetic, no I/O and no clock.

**Classes.** A deployment's class decides what may be stopped to place it
(:mod:`modelkeeper.domain.eviction` applies the rules): ``critical`` outranks
``standard``, which outranks ``opportunistic``. A class left unset follows the scaling
policy (:func:`effective_class`): a model loaded on demand (min 0) is opportunistic, since
nobody was promised it; any other is standard. Nothing is critical unless an operator says
so.

**Owners.** A deployment may have an owner, a path in the tenancy tree of at most three
parts, ``org``, ``org/team`` or ``org/team/project``. What a scope holds is summed from
the replicas of the deployments it owns and those of every scope beneath it
(:func:`held_by`).

**Quotas.** A scope may have a *guarantee* and a *limit*, each of memory, GPUs and CPU
cores:

* a replica within its owner's guarantee is never taken for another scope;
* what a scope holds beyond its guarantee is *borrowed*, and may be taken back for a
  scope that is still within its own guarantee (:func:`borrowed`);
* a limit refuses a deployment, or a scale-up, before it starts (:func:`limit_refusal`),
  with the numbers. Every scope on the path counts: a project's deployment is refused by
  its team's limit too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints

from .base import Frozen, Tolerant
from .bounds import JsonInt
from .demand import ScalingPolicy
from .ids import DeploymentId, ReplicaId
from .units import format_gib


class CapacityClass(StrEnum):
    """What may be stopped to place a deployment: a lower class for a higher."""

    CRITICAL = "critical"
    STANDARD = "standard"
    OPPORTUNISTIC = "opportunistic"


#: Each class's rank; a higher rank may preempt a lower one.
CLASS_RANK: Mapping[CapacityClass, int] = {
    CapacityClass.OPPORTUNISTIC: 0, CapacityClass.STANDARD: 1, CapacityClass.CRITICAL: 2}


def effective_class(declared: CapacityClass | None,
                    policy: ScalingPolicy | None) -> CapacityClass:
    """The class a deployment runs as: the one declared, else what its scaling policy
    implies (on demand: opportunistic; fixed or min >= 1: standard)."""
    if declared is not None:
        return declared
    if policy is not None and policy.on_demand:
        return CapacityClass.OPPORTUNISTIC
    return CapacityClass.STANDARD


def outranks(a: CapacityClass, b: CapacityClass) -> bool:
    """Whether class ``a`` may preempt class ``b``."""
    return CLASS_RANK[a] > CLASS_RANK[b]


#: One part of an owner path: what a DNS label allows, so it is safe in a URL, a metric
#: label and a log line alike.
OWNER_PART_PATTERN = r"[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?"
#: An owner: org, org/team or org/team/project.
OWNER_PATTERN = rf"^{OWNER_PART_PATTERN}(/{OWNER_PART_PATTERN}){{0,2}}$"
#: The deepest an owner path goes (org, team, project).
MAX_OWNER_DEPTH = 3
#: The longest owner path: three parts of 63 and two slashes.
MAX_OWNER_LENGTH = 3 * 63 + 2

OwnerPath = Annotated[str, StringConstraints(pattern=OWNER_PATTERN,
                                             max_length=MAX_OWNER_LENGTH)]


def scopes_of(owner: str) -> list[str]:
    """The scopes an owner is counted in, outermost first: ``a/b/c`` is in ``a``,
    ``a/b`` and ``a/b/c``."""
    parts = owner.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def within(owner: str, scope: str) -> bool:
    """Whether ``owner`` is ``scope`` or beneath it."""
    return owner == scope or owner.startswith(scope + "/")


#: The most memory a quota may name: 1 EiB, far past any cluster, and within a bigint.
MAX_QUOTA_BYTES = 2**60
#: The most GPUs or cores a quota may name.
MAX_QUOTA_UNITS = 1_000_000
#: The most memory a quota set through the API may name: 4 PiB (2**52), far past any
#: cluster, and below 2**53, so that a JSON client comparing it as a float
#: (a JSON Schema validator does) agrees with the API on what passes the bound; at 2**60
#: a number a little past the bound reads as equal to it.
MAX_QUOTA_REQUEST_BYTES = 1 << 52


class Resources(Tolerant):
    """Memory, GPUs and CPU cores: what a replica holds, or what a scope holds or may."""

    memory_bytes: int = Field(default=0, ge=0, le=MAX_QUOTA_BYTES)
    gpus: int = Field(default=0, ge=0, le=MAX_QUOTA_UNITS)
    cpu_cores: float = Field(default=0.0, ge=0, le=MAX_QUOTA_UNITS)

    def __add__(self, other: Resources) -> Resources:
        return Resources(memory_bytes=self.memory_bytes + other.memory_bytes,
                         gpus=self.gpus + other.gpus,
                         cpu_cores=self.cpu_cores + other.cpu_cores)

    def __sub__(self, other: Resources) -> Resources:
        """What is left; never below zero in any part."""
        return Resources(memory_bytes=max(0, self.memory_bytes - other.memory_bytes),
                         gpus=max(0, self.gpus - other.gpus),
                         cpu_cores=max(0.0, self.cpu_cores - other.cpu_cores))

    def fits_in(self, other: Resources) -> bool:
        """Whether every part of this is at most the same part of ``other``."""
        return (self.memory_bytes <= other.memory_bytes and self.gpus <= other.gpus
                and self.cpu_cores <= other.cpu_cores + _CPU_EPSILON)

    @property
    def empty(self) -> bool:
        return self.memory_bytes == 0 and self.gpus == 0 and self.cpu_cores <= _CPU_EPSILON

    def describe(self) -> str:
        """``16.0 GiB, 2 GPUs, 4 cores``: the parts that are not zero."""
        parts = [format_gib(self.memory_bytes)] if self.memory_bytes else []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}")
        if self.cpu_cores > _CPU_EPSILON:
            parts.append(f"{self.cpu_cores:g} cores")
        return ", ".join(parts) or "nothing"


#: Slack for comparing summed fractional cores.
_CPU_EPSILON = 1e-9


class Limit(Tolerant):
    """A scope's limit: each part None means unlimited."""

    memory_bytes: JsonInt | None = Field(default=None, ge=0, le=MAX_QUOTA_BYTES)
    gpus: JsonInt | None = Field(default=None, ge=0, le=MAX_QUOTA_UNITS)
    cpu_cores: float | None = Field(default=None, ge=0, le=MAX_QUOTA_UNITS)


class Quota(Tolerant):
    """A scope's guarantee and limit."""

    scope: OwnerPath
    guarantee: Resources = Field(default_factory=Resources)
    limit: Limit = Field(default_factory=Limit)


class Holding(Frozen):
    """What one owner's replicas hold (or one replica, or what a new one would)."""

    owner: str | None
    resources: Resources


def held_by(scope: str, holdings: Iterable[Holding]) -> Resources:
    """What ``scope`` holds: the sum over every holding of it and of the scopes beneath
    it. Holdings with no owner belong to no scope."""
    total = Resources()
    for holding in holdings:
        if holding.owner is not None and within(holding.owner, scope):
            total = total + holding.resources
    return total


class LimitBreach(Frozen):
    """A limit a deployment or a scale-up would pass: the scope, the part (``memory``,
    ``gpus`` or ``cpu_cores``), what the scope holds, what was asked and the limit (bytes
    for memory, units for the rest)."""

    scope: str
    part: str
    #: Whole numbers stay whole (bytes, GPUs); cores may be fractional.
    held: int | float
    asked: int | float
    limit: int | float

    @property
    def message(self) -> str:
        unit = "bytes" if self.part == "memory" else "units"
        return (f"scope {self.scope!r} would pass its {self.part} limit: it holds "
                f"{_show(self.held, unit)}, this asks {_show(self.asked, unit)} more, and "
                f"its limit is {_show(self.limit, unit)}")


def limit_breach(owner: str | None, adding: Resources, quotas: Sequence[Quota],
                 holdings: Iterable[Holding]) -> LimitBreach | None:
    """The first limit on ``owner``'s path, outermost first, that taking ``adding`` more
    would pass, as numbers; None when none would be."""
    if owner is None:
        return None
    by_scope = {q.scope: q for q in quotas}
    listed = list(holdings)
    for scope in scopes_of(owner):
        quota = by_scope.get(scope)
        if quota is None:
            continue
        held = held_by(scope, listed)
        limit = quota.limit
        checks: tuple[tuple[str, float, float, float | None], ...] = (
            ("memory", held.memory_bytes, adding.memory_bytes, limit.memory_bytes),
            ("gpus", held.gpus, adding.gpus, limit.gpus),
            ("cpu_cores", held.cpu_cores, adding.cpu_cores, limit.cpu_cores),
        )
        for part, have, add, cap in checks:
            if cap is not None and have + add > cap + _CPU_EPSILON:
                return LimitBreach(scope=scope, part=part, held=have, asked=add, limit=cap)
    return None


def limit_refusal(owner: str | None, adding: Resources, quotas: Sequence[Quota],
                  holdings: Iterable[Holding]) -> str | None:
    """Why ``owner`` may not take ``adding`` more (a new deployment's replicas, or a
    scale-up's), or None: it names the first scope on the owner's path whose limit it
    would pass, with what the scope holds, what was asked and the limit."""
    breach = limit_breach(owner, adding, quotas, holdings)
    return None if breach is None else breach.message


def at_limit(held: Resources, limit: Limit) -> list[str]:
    """The parts of ``limit`` that ``held`` has reached (``memory``, ``gpus``,
    ``cpu_cores``): where the next replica of any size is refused. An unset part is
    never reached."""
    parts: tuple[tuple[str, float, float | None], ...] = (
        ("memory", held.memory_bytes, limit.memory_bytes),
        ("gpus", held.gpus, limit.gpus),
        ("cpu_cores", held.cpu_cores, limit.cpu_cores),
    )
    return [part for part, have, cap in parts
            if cap is not None and have + _CPU_EPSILON >= cap]


def _show(value: float, unit: str) -> str:
    return format_gib(int(value)) if unit == "bytes" else f"{value:g}"


def borrowed(scope: str, quotas: Sequence[Quota], holdings: Iterable[Holding]) -> Resources:
    """What ``scope`` holds beyond its guarantee (all of it, with no quota): the part
    that may be taken back for a scope within its own guarantee."""
    held = held_by(scope, holdings)
    quota = next((q for q in quotas if q.scope == scope), None)
    if quota is None:
        return held
    return held - quota.guarantee


def guarantee_scope(owner: str | None, quotas: Sequence[Quota]) -> Quota | None:
    """The innermost scope on ``owner``'s path that has a guarantee: the one whose
    promise covers the owner's replicas. None: the owner is promised nothing."""
    if owner is None:
        return None
    by_scope = {q.scope: q for q in quotas}
    for scope in reversed(scopes_of(owner)):
        quota = by_scope.get(scope)
        if quota is not None and not quota.guarantee.empty:
            return quota
    return None


def within_guarantee(owner: str | None, adding: Resources, quotas: Sequence[Quota],
                     holdings: Iterable[Holding]) -> bool:
    """Whether ``owner`` would still be within its guarantee holding ``adding`` more (a
    replica it asks to place; or, with ``adding`` empty, whether what it holds now is
    all promised). An owner with no guarantee is within none."""
    quota = guarantee_scope(owner, quotas)
    if quota is None:
        return False
    held = held_by(quota.scope, holdings)
    return (held + adding).fits_in(quota.guarantee)


class PreemptRequest(Tolerant):
    """``preempt``: stop this replica to make room for something that outranks it (a
    higher class's placement, a scope taking back its guarantee) or to save its node (the
    memory watchdog). Unlike an eviction, the deployment keeps its count: it drains the
    replica with a short grace, then holds back with ``reason`` until room returns, and
    is placed again by itself."""

    replica_id: ReplicaId
    #: The deployment the room is for; None: no deployment (the watchdog).
    by: DeploymentId | None = None
    #: Shown as the victim's status reason: "preempted by d-1 (critical) for ...".
    reason: str = Field(min_length=1, max_length=1024)


class SetTenancyRequest(Tolerant):
    """``set_tenancy``: a deployment's new owner and/or class (PATCH, the CLI), for the
    placements, preemptions and holds its workflow asks for from now on. None: unchanged."""

    owner: OwnerPath | None = None
    capacity_class: CapacityClass | None = None
