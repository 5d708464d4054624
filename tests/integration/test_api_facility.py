"""A node's hold and the power caps through the API, on real PostgreSQL and Temporal: a
hold set by PATCH shows on the node (GET /nodes, GET /nodes/{id}) until it is released,
with an audit event each time; power caps are set, listed and removed, and bad input is a
422 or a 404 naming what was wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.units import GIB
from modelkeeper.store import Store
from tests.integration.test_api_room import register, settings_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def api(local_temporal_env: WorkflowEnvironment,
              database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings_for(local_temporal_env, database_url))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        yield http


async def test_a_hold_shows_on_the_node_until_it_is_released(api: httpx.AsyncClient,
                                                              store: Store) -> None:
    await register(store, "gpu-a")
    held = await api.patch("/nodes/gpu-a", json={"hold_class": "critical",
                                                 "hold_owner": "acme/ml"})
    assert held.status_code == 200, held.text
    assert (held.json()["hold_class"], held.json()["hold_owner"]) == ("critical", "acme/ml")
    listed = (await api.get("/nodes")).json()
    assert [(n["name"], n["hold_class"], n["hold_owner"]) for n in listed] == [
        ("gpu-a", "critical", "acme/ml")]
    # A second PATCH changing only the owner keeps the class.
    moved = await api.patch("/nodes/gpu-a", json={"hold_owner": "acme"})
    assert (moved.json()["hold_class"], moved.json()["hold_owner"]) == ("critical", "acme")

    both = await api.patch("/nodes/gpu-a", json={"release_hold": True,
                                                 "hold_class": "standard"})
    assert both.status_code == 422 and "release_hold or a hold" in both.text
    bad = await api.patch("/nodes/gpu-a", json={"hold_class": "urgent"})
    assert bad.status_code == 422 and "hold_class" in bad.text

    released = await api.patch("/nodes/gpu-a", json={"release_hold": True})
    assert (released.json()["hold_class"], released.json()["hold_owner"]) == (None, None)
    shown = (await api.get("/nodes/gpu-a")).json()
    assert (shown["hold_class"], shown["hold_owner"]) == (None, None)
    events = await store._pool.fetch(
        "SELECT message FROM events WHERE kind = 'node.updated' ORDER BY event_id")
    assert [e["message"] for e in events] == [
        "node gpu-a (gpu-a): hold_class=critical, hold_owner=acme/ml",
        "node gpu-a (gpu-a): hold_owner=acme",
        "node gpu-a (gpu-a): release_hold=True"]


async def test_power_caps_are_set_listed_and_removed(api: httpx.AsyncClient) -> None:
    assert (await api.get("/power-caps")).json() == {}
    assert (await api.put("/power-caps/pdu-3", json={"watts": 7200})).json() == {
        "pdu-3": 7200}
    assert (await api.put("/power-caps/_facility", json={"watts": 50000})).json() == {
        "_facility": 50000, "pdu-3": 7200}
    assert (await api.put("/power-caps/pdu-3", json={"watts": 6000})).json()["pdu-3"] == 6000
    negative = await api.put("/power-caps/pdu-3", json={"watts": -1})
    assert negative.status_code == 422 and "watts" in negative.text
    assert (await api.delete("/power-caps/pdu-3")).json() == {"_facility": 50000}
    gone = await api.delete("/power-caps/pdu-3")
    assert gone.status_code == 404 and "pdu 'pdu-3' has no power cap" in gone.text


async def test_engine_versions_show_on_the_node_and_judge_the_explain(
        api: httpx.AsyncClient, store: Store) -> None:
    for name, engines in (("gpu-old", {EngineKind.VLLM: "0.5.4", EngineKind.SIM: "0.2.0"}),
                          ("cpu-only", {EngineKind.SIM: "0.2.0"}),
                          ("gpu-new", {EngineKind.VLLM: "0.6.3"})):
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId(name), name=name, engines=engines,
            inventory=Inventory(memory_total_bytes=16 * GIB,
                                memory_available_bytes=16 * GIB, cpu_count=8)))
    shown = {n["name"]: n["engines"] for n in (await api.get("/nodes")).json()}
    assert shown["gpu-old"] == {"vllm": "0.5.4", "sim": "0.2.0"}

    added = await api.post("/models", json={
        "model_id": "qwen", "engine": "vllm", "source": "org/qwen",
        "memory_bytes": 4 * GIB, "engine_version": "0.6.3"})
    assert added.status_code == 201, added.text
    assert added.json()["engine_version"] == "==0.6.3"
    why = {n["node_id"]: n for n in (await api.get("/placement/explain",
                                                   params={"model_id": "qwen"})).json()["nodes"]}
    assert (why["gpu-old"]["reason"], why["gpu-old"]["message"]) == (
        "engine_version", "vllm 0.5.4, needs ==0.6.3")
    assert (why["cpu-only"]["reason"], why["cpu-only"]["message"]) == (
        "no_engine", "cannot run vllm (its agent found: sim 0.2.0)")
    assert why["gpu-new"]["fits"]

    bad = await api.post("/models", json={"model_id": "q2", "engine": "vllm",
                                          "source": "org/q2", "memory_bytes": GIB,
                                          "engine_version": "newest"})
    assert bad.status_code == 422
    assert "engine_version" in bad.text and "'newest' is not a version requirement" in bad.text
