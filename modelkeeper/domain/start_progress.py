"""A start's progress, carried from its agent to where people look (the API, ``ls``).

A start passes through phases on its node (:mod:`agent.shard_startup`): ``fetching``
(the weights download; ``cached`` when they were there already), ``queued`` (waiting its
turn at the node's start-up gate), ``launching``, ``loading`` (the engine runs and is
probed until ready). The agent keeps each start's latest :class:`StartProgress` and sends
them with its heartbeat; the API keeps the latest per replica (``replica_progress``,
migration 0028) and shows it in :class:`ReplicaProgress` while the replica is starting.

How often progress is written (one home for the numbers, :data:`PROGRESS_MIN_WRITE_GAP_S`):
at most once per heartbeat (2 s by default, ``heartbeat_interval_s``), and then only when
it changed, and no more than once per :data:`PROGRESS_MIN_WRITE_GAP_S` per replica unless
its phase changed (at most five phase changes per start). A 100-replica rollout downloading
at once is then at most 100 small upserts a second, on a table without the NOTIFY
trigger of ``replicas`` (the gateways do not re-read routes for it).

Pure: the rate (:func:`download_rate`) takes its samples' times as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import Field

from .base import Frozen, Tolerant
from .ids import NodeId, ReplicaId
from .units import GIB, KIB, MIB

#: The phases a start shows, in the order it passes them. ``cached``: the weights were on
#: the node already (no download).
PHASES = ("fetching", "cached", "queued", "launching", "loading")
#: The phase a start waiting at its node's start-up gate shows; ``ls`` and the views show
#: such a replica as ``queued`` rather than ``starting`` (README,
#: MODELKEEPER_MAX_CONCURRENT_STARTUPS).
QUEUED = "queued"

#: A replica's progress is written at most this often (plus once per phase change): a
#: download's bytes change on every heartbeat, and a person reads a line at most about
#: once a second. With the default 2 s heartbeat it never binds; it caps the writes of an
#: agent whose heartbeat_interval_s is set low.
PROGRESS_MIN_WRITE_GAP_S = 1.0
#: An unchanged progress (a long wait in the queue) is written again after this long, so
#: that it stays fresh (:data:`PROGRESS_FRESH_S`).
PROGRESS_REFRESH_S = 4.0
#: Progress is shown only while this fresh: an agent that stopped reporting a start (it
#: ended, or the node went quiet) leaves no stale "downloading 40 %" behind. Five default
#: heartbeats; an API whose agents heartbeat slower shows it for three of theirs.
PROGRESS_FRESH_S = 10.0
#: The download rate is the mean over the last this many seconds: long enough to smooth
#: the bursts of a 1 MiB chunk, short enough to follow a stall within a few heartbeats.
RATE_WINDOW_S = 5.0
#: A start's progress names at most this many replicas it waits for (the slots of the
#: node's start-up gate; 1 by default).
MAX_WAITING_FOR = 8


class StartProgress(Tolerant):
    """One start's progress as its agent reports it (heartbeat ``starts``). Tolerant: an
    agent one version ahead may add a field."""

    replica_id: ReplicaId
    rank: int = Field(default=0, ge=0)
    #: One of :data:`PHASES` (a newer agent may say another word; it is shown as said).
    phase: str = Field(max_length=32)
    bytes_done: int | None = Field(default=None, ge=0)
    #: None when the server did not say: no percentage is invented.
    bytes_total: int | None = Field(default=None, ge=0)
    rate_bytes_per_s: float | None = Field(default=None, ge=0)
    #: Queued: its place in line at the start-up gate, 1 is next.
    queue_position: int | None = Field(default=None, ge=1)
    #: Queued: the replicas loading now, whose slots it waits for.
    waiting_for: list[ReplicaId] = Field(default_factory=list, max_length=MAX_WAITING_FOR)


class ReplicaProgress(Frozen):
    """A starting replica's progress as the API shows it (``ReplicaView.progress``)."""

    #: One of :data:`PHASES`.
    phase: str
    #: The node whose agent reported it (a replica of several shards: the last to report).
    node_id: NodeId
    rank: int = 0
    bytes_done: int | None = None
    bytes_total: int | None = None
    #: 0-100, one decimal; None without a total.
    percent: float | None = None
    rate_bytes_per_s: float | None = None
    queue_position: int | None = None
    waiting_for: list[ReplicaId] = Field(default_factory=list)
    #: The line ``ls`` shows, e.g. "downloading 45.2 MiB of 98.0 MiB (46.1 %), 3.1 MiB/s".
    summary: str
    #: When its agent reported it.
    updated_at: datetime


