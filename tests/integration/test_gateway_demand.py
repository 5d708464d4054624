"""The gateway's side of loading on demand, against the real store: a request for a model
with no ready replica is held and asks for the load at once (its waiting count written,
which fires the store's demand trigger on ``modelkeeper_demand``), then is sent to the
first replica that becomes ready, or answered 503 "is loading" at its deadline; an unknown
model (404) and a switched-off one (answered at once) ask for nothing.

No control plane runs here: the test plays it, listening on the demand channel and
marking a replica ready, which is all the gateway sees of a load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.names import DEMAND_CHANNEL
from modelkeeper.store.routing import RoutingStore
from tests.support.gateway_support import (
    add_deployment,
    add_replica,
    metric,
    running_gateway,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-demand"
HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
#: The usage tick in these tests: far longer than any of them waits for a usage row, so
#: a row seen is one written at once for the demand, not by a tick.
LONG_TICK_S = 60.0
#: How soon the demand must reach the store: milliseconds on an idle machine, with room
#: for a busy two-core one; either way a small fraction of the tick.
DEMAND_WITHIN_S = 5.0
#: Requests held together for the model: they must make one write, and one notice.
HELD = 20



@pytest.fixture
async def demands(database_url: str) -> AsyncIterator[asyncio.Queue[str]]:
    """The payloads (deployment ids) notified on the demand channel, as they come."""
    conn = await asyncpg.connect(database_url)
    queue: asyncio.Queue[str] = asyncio.Queue()
    await conn.add_listener(DEMAND_CHANNEL, lambda _c, _p, _ch, payload: queue.put_nowait(
        payload))
    try:
        yield queue
    finally:
        await conn.close()


async def on_demand(db: asyncpg.Connection, model: str, policy: ScalingPolicy, *,
                    status: str = "idle") -> str:
    """A deployment of ``model`` with ``policy``, none of it running."""
    deployment = await add_deployment(db, model, status=status, replicas=0)
    await db.execute("UPDATE deployments SET scaling = $2::jsonb WHERE deployment_id = $1",
                     deployment, policy.model_dump_json())
    return deployment


async def waiting_rows(database_url: str, deployment: str) -> list[int]:
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        return [u.waiting for u in await routes.deployment_usage(deployment)]
    finally:
        await routes.close()


async def test_held_requests_ask_for_the_load_at_once_and_go_to_the_first_ready_replica(
        tmp_path: Path, database_url: str, db: asyncpg.Connection,
        demands: asyncio.Queue[str]) -> None:
    deployment = await on_demand(db, MODEL, ScalingPolicy(min_replicas=0, max_replicas=2))
    async with sims(tmp_path, MODEL, "r-d") as (sim,), \
            running_gateway(database_url, usage_flush_interval_s=LONG_TICK_S,
                            gateway_load_wait_s=60.0) as server, \
            httpx.AsyncClient(timeout=90) as http:
        models = (await http.get(server.url + "/v1/models")).json()["data"]
        assert [(m["id"], m["status"], m["on_demand"], m["min_replicas"], m["max_replicas"],
                 m["ready_replicas"]) for m in models] == [(MODEL, "idle", True, 0, 2, 0)]
        reporter = server.gateway.usage.reporter
        assert reporter is not None and reporter.flushes == 0

        sent = time.monotonic()
        held = [asyncio.create_task(http.post(
            server.url + CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 2}))
            for _ in range(HELD)]
        assert await asyncio.wait_for(demands.get(), DEMAND_WITHIN_S) == deployment
        noticed_s = time.monotonic() - sent
        assert noticed_s < DEMAND_WITHIN_S < LONG_TICK_S
        assert (await waiting_rows(database_url, deployment))[0] >= 1
        entry = server.gateway.table.models[MODEL]
        await until(lambda: entry.waiting == HELD, what="every request held")
        assert not any(task.done() for task in held)

        # The control plane's part, played here: it loads a replica and marks it ready.
        await add_replica(db, deployment, sim.replica_id, sim.url)
        await db.execute("UPDATE deployments SET status = 'serving', replicas = 1 "
                         "WHERE deployment_id = $1", deployment)
        answers = await asyncio.gather(*held)
        assert [(a.status_code, a.headers["x-modelkeeper-replica"]) for a in answers] == [
            (200, "r-d")] * HELD
        # One write for all of them, one notice: not one per request.
        assert reporter.flushes == 1
        assert demands.empty()
        scrape = (await http.get(server.url + "/metrics")).text
        assert metric(scrape, "modelkeeper_gateway_held_for_load_total", model=MODEL) == HELD


async def test_a_load_that_outlasts_the_wait_is_answered_503_loading(
        database_url: str, db: asyncpg.Connection, demands: asyncio.Queue[str]) -> None:
    deployment = await on_demand(db, MODEL, ScalingPolicy(min_replicas=0, max_replicas=1,
                                                          load_wait_s=0.5))
    await db.execute("UPDATE deployments SET status = 'loading', loading_since = now(), "
                     "loading_reason = 'asked for: 1 request waiting' "
                     "WHERE deployment_id = $1", deployment)
    async with running_gateway(database_url, usage_flush_interval_s=LONG_TICK_S,
                               gateway_wait_for_replica_s=20.0,
                               gateway_load_wait_s=30.0) as server, \
            httpx.AsyncClient(timeout=60) as http:
        started = time.monotonic()
        resp = await http.post(server.url + CHAT, json={"model": MODEL, "messages": HI})
        waited_s = time.monotonic() - started
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "5"
        error = resp.json()["error"]
        assert (error["type"], error["code"], error["status"], error["reason"]) == (
            "service_unavailable", "model_loading", "loading", "asked for: 1 request waiting")
        assert error["message"].startswith(f"`{MODEL}` is loading (asked for: 1 request "
                                           "waiting, since ")
        assert error["loading_since"] is not None
        # Held for the policy's 0.5 s, not the gateway's 20 s wait for a replica nor its
        # 30 s load wait (the bound leaves room for a loaded machine: the point is which
        # wait applied).
        assert 0.5 <= waited_s < 10.0
        # It asked for the load while it was held.
        assert await asyncio.wait_for(demands.get(), DEMAND_WITHIN_S) == deployment
        models = (await http.get(server.url + "/v1/models")).json()["data"]
        assert (models[0]["status"], models[0]["loading_reason"]) == (
            "loading", "asked for: 1 request waiting")


async def test_an_unknown_model_and_a_switched_off_one_ask_for_nothing(
        database_url: str, db: asyncpg.Connection, demands: asyncio.Queue[str]) -> None:
    off = await on_demand(db, "sim-off", ScalingPolicy(min_replicas=0, max_replicas=0),
                          status="stopped")
    wanted = await on_demand(db, MODEL, ScalingPolicy(min_replicas=0, max_replicas=1,
                                                      load_wait_s=0.2))
    async with running_gateway(database_url, usage_flush_interval_s=LONG_TICK_S,
                               gateway_load_wait_s=60.0) as server, \
            httpx.AsyncClient(timeout=30) as http:
        await until(lambda: len(server.gateway.table.models) == 2, what="both routed")
        typo = await http.post(server.url + CHAT, json={"model": "sim-demnad", "messages": HI})
        assert typo.status_code == 404 and typo.json()["error"]["code"] == "model_not_found"
        started = time.monotonic()
        stopped = await http.post(server.url + CHAT, json={"model": "sim-off", "messages": HI})
        assert time.monotonic() - started < 10.0  # at once, not after the 60 s load wait
        assert stopped.status_code == 503 and "retry-after" not in stopped.headers
        error = stopped.json()["error"]
        assert (error["code"], error["status"]) == ("model_stopped", "stopped")
        assert "switched off" in error["message"]
        # A request that does ask: its notice is the first and only one on the channel.
        loading = await http.post(server.url + CHAT, json={"model": MODEL, "messages": HI})
        assert loading.json()["error"]["code"] == "model_loading"
        assert await asyncio.wait_for(demands.get(), DEMAND_WITHIN_S) == wanted
        assert demands.empty()
        assert await waiting_rows(database_url, off) in ([], [0])


async def test_a_load_wait_of_0_answers_at_once_and_still_asks_for_the_load(
        database_url: str, db: asyncpg.Connection, demands: asyncio.Queue[str]) -> None:
    deployment = await on_demand(db, MODEL, ScalingPolicy(min_replicas=0, max_replicas=1,
                                                          load_wait_s=0.0))
    async with running_gateway(database_url, usage_flush_interval_s=LONG_TICK_S,
                               gateway_load_wait_s=60.0) as server, \
            httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(server.url + CHAT, json={"model": MODEL, "messages": HI})
        assert (resp.status_code, resp.json()["error"]["code"]) == (503, "model_loading")
        assert resp.headers["retry-after"] == "5"
        # Never held, yet its demand is written at once, as a held request's is.
        assert await asyncio.wait_for(demands.get(), DEMAND_WITHIN_S) == deployment
        # Once the write is done it is not counted again (the next tick writes 0).
        entry = server.gateway.table.models[MODEL]
        await until(lambda: entry.turned_away == 0, what="the turned-away request written")


async def test_routes_read_the_policy_and_one_that_does_not_read_counts_as_none(
        database_url: str, db: asyncpg.Connection) -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=3, load_wait_s=12.0)
    deployment = await on_demand(db, MODEL, policy)
    fixed = await add_deployment(db, "sim-fixed", replicas=2)
    # A newer writer's rule this version refuses (min above max): fixed, never on demand,
    # and every other route still reads.
    broken = await add_deployment(db, "sim-broken", status="stopped", replicas=0)
    await db.execute("UPDATE deployments SET scaling = $2::jsonb WHERE deployment_id = $1",
                     broken, '{"min_replicas": 3, "max_replicas": 1}')
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        found = await routes.load_routes_for([deployment, fixed, broken])
    finally:
        await routes.close()
    assert (found[deployment].scaling, found[deployment].loads_on_demand) == (policy, True)
    assert (found[fixed].scaling, found[fixed].loads_on_demand) == (None, False)
    assert (found[broken].scaling, found[broken].loads_on_demand) == (None, False)
