"""The memory watchdog end to end: a real agent declaring 800 MiB, a real sim engine that
grows its resident memory (POST /sim/grow) past the node's lines, the real API, a real
PostgreSQL and a real Temporal dev server.

* The agent measures the engine's real resident memory at each heartbeat; the API records
  ok -> warn, then warn -> critical, each as an event, a level on GET /nodes and a metric.
* With auto_protect, the lowest-class replica on the node (opportunistic, though it is the
  smallest there) is preempted once: one audit event, and one ``preempt`` signal to its
  deployment's workflow (a recorder standing in for the lead's DeploymentWorkflow.preempt,
  on the same Temporal server), however many critical heartbeats follow.

At most ~700 MiB is allocated: the machine is shared.
"""

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
import pytest
import uvicorn
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from agent.main import run_agent
from agent.watchdog import tree_rss
from api.app import create_app
from modelkeeper.domain.capacity import PreemptRequest
from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardEndpoint, ShardSpec, StartShardInput
from modelkeeper.infra.processes import free_port
from modelkeeper.names import SIGNAL_PREEMPT, deployment_workflow_id, node_task_queue
from modelkeeper.settings import Settings
from tests.support.node_keys import key_epoch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SECRET = "watchdog-secret"
MIB = 1 << 20
NODE_MEMORY = 800 * MIB
#: A quarter of the node (watchdog_margin_fraction below): critical under 200 MiB
#: available, warn under 300 MiB.
MARGIN = NODE_MEMORY // 4
#: What the engine grows to: 250 MiB left (warn), then 120 MiB left (critical).
WARN_RSS = NODE_MEMORY - 250 * MIB
CRITICAL_RSS = NODE_MEMORY - 120 * MIB
#: Heartbeats the test lets pass at critical after the stop, to see that it is not repeated.
MORE_HEARTBEATS = 4


@workflow.defn(sandboxed=False)  # test-only driver; the module imports httpx
class DriveShard:
    """Calls one node activity on a node's queue and returns its result."""

    @workflow.run
    async def run(self, args: list[Any]) -> Any:
        name, queue, payload = args
        return await workflow.execute_activity(
            name, args=[payload], task_queue=queue,
            start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_attempts=1))


@workflow.defn(sandboxed=False)
class PreemptRecorder:
    """Stands in for a deployment's workflow: keeps every ``preempt`` signal it gets."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name=SIGNAL_PREEMPT)
    def preempt(self, request: dict[str, Any]) -> None:
        self.received.append(request)

    @workflow.query
    def requests(self) -> list[dict[str, Any]]:
        return self.received


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 45) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def _claims(database_url: str, node_id: str) -> None:
    """Three deployments with a replica each claiming on the node, as placement leaves
    them: rep-grow (standard) runs the engine that grows; rep-crit (critical, the largest)
    and rep-opp (opportunistic, the smallest) run none (no engine needed to be chosen)."""
    conn = await asyncpg.connect(database_url)
    try:
        for name, cls, claim_mib in (("grow", "standard", 300), ("crit", "critical", 350),
                                     ("opp", "opportunistic", 100)):
            await conn.execute("INSERT INTO models (model_id, engine, source, memory_bytes) "
                               "VALUES ($1, 'sim', 'sim', $2)", f"m-{name}", claim_mib * MIB)
            await conn.execute(
                "INSERT INTO deployments (deployment_id, model_id, replicas, workflow_id, "
                "capacity_class) VALUES ($1, $2, 1, $3, $4)", f"d-{name}", f"m-{name}",
                deployment_workflow_id(DeploymentId(f"d-{name}")), cls)
            await conn.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                               "VALUES ($1, $2, 'ready')", f"rep-{name}", f"d-{name}")
            await conn.execute("INSERT INTO allocations (replica_id, node_id, rank, "
                               "memory_bytes) VALUES ($1, $2, 0, $3)", f"rep-{name}", node_id,
                               claim_mib * MIB)
    finally:
        await conn.close()


def _kill_engine(pid: int) -> None:
    """Engines outlive agents by design: the test stops its own."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@pytest.fixture
async def settings(local_temporal_env: WorkflowEnvironment, database_url: str,
                   tmp_path: Path) -> Settings:
    client = local_temporal_env.client
    port = free_port()
    low = free_port()
    return Settings(
        database_url=database_url, api_port=port, api_url=f"http://127.0.0.1:{port}",
        temporal_address=client.service_client.config.target_host,
        temporal_namespace=client.namespace, engine_key_secret=SECRET,
        heartbeat_interval_s=0.3, api_auth=False, data_dir=tmp_path / "box",
        node_name="box", node_memory=f"{NODE_MEMORY}", engine_port_range=f"{low}-{low + 10}",
        watchdog_margin_fraction=MARGIN / NODE_MEMORY, watchdog_auto_protect=True)