def percent(done: int | None, total: int | None) -> float | None:
    """``done`` of ``total`` in per cent, one decimal; None without a total (or of 0)."""
    if done is None or not total:
        return None
    return round(min(100.0, 100.0 * done / total), 1)


def download_rate(samples: Sequence[tuple[float, int]]) -> float | None:
    """Bytes per second over ``samples`` (time in seconds, bytes done so far), oldest
    first; None with fewer than two samples or no time between them."""
    if len(samples) < 2:
        return None
    (t0, b0), (t1, b1) = samples[0], samples[-1]
    if t1 <= t0:
        return None
    return max(0.0, (b1 - b0) / (t1 - t0))


def keep_window(samples: Sequence[tuple[float, int]], now: float, done: int, *,
                window_s: float = RATE_WINDOW_S) -> tuple[tuple[float, int], ...]:
    """``samples`` with ``(now, done)`` added and those older than ``window_s`` dropped,
    keeping one older than the window so the rate spans it whole."""
    kept = [*samples, (now, done)]
    while len(kept) > 2 and kept[1][0] <= now - window_s:
        kept.pop(0)
    return tuple(kept)


def format_bytes(n: int) -> str:
    """A byte count for a progress line: "512 B", "3.4 KiB", "45.2 MiB", "1.50 GiB"."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{n} B"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def summary(progress: StartProgress, node: str) -> str:
    """The progress as a line for a person, naming what the start waits for; ``node``:
    the node's name (or id)."""
    match progress.phase:
        case "fetching":
            done = progress.bytes_done or 0
            text = f"downloading {format_bytes(done)}"
            if progress.bytes_total is not None:
                text += (f" of {format_bytes(progress.bytes_total)} "
                         f"({percent(done, progress.bytes_total)} %)")
            if progress.rate_bytes_per_s is not None:
                text += f", {format_bytes(int(progress.rate_bytes_per_s))}/s"
            return text + f" on {node}"
        case "cached":
            return f"weights cached on {node}"
        case "queued":
            place = ("in line" if progress.queue_position is None
                     else f"{ordinal(progress.queue_position)} in line")
            behind = (f", waiting for {', '.join(progress.waiting_for)} to load"
                      if progress.waiting_for else "")
            return f"queued {place} at {node}'s start-up gate{behind}"
        case "launching":
            return f"launching its engine on {node}"
        case "loading":
            return f"engine loading on {node}, waiting until it answers ready"
        case other:
            return f"{other} on {node}"


def shown(progress: StartProgress, *, node_id: NodeId, node_name: str,
          updated_at: datetime) -> ReplicaProgress:
    """The API's view of a stored progress; its summary names the node by ``node_name``."""
    return ReplicaProgress(
        phase=progress.phase, node_id=node_id, rank=progress.rank,
        bytes_done=progress.bytes_done, bytes_total=progress.bytes_total,
        percent=percent(progress.bytes_done, progress.bytes_total),
        rate_bytes_per_s=(None if progress.rate_bytes_per_s is None
                          else round(progress.rate_bytes_per_s, 1)),
        queue_position=progress.queue_position, waiting_for=list(progress.waiting_for),
        summary=summary(progress, node_name), updated_at=updated_at)
