"""Quotas through the API against real PostgreSQL and Temporal (no worker: a workflow
starts and never places, so what a deployment holds is written here as placement writes
it, claims on replicas):

* a deployment, a scale-up or a new owner that would pass a scope's limit is refused
  before it starts, 409, with the scope, the part and the numbers; within the limit it
  is created;
* GET /quotas shows what each scope and those beneath it hold, what is borrowed, and the
  parts at the limit; the metrics say the same;
* a token bound to a scope changes only the deployments owned there: 403 naming the
  scope otherwise, and a deployment it makes without an owner is its scope's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from workflows.deployment import DeploymentWorkflow

pytestmark = pytest.mark.timeout(90)

GIB = 1 << 30


def _model(model_id: str, gib: int = 8) -> dict[str, Any]:
    return {"model_id": model_id, "engine": "sim", "source": "sim",
            "memory_bytes": gib * GIB}



async def _placed(store: Store, db: asyncpg.Connection, deployment_id: str, count: int,
                  gib: int = 8) -> None:
    """``count`` replicas of ``deployment_id`` holding ``gib`` GiB each, as placement
    records them."""
    if await store.nodes.get_node(NodeId("n1")) is None:
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId("n1"), name="n1",
            inventory=Inventory(memory_total_bytes=256 * GIB,
                                memory_available_bytes=256 * GIB, cpu_count=64)))
    for i in range(count):
        replica_id = f"{deployment_id}-r{i}"
        await db.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                         "VALUES ($1, $2, 'ready')", replica_id, deployment_id)
        await db.execute("INSERT INTO allocations (replica_id, node_id, rank, memory_bytes) "
                         "VALUES ($1, 'n1', 0, $2)", replica_id, gib * GIB)


async def _deploy(api: httpx.AsyncClient, model_id: str, *, replicas: int = 1,
                  owner: str | None = None, headers: dict[str, str] | None = None,
                  ) -> httpx.Response:
    body: dict[str, Any] = {"model_id": model_id, "replicas": replicas}
    if owner is not None:
        body["owner"] = owner
    return await api.post("/deployments", json=body, headers=headers)


async def test_a_limit_refuses_a_deploy_a_scale_up_and_a_move_with_the_numbers(
        api: httpx.AsyncClient, store: Store, db: asyncpg.Connection) -> None:
    put = await api.put("/quotas/acme/a", json={
        "guarantee": {"memory_bytes": 16 * GIB},
        "limit": {"memory_bytes": 24 * GIB}})
    assert put.status_code == 200, put.text
    for model in ("m1", "m2", "m3"):
        assert (await api.post("/models", json=_model(model))).status_code == 201

    # Within the limit: 2 x 8 GiB of 24 GiB.
    first = await _deploy(api, "m1", replicas=2, owner="acme/a")
    assert first.status_code == 201, first.text
    first_id = first.json()["deployment_id"]
    await _placed(store, db, first_id, 2)

    # A project beneath the team counts against the team's limit: 16 + 16 > 24 GiB.
    over = await _deploy(api, "m2", replicas=2, owner="acme/a/p")
    assert over.status_code == 409, over.text
    body = over.json()
    assert '"held":17179869184,' in over.text  # bytes as a JSON integer
    assert body["quota"] == {"scope": "acme/a", "part": "memory", "held": 16 * GIB,
                             "asked": 16 * GIB, "limit": 24 * GIB}
    assert body["detail"] == ("scope 'acme/a' would pass its memory limit: it holds "
                              "16.0 GiB, this asks 16.0 GiB more, and its limit is 24.0 GiB")
    # Refused before it started: no row, nothing to clean up.
    assert [d["model_id"] for d in (await api.get("/deployments")).json()] == ["m1"]
    # One replica fits (16 + 8 = 24), as does a deployment nobody owns.
    second = await _deploy(api, "m2", owner="acme/a/p")
    assert second.status_code == 201, second.text
    await _placed(store, db, second.json()["deployment_id"], 1)
    assert (await _deploy(api, "m3", replicas=9)).status_code == 201

    # A scale-up counts the deployment's new total against what the others hold (8 GiB).
    scale = await api.patch(f"/deployments/{first_id}", json={"replicas": 3})
    assert scale.status_code == 409, scale.text
    assert scale.json()["quota"] == {"scope": "acme/a", "part": "memory", "held": 8 * GIB,
                                     "asked": 24 * GIB, "limit": 24 * GIB}
    policy = await api.patch(f"/deployments/{first_id}", json={"scaling": {
        "min_replicas": 1, "max_replicas": 3}})
    assert policy.status_code == 409, policy.text
    assert policy.json()["quota"]["part"] == "memory"

    # A move into the team is judged as a deployment of its most replicas.
    m3 = next(d for d in (await api.get("/deployments")).json() if d["model_id"] == "m3")
    move = await api.patch(f"/deployments/{m3['deployment_id']}", json={"owner": "acme/a"})
    assert move.status_code == 409, move.text
    assert move.json()["quota"]["asked"] == 72 * GIB
    kinds = [e["kind"] for e in (await api.get("/events")).json()]
    assert "quota.set" in kinds and "deployment.tenancy_set" not in kinds


@pytest.mark.slow  # the worker starts and the update waits for a workflow task
async def test_a_move_reaches_the_workflow_the_row_and_the_audit_log(
        worked: tuple[FastAPI, httpx.AsyncClient]) -> None:
    """PATCH owner and class: the running workflow's spec (what its placements and
    preemptions ask as from now on), the row and the audit log."""
    app, api = worked
    assert (await api.post("/models", json=_model("m1"))).status_code == 201
    made = (await _deploy(api, "m1", owner="acme/a")).json()
    moved = await api.patch(f"/deployments/{made['deployment_id']}",
                            json={"owner": "acme/b", "capacity_class": "opportunistic"})
    assert moved.status_code == 200, moved.text
    assert (moved.json()["owner"], moved.json()["capacity_class"],
            moved.json()["runs_as"]) == ("acme/b", "opportunistic", "opportunistic")
    client: Client = app.state.temporal
    view = await client.get_workflow_handle_for(
        DeploymentWorkflow.run, made["workflow_id"]).query(DeploymentWorkflow.status)
    assert (view.keeper.spec.owner, view.keeper.spec.capacity_class) == (
        "acme/b", CapacityClass.OPPORTUNISTIC)
    kinds = [e["kind"] for e in (await api.get("/events")).json()]
    assert "deployment.tenancy_set" in kinds


async def test_quotas_show_held_borrowed_and_at_limit(
        api: httpx.AsyncClient, store: Store, db: asyncpg.Connection) -> None:
    assert (await api.put("/quotas/acme/a", json={
        "guarantee": {"memory_bytes": 16 * GIB}, "limit": {"memory_bytes": 16 * GIB}})
            ).status_code == 200
    assert (await api.put("/quotas/acme/b", json={
        "guarantee": {"memory_bytes": 4 * GIB}})).status_code == 200
    assert (await api.put("/quotas/acme", json={"limit": {"gpus": 4}})).status_code == 200
    for model in ("m1", "m2"):
        assert (await api.post("/models", json=_model(model))).status_code == 201
    a = (await _deploy(api, "m1", replicas=2, owner="acme/a")).json()["deployment_id"]
    b = (await _deploy(api, "m2", replicas=1, owner="acme/b/x")).json()["deployment_id"]
    await _placed(store, db, a, 2)
    await _placed(store, db, b, 1)

    views = {v["scope"]: v for v in (await api.get("/quotas")).json()}
    assert list(views) == ["acme", "acme/a", "acme/b"]
    assert views["acme/a"]["held"]["memory_bytes"] == 16 * GIB
    assert views["acme/a"]["borrowed"]["memory_bytes"] == 0
    assert views["acme/a"]["at_limit"] == ["memory"]
    # B holds 8 GiB on a 4 GiB guarantee: 4 GiB borrowed, which may be taken back.
    assert views["acme/b"]["held"]["memory_bytes"] == 8 * GIB
    assert views["acme/b"]["borrowed"]["memory_bytes"] == 4 * GIB
    assert views["acme/b"]["at_limit"] == []
    assert views["acme"]["held"]["memory_bytes"] == 24 * GIB
    assert views["acme"]["limit"] == {"memory_bytes": None, "gpus": 4, "cpu_cores": None}
    one = await api.get("/quotas/acme/b")
    assert one.status_code == 200 and one.json() == views["acme/b"]

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families((await api.get("/metrics")).text)
               for s in family.samples if s.name.startswith("modelkeeper_quota_")}
    assert samples[("modelkeeper_quota_held", (("resource", "memory_bytes"),
                                               ("scope", "acme/a")))] == 16 * GIB
    assert samples[("modelkeeper_quota_borrowed", (("resource", "memory_bytes"),
                                                   ("scope", "acme/b")))] == 4 * GIB
    assert samples[("modelkeeper_quota_at_limit", (("scope", "acme/a"),))] == 1
    assert samples[("modelkeeper_quota_at_limit", (("scope", "acme/b"),))] == 0
    assert samples[("modelkeeper_quota_limit", (("resource", "gpus"), ("scope", "acme")))] == 4
    # An unset limit is unlimited, not 0: no series.
    assert ("modelkeeper_quota_limit", (("resource", "gpus"), ("scope", "acme/a"))) \
        not in samples

    assert (await api.get("/quotas/acme/c")).status_code == 404
    assert (await api.delete("/quotas/acme/b")).status_code == 204
    assert (await api.delete("/quotas/acme/b")).status_code == 404
    # A misspelt part or a scope no owner could be is a 422 naming it.
    typo = await api.put("/quotas/acme", json={"limit": {"memory": 1}})
    assert typo.status_code == 422 and "memory" in typo.text
    for bad in ({"guarantee": {"gpus": True}}, {"guarantee": {"cpu_cores": False}},
                {"limit": {"memory_bytes": (1 << 52) + 1}}, {"limit": {"gpus": "2"}}):
        refused = await api.put("/quotas/acme", json=bad)
        assert refused.status_code == 422, (bad, refused.text)
    assert (await api.put("/quotas/Acme", json={})).status_code == 422
    assert (await api.put("/quotas/a/b/c/d", json={})).status_code == 422


@pytest.fixture
async def secured(local_temporal_env: WorkflowEnvironment,
                  database_url: str) -> AsyncIterator[FastAPI]:
    client = local_temporal_env.client
    app = create_app(Settings(database_url=database_url,
                              temporal_address=client.service_client.config.target_host,
                              temporal_namespace=client.namespace))
    async with app.router.lifespan_context(app):
        yield app


async def test_a_scoped_token_changes_only_its_scopes_deployments(secured: FastAPI) -> None:
    store: Store = secured.state.store
    _, root = await store.tokens.create_token("root", OperatorRole.ADMIN)
    _, team = await store.tokens.create_token("team-a", OperatorRole.ADMIN, scope="acme/a")
    as_root = {"Authorization": f"Bearer {root}"}
    as_team = {"Authorization": f"Bearer {team}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=secured),
                                 base_url="http://localhost") as api:
        for model in ("m1", "m2", "m3"):
            assert (await api.post("/models", json=_model(model),
                                   headers=as_root)).status_code == 201
        # Without an owner, its deployment is the token's scope's; beneath it is allowed.
        mine = await _deploy(api, "m1", headers=as_team)
        assert mine.status_code == 201, mine.text
        assert mine.json()["owner"] == "acme/a"
        assert (await _deploy(api, "m2", owner="acme/a/p", headers=as_team)
                ).status_code == 201
        # Another scope's, or nobody's: 403 naming the scope.
        theirs = await _deploy(api, "m3", owner="acme/b", headers=as_team)
        assert theirs.status_code == 403, theirs.text
        assert "bound to scope 'acme/a'" in theirs.json()["detail"]
        other = (await _deploy(api, "m3", owner="acme/b", headers=as_root)).json()
        for method, path, body in (
                ("DELETE", f"/deployments/{other['deployment_id']}", None),
                ("PATCH", f"/deployments/{other['deployment_id']}", {"replicas": 2}),
                ("POST", f"/deployments/{other['deployment_id']}/restart", None),
                ("PATCH", f"/deployments/{mine.json()['deployment_id']}",
                 {"owner": "acme/b"}),
                ("PUT", "/quotas/acme/a", {"limit": {"gpus": 100}}),
                ("POST", "/models", _model("m4"))):
            refused = await api.request(method, path, json=body, headers=as_team)
            assert refused.status_code == 403, (method, path, refused.text)
            assert "acme/a" in refused.json()["detail"], refused.text
        # It reads as an admin does, and deletes its own.
        assert (await api.get("/quotas", headers=as_team)).status_code == 200
        gone = await api.delete(f"/deployments/{mine.json()['deployment_id']}",
                                headers=as_team)
        assert gone.status_code == 202, gone.text
        still = await api.get(f"/deployments/{other['deployment_id']}", headers=as_root)
        assert still.json()["status"] != "deleting"