@pytest.fixture
async def stack(settings: Settings,
                local_temporal_env: WorkflowEnvironment) -> AsyncIterator[str]:
    """The API and one agent; yields the driver's task queue."""
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1",
                                           port=settings.api_port, log_level="warning"))
    served = asyncio.create_task(server.serve())
    stop = asyncio.Event()
    agent: asyncio.Task[None] | None = None
    queue = f"driver-{uuid.uuid4()}"
    try:
        async def started() -> bool:
            return bool(server.started)

        await _until(started)
        agent = asyncio.create_task(run_agent(settings, stop))
        async with Worker(local_temporal_env.client, task_queue=queue,
                          workflows=[DriveShard, PreemptRecorder]):
            yield queue
    finally:
        stop.set()
        if agent is not None:
            await asyncio.wait_for(agent, 30)
        server.should_exit = True
        await asyncio.wait_for(served, 10)


async def test_a_growing_engine_takes_its_node_to_warn_then_critical_and_the_lowest_class_is_preempted_once(  # noqa: E501
    settings: Settings, stack: str, local_temporal_env: WorkflowEnvironment,
) -> None:
    client = local_temporal_env.client
    api = httpx.AsyncClient(base_url=settings.api_url, timeout=10)

    async def node() -> dict[str, Any]:
        nodes = (await api.get("/nodes")).json()
        return next((n for n in nodes if n["name"] == "box"), {})

    await _until(lambda: _has(node))
    node_id = NodeId((await node())["node_id"])
    await _claims(settings.database_url or "", node_id)
    recorder = await client.start_workflow(
        PreemptRecorder.run, id=deployment_workflow_id(DeploymentId("d-opp")), task_queue=stack)

    spec = ShardSpec(replica_id=ReplicaId("rep-grow"), model_id=ModelId("m-grow"),
                     node_id=node_id, engine=EngineKind.SIM, source="sim",
                     memory_bytes=300 * MIB, engine_args={"memory_bytes": 0},
                     start_timeout_s=60)
    raw = await client.execute_workflow(
        DriveShard.run, ["start_shard", node_task_queue(node_id), StartShardInput(spec=spec)],
        id=f"drive-{uuid.uuid4()}", task_queue=stack)
    endpoint = ShardEndpoint.model_validate(raw)
    assert endpoint.url is not None
    try:
        key = replica_engine_key(SECRET.encode(), node_id=node_id, replica_id="rep-grow",
                                 key_epoch=await key_epoch(settings.database_url or "",
                                                           node_id))
        engine = httpx.AsyncClient(base_url=endpoint.url, timeout=60,
                                   headers={"Authorization": f"Bearer {key}"})

        async def grow_to(rss: int) -> None:
            more = rss - tree_rss(endpoint.pid)
            assert 0 < more < 700 * MIB
            answer = await engine.post("/sim/grow", json={"bytes": more})
            assert answer.status_code == 200, answer.text
            assert answer.json()["rss_bytes"] >= rss - 16 * MIB

        async def level_is(level: str) -> bool:
            return bool((await node()).get("memory_level") == level)

        assert (await node())["memory_level"] == "ok"
        await grow_to(WARN_RSS)
        await _until(lambda: level_is("warn"))
        assert "available, margin" in (await node())["memory_level_reason"]
        await grow_to(CRITICAL_RSS)
        await _until(lambda: level_is("critical"))

        async def stops() -> list[dict[str, Any]]:
            events = (await api.get("/events", params={"limit": 1000})).json()
            return [e for e in events if e["kind"] == "node.watchdog_stop"]

        async def signalled() -> list[dict[str, Any]]:
            got: list[dict[str, Any]] = await recorder.query(PreemptRecorder.requests)
            return got

        await _until(lambda: _nonempty(signalled))
        # More critical heartbeats: the watchdog has acted within its interval (60 s).
        for _ in range(MORE_HEARTBEATS):
            await _next_heartbeat(node)
        assert (await node())["memory_level"] == "critical"

        [request] = [PreemptRequest.model_validate(r) for r in await signalled()]
        assert (request.replica_id, request.by) == ("rep-opp", None)
        assert request.reason.startswith("memory critical on node box: ")
        assert "opportunistic" in request.reason
        [stop] = await stops()
        assert (stop["replica_id"], stop["deployment_id"], stop["node_id"]) == (
            "rep-opp", "d-opp", node_id)
        assert stop["data"]["runs_as"] == "opportunistic"

        events = (await api.get("/events", params={"limit": 1000})).json()
        changes = [(e["data"]["previous"], e["data"]["level"], e["data"]["margin_bytes"])
                   for e in events if e["kind"] == "node.memory_level"]
        assert changes == [("ok", "warn", MARGIN), ("warn", "critical", MARGIN)]
        metrics = (await api.get("/metrics")).text
        assert f'modelkeeper_node_memory_level{{node="box",node_id="{node_id}"}} 2.0' in metrics
        assert (f'modelkeeper_node_memory_level_changes_total{{node="box",'
                f'node_id="{node_id}"}} 2.0') in metrics
        await engine.aclose()
    finally:
        _kill_engine(endpoint.pid)
        await recorder.terminate()
        await api.aclose()


async def _has(node: Callable[[], Awaitable[dict[str, Any]]]) -> bool:
    return bool(await node())


async def _nonempty(read: Callable[[], Awaitable[list[Any]]]) -> bool:
    return bool(await read())


async def _next_heartbeat(node: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once the node's ``last_seen`` has moved: a heartbeat was recorded (and its
    memory report handled: the handler answers after it)."""
    seen = (await node())["last_seen"]

    async def newer() -> bool:
        return bool((await node())["last_seen"] > seen)

    await _until(newer)
