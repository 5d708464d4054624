"""The agent's fleet mode against the whole stack (bench/scale's fleet, at five nodes): each
simulated node registers as a node of its own, serves its sim engines in-process to the
gateway, and a kill makes a node look to the control plane as a kill -9 of its agent and
engines would: its liveness stream breaks, its replicas go unreachable (their watches
never answer), and they serve again elsewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fleet.scale import ScaleFleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIZE = 5
GIB = 1 << 30
#: The API marks a node silent within node_silent_after_s (1.5 s) of its last ping, and
#: at once when its stream breaks; loaded cores get a few seconds more.
SILENT_WITHIN_S = 5.0
#: From the POSTs (the worker places nothing in its first 15 s) until every model serves.
SERVING_TIMEOUT_S = 120.0


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[ScaleFleet]:
    stack = ScaleFleet(tmp_path / "stack", node_memory="2GiB", size=SIZE)
    try:
        await stack.start()
        await stack.start_fleet()
        yield stack
    finally:
        stack.stop()


async def _until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def _chat(fleet: ScaleFleet, key: str, model: str) -> int:
    async with httpx.AsyncClient(timeout=30.0) as gw:
        resp = await gw.post(f"{fleet.gateway_url}/v1/chat/completions",
                             headers={"Authorization": f"Bearer {key}"},
                             json={"model": model, "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "hi"}]})
        return resp.status_code


async def test_a_fleet_serves_and_a_killed_node_dies_as_a_crashed_one(
        fleet: ScaleFleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.api_url, headers=fleet.headers(),
                                 timeout=30.0) as api:
        nodes = (await api.get("/nodes")).json()
        assert sorted(n["name"] for n in nodes) == [f"sim-000{i}" for i in range(1, 6)]
        assert len({n["node_id"] for n in nodes}) == SIZE
        assert {n["memory_total_bytes"] for n in nodes} == {2 * GIB}
        names = {n["node_id"]: n["name"] for n in nodes}

        models = [f"fleet-{i}" for i in range(3)]
        for model in models:
            resp = await api.post("/models", json={
                "model_id": model, "engine": "sim", "source": "sim", "memory_bytes": GIB,
                "engine_args": {"memory_bytes": 1 << 20, "load_time_s": 0.2}})
            assert resp.status_code == 201, resp.text
            resp = await api.post("/deployments", json={"model_id": model, "replicas": 1})
            assert resp.status_code == 201, resp.text

        async def all_serving() -> bool:
            views = (await api.get("/deployments")).json()
            return len(views) == 3 and all(v["status"] == "serving" for v in views)
        await _until(all_serving, SERVING_TIMEOUT_S, "every deployment serving")
        key = await fleet.client_key()
        assert [await _chat(fleet, key, m) for m in models] == [200, 200, 200]

        replicas = (await api.get("/replicas")).json()
        victim = replicas[0]["nodes"][0]
        doomed = {r["replica_id"] for r in replicas if r["nodes"] == [victim]}
        record = await fleet.kill([names[victim]])
        assert [n["node_id"] for n in record["nodes"]] == [victim]
        assert record["engines"] == len(doomed)

        async def victim_silent() -> bool:
            node = (await api.get(f"/nodes/{victim}")).json()
            return bool(node["state"] == "unreachable" and node["silent_since"])
        await _until(victim_silent, SILENT_WITHIN_S, "the killed node marked silent")

        async def recovered() -> bool:
            views: list[dict[str, Any]] = (await api.get("/deployments")).json()
            return all(v["status"] == "serving" and any(
                r["state"] == "ready" and r["nodes"] != [victim] for r in v["replicas"])
                for v in views)
        await _until(recovered, SERVING_TIMEOUT_S, "every deployment serving elsewhere")
        # Its old replicas were never reported as exited: the watch on a dead node does not
        # answer, so the control plane knows them only as unreachable (then replaced).
        events = (await api.get("/events", params={"limit": 500})).json()
        exits = [e for e in events if e.get("replica_id") in doomed
                 and e["kind"] == "replica.exited"]
        assert exits == [], exits
        assert [await _chat(fleet, key, m) for m in models] == [200, 200, 200]
        # Every live node heartbeats on: the control plane still has each one ready.
        states = {n["node_id"]: n["state"] for n in (await api.get("/nodes")).json()}
        assert {n: s for n, s in states.items() if n != victim} == {
            n: "ready" for n in names if n != victim}, states

    # The fleet timed its heartbeats' round trips (they carry no node: a count, at least
    # one a node).
    assert len(fleet.heartbeats()) >= SIZE
