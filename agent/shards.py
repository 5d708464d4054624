"""The shards an agent runs: start, watch, stop, and adoption across agent restarts.

Every engine is a process group of its own. Its spec and identity (pid, start time, port)
are written to the agent's data dir before the agent waits on it, so an agent that
restarts can tell its own still-running engines from strangers: it adopts the first and
kills the second. An engine nobody can describe still holds memory that placement thinks
is free, which is worse than no engine at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import httpx
import psutil
from pydantic import Field

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.engine_keys import derive_engine_key
from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.redact import scrub_secrets
from modelkeeper.domain.shards import (
    ExitKind,
    FetchProgress,
    ShardEndpoint,
    ShardExit,
    ShardReport,
    ShardSpec,
    ShardStartError,
    ShardState,
    choose_port,
    classify_exit,
)
from modelkeeper.domain.sources import SourcePolicy
from modelkeeper.infra.processes import (
    LOG_DRAIN_TIMEOUT_S,
    LOG_MODE,
    ManagedProcess,
    port_is_free,
    signal_group,
)

from .engines.base import EngineAdapter, adapter_for
from .fetch import FetchRefused, WeightFetcher, file_sha256, is_remote
from .inventory import read_available_memory
from .log_filter import filter_command, secret_values
from .startup_gate import (
    Admitted,
    Queued,
    Removed,
    StartupGate,
    TimedOut,
    check_fit,
    queue_limit_s,
)

log = logging.getLogger(__name__)

#: Environment markers on every engine: how a restarted agent recognises its own engines,
#: including ones whose record was lost.
NODE_ENV = "MODELKEEPER_NODE_ID"
REPLICA_ENV = "MODELKEEPER_REPLICA_ID"

#: What an engine inherits from the agent's environment, by exact name: what any process
#: needs (search paths, user, locale, temp dir, CA roots). Nothing else passes, above all
#: none of the agent's own MODELKEEPER_* settings (its join token among them).
INHERITED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR",
})
#: ... and by prefix: the locale's parts, and what GPU engines read to find devices,
#: libraries, compilers and model caches.
INHERITED_PREFIXES = ("LC_", "XDG_", "CUDA_", "NVIDIA_", "NCCL_", "HF_", "TRANSFORMERS_",
                      "TORCH", "TRITON_", "OMP_", "MKL_", "VLLM_", "SGLANG_")
#: A variable whose name holds one of these is never inherited, whatever its prefix
#: (``HF_TOKEN``, ``VLLM_API_KEY``): an engine gets its own key from its plan and no
#: other secret. Weights come through the agent's fetcher, which needs no engine-side
#: token.
SECRET_NAME_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "CREDENTIAL")

#: The engines' log folder: the agent's user and its group (the operators) may list it,
#: nobody else. Each log in it is :data:`~modelkeeper.infra.processes.LOG_MODE`.
LOG_FOLDER_MODE = 0o750
#: The watch reports the end of an engine with this many of its last log lines.
LOG_TAIL_LINES = 200
#: How often a start polls readiness and a watch polls the process; also how often a
#: queued start heartbeats.
POLL_INTERVAL_S = 0.25
#: A start that failed or was cancelled stops what it launched with this grace.
START_FAILED_STOP_GRACE_S = 5.0

#: Called while a start waits at the start-up gate: its place in the queue (1 is next)
#: and the replicas loading now.
QueuedCallback = Callable[[int, list[ReplicaId]], None]


class EngineProcess(Protocol):
    """One launched engine as the shard manager drives it: a process group of its own
    (:class:`ChildEngine`, what every real agent runs) or, in the agent's fleet mode, a sim
    served inside the agent (:mod:`agent.engines.sim_inprocess`).

    Every signal goes through :meth:`signal`, never to :attr:`pid` directly: an engine
    served in-process reports the agent's own pid, which must never be killed for it.
    """

    @property
    def pid(self) -> int: ...

    def start(self) -> None:
        """Launch it; it loads in the background."""
        ...

    def create_time(self) -> float:
        """When it started (seconds since the epoch), recorded so that a restarted agent
        can tell it from a process that reused its pid."""
        ...

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        ...

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the engine and everything it started; harmless once gone."""
        ...

    def reap(self) -> None:
        """Once it has exited: collect it, and wait (briefly) for the last of its output
        to reach its log. Harmless when called again."""
        ...

    @property
    def log_writer(self) -> tuple[int, float] | None:
        """The process writing its log, if not the engine itself: (pid, start time)."""
        ...


