"""The API's catalog and deployment routes against real PostgreSQL and Temporal
(no worker: these check what the API itself decides)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from api.auth import UNAUTHENTICATED_ACTOR
from modelkeeper.domain.catalog import DeploymentStatusUpdate
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import NODE_NAME_PATTERN, AgentRegistration, Inventory
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from tests.support.gateway_support import metric

pytestmark = pytest.mark.timeout(60)

SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30}


@pytest.fixture
async def api(local_temporal_env: WorkflowEnvironment,
              database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    client = local_temporal_env.client
    settings = Settings(database_url=database_url,
                        temporal_address=client.service_client.config.target_host,
                        temporal_namespace=client.namespace, api_auth=False)
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        yield http


async def test_models_catalog(api: httpx.AsyncClient) -> None:
    assert (await api.post("/models", json=SIM)).status_code == 201
    assert (await api.post("/models", json=SIM)).status_code == 409
    # The packaged SmolLM2's memory is estimated from its file, and says so.
    smol = await api.post("/models", json={"model_id": "smol", "engine": "llamacpp",
                                           "source": "smollm2"})
    assert smol.status_code == 201, smol.text
    assert smol.json()["memory_estimated"] is True
    assert 150 << 20 < smol.json()["memory_bytes"] < 300 << 20
    listed = [m["model_id"] for m in (await api.get("/models")).json()]
    assert listed == ["sim-a", "smol"]
    assert (await api.delete("/models/smol")).status_code == 204
    assert (await api.get("/models/smol")).status_code == 404


@pytest.mark.parametrize(("body", "field", "words"), [
    ({**SIM, "colour": "blue"}, "colour", "Extra inputs"),
    ({**SIM, "engine": "tgi"}, "engine", "llamacpp"),
    ({**SIM, "memory_bytes": None}, "memory_bytes", "required for engine 'sim'"),
    ({**SIM, "engine_args": {"rm_rf": True}}, "engine_args", "rm_rf"),
    ({**SIM, "model_id": "bad id!"}, "model_id", "pattern"),
])
async def test_bad_models_name_the_field(api: httpx.AsyncClient, body: dict[str, object],
                                         field: str, words: str) -> None:
    resp = await api.post("/models", json=body)
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert error["loc"][-1] == field and words in error["msg"] + str(error.get("input"))
    assert (await api.get("/models")).json() == []  # nothing was kept


async def test_deployments_create_conflict_unknown_delete(
        api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment) -> None:
    await api.post("/models", json=SIM)
    unknown = await api.post("/deployments", json={"model_id": "nope"})
    assert unknown.status_code == 422
    assert unknown.json()["detail"][0]["loc"] == ["body", "model_id"]
    assert "sim-a" in unknown.json()["detail"][0]["msg"]  # lists the known models
    bad = await api.post("/deployments", json={"model_id": "sim-a", "replicas": 1000})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "replicas"]

    created = await api.post("/deployments", json={"model_id": "sim-a", "replicas": 2})
    assert created.status_code == 201, created.text
    view = created.json()
    assert (view["status"], view["desired_replicas"], view["ready_replicas"]) == (
        "placing", 2, 0)
    assert view["workflow_id"] == f"deployment/{view['deployment_id']}"
    # The web UI shows the run with a sentence that stays true (issue 24): no replica
    # count, which a scale would make a lie; the current details carry what changes.
    described = await local_temporal_env.client.get_workflow_handle(
        view["workflow_id"]).describe()
    assert await described.static_summary() == (
        f"Deployment {view['deployment_id']}, created for model sim-a by "
        f"{UNAUTHENTICATED_ACTOR}; its current details say how it stands now")
    assert (await api.post("/deployments", json={"model_id": "sim-a"})).status_code == 409
    assert (await api.get(f"/deployments/{view['deployment_id']}")).status_code == 200
    assert (await api.get("/deployments/d-missing")).status_code == 404
    assert (await api.delete("/deployments/d-missing")).status_code == 404
    first = await api.delete(f"/deployments/{view['deployment_id']}")
    second = await api.delete(f"/deployments/{view['deployment_id']}")
    assert (first.status_code, second.status_code) == (202, 202)
    assert (await api.get(f"/deployments/{view['deployment_id']}")).json()["status"] == \
        "deleting"


async def test_racing_creates_leave_exactly_one_deployment(api: httpx.AsyncClient) -> None:
    await api.post("/models", json=SIM)
    results = await asyncio.gather(*(api.post("/deployments", json={"model_id": "sim-a"})
                                     for _ in range(6)))
    assert sorted(r.status_code for r in results) == [201] + [409] * 5
    assert len((await api.get("/deployments")).json()) == 1


async def test_degraded_and_stopped_show_in_the_list_and_in_the_status_gauge(
        api: httpx.AsyncClient, store: Store) -> None:
    # Written as the keeper writes them (no worker runs here): the API reads the store.
    unreachable = "d-r1 unreachable: no heartbeat from a"
    written: dict[str, tuple[DeploymentStatus, int, str | None]] = {
        "sim-a": (DeploymentStatus.DEGRADED, 2, unreachable),
        "sim-b": (DeploymentStatus.STOPPED, 0, None),
        "sim-c": (DeploymentStatus.SERVING, 1, None),
    }
    ids = {}
    for model, (status, replicas, last_failure) in written.items():
        assert (await api.post("/models", json={**SIM, "model_id": model})).status_code == 201
        created = await api.post("/deployments", json={"model_id": model, "replicas": 1})
        ids[model] = created.json()["deployment_id"]
        await store.deployments.record_deployment_status(DeploymentStatusUpdate(
            deployment_id=ids[model], status=status, placement_error=None,
            consecutive_failures=0, last_failure=last_failure, desired_replicas=replicas))

    listed = {d["model_id"]: d for d in (await api.get("/deployments")).json()}
    assert {m: (d["status"], d["desired_replicas"], d["last_failure"])
            for m, d in listed.items()} == {
        "sim-a": ("degraded", 2, unreachable), "sim-b": ("stopped", 0, None),
        "sim-c": ("serving", 1, None)}
    one = (await api.get(f"/deployments/{ids['sim-a']}")).json()
    assert (one["status"], one["last_failure"]) == ("degraded", unreachable)

    text = (await api.get("/metrics")).text
    for model, (current, _, _) in written.items():
        # A series for every status, 1 for the current one: "degraded for 10 minutes"
        # alerts on a series that exists at 0 before it turns 1.
        assert {status.value: metric(text, "modelkeeper_deployment_status",
                                     deployment_id=ids[model], model_id=model,
                                     status=status.value)
                for status in DeploymentStatus} == {
            status.value: float(status is current) for status in DeploymentStatus}
    assert metric(text, "modelkeeper_deployment_desired_replicas",
                  deployment_id=ids["sim-b"], model_id="sim-b") == 0.0


# -- node names ----------------------------------------------------------------------------

GIB = 1 << 30


async def _register(store: Store, node_id: str, name: str) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=name,
        inventory=Inventory(memory_total_bytes=64 * GIB, memory_available_bytes=64 * GIB,
                            cpu_count=8)))


async def test_deploy_takes_node_names_wherever_it_takes_ids(
        api: httpx.AsyncClient, store: Store) -> None:
    await _register(store, "n-7f3a", "gpu-a")
    await _register(store, "n-91bc", "gpu-b")
    await api.post("/models", json=SIM)
    # A name and an id side by side; the deployment keeps ids, which survive a rename.
    created = await api.post("/deployments", json={"model_id": "sim-a",
                                                   "node_ids": ["gpu-a", "n-91bc", "n-7f3a"]})
    assert created.status_code == 201, created.text
    assert created.json()["node_ids"] == ["n-7f3a", "n-91bc"]
    # explain's dry run takes names too, and heads its verdict with them.
    explained = await api.get("/placement/explain",
                              params={"model_id": "sim-a", "node_ids": ["gpu-b"]})
    assert explained.status_code == 200, explained.text
    assert explained.json()["nodes_chosen"] == ["n-91bc"]
    assert {n["node_id"]: n["name"] for n in explained.json()["nodes"]} == {
        "n-7f3a": "gpu-a", "n-91bc": "gpu-b"}


async def test_an_unknown_node_is_a_422_listing_the_known_ones_by_name_and_id(
        api: httpx.AsyncClient, store: Store) -> None:
    await _register(store, "n-7f3a", "gpu-a")
    await api.post("/models", json=SIM)
    resp = await api.post("/deployments", json={"model_id": "sim-a", "node_ids": ["node2"]})
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert (error["loc"], error["input"]) == (["body", "node_ids"], "node2")
    assert "'node2' is neither the id nor the name" in error["msg"]
    assert "gpu-a (n-7f3a)" in error["msg"]
    assert (await api.get("/deployments")).json() == []  # nothing was started
    explained = await api.get("/placement/explain",
                              params={"model_id": "sim-a", "node_ids": ["node2"]})
    assert explained.status_code == 422
    assert explained.json()["detail"][0]["loc"] == ["query", "node_ids"]


async def test_a_name_two_nodes_share_is_refused_naming_both(
        api: httpx.AsyncClient, store: Store, database_url: str) -> None:
    await _register(store, "n-1", "box")
    # Registration refuses a taken name now (issue 19); rows from before that rule may
    # still share one, written here directly.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("INSERT INTO nodes (node_id, name) VALUES ('n-2', 'box')")
    finally:
        await conn.close()
    await api.post("/models", json=SIM)
    resp = await api.post("/deployments", json={"model_id": "sim-a", "node_ids": ["box"]})
    assert resp.status_code == 422, resp.text
    message = resp.json()["detail"][0]["msg"]
    assert "n-1" in message and "n-2" in message and "id" in message


@pytest.mark.parametrize("name", ["bad\x07name", "two words", "-flag", "x" * 65, "tab\there",
                                  "line\n"])
async def test_registration_refuses_a_name_outside_the_pattern(
        api: httpx.AsyncClient, name: str) -> None:
    resp = await api.post("/nodes/register", json={"node_id": "n-1", "name": name,
                                                   "inventory": {}})
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    # The field, the value and the pattern it must match.
    assert (error["loc"], error["input"]) == (["body", "name"], name)
    assert NODE_NAME_PATTERN in error["msg"]


async def test_model_max_tokens_are_kept_and_must_be_consistent(
        api: httpx.AsyncClient) -> None:
    created = await api.post("/models", json={**SIM, "default_max_tokens": 256,
                                              "max_tokens_limit": 1024})
    assert created.status_code == 201, created.text
    got = (await api.get("/models/sim-a")).json()
    assert (got["default_max_tokens"], got["max_tokens_limit"]) == (256, 1024)
    unset = await api.post("/models", json={**SIM, "model_id": "sim-b"})
    assert (unset.json()["default_max_tokens"], unset.json()["max_tokens_limit"]) == (
        None, None)
    for body, words in [({"default_max_tokens": 2048, "max_tokens_limit": 1024},
                         "default_max_tokens = 2048 is above max_tokens_limit = 1024"),
                        ({"max_tokens_limit": 0}, "greater than or equal to 1"),
                        ({"default_max_tokens": 1 << 21}, "less than or equal to")]:
        resp = await api.post("/models", json={**SIM, "model_id": "sim-c", **body})
        assert resp.status_code == 422, resp.text
        assert words in str(resp.json()["detail"])
