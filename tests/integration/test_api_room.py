"""Seeing the room through the API, on real PostgreSQL and Temporal: GET /fleet, the
headroom of a deployment and of a model not deployed yet, a deploy or a scale-up that
does not fit answered 409 with its plans (and, by default, still accepted to wait), and,
with the control worker answering the updates, a plan applied (its scale-down, then the
deployment) and a plan that no longer fits under the lock undone, each step audited.

Replicas and their claims are written here as placement writes them: no agent runs, so
none would ever become ready."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from modelkeeper.domain.catalog import DeploymentStatusUpdate
from modelkeeper.domain.ids import DeploymentId, NodeId
from modelkeeper.domain.nodes import AgentRegistration, GpuInfo, Inventory
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.locks import FIT_PLAN_LOCK
from worker.main import run_worker

pytestmark = pytest.mark.timeout(120)

GIB = 1 << 30
H100 = "NVIDIA H100 80GB HBM3"
#: Nodes registered once stay ready for the whole test: no agent heartbeats here.
QUIET_NODES = {"node_unreachable_after_s": 3600.0, "node_lost_after_s": 7200.0}
#: How long a test waits for the API to queue behind the plan lock it holds.
LOCK_WAIT_S = 30


def sim(model_id: str, gib: int, **extra: Any) -> dict[str, Any]:
    return {"model_id": model_id, "engine": "sim", "source": "sim",
            "memory_bytes": gib * GIB, **extra}


def settings_for(env: WorkflowEnvironment, database_url: str) -> Settings:
    client = env.client
    return Settings(database_url=database_url,
                    temporal_address=client.service_client.config.target_host,
                    temporal_namespace=client.namespace, api_auth=False, **QUIET_NODES)


@pytest.fixture
async def roomy(local_temporal_env: WorkflowEnvironment,
                database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API with no worker: deployments' workflows start and never place."""
    app = create_app(settings_for(local_temporal_env, database_url))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        yield http


@pytest.fixture
async def worked(local_temporal_env: WorkflowEnvironment,
                 database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API and the control worker: the deployments' workflows answer updates."""
    settings = settings_for(local_temporal_env, database_url)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    app = create_app(settings)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            yield http
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)


async def register(store: Store, node_id: str, *, gib: int = 16,
                   gpus: list[GpuInfo] | None = None) -> None:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId(node_id), name=node_id,
        inventory=Inventory(memory_total_bytes=gib * GIB, memory_available_bytes=gib * GIB,
                            cpu_count=8, gpus=gpus or [])))


async def deploy(api: httpx.AsyncClient, body: dict[str, Any]) -> str:
    created = await api.post("/deployments", json=body)
    assert created.status_code == 201, created.text
    return str(created.json()["deployment_id"])


async def hold(store: Store, deployment_id: str, *, node: str, gib: int,
               idle: timedelta | None = None) -> str:
    """A ready replica of ``deployment_id`` claiming ``gib`` on ``node``, as placement
    writes one; with ``idle``, a gateway's usage row saying it was last asked for then."""
    replica_id = f"{deployment_id}-r1"
    await store._pool.execute(
        "INSERT INTO replicas (replica_id, deployment_id, state, ready_at) "
        "VALUES ($1, $2, 'ready', now() - interval '3 hours')", replica_id, deployment_id)
    await store._pool.execute(
        "INSERT INTO allocations (replica_id, node_id, rank, memory_bytes) "
        "VALUES ($1, $2, 0, $3)", replica_id, node, gib * GIB)
    if idle is not None:
        await store._pool.execute(
            "INSERT INTO replica_usage (gateway_id, replica_id, in_flight, last_used_at, "
            "reporting_since) VALUES ('gw-1', $1, 0, now() - $2::interval, "
            "now() - interval '4 hours')", replica_id, idle)
    return replica_id


