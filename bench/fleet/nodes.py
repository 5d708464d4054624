"""`python -m bench.fleet --fleet N`: one process that is N simulated nodes, for scale
benchmarks and tests (bench/scale), each running the real agent's code.

Each simulated node is a :class:`agent.main.Node` run by :func:`agent.main.run_node`, the
code every agent runs: its own node id and credential (kept in a folder of its own under
``<data dir>/agent/fleet/``), its own name (``NAME-0001``...), its own registration,
heartbeats and liveness stream over its own HTTP client, its own Temporal worker on its own
task queue, and its own :class:`agent.shards.ShardManager` with its share of the engine
ports. What the nodes share is what one machine would share anyway: the Temporal client
(one connection), the TLS settings, and the process.

Each node has HTTP clients of its own, as each agent does, rather than one pool for all:
httpcore scans every connection of a pool for each request, and one pool of a thousand
liveness streams made that scan the fleet's largest cost (its profile at 100 nodes). The
clients share one TLS context: building one per client costs 50 ms each.

Two things differ from a real agent, each because a thousand of the real thing do not fit
on one machine:

* engines: only the sim engine, served inside this process
  (:mod:`agent.engines.sim_inprocess`), from the launch plan a child would get;
* capacity: each node declares ``--memory`` (required) and ``--cpus`` and reads nothing
  from the machine; its available memory is what it declares less what its sims say they
  hold.

**Killing nodes** (the benchmark's 10 % loss): write their names or ids, one a line, to
``<data dir>/agent/fleet/kill`` and send the process SIGUSR1. Every node listed then dies
at once, as a kill -9 of its agent and its engines would have it: its liveness stream is
cut, its heartbeats stop, its worker stops polling and what its activities were doing
never answers (not even a cancellation), and its engines close their sockets. The fleet
writes ``killed.json`` beside the list: when, and which nodes. Dead nodes stay dead until
the fleet stops.

Every heartbeat's round trip is appended to ``heartbeats.csv`` there (when it was sent, in
seconds since the epoch, how long the answer took, and the node), a few times a second:
the latency an agent sees, which the benchmark reads while placements run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeVar

import httpx

from agent.engines.sim_inprocess import InProcessSims
from agent.identity import load_or_create_node_id
from agent.main import (
    STOP_ON_EXIT_GRACE_S,
    AgentConfigError,
    Node,
    NodeIdentity,
    NodeRun,
    TemporalClients,
    advertised_engine_host,
    declared_memory,
    engine_port_range,
    node_name_problem,
    run_node,
    writable_agent_dir,
)
from agent.shards import ShardManager
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.nodes import MAX_PORT, Inventory, PortRange
from modelkeeper.domain.shards import (
    FetchProgress,
    ShardEndpoint,
    ShardExit,
    ShardReport,
    ShardSpec,
)
from modelkeeper.infra.model_files import source_policy
from modelkeeper.infra.secrets import read_join_token
from modelkeeper.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Under the agent's data dir: one folder per simulated node, and the kill list.
FLEET_DIR = "fleet"
KILL_FILE = "kill"
KILLED_FILE = "killed.json"
HEARTBEATS_FILE = "heartbeats.csv"
#: A node needs a port for its replica and one for a replacement started beside it (a
#: surge, a restart); fewer and it cannot take part in either.
MIN_PORTS_PER_NODE = 2
#: The most nodes one fleet can be: each needs MIN_PORTS_PER_NODE ports of the MAX_PORT.
MAX_FLEET_SIZE = MAX_PORT // MIN_PORTS_PER_NODE
#: Files a node holds open, counted from what it opens rather than measured: two
#: connections to the API (its liveness stream, and its registrations and heartbeats), and
#: for each of the MIN_PORTS_PER_NODE engines it has ports for, the engine's listening
#: socket and both ends of the readiness probe's connection to it (engine and probe are
#: both in this process).
FILES_PER_NODE = 2 + 3 * MIN_PORTS_PER_NODE
#: Files the process holds whatever its size: its Temporal connection, the event loop's,
#: the log, the standard streams, with room to spare.
FILES_PER_PROCESS = 64
#: The shard manager's own timeout for a readiness probe (agent.shards.ShardManager).
PROBE_TIMEOUT = httpx.Timeout(10.0)
#: The agent's own timeout for a call to the API (agent.main.run_agent's client).
API_TIMEOUT = httpx.Timeout(5.0)
#: How often the heartbeat samples are appended to their file, and how often the fleet
#: says how many of its nodes poll their task queues until all do.
FLUSH_INTERVAL_S = 0.5
#: The sims' own lines (one per start and stop, a thousand nodes' worth) are left out
#: below this level: the fleet's log is the agents' log.
SIM_LOG_LEVEL = logging.WARNING


class Mortal:
    """What a simulated node's activities drive (an :class:`activities.node.ShardRunner`
    over its shard manager) until the node dies; then every call in flight, and every call
    after, hangs without an answer, as on a node killed with kill -9, until the fleet
    stops (:meth:`release`)."""

    def __init__(self, manager: ShardManager) -> None:
        self._manager = manager
        self._dead = asyncio.Event()
        self._released = asyncio.Event()

    def die(self) -> None:
        self._dead.set()

    def release(self) -> None:
        """The fleet stops: let the dead node's calls end (they end cancelled)."""
        self._released.set()

    async def start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                    on_queued: Callable[[int, list[ReplicaId]], None] | None = None,
                    answer_within_s: float | None = None) -> ShardEndpoint:
        return await self._unless_dead(self._manager.start(
            spec, on_progress, on_queued=on_queued, answer_within_s=answer_within_s))

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit:
        return await self._unless_dead(self._manager.watch(replica_id, heartbeat))

    async def stop(self, replica_id: ReplicaId, grace_s: float) -> ShardExit:
        return await self._unless_dead(self._manager.stop(replica_id, grace_s))

    async def sleep(self, replica_id: ReplicaId) -> None:
        await self._unless_dead(self._manager.sleep(replica_id))

    async def wake(self, replica_id: ReplicaId, heartbeat: Callable[[], None], *,
                   answer_within_s: float | None = None) -> None:
        await self._unless_dead(self._manager.wake(replica_id, heartbeat,
                                                   answer_within_s=answer_within_s))

    def reports(self) -> list[ShardReport]:
        return self._manager.reports()

    async def _unless_dead(self, call: Awaitable[T]) -> T:
        task = asyncio.ensure_future(call)
        if not self._dead.is_set():
            death = asyncio.ensure_future(self._dead.wait())
            try:
                await asyncio.wait({task, death}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                # Cancelled by its workflow while the node lives: as without this wrapper.
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise
            finally:
                death.cancel()
            if not self._dead.is_set():
                return task.result()
        # Dead: whatever it was doing dies with it, heartbeats included, and nothing answers.
        task.cancel()
        await self._limbo()

    async def _limbo(self) -> NoReturn:
        while not self._released.is_set():
            # A dead node answers nothing, not even its worker's cancellation at shutdown.
            with contextlib.suppress(asyncio.CancelledError):
                await self._released.wait()
        raise asyncio.CancelledError


@dataclass
class SimulatedNode:
    """One node of the fleet: the agent's :class:`Node`, and what makes it die."""

    node: Node
    sims: InProcessSims
    mortal: Mortal
    #: The node's client to the API (registration, heartbeats, the liveness stream) and
    #: its shard manager's, for readiness probes.
    api: httpx.AsyncClient
    probes: httpx.AsyncClient
    run: NodeRun = field(default_factory=NodeRun)
    task: asyncio.Task[None] | None = None
    dead: bool = False

    def kill(self) -> int:
        """Die at once (see the module docstring); how many engines it ran."""
        self.dead = True
        self.mortal.die()
        engines = self.sims.kill_all()
        if self.run.liveness is not None:
            self.run.liveness.cancel()
        if self.task is not None:
            # Stops the heartbeats; the worker then stops polling and waits, for ever,
            # on activities that will not answer.
            self.task.cancel()
        return engines


@dataclass
class Heartbeats:
    """Heartbeat round trips, appended to a CSV file a few times a second."""

    path: Path
    pending: list[str] = field(default_factory=list)

    def observer(self, index: int) -> Callable[[float, float], None]:
        def seen(sent_at: float, latency_s: float) -> None:
            self.pending.append(f"{sent_at:.3f},{latency_s:.4f},{index}\n")
        return seen

    def flush(self) -> None:
        if not self.pending:
            return
        lines, self.pending = self.pending, []
        with self.path.open("a") as out:
            out.writelines(lines)


def fleet_size_problem(size: int, *, open_files: int | None) -> str | None:
    """Why a fleet of ``size`` nodes cannot run in a process that may hold ``open_files``
    files open (None: no limit); None when it can. The rules, in order: at least 1 node;
    at most :data:`MAX_FLEET_SIZE`, the ports there are; at most what ``open_files`` holds
    at :data:`FILES_PER_NODE` a node, after :data:`FILES_PER_PROCESS`."""
    if size < 1:
        return f"--fleet {size}: a fleet has at least 1 node"
    if size > MAX_FLEET_SIZE:
        return (f"--fleet {size}: a fleet has at most {MAX_FLEET_SIZE} nodes "
                f"({MIN_PORTS_PER_NODE} engine ports each, of the {MAX_PORT} there are)")
    if open_files is not None:
        most = max(0, (open_files - FILES_PER_PROCESS) // FILES_PER_NODE)
        if size > most:
            return (f"--fleet {size}: {size} nodes hold about "
                    f"{size * FILES_PER_NODE + FILES_PER_PROCESS} files open "
                    f"({FILES_PER_NODE} a node), and this process may open {open_files} "
                    f"(ulimit -n): at most {most} nodes; raise ulimit -n or run fewer")
    return None


def open_files_limit() -> int | None:
    """How many files this process may hold open (the soft RLIMIT_NOFILE); None: no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def port_ranges(low: int, high: int, size: int) -> list[tuple[int, int]]:
    """``size`` equal, disjoint ranges out of ``low-high``; an AgentConfigError when each
    would get fewer than :data:`MIN_PORTS_PER_NODE`."""
    count = high - low + 1
    per_node = count // size
    if per_node < MIN_PORTS_PER_NODE:
        fewer = count // MIN_PORTS_PER_NODE
        raise AgentConfigError(
            f"--engine-port-range {low}-{high}: {count} port(s) for --fleet {size} is fewer "
            f"than {MIN_PORTS_PER_NODE} a node; give a range of at least "
            f"{size * MIN_PORTS_PER_NODE} ports"
            + (f", or at most --fleet {fewer}" if fewer >= 1 else ""))
    return [(low + i * per_node, low + (i + 1) * per_node - 1) for i in range(size)]


def node_names(prefix: str, size: int) -> list[str]:
    """``prefix-0001`` ... : numbered from 1, zero-padded so that they sort."""
    width = max(4, len(str(size)))
    return [f"{prefix}-{i:0{width}d}" for i in range(1, size + 1)]


class SimulatedFleet:
    """N simulated nodes in this process (see the module docstring)."""

    def __init__(self, settings: Settings, size: int) -> None:
        problem = fleet_size_problem(size, open_files=open_files_limit())
        if problem is not None:
            raise AgentConfigError(problem)
        memory = declared_memory(settings)
        if memory is None:
            raise AgentConfigError(f"--fleet {size}: give each simulated node its capacity "
                                   "with --memory SIZE (it reads none from this machine)")
        try:
            join_token = read_join_token(settings)
        except ValueError as exc:
            raise AgentConfigError(str(exc)) from None
        ports = engine_port_range(settings)
        ranges = port_ranges(ports.low, ports.high, size)
        prefix = settings.node_name or socket.gethostname()
        names = node_names(prefix, size)
        # Every name has the prefix and the same length: if one passes, all do.
        if (problem := node_name_problem(names[-1])) is not None:
            raise AgentConfigError(f"--name {prefix!r}: --fleet {size} names the nodes "
                                   f"{names[0]} to {names[-1]}, and {problem}")
        self.settings = settings
        self.dir = writable_agent_dir(settings, FLEET_DIR)
        self.heartbeats = Heartbeats(self.dir / HEARTBEATS_FILE)
        host = advertised_engine_host(settings)
        cpus = settings.node_cpus or os.cpu_count() or 1
        tls = httpx.create_ssl_context()
        policy = source_policy(settings)
        self.nodes: list[SimulatedNode] = []
        for name, (low, high) in zip(names, ranges, strict=True):
            node_dir = self.dir / name
            node_id = load_or_create_node_id(node_dir)
            # In-process engines die with the process that served them: there is nothing
            # to adopt, and the records of the last run only describe what is gone.
            shutil.rmtree(node_dir / "shards", ignore_errors=True)
            sims = InProcessSims()
            probes = httpx.AsyncClient(timeout=PROBE_TIMEOUT, verify=tls)
            manager = ShardManager(
                node_id=node_id, agent_dir=node_dir, engine_host=host,
                port_range=(low, high),
                max_concurrent_startups=settings.max_concurrent_startups,
                available_memory=_available(memory, sims), launcher=sims, http=probes,
                source_policy=policy)
            node = Node(node_id=node_id, name=name, labels=settings.node_labels,
                        identity=NodeIdentity(node_dir, join_token), manager=manager,
                        inventory=_inventory(memory, cpus, sims), engine_host=host,
                        engine_ports=PortRange(low=low, high=high))
            api = httpx.AsyncClient(base_url=settings.api_url, timeout=API_TIMEOUT,
                                    verify=tls)
            self.nodes.append(SimulatedNode(node, sims, Mortal(manager), api, probes))

    def by_key(self) -> dict[str, SimulatedNode]:
        """Each node under its name and under its id."""
        keyed = {n.node.name: n for n in self.nodes}
        keyed.update({n.node.node_id: n for n in self.nodes})
        return keyed

    def kill_listed(self) -> None:
        """Kill every node the kill file names (SIGUSR1), and say so in ``killed.json``."""
        try:
            wanted = [w.strip() for w in (self.dir / KILL_FILE).read_text().splitlines()]
        except OSError as exc:
            log.error("SIGUSR1 but no kill list to read: %s", exc)
            return
        keyed = self.by_key()
        unknown = [w for w in wanted if w and w not in keyed]
        victims = [keyed[w] for w in wanted if w in keyed and not keyed[w].dead]
        at = time.time()
        engines = sum(victim.kill() for victim in victims)
        record = {"at": at, "nodes": [{"name": v.node.name, "node_id": v.node.node_id}
                                      for v in victims],
                  "engines": engines, "unknown": unknown}
        tmp = self.dir / (KILLED_FILE + ".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(self.dir / KILLED_FILE)
        log.warning("killed %d node(s) at once, with %d engine(s)%s", len(victims), engines,
                    f"; not in this fleet: {', '.join(unknown)}" if unknown else "")

    async def run(self, stop: asyncio.Event) -> None:
        """Run every node until ``stop``; then stop every engine (in-process engines
        cannot outlive this process, so none is left for a next agent to adopt)."""
        settings = self.settings
        temporal = TemporalClients(settings)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.kill_listed)
        flusher = asyncio.create_task(self._flush_and_count(stop))
        try:
            for index, sim in enumerate(self.nodes, start=1):
                sim.task = asyncio.create_task(run_node(
                    sim.node, settings, stop, http=sim.api, temporal=temporal,
                    activities=sim.mortal, run=sim.run,
                    on_heartbeat=self.heartbeats.observer(index)),
                    name=f"node {sim.node.name}")
            await stop.wait()
            for sim in self.nodes:
                if sim.dead:
                    sim.mortal.release()
            results = await asyncio.gather(*(s.task for s in self.nodes if s.task),
                                           return_exceptions=True)
            for sim, result in zip(self.nodes, results, strict=True):
                if isinstance(result, Exception):
                    log.error("node %s ended with %s: %s", sim.node.name,
                              type(result).__name__, result)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            self.heartbeats.flush()
            running = sum(len(s.node.manager.reports()) for s in self.nodes if not s.dead)
            log.info("stopping the %d engine(s) of the fleet's live nodes", running)
            await asyncio.gather(*(s.node.manager.stop_all(STOP_ON_EXIT_GRACE_S)
                                   for s in self.nodes if not s.dead))
            await self.close()

    async def close(self) -> None:
        """Close every node's HTTP clients (engines are :meth:`run`'s to stop)."""
        for sim in self.nodes:
            await sim.node.manager.close()
            await sim.api.aclose()
            await sim.probes.aclose()

    async def _flush_and_count(self, stop: asyncio.Event) -> None:
        started = time.monotonic()
        polling = 0
        while not stop.is_set():
            self.heartbeats.flush()
            if polling < len(self.nodes):
                polling = sum(1 for s in self.nodes if s.run.worker is not None)
                if polling == len(self.nodes):
                    log.info("all %d nodes registered and polling, %.1fs after start",
                             polling, time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FLUSH_INTERVAL_S)


def _available(declared: int, sims: InProcessSims) -> Callable[[], int]:
    return lambda: max(0, declared - sims.held_bytes())


def _inventory(declared: int, cpus: int, sims: InProcessSims) -> Callable[[], Inventory]:
    def read() -> Inventory:
        return Inventory(memory_total_bytes=declared,
                         memory_available_bytes=max(0, declared - sims.held_bytes()),
                         cpu_count=cpus, gpus=[])
    return read


async def run_fleet(settings: Settings, stop: asyncio.Event, *, size: int) -> None:
    """Run ``size`` simulated nodes until ``stop`` is set (``python -m bench.fleet``)."""
    logging.getLogger("agent.engines.sim_server").setLevel(SIM_LOG_LEVEL)
    fleet = SimulatedFleet(settings, size)
    log.info("fleet of %d simulated nodes (%s ... %s), %s each, in-process sim engines",
             size, fleet.nodes[0].node.name, fleet.nodes[-1].node.name, settings.node_memory)
    await fleet.run(stop)

