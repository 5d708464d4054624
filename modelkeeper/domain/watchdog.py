"""The memory watchdog's rules: how much memory a node really has left, the level that
makes (ok, warn, critical), which replica a critical node stops, and how often; and the
OOM calibration of a model's claim. Pure: time is an argument, no I/O.

Rules, in order (each has its test in tests/unit/test_watchdog.py):

1. **Margin.** A node keeps ``watchdog_margin_bytes`` free, or, on a node smaller than 10
   of those, ``watchdog_margin_fraction`` of its memory (:func:`margin_for`).
2. **Level.** Available memory below the margin is critical, below
   ``watchdog_warn_factor`` margins a warning, else ok (:func:`raw_level`). GPUs have their
   own margin; the node's level is the worse of the two (:func:`worst`).
3. **Hysteresis.** A worse level is taken at once; a better one only once available memory
   is ``watchdog_clear_fraction`` of a margin above that level's line
   (:func:`memory_level`), so a node at a line does not flap.
4. **Victim.** On a critical node the replica stopped is the lowest effective class's
   (:func:`~modelkeeper.domain.capacity.effective_class`), the largest claim first within a
   class, then the replica id, so the choice is stable (:func:`choose_victim`).
5. **Pace.** One stop per node per ``watchdog_action_interval_s``: the engine stopped
   frees its memory within seconds and the next heartbeats must see it first
   (:func:`action_due`).
6. **Calibration.** A model killed for memory with evidence is claimed next at
   ``max(catalog memory, peak resident x oom_calibration_margin)``
   (:func:`calibrated_memory`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import Field

from .base import Frozen, Tolerant
from .bounds import JsonInt
from .capacity import CLASS_RANK, CapacityClass, effective_class
from .catalog import CatalogModel
from .demand import ScalingPolicy
from .ids import DeploymentId, ModelId, ReplicaId
from .tunables import WatchdogTunables
from .units import format_gib

#: The most bytes a report may carry: far past any node, and within a bigint.
MAX_REPORTED_BYTES = 2**60
#: A node smaller than this many margins uses the fractional margin (rule 1).
SMALL_NODE_MARGINS = 10


class MemoryLevel(StrEnum):
    """How close a node is to running out of real memory."""

    OK = "ok"
    WARN = "warn"
    CRITICAL = "critical"


#: Each level's severity, worst highest; also the value of the per-node metric.
LEVEL_RANK = {MemoryLevel.OK: 0, MemoryLevel.WARN: 1, MemoryLevel.CRITICAL: 2}


def worst(*levels: MemoryLevel) -> MemoryLevel:
    """The most severe of ``levels`` (ok for none)."""
    return max(levels, key=LEVEL_RANK.__getitem__, default=MemoryLevel.OK)


def margin_for(total_bytes: int | None, tunables: WatchdogTunables) -> int:
    """Rule 1: the memory a node of ``total_bytes`` keeps free."""
    fixed = tunables.watchdog_margin_bytes
    if total_bytes is None or total_bytes >= SMALL_NODE_MARGINS * fixed:
        return fixed
    return int(total_bytes * tunables.watchdog_margin_fraction)


def raw_level(available_bytes: int, margin_bytes: int, warn_factor: float) -> MemoryLevel:
    """Rule 2, without hysteresis."""
    if available_bytes < margin_bytes:
        return MemoryLevel.CRITICAL
    if available_bytes < margin_bytes * warn_factor:
        return MemoryLevel.WARN
    return MemoryLevel.OK


def memory_level(available_bytes: int | None, previous: MemoryLevel, *, margin_bytes: int,
                 tunables: WatchdogTunables) -> MemoryLevel:
    """Rules 2 and 3: the level after a sample of ``available_bytes``, coming from
    ``previous``. Unreadable (None): no evidence either way, the level stays."""
    if available_bytes is None:
        return previous
    factor = tunables.watchdog_warn_factor
    now = raw_level(available_bytes, margin_bytes, factor)
    if LEVEL_RANK[now] >= LEVEL_RANK[previous]:
        return now
    # Better: only as far as memory clears each line by the band.
    band = int(margin_bytes * tunables.watchdog_clear_fraction)
    eased = raw_level(available_bytes - band, margin_bytes, factor)
    return worst(now, eased)


class MemorySample(Frozen):
    """What the agent measured at one heartbeat: the memory the node has left (the
    machine's MemAvailable, and on a node that declares its memory, the declaration less
    what its engines hold resident), the node's total, and the least free memory of any
    GPU (None: no GPU, or none readable)."""

    available_bytes: int | None
    total_bytes: int | None
    engines_rss_bytes: int = 0
    gpu_free_bytes: int | None = None


class MemoryReport(Tolerant):
    """The watchdog's word in a heartbeat (``AgentHeartbeat.memory``). Tolerant: an API
    one version behind an agent ignores what it does not know."""

    level: MemoryLevel
    #: The memory the node has left, as the level was computed from it.
    available_bytes: JsonInt | None = Field(default=None, ge=0, le=MAX_REPORTED_BYTES)
    margin_bytes: JsonInt = Field(default=0, ge=0, le=MAX_REPORTED_BYTES)
    engines_rss_bytes: JsonInt = Field(default=0, ge=0, le=MAX_REPORTED_BYTES)
    gpu_free_bytes: JsonInt | None = Field(default=None, ge=0, le=MAX_REPORTED_BYTES)
    #: One sentence: what the level stands on.
    reason: str = Field(default="", max_length=1024)


class WatchState(Frozen):
    """The agent's previous levels: hysteresis needs them (rule 3)."""

    system: MemoryLevel = MemoryLevel.OK
    gpu: MemoryLevel = MemoryLevel.OK