async def test_fleet_headroom_and_a_409_with_plans(roomy: httpx.AsyncClient,
                                                   store: Store) -> None:
    api = roomy
    await register(store, "n1", gpus=[GpuInfo(index=0, name=H100, memory_bytes=80 * GIB),
                                       GpuInfo(index=1, name=H100, memory_bytes=80 * GIB,
                                               healthy=False)])
    await register(store, "n2")
    for model in (sim("big", 12, weights_bytes=4 * GIB), sim("od", 8), sim("new", 8),
                  sim("ten", 10), sim("huge", 64)):
        assert (await api.post("/models", json=model)).status_code == 201
    big = await deploy(api, {"model_id": "big"})
    od = await deploy(api, {"model_id": "od", "scaling": {"min_replicas": 0,
                                                          "max_replicas": 1}})
    huge = await deploy(api, {"model_id": "huge"})
    await store.deployments.record_deployment_status(DeploymentStatusUpdate(
        deployment_id=DeploymentId(huge), status=DeploymentStatus.CANT_PLACE,
        placement_error="node n1: 4.0 GiB free, needs 64.0 GiB", consecutive_failures=0,
        last_failure=None, desired_replicas=1))
    big_r1 = await hold(store, big, node="n1", gib=12)  # no usage reported: unknown
    od_r1 = await hold(store, od, node="n2", gib=8, idle=timedelta(hours=2))

    fleet = (await api.get("/fleet")).json()
    assert fleet["nodes"] == {"ready": 2}
    assert fleet["memory"] == {"total_bytes": 32 * GIB, "used_bytes": 20 * GIB,
                               "free_bytes": 12 * GIB}
    assert fleet["gpus"] == [{"gpu_class": H100, "total": 2, "used": 0, "free": 1,
                              "unhealthy": 1}]
    assert fleet["free_whole_nodes"] == []
    assert (fleet["deployments"], fleet["replicas"]) == (3, {"ready": 2})
    assert (fleet["models_in_catalog"], fleet["models_deployed"]) == (5, 3)
    assert [(w["deployment_id"], w["status"], w["reason"]) for w in fleet["cant_place"]] == [
        (huge, "cant_place", "node n1: 4.0 GiB free, needs 64.0 GiB")]
    [unasked] = fleet["unasked"]
    assert (unasked["replica_id"], unasked["memory_bytes"]) == (od_r1, 8 * GIB)
    assert 2 * 3600 - 60 < unasked["idle_s"] < 2 * 3600 + 60
    assert [(u["replica_id"], u["idle_s"]) for u in fleet["usage_unknown"]] == [(big_r1, None)]

    # A model not deployed: 8 GiB fits once (n2), and once more by stopping the idle
    # on-demand replica there; the fixed one is a promise, named as why no more.
    room = (await api.get("/models/new/headroom")).json()
    assert (room["deployment_id"], room["memory_bytes"]) == (None, 8 * GIB)
    assert (room["headroom"]["now"], room["total"]) == (1, 2)
    assert [[v["replica_id"] for v in s["victims"]]
            for s in room["headroom"]["by_stopping"]] == [[od_r1]]
    assert big_r1 in room["headroom"]["reason"]
    # A deployment: its own replica is never its victim.
    room = (await api.get(f"/deployments/{big}/headroom")).json()
    assert room["headroom"]["now"] == 0
    assert [[v["replica_id"] for v in s["victims"]]
            for s in room["headroom"]["by_stopping"]] == [[od_r1]]
    assert (await api.get("/models/missing/headroom")).status_code == 404
    assert (await api.get("/deployments/d-missing/headroom")).status_code == 404

    # 10 GiB fits nowhere: with if_no_room plan, a 409 with the plans, nothing created.
    refused = await api.post("/deployments", json={"model_id": "ten", "if_no_room": "plan"})
    assert refused.status_code == 409, refused.text
    plans = refused.json()["plans"]
    assert [[(a["kind"], a["replica_id"], a["frees_bytes"]) for a in p["actions"]]
            for p in plans] == [[("sleep", big_r1, 8 * GIB)], [("scale_down", big_r1, 12 * GIB)]]
    assert refused.json()["detail"].startswith(
        f"a deployment of ten does not fit on the ready nodes; plan 1: sleep {big}'s replica "
        f"{big_r1} (frees 8.0 GiB on n1); plan 2: scale {big} down from 1 to 0")
    assert len((await api.get("/deployments")).json()) == 3
    # The default queues it, as ever: accepted, it waits for room.
    queued = await api.post("/deployments", json={"model_id": "ten"})
    assert (queued.status_code, queued.json()["status"]) == (201, "placing")

    # A scale-up too; od's replica cannot sleep (its model keeps all it claims) and a
    # policy is not scaled down by hand: no plan, and the 409 says so.
    up = await api.patch(f"/deployments/{big}", json={"replicas": 2, "if_no_room": "plan"})
    assert up.status_code == 409, up.text
    assert up.json()["plans"] == [] and "no plan makes room" in up.json()["detail"]
    bad = await api.patch(f"/deployments/{big}", json={"scaling": {"min_replicas": 0,
                                                                   "max_replicas": 1},
                                                       "plan": 1})
    assert bad.status_code == 422 and "go with replicas" in bad.text


