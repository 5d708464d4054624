"""The sim engine speaking vLLM's and SGLang's HTTP dialects (``engine_args.dialect``; the
paths and names cited from the installed vllm 0.33.0 and sglang 0.5.23 in
agent/engines/sim_server.py), and our own code held against them: the adapters' readiness
probe, the gateway's queue scrape, the agent's sleep calls. Each sim serves in this event
loop on a free port (real HTTP, a real asyncio server)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from agent.engines.base import post_sleep_call, read_sleeping, sleep_dialect
from agent.engines.sglang import SglangAdapter
from agent.engines.sim import SimAdapter
from agent.engines.sim_server import (
    KV_CACHE_TAG,
    SGLANG,
    SGLANG_NOT_IDLE,
    VLLM,
    SimConfig,
    SimEngine,
    parse_args,
    serve,
)
from agent.engines.vllm import VllmAdapter
from gateway.breaker import Breaker
from gateway.engine_queue import QUEUE_GAUGES, EngineQueues, queue_length
from gateway.table import Endpoint, RoutingTable
from modelkeeper.domain.engine_args import EngineConfigError, check_engine_arg_names
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.infra.processes import free_port
from modelkeeper.store.routing import DeploymentRoute, ReplicaRoute

pytestmark = pytest.mark.timeout(60)

MODEL = "dialect-model"
KEY = "k-dialect"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Generous: a sim starting on a busy 2-core machine.
READY_TIMEOUT_S = 30.0
BOTH = pytest.mark.parametrize("dialect", [VLLM, SGLANG])
#: The adapter whose probe and sleep calls each dialect stands in for.
ADAPTERS = {VLLM: VllmAdapter(), SGLANG: SglangAdapter()}
ENGINE_OF = {VLLM: EngineKind.VLLM, SGLANG: EngineKind.SGLANG}


@asynccontextmanager
async def served(dialect: str, *, wait_ready: bool = True,
                 **config: Any) -> AsyncIterator[tuple[SimEngine, httpx.AsyncClient, str]]:
    """A sim speaking ``dialect`` on a free port in this loop, and a client to it (no key)."""
    port = free_port()
    cfg = SimConfig(host="127.0.0.1", port=port, model=MODEL, dialect=dialect,
                    wake_time_s=0.0, **config)
    engine = SimEngine(cfg, KEY)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, KEY, stop=stop, engine=engine))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                status = None
                with suppress(httpx.HTTPError):
                    status = (await client.get("/health")).status_code
                if status == 200 or (status is not None and not wait_ready):
                    break
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            yield engine, client, url
        finally:
            stop.set()
            await task


def gauges(text: str, *names: str) -> dict[str, float | None]:
    found: dict[str, float | None] = {}
    for name in names:
        value = queue_length(text, name)
        found[name] = None if value is None else float(value)
    return found


async def _until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# -- the arguments ---------------------------------------------------------------------


def test_the_dialect_argument_reaches_the_sim_and_is_checked() -> None:
    spec = ShardSpec(replica_id=ReplicaId("r"), model_id=ModelId(MODEL), node_id=NodeId("n"),
                     engine=EngineKind.SIM, source="sim", memory_bytes=0,
                     engine_args={"dialect": "sglang"})
    argv = SimAdapter().launch_plan(spec, host="127.0.0.1", port=1, api_key=KEY).argv
    assert argv[argv.index("--dialect") + 1] == "sglang"
    assert parse_args([*argv[3:]]).dialect == SGLANG
    check_engine_arg_names(EngineKind.SIM, {"dialect": "vllm"})
    with pytest.raises(EngineConfigError, match="must be one of vllm, sglang"):
        check_engine_arg_names(EngineKind.SIM, {"dialect": "tgi"})
    # The agent sleeps a sim the way the engine it imitates sleeps.
    assert sleep_dialect(EngineKind.SIM, {"dialect": "sglang"}) == sleep_dialect(
        EngineKind.SGLANG)
    assert sleep_dialect(EngineKind.SIM, {"dialect": "vllm"}) == sleep_dialect(
        EngineKind.VLLM) == sleep_dialect(EngineKind.SIM)


# -- what each serves ------------------------------------------------------------------


@BOTH
async def test_health_models_and_completions_streamed_or_not(dialect: str) -> None:
    async with served(dialect) as (_, client, _url):
        health = await client.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert (await client.get("/v1/models")).status_code == 401
        models = (await client.get("/v1/models", headers=AUTH)).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        plain = await client.post("/v1/completions", headers=AUTH,
                                  json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert plain.json()["choices"][0]["text"] == "the quick brown"
        chunks: list[str] = []
        async with client.stream("POST", "/v1/chat/completions", headers=AUTH, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True}) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
        assert chunks[-1] == "[DONE]"
        text = "".join(json.loads(c)["choices"][0]["delta"].get("content", "")
                       for c in chunks[:-1] if json.loads(c)["choices"])
        assert text == "the quick"


async def test_vllm_metrics_and_sleep_answers() -> None:
    async with served(VLLM) as (_, client, _url):
        page = (await client.get("/metrics")).text
        assert gauges(page, "vllm:num_requests_running", "vllm:num_requests_waiting",
                      "vllm:kv_cache_usage_perc") == {
            "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0}
        assert 'vllm:engine_sleep_state{engine="0",model_name="dialect-model",' \
               'sleep_state="awake"} 1.0' in page
        assert "vllm:gpu_cache_usage_perc" not in page, "gone from vLLM 0.33"
        # vLLM's dev endpoints, with vLLM 0.33's answers.
        slept = await client.post("/sleep?level=1", headers=AUTH)
        assert slept.json() == {"status": "sleeping", "level": 1}
        assert (await client.get("/is_sleeping", headers=AUTH)).json() == {"is_sleeping": True}
        assert 'sleep_state="weights_offloaded"} 1.0' in (await client.get("/metrics")).text
        woken = await client.post("/wake_up", headers=AUTH)
        assert woken.json() == {"status": "awake", "tags": None}
        # SGLang's paths are not vLLM's.
        assert (await client.post("/release_memory_occupation", headers=AUTH)).status_code \
            == 404


async def test_vllm_queues_a_completion_asked_while_asleep_until_the_wake() -> None:
    async with served(VLLM) as (engine, client, _url):
        await client.post("/sleep?level=1", headers=AUTH)
        asked = asyncio.create_task(client.post(
            "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 1}))

        async def waiting() -> bool:
            page = (await client.get("/metrics")).text
            return queue_length(page, "vllm:num_requests_waiting") == 1
        await _until(waiting, "the request to wait in the queue")
        assert not asked.done()
        await client.post("/wake_up", headers=AUTH)
        assert (await asked).status_code == 200
        assert engine.waiting == 0


async def test_sglang_paths_metrics_and_memory_saver() -> None:
    async with served(SGLANG) as (engine, client, _url):
        for path in ("/health_generate", "/ready"):
            answer = await client.get(path)
            assert (answer.status_code, answer.content) == (200, b""), path
        refused = await client.get("/get_model_info")
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        info = (await client.get("/get_model_info", headers=AUTH)).json()
        assert (info["model_path"], info["is_generation"]) == (MODEL, True)
        page = (await client.get("/metrics")).text
        assert gauges(page, "sglang:num_running_reqs", "sglang:num_queue_reqs",
                      "sglang:token_usage", "vllm:num_requests_waiting") == {
            "sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0,
            "sglang:token_usage": 0.0, "vllm:num_requests_waiting": None}
        # vLLM's sleep paths are not SGLang's.
        assert (await client.post("/sleep?level=1", headers=AUTH)).status_code == 404
        assert (await client.get("/is_sleeping", headers=AUTH)).status_code == 404
        # No tags means all of it, weights included: the sim releases the KV cache only.
        assert (await client.post("/release_memory_occupation", headers=AUTH,
                                  json={})).status_code == 400
        released = await client.post("/release_memory_occupation", headers=AUTH,
                                     json={"tags": [KV_CACHE_TAG]})
        assert (released.status_code, released.json()) == (200, None)
        assert engine.sleeping
        asked = await client.post("/v1/completions", headers=AUTH,
                                  json={"prompt": "x", "max_tokens": 1})
        assert asked.status_code == 503
        resumed = await client.post("/resume_memory_occupation", headers=AUTH,
                                    json={"tags": [KV_CACHE_TAG]})
        assert (resumed.status_code, resumed.json(), engine.sleeping) == (200, None, False)


async def test_sglang_refuses_a_release_while_requests_run() -> None:
    async with served(SGLANG, tokens_per_second=20.0) as (_, client, _url):
        running = asyncio.create_task(client.post(
            "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 20}))

        async def busy() -> bool:
            page = (await client.get("/metrics")).text
            return queue_length(page, "sglang:num_running_reqs") == 1
        await _until(busy, "the request to run")
        refused = await client.post("/release_memory_occupation", headers=AUTH,
                                    json={"tags": [KV_CACHE_TAG]})
        assert refused.status_code == 400 and SGLANG_NOT_IDLE in refused.text
        assert (await running).status_code == 200


# -- our code against them -------------------------------------------------------------


@BOTH
async def test_the_adapters_readiness_probe(dialect: str) -> None:
    adapter = ADAPTERS[dialect]
    async with served(dialect, wait_ready=False, load_time_s=1.0) as (engine, _, url), \
            httpx.AsyncClient() as http:
        loading = await adapter.check_ready(http, url, KEY, MODEL)
        assert not engine.ready and not loading.ready
        assert loading.detail == "GET /health answered 503: "

        async def ready() -> bool:
            return (await adapter.check_ready(http, url, KEY, MODEL)).ready
        await _until(ready, "ready")
        assert not (await adapter.check_ready(http, url, "wrong-key", MODEL)).ready
        assert not (await adapter.check_ready(http, url, KEY, "other-model")).ready


@BOTH
async def test_the_agents_sleep_calls(dialect: str) -> None:
    """What the agent's shard_sleep sends for the engine each dialect imitates."""
    calls = sleep_dialect(ENGINE_OF[dialect])
    assert calls is not None
    async with served(dialect) as (engine, _, url), httpx.AsyncClient() as http:
        slept = await post_sleep_call(http, url, KEY, calls.sleep_path, calls.body, timeout=5)
        assert slept.status_code == 200 and engine.sleeping
        said = await read_sleeping(http, url, KEY, calls, timeout=5)
        # vLLM says; SGLang has no way to, and the agent goes by its own record.
        assert said is (True if dialect == VLLM else None)
        woken = await post_sleep_call(http, url, KEY, calls.wake_path, calls.body, timeout=5)
        assert woken.status_code == 200 and not engine.sleeping
        assert await read_sleeping(http, url, KEY, calls, timeout=5) is (
            False if dialect == VLLM else None)


