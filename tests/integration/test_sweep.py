"""The store sweep (worker/sweep.py): what a terminated deployment leaves is removed.

First its rule, :func:`decide`, with chosen times, one test per rule of its docstring;
then passes against a real Temporal dev server and PostgreSQL: a deployment created
through the API, given a claim, and terminated is swept (row, replicas, claims, and one
``deployment.swept`` event, however many workers sweep at once), while a running
deployment and a fresh row whose workflow has not started yet are kept.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from modelkeeper.domain.catalog import DeploymentRequest, DeploymentView
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.placement import PlacementRequest
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from worker import sweep
from worker.main import run_worker
from worker.sweep import SWEEP_GRACE_S, Keep, NotFound, Sweep, decide, sweep_once

pytestmark = pytest.mark.timeout(90)

GIB = 1024**3
NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
OLD = NOW - timedelta(seconds=SWEEP_GRACE_S + 1)
#: What a row is backdated by to count as past the grace, without waiting for it.
PAST_GRACE = timedelta(seconds=SWEEP_GRACE_S * 2)


def _row(created_at: datetime) -> DeploymentView:
    return DeploymentView(
        deployment_id=DeploymentId("d-1"), model_id=ModelId("m"),
        status=DeploymentStatus.SERVING, placement_error=None, desired_replicas=1,
        ready_replicas=1, consecutive_failures=0, last_failure=None, min_nodes=1,
        node_ids=None, labels={}, replicas=[], workflow_id="deployment/d-1",
        created_at=created_at, updated_at=created_at)


# -- the rule, with chosen times ------------------------------------------------------------

@pytest.mark.parametrize("workflow", [NotFound.NOT_FOUND, WorkflowExecutionStatus.TERMINATED])
def test_rule_1_a_row_within_the_grace_is_kept_whatever_its_workflow(
        workflow: sweep.WorkflowSeen) -> None:
    verdict = decide(_row(NOW - timedelta(seconds=SWEEP_GRACE_S - 1)), workflow, NOW)
    assert isinstance(verdict, Keep)
    assert "grace" in verdict.reason
    # A row stamped by a database clock ahead of ours is young too.
    assert isinstance(decide(_row(NOW + timedelta(seconds=5)), workflow, NOW), Keep)


@pytest.mark.parametrize("status", sorted(sweep.CLOSED))
def test_rule_2_a_row_past_the_grace_whose_workflow_closed_is_swept(
        status: WorkflowExecutionStatus) -> None:
    verdict = decide(_row(OLD), status, NOW)
    assert isinstance(verdict, Sweep)
    assert verdict.workflow == status.name.lower().replace("_", " ")
    assert "deployment/d-1" in verdict.reason and verdict.workflow in verdict.reason


def test_rule_3_a_row_past_the_grace_without_a_workflow_is_swept() -> None:
    assert decide(_row(NOW - timedelta(seconds=SWEEP_GRACE_S)), NotFound.NOT_FOUND, NOW) \
        == Sweep("not found", "no workflow 'deployment/d-1' exists 60s after the row was "
                 "written")


@pytest.mark.parametrize("workflow", [WorkflowExecutionStatus.RUNNING,
                                      WorkflowExecutionStatus.CONTINUED_AS_NEW, None])
def test_rule_4_a_row_whose_workflow_runs_is_kept(workflow: sweep.WorkflowSeen) -> None:
    assert isinstance(decide(_row(NOW - timedelta(days=30)), workflow, NOW), Keep)


# -- passes against Temporal and PostgreSQL -------------------------------------------------

# The API fixtures `app` and `api` are in tests/conftest.py.


async def _deploy_with_a_claim(api: httpx.AsyncClient, store: Store, model_id: str,
                               ) -> DeploymentId:
    """A deployment created through the API, with one replica claiming memory on n1 (as
    its workflow's placement would have claimed it)."""
    model = {"model_id": model_id, "engine": "sim", "source": "sim", "memory_bytes": GIB}
    assert (await api.post("/models", json=model)).status_code == 201
    created = await api.post("/deployments", json={"model_id": model_id})
    assert created.status_code == 201, created.text
    deployment_id = DeploymentId(created.json()["deployment_id"])
    catalog = await store.catalog.get_model(model_id)
    assert catalog is not None
    shards = await store.placement.place_replica(
        deployment_id=deployment_id, replica_id=ReplicaId(f"r-{model_id}"),
        request=PlacementRequest(model_id=catalog.model_id, memory_bytes=GIB),
        model=catalog, now=datetime.now(UTC), unreachable_after_s=600.0,
        lost_after_s=1200.0, start_timeout_s=300.0)
    assert isinstance(shards, list)
    return deployment_id


async def _backdate(database_url: str, *deployment_ids: str) -> None:
    """Make rows look written ``PAST_GRACE`` ago."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE deployments SET created_at = created_at - $2::interval "
            "WHERE deployment_id = ANY($1::text[])", list(deployment_ids), PAST_GRACE)
    finally:
        await conn.close()


async def _claims(store: Store, deployment_id: str) -> list[str]:
    return [str(r["replica_id"]) for r in await store._pool.fetch(
        "SELECT a.replica_id FROM allocations a JOIN replicas r USING (replica_id) "
        "WHERE r.deployment_id = $1", deployment_id)]


async def _terminate(client: Client, deployment_id: DeploymentId) -> None:
    await client.get_workflow_handle(deployment_workflow_id(deployment_id)).terminate(
        "by hand")


async def test_a_terminated_deployment_is_swept_and_others_are_kept(
        app: FastAPI, api: httpx.AsyncClient, database_url: str) -> None:
    store: Store = app.state.store
    client: Client = app.state.temporal
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                            cpu_count=8)))
    terminated = await _deploy_with_a_claim(api, store, "sim-terminated")
    running = await _deploy_with_a_claim(api, store, "sim-running")
    # A row the API just wrote, its workflow not started yet.
    assert (await api.post("/models", json={"model_id": "sim-fresh", "engine": "sim",
                                            "source": "sim", "memory_bytes": GIB})
            ).status_code == 201
    fresh = DeploymentId("d-fresh")
    await store.deployments.create_deployment(
        fresh, DeploymentRequest(model_id=ModelId("sim-fresh")), deployment_workflow_id(fresh))
    await _terminate(client, terminated)
    await _backdate(database_url, terminated, running)
    before = (await api.get("/nodes/n1")).json()["memory_claimed_bytes"]
    assert before == 2 * GIB

    # Two workers sweeping at once: one removes the rows and records the event.
    other = await Store.connect(database_url, migrate=False)
    try:
        passes = await asyncio.gather(sweep_once(store, client), sweep_once(other, client))
    finally:
        await other.close()
    [event] = [e for events in passes for e in events]

    assert (event.kind, event.deployment_id) == ("deployment.swept", terminated)
    assert event.data == {"workflow_id": deployment_workflow_id(terminated),
                          "workflow": "terminated", "status": "placing",
                          "replicas": ["r-sim-terminated"], "nodes": ["n1"]}
    assert "is closed: terminated" in event.message and "claims on n1" in event.message
    assert (await api.get(f"/deployments/{terminated}")).status_code == 404
    assert await _claims(store, terminated) == []
    assert [r.replica_id for r in await store.deployments.list_replicas()] == ["r-sim-running"]
    assert (await api.get("/nodes/n1")).json()["memory_claimed_bytes"] == GIB
    events = (await api.get("/events", params={"deployment_id": terminated})).json()
    # The system's entries: the operator's deploy is recorded too, with its actor.
    assert [(e["event_id"], e["kind"]) for e in events if e["actor"] is None] == [
        (event.event_id, "deployment.swept")]

    # Kept: the running deployment with its claim, and the fresh row within the grace.
    assert (await api.get(f"/deployments/{running}")).status_code == 200
    assert await _claims(store, running) == ["r-sim-running"]
    assert (await api.get(f"/deployments/{fresh}")).status_code == 200

    # Nothing more to do: a second pass records nothing.
    assert await sweep_once(store, client) == []

    # Past the grace with still no workflow, the fresh row goes too.
    await _backdate(database_url, fresh)
    [gone] = await sweep_once(store, client)
    assert (gone.deployment_id, gone.data["workflow"]) == (fresh, "not found")
    assert "no workflow" in gone.message and "holding no claims" in gone.message
    assert [d.deployment_id for d in await store.deployments.list_deployments()] == [running]


async def test_the_control_worker_sweeps_in_the_background(
        app: FastAPI, api: httpx.AsyncClient, database_url: str) -> None:
    """The wiring: the worker sweeps as it starts, not only after its first interval."""
    store: Store = app.state.store
    client: Client = app.state.temporal
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n1"), name="n1",
        inventory=Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                            cpu_count=8)))
    terminated = await _deploy_with_a_claim(api, store, "sim-terminated")
    await _terminate(client, terminated)
    await _backdate(database_url, terminated)

    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(
        Settings(database_url=database_url,
                 temporal_address=client.service_client.config.target_host,
                 temporal_namespace=client.namespace, sweep_interval_s=3600), stop))
    try:
        for _ in range(200):
            if await store.deployments.get_deployment(terminated) is None:
                break
            await asyncio.sleep(0.1)
        assert await store.deployments.get_deployment(terminated) is None
        assert await _claims(store, terminated) == []
        assert [e.kind for e in await store.events.list_events(deployment_id=terminated)
                if e.actor is None] == ["deployment.swept"]
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)


async def test_a_missing_namespace_is_not_a_missing_workflow(
        local_temporal_env: WorkflowEnvironment) -> None:
    """A client pointed at a namespace that does not exist must not read every workflow
    as gone: the pass fails instead, and sweeps nothing."""
    wrong = await Client.connect(local_temporal_env.client.service_client.config.target_host,
                                 namespace="no-such-namespace")
    with pytest.raises(RPCError, match=r"(?i)namespace"):
        await sweep.describe(wrong, "deployment/d-1")
    assert await sweep.describe(local_temporal_env.client, "deployment/d-none") \
        is NotFound.NOT_FOUND
