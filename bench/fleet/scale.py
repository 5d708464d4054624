"""The scale benchmark's stack: :class:`bench.fleet.stack.Fleet` with no agents of its
own, and one process that is N simulated nodes (``python -m bench.fleet --fleet N``,
:mod:`bench.fleet.nodes`) instead.

What it adds to the shared fleet:

* **the fleet agent**: the real agent's code for every node (registration, heartbeats,
  liveness stream, a Temporal worker on each node's own task queue), with the sim engine
  served in-process, each node on its own share of the engine ports;
* **the control worker with placement timing**: run as ``python -m bench.scale.component
  worker``, which turns on the DEBUG lines of ``modelkeeper.store.placement`` (each
  placement's time, its lock wait apart) and, when asked, profiles the component;
* **a kill of many nodes at once**: the node list goes to the fleet's kill file and the
  fleet gets SIGUSR1 (see :mod:`bench.fleet.nodes`); :meth:`ScaleFleet.kill` returns when
  the fleet says it has killed them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.fleet.nodes import FLEET_DIR, HEARTBEATS_FILE, KILL_FILE, KILLED_FILE
from bench.fleet.stack import AGENT_WITHHELD_ENV, STOP_GRACE_S, Fleet, FleetError
from modelkeeper.infra.processes import ManagedProcess

#: Engine ports start here, PORTS_PER_NODE apiece: below the kernel's ephemeral range
#: (32768 and up), so that no outgoing connection holds one a node hands out.
ENGINE_PORT_BASE = 20000
#: A node's replica, a replacement beside it, and spare.
PORTS_PER_NODE = 4
#: Components that may be profiled (``--profile``, with ``fleet``): one Python process each.
PROFILABLE = ("worker", "api")
#: A fleet stopped at the end: each live node says bye, its worker drains, its engines
#: stop; a thousand of them take a while on two cores.
FLEET_STOP_GRACE_S = 60.0
#: How often registration progress is read from the API.
NODES_POLL_S = 1.0
#: How long the fleet may take to say it has killed the nodes asked for.
KILL_TIMEOUT_S = 10.0
#: Left out of the children's environment, where this machine's shell sets it: an installed
#: package has its bytecode, and without it the worker compiles every workflow module from
#: source again for each workflow run it starts (the sandbox imports them anew each time:
#: 66 ms a run instead of 22 ms, measured).
NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"


class ScaleError(RuntimeError):
    """The stack did not reach the state the benchmark needs; names why."""


@dataclass
class ScaleFleet(Fleet):
    """The shared fleet without agents, plus one fleet agent of ``size`` nodes."""

    size: int = 100
    #: Components run under cProfile; each writes ROOT/profiles/NAME.prof at the end.
    profile: tuple[str, ...] = ()
    fleet_proc: ManagedProcess | None = None
    nodes_ready_s: float | None = None
    extra_agent_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.agent_count = 0
        # The fleet registers all its nodes from one address at once; the API's default
        # burst (registration_burst) is sized for machines, not for a harness.
        self.extra_env.setdefault("MODELKEEPER_REGISTRATION_BURST", str(max(self.size, 1)))

    @property
    def fleet_dir(self) -> Path:
        return self.root / "fleet-agent" / "agent" / FLEET_DIR

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        """The worker and the API through :mod:`bench.scale.component` (placement timing,
        and cProfile when asked); the rest as the shared fleet starts them."""
        if name in PROFILABLE:
            wrapper = [sys.executable, "-m", "bench.scale.component"]
            if name in self.profile:
                wrapper += ["--profile", str(self.root / "profiles" / f"{name}.prof")]
            argv = [*wrapper, name]
        return super()._start(name, argv, _with_bytecode(env))

    async def start_fleet(self) -> float:
        """Start the fleet agent and wait until the API sees every node ready; the
        seconds that took."""
        low = ENGINE_PORT_BASE
        high = low + self.size * PORTS_PER_NODE - 1
        command = [sys.executable, "-m", "bench.fleet"]
        if "fleet" in self.profile:
            command = [sys.executable, "-m", "bench.scale.component", "--profile",
                       str(self.root / "profiles" / "fleet.prof"), "fleet"]
        argv = [*command, "--fleet", str(self.size),
                "--data-dir", str(self.root / "fleet-agent"), "--name", "sim",
                "--memory", self.node_memory, "--engine-port-range", f"{low}-{high}",
                *self.extra_agent_args]
        env = _with_bytecode({k: v for k, v in self._env.items()
                              if k not in AGENT_WITHHELD_ENV})
        self.fleet_proc = ManagedProcess("fleet", argv, self.root / "logs" / "fleet.log",
                                         env=env)
        t0 = time.monotonic()
        self.fleet_proc.start()
        deadline = t0 + max(120.0, self.size * 0.5)
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30.0,
                                     headers=self.headers()) as api:
            ready = 0
            while ready < self.size:
                code = self.fleet_proc.poll()
                if code is not None:
                    raise FleetError(f"the fleet agent exited with code {code}; log "
                                     f"{self.fleet_proc.log_path}:\n{self.fleet_proc.log_tail()}")
                if time.monotonic() > deadline:
                    raise ScaleError(f"{ready} of {self.size} nodes ready after "
                                     f"{time.monotonic() - t0:.0f}s; log "
                                     f"{self.fleet_proc.log_path}")
                await asyncio.sleep(NODES_POLL_S)
                try:
                    resp = await api.get("/nodes")
                except httpx.HTTPError:
                    continue
                if resp.status_code == 200:
                    ready = sum(1 for n in resp.json() if n["state"] == "ready")
        self.nodes_ready_s = time.monotonic() - t0
        return self.nodes_ready_s

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.operator_token}"}

    def component_pids(self) -> dict[str, int]:
        """The pid of each process the benchmark weighs: worker, api, gateway, fleet."""
        pids = {p.name: p.pid for p in self.started if p.popen is not None}
        if self.fleet_proc is not None and self.fleet_proc.popen is not None:
            pids["fleet"] = self.fleet_proc.pid
        return pids

    async def kill(self, names: list[str]) -> dict[str, Any]:
        """Kill the nodes ``names`` at once (see :mod:`bench.fleet.nodes`); the fleet's record of
        it: ``at`` (seconds since the epoch), ``nodes``, ``engines``."""
        assert self.fleet_proc is not None
        (self.fleet_dir / KILL_FILE).write_text("".join(f"{n}\n" for n in names))
        killed = self.fleet_dir / KILLED_FILE
        killed.unlink(missing_ok=True)
        asked = time.time()
        os.kill(self.fleet_proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                record: dict[str, Any] = json.loads(killed.read_text())
            except (OSError, ValueError):
                await asyncio.sleep(0.02)
                continue
            record["asked"] = asked
            return record
        raise ScaleError(f"the fleet did not kill {len(names)} node(s) within "
                         f"{KILL_TIMEOUT_S:.0f}s; log {self.fleet_proc.log_path}")

    def heartbeats(self) -> list[tuple[float, float]]:
        """Every heartbeat round trip the fleet has recorded: (sent at, seconds)."""
        try:
            text = (self.fleet_dir / HEARTBEATS_FILE).read_text()
        except FileNotFoundError:
            return []
        samples = []
        for line in text.splitlines():
            parts = line.split(",")
            if len(parts) >= 2:
                samples.append((float(parts[0]), float(parts[1])))
        return samples

    def stop(self) -> None:
        """Profiles first (SIGUSR2 makes a profiled component write its own), then the
        fleet, then what the shared fleet stops."""
        for proc in [*self.started, *([self.fleet_proc] if self.fleet_proc else [])]:
            if proc.name in self.profile and proc.popen is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR2)
        if self.profile:
            time.sleep(2.0)  # a dump of a large profile takes a moment
        for proc in self.started:
            if proc.name == "worker":
                # First: the fleet's engines stop next, and a worker still running would
                # place a replacement for each of them on the way out.
                proc.stop(grace=STOP_GRACE_S)
        if self.fleet_proc is not None:
            # Before the API and Temporal: its nodes say bye and drain while those answer.
            self.fleet_proc.stop(grace=FLEET_STOP_GRACE_S)
        super().stop()


def _with_bytecode(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != NO_BYTECODE}