def _route(engine: str, url: str) -> DeploymentRoute:
    return DeploymentRoute(
        deployment_id=f"d-{engine}", model_id=f"m-{engine}", status="serving",
        desired_replicas=1, placement_error=None, last_failure=None, consecutive_failures=0,
        created_at=datetime(2026, 1, 1, tzinfo=UTC), engine=engine,
        ready=(ReplicaRoute(f"r-{engine}", url),))


def _endpoint(replica: ReplicaRoute, deployment: DeploymentRoute) -> Endpoint:
    return Endpoint(replica.replica_id, replica.endpoint, deployment.deployment_id,
                    deployment.model_id, dict(AUTH), Breaker(2, 1.0))


async def test_the_gateways_queue_scrape_reads_each_dialect() -> None:
    """One request runs and one waits on each engine (one slot each): the gateway's scrape
    reads 1 from vLLM's gauge on one and from SGLang's on the other."""
    slow = {"max_num_seqs": 1, "tokens_per_second": 20.0}
    async with served(VLLM, **slow) as (vllm, vc, vllm_url), \
            served(SGLANG, **slow) as (sglang, sc, sglang_url):
        table = RoutingTable(_endpoint)
        table.apply(_route("vllm", vllm_url))
        table.apply(_route("sglang", sglang_url))
        body = {"prompt": "x", "max_tokens": 20}
        requests = [asyncio.create_task(client.post("/v1/completions", headers=AUTH,
                                                    json=body))
                    for client in (vc, vc, sc, sc)]

        async def both_queued() -> bool:
            return vllm.waiting == 1 and sglang.waiting == 1
        await _until(both_queued, "one request to wait on each")
        queues = EngineQueues(table)
        queues.open()
        try:
            await asyncio.gather(*queues.scrape())
        finally:
            await queues.close()
        waiting = {e.replica_id: e.engine_waiting
                   for entry in table.models.values() for e in entry.endpoints}
        assert waiting == {"r-vllm": 1, "r-sglang": 1}
        assert QUEUE_GAUGES[EngineKind.SGLANG] == "sglang:num_queue_reqs"
        assert all(r.status_code == 200 for r in await asyncio.gather(*requests))