def assess(sample: MemorySample, state: WatchState,
           tunables: WatchdogTunables) -> tuple[MemoryReport, WatchState]:
    """Rules 1-3 over one sample: the report to send, and the state to keep."""
    margin = margin_for(sample.total_bytes, tunables)
    system = memory_level(sample.available_bytes, state.system, margin_bytes=margin,
                          tunables=tunables)
    gpu_margin = tunables.watchdog_gpu_margin_bytes
    gpu = memory_level(sample.gpu_free_bytes, state.gpu, margin_bytes=gpu_margin,
                       tunables=tunables)
    level = worst(system, gpu)
    parts = []
    if sample.available_bytes is not None:
        parts.append(f"{format_gib(sample.available_bytes)} available, margin "
                     f"{format_gib(margin)} (engines hold "
                     f"{format_gib(sample.engines_rss_bytes)} resident): {system.value}")
    else:
        parts.append(f"available memory unreadable: {system.value} kept")
    if sample.gpu_free_bytes is not None:
        parts.append(f"least free GPU memory {format_gib(sample.gpu_free_bytes)}, margin "
                     f"{format_gib(gpu_margin)}: {gpu.value}")
    report = MemoryReport(level=level, available_bytes=sample.available_bytes,
                          margin_bytes=margin, engines_rss_bytes=sample.engines_rss_bytes,
                          gpu_free_bytes=sample.gpu_free_bytes, reason="; ".join(parts))
    return report, WatchState(system=system, gpu=gpu)


class ProtectCandidate(Frozen):
    """A replica claiming on a critical node, as the victim choice reads it."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    capacity_class: CapacityClass | None = None
    policy: ScalingPolicy | None = None
    #: What it claims on this node.
    memory_bytes: int = 0

    @property
    def runs_as(self) -> CapacityClass:
        return effective_class(self.capacity_class, self.policy)


def choose_victim(candidates: Iterable[ProtectCandidate]) -> ProtectCandidate | None:
    """Rule 4: the replica a critical node stops; None when it runs none."""
    return min(candidates, default=None,
               key=lambda c: (CLASS_RANK[c.runs_as], -c.memory_bytes, c.replica_id))


def action_due(last_action_at: datetime | None, now: datetime, interval_s: float) -> bool:
    """Rule 5: whether a node whose watchdog last stopped a replica at ``last_action_at``
    (None: never) may stop another at ``now``."""
    return last_action_at is None or now - last_action_at >= timedelta(seconds=interval_s)


def protect_reason(node_name: str, report: MemoryReport, victim: ProtectCandidate) -> str:
    """The victim's status reason: which node, what it measured, why this replica."""
    return (f"memory critical on node {node_name}: {report.reason}; stopped "
            f"{victim.replica_id} ({victim.runs_as.value}, the lowest class there, "
            f"claiming {format_gib(victim.memory_bytes)})")


class OomKill(Tolerant):
    """An engine the kernel or its cgroup killed for memory (with evidence:
    :func:`~modelkeeper.domain.shards.classify_exit`), with the most it was seen to hold
    resident. Sent with heartbeats until one is answered; Tolerant for version skew."""

    replica_id: ReplicaId
    model_id: ModelId
    peak_rss_bytes: JsonInt = Field(ge=0, le=MAX_REPORTED_BYTES)
    detail: str = Field(default="", max_length=1024)


class Calibration(Frozen):
    """What a model was measured to take: its largest peak at an OOM kill."""

    model_id: ModelId
    peak_rss_bytes: int
    oom_kills: int
    last_at: datetime | None = None


def calibrated_memory(catalog_bytes: int, calibration: Calibration | None, *,
                      margin: float) -> int:
    """Rule 6: the memory a replica of a model is claimed at."""
    if calibration is None:
        return catalog_bytes
    return max(catalog_bytes, int(calibration.peak_rss_bytes * margin))


def with_calibration(model: CatalogModel, calibration: Calibration | None, *,
                     margin: float) -> CatalogModel:
    """``model`` as placement claims it: its memory raised by rule 6."""
    memory = calibrated_memory(model.memory_bytes, calibration, margin=margin)
    if memory == model.memory_bytes:
        return model
    return model.model_copy(update={"memory_bytes": memory})


class CalibrationView(Frozen):
    """A model's calibration as ``explain`` and ``GET /models/{id}`` show it."""

    peak_rss_bytes: int
    oom_kills: int
    last_at: datetime | None
    #: What a replica of the model claims now: max(catalog, peak x margin).
    claimed_bytes: int
    note: str


def calibration_view(catalog_bytes: int, calibration: Calibration, *,
                     margin: float) -> CalibrationView:
    """What to show of ``calibration`` for a model of ``catalog_bytes``."""
    return CalibrationView(
        peak_rss_bytes=calibration.peak_rss_bytes, oom_kills=calibration.oom_kills,
        last_at=calibration.last_at,
        claimed_bytes=calibrated_memory(catalog_bytes, calibration, margin=margin),
        note=calibration_note(catalog_bytes, calibration, margin=margin))


def calibration_note(catalog_bytes: int, calibration: Calibration, *, margin: float) -> str:
    """One line for ``explain`` and the model's view."""
    claimed = calibrated_memory(catalog_bytes, calibration, margin=margin)
    return (f"killed for memory {calibration.oom_kills} time(s) at up to "
            f"{format_gib(calibration.peak_rss_bytes)} resident; claimed at "
            f"{format_gib(claimed)} (catalog {format_gib(catalog_bytes)}, peak x {margin:g})")

