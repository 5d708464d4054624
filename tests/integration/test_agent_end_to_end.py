"""Agents against the real API, a real Temporal server and real llama.cpp (SmolLM2)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import pytest
import uvicorn
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from agent.main import run_agent
from api.app import create_app
from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.infra.processes import free_port
from modelkeeper.names import node_task_queue
from modelkeeper.settings import Settings
from tests.support.node_keys import key_epoch

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
    from modelkeeper.domain.shards import (
        EngineKind,
        ShardEndpoint,
        ShardExit,
        ShardReport,
        ShardSpec,
        StartShardInput,
        WatchShardInput,
    )

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SECRET = "e2e-secret"


@workflow.defn(sandboxed=False)  # test-only driver; the module imports httpx
class DriveShard:
    """Calls one node activity on a node's queue and returns its result."""

    @workflow.run
    async def run(self, args: list[Any]) -> Any:
        name, queue, payload = args
        return await workflow.execute_activity(
            name, args=[] if payload is None else [payload], task_queue=queue,
            start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_attempts=1))


class Cluster:
    """The API on a real port, and agents as tasks in this event loop."""

    def __init__(self, env: WorkflowEnvironment, database_url: str, tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        port = free_port()
        self.api_url = f"http://127.0.0.1:{port}"
        client = env.client
        self.settings = Settings(
            database_url=database_url, api_port=port, api_url=self.api_url,
            temporal_address=client.service_client.config.target_host,
            temporal_namespace=client.namespace, engine_key_secret=SECRET,
            heartbeat_interval_s=0.5, api_auth=False)
        self.agents: dict[str, tuple[asyncio.Event, asyncio.Task[None]]] = {}
        self.driver_queue = f"driver-{uuid.uuid4()}"

    async def start_api(self) -> None:
        config = uvicorn.Config(create_app(self.settings), host="127.0.0.1",
                                port=self.settings.api_port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.server_task = asyncio.create_task(self.server.serve())
        await _until(lambda: self.server.started)

    def start_agent(self, name: str, **overrides: Any) -> None:
        low = free_port()
        settings = self.settings.model_copy(update={
            "data_dir": self.tmp / name, "node_name": name,
            "engine_port_range": f"{low}-{low + 10}", **overrides})
        stop = asyncio.Event()
        self.agents[name] = (stop, asyncio.create_task(run_agent(settings, stop)))

    async def stop_agent(self, name: str) -> None:
        stop, task = self.agents.pop(name)
        stop.set()
        await asyncio.wait_for(task, 30)

    async def nodes(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=self.api_url) as http:
            result: list[dict[str, Any]] = (await http.get("/nodes")).json()
            return result

    async def node_id(self, name: str) -> NodeId:
        await _until_async(lambda: self._has_node(name))
        return NodeId(next(n["node_id"] for n in await self.nodes() if n["name"] == name))

    async def _has_node(self, name: str) -> bool:
        return any(n["name"] == name for n in await self.nodes())

    async def call(self, node_id: NodeId, activity: str, payload: Any,
                   result_type: type) -> Any:
        raw = await self.env.client.execute_workflow(
            "DriveShard", [activity, node_task_queue(node_id), payload],
            id=f"drive-{uuid.uuid4()}", task_queue=self.driver_queue)
        if isinstance(raw, list):
            return [result_type.model_validate(item) for item in raw]
        return result_type.model_validate(raw)

    async def close(self) -> None:
        for name in list(self.agents):
            await self.stop_agent(name)
        self.server.should_exit = True
        await asyncio.wait_for(self.server_task, 10)


async def _until(check: Callable[[], bool], timeout: float = 30) -> None:
    async def wrapped() -> bool:
        return check()

    await _until_async(wrapped, timeout)


async def _until_async(check: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def _kill_engines_of(tmp: Path) -> None:
    """Safety net: engines outlive agents by design, so the test cleans them up."""
    for proc in psutil.process_iter(["pid"]):
        try:
            cwd_env = proc.environ().get("MODELKEEPER_NODE_ID")
        except psutil.Error:
            continue
        if cwd_env and any((tmp / d / "agent" / "node_id").exists() and
                           (tmp / d / "agent" / "node_id").read_text().strip() == cwd_env
                           for d in os.listdir(tmp)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


async def claim(database_url: str, node_id: str, replica_id: str) -> None:
    """A deployment whose one replica claims memory on ``node_id``, as placement leaves it
    (an engine whose replica holds no claim on its node is stopped at the next heartbeat)."""
    conn = await asyncpg.connect(database_url)
    try:
        model, deployment = f"m-{replica_id}", f"d-{replica_id}"
        await conn.execute("INSERT INTO models (model_id, engine, source, memory_bytes) "
                           "VALUES ($1, 'sim', 'sim', 314572800)", model)
        await conn.execute("INSERT INTO deployments (deployment_id, model_id, replicas, "
                           "workflow_id) VALUES ($1, $2, 1, $3)", deployment, model,
                           f"wf-{deployment}")
        await conn.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                           "VALUES ($1, $2, 'starting')", replica_id, deployment)
        await conn.execute("INSERT INTO allocations (replica_id, node_id, rank, memory_bytes) "
                           "VALUES ($1, $2, 0, 314572800)", replica_id, node_id)
    finally:
        await conn.close()


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


async def test_llamacpp_shard_serves_survives_agent_restart_and_reports_exit(
    cluster: Cluster,
) -> None:
    cluster.start_agent("alpha")
    node = await cluster.node_id("alpha")
    [info] = await cluster.nodes()
    assert info["state"] == "ready" and info["memory_total_bytes"] > 0 and info["cpu_count"] >= 1

    spec = ShardSpec(replica_id=ReplicaId("rep-1"), model_id=ModelId("smollm2-135m"),
                     node_id=node, engine=EngineKind.LLAMACPP, source="smollm2",
                     memory_bytes=300 << 20, start_timeout_s=60)
    # The claim placement would have made: an engine whose replica holds no claim on its
    # node is stopped at the next heartbeat (HeartbeatAnswer).
    await claim(cluster.settings.database_url or "", node, "rep-1")
    endpoint = await cluster.call(node, "start_shard", StartShardInput(spec=spec), ShardEndpoint)
    assert endpoint.url is not None
    key = replica_engine_key(SECRET.encode(), node_id=node, replica_id="rep-1",
                             key_epoch=await key_epoch(cluster.settings.database_url or "",
                                                       node))
    async with httpx.AsyncClient(base_url=endpoint.url, timeout=60) as http:
        chat = await http.post(
            "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": "smollm2-135m", "max_tokens": 8,
                  "messages": [{"role": "user", "content": "Say hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]
        assert (await http.post("/v1/chat/completions", json={"messages": []})).status_code == 401

    # Kill the agent and start it again: the engine is adopted, same pid and port.
    await cluster.stop_agent("alpha")
    assert psutil.pid_exists(endpoint.pid)
    cluster.start_agent("alpha")
    reports = await _eventually_reports(cluster, node)
    assert [(r.replica_id, r.pid, r.port, r.adopted) for r in reports] == [
        ("rep-1", endpoint.pid, endpoint.port, True)]

    # Kill the engine: watch_shard returns with the classification and the log tail.
    watch = asyncio.create_task(cluster.call(
        node, "watch_shard", WatchShardInput(replica_id=ReplicaId("rep-1")), ShardExit))
    await asyncio.sleep(0)
    os.killpg(endpoint.pid, signal.SIGKILL)
    ended = await asyncio.wait_for(watch, 30)
    assert ended.replica_id == "rep-1"
    assert ended.kind == "vanished"  # adopted: not our child, so no exit code to read
    assert ended.log_tail


async def _eventually_reports(cluster: Cluster, node: NodeId) -> list[ShardReport]:
    for _ in range(100):
        try:
            reports: list[ShardReport] = await cluster.call(node, "list_shards", None,
                                                            ShardReport)
            return reports
        except Exception:  # noqa: BLE001 - the restarted agent may not poll yet
            await asyncio.sleep(0.1)
    raise AssertionError("restarted agent never answered list_shards")


async def test_four_agents_with_declared_capacities_side_by_side(cluster: Cluster) -> None:
    sizes = {"n8": "8GiB", "n16": "16GiB", "n32": "32GiB", "nold": None}
    for name, memory in sizes.items():
        cluster.start_agent(name, node_memory=memory, node_cpus=2,
                            node_labels={"size": name})
    for name in sizes:
        await cluster.node_id(name)
    nodes = {n["name"]: n for n in await cluster.nodes()}
    assert nodes["n8"]["memory_total_bytes"] == 8 << 30
    assert nodes["n16"]["memory_total_bytes"] == 16 << 30
    assert nodes["n32"]["memory_total_bytes"] == 32 << 30
    assert all(n["cpu_count"] == 2 and n["state"] == "ready" for n in nodes.values())
    assert nodes["n32"]["labels"] == {"size": "n32"}

    # Operator settings outrank the agent's and survive re-registration.
    async with httpx.AsyncClient(base_url=cluster.api_url) as http:
        patched = await http.patch(f"/nodes/{nodes['n8']['node_id']}",
                                   json={"labels": {"size": "small"}, "cordoned": True,
                                         "cordon_reason": "ECC errors"})
        assert patched.status_code == 200
    await cluster.stop_agent("n8")
    cluster.start_agent("n8", node_memory="8GiB", node_cpus=2, node_labels={"size": "n8"})
    await asyncio.sleep(0)
    async def re_registered() -> bool:
        n = {x["name"]: x for x in await cluster.nodes()}["n8"]
        return bool(n["last_seen"] > nodes["n8"]["last_seen"])

    await _until_async(re_registered)
    after = {n["name"]: n for n in await cluster.nodes()}["n8"]
    assert after["state"] == "cordoned" and after["labels"] == {"size": "small"}
    assert after["cordon_reason"] == "ECC errors"
