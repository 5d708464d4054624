"""Sim engines served inside the agent's own process: how one agent process runs the
engines of a thousand simulated nodes (``python -m bench.fleet --fleet N``,
:mod:`bench.fleet.nodes`).

A sim run as a child costs an interpreter (~20 MB and a start-up of a few hundred ms); a
thousand of them would fill this machine before the control plane is measured. Here each
engine is :func:`agent.engines.sim_server.serve` as a task on the agent's event loop, on
a port of its own, started from the very launch plan :class:`~agent.engines.sim.SimAdapter`
builds for a child: the same command line, parsed by the same parser, the same API key
from the plan's environment, the same HTTP server. Only the process boundary is gone.

What that changes, each on purpose:

* it holds no memory: ``--memory-bytes`` is what it *says* it holds, which its node's
  available memory reports as taken (:meth:`InProcessSims.held_bytes`), as a real machine's
  would drop by what a child sim holds; asleep, it says it holds only its
  ``--weights-bytes``, as a child sim frees the rest;
* a simulated crash (``crash_after_s``) ends this engine with the crash's exit code, not
  the process that serves a thousand of them;
* SIGTERM stops it as a signal would stop the child; SIGKILL cancels it at once (its
  sockets close, its exit code reads as -9); no other signal does anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from pathlib import Path

from .base import EngineConfigError
from .sim import ENTRY_MODULE
from .sim_server import API_KEY_ENV, SimConfig, SimEngine, parse_args, serve

#: What an engine killed with SIGKILL reports, as a child's returncode would.
KILLED_CODE = -signal.SIGKILL


class InProcessSim:
    """One sim engine served on this process's event loop (an
    :class:`agent.engine_process.EngineProcess`)."""

    def __init__(self, name: str, config: SimConfig, api_key: str | None) -> None:
        self.name = name
        self.config = config
        self._api_key = api_key
        self._stop = asyncio.Event()
        self._task: asyncio.Task[int] | None = None
        self._started_at = time.time()
        # Nothing is held for real: see the module docstring.
        self.engine = SimEngine(dataclasses.replace(config, memory_bytes=0), api_key)

    @property
    def held_bytes(self) -> int:
        """What it says it holds: all of ``--memory-bytes``, less its KV share asleep."""
        if self.engine.sleeping:
            return self.config.memory_bytes - self.config.kv_bytes
        return self.config.memory_bytes

    @property
    def pid(self) -> int:
        # Reported, never signalled: every signal goes through signal() (see
        # agent.engine_process.EngineProcess).
        return os.getpid()

    def create_time(self) -> float:
        return self._started_at

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            serve(self.engine.config, self._api_key, stop=self._stop, engine=self.engine),
            name=self.name)

    def poll(self) -> int | None:
        task = self._task
        if task is None or not task.done():
            return None
        if task.cancelled():
            return KILLED_CODE
        error = task.exception()
        if error is not None:
            # What a child that failed to bind or load would have exited with.
            return 1
        return task.result()

    def signal(self, sig: int) -> None:
        if self._task is None or self._task.done():
            return
        if sig == signal.SIGKILL:
            self._task.cancel()
        elif sig in (signal.SIGTERM, signal.SIGINT):
            self._stop.set()

    def reap(self) -> None:
        """Nothing to collect: the task is gone once :meth:`poll` answers."""

    @property
    def log_writer(self) -> tuple[int, float] | None:
        """None: an in-process sim writes no log."""
        return None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def wait(self) -> None:
        """Until the engine's task has ended (however it ended)."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(self._task)


class InProcessSims:
    """The launcher (:data:`agent.engine_process.EngineLauncher`) of one simulated node: it serves
    the sim engine in-process and refuses every other engine, and it keeps the node's
    engines so that the fleet can kill them all at once when the node dies."""

    def __init__(self) -> None:
        self._engines: list[InProcessSim] = []

    def __call__(self, name: str, argv: list[str], log_path: Path,
                 env: dict[str, str]) -> InProcessSim:
        if argv[1:3] != ["-m", ENTRY_MODULE]:
            raise EngineConfigError("engine", " ".join(argv[:3]),
                                    "a fleet's simulated nodes run only the sim engine")
        engine = InProcessSim(name, parse_args(argv[3:]), env.get(API_KEY_ENV) or None)
        # Ended engines are forgotten here, not when they end: nothing else is told.
        self._engines = [e for e in self._engines if e.poll() is None]
        self._engines.append(engine)
        return engine

    def held_bytes(self) -> int:
        """What this node's running engines say they hold (``--memory-bytes``, less the
        KV share of those asleep)."""
        return sum(e.held_bytes for e in self._engines if e.running)

    def kill_all(self) -> int:
        """SIGKILL every engine of the node at once; how many were running."""
        running = [e for e in self._engines if e.running]
        for engine in running:
            engine.signal(signal.SIGKILL)
        return len(running)
