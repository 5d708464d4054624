"""Hardware profiles through the API: POST /models keeps a model's profiles and refuses a
profile's engine argument by its field; GET /placement/explain says which profile it
judged and names the ones it would pass over."""

from __future__ import annotations

import httpx
import pytest

from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(90)

GIB = 1 << 30
MODEL = {"model_id": "m", "engine": "sim", "source": "sim", "memory_bytes": GIB,
         "profiles": [{"name": "sim-gpu", "engine": "sim", "gpus": 1, "priority": 1},
                      {"name": "sim-cpu", "engine": "sim", "memory_bytes": 2 * GIB,
                       "engine_args": {"load_time_s": 0.5}}]}


async def test_models_keep_profiles_and_explain_names_them(
        api: httpx.AsyncClient, store: Store) -> None:
    created = await api.post("/models", json=MODEL)
    assert created.status_code == 201, created.text
    assert [p["name"] for p in created.json()["profiles"]] == ["sim-gpu", "sim-cpu"]
    assert (await api.get("/models/m")).json()["profiles"] == created.json()["profiles"]

    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="a", labels={},
        inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                            cpu_count=4)))
    shown = (await api.get("/placement/explain", params={"model_id": "m"})).json()
    assert (shown["fits"], shown["profile"], shown["nodes_chosen"]) == (True, "sim-cpu", ["n1"])
    assert shown["note"] == ("runs profile sim-cpu, passed over profile sim-gpu: node a: "
                             "0 of 0 GPUs free, needs 1")


async def test_a_profiles_engine_argument_is_refused_by_its_field(
        api: httpx.AsyncClient) -> None:
    bad = {**MODEL, "profiles": [{"name": "cpp", "engine": "llamacpp",
                                  "engine_args": {"load_time_s": 1}}]}
    resp = await api.post("/models", json=bad)
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert error["loc"] == ["body", "profiles[0].engine_args"]
    assert "engine_args.load_time_s" in error["msg"] and "llamacpp" in error["msg"]
    assert (await api.get("/models")).json() == []
