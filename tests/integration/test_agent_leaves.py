"""Taking a node out for good: `modelkeeper agent --stop-engines-on-exit`, run as an
operator runs it (a process, stopped with SIGTERM), against the real API and Temporal.

Without the flag an agent leaves its engines for the next one to adopt
(test_agent_end_to_end), and says so; with it, the engines go with the agent. Its log
file, written while the API is away, stays a few plain lines.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from .test_agent_end_to_end import Cluster, DriveShard, _kill_engines_of

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
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_stop_engines_on_exit_stops_them_and_the_log_stays_plain(
        cluster: Cluster, tmp_path: Path) -> None:
    low = free_port()
    log_path = tmp_path / "leaver.log"
    with open(log_path, "w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "modelkeeper", "agent", "--stop-engines-on-exit",
             "--data-dir", str(tmp_path / "leaver"), "--api-url", cluster.api_url,
             "--name", "leaver", "--memory", "2GiB",
             "--engine-port-range", f"{low}-{low + 10}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MODELKEEPER_HEARTBEAT_INTERVAL_S": "0.5"})
    try:
        node = await cluster.node_id("leaver")
        spec = ShardSpec(replica_id=ReplicaId("leaving-1"), model_id=ModelId("sim-leave"),
                         node_id=node, engine=EngineKind.SIM, source="sim",
                         memory_bytes=SIM_BYTES, engine_args={"memory_bytes": SIM_BYTES},
                         start_timeout_s=60)
        endpoint = await cluster.call(node, "start_shard", StartShardInput(spec=spec),
                                      ShardEndpoint)
        assert _alive(endpoint.pid)

        # The API goes away: engines keep serving, the log says so in a few lines.
        cluster.server.should_exit = True
        await cluster.server_task
        await asyncio.sleep(API_AWAY_S)
        assert _alive(endpoint.pid)

        agent.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agent.wait, 60) == 0
        deadline = time.monotonic() + 10
        while _alive(endpoint.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not _alive(endpoint.pid), "the engine outlived its agent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)

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
