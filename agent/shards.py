"""The shards an agent runs: start, watch, stop, and adoption across agent restarts.

Every engine is a process group of its own. Its spec and identity (pid, start time, port)
are written to the agent's data dir before the agent waits on it, so an agent that
restarts can tell its own still-running engines from strangers: it adopts the first and
kills the second. An engine nobody can describe still holds memory that placement thinks
is free, which is worse than no engine at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import psutil

from modelkeeper.domain.engine_keys import derive_engine_key
from modelkeeper.domain.engine_logs import exit_detail, failure_detail
from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.log_reads import EngineLogChunk, EngineLogRequest
from modelkeeper.domain.shards import (
    ExitKind,
    FetchProgress,
    ShardEndpoint,
    ShardExit,
    ShardReport,
    ShardSpec,
    ShardState,
    classify_exit,
)
from modelkeeper.domain.sources import SourcePolicy
from modelkeeper.domain.start_progress import StartProgress
from modelkeeper.infra.processes import LOG_DRAIN_TIMEOUT_S, signal_group

from .engine_process import (
    NODE_ENV,
    POLL_INTERVAL_S,
    REPLICA_ENV,
    ChildEngine,
    EngineLauncher,
    ExitSignal,
    LiveShard,
    ShardRecord,
    read_log_tail,
    read_oom_kills,
)
from .engines.base import EngineAdapter, adapter_for
from .inventory import read_available_memory
from .links import LinkWatch
from .log_reader import read_engine_log
from .shard_sleep import ShardSleep
from .shard_startup import QueuedCallback, ShardStartup
from .startup_gate import StartupGate

log = logging.getLogger(__name__)


#: A rank cut off from rank 0 is stopped as a failed start is: its engine is of no use
#: and its collectives would hang, so a short grace.
LINK_LOST_STOP_GRACE_S = 5.0
#: Ends whose cause the engine's log may name (modelkeeper/domain/engine_logs.py). Not a
#: clean exit, nor an OOM kill, whose cause is known already.
LOG_NAMES_THE_CAUSE = frozenset({ExitKind.ERROR, ExitKind.SIGNALLED, ExitKind.VANISHED})

_KERNEL_OOM = re.compile(r"Killed process (\d+)|oom-kill:.*?pid=(\d+)")


def kernel_oom_pids() -> frozenset[int]:
    """Pids the kernel's OOM killer named in its log, where the log is readable."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    pids = set()
    for match in _KERNEL_OOM.finditer(out):
        pids.add(int(match.group(1) or match.group(2)))
    return frozenset(pids)


def _wait_for_log_writer(record: ShardRecord) -> None:
    """Until the log filter of an adopted engine that ended has written its last lines
    (LOG_DRAIN_TIMEOUT_S at most): it is no child of ours, so it is watched by pid."""
    if record.log_writer_pid is None or record.log_writer_create_time is None:
        return
    if not _process_matches(record.log_writer_pid, record.log_writer_create_time):
        return
    try:
        psutil.Process(record.log_writer_pid).wait(LOG_DRAIN_TIMEOUT_S)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        return


def _signal(live: LiveShard, sig: int) -> None:
    """``sig`` to the shard's engine: through its handle when this agent launched it, to
    its recorded process group when it was adopted."""
    if live.proc is not None:
        live.proc.signal(sig)
    else:
        signal_group(live.record.pid, sig)


