"""An engine's own queue, end to end: a sim engine process running one request at a time
(``--max-num-seqs 1``) gets three slow requests through the gateway; the gateway's
scrape reads the two it queues, writes them in its usage row, and the store's demand
sample (what the usage watch reads) counts them, while the gateway's own waiting count
stays 0 (it held nothing: a replica was ready)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import httpx
import pytest

from modelkeeper.domain.ids import DeploymentId
from modelkeeper.store import Store
from modelkeeper.store.routing import RoutingStore
from tests.support.gateway_support import (
    add_deployment,
    add_replica,
    ready_replicas,
    running_gateway,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-queue"
#: The gateways' usage tick here, and the flush interval the store's read assumes.
TICK_S = 0.1
#: Each request: 40 tokens at 10/s, four seconds; the second and third wait meanwhile.
TOKENS, TOKENS_PER_S = 40, 10
#: Generous, for a busy 2-core machine: the queue is in place within a tick or two.
SEEN_WITHIN_S = 10.0



async def test_an_engines_queue_reaches_the_usage_row_and_the_demand_sample(
        tmp_path: Path, database_url: str, db: asyncpg.Connection, store: Store) -> None:
    deployment = DeploymentId(await add_deployment(db, MODEL))
    routes = await RoutingStore.connect(database_url, migrate=False)
    flags = ("--max-num-seqs", "1", "--tokens-per-second", str(TOKENS_PER_S))
    requests: list[asyncio.Task[httpx.Response]] = []
    try:
        async with sims(tmp_path, MODEL, "r-q", flags=flags) as (sim,), \
                running_gateway(database_url, usage_flush_interval_s=TICK_S) as server, \
                httpx.AsyncClient(timeout=60) as http:
            await add_replica(db, deployment, "r-q", sim.url)
            await until(lambda: ready_replicas(server, MODEL) == ["r-q"], what="routed")

            async def row() -> int | None:
                rows = await routes.replica_usage("r-q")
                return rows[0].engine_waiting if rows else None

            # Idle, it says 0: known and empty, not unknown.
            deadline = time.monotonic() + SEEN_WITHIN_S
            while await row() != 0:
                assert time.monotonic() < deadline, await routes.replica_usage("r-q")
                await asyncio.sleep(TICK_S)

            body = {"model": MODEL, "prompt": "x", "max_tokens": TOKENS}
            requests = [asyncio.create_task(http.post(server.url + "/v1/completions",
                                                      json=body)) for _ in range(3)]
            deadline = time.monotonic() + SEEN_WITHIN_S
            while await row() != 2:
                assert time.monotonic() < deadline, await routes.replica_usage("r-q")
                await asyncio.sleep(TICK_S / 2)
            sample = (await store.usage.demand_samples(
                [deployment], flush_interval_s=TICK_S))[deployment]
            assert sample.engine_waiting == 2
            assert sample.waiting == 0, "the gateway held none: they went to the engine"
            assert [u.in_flight for u in sample.replicas] == [3]
    finally:
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await routes.close()
