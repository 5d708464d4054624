"""The keeper end to end: the real API, the real worker, real Temporal and PostgreSQL,
three real agent processes and sim engines. Deploy, kill -9 the agent holding the
replica, watch it move, delete, and check nothing comes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from cli.main import build_parser
from cli.operator_cli import run_operator_command
from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.settings import Settings
from tests.support.node_keys import key_epoch
from worker.main import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SECRET = "keeper-e2e-secret"
GiB = 1 << 30


class Stack:
    def __init__(self, env: WorkflowEnvironment, database_url: str, tmp: Path) -> None:
        port = free_port()
        client = env.client
        self.tmp = tmp
        self.temporal = client
        self.api_url = f"http://127.0.0.1:{port}"
        self.settings = Settings(
            database_url=database_url, api_port=port, api_url=self.api_url,
            temporal_address=client.service_client.config.target_host,
            temporal_namespace=client.namespace, engine_key_secret=SECRET,
            heartbeat_interval_s=0.5, node_unreachable_after_s=2.0,
            replica_lost_after_s=4.0, settling_window_s=0.0, cant_place_retry_s=30.0,
            api_auth=False)
        self.agents: dict[str, ManagedProcess] = {}
        self.http = httpx.AsyncClient(base_url=self.api_url, timeout=30)

    async def start(self) -> None:
        self.stop_worker = asyncio.Event()
        self.worker = asyncio.create_task(run_worker(self.settings, self.stop_worker))
        config = uvicorn.Config(create_app(self.settings), host="127.0.0.1",
                                port=self.settings.api_port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.server_task = asyncio.create_task(self.server.serve())
        await until(lambda: self.server.started)

    async def restart_worker(self) -> None:
        self.stop_worker.set()
        await asyncio.wait_for(self.worker, 30)
        self.stop_worker = asyncio.Event()
        self.worker = asyncio.create_task(run_worker(self.settings, self.stop_worker))

    def start_agent(self, name: str, memory: str) -> None:
        low = free_port()
        env = {**os.environ, "MODELKEEPER_API_URL": self.api_url,
               "MODELKEEPER_ENGINE_KEY_SECRET": SECRET,
               "MODELKEEPER_HEARTBEAT_INTERVAL_S": "0.5"}
        proc = ManagedProcess(
            f"agent {name}",
            [sys.executable, "-m", "modelkeeper", "agent", "--data-dir",
             str(self.tmp / name), "--name", name, "--memory", memory,
             "--engine-port-range", f"{low}-{low + 20}"],
            self.tmp / f"{name}.log", env=env)
        proc.start()
        self.agents[name] = proc

    async def get(self, path: str) -> Any:
        resp = await self.http.get(path)
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def close(self) -> None:
        for proc in self.agents.values():
            proc.stop(grace=5)
        self.server.should_exit = True
        self.stop_worker.set()
        await asyncio.wait_for(asyncio.gather(self.server_task, self.worker), 30)
        await self.http.aclose()
        # Engines outlive their agents by design; the test owns their cleanup. Only engines
        # of this test's agents: other tests' engines may be running beside it.
        ours = {(self.tmp / name / "agent" / "node_id").read_text().strip()
                for name in self.agents
                if (self.tmp / name / "agent" / "node_id").exists()}
        for proc in psutil.process_iter(["pid"]):
            try:
                node = proc.environ().get("MODELKEEPER_NODE_ID")
            except psutil.Error:
                continue
            if node in ours:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


async def until(check: Any, timeout: float = 60, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(interval)


@pytest.fixture
async def stack(local_temporal_env: WorkflowEnvironment, database_url: str,
                tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(local_temporal_env, database_url, tmp_path)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def _deployment(stack: Stack, deployment_id: str) -> dict[str, Any]:
    result: dict[str, Any] = await stack.get(f"/deployments/{deployment_id}")
    return result


async def test_deploy_survive_agent_kill_and_delete(stack: Stack) -> None:
    for name, memory in (("n8", "8GiB"), ("n16", "16GiB"), ("n32", "32GiB")):
        stack.start_agent(name, memory)
    await until(lambda: _count_nodes(stack, 3))
    nodes = {n["node_id"]: n["name"] for n in await stack.get("/nodes")}

    resp = await stack.http.post("/models", json={
        "model_id": "sim-12g", "engine": "sim", "source": "sim", "memory_bytes": 12 * GiB,
        "engine_args": {"memory_bytes": 1 << 20}})
    assert resp.status_code == 201, resp.text
    resp = await stack.http.post("/deployments", json={"model_id": "sim-12g"})
    assert resp.status_code == 201, resp.text
    deployment_id = resp.json()["deployment_id"]
    # One deployment per model, even for a second request.
    again = await stack.http.post("/deployments", json={"model_id": "sim-12g"})
    assert again.status_code == 409

    view = await until(lambda: _serving(stack, deployment_id))
    [replica] = view["replicas"]
    first_node = nodes[replica["nodes"][0]]
    assert first_node == "n16"  # bin-packed: the tightest node that fits
    await _assert_serves(stack, replica)

    # Restart the worker mid-flight: nothing is placed twice, nothing is lost.
    await stack.restart_worker()
    await asyncio.sleep(0)
    again_view = await _deployment(stack, deployment_id)
    assert [r["replica_id"] for r in again_view["replicas"]] == [replica["replica_id"]]

    # kill -9 the agent that holds the replica: placed again on another node, and served.
    killed_at = time.monotonic()
    os.killpg(stack.agents[first_node].pid, signal.SIGKILL)

    async def moved() -> dict[str, Any] | None:
        v = await _deployment(stack, deployment_id)
        ready = [r for r in v["replicas"] if r["state"] == "ready"]
        if ready and nodes[ready[0]["nodes"][0]] != first_node:
            return ready[0]
        return None

    new_replica = await until(moved, timeout=60)
    moved_in = time.monotonic() - killed_at
    # Exactly one replacement: the deployment never held more replicas than asked.
    placed = [e for e in await stack.get(f"/events?deployment_id={deployment_id}")
              if e["kind"] == "replica.placed"]
    assert len(placed) == 2, placed
    assert nodes[new_replica["nodes"][0]] == "n32"
    await _assert_serves(stack, new_replica)
    # Detection (3 s heartbeat timeout) + lost timeout (4 s) + load + 2 s.
    assert moved_in < 3 + 4 + 1 + 2 + 2, moved_in
    print(f"\nre-served on another node {moved_in:.1f}s after kill -9 of its agent")

    # Delete: everything stops, nothing comes back.
    resp = await stack.http.delete(f"/deployments/{deployment_id}")
    assert resp.status_code == 202
    assert (await stack.http.delete(f"/deployments/{deployment_id}")).status_code in (202, 404)

    async def gone() -> bool:
        return (await stack.http.get(f"/deployments/{deployment_id}")).status_code == 404

    await until(gone, timeout=60)
    assert await stack.get("/replicas") == []
    with pytest.raises(httpx.HTTPError):
        async with httpx.AsyncClient(timeout=2) as http:
            await http.get(f"{new_replica['endpoint']}/health")
    nodes_after = await stack.get("/nodes")
    assert all(n["memory_claimed_bytes"] == 0 for n in nodes_after
               if n["name"] != first_node)


async def test_cant_place_names_every_node_then_places_when_a_node_joins(
    stack: Stack,
) -> None:
    stack.start_agent("small", "8GiB")
    await until(lambda: _count_nodes(stack, 1))
    await stack.http.post("/models", json={
        "model_id": "big", "engine": "sim", "source": "sim", "memory_bytes": 64 * GiB,
        "engine_args": {"memory_bytes": 1 << 20}})
    resp = await stack.http.post("/deployments", json={"model_id": "big"})
    deployment_id = resp.json()["deployment_id"]

    async def cant_place() -> dict[str, Any] | None:
        v = await _deployment(stack, deployment_id)
        return v if v["status"] == "cant_place" else None

    view = await until(cant_place)
    metrics = (await stack.http.get("/metrics")).text
    series = f'deployment_id="{deployment_id}",model_id="big"'
    assert f"modelkeeper_deployment_cant_place{{{series}}} 1.0" in metrics
    assert f"modelkeeper_deployment_ready_replicas{{{series}}} 0.0" in metrics
    assert "node small: 8.0 GiB free, needs 64.0 GiB" in view["placement_error"]
    explained = await stack.get("/placement/explain?model_id=big")
    assert explained["fits"] is False and explained["nodes"][0]["reason"] == \
        "insufficient_memory"

    # The CLI shows the same, as a table and as JSON.
    lines: list[str] = []
    args = build_parser().parse_args(["explain", "big", "--api-url", stack.api_url])
    # In a thread: the CLI is synchronous, and the API runs on this test's event loop.
    assert await asyncio.to_thread(run_operator_command, args, stack.api_url,
                                   lines.append) == 0
    assert "cannot be placed" in lines[0] and "8.0 GiB free, needs 64.0 GiB" in lines[0]
    args = build_parser().parse_args(["ls", "--json", "--api-url", stack.api_url])
    await asyncio.to_thread(run_operator_command, args, stack.api_url, lines.append)
    assert json.loads(lines[-1])[0]["status"] == "cant_place"
    # Operators filter the workflows by status with the custom search attribute.
    found = [w.id async for w in stack.temporal.list_workflows(
        "DeploymentStatus = 'cant_place'")]
    assert found == [f"deployment/{deployment_id}"]

    stack.start_agent("huge", "64GiB")

    async def huge_registered() -> bool:
        return any(n["name"] == "huge" for n in await stack.get("/nodes"))

    await until(huge_registered, interval=0.02)
    joined_at = time.monotonic()

    async def placed() -> bool:
        return bool((await _deployment(stack, deployment_id))["replicas"])

    await until(placed, timeout=10, interval=0.02)
    placed_in = time.monotonic() - joined_at
    # The registration signals waiting deployments: placed at once, not at the 30 s timer.
    assert placed_in < 2.0, placed_in
    print(f"\nplaced {placed_in:.2f}s after the 64 GiB node registered")
    await until(lambda: _serving(stack, deployment_id), timeout=30)


async def _count_nodes(stack: Stack, n: int) -> bool:
    nodes = await stack.get("/nodes")
    return len([x for x in nodes if x["state"] == "ready"]) >= n


async def _serving(stack: Stack, deployment_id: str) -> dict[str, Any] | None:
    view = await _deployment(stack, deployment_id)
    return view if view["status"] == "serving" else None


async def _assert_serves(stack: Stack, replica: dict[str, Any]) -> None:
    # Derived as the gateway does: from the key of the node rank 0 runs on, in its epoch.
    node = replica["nodes"][0]
    key = replica_engine_key(SECRET.encode(), node_id=node, replica_id=replica["replica_id"],
                             key_epoch=await key_epoch(stack.settings.database_url or "",
                                                       node))
    async with httpx.AsyncClient(base_url=replica["endpoint"], timeout=10) as http:
        resp = await http.post("/v1/chat/completions",
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": "sim-12g", "messages": [
                                   {"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
