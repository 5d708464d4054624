"""The soak's stack: :class:`bench.fleet.stack.Fleet` with two control workers, an agent
per network namespace, and a way to restart every component.

What it adds to the recovery fleet:

* **Two control workers** for the whole run (``worker-1``, ``worker-2``), both polling the
  control task queue: Temporal hands each task to one of them, so a kill -9 of either is
  survived by the other, which must pick up what the dead one held.
* **An agent per network namespace** (:mod:`bench.soak.netns`), when the machine allows
  it, so that one can be partitioned from the control plane. Each reaches the API from an
  address of its own, as a machine of its own would: so the API and the gateway listen on
  every address (auth stays on for both) and the agents join with a join token, the two
  settings that differ from the defaults, neither a timing. Without namespaces the agents
  run as in the recovery fleet and the partition fault is left out (the report says why).
* **Restarts:** kill -9 and start again (a worker, the API, the gateway), or stop and start
  again keeping the data (the Temporal dev server its database file, PostgreSQL its data
  dir), each on the same port, each waited for until it does its job again.
* **The operator's token** (the recovery fleet issues it) as headers, in one place
  (:meth:`SoakFleet.api_headers`): the API asks for it on every operator route.

Every process is in a group of its own (``ManagedProcess``); :meth:`SoakFleet.stop` wakes
what a fault froze before stopping everything, forwarders and namespaces included.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from bench.fleet.stack import (
    HOST,
    READY_TIMEOUT_S,
    STOP_GRACE_S,
    Agent,
    Fleet,
    FleetError,
    wait_ready,
)
from cli.stack import FIRST_RESTART_DELAY_S
from modelkeeper.infra.processes import ManagedProcess, signal_group, tcp_accepts

from .netns import NodeNetwork

#: What the worker logs once it polls its task queue (worker/main.py): its readiness.
WORKER_POLLING = b"worker polling"
#: How long a single readiness probe may take; a component busy restarting answers slowly.
PROBE_TIMEOUT_S = 2.0
#: Where the API and the gateway listen when agents are namespaced: every address, so that
#: each namespace reaches the API at its veth pair's host end. Auth stays on for both.
ANY_ADDRESS = "0.0.0.0"
#: Engine ports of the namespaced agents start here, ENGINE_PORTS apiece: each agent has
#: its own namespace, so these need not be free on the host.
ENGINE_PORT_BASE = 21000
#: Ports an agent hands to its engines: one per replica at a time, a few spare for the
#: replacements a restart or a drain starts beside the old ones.
ENGINE_PORTS = 20


@dataclass
class SoakFleet(Fleet):
    """The recovery fleet, with two workers, namespaced agents and restarts."""

    #: Control workers run side by side for the whole soak.
    workers: int = 2
    #: Run each agent in a network namespace of its own (partitions need it).
    use_netns: bool = True
    networks: dict[str, NodeNetwork] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_netns:
            # A namespaced agent reaches the API over its veth pair, as from a machine of
            # its own: the API must listen beyond loopback, and a node that is not on
            # loopback joins with the join token (api/agents.py). Neither is a timing.
            self.extra_env = {"MODELKEEPER_BIND_HOST": ANY_ADDRESS,
                              "MODELKEEPER_JOIN_TOKEN": secrets.token_urlsafe(32),
                              **self.extra_env}

    # -- start ------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        """As the recovery fleet, but ``worker`` is started :attr:`workers` times."""
        if name != "worker":
            return super()._start(name, argv, env)
        # A loop, not a comprehension: super() without arguments needs the method's frame.
        procs = []
        for i in range(1, self.workers + 1):
            procs.append(super()._start(f"worker-{i}", argv, env))
        return procs[0]

    def _start_agent(self, name: str) -> None:
        """The recovery fleet's agent, inside a namespace of its own when asked for."""
        if not self.use_netns:
            super()._start_agent(name)
            return
        net = NodeNetwork.create(len(self.agents))
        self.networks[name] = net
        net.start_forwarder([f"{self.api_port}:{net.host_ip}:{self.api_port}:netns",
                             f"{self.temporal_port}:{HOST}:{self.temporal_port}:host"],
                            self.root / "logs")
        low = self._engine_port_low()
        data_dir = self.root / name
        argv = [*net.exec_prefix(), *self.agent_command, "agent", "--data-dir", str(data_dir),
                "--name", name, "--memory", self.node_memory,
                "--engine-port-range", f"{low}-{low + ENGINE_PORTS}"]
        # Engines bind the namespace's end of the veth pair and advertise it: the gateway
        # reaches them through the kernel, not through the forwarder a partition stops.
        env = {**self._env, "MODELKEEPER_ENGINE_HOST": net.node_ip}
        proc = ManagedProcess(f"agent {name}", argv, self.root / "logs" / f"{name}.log",
                              env=env)
        proc.start()
        self.agents.append(Agent(name, data_dir, proc))

    def _engine_port_low(self) -> int:
        # Inside its namespace an agent has every port to itself; distinct ranges anyway,
        # so that an engine's address names its node in every log.
        return ENGINE_PORT_BASE + len(self.agents) * ENGINE_PORTS

    @property
    def api_port(self) -> int:
        return int(self.api_url.rsplit(":", 1)[1])

    @property
    def temporal_port(self) -> int:
        return int(self.temporal_address.rsplit(":", 1)[1])

    # -- the operator's token -------------------------------------------------------------

    def api_headers(self) -> dict[str, str]:
        """The headers every operator call to the API carries: the one place auth lives.
        The token is the recovery fleet's, issued once the API is up."""
        return {"Authorization": f"Bearer {self.operator_token}"} if self.operator_token else {}

    # -- restarts -------------------------------------------------------------------------

    def component(self, name: str) -> ManagedProcess:
        """The control-plane process called ``name`` (``worker-1``, ``api``, ``postgres``…)."""
        for proc in self.started:
            if proc.name == name:
                return proc
        raise FleetError(f"no component {name!r}; have {[p.name for p in self.started]}")

    @property
    def worker_names(self) -> list[str]:
        return [f"worker-{i}" for i in range(1, self.workers + 1)]

    async def kill_and_restart(self, name: str) -> float:
        """kill -9 ``name``'s group, start it again after the backoff ``up`` would wait, and
        wait until it does its job; returns the seconds it was away."""
        proc = self.component(name)
        t0 = time.monotonic()
        signal_group(proc.pid, signal.SIGKILL)
        proc.stop(grace=0)  # reap it, close its log
        await asyncio.sleep(FIRST_RESTART_DELAY_S)
        await self._start_and_wait(proc)
        return time.monotonic() - t0

    async def restart_keeping_data(self, name: str) -> float:
        """Stop ``name`` (SIGTERM, then SIGKILL after the grace) and start it again with the
        same data: the dev server's database file, PostgreSQL's data dir."""
        proc = self.component(name)
        t0 = time.monotonic()
        await asyncio.to_thread(proc.stop, STOP_GRACE_S)
        await self._start_and_wait(proc)
        return time.monotonic() - t0

    async def _start_and_wait(self, proc: ManagedProcess) -> None:
        offset = proc.log_path.stat().st_size if proc.log_path.exists() else 0
        proc.start()
        await wait_ready(proc, self._readiness(proc.name, offset), READY_TIMEOUT_S)

    def _readiness(self, name: str, log_offset: int) -> Callable[[], Awaitable[bool]]:
        match name:
            case "api":
                return self._api_ready
            case "gateway":
                return self._gateway_ready
            case "temporal":
                return functools.partial(_tcp_ready, HOST, self.temporal_port)
            case "postgres":
                return functools.partial(_database_ready, self.database_url)
            case _ if name.startswith("worker"):
                return functools.partial(_logged, self.component(name), log_offset,
                                         WORKER_POLLING)
        raise FleetError(f"no readiness check for {name!r}")

    # -- freeze and partition ------------------------------------------------------------

    def node_ids(self) -> set[str]:
        """The ids of this fleet's nodes (what the markers in their engines carry)."""
        return {a.node_id for a in self.agents if a.node_id is not None}

    def partitionable(self) -> list[Agent]:
        """Agents with a namespace: those a partition can cut off."""
        return [a for a in self.agents if a.name in self.networks]

    def partition(self, agent: Agent, cut: bool) -> None:
        """Cut ``agent`` from the control plane (stop its forwarder), or heal the cut."""
        forwarder = self.networks[agent.name].forwarder
        assert forwarder is not None, "every namespace is made with its forwarder"
        signal_group(forwarder.pid, signal.SIGSTOP if cut else signal.SIGCONT)

    def freeze(self, agent: Agent, frozen: bool) -> None:
        """SIGSTOP the agent (its group only: engines have groups of their own), or SIGCONT."""
        signal_group(agent.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Wake what a fault froze, stop everything, then remove the namespaces."""
        for agent in self.agents:
            if agent.proc.popen is not None:
                signal_group(agent.proc.pid, signal.SIGCONT)
        for net in self.networks.values():
            if net.forwarder is not None and net.forwarder.popen is not None:
                signal_group(net.forwarder.pid, signal.SIGCONT)
        try:
            super().stop()
        finally:
            for net in self.networks.values():
                net.destroy()


async def _tcp_ready(host: str, port: int) -> bool:
    return await asyncio.to_thread(tcp_accepts, host, port)


async def _database_ready(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=PROBE_TIMEOUT_S)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False  # refused, or still starting up ("the database system is starting up")
    await conn.close()
    return True


async def _logged(proc: ManagedProcess, offset: int, marker: bytes) -> bool:
    """True once ``marker`` appears in ``proc``'s log past ``offset`` (this start's part)."""
    try:
        with proc.log_path.open("rb") as log:
            log.seek(offset)
            return marker in log.read()
    except FileNotFoundError:
        return False