#: Makes the engine of a launch plan: (name, argv, log path, environment).
EngineLauncher = Callable[[str, list[str], Path, dict[str, str]], EngineProcess]


class ChildEngine:
    """An engine run as a child process in a group of its own (:class:`ManagedProcess`),
    its output written to its log through a log filter (:mod:`agent.log_filter`) that
    scrubs every secret, the values of the engine's own secret variables included."""

    def __init__(self, name: str, argv: list[str], log_path: Path,
                 env: dict[str, str]) -> None:
        filter_argv, filter_env = filter_command(
            sys.executable, env, secret_values(env, SECRET_NAME_WORDS))
        self._proc = ManagedProcess(name, argv, log_path, env=env, log_filter=filter_argv,
                                    log_filter_env=filter_env)
        self._reaped = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def log_writer(self) -> tuple[int, float] | None:
        """The log filter's pid and start time, recorded so that an agent that adopts
        the engine can wait for its log's last lines too."""
        filt = self._proc.filter_popen
        if filt is None:
            return None
        try:
            return filt.pid, float(psutil.Process(filt.pid).create_time())
        except psutil.Error:
            return None  # gone already: nothing to wait for

    def start(self) -> None:
        self._proc.start()

    def create_time(self) -> float:
        return float(psutil.Process(self.pid).create_time())

    def poll(self) -> int | None:
        return self._proc.poll()

    def signal(self, sig: int) -> None:
        if not self._reaped:  # once reaped, its group id may be another's
            signal_group(self.pid, sig)

    def reap(self) -> None:
        if not self._reaped:
            self._proc.stop(grace=0)
            self._reaped = True


class ShardRecord(Frozen):
    """What the agent writes to disk per shard, enough to adopt it after a restart."""

    spec: ShardSpec
    port: int
    pid: int
    create_time: float
    log_path: str
    url: str | None
    state: ShardState
    started_at: datetime
    oom_kills_at_start: int | None = None
    notes: list[str] = Field(default_factory=list)
    #: The log filter's pid and start time (see :mod:`agent.log_filter`): an agent that
    #: adopted the engine waits for it to end before it reads the log's tail.
    log_writer_pid: int | None = None
    log_writer_create_time: float | None = None


@dataclass
class LiveShard:
    """A shard this agent runs now."""

    record: ShardRecord
    proc: EngineProcess | None  # None when adopted: not our child, watched by polling
    exit: ShardExit | None = None
    watchers: int = 0
    unwatched_since: float | None = field(default_factory=time.monotonic)
    #: When this agent began to run it (launched or adopted), monotonic: see
    #: :meth:`ShardManager.stop_unclaimed`.
    since: float = field(default_factory=time.monotonic)

    @property
    def adopted(self) -> bool:
        return self.proc is None

    def endpoint(self, node_id: NodeId) -> ShardEndpoint:
        return ShardEndpoint(replica_id=self.record.spec.replica_id, node_id=node_id,
                             rank=self.record.spec.rank, url=self.record.url,
                             port=self.record.port, pid=self.record.pid,
                             adopted=self.adopted)


