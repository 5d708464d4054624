"""Measured capacity in the store and on the API: what bench sends is stored per GPU or
core and replaces the profile's earlier figure, the model's view shows it, size answers
by it against the nodes' room, and the usage watch's sample carries the concurrency."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest

from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.measured import CapacityReport, measured_of
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.shards import EngineKind
from modelkeeper.store import Store
from tests.support.gateway_support import add_deployment

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


def report(concurrency: int, *, profile: str = "") -> dict[str, Any]:
    return {"profile": profile, "concurrency": concurrency, "tokens_per_s": 240.0,
            "mean_request_s": 2.0, "ttft_p95_s": 0.4, "itl_p95_s": 0.05,
            "objective": {"ttft_p95_s": 2.0, "itl_p95_s": 0.1}, "replicas": 1,
            "max_tokens": 128}


async def test_bench_results_are_stored_shown_and_sized_by(api: httpx.AsyncClient,
                                                           store: Store) -> None:
    created = await api.post("/models", json={"model_id": "org/chat", "engine": "sim",
                                              "source": "sim", "memory_bytes": 4 * GIB,
                                              "cpu_cores": 4})
    assert created.status_code == 201, created.text
    assert (await api.get("/models/org/chat")).json()["measured"] == []
    # Never measured: size says how to measure it.
    refused = await api.get("/models/org/chat/size", params={"rps": 5})
    assert refused.status_code == 409 and "modelkeeper bench org/chat" in refused.text

    first = await api.put("/models/org/chat/capacity", json=report(6))
    assert first.status_code == 200, first.text
    again = await api.put("/models/org/chat/capacity", json=report(8))
    stored = again.json()
    # Per core (the model declares 4 and no GPU); the later measurement replaces the first.
    assert (stored["unit"], stored["tokens_per_s_per_unit"]) == ("core", 60.0)
    shown = (await api.get("/models/org/chat")).json()["measured"]
    assert [(m["profile"], m["concurrency"]) for m in shown] == [("", 8)]
    assert (await api.get("/models/org/chat/capacity")).json() == shown
    events = (await api.get("/events")).json()
    assert any(e["kind"] == "model.measured" and "8 concurrent request(s) per replica"
               in e["message"] for e in events)

    # 10 req/s x 2 s = 20 open at once, 8 per replica: 3 replicas. Two nodes of 10 GiB
    # hold 2 replicas of 4 GiB each: 4 fit, so the room is there.
    for name in ("n-a", "n-b"):
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId(name), name=name,
            inventory=Inventory(memory_total_bytes=10 * GIB, memory_available_bytes=10 * GIB,
                                cpu_count=16)))
    sized = (await api.get("/models/org/chat/size", params={"rps": 10})).json()
    assert (sized["replicas_needed"], sized["replicas_now"], sized["more_needed"]) == (3, 0, 3)
    assert (sized["fit_now"], sized["enough_room"]) == (3, True)
    short = (await api.get("/models/org/chat/size", params={"rps": 40})).json()
    assert (short["replicas_needed"], short["fit_now"], short["enough_room"]) == (10, 4, False)


async def test_a_report_out_of_bounds_or_for_an_unknown_model_is_refused(
        api: httpx.AsyncClient) -> None:
    assert (await api.put("/models/nope/capacity", json=report(4))).status_code == 404
    await api.post("/models", json={"model_id": "m", "engine": "sim", "source": "sim",
                                    "memory_bytes": GIB})
    bad = await api.put("/models/m/capacity", json={**report(4), "concurrency": 0})
    assert bad.status_code == 422 and "concurrency" in bad.text
    assert (await api.get("/models/m/size", params={"rps": 0})).status_code == 422


async def test_the_usage_watch_reads_the_least_measured_concurrency(
        database_url: str, store: Store) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        deployment = DeploymentId(await add_deployment(conn, "sim-measured"))
        await add_deployment(conn, "sim-unmeasured")
    finally:
        await conn.close()
    for profile, concurrency in (("gpu", 12), ("cpu", 3)):
        await store.measured.put_measured(measured_of(
            CapacityReport.model_validate(report(concurrency, profile=profile)),
            model_id=ModelId("sim-measured"), engine=EngineKind.SIM, gpus=None,
            cpu_cores=None, at=datetime.now(UTC)))
    samples = await store.usage.demand_samples(
        [deployment, DeploymentId("dep-sim-unmeasured")], flush_interval_s=1.0)
    assert samples[deployment].measured_concurrency == 3
    assert samples[DeploymentId("dep-sim-unmeasured")].measured_concurrency is None
