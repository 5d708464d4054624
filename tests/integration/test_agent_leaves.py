"""Taking a node out for good: `modelkeeper agent --stop-engines-on-exit`, run as an
operator runs it (a process, stopped with SIGTERM), against the real API and Temporal.

Without the flag an agent leaves its engines for the next one to adopt
(test_agent_end_to_end), and says so; with it, the engines go with the agent. Its log
file, written while the API is away, stays a few plain lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelkeeper.domain.ids import ModelId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardEndpoint, ShardSpec, StartShardInput
from modelkeeper.infra.processes import free_port

from .test_agent_end_to_end import Cluster, DriveShard, _kill_engines_of, claim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: The sim engine holds this much real memory, whatever its claim.
SIM_BYTES = 64 * 1024**2
#: Long enough for the agent to fail its heartbeat and liveness stream many times over (a
#: heartbeat every 0.5 s here, a stream reopened within 2 s), and short enough for a test.
API_AWAY_S = 8.0


@pytest.fixture
async def cluster(local_temporal_env: WorkflowEnvironment, database_url: str,
                  tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(local_temporal_env, database_url, tmp_path)
    await c.start_api()
    async with Worker(local_temporal_env.client, task_queue=c.driver_queue,
                      workflows=[DriveShard]):
        try:
            yield c
        finally:
            await c.close()
            _kill_engines_of(tmp_path)


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _agent(cluster: Cluster, data_dir: Path, log_path: Path,
           *flags: str) -> subprocess.Popen[bytes]:
    """`modelkeeper agent` as a process of its own, as an operator starts it."""
    low = free_port()
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "modelkeeper", "agent", *flags,
             "--data-dir", str(data_dir), "--api-url", cluster.api_url,
             "--name", data_dir.name, "--memory", "2GiB",
             "--engine-port-range", f"{low}-{low + 10}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MODELKEEPER_HEARTBEAT_INTERVAL_S": "0.5"})


async def _start_sim(cluster: Cluster, name: str) -> ShardEndpoint:
    node = await cluster.node_id(name)
    spec = ShardSpec(replica_id=ReplicaId(f"{name}-1"), model_id=ModelId("sim-leave"),
                     node_id=node, engine=EngineKind.SIM, source="sim",
                     memory_bytes=SIM_BYTES, engine_args={"memory_bytes": SIM_BYTES},
                     start_timeout_s=60)
    await claim(cluster.settings.database_url or "", node, spec.replica_id)
    endpoint: ShardEndpoint = await cluster.call(node, "start_shard",
                                                 StartShardInput(spec=spec), ShardEndpoint)
    assert _alive(endpoint.pid)
    return endpoint


async def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return not _alive(pid)


def _kill(agent: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(10)


async def test_an_agent_stopped_plainly_leaves_its_engines_and_leave_stops_them(
        cluster: Cluster, tmp_path: Path) -> None:
    data_dir, log_path = tmp_path / "stayer", tmp_path / "stayer.log"
    agent = _agent(cluster, data_dir, log_path)
    try:
        endpoint = await _start_sim(cluster, "stayer")
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agent.wait, 60) == 0
    finally:
        _kill(agent)
    assert _alive(endpoint.pid), "engines outlive their agent by design"
    assert "leaving 1 engine(s) running for the next agent" in log_path.read_text()

    left = subprocess.run([sys.executable, "-m", "modelkeeper", "leave", "--data-dir",
                           str(data_dir)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert left.returncode == 0, left.stderr
    assert left.stdout.strip().endswith("stopped 1 engine(s); none left running"), left.stdout
    assert await _gone(endpoint.pid)


async def test_stop_engines_on_exit_stops_them_and_the_log_stays_plain(
        cluster: Cluster, tmp_path: Path) -> None:
    log_path = tmp_path / "leaver.log"
    agent = _agent(cluster, tmp_path / "leaver", log_path, "--stop-engines-on-exit")
    try:
        endpoint = await _start_sim(cluster, "leaver")

        # The API goes away: engines keep serving, the log says so in a few lines.
        # Forced: a graceful stop would wait for the agent's liveness stream to end.
        cluster.server.should_exit = cluster.server.force_exit = True
        await cluster.server_task
        await asyncio.sleep(API_AWAY_S)
        assert _alive(endpoint.pid)

        agent.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agent.wait, 60) == 0
        assert await _gone(endpoint.pid), "the engine outlived its agent"
    finally:
        _kill(agent)

    text = log_path.read_text()
    assert "stopping 1 engine(s) (--stop-engines-on-exit)" in text, text
    assert "stopped 1 engine(s); none left running" in text, text
    assert "\x1b[" not in text, text
    assert "Traceback" not in text, text
    # About 16 heartbeats and several stream reopenings failed; each kind gets a line at
    # once and one more after 5 s.
    failures = [line for line in text.splitlines() if "failed (" in line]
    assert 2 <= len(failures) <= 5, text
    assert all("Error" in line for line in failures), text


async def test_an_agent_whose_temporal_is_away_retries_in_one_line_each(
        local_temporal_env: WorkflowEnvironment, database_url: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.main")
    c = Cluster(local_temporal_env, database_url, tmp_path)
    # Registration works, and the API names a Temporal nobody listens on.
    c.settings = c.settings.model_copy(update={
        "agent_temporal_address": f"127.0.0.1:{free_port()}"})
    await c.start_api()
    try:
        c.start_agent("lonely")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _connect_failures(caplog):
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # several more attempts, every 0.2, 0.4, 0.8 s
        await c.stop_agent("lonely")  # a stop while retrying ends it at once
    finally:
        await c.close()
    [line] = _connect_failures(caplog)
    assert line.exc_info is None
    assert "retrying 127.0.0.1:" in line.getMessage()
    assert "RuntimeError: Failed client connect" in line.getMessage()


def _connect_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "agent.main" and "connecting to Temporal failed" in r.getMessage()]
