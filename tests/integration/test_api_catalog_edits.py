"""The catalog changes live (issue 24, section 6), through the API on real PostgreSQL:

* ``PATCH /models/{id}`` changes memory, engine arguments and source, judged as
  ``POST /models`` judges a new entry (a 422 naming the field), and says which
  deployments serve the model;
* a replica placed before the change shows as outdated, one placed after does not;
* ``POST /models`` refuses at once a source its engine cannot read (a Hugging Face repo id
  for llama.cpp, which reads one .gguf file);
* ``DELETE /models/{id}`` of a model in use names the deployments that serve it.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from activities.store import StoreActivities
from modelkeeper.domain.catalog import DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.store_activities import PlaceReplicaInput
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": GIB,
       "engine_args": {"load_time_s": 0.5}}


async def _place(store: Store, spec: DeploymentSpec, replica_id: str) -> None:
    """One replica of ``spec`` placed, as the deployment's workflow places it."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=f"deployment/{spec.deployment_id}",
                                   workflow_run_id="run-1", activity_id=replica_id)
    acts = StoreActivities(store, Settings(database_url="postgresql://unused",
                                           settling_window_s=0))
    await env.run(acts.place_replica, PlaceReplicaInput(
        spec=spec, replica_id=ReplicaId(replica_id), start_timeout_s=60))


async def _deployed(api: httpx.AsyncClient, store: Store, deployment_id: str) -> DeploymentSpec:
    """sim-a in the catalog, deployed as ``deployment_id``, with one node to place on."""
    assert (await api.post("/models", json=SIM)).status_code == 201
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                            cpu_count=16)))
    did = DeploymentId(deployment_id)
    await store.deployments.create_deployment(did, DeploymentRequest(model_id="sim-a"),
                                              deployment_workflow_id(did))
    return DeploymentSpec(deployment_id=did, model_id="sim-a", replicas=2)


async def test_a_change_is_judged_recorded_and_outdates_the_replicas_placed_before(
        api: httpx.AsyncClient, store: Store) -> None:
    spec = await _deployed(api, store, "d-edit")
    await _place(store, spec, "d-edit-r1")

    resp = await api.patch("/models/sim-a", json={"memory_bytes": 2 * GIB,
                                                  "engine_args": {"load_time_s": 1}})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["changes"] == ["memory 1.0 GiB -> 2.0 GiB",
                                 "engine_args {'load_time_s': 0.5} -> {'load_time_s': 1}"]
    assert (answer["deployments"], answer["deployment_count"]) == (["d-edit"], 1)
    shown = (await api.get("/models/sim-a")).json()
    assert (shown["memory_bytes"], shown["engine_args"]) == (2 * GIB, {"load_time_s": 1})
    assert shown["spec_changed_at"] is not None

    # The replica placed before runs the old spec; one placed after runs the new.
    await _place(store, spec, "d-edit-r2")
    view = await store.deployments.get_deployment("d-edit")
    assert view is not None
    assert [(r.replica_id, r.outdated) for r in view.replicas] == [
        ("d-edit-r1", True), ("d-edit-r2", False)]
    changed = [e for e in await store.events.list_events() if e.kind == "model.changed"]
    assert [e.message for e in changed] == [
        "model sim-a changed: memory 1.0 GiB -> 2.0 GiB; engine_args {'load_time_s': 0.5} "
        "-> {'load_time_s': 1}"]

    # The same values again change nothing, and outdate nothing.
    again = await api.patch("/models/sim-a", json={"memory_bytes": 2 * GIB})
    assert again.status_code == 200 and again.json()["changes"] == []
    assert (await api.get("/models/sim-a")).json()["spec_changed_at"] == \
        shown["spec_changed_at"]


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"engine_args": {"rm_rf": True}}, "engine_args", "rm_rf"),
    ({"memory_bytes": 0}, "memory_bytes", "greater than 0"),
    ({"source": "https://evil.example/x"}, "source", "host"),
    ({"colour": "blue"}, "colour", "Extra inputs"),
    ({}, "body", "at least one of"),
])
async def test_a_bad_change_names_the_field_and_keeps_the_model(
        api: httpx.AsyncClient, body: dict[str, object], field: str, words: str) -> None:
    assert (await api.post("/models", json=SIM)).status_code == 201
    resp = await api.patch("/models/sim-a", json=body)
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert field in error["loc"] and words in error["msg"] + str(error.get("input")), error
    kept = (await api.get("/models/sim-a")).json()
    assert (kept["memory_bytes"], kept["engine_args"], kept["spec_changed_at"]) == (
        GIB, {"load_time_s": 0.5}, None)