def _process_matches(pid: int, create_time: float) -> bool:
    """True when ``pid`` is alive and is the same process we started (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return bool(abs(proc.create_time() - create_time) < 1.0
                    and proc.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class ShardManager:
    """Runs this node's engines."""

    def __init__(self, *, node_id: NodeId, agent_dir: Path, engine_host: str,
                 port_range: tuple[int, int], node_key: str | None = None,
                 llama_server_path: Path | None = None,
                 adapter_factory: Callable[[ShardSpec], EngineAdapter] | None = None,
                 max_concurrent_startups: int = 1,
                 available_memory: Callable[[], int | None] = read_available_memory,
                 launcher: EngineLauncher = ChildEngine,
                 http: httpx.AsyncClient | None = None,
                 source_policy: SourcePolicy | None = None,
                 ) -> None:
        """``node_key``: the key the API handed this node at registration, from which each
        engine's key is derived (None until then: see :meth:`use_node_key`).
        ``available_memory`` reads the node's free memory (capped by what it declares)
        for the fit check after the start-up queue; None from it skips the check.
        ``launcher`` makes each engine (a child process unless the fleet mode serves it
        in-process); ``http``: the client for readiness probes, shared by the managers of a
        fleet (one of its own otherwise, closed by :meth:`close`). ``source_policy``: what
        weights may be fetched from; read from this process's settings when None (24 ms,
        which a fleet of a thousand nodes does once)."""
        self.node_id = node_id
        self._logs = agent_dir / "logs"
        self._records = agent_dir / "shards"
        self._node_key = node_key
        self._shards: dict[ReplicaId, LiveShard] = {}
        #: Engines killed for memory with evidence, since the watchdog last took them
        #: (agent.watchdog: it adds the peak it saw and reports them for calibration).
        self.memory_kills: list[tuple[ShardSpec, ShardExit]] = []
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        self._gate = StartupGate(max_concurrent_startups)
        self._startup = ShardStartup(
            self, node_id=node_id, agent_dir=agent_dir, engine_host=engine_host,
            port_range=port_range,
            adapter_factory=adapter_factory or (
                lambda spec: adapter_for(spec.engine, llama_server_path=llama_server_path)),
            gate=self._gate, available_memory=available_memory, launcher=launcher,
            http=self._http, source_policy=source_policy)
        self._sleep = ShardSleep(self, gate=self._gate, available_memory=available_memory,
                                 http=self._http)

    async def close(self) -> None:
        """Release the HTTP client. Engines keep running: a restarted agent adopts them."""
        if self._owns_http:
            await self._http.aclose()

    def use_node_key(self, node_key: str) -> None:
        """Derive engine keys from ``node_key`` from now on (each registration hands one)."""
        self._node_key = node_key

    # -- the table the start-up path adds to (agent.shard_startup.ShardTable) ------------

    @property
    def running(self) -> Mapping[ReplicaId, LiveShard]:
        return self._shards

    def engine_key(self, replica_id: ReplicaId) -> str:
        if self._node_key is None:
            # The worker that runs starts polls only after registration: a programming error.
            raise RuntimeError(f"node {self.node_id} has no node key yet: it must register "
                               "before it starts engines")
        return derive_engine_key(self._node_key.encode(), replica_id)

    # -- persistence and adoption --------------------------------------------------------

    def _record_path(self, replica_id: ReplicaId) -> Path:
        return self._records / f"{replica_id}.json"

    def add(self, live: LiveShard) -> None:
        self.save(live.record)
        self._shards[live.record.spec.replica_id] = live

    def save(self, record: ShardRecord) -> None:
        self._records.mkdir(parents=True, exist_ok=True)
        path = self._record_path(record.spec.replica_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json())
        tmp.replace(path)

    def forget(self, replica_id: ReplicaId) -> None:
        self._shards.pop(replica_id, None)
        self._record_path(replica_id).unlink(missing_ok=True)
        # An engine that is gone loads nothing: its slot passes to the next in line.
        self._gate.leave(replica_id)

    def recover(self) -> tuple[list[ReplicaId], list[int]]:
        """Adopt recorded engines still running; kill our engines nobody recorded.

        Returns (adopted replica ids, pids killed).
        """
        adopted: list[ReplicaId] = []
        for path in sorted(self._records.glob("*.json")) if self._records.exists() else []:
            try:
                record = ShardRecord.model_validate_json(path.read_text())
            except ValueError:
                log.warning("unreadable shard record %s; removing it", path)
                path.unlink(missing_ok=True)
                continue
            if _process_matches(record.pid, record.create_time):
                self._shards[record.spec.replica_id] = LiveShard(record=record, proc=None)
                adopted.append(record.spec.replica_id)
                log.info("adopted %s (pid %d, port %d)", record.spec.replica_id, record.pid,
                         record.port)
            else:
                path.unlink(missing_ok=True)
        known = {s.record.pid for s in self._shards.values()}
        killed = []
        for proc in psutil.process_iter(["pid"]):
            try:
                env = proc.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if env.get(NODE_ENV) != self.node_id:
                continue
            try:
                pgid = os.getpgid(proc.pid)
            except ProcessLookupError:
                continue
            if proc.pid in known or pgid in known:
                continue  # an adopted engine or one of its own children
            log.warning("killing unidentified engine pid %d (replica %s)", proc.pid,
                        env.get(REPLICA_ENV, "?"))
            signal_group(pgid, signal.SIGKILL)
            killed.append(proc.pid)
        return adopted, killed

    # -- start ---------------------------------------------------------------------------

    async def start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                    on_queued: QueuedCallback | None = None,
                    answer_within_s: float | None = None) -> ShardEndpoint:
        """Start ``spec`` and return once it is ready; idempotent per replica id. The
        start-up path (:meth:`agent.shard_startup.ShardStartup.start`) says how."""
        return await self._startup.start(spec, on_progress, on_queued=on_queued,
                                         answer_within_s=answer_within_s)

    # -- sleep and wake ------------------------------------------------------------------

    async def sleep(self, replica_id: ReplicaId) -> None:
        """Free the engine's KV cache, keep its weights; never delayed, idempotent. The
        rules are :mod:`agent.shard_sleep`'s."""
        await self._sleep.sleep(replica_id)

    async def wake(self, replica_id: ReplicaId, heartbeat: Callable[[], None], *,
                   answer_within_s: float | None = None) -> None:
        """Take the KV cache back after the node's start-up gate; idempotent
        (:meth:`agent.shard_sleep.ShardSleep.wake`)."""
        await self._sleep.wake(replica_id, heartbeat, answer_within_s=answer_within_s)

    # -- watch and stop ------------------------------------------------------------------

    def poll_exit(self, live: LiveShard) -> ShardExit | None:
        if live.exit is not None:
            return live.exit
        record = live.record
        if live.proc is not None:
            code = live.proc.poll()
            if code is None:
                return None
            # Sidecars die with the engine: the group goes, not just its leader.
            live.proc.signal(signal.SIGKILL)
            # Before the tail is read: its last lines may still be in the log filter.
            live.proc.reap()
        elif _process_matches(record.pid, record.create_time):
            return None
        else:
            code = None
            _wait_for_log_writer(record)
        oom_pids = kernel_oom_pids() if code == -signal.SIGKILL else frozenset()
        kind, detail = classify_exit(code, oom_kills_before=record.oom_kills_at_start,
                                     oom_kills_after=read_oom_kills(),
                                     kernel_oom_pids=oom_pids, pid=record.pid)
        tail = read_log_tail(Path(record.log_path))
        if kind in LOG_NAMES_THE_CAUSE:
            # "exited with code 1: the GPU ran out of memory (log: '...')".
            detail = exit_detail(detail, tail)
        if kind is ExitKind.ERROR:
            # It exited by itself: its log says why. Its last line (unless a known fatal
            # line is named already) and where the whole log is, for a start that failed
            # and an engine that exited after it was ready alike.
            detail = failure_detail(detail, tail, log_path=record.log_path, node=self.node_id,
                                    replica_id=record.spec.replica_id)
        live.exit = ShardExit(
            replica_id=record.spec.replica_id, kind=kind,
            exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            detail=detail, log_tail=tail)
        if kind is ExitKind.OOM_KILLED:
            self.memory_kills.append((record.spec, live.exit))
        return live.exit

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit:
        """Return when the engine ends, heartbeating meanwhile."""
        live = self._shards.get(replica_id)
        if live is None:
            return ShardExit(replica_id=replica_id, kind=ExitKind.UNKNOWN_SHARD,
                             detail=f"node {self.node_id} runs no shard {replica_id}")
        live.watchers += 1
        live.unwatched_since = None
        link = LinkWatch.of(live.record.spec)
        exited = ExitSignal(live.record.pid)
        try:
            while True:
                ended = self.poll_exit(live)
                if ended is not None:
                    self.forget(replica_id)
                    return ended
                heartbeat()
                lost = None if link is None else await link.poll(time.monotonic())
                if lost is not None:
                    log.warning("%s: %s; stopping it", replica_id, lost)
                    stopped = await self.stop(replica_id, grace_s=LINK_LOST_STOP_GRACE_S)
                    return stopped.model_copy(update={"kind": ExitKind.LINK_LOST,
                                                      "detail": lost})
                await exited.wait(POLL_INTERVAL_S)
        finally:
            exited.close()
            live.watchers -= 1
            if live.watchers == 0:
                live.unwatched_since = time.monotonic()

    async def stop(self, replica_id: ReplicaId, grace_s: float) -> ShardExit:
        """SIGTERM the engine's group, SIGKILL it after ``grace_s``; harmless if gone.

        Never waits for the start-up gate. A start still queued there is taken out of the
        queue at once: its engine was never launched, and its start fails as stopped. A
        wake queued there is taken out too (it fails as stopped), and its engine, which
        runs asleep, is stopped.
        """
        # Stopped on request: the replica is not relaunched here, its port need not wait.
        self._startup.forget_port(replica_id)
        if self._gate.remove_waiter(replica_id) and replica_id not in self._shards:
            log.info("%s stopped while queued at the start-up gate", replica_id)
            return ShardExit(replica_id=replica_id, kind=ExitKind.STOPPED,
                             detail="stopped on request while queued at the start-up gate "
                                    "(never launched)")
        live = self._shards.get(replica_id)
        if live is None:
            return ShardExit(replica_id=replica_id, kind=ExitKind.UNKNOWN_SHARD,
                             detail=f"node {self.node_id} runs no shard {replica_id}")
        if self.poll_exit(live) is None:
            _signal(live, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.poll_exit(live) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            _signal(live, signal.SIGKILL)
            while self.poll_exit(live) is None:
                await asyncio.sleep(0.05)
        if live.proc is not None:
            live.proc.reap()
        ended = live.exit
        assert ended is not None
        self.forget(replica_id)
        return ended.model_copy(update={"kind": ExitKind.STOPPED,
                                        "detail": f"stopped on request ({ended.detail})"})

    async def stop_all(self, grace_s: float) -> list[ShardExit]:
        """Stop every engine this agent runs, and every start queued at the gate, all at
        once: each gets SIGTERM and ``grace_s`` to exit, so the whole stop takes about
        ``grace_s`` however many engines there are.

        Only for an agent that takes its node out for good (``--stop-engines-on-exit``): a
        plain exit leaves engines for the next agent to adopt.
        """
        replica_ids = [report.replica_id for report in self.reports()]
        return list(await asyncio.gather(*(self.stop(rid, grace_s=grace_s)
                                           for rid in replica_ids)))

    def reports(self) -> list[ShardReport]:
        """What this agent runs, for registration and `list_shards` (a sleeping one
        waiting at the start-up gate to wake with its place there); then the starts
        queued at the gate, in queue order (starting, no process yet)."""
        # A running shard in the gate's queue is a wake waiting its turn.
        positions = self._gate.positions()
        running = [
            ShardReport(replica_id=s.record.spec.replica_id, model_id=s.record.spec.model_id,
                        rank=s.record.spec.rank, state=s.record.state, port=s.record.port,
                        pid=s.record.pid, url=s.record.url, adopted=s.adopted,
                        sleeping=s.record.sleeping,
                        queued_position=positions.get(s.record.spec.replica_id))
            for s in self._shards.values() if self.poll_exit(s) is None
        ]
        queued = [
            ShardReport(replica_id=rid, model_id=spec.model_id, rank=spec.rank,
                        state=ShardState.STARTING, port=0, pid=0, url=None, adopted=False,
                        queued_position=position)
            for rid, position in self._gate.positions().items()
            if (spec := self._startup.queued.get(rid)) is not None
        ]
        return running + queued

    def read_log(self, request: EngineLogRequest) -> EngineLogChunk:
        """Lines of an engine's log here, for `modelkeeper logs` (agent.log_reader)."""
        return read_engine_log(self._logs, self.node_id, request)

    def start_progress(self) -> list[StartProgress]:
        """The progress of each start under way here (fetching, queued, launching,
        loading), for the heartbeat."""
        return list(self._startup.progress.values())

    async def stop_unclaimed(self, claimed: set[ReplicaId], *,
                             ran_before: float) -> list[ReplicaId]:
        """Stop the shards whose replicas hold no claim on this node, as the control plane
        answered a heartbeat sent at ``ran_before`` (monotonic). Only shards this agent
        ran before that heartbeat left: one launched since may belong to a placement that
        committed after the answer was read. A partition's victims (released and replaced
        elsewhere while the node was cut off) stop here at once, instead of holding memory
        without a claim until the orphan reaper's grace has passed."""
        gone = [rid for rid, s in self._shards.items()
                if rid not in claimed and s.since < ran_before and s.exit is None]
        for rid in gone:
            log.warning("stopping %s: the control plane holds no claim for it on this node "
                        "(released while the node was unreachable, or its stop was lost)",
                        rid)
            await self.stop(rid, grace_s=5.0)
        return gone

    async def reap_orphans(self, grace_s: float) -> list[ReplicaId]:
        """Stop ready shards nobody has watched for ``grace_s``: the control plane has
        given up on them (declared them lost and placed them elsewhere)."""
        now = time.monotonic()
        stale = [rid for rid, s in self._shards.items()
                 if s.watchers == 0 and s.unwatched_since is not None
                 and s.record.state is ShardState.READY and now - s.unwatched_since > grace_s]
        for rid in stale:
            log.warning("stopping %s: unwatched for over %.0fs", rid, grace_s)
            await self.stop(rid, grace_s=5.0)
        return stale
