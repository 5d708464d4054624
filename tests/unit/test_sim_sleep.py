"""The sim engine's sleep dialect (vLLM's: POST /sleep?level=1, POST /wake_up,
GET /is_sleeping), its queue gauges on /metrics, and the arguments behind them: served
in-process on a free port (real HTTP, real asyncio server), and once as a real process whose
resident memory falls on sleep and comes back on wake."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.engines.base import adapter_for, sleep_dialect
from agent.engines.sim import SimAdapter
from agent.engines.sim_inprocess import InProcessSims
from agent.engines.sim_server import (
    DEFAULT_WAKE_TIME_S,
    SLEEPING_MESSAGE,
    SimConfig,
    SimEngine,
    parse_args,
    serve,
)
from modelkeeper.domain.engine_args import EngineConfigError, check_engine_arg_names
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec, can_sleep, share_of
from modelkeeper.infra.processes import ManagedProcess, free_port

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-model"
KEY = "k-sleep"
AUTH = {"Authorization": f"Bearer {KEY}"}
MIB = 1 << 20
#: Generous: a sim starting on a busy 2-core machine.
READY_TIMEOUT_S = 30.0


@asynccontextmanager
async def served(**config: Any) -> AsyncIterator[tuple[SimEngine, httpx.AsyncClient]]:
    """A sim engine serving on a free port in this event loop, ready, and a client to it."""
    port = free_port()
    cfg = SimConfig(host="127.0.0.1", port=port, model=MODEL, **config)
    engine = SimEngine(cfg, KEY)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, KEY, stop=stop, engine=engine))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                                 timeout=10) as client:
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                status = None
                with suppress(httpx.HTTPError):
                    status = (await client.get("/health")).status_code
                if status == 200:
                    break
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            yield engine, client
        finally:
            stop.set()
            await task


async def complete(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})


async def test_sleep_refuses_completions_and_wake_takes_the_wake_time() -> None:
    async with served(wake_time_s=0.3) as (_, client):
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await complete(client)).status_code == 200

        slept = await client.post("/sleep", params={"level": "1"})
        assert (slept.status_code, slept.content) == (200, b"")
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        refused = await complete(client)
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == SLEEPING_MESSAGE
        # /health keeps answering: the process is well, as vLLM's is asleep.
        assert (await client.get("/health")).status_code == 200
        # Idempotent.
        assert (await client.post("/sleep")).status_code == 200

        began = time.monotonic()
        assert (await client.post("/wake_up")).status_code == 200
        assert time.monotonic() - began >= 0.3
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await complete(client)).status_code == 200
        # An awake engine answers a wake at once.
        began = time.monotonic()
        assert (await client.post("/wake_up")).status_code == 200
        assert time.monotonic() - began < 0.3


async def test_only_level_1_and_only_with_the_key() -> None:
    async with served() as (_, client):
        level2 = await client.post("/sleep", params={"level": "2"})
        assert level2.status_code == 400 and "level" in level2.json()["error"]["message"]
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
            answer = await client.request(method, path, headers={"Authorization": "Bearer no"})
            assert answer.status_code == 401, path
        assert (await client.get("/sleep")).status_code == 405
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}


async def test_concurrent_wakes_both_end_awake() -> None:
    async with served(wake_time_s=0.2) as (_, client):
        await client.post("/sleep")
        answers = await asyncio.gather(client.post("/wake_up"), client.post("/wake_up"))
        assert [a.status_code for a in answers] == [200, 200]
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}


def _gauges(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.partition("{")[0]] = float(value)
    return values


async def test_metrics_show_the_real_queue() -> None:
    # One request at a time, each taking 20 tokens at 20/s: the second waits for the first.
    async with served(max_num_seqs=1, tokens_per_second=20.0) as (engine, client):
        idle = await client.get("/metrics", headers={})
        assert idle.status_code == 200
        assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in idle.text
        assert _gauges(idle.text) == {"vllm:num_requests_running": 0.0,
                                      "vllm:num_requests_waiting": 0.0}
        body = {"prompt": "x", "max_tokens": 20}
        requests = [asyncio.create_task(client.post("/v1/completions", json=body))
                    for _ in range(2)]
        deadline = time.monotonic() + 10
        while (engine.running, engine.waiting) != (1, 1):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        busy = _gauges((await client.get("/metrics")).text)
        assert busy == {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 1.0}
        assert [r.status_code for r in await asyncio.gather(*requests)] == [200, 200]
        assert (engine.running, engine.waiting) == (0, 0)


def test_defaults_are_unchanged_and_new_args_reach_the_command_line() -> None:
    config = parse_args(["--port", "1", "--model", "m"])
    assert (config.weights_bytes, config.wake_time_s, config.max_num_seqs) == (
        None, DEFAULT_WAKE_TIME_S, None)
    assert SimConfig(host="h", port=1, model="m", memory_bytes=100).kv_bytes == 0
    spec = ShardSpec(replica_id=ReplicaId("r1"), model_id=ModelId("m"), node_id=NodeId("n1"),
                     engine=EngineKind.SIM, source="sim", memory_bytes=100)
    plain = SimAdapter().launch_plan(spec, host="h", port=1, api_key="k").argv
    assert not {"--weights-bytes", "--wake-time", "--max-num-seqs"} & set(plain)
    argv = SimAdapter().launch_plan(
        spec.model_copy(update={"engine_args": {"weights_bytes": 60, "wake_time_s": 0.5,
                                                "max_num_seqs": 4}}),
        host="h", port=1, api_key="k").argv
    config = parse_args(argv[3:])
    assert (config.weights_bytes, config.wake_time_s, config.max_num_seqs) == (60, 0.5, 4)
    assert config.kv_bytes == 40


@pytest.mark.parametrize("args", [{"weights_bytes": -1}, {"weights_bytes": True},
                                  {"wake_time_s": -0.1}, {"wake_time_s": 1e9},
                                  {"max_num_seqs": 0}, {"weights_bytes": 2 * MIB}])
def test_the_new_args_are_bounded(args: dict[str, Any]) -> None:
    with pytest.raises(EngineConfigError):
        check_engine_arg_names(EngineKind.SIM, args, claim_bytes=MIB)


def test_can_sleep_agrees_with_the_adapters_dialects() -> None:
    for kind in EngineKind:
        assert can_sleep(kind) is (sleep_dialect(kind) is not None), kind
        adapter_for(kind)  # every kind still has its adapter
    assert not can_sleep(EngineKind.LLAMACPP)
    assert sleep_dialect(EngineKind.SIM) == sleep_dialect(EngineKind.VLLM)


def test_share_of() -> None:
    assert share_of(3, 8, 8) == 3
    assert share_of(2, 4, 8) == 1
    assert share_of(10, 3, 0) == 0
    assert share_of(7, 5, 10) == 3  # rounded down: never more than the share


async def test_an_in_process_sim_says_it_holds_only_its_weights_asleep() -> None:
    sims = InProcessSims()
    port = free_port()
    spec = ShardSpec(replica_id=ReplicaId("r1"), model_id=ModelId(MODEL), node_id=NodeId("n1"),
                     engine=EngineKind.SIM, source="sim", memory_bytes=100 * MIB,
                     engine_args={"weights_bytes": 30 * MIB, "wake_time_s": 0.0})
    plan = SimAdapter().launch_plan(spec, host="127.0.0.1", port=port, api_key=KEY)
    engine = sims("r1", plan.argv, Path("/dev/null"), dict(plan.env))
    engine.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                                     timeout=10) as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not engine.engine.ready:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert sims.held_bytes() == 100 * MIB
            assert (await client.post("/sleep")).status_code == 200
            assert sims.held_bytes() == 30 * MIB
            assert (await client.post("/wake_up")).status_code == 200
            assert sims.held_bytes() == 100 * MIB
    finally:
        engine.signal(15)
        await engine.wait()


@contextmanager
def sim_process(tmp_path: Path, **engine_args: Any) -> Iterator[tuple[ManagedProcess, str]]:
    port = free_port()
    spec = ShardSpec(replica_id=ReplicaId("r-mem"), model_id=ModelId(MODEL),
                     node_id=NodeId("n1"), engine=EngineKind.SIM, source="sim",
                     memory_bytes=engine_args.pop("memory_bytes"), engine_args=engine_args)
    plan = SimAdapter(python=sys.executable).launch_plan(spec, host="127.0.0.1", port=port,
                                                         api_key=KEY)
    process = ManagedProcess("sim", plan.argv, tmp_path / "sim.log",
                             env={**os.environ, **plan.env})
    process.start()
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def test_a_sim_process_frees_its_kv_share_asleep_and_takes_it_back(tmp_path: Path) -> None:
    with sim_process(tmp_path, memory_bytes=160 * MIB, weights_bytes=64 * MIB,
                     wake_time_s=0.0) as (process, url):
        process.wait_until(lambda: _health(url) == 200, timeout=READY_TIMEOUT_S)
        rss = psutil.Process(process.pid).memory_info().rss
        assert rss >= 150 * MIB, rss
        with httpx.Client(base_url=url, headers=AUTH, timeout=10) as client:
            assert client.post("/sleep").status_code == 200
            asleep = psutil.Process(process.pid).memory_info().rss
            # The KV share (96 MiB) is gone; the weights stay.
            assert rss - asleep >= 90 * MIB, (rss, asleep)
            assert asleep >= 60 * MIB, asleep
            assert client.post("/wake_up").status_code == 200
            awake = psutil.Process(process.pid).memory_info().rss
            assert awake >= 150 * MIB, awake


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.HTTPError:
        return None
