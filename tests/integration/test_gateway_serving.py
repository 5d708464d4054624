"""The gateway serving real sim engines, routed from the test database: the openai SDK
unchanged, /v1/models, the 404/503/401 answers, routing changes pushed by NOTIFY, and
usage written to the store."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest

from gateway.server import GatewayServer
from modelkeeper.infra.processes import free_port
from modelkeeper.store.routing import RoutingStore
from tests.support.gateway_support import (
    HOST,
    add_deployment,
    add_replica,
    ready_replicas,
    running_gateway,
    set_replica_state,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-chat"
#: A chat request's smallest valid messages (an empty list is the gateway's own 400).
HI = [{"role": "user", "content": "hi"}]



def sdk(server: GatewayServer, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                              timeout=20)


async def test_openai_sdk_chat_completion_and_streams(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    async with sims(tmp_path, MODEL, "r-a") as (sim,):
        await add_replica(db, deployment, sim.replica_id, sim.url)
        async with running_gateway(database_url) as server:
            assert ready_replicas(server, MODEL) == ["r-a"]
            client = sdk(server)

            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
            assert chat.choices[0].message.content == "the quick brown fox jumps"

            completion = await client.completions.create(model=MODEL, prompt="say", max_tokens=3)
            assert completion.choices[0].text == "the quick brown"

            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                stream=True)
            pieces = [c.choices[0].delta.content async for c in stream if c.choices]
            assert "".join(p for p in pieces if p) == "the quick brown fox"

            text_stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                          stream=True)
            texts = [c.choices[0].text async for c in text_stream]
            assert "".join(texts) == "the quick"

            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            listed = models.data[0].model_dump()
            assert listed["status"] == "serving"
            assert listed["ready_replicas"] == 1
            await client.close()


async def test_unknown_model_is_404_listing_known_models(
        database_url: str, db: asyncpg.Connection) -> None:
    await add_deployment(db, "alpha")
    await add_deployment(db, "beta", status="placing")
    async with running_gateway(database_url) as server, httpx.AsyncClient() as http:
        started = time.monotonic()
        resp = await http.post(server.url + "/v1/chat/completions",
                               json={"model": "alpah", "messages": HI})
        assert time.monotonic() - started < 1.0, "a typo must not wait like a loading model"
        assert resp.status_code == 404
        error = resp.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["known_models"] == ["alpha", "beta"]
        assert "alpha, beta" in error["message"]


async def test_no_ready_replica_waits_then_503_with_retry_after_and_reason(
        database_url: str, db: asyncpg.Connection) -> None:
    await add_deployment(db, "loading", status="placing", last_failure="engine exited 1",
                         consecutive_failures=2)
    async with running_gateway(database_url, gateway_wait_for_replica_s=0.5,
                               gateway_retry_after_s=7) as server, httpx.AsyncClient() as http:
        started = time.monotonic()
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": "loading", "prompt": "x"})
        waited = time.monotonic() - started
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "7"
        error = resp.json()["error"]
        assert error["code"] == "model_not_ready"
        assert error["status"] == "placing"
        assert "being placed" in error["reason"] and "engine exited 1" in error["reason"]
        assert 0.5 <= waited < 5


async def test_degraded_without_a_ready_replica_waits_then_503_naming_the_unreachable_one(
        database_url: str, db: asyncpg.Connection) -> None:
    unreachable = "dep-limp-r1 unreachable: no heartbeat from node-a"
    deployment = await add_deployment(db, "limp", status="degraded", last_failure=unreachable)
    # Its one replica is unreachable: routed around, not sent to.
    await add_replica(db, deployment, "dep-limp-r1", f"http://{HOST}:{free_port()}",
                      state="unreachable")
    async with running_gateway(database_url, gateway_wait_for_replica_s=0.5,
                               gateway_retry_after_s=7) as server, httpx.AsyncClient() as http:
        started = time.monotonic()
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": "limp", "prompt": "x"})
        waited = time.monotonic() - started
        # Held like a starting model (the keeper is surging a replacement), then told to
        # come back: not answered at once as if nothing were coming.
        assert 0.5 <= waited < 5
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "7"
        error = resp.json()["error"]
        assert (error["code"], error["status"]) == ("model_not_ready", "degraded")
        assert error["reason"] == (f"it is degraded: {unreachable}; a replacement is being "
                                   "placed or started")
        assert error["reason"] in error["message"]


async def test_stopped_is_answered_at_once_without_retry_after(
        database_url: str, db: asyncpg.Connection) -> None:
    await add_deployment(db, "idle", status="stopped", replicas=0,
                         last_failure="exit 137 (oom)", consecutive_failures=1)
    async with running_gateway(database_url, gateway_wait_for_replica_s=10) as server, \
            httpx.AsyncClient() as http:
        started = time.monotonic()
        resp = await http.post(server.url + "/v1/chat/completions",
                               json={"model": "idle", "messages": HI})
        assert time.monotonic() - started < 2, "an operator's 0 replicas is not a loading model"
        assert resp.status_code == 503
        assert "retry-after" not in resp.headers, "retrying shortly will not change the answer"
        error = resp.json()["error"]
        assert (error["code"], error["status"], error["reason"]) == (
            "model_stopped", "stopped", "scaled to zero replicas")
        assert error["message"] == ("`idle` is scaled to zero replicas: its deployment is "
                                    "stopped. It is served again once an operator scales it up.")


@pytest.mark.parametrize(("status", "field", "reason", "code"), [
    ("parked", "last_failure", "engine exited with code 1 (OOM)", "model_parked"),
    ("cant_place", "placement_error", "node n1: needs 8 GiB, has 2 GiB", "model_cant_place"),
])
async def test_parked_or_unplaceable_is_answered_at_once_with_why(
        database_url: str, db: asyncpg.Connection, status: str, field: str, reason: str,
        code: str) -> None:
    await add_deployment(db, "stuck", status=status, consecutive_failures=5,
                         placement_error=reason if field == "placement_error" else None,
                         last_failure=reason if field == "last_failure" else None)
    async with running_gateway(database_url, gateway_wait_for_replica_s=10) as server, \
            httpx.AsyncClient() as http:
        started = time.monotonic()
        resp = await http.post(server.url + "/v1/completions",
                               json={"model": "stuck", "prompt": "x"})
        assert time.monotonic() - started < 2, "must not wait for what will not come"
        assert resp.status_code == 503
        assert "retry-after" not in resp.headers, "retrying shortly will not change the answer"
        error = resp.json()["error"]
        assert (error["code"], error["status"], error["reason"]) == (code, status, reason)
        assert reason in error["message"]


@pytest.mark.parametrize("status", ["starting", "degraded"])
async def test_waiting_request_is_served_when_a_replica_becomes_ready(
        tmp_path: Path, database_url: str, db: asyncpg.Connection, status: str) -> None:
    # Degraded: the replica that went unreachable is routed around, and its replacement
    # takes the held request.
    deployment = await add_deployment(db, MODEL, status=status)
    async with sims(tmp_path, MODEL, "r-late") as (sim,), \
            running_gateway(database_url, gateway_wait_for_replica_s=20) as server, \
            httpx.AsyncClient(timeout=30) as http:
        await add_replica(db, deployment, "r-late", sim.url, state="starting")
        request = asyncio.create_task(http.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "max_tokens": 1}))
        entry = server.gateway.table.models[MODEL]
        await until(lambda: entry.waiting == 1, what="the request to wait")
        marked = time.monotonic()
        await set_replica_state(db, "r-late", "ready")
        resp = await request
        # Woken by the notification, not by a poll or the 20 s deadline.
        assert time.monotonic() - marked < 2
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-modelkeeper-replica"] == "r-late"


async def test_draining_replica_is_out_at_once_and_live_state_survives(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL, replicas=2)
    async with sims(tmp_path, MODEL, "r-1", "r-2") as (one, two), \
            running_gateway(database_url) as server, httpx.AsyncClient() as http:
        await add_replica(db, deployment, "r-1", one.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-1"], what="r-1 routed")
        kept = server.gateway.table.models[MODEL].endpoints[0]
        await add_replica(db, deployment, "r-2", two.url)
        await until(lambda: ready_replicas(server, MODEL) == ["r-1", "r-2"], what="r-2 routed")
        # The same live object: r-1's counters and breaker were not reset by r-2 arriving.
        assert server.gateway.table.models[MODEL].endpoints[0] is kept

        await set_replica_state(db, "r-1", "draining")
        await until(lambda: ready_replicas(server, MODEL) == ["r-2"], what="r-1 out")
        served = set()
        for _ in range(6):
            resp = await http.post(server.url + "/v1/completions",
                                   json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert resp.status_code == 200
            served.add(resp.headers["x-modelkeeper-replica"])
        assert served == {"r-2"}


async def test_client_keys_401_and_revocation(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        async with sims(tmp_path, MODEL, "r-auth") as (sim,), \
                running_gateway(database_url, gateway_auth=True) as server, \
                httpx.AsyncClient() as http:
            await add_replica(db, deployment, "r-auth", sim.url)
            await until(lambda: ready_replicas(server, MODEL) == ["r-auth"], what="routed")
            url = server.url + "/v1/chat/completions"
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1}

            missing = await http.post(url, json=body)
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "invalid_api_key"
            assert missing.headers["www-authenticate"] == "Bearer"
            wrong = await http.post(url, json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert (await http.get(server.url + "/v1/models")).status_code == 401

            record, key = await routes.create_api_key("tests")
            assert key.startswith("mkc-") and record.prefix == key[:12]
            await until(lambda: len(server.gateway.admission._key_hashes) == 1, what="key cached")
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key,
                                        max_retries=0)
            chat = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
            assert chat.choices[0].message.content == "the"

            assert [r.key_id for r in await routes.revoke_api_keys(record.prefix)] == [
                record.key_id]
            await until(lambda: not server.gateway.admission._key_hashes, what="revocation seen")
            with pytest.raises(openai.AuthenticationError):
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
            await client.close()
            # Only the hash is stored.
            stored = await db.fetchval("SELECT key_sha256 FROM api_keys")
            assert key not in stored and len(stored) == 64
    finally:
        await routes.close()


async def test_usage_is_written_in_batches(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        async with sims(tmp_path, MODEL, "r-u", flags=("--tokens-per-second", "20")) as (sim,), \
                running_gateway(database_url, usage_flush_interval_s=0.1) as server, \
                httpx.AsyncClient(timeout=30) as http:
            await add_replica(db, deployment, "r-u", sim.url)
            await until(lambda: ready_replicas(server, MODEL) == ["r-u"], what="routed")
            # 20 tokens at 20/s: open for about a second, long enough to be seen in flight.
            slow = asyncio.create_task(http.post(
                server.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 20}))
            deadline = time.monotonic() + 10
            while True:
                rows = await routes.replica_usage("r-u")
                if rows and rows[0].in_flight == 1:
                    break
                assert time.monotonic() < deadline, rows
                await asyncio.sleep(0.05)
            assert (await slow).status_code == 200
            while True:
                rows = await routes.replica_usage("r-u")
                if rows[0].in_flight == 0 and rows[0].last_used_at is not None:
                    break
                assert time.monotonic() < deadline, rows
                await asyncio.sleep(0.05)
            waiting = await routes.deployment_usage(deployment)
            assert waiting[0].waiting == 0 and waiting[0].last_request_at is not None
            usage = server.gateway.usage.reporter
            assert usage is not None
        # A stopped worker removes its rows.
        assert await routes.replica_usage("r-u") == []
    finally:
        await routes.close()


async def test_listener_reconnects_and_reloads(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    deployment = await add_deployment(db, MODEL)
    async with sims(tmp_path, MODEL, "r-x") as (sim,), \
            running_gateway(database_url) as server:
        listener = server.gateway.listener
        assert listener is not None and listener.connections == 1
        pid = listener.backend_pid
        await db.execute("SELECT pg_terminate_backend($1)", pid)
        # Changed while the listener is down or reconnecting: only a full reload sees it.
        await add_replica(db, deployment, "r-x", sim.url)
        await until(lambda: listener.connections == 2, what="reconnection")
        await until(lambda: ready_replicas(server, MODEL) == ["r-x"], what="reload")
        assert listener.backend_pid != pid
