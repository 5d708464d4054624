"""The gateway's engine queue scraper (gateway/engine_queue.py): the gauge parser, and
scrapes over real HTTP, against a small aiohttp server playing engines that answer, hang,
send garbage or nothing of use, and against the sim engine's own /metrics. A failed
scrape leaves the value unknown and routing as it was; a slow engine is never asked twice
at once; an engine without a queue gauge is never asked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import pytest
from aiohttp import web

from agent.engines.sim_server import SimConfig, SimEngine, serve
from gateway.breaker import Breaker, BreakerState
from gateway.engine_queue import MAX_METRICS_BYTES, QUEUE_GAUGES, EngineQueues, queue_length
from gateway.table import Endpoint, RoutingTable
from gateway.usage import snapshot
from modelkeeper.domain.shards import EngineKind
from modelkeeper.infra.processes import free_port
from modelkeeper.store.routing import DeploymentRoute, ReplicaRoute, ReplicaUsage

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOST = "127.0.0.1"
KEY = "k-engine"
#: A scrape's timeout in these tests: short, so a hanging engine is given up on quickly.
TIMEOUT_S = 0.3

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 40.0
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 7.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 9.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 3.5
"""

SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 8.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 5.0
"""


# -- the parser ----------------------------------------------------------------------------


def test_the_gauge_is_summed_over_its_label_sets_and_nothing_else_counts() -> None:
    assert queue_length(VLLM_PAGE, "vllm:num_requests_waiting") == 3
    assert queue_length(SGLANG_PAGE, "sglang:num_queue_reqs") == 5
    # A page without it says nothing: unknown, not 0.
    assert queue_length(SGLANG_PAGE, "vllm:num_requests_waiting") is None
    assert queue_length("", "vllm:num_requests_waiting") is None
    # Untyped and without labels, as a bare exposition may be.
    assert queue_length("vllm:num_requests_waiting 0\n", "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("page", [
    "vllm:num_requests_waiting{model_name=\"m\"} lots\n",
    "vllm:num_requests_waiting{model_name=\"m\" 2\n",
    "vllm:num_requests_waiting NaN\n",
    "vllm:num_requests_waiting -1\n",
    "vllm:num_requests_waiting +Inf\n",
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{} {} 1\n",
])
def test_garbage_in_the_gauge_is_an_error(page: str) -> None:
    with pytest.raises(ValueError):
        queue_length(page, "vllm:num_requests_waiting")


def test_each_engine_that_has_a_queue_gauge_is_named_and_llamacpp_is_not() -> None:
    assert QUEUE_GAUGES[EngineKind.VLLM] == QUEUE_GAUGES[EngineKind.SIM] == (
        "vllm:num_requests_waiting")
    assert QUEUE_GAUGES[EngineKind.SGLANG] == "sglang:num_queue_reqs"
    assert EngineKind.LLAMACPP not in QUEUE_GAUGES


# -- scrapes over HTTP ---------------------------------------------------------------------


@dataclass
class Engines:
    """One aiohttp server playing several engines, each under ``/e/<name>``."""

    base: str
    hits: dict[str, int] = field(default_factory=dict)
    queries: list[list[str]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    flaky_ok: bool = True
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, name: str) -> str:
        return f"{self.base}/e/{name}"


@asynccontextmanager
async def engines() -> AsyncIterator[Engines]:
    port = free_port()
    state = Engines(f"http://{HOST}:{port}")

    async def metrics(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        state.hits[name] = state.hits.get(name, 0) + 1
        state.queries.append(request.query.getall("name[]", []))
        state.auth.append(request.headers.get("Authorization"))
        match name:
            case "vllm" | "llamacpp":
                return web.Response(text=VLLM_PAGE)
            case "sglang":
                return web.Response(text=SGLANG_PAGE)
            case "hang":
                await state.release.wait()
                return web.Response(text=VLLM_PAGE)
            case "garbage":
                return web.Response(text="vllm:num_requests_waiting{oops 3\n")
            case "binary":
                return web.Response(body=b"vllm:num_requests_waiting \xff\xfe\n")
            case "none":
                return web.Response(text=SGLANG_PAGE)
            case "huge":
                return web.Response(text=VLLM_PAGE + "# padding\n" * 1000)
            case "streamed":
                # Chunked, with no length to refuse it by: cut off once past the cap.
                response = web.StreamResponse()
                response.enable_chunked_encoding()
                await response.prepare(request)
                for _ in range(100):
                    await response.write(b"# padding\n" * 10)
                await response.write(VLLM_PAGE.encode())
                await response.write_eof()
                return response
            case "flaky" if state.flaky_ok:
                return web.Response(text=VLLM_PAGE)
        return web.Response(status=404, text="no metrics here")

    app = web.Application()
    app.router.add_get("/e/{name}/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, HOST, port).start()
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


def route(model: str, engine: str | None, *replicas: tuple[str, str]) -> DeploymentRoute:
    return DeploymentRoute(
        deployment_id=f"d-{model}", model_id=model, status="serving",
        desired_replicas=len(replicas), placement_error=None, last_failure=None,
        consecutive_failures=0, created_at=T0, engine=engine,
        ready=tuple(ReplicaRoute(rid, url) for rid, url in replicas))


def make_endpoint(replica: ReplicaRoute, deployment: DeploymentRoute) -> Endpoint:
    return Endpoint(replica.replica_id, replica.endpoint, deployment.deployment_id,
                    deployment.model_id, {"Authorization": f"Bearer {KEY}"}, Breaker(2, 1.0))


@asynccontextmanager
async def scraper(table: RoutingTable, *, timeout_s: float = TIMEOUT_S,
                  max_bytes: int = MAX_METRICS_BYTES) -> AsyncIterator[EngineQueues]:
    queues = EngineQueues(table, timeout_s=timeout_s, max_bytes=max_bytes)
    queues.open()
    try:
        yield queues
    finally:
        await queues.close()


def endpoints_of(table: RoutingTable, model: str) -> dict[str, Endpoint]:
    return {e.replica_id: e for e in table.models[model].endpoints}


async def test_a_round_reads_each_engines_own_gauge_with_its_key() -> None:
    async with engines() as eng:
        table = RoutingTable(make_endpoint)
        table.apply(route("m", "vllm", ("r-v", eng.url("vllm"))))
        table.apply(route("s", "sglang", ("r-s", eng.url("sglang"))))
        table.apply(route("l", "llamacpp", ("r-l", eng.url("llamacpp"))))
        table.apply(route("old", None, ("r-o", eng.url("vllm"))))
        async with scraper(table) as queues:
            tasks = queues.scrape()
            assert len(tasks) == 2, "llama.cpp and an engine of unknown kind are not asked"
            await asyncio.gather(*tasks)
        assert endpoints_of(table, "m")["r-v"].engine_waiting == 3
        assert endpoints_of(table, "s")["r-s"].engine_waiting == 5
        assert endpoints_of(table, "l")["r-l"].engine_waiting is None
        assert eng.hits == {"vllm": 1, "sglang": 1}
        assert eng.auth == [f"Bearer {KEY}"] * 2
        # Each asks a prometheus_client exposition for its gauge alone.
        assert sorted(eng.queries) == [["sglang:num_queue_reqs"],
                                       ["vllm:num_requests_waiting"]]
        # The usage row carries it.
        assert snapshot(table).replicas[0] == ReplicaUsage("r-v", 0, None, 3)


@pytest.mark.parametrize("name", ["garbage", "binary", "none", "missing", "huge",
                                  "streamed"])
async def test_a_page_that_says_nothing_of_use_leaves_it_unknown_and_routing_as_it_was(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    async with engines() as eng:
        table = RoutingTable(make_endpoint)
        table.apply(route("m", "sim", ("r-1", eng.url(name)), ("r-ok", eng.url("vllm"))))
        bad, ok = endpoints_of(table, "m").values()
        bad.engine_waiting = 7  # an earlier answer: not kept once the engine stops saying
        async with scraper(table, max_bytes=len(VLLM_PAGE) + 100) as queues:
            with caplog.at_level(logging.WARNING, logger="gateway.engine_queue"):
                await asyncio.gather(*queues.scrape())
        assert (bad.engine_waiting, ok.engine_waiting) == (None, 3)
        assert [r.message for r in caplog.records if "r-1" in r.message], caplog.text
        # Routing never heard of it.
        assert bad.breaker.state is BreakerState.CLOSED and bad.in_flight == 0
        picked = {table.models["m"].pick(time.monotonic()) for _ in range(2)}
        assert picked == {bad, ok}


async def test_a_hanging_engine_is_given_up_on_and_never_asked_twice_at_once() -> None:
    async with engines() as eng:
        table = RoutingTable(make_endpoint)
        table.apply(route("m", "vllm", ("r-h", eng.url("hang"))))
        (hung,) = table.models["m"].endpoints
        hung.engine_waiting = 4
        async with scraper(table) as queues:
            began = time.monotonic()
            first = queues.scrape()
            assert len(first) == 1
            # Ticks while it hangs start nothing more.
            assert queues.scrape() == [] and queues.scrape() == []
            await asyncio.gather(*first)
            took = time.monotonic() - began
            assert hung.engine_waiting is None
            assert TIMEOUT_S <= took < TIMEOUT_S + 2, took
            assert eng.hits == {"hang": 1}
            # Given up on, it is asked again at the next tick.
            again = queues.scrape()
            assert len(again) == 1
            eng.release.set()
            await asyncio.gather(*again)
        assert hung.engine_waiting == 3


async def test_an_outage_is_logged_once_and_its_end_once(
        caplog: pytest.LogCaptureFixture) -> None:
    async with engines() as eng:
        table = RoutingTable(make_endpoint)
        table.apply(route("m", "vllm", ("r-f", eng.url("flaky"))))
        (flaky,) = table.models["m"].endpoints
        async with scraper(table) as queues:
            with caplog.at_level(logging.INFO, logger="gateway.engine_queue"):
                eng.flaky_ok = False
                for _ in range(3):
                    await asyncio.gather(*queues.scrape())
                assert flaky.engine_waiting is None
                eng.flaky_ok = True
                await asyncio.gather(*queues.scrape())
                await asyncio.gather(*queues.scrape())
        assert flaky.engine_waiting == 3
        messages = [r.getMessage() for r in caplog.records]
        assert len([m for m in messages if m.startswith("cannot read")]) == 1, messages
        assert "404" in messages[0]
        assert len([m for m in messages if m.startswith("reading replica r-f")]) == 1


async def test_an_engine_that_does_not_listen_is_unknown() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route("m", "vllm", ("r-gone", f"http://{HOST}:{free_port()}")))
    (gone,) = table.models["m"].endpoints
    async with scraper(table) as queues:
        await asyncio.gather(*queues.scrape())
    assert gone.engine_waiting is None


async def test_the_sim_engines_own_queue() -> None:
    """The sim engine, served in this loop, running one request at a time: a second one
    waits in its queue, and the scrape reads it there."""
    port = free_port()
    config = SimConfig(host=HOST, port=port, model="m", tokens_per_second=20.0,
                       max_num_seqs=1)
    stop = asyncio.Event()
    served = asyncio.create_task(serve(config, KEY, stop=stop, engine=SimEngine(config, KEY)))
    table = RoutingTable(make_endpoint)
    table.apply(route("m", "sim", ("r-sim", f"http://{HOST}:{port}")))
    (sim,) = table.models["m"].endpoints
    try:
        async with scraper(table, timeout_s=5.0) as queues, httpx.AsyncClient(
                base_url=f"http://{HOST}:{port}", headers=sim.headers, timeout=30) as client:
            deadline = time.monotonic() + 20
            while sim.engine_waiting != 0:  # up, and idle
                assert time.monotonic() < deadline, "the sim never answered"
                await asyncio.gather(*queues.scrape())
            # 20 tokens at 20/s: each runs for a second, the second waiting meanwhile.
            body = {"model": "m", "prompt": "x", "max_tokens": 20}
            requests = [asyncio.create_task(client.post("/v1/completions", json=body))
                        for _ in range(2)]
            while sim.engine_waiting != 1:
                assert time.monotonic() < deadline, "the queue was never seen"
                await asyncio.gather(*queues.scrape())
            assert [r.status_code for r in await asyncio.gather(*requests)] == [200, 200]
            await asyncio.gather(*queues.scrape())
            assert sim.engine_waiting == 0
    finally:
        stop.set()
        await served
