"""Helpers for the gateway's integration tests: sim engines as real processes, rows in
the test database, and a gateway running in the test's event loop.

Every wait polls a real signal (a health check, the gateway's table) with a deadline;
nothing sleeps a fixed time hoping something happened meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from agent.engines.sim_server import API_KEY_ENV
from gateway.server import GatewayServer
from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.settings import Settings

SECRET = b"gateway-test-secret"
#: The node every test replica's endpoint is recorded against: the gateway derives each
#: engine's key from this node's key (modelkeeper.domain.engine_keys).
NODE = "n-gateway-test"
HOST = "127.0.0.1"
#: Generous: interpreters starting on a busy 2-core machine.
READY_TIMEOUT_S = 30.0


class Sim:
    """A sim engine process serving one replica."""

    def __init__(self, process: ManagedProcess, replica_id: str, port: int) -> None:
        self.process = process
        self.replica_id = replica_id
        self.port = port
        self.url = f"http://{HOST}:{port}"

    async def wait_healthy(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise RuntimeError(f"sim {self.replica_id} exited with {code}:\n"
                                       f"{self.process.log_tail()}")
                try:
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sim {self.replica_id} not healthy after {timeout}s")
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self.process.stop(grace=5)


def launch_sim(tmp_path: Path, replica_id: str, model: str, *flags: str,
               port: int | None = None) -> Sim:
    """Start a sim engine whose key is the one the gateway derives for ``replica_id``."""
    port = port or free_port()
    argv = [sys.executable, "-m", "agent.engines.sim_server", "--host", HOST,
            "--port", str(port), "--model", model, "--log-level", "INFO", *flags]
    # MODELKEEPER_DATA_DIR marks the sim as this test's: other tests' clean-ups kill
    # leftover engines by their environment, and must be able to tell ours apart.
    env = {**os.environ,
           API_KEY_ENV: replica_engine_key(SECRET, node_id=NODE, replica_id=replica_id),
           "MODELKEEPER_DATA_DIR": str(tmp_path)}
    process = ManagedProcess(f"sim-{replica_id}", argv, tmp_path / f"sim-{replica_id}.log",
                             env=env)
    process.start()
    return Sim(process, replica_id, port)


@asynccontextmanager
async def sims(tmp_path: Path, model: str, *replica_ids: str,
               flags: tuple[str, ...] = ()) -> AsyncIterator[list[Sim]]:
    """Healthy sims for ``replica_ids``, stopped on exit."""
    started = [launch_sim(tmp_path, rid, model, *flags) for rid in replica_ids]
    try:
        for sim in started:
            await sim.wait_healthy()
        yield started
    finally:
        for sim in started:
            sim.stop()


async def add_deployment(conn: asyncpg.Connection, model: str, *, status: str = "serving",
                         replicas: int = 1, placement_error: str | None = None,
                         last_failure: str | None = None,
                         consecutive_failures: int = 0) -> str:
    """A model and its deployment; returns the deployment id."""
    deployment_id = f"dep-{model}"
    await conn.execute(
        "INSERT INTO models (model_id, engine, source, memory_bytes) "
        "VALUES ($1, 'sim', 'sim', 1)", model)
    await conn.execute(
        "INSERT INTO deployments (deployment_id, model_id, replicas, status, placement_error, "
        "last_failure, consecutive_failures, workflow_id) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        deployment_id, model, replicas, status, placement_error, last_failure,
        consecutive_failures, f"deployment/{deployment_id}")
    return deployment_id


async def add_replica(conn: asyncpg.Connection, deployment_id: str, replica_id: str,
                      endpoint: str, state: str = "ready") -> None:
    """A replica row (the gateway is notified by the trigger of migration 0002), its
    endpoint recorded against :data:`NODE`, as the store records a checked one."""
    await conn.execute(
        "INSERT INTO replicas (replica_id, deployment_id, state, endpoint, endpoint_node_id) "
        "VALUES ($1, $2, $3, $4, $5)", replica_id, deployment_id, state, endpoint, NODE)


async def set_replica_state(conn: asyncpg.Connection, replica_id: str, state: str) -> None:
    await conn.execute("UPDATE replicas SET state = $2 WHERE replica_id = $1", replica_id,
                       state)


async def until(condition: Callable[[], bool], timeout: float = 10.0,
                what: str = "condition") -> None:
    """Poll ``condition`` until true, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def settings_for(database_url: str, **overrides: Any) -> Settings:
    """Gateway settings for a test: a free port, auth off unless asked for."""
    values: dict[str, Any] = {
        "database_url": database_url, "gateway_port": free_port(), "bind_host": HOST,
        "gateway_auth": False, "gateway_wait_for_replica_s": 2.0,
        "usage_flush_interval_s": 0.1, "log_level": "INFO",
    }
    values.update(overrides)
    return Settings(**values)


@asynccontextmanager
async def running_gateway(database_url: str, **overrides: Any) -> AsyncIterator[GatewayServer]:
    """A gateway worker in this event loop, stopped on exit."""
    server = GatewayServer(settings_for(database_url, **overrides), engine_key_secret=SECRET)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def ready_replicas(server: GatewayServer, model: str) -> list[str]:
    """The replica ids the gateway currently routes ``model`` to."""
    entry = server.gateway.table.models.get(model)
    return [] if entry is None else [e.replica_id for e in entry.endpoints]


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample's value from a Prometheus text exposition, or None if absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if "{" in series:
            metric_name, _, rest = series.partition("{")
            found = ",".join(sorted(rest.rstrip("}").split(",")))
        else:
            metric_name, found = series, ""
        if metric_name == name and found == wanted:
            return float(value)
    return None
