"""The start-up path of a shard: weights, the start-up gate, the launch, readiness.

A start is the agent's longest and most branching call: it fetches the weights, waits its
turn at the node's start-up gate (:mod:`agent.startup_gate`), checks the fit again,
launches the engine with its record written first (:mod:`agent.engine_process`), and
probes it until it is ready or its start timeout passes. It lives apart from the shard
manager (:mod:`agent.shards`), which watches, stops and adopts what this launched, and
owns the table of running shards this path adds to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import httpx

from modelkeeper.domain.engine_logs import exit_detail, failure_detail
from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.redact import scrub_secrets
from modelkeeper.domain.shards import (
    ExitKind,
    FetchProgress,
    ShardEndpoint,
    ShardExit,
    ShardSpec,
    ShardStartError,
    ShardState,
    choose_port,
    split_address,
)
from modelkeeper.domain.sources import SourcePolicy
from modelkeeper.domain.start_progress import MAX_WAITING_FOR, StartProgress
from modelkeeper.infra.processes import LOG_MODE, port_is_free

from .engine_process import (
    POLL_INTERVAL_S,
    EngineLauncher,
    LiveShard,
    ShardRecord,
    engine_environment,
    read_log_tail,
    read_oom_kills,
    ready_poll_s,
)
from .engines.base import EngineAdapter
from .fetch import FetchRefused, WeightFetcher, file_sha256, is_remote
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

#: The engines' log folder: the agent's user and its Unix group may list it,
#: nobody else. Each log in it is :data:`~modelkeeper.infra.processes.LOG_MODE`.
LOG_FOLDER_MODE = 0o750
#: A start that failed or was cancelled stops what it launched with this grace.
START_FAILED_STOP_GRACE_S = 5.0

#: Called while a start waits at the start-up gate: its place in the queue (1 is next)
#: and the replicas loading now.
QueuedCallback = Callable[[int, list[ReplicaId]], None]


def rendezvous_port_of(spec: ShardSpec) -> int | None:
    """The port rank 0 of a multi-node replica listens on for the other ranks, on this
    node; None for any other shard."""
    if spec.rank != 0 or spec.world_size <= 1 or not spec.leader_address:
        return None
    parts = split_address(spec.leader_address)
    return None if parts is None else parts[1]


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


class ShardTable(Protocol):
    """What the start-up path needs of the shard manager (:class:`agent.shards.ShardManager`):
    its table of running shards, and the calls that keep that table and its records on
    disk in step."""

    @property
    def running(self) -> Mapping[ReplicaId, LiveShard]:
        """The shards this agent runs now, launched or adopted."""
        ...

    def engine_key(self, replica_id: ReplicaId) -> str:
        """The key the engine of ``replica_id`` serves with."""
        ...

    def add(self, live: LiveShard) -> None:
        """Write ``live``'s record, then run it: a successor agent adopts it from now."""
        ...

    def save(self, record: ShardRecord) -> None:
        """Write ``record`` over the one on disk."""
        ...

    def poll_exit(self, live: LiveShard) -> ShardExit | None:
        """How ``live`` ended, or None while it runs."""
        ...

    def forget(self, replica_id: ReplicaId) -> None:
        """Drop an engine that is gone, and its record."""
        ...

    async def stop(self, replica_id: ReplicaId, grace_s: float) -> ShardExit:
        """Stop the engine of ``replica_id`` (SIGTERM, SIGKILL after ``grace_s``)."""
        ...