def read_oom_kills() -> int | None:
    """This cgroup's ``oom_kill`` count (cgroup v2), or None where it cannot be read."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        rel = line.split("::", 1)[1] if "::" in line else "/"
        events = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events"
        for entry in events.read_text().splitlines():
            key, _, value = entry.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


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


def engine_environment(parent: Mapping[str, str], plan_env: Mapping[str, str], *,
                       node_id: NodeId, replica_id: ReplicaId) -> dict[str, str]:
    """The whole environment of one engine: the allow-listed part of ``parent`` (the
    agent's), the plan's own variables (its key among them), and the markers that let a
    restarted agent recognise it. Never the agent's environment as a whole."""
    env = {
        name: value for name, value in parent.items()
        if (name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES))
        and not any(word in name.upper() for word in SECRET_NAME_WORDS)
    }
    return {**env, **plan_env, NODE_ENV: node_id, REPLICA_ENV: replica_id}


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` of an engine's log, secrets scrubbed: the tail leaves the node
    (in ShardExit, then Temporal's history and the audit log). The log filter scrubbed
    the log already; this is the second lock, for a log written before it existed."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            # 200 lines of engine logs rarely exceed 64 KiB; read no more than that.
            f.seek(max(0, size - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return scrub_secrets(text).splitlines()[-lines:]


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


def prepare_log_folder(folder: Path) -> None:
    """The engines' log folder, created if missing and closed to other users
    (:data:`LOG_FOLDER_MODE`, or tighter); each log in it tightened to
    :data:`~modelkeeper.infra.processes.LOG_MODE`, for logs an older agent left readable
    by all."""
    folder.mkdir(parents=True, exist_ok=True)
    mode = folder.stat().st_mode & 0o777
    if mode & ~LOG_FOLDER_MODE:
        folder.chmod(mode & LOG_FOLDER_MODE)
    for log_file in folder.glob("*.log"):
        with contextlib.suppress(OSError):
            file_mode = log_file.stat().st_mode & 0o777
            if file_mode & ~LOG_MODE:
                log_file.chmod(file_mode & LOG_MODE)


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
        self._records = agent_dir / "shards"
        self._logs = agent_dir / "logs"
        self._logs_prepared = False
        self._host = engine_host
        self._ports = port_range
        self._node_key = node_key
        self._fetcher = WeightFetcher(agent_dir / "weights", policy=source_policy)
        self._adapter_factory = adapter_factory or (
            lambda spec: adapter_for(spec.engine, llama_server_path=llama_server_path))
        self._shards: dict[ReplicaId, LiveShard] = {}
        self._locks: dict[ReplicaId, asyncio.Lock] = {}
        self._port_lock = asyncio.Lock()
        self._launcher = launcher
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        self._gate = StartupGate(max_concurrent_startups)
        self._available_memory = available_memory
        #: Starts waiting at the gate, for reports: they have no process yet.
        self._queued: dict[ReplicaId, ShardSpec] = {}

    async def close(self) -> None:
        """Release the HTTP client. Engines keep running: a restarted agent adopts them."""
        if self._owns_http:
            await self._http.aclose()

    def use_node_key(self, node_key: str) -> None:
        """Derive engine keys from ``node_key`` from now on (each registration hands one)."""
        self._node_key = node_key

    def _engine_key(self, replica_id: ReplicaId) -> str:
        if self._node_key is None:
            # The worker that runs starts polls only after registration: a programming error.
            raise RuntimeError(f"node {self.node_id} has no node key yet: it must register "
                               "before it starts engines")
        return derive_engine_key(self._node_key.encode(), replica_id)

    # -- persistence and adoption --------------------------------------------------------

    def _record_path(self, replica_id: ReplicaId) -> Path:
        return self._records / f"{replica_id}.json"

    def _save(self, record: ShardRecord) -> None:
        self._records.mkdir(parents=True, exist_ok=True)
        path = self._record_path(record.spec.replica_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(record.model_dump_json())
        tmp.replace(path)

    def _forget(self, replica_id: ReplicaId) -> None:
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

    def _lock(self, replica_id: ReplicaId) -> asyncio.Lock:
        return self._locks.setdefault(replica_id, asyncio.Lock())

    async def start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                    on_queued: QueuedCallback | None = None,
                    answer_within_s: float | None = None) -> ShardEndpoint:
        """Start ``spec`` and return once it is ready; idempotent per replica id.

        A new engine first fetches its weights, then waits its turn at the node's
        start-up gate (``on_queued`` is told its place meanwhile; without it, progress
        says "queued"), then its fit is checked again, and only then does it launch. Its
        start timeout counts from the launch. ``answer_within_s``: the time the caller
        gives this whole call (Temporal's start-to-close); it bounds the queue wait, so
        that the answer comes before the caller's own timeout (see
        :func:`agent.startup_gate.queue_limit_s`).

        Raises :class:`ShardStartError` when the engine exits or misses its start timeout,
        when it no longer fits, or when it waited too long or was stopped in the queue;
        in every case nothing of it is left running.
        """
        answer_by = None if answer_within_s is None else time.monotonic() + answer_within_s
        async with self._lock(spec.replica_id):
            live = self._shards.get(spec.replica_id)
            if live is not None and self._poll_exit(live) is not None:
                self._forget(spec.replica_id)
                live = None
            if live is None:
                spec = await self._fetch(spec, on_progress)
                await self._pass_gate(spec, on_progress, on_queued=on_queued,
                                      answer_by=answer_by)
                try:
                    live = await self._launch(spec, on_progress)
                except BaseException:
                    self._gate.leave(spec.replica_id)
                    raise
            elif live.record.state is ShardState.STARTING:
                # Launched before this call (adopted while loading): it loads already, so
                # it holds a slot without queueing. Adoption alone takes no slot: with
                # nobody bound to give it back, a slot held for an engine the keeper has
                # given up on would stall every start on the node.
                self._gate.occupy(spec.replica_id)
            try:
                await self._wait_ready(live, on_progress)
            except BaseException:
                # Covers cancellation too: a start the workflow gave up on must not linger.
                await self.stop(spec.replica_id, grace_s=START_FAILED_STOP_GRACE_S)
                raise
            finally:
                # Ready, failed or cancelled: it loads no more, the next in line may.
                self._gate.leave(spec.replica_id)
            return live.endpoint(self.node_id)

    async def _fetch(self, spec: ShardSpec,
                     on_progress: Callable[[FetchProgress], None]) -> ShardSpec:
        """Weights come before the queue: a download disturbs no engine's load. A local
        file with a catalog digest is checked here too (never removed: it is the
        operator's file, not our cache)."""
        if not is_remote(spec.source):
            local = Path(spec.source)
            if spec.sha256 is not None and local.is_file():
                actual = await asyncio.to_thread(file_sha256, local)
                if actual != spec.sha256:
                    raise FetchRefused("sha256", spec.sha256,
                                       f"{spec.source} has SHA-256 {actual}")
            return spec
        path = await self._fetcher.fetch(spec.source, on_progress, sha256=spec.sha256,
                                         secret=spec.secret)
        return spec.model_copy(update={"source": str(path)})

    async def _pass_gate(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None],
                         *, on_queued: QueuedCallback | None, answer_by: float | None) -> None:
        """Wait for a start-up slot, then check the fit again; on return the slot is held."""
        replica_id = spec.replica_id
        within = None if answer_by is None else answer_by - time.monotonic()
        limit = queue_limit_s(spec.start_timeout_s, within)
        logged = False

        def queued(place: Queued) -> None:
            nonlocal logged
            if not logged:
                log.info("%s queued at the start-up gate, position %d, behind %s",
                         replica_id, place.position, ", ".join(place.waiting_for) or "-")
                logged = True
            # The caller's heartbeat: a queued start must still show it is alive.
            if on_queued is not None:
                on_queued(place.position, list(place.waiting_for))
            else:
                on_progress(FetchProgress(phase="queued"))

        self._queued[replica_id] = spec
        entered = time.monotonic()
        try:
            outcome = await self._gate.wait_turn(replica_id, limit_s=limit, on_queued=queued,
                                                 poll_s=POLL_INTERVAL_S)
        finally:
            self._queued.pop(replica_id, None)
        match outcome:
            case TimedOut():
                log.warning("%s", outcome.detail())
                raise ShardStartError(ShardExit(replica_id=replica_id,
                                                kind=ExitKind.START_TIMEOUT,
                                                detail=outcome.detail()))
            case Removed():
                raise ShardStartError(ShardExit(replica_id=replica_id, kind=ExitKind.STOPPED,
                                                detail=outcome.detail()))
            case Admitted():
                if logged:
                    log.info("%s leaves the start-up queue after %.1fs", replica_id,
                             time.monotonic() - entered)
        shortfall = check_fit(spec, self._available_memory())
        if shortfall is not None:
            self._gate.leave(replica_id)
            log.warning("%s", shortfall.detail())
            # ERROR, not OOM_KILLED: nothing was killed, the engine never ran.
            raise ShardStartError(ShardExit(replica_id=replica_id, kind=ExitKind.ERROR,
                                            detail=shortfall.detail()))

    async def _launch(self, spec: ShardSpec,
                      on_progress: Callable[[FetchProgress], None]) -> LiveShard:
        on_progress(FetchProgress(phase="launching"))
        adapter = self._adapter_factory(spec)
        async with self._port_lock:
            taken = {s.record.port for s in self._shards.values()}
            port = choose_port(*self._ports, taken,
                               lambda p: port_is_free(self._host, p))
            key = self._engine_key(spec.replica_id)
            plan = adapter.launch_plan(spec, host=self._host, port=port, api_key=key)
            env = engine_environment(os.environ, plan.env, node_id=self.node_id,
                                     replica_id=spec.replica_id)
            if not self._logs_prepared:
                prepare_log_folder(self._logs)
                self._logs_prepared = True
            log_path = self._logs / f"{spec.replica_id}.log"
            proc = self._launcher(f"engine {spec.replica_id}", list(plan.argv), log_path, env)
            oom_before = read_oom_kills()
            proc.start()
            writer = proc.log_writer
            record = ShardRecord(
                spec=spec, port=port, pid=proc.pid, create_time=proc.create_time(),
                log_path=str(log_path),
                url=f"http://{self._host}:{port}" if plan.serves_http else None,
                state=ShardState.STARTING, started_at=datetime.now(UTC),
                oom_kills_at_start=oom_before, notes=plan.notes,
                log_writer_pid=None if writer is None else writer[0],
                log_writer_create_time=None if writer is None else writer[1])
            # Written before we wait on it: if the agent dies now, its successor adopts it.
            self._save(record)
            live = LiveShard(record=record, proc=proc)
            self._shards[spec.replica_id] = live
        log.info("launched %s on port %d (pid %d): %s", spec.replica_id, port, proc.pid,
                 " ".join(plan.argv[:4]))
        return live

    async def _wait_ready(self, live: LiveShard,
                          on_progress: Callable[[FetchProgress], None]) -> None:
        spec = live.record.spec
        if live.record.state is ShardState.READY:
            return
        deadline = live.record.started_at.timestamp() + spec.start_timeout_s
        adapter = self._adapter_factory(spec)
        key = self._engine_key(spec.replica_id)
        detail = "not probed yet"
        while True:
            ended = self._poll_exit(live)
            if ended is not None:
                self._forget(spec.replica_id)
                raise ShardStartError(ended)
            if live.record.url is None:
                break  # a rank without HTTP: alive is all we can know
            # A hung engine accepts connections and never answers: bound each probe by
            # what is left of the start timeout, so the timeout holds.
            budget = max(0.2, min(10.0, deadline - time.time()))
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns the probe's answer
            # when a cancellation lands as the probe ends, and the cancelled start would
            # go on loading an engine nobody waits for.
            try:
                async with asyncio.timeout(budget):
                    check = await adapter.check_ready(self._http, live.record.url, key,
                                                      spec.model_id)
            except TimeoutError:
                check = None
                detail = f"no answer within {budget:.1f}s"
            if check is not None and check.ready:
                break
            if check is not None:
                # The engine's own words, which leave the node in ShardExit.detail.
                detail = scrub_secrets(check.detail)
            if time.time() > deadline:
                tail = _tail(Path(live.record.log_path))
                await self.stop(spec.replica_id, grace_s=START_FAILED_STOP_GRACE_S)
                raise ShardStartError(ShardExit(
                    replica_id=spec.replica_id, kind=ExitKind.START_TIMEOUT,
                    detail=f"not ready after {spec.start_timeout_s:.0f}s (last probe: "
                           f"{detail})", log_tail=tail))
            on_progress(FetchProgress(phase="loading"))
            await asyncio.sleep(POLL_INTERVAL_S)
        live.record = live.record.model_copy(update={"state": ShardState.READY})
        live.unwatched_since = time.monotonic()
        self._save(live.record)

    # -- watch and stop ------------------------------------------------------------------

    def _poll_exit(self, live: LiveShard) -> ShardExit | None:
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
        live.exit = ShardExit(
            replica_id=record.spec.replica_id, kind=kind,
            exit_code=code if code is not None and code >= 0 else None,
            signal=-code if code is not None and code < 0 else None,
            detail=detail, log_tail=_tail(Path(record.log_path)))
        return live.exit

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit:
        """Return when the engine ends, heartbeating meanwhile."""
        live = self._shards.get(replica_id)
        if live is None:
            return ShardExit(replica_id=replica_id, kind=ExitKind.UNKNOWN_SHARD,
                             detail=f"node {self.node_id} runs no shard {replica_id}")
        live.watchers += 1
        live.unwatched_since = None
        try:
            while True:
                ended = self._poll_exit(live)
                if ended is not None:
                    self._forget(replica_id)
                    return ended
                heartbeat()
                await asyncio.sleep(POLL_INTERVAL_S)
        finally:
            live.watchers -= 1
            if live.watchers == 0:
                live.unwatched_since = time.monotonic()

    async def stop(self, replica_id: ReplicaId, grace_s: float) -> ShardExit:
        """SIGTERM the engine's group, SIGKILL it after ``grace_s``; harmless if gone.

        Never waits for the start-up gate. A start still queued there is taken out of the
        queue at once: its engine was never launched, and its start fails as stopped.
        """
        if self._gate.remove_waiter(replica_id):
            log.info("%s stopped while queued at the start-up gate", replica_id)
            return ShardExit(replica_id=replica_id, kind=ExitKind.STOPPED,
                             detail="stopped on request while queued at the start-up gate "
                                    "(never launched)")
        live = self._shards.get(replica_id)
        if live is None:
            return ShardExit(replica_id=replica_id, kind=ExitKind.UNKNOWN_SHARD,
                             detail=f"node {self.node_id} runs no shard {replica_id}")
        if self._poll_exit(live) is None:
            _signal(live, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self._poll_exit(live) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            _signal(live, signal.SIGKILL)
            while self._poll_exit(live) is None:
                await asyncio.sleep(0.05)
        if live.proc is not None:
            live.proc.reap()
        ended = live.exit
        assert ended is not None
        self._forget(replica_id)
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
        """What this agent runs, for registration and `list_shards`; then the starts
        queued at the start-up gate, in queue order (starting, no process yet)."""
        running = [
            ShardReport(replica_id=s.record.spec.replica_id, model_id=s.record.spec.model_id,
                        rank=s.record.spec.rank, state=s.record.state, port=s.record.port,
                        pid=s.record.pid, url=s.record.url, adopted=s.adopted)
            for s in self._shards.values() if self._poll_exit(s) is None
        ]
        queued = [
            ShardReport(replica_id=rid, model_id=spec.model_id, rank=spec.rank,
                        state=ShardState.STARTING, port=0, pid=0, url=None, adopted=False,
                        queued_position=position)
            for rid, position in self._gate.positions().items()
            if (spec := self._queued.get(rid)) is not None
        ]
        return running + queued

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