async def test_a_change_of_an_unknown_model_is_a_404(api: httpx.AsyncClient) -> None:
    resp = await api.patch("/models/nope", json={"memory_bytes": GIB})
    assert resp.status_code == 404 and "nope" in resp.json()["detail"]


async def test_a_new_source_needs_the_new_files_sha256(api: httpx.AsyncClient) -> None:
    digest = "a" * 64
    url = "https://huggingface.co/o/n/resolve/main/m.gguf"
    body = {"model_id": "hf", "engine": "llamacpp", "source": url, "sha256": digest,
            "memory_bytes": GIB}
    assert (await api.post("/models", json=body)).status_code == 201
    moved = url.replace("m.gguf", "m2.gguf")
    refused = await api.patch("/models/hf", json={"source": moved})
    assert refused.status_code == 422
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "sha256"] and "new file's sha256" in error["msg"]
    done = await api.patch("/models/hf", json={"source": moved, "sha256": None})
    assert done.status_code == 200, done.text
    assert (done.json()["model"]["source"], done.json()["model"]["sha256"]) == (moved, None)


@pytest.mark.parametrize("source", ["Qwen/Qwen2.5-0.5B-Instruct-GGUF",
                                    "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF",
                                    "https://huggingface.co/o/n/resolve/main/m.safetensors"])
async def test_llamacpp_refuses_a_source_that_is_no_gguf_file_at_once(
        api: httpx.AsyncClient, source: str) -> None:
    resp = await api.post("/models", json={"model_id": "q", "engine": "llamacpp",
                                           "source": source, "memory_bytes": GIB})
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert error["loc"] == ["body", "source"] and error["input"] == source
    assert "reads one .gguf file" in error["msg"], error
    assert (await api.get("/models")).json() == []


async def test_removing_a_model_in_use_names_its_deployment(
        api: httpx.AsyncClient, store: Store) -> None:
    await _deployed(api, store, "d-busy")
    resp = await api.delete("/models/sim-a")
    assert resp.status_code == 409
    assert resp.json()["detail"] == (
        "model 'sim-a' is in use: deployment(s) d-busy serve it; delete them first "
        "(modelkeeper rm DEPLOYMENT)")


async def test_a_missing_local_file_the_api_reads_is_refused_naming_the_source(
        api: httpx.AsyncClient) -> None:
    # Without memory_bytes the API reads the file for its size: where it can know the
    # file is missing, it says so at once (a path with memory declared is the nodes' to
    # check: they may hold files this machine does not).
    missing = str(Settings().models_dir / "missing.gguf")
    resp = await api.post("/models", json={"model_id": "q", "engine": "llamacpp",
                                           "source": missing})
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert (error["loc"], error["input"]) == (["body", "source"], missing)
    assert error["msg"].startswith("no such file on the API's machine"), error


async def test_a_change_breaking_a_rule_across_fields_is_a_422(
        api: httpx.AsyncClient) -> None:
    body = {**SIM, "memory_bytes": 4 * GIB, "weights_bytes": 3 * GIB}
    assert (await api.post("/models", json=body)).status_code == 201
    resp = await api.patch("/models/sim-a", json={"memory_bytes": 2 * GIB})
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert "weights_bytes" in error["msg"] and "memory_bytes" in error["msg"], error


async def test_a_patch_of_a_catalog_sub_resource_is_a_405(api: httpx.AsyncClient) -> None:
    assert (await api.post("/models", json={**SIM, "model_id": "org/m"})).status_code == 201
    # A model id may hold '/': PATCH reaches it.
    changed = await api.patch("/models/org/m", json={"memory_bytes": 2 * GIB})
    assert changed.status_code == 200, changed.text
    for sub in ("capacity", "headroom", "size"):
        resp = await api.patch(f"/models/org/m/{sub}", json={"memory_bytes": GIB})
        assert resp.status_code == 405, (sub, resp.text)
