"""One engine's process, as the shard manager drives it, and the record of it on disk.

What both halves of the shard manager share: the start-up path (:mod:`agent.shard_startup`)
launches an engine and writes its record; the manager (:mod:`agent.shards`) watches, stops
and adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

import psutil
from pydantic import Field

from modelkeeper.domain.base import Frozen
from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.redact import scrub_secrets
from modelkeeper.domain.shards import ShardEndpoint, ShardExit, ShardSpec, ShardState
from modelkeeper.infra.processes import ManagedProcess, signal_group

from .log_filter import filter_command, secret_values

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

#: The watch reports the end of an engine with this many of its last log lines.
LOG_TAIL_LINES = 200
#: How often a start polls readiness and a watch polls the process; also how often a
#: queued start heartbeats.
POLL_INTERVAL_S = 0.25
#: ... except readiness during the first READY_FAST_FOR_S of a start, polled every
#: READY_POLL_FAST_S: a request held for an on-demand load waits on each poll missed (at
#: 0.25 s, 125 ms on average of a cold start's 0.5 s budget), and a health probe on the
#: node costs well under a millisecond. A longer load (a large model) is polled at
#: POLL_INTERVAL_S, so it costs no more than before.
READY_POLL_FAST_S = 0.05
READY_FAST_FOR_S = 30.0


def ready_poll_s(loading_for_s: float) -> float:
    """The wait before the next readiness probe of an engine loading this long."""
    return READY_POLL_FAST_S if loading_for_s < READY_FAST_FOR_S else POLL_INTERVAL_S

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
    #: Put to sleep by this agent and not woken since: the record an engine with no "is
    #: it sleeping" endpoint (SGLang) is judged by, kept across agent restarts.
    sleeping: bool = False


class ExitSignal:
    """Wakes a watch the moment an engine's process ends, instead of at its next poll.

    A pidfd (Linux 5.3 and later) becomes readable when its process exits, and the event
    loop waits on it for free: the engine's exit is seen within milliseconds, where a
    poll every POLL_INTERVAL_S saw it 0.125 s later on average, a delay every relaunch
    in place and every replacement paid before the keeper could act. Where there is no
    pidfd (another OS, an old kernel, a process already gone) and for an engine served
    inside the agent (its pid is the agent's own, which never ends under the watch),
    :meth:`wait` is the plain sleep it replaces: the poll still decides, this only wakes
    it sooner.
    """

    def __init__(self, pid: int) -> None:
        self._fd: int | None = None
        if pid != os.getpid() and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._fd = os.pidfd_open(pid)

    async def wait(self, timeout_s: float) -> None:
        """Return after ``timeout_s``, or as soon as the process has ended."""
        if self._fd is None:
            await asyncio.sleep(timeout_s)
            return
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        fired = False

        def readable() -> None:
            nonlocal fired
            fired = True
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(self._fd, readable)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await ended
        finally:
            loop.remove_reader(self._fd)
        if fired:
            # It has ended and stays readable: later waits (should the poll not see the
            # end yet) are plain sleeps, never a spin. (A wait that timed out leaves the
            # future cancelled, which is done too: hence the flag.)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
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