async def _events(api: httpx.AsyncClient, kind: str) -> list[dict[str, Any]]:
    return [e for e in (await api.get("/events")).json() if e["kind"] == kind]


async def _waiting_for_plan_lock(store: Store) -> None:
    """Until another session waits for the plan lock (a request queued behind it)."""
    for _ in range(LOCK_WAIT_S * 20):
        waiting = await store._pool.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND classid::int = $1 AND objid::int = $2", *FIT_PLAN_LOCK)
        if waiting:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no request queued behind the plan lock")


@pytest.mark.slow  # the worker starts, and each action waits for a workflow task
async def test_a_plan_is_undone_when_the_room_is_gone_and_applied_when_it_is_not(
        worked: httpx.AsyncClient, store: Store) -> None:
    api = worked
    await register(store, "n1")
    await register(store, "n2")
    for model in (sim("held-a", 12), sim("held-b", 12), sim("asked", 8)):
        assert (await api.post("/models", json=model)).status_code == 201
    a = await deploy(api, {"model_id": "held-a"})
    b = await deploy(api, {"model_id": "held-b"})
    await hold(store, a, node="n1", gib=12)
    await hold(store, b, node="n2", gib=12)

    refused = await api.post("/deployments", json={"model_id": "asked", "if_no_room": "plan"})
    assert refused.status_code == 409, refused.text
    first = refused.json()["plans"][0]
    [action] = first["actions"]
    assert action["kind"] == "scale_down"
    victim, victim_node = action["deployment_id"], action["node_id"]
    other = b if victim == a else a

    # Plan 1, while something else takes its room: the test holds the plan lock, the
    # request queues behind it, and the victim's node shrinks to 4 GiB meanwhile.
    async with store._pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1, $2)", *FIT_PLAN_LOCK)
        applying = asyncio.create_task(api.post(
            "/deployments", json={"model_id": "asked", "plan": 1}))
        await _waiting_for_plan_lock(store)
        await store.nodes.heartbeat_node(victim_node, Inventory(
            memory_total_bytes=4 * GIB, memory_available_bytes=4 * GIB, cpu_count=8), 3600.0)
    undone = await applying
    assert undone.status_code == 409, undone.text
    body = undone.json()
    assert body["detail"].startswith("plan 1 was undone: the room is not made any more")
    assert [u["deployment_id"] for u in body["undone"]] == [victim]
    assert body["rollback_incomplete"] == []
    view = (await api.get(f"/deployments/{victim}")).json()
    assert view["desired_replicas"] == 1  # scaled down, then back
    scaled = [e["message"] for e in await _events(api, "deployment.scaled")
              if e["deployment_id"] == victim]
    assert scaled == [f"scale {victim} from 1 to 0 replica(s)",
                      f"scale {victim} from 0 to 1 replica(s)"]
    [audit] = await _events(api, "plan.undone")
    assert "the room is not made any more" in audit["message"]
    assert [d["model_id"] for d in (await api.get("/deployments")).json()] == [
        "held-a", "held-b"]

    # The fresh plans name the other deployment now; plan 1 is applied, then the deploy.
    assert [a_["deployment_id"] for p in body["plans"] for a_ in p["actions"]] == [other]
    applied = await api.post("/deployments", json={"model_id": "asked", "plan": 1})
    assert applied.status_code == 201, applied.text
    assert (await api.get(f"/deployments/{other}")).json()["desired_replicas"] == 0
    [audit] = await _events(api, "plan.applied")
    assert audit["message"].startswith(
        f"plan 1 applied to make room for a deployment of asked: scale {other} down from 1 "
        "to 0")
    # In the order they were made: the action, the plan, then the deployment.
    kinds = {"deployment.scaled", "plan.applied", "deployment.created"}
    tail = [(e["kind"], e["deployment_id"]) for e in (await api.get("/events")).json()
            if e["kind"] in kinds][-3:]
    asked = applied.json()["deployment_id"]
    assert tail == [("deployment.scaled", other), ("plan.applied", None),
                    ("deployment.created", asked)]
