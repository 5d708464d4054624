"""Graceful stop, for real: ``drain_replica`` run as a function (``ActivityEnvironment``,
no Temporal) against a real gateway serving two sim engines from the test database.

The gateway's usage tick is set far longer than any wait here, so a drain can only end
in time if the gateway writes its rows the moment a replica leaves routing and the
moment that replica's last request ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from activities.routing import RoutingActivities
from gateway.server import GatewayServer
from gateway.table import Endpoint
from modelkeeper.domain.catalog import ReplicaStateUpdate
from modelkeeper.domain.draining import DrainReplicaInput, DrainReplicaResult
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.status import ReplicaState
from modelkeeper.store import Store
from modelkeeper.store.routing import ReplicaUsage, RoutingStore
from tests.support.gateway_support import (
    add_deployment,
    add_replica,
    metric,
    ready_replicas,
    running_gateway,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

log = logging.getLogger(__name__)

MODEL = "sim-drain"
#: The sims generate 20 tokens a second: a request's length is set by its max_tokens.
TOKENS_PER_S = 20
#: The gateway's usage tick: longer than the grace periods below, so only the prompt
#: flushes (replica out of routing, its last request over) can end a drain in time.
SLOW_TICK_S = 60.0



@asynccontextmanager
async def two_replicas(tmp_path: Path, database_url: str, db: asyncpg.Connection
                       ) -> AsyncIterator[tuple[GatewayServer, httpx.AsyncClient]]:
    """A gateway routing MODEL to r-a and r-b, slow sims, and an HTTP client."""
    deployment = await add_deployment(db, MODEL, replicas=2)
    async with sims(tmp_path, MODEL, "r-a", "r-b",
                    flags=("--tokens-per-second", str(TOKENS_PER_S))) as (a, b), \
            running_gateway(database_url, usage_flush_interval_s=SLOW_TICK_S) as server, \
            httpx.AsyncClient(timeout=60) as http:
        await add_replica(db, deployment, "r-a", a.url)
        await add_replica(db, deployment, "r-b", b.url)
        await until(lambda: sorted(ready_replicas(server, MODEL)) == ["r-a", "r-b"],
                    what="both replicas routed")
        yield server, http


@dataclasses.dataclass
class Stream:
    """A streaming completion held open: where it went, and how it ended."""

    replica: asyncio.Future[str]
    task: asyncio.Task[tuple[int, list[str], float]]


def open_stream(server: GatewayServer, http: httpx.AsyncClient, tokens: int) -> Stream:
    """Start a streaming completion of ``tokens`` tokens; its replica is known once the
    response starts, and the task returns (status, data lines, monotonic end time)."""
    replica: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def run() -> tuple[int, list[str], float]:
        body = {"model": MODEL, "prompt": "x", "max_tokens": tokens, "stream": True}
        async with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            replica.set_result(resp.headers["x-modelkeeper-replica"])
            lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
        return resp.status_code, lines, time.monotonic()

    return Stream(replica, asyncio.create_task(run()))


def endpoint_of(server: GatewayServer, replica_id: str) -> Endpoint:
    return next(e for e in server.gateway.table.models[MODEL].endpoints
                if e.replica_id == replica_id)


def drain(store: Store, replica_id: str, grace_s: float, *, flush_interval_s: float,
          env: ActivityEnvironment | None = None) -> asyncio.Task[DrainReplicaResult]:
    env = env or ActivityEnvironment()
    activities = RoutingActivities(store, usage_flush_interval_s=flush_interval_s)
    return asyncio.create_task(env.run(activities.drain_replica, DrainReplicaInput(
        replica_id=ReplicaId(replica_id), grace_s=grace_s)))


async def replica_state(db: asyncpg.Connection, replica_id: str) -> str | None:
    state: str | None = await db.fetchval(
        "SELECT state FROM replicas WHERE replica_id = $1", replica_id)
    return state


async def test_drain_waits_for_the_request_in_flight_while_new_ones_go_elsewhere(
        tmp_path: Path, database_url: str, db: asyncpg.Connection, store: Store) -> None:
    grace_s = 20.0
    async with two_replicas(tmp_path, database_url, db) as (server, http):
        # 60 tokens at 20/s: a stream open for about 3 s.
        stream = open_stream(server, http, tokens=60)
        a = await asyncio.wait_for(stream.replica, 10)
        b = "r-b" if a == "r-a" else "r-a"
        endpoint = endpoint_of(server, a)
        assert endpoint.in_flight == 1

        started = time.monotonic()
        task = drain(store, a, grace_s, flush_interval_s=SLOW_TICK_S)
        at_return: list[tuple[float, int]] = []
        task.add_done_callback(lambda _: at_return.append((time.monotonic(),
                                                           endpoint.in_flight)))
        # 1) It leaves routing first.
        await until(lambda: ready_replicas(server, MODEL) == [b], what=f"{a} out of routing")
        assert await replica_state(db, a) == ReplicaState.DRAINING

        # New requests during the drain all go to the other replica, and succeed.
        answers = await asyncio.gather(*(
            http.post(server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            for _ in range(8)))
        assert [r.status_code for r in answers] == [200] * 8
        assert {r.headers["x-modelkeeper-replica"] for r in answers} == {b}
        assert not task.done(), "the drain must wait for the request still in flight"
        assert endpoint.in_flight == 1

        # 2) The request in flight completes, whole.
        status, lines, stream_ended = await stream.task
        assert status == 200
        assert lines[-1] == "data: [DONE]" and len(lines) > 60, "all 60 tokens, then [DONE]"
        # 3) Then, and only then, the drain returns: well before its grace.
        result = await asyncio.wait_for(task, grace_s)
        returned, in_flight_then = at_return[0]
        log.info("drain of %s: waited %.2fs (store clock), returned %.3fs after the "
                    "stream ended, %.2fs after it began", a, result.waited_s,
                    returned - stream_ended, returned - started)
        assert result == DrainReplicaResult(waited_s=result.waited_s, in_flight_left=0,
                                            timed_out=False)
        assert in_flight_then == 0, "returned while the request was still in flight"
        assert returned - stream_ended < 1.0, "the gateway must report the end at once"
        assert 2.0 < result.waited_s < grace_s / 2
        # Written down and forgotten: the gateway no longer reports it, nor its gauge.
        await until(lambda: endpoint not in server.gateway.table.leaving, what="forgotten")
        text = (await http.get(server.url + "/metrics")).text
        assert metric(text, "modelkeeper_gateway_in_flight", model=MODEL, replica=b) == 0
        assert metric(text, "modelkeeper_gateway_in_flight", model=MODEL, replica=a) is None

        # A retry (or a second call) changes nothing and is done at once: the gateway's
        # row says 0, written after the first mark, which the retry carries on from.
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, attempt=2, heartbeat_details=[
            time.time() - (time.monotonic() - started)])
        again = await asyncio.wait_for(drain(store, a, grace_s,
                                             flush_interval_s=SLOW_TICK_S, env=env), 5)
        assert not again.timed_out and again.in_flight_left == 0
        assert await replica_state(db, a) == ReplicaState.DRAINING


async def test_drain_gives_up_after_its_grace_with_the_request_still_in_flight(
        tmp_path: Path, database_url: str, db: asyncpg.Connection, store: Store) -> None:
    grace_s = 1.5
    async with two_replicas(tmp_path, database_url, db) as (server, http):
        # 100 tokens at 20/s: a stream open for about 5 s, longer than the grace.
        stream = open_stream(server, http, tokens=100)
        a = await asyncio.wait_for(stream.replica, 10)
        beats: list[tuple[Any, ...]] = []
        env = ActivityEnvironment()
        env.on_heartbeat = lambda *details: beats.append(details)

        started = time.monotonic()
        result = await asyncio.wait_for(
            drain(store, a, grace_s, flush_interval_s=SLOW_TICK_S, env=env), 10)
        took = time.monotonic() - started
        log.info("drain of %s timed out: waited %.2fs (store clock), %.2fs here",
                    a, result.waited_s, took)
        assert result.timed_out and result.in_flight_left == 1
        assert grace_s <= result.waited_s < grace_s + 1.0
        assert not stream.task.done(), "the stream outlives the grace"
        # Heartbeats every second, each carrying the mark time (for a retry).
        assert len(beats) >= 2 and len({b for b in beats}) == 1

        # Nothing here stops the engine, so the request still ends well.
        status, lines, _ = await stream.task
        assert status == 200 and lines[-1] == "data: [DONE]"
        await until(lambda: not server.gateway.table.leaving, what="the gateway forgets it")


async def test_mark_is_idempotent_and_never_undoes_a_stop(
        database_url: str, db: asyncpg.Connection, store: Store) -> None:
    deployment = await add_deployment(db, MODEL, replicas=3)
    for replica_id, state in (("r-1", "ready"), ("r-2", "stopping"), ("r-3", "starting")):
        await add_replica(db, deployment, replica_id, "http://127.0.0.1:1", state)

    first = await store.deployments.mark_replica_draining("r-1")
    assert first is not None and first[0] is ReplicaState.DRAINING
    again = await store.deployments.mark_replica_draining("r-1")
    # Already out of routing: it counts from when it left (no later than the first mark).
    assert again is not None and again[0] is ReplicaState.DRAINING and again[1] <= first[1]
    stopping = await store.deployments.mark_replica_draining("r-2")
    assert stopping is not None and stopping[0] is ReplicaState.STOPPING
    assert await replica_state(db, "r-2") == "stopping", "a stop never goes back"
    starting = await store.deployments.mark_replica_draining("r-3")
    assert starting is not None and starting[0] is ReplicaState.DRAINING
    assert await store.deployments.mark_replica_draining("gone") is None


async def test_usage_rows_a_drain_trusts_and_a_retry_that_keeps_its_first_mark(
        database_url: str, db: asyncpg.Connection, store: Store) -> None:
    deployment = await add_deployment(db, MODEL)
    await add_replica(db, deployment, "r-1", "http://127.0.0.1:1")
    routes = RoutingStore(await asyncpg.create_pool(database_url, min_size=1, max_size=2),
                          owns_pool=True)
    try:
        # A worker that has not heard of the mark yet still routes r-1: its row is not
        # written, since its count could still grow. One that dropped it is written.
        first_mark = await db.fetchval("SELECT clock_timestamp() - interval '10 seconds'")
        marked = await store.deployments.mark_replica_draining("r-1")
        assert marked is not None
        await routes.write_usage("g-late", [ReplicaUsage("r-1", 0, None)], [])
        await routes.write_usage("g-left", [], [], leaving=[ReplicaUsage("r-1", 2, None)])
        now, reports = await store.usage.replica_usage_since("r-1", first_mark)
        assert [(r.gateway_id, r.in_flight) for r in reports] == [("g-left", 2)]
        assert reports[0].updated_at > marked[1] and now >= reports[0].updated_at

        # A retry goes on from the first attempt's mark: its grace (5 s) is already over.
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, attempt=2,
                                       heartbeat_details=[first_mark.timestamp()])
        result = await asyncio.wait_for(
            drain(store, "r-1", 5.0, flush_interval_s=0.3, env=env), 5)
        assert result.timed_out and result.in_flight_left == 2 and result.waited_s >= 10
    finally:
        await routes.close()


async def test_a_replica_no_gateway_serves_is_drained_after_one_flush_interval(
        database_url: str, db: asyncpg.Connection, store: Store) -> None:
    deployment = await add_deployment(db, MODEL)
    await add_replica(db, deployment, "r-1", "http://127.0.0.1:1")
    started = time.monotonic()
    result = await asyncio.wait_for(drain(store, "r-1", 30.0, flush_interval_s=0.5), 5)
    took = time.monotonic() - started
    assert not result.timed_out and result.in_flight_left == 0
    assert 0.5 <= result.waited_s < 1.5 and took < 2.0
    # And one that is gone is drained at once.
    gone = await asyncio.wait_for(drain(store, "r-none", 30.0, flush_interval_s=0.5), 5)
    assert gone == DrainReplicaResult(waited_s=0.0, in_flight_left=0, timed_out=False)


async def test_a_replica_the_keeper_already_took_out_of_routing_drains_from_that_moment(
        tmp_path: Path, database_url: str, db: asyncpg.Connection, store: Store) -> None:
    """The keeper's own write (stopping) can land before the drain's mark: the gateway
    drops the replica then, writes its 0 once, and never writes about it again. The drain
    counts from when it left routing (migration 0009); counting from its own later mark,
    it waited out the stale-row rule (5 flush intervals, 5 s by default) for nothing."""
    flush_s = 1.0
    async with two_replicas(tmp_path, database_url, db) as (server, _http):
        await store.deployments.record_replica_state(ReplicaStateUpdate(
            replica_id=ReplicaId("r-a"), state=ReplicaState.STOPPING))
        # The gateway writes r-a's 0 at once when it drops it (a nudge), and may have
        # done so by the first look: wait for both, not for a moment in between. Were the
        # 0 never written, the drain below would wait out the stale-row rule and fail.
        table = server.gateway.table
        await until(lambda: ready_replicas(server, MODEL) == ["r-b"]
                    and all(e.replica_id != "r-a" for e in table.leaving),
                    what="r-a dropped and its 0 written")
        started = time.monotonic()
        result = await asyncio.wait_for(drain(store, "r-a", 30, flush_interval_s=flush_s), 10)
        took = time.monotonic() - started
        assert not result.timed_out and result.in_flight_left == 0
        assert took < 2 * flush_s, f"waited {took:.1f}s for a replica already drained"
        assert await replica_state(db, "r-a") == ReplicaState.STOPPING
