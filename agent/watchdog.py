"""The agent's memory watchdog: on every heartbeat, measure the memory the node really has
left and say how close it is to running out (the rules are
:mod:`modelkeeper.domain.watchdog`'s; this module only measures).

What "available" is:

* the machine's MemAvailable (``/proc/meminfo``), always;
* on a node that declares its memory (``--memory``), also the declaration less what its
  engines hold resident (each engine's process tree, summed), whichever is less. A node
  declaring 16 GiB on a 64 GiB machine runs out at 16 GiB, whatever the machine has: so a
  test crosses the line with a sim engine that grows by a few hundred MB, and a shared
  machine's other work does not make one node's level move.

GPU memory: the least free memory of any GPU, read with ``nvidia-smi`` where it is
installed. Untested on a GPU here (no GPU on the machines the suite runs on).

Engines killed for memory (:attr:`agent.shards.ShardManager.memory_kills`) are reported
with the largest resident memory the watchdog saw them hold, until a heartbeat carrying
them is answered: the API raises the model's claim from it (OOM calibration).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from modelkeeper.domain.ids import ModelId, ReplicaId
from modelkeeper.domain.shards import ShardReport
from modelkeeper.domain.tunables import WatchdogTunables
from modelkeeper.domain.watchdog import (
    MemoryReport,
    MemorySample,
    OomKill,
    WatchState,
    assess,
)

from .inventory import MEMINFO, parse_meminfo

#: nvidia-smi answers in well under a second; one that hangs must not hold a heartbeat
#: (the inventory's own query allows the same).
GPU_QUERY_TIMEOUT_S = 10
#: The most memory kills one heartbeat carries: each is a few hundred bytes, and a node
#: whose engines die in a loop must not grow its heartbeats without bound (the oldest are
#: dropped; the calibration keeps the largest peak anyway).
MAX_PENDING_KILLS = 32
#: How far up the process tree :func:`trees_rss` looks for an engine: engines start
#: workers a level or two deep (vLLM's, a sidecar's); 64 is far past any of them.
MAX_TREE_DEPTH = 64


def tree_rss(pid: int) -> int:
    """Resident memory of process ``pid`` and its descendants (an engine's sidecars and
    workers); 0 for a process that is gone or not ours to read."""
    return trees_rss([pid])[pid]


def trees_rss(pids: Iterable[int]) -> dict[int, int]:
    """:func:`tree_rss` of each of ``pids`` from one pass over the machine's processes
    (psutil's ``children`` walks them all for every call: once per engine at every
    heartbeat would be one walk per engine)."""
    wanted = set(pids)
    if not wanted:
        return {}
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for proc in psutil.process_iter(["ppid", "memory_info"]):
        info = proc.info
        if info["memory_info"] is None:
            continue  # not ours to read, or gone meanwhile
        parent[proc.pid] = info["ppid"] or 0
        rss[proc.pid] = info["memory_info"].rss
    totals = dict.fromkeys(wanted, 0)
    for pid, resident in rss.items():
        # Climb to the first wanted ancestor (the process itself included): an engine's
        # workers count towards it. Bounded: a pid table has no cycles, but a reused pid
        # read mid-change must not loop.
        node, hops = pid, 0
        while node not in wanted and node > 1 and hops < MAX_TREE_DEPTH:
            node, hops = parent.get(node, 0), hops + 1
        if node in wanted:
            totals[node] += resident
    return totals


def read_gpu_free() -> int | None:
    """The least free memory of any GPU (bytes), or None: no nvidia-smi, no GPU, or an
    answer it cannot read. Untested on a GPU here."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpu_free(out)


def parse_gpu_free(csv_text: str) -> int | None:
    """The least of nvidia-smi's ``memory.free`` lines (MiB), in bytes."""
    free = [int(float(line.strip())) << 20 for line in csv_text.splitlines()
            if line.strip().replace(".", "", 1).isdigit()]
    return min(free, default=None)


def read_machine_memory(meminfo: Path = MEMINFO) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) of the machine; None where unreadable."""
    try:
        return parse_meminfo(meminfo.read_text())
    except OSError:
        return None, None


def node_sample(*, declared_memory: int | None, engines_rss: int,
                machine: tuple[int | None, int | None], gpu_free: int | None) -> MemorySample:
    """What the node has left (see the module docstring), from what was read."""
    total, available = machine
    if declared_memory is not None:
        left = max(0, declared_memory - engines_rss)
        available = left if available is None else min(available, left)
        total = declared_memory
    return MemorySample(available_bytes=available, total_bytes=total,
                        engines_rss_bytes=engines_rss, gpu_free_bytes=gpu_free)


class Watchdog:
    """One node's watchdog: its levels (for hysteresis), the peaks its engines reached,
    and the memory kills not yet reported."""

    def __init__(self, tunables: WatchdogTunables, *, declared_memory: int | None,
                 gpu_free: Callable[[], int | None] = read_gpu_free,
                 meminfo: Path = MEMINFO) -> None:
        self.tunables = tunables
        self.declared_memory = declared_memory
        self._gpu_free = gpu_free
        self._meminfo = meminfo
        self.state = WatchState()
        self.peaks: dict[ReplicaId, int] = {}
        self.pending_kills: list[OomKill] = []

    def check(self, shards: Iterable[ShardReport]) -> MemoryReport:
        """Measure once (each engine's resident memory, the machine's, the GPUs') and
        return the level to report; keeps each engine's peak."""
        running = [s for s in shards if s.pid > 0]
        by_pid = trees_rss(s.pid for s in running)
        rss: dict[ReplicaId, int] = {}
        for shard in running:
            rss[shard.replica_id] = rss.get(shard.replica_id, 0) + by_pid.get(shard.pid, 0)
        for replica_id, now in rss.items():
            self.peaks[replica_id] = max(now, self.peaks.get(replica_id, 0))
        sample = node_sample(declared_memory=self.declared_memory,
                             engines_rss=sum(rss.values()),
                             machine=read_machine_memory(self._meminfo),
                             gpu_free=self._gpu_free())
        report, self.state = assess(sample, self.state, self.tunables)
        # Peaks of engines no longer running are kept only until their kill is taken.
        self.peaks = {r: p for r, p in self.peaks.items() if r in rss}
        return report

    def take_kills(self, kills: list[tuple[ReplicaId, ModelId, str]]) -> None:
        """Engines killed for memory (replica, model, detail) since the last heartbeat:
        queued for the next ones with the peak seen. Call before :meth:`check`, which
        forgets the peaks of engines that are gone."""
        for replica_id, model_id, detail in kills:
            self.pending_kills.append(OomKill(
                replica_id=replica_id, model_id=model_id,
                peak_rss_bytes=self.peaks.get(replica_id, 0), detail=detail[:1024]))
        del self.pending_kills[:-MAX_PENDING_KILLS]

    def kills_reported(self, sent: int) -> None:
        """The first ``sent`` pending kills reached the API: drop them."""
        del self.pending_kills[:sent]