class ShardStartup:
    """Starts this node's engines, one start-up gate for all of them."""

    def __init__(self, table: ShardTable, *, node_id: NodeId, agent_dir: Path,
                 engine_host: str, port_range: tuple[int, int],
                 adapter_factory: Callable[[ShardSpec], EngineAdapter],
                 gate: StartupGate, available_memory: Callable[[], int | None],
                 launcher: EngineLauncher, http: httpx.AsyncClient,
                 source_policy: SourcePolicy | None) -> None:
        """``table``: the shard manager, whose table a launch adds to. The rest as
        :class:`agent.shards.ShardManager` takes them; ``gate`` is shared with it, which
        takes a stopped start out of the queue."""
        self._table = table
        self.node_id = node_id
        self._logs = agent_dir / "logs"
        self._logs_prepared = False
        self._host = engine_host
        self._ports = port_range
        self._fetcher = WeightFetcher(agent_dir / "weights", policy=source_policy)
        self._adapter_factory = adapter_factory
        self._locks: dict[ReplicaId, asyncio.Lock] = {}
        self._port_lock = asyncio.Lock()
        #: The port each replica's engine was last launched on, until the replica is
        #: stopped here (forget_port): a relaunch in place takes it again if it is free,
        #: so the replica's endpoint does not change, and other launches pass it over.
        self._last_ports: dict[ReplicaId, int] = {}
        self._launcher = launcher
        self._http = http
        self._gate = gate
        self._available_memory = available_memory
        #: Starts waiting at the gate, for reports: they have no process yet.
        self.queued: dict[ReplicaId, ShardSpec] = {}
        #: Each start's latest progress, from its first word until it ends (ready, failed
        #: or cancelled): the heartbeat carries them to the API (agent.main), which shows
        #: them where people look (modelkeeper.domain.start_progress).
        self.progress: dict[ReplicaId, StartProgress] = {}

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
            try:
                return await self._start(spec, self._tracked(spec, on_progress),
                                         on_queued=on_queued, answer_by=answer_by)
            finally:
                self.progress.pop(spec.replica_id, None)

    def _tracked(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None],
                 ) -> Callable[[FetchProgress], None]:
        """``on_progress``, keeping each report in :attr:`progress` on the way."""
        def track(progress: FetchProgress) -> None:
            fetched = progress.phase in ("fetching", "cached")
            self.progress[spec.replica_id] = StartProgress(
                replica_id=spec.replica_id, rank=spec.rank, phase=progress.phase,
                bytes_done=progress.bytes_done if fetched else None,
                bytes_total=progress.bytes_total if fetched else None,
                rate_bytes_per_s=progress.rate_bytes_per_s if fetched else None)
            on_progress(progress)
        return track

    async def _start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                     on_queued: QueuedCallback | None,
                     answer_by: float | None) -> ShardEndpoint:
        """:meth:`start`, under the replica's lock."""
        live = self._table.running.get(spec.replica_id)
        if live is not None and self._table.poll_exit(live) is not None:
            self._table.forget(spec.replica_id)
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
            await self._table.stop(spec.replica_id, grace_s=START_FAILED_STOP_GRACE_S)
            raise
        finally:
            # Ready, failed or cancelled: it loads no more, the next in line may.
            self._gate.leave(spec.replica_id)
        return live.endpoint(self.node_id)

    def forget_port(self, replica_id: ReplicaId) -> None:
        """The replica was stopped here: its port is no longer kept for a relaunch."""
        self._last_ports.pop(replica_id, None)

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
            # After the callbacks: the plain one (tracked) knows no place in line.
            self.progress[replica_id] = StartProgress(
                replica_id=replica_id, rank=spec.rank, phase="queued",
                queue_position=place.position,
                waiting_for=list(place.waiting_for[:MAX_WAITING_FOR]))

        self.queued[replica_id] = spec
        entered = time.monotonic()
        try:
            outcome = await self._gate.wait_turn(replica_id, limit_s=limit, on_queued=queued,
                                                 poll_s=POLL_INTERVAL_S)
        finally:
            self.queued.pop(replica_id, None)
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
            # Rendezvous ports are the control plane's claims (rendezvous_port): never an
            # engine's HTTP port, even before the rank 0 holding one has bound it.
            rendezvous = {port for s in [*self._table.running.values()]
                          if (port := rendezvous_port_of(s.record.spec)) is not None}
            own = rendezvous_port_of(spec)
            taken = {s.record.port for s in self._table.running.values()} | rendezvous
            if own is not None and (own in taken or not port_is_free(self._host, own)):
                raise ShardStartError(ShardExit(
                    replica_id=spec.replica_id, kind=ExitKind.ERROR,
                    detail=f"rank 0's rendezvous port {own} on node {self.node_id} is in use"))
            # A relaunch takes the port it had if it is free (its endpoint stays what it
            # was); other launches pass over the ports kept for relaunches.
            kept = {p for rid, p in self._last_ports.items() if rid != spec.replica_id}
            port = choose_port(*self._ports, taken | ({own} if own is not None else set()),
                               lambda p: port_is_free(self._host, p),
                               prefer=self._last_ports.get(spec.replica_id), kept=kept)
            self._last_ports[spec.replica_id] = port
            key = self._table.engine_key(spec.replica_id)
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
            live = LiveShard(record=record, proc=proc)
            # Written before we wait on it: if the agent dies now, its successor adopts it.
            self._table.add(live)
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
        key = self._table.engine_key(spec.replica_id)
        detail = "not probed yet"
        while True:
            ended = self._table.poll_exit(live)
            if ended is not None:
                self._table.forget(spec.replica_id)
                # Its detail names its last log line and its log (ShardManager.poll_exit).
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
                tail = read_log_tail(Path(live.record.log_path))
                await self._table.stop(spec.replica_id, grace_s=START_FAILED_STOP_GRACE_S)
                raise ShardStartError(ShardExit(
                    replica_id=spec.replica_id, kind=ExitKind.START_TIMEOUT,
                    # A load wedged on a fatal error still says which in its log.
                    detail=failure_detail(
                        exit_detail(f"not ready after {spec.start_timeout_s:.0f}s (last "
                                    f"probe: {detail})", tail), tail,
                        log_path=live.record.log_path, node=self.node_id,
                        replica_id=spec.replica_id), log_tail=tail))
            on_progress(FetchProgress(phase="loading"))
            await asyncio.sleep(ready_poll_s(time.time() - live.record.started_at.timestamp()))
        live.record = live.record.model_copy(update={"state": ShardState.READY})
        live.unwatched_since = time.monotonic()
        self._table.save(live.record)
