"""OOM calibration on a real PostgreSQL: a heartbeat's memory kills raise the model's
calibration (once per kill, however often the heartbeat is sent; the largest peak kept),
placement claims max(catalog, peak x margin), and explain and GET /models/{id} show it."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import httpx
import pytest
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.store import StoreActivities
from api.watchdog import EVENT_OOM_CALIBRATED, watch_memory
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.nodes import AgentHeartbeat, AgentRegistration, Inventory
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.store_activities import PlaceReplicaInput
from modelkeeper.domain.watchdog import OomKill
from modelkeeper.names import deployment_workflow_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20
SETTINGS = Settings(database_url="postgresql://unused", settling_window_s=0)
NODE = NodeId("n-1")


async def _kills(store: Store, env: WorkflowEnvironment, *kills: OomKill) -> None:
    beat = AgentHeartbeat(inventory=Inventory(), oom_kills=list(kills))
    await watch_memory(NODE, beat, store=store, temporal=env.client, settings=SETTINGS,
                       now=datetime.now(UTC))


def _kill(replica: str, peak_mib: int) -> OomKill:
    return OomKill(replica_id=ReplicaId(replica), model_id=ModelId("m"),
                   peak_rss_bytes=peak_mib * MIB, detail="SIGKILL: the kernel's OOM killer")


async def test_a_model_killed_for_memory_is_placed_explained_and_shown_at_its_peak(
    store: Store, api: httpx.AsyncClient, local_temporal_env: WorkflowEnvironment,
) -> None:
    await store.catalog.create_model(CatalogModel(
        model_id=ModelId("m"), engine=EngineKind.SIM, source="sim", memory_bytes=100 * MIB))
    await store.catalog.create_model(CatalogModel(
        model_id=ModelId("other"), engine=EngineKind.SIM, source="sim",
        memory_bytes=100 * MIB))
    await store.nodes.register_node(AgentRegistration(
        node_id=NODE, name="box", inventory=Inventory(
            memory_total_bytes=1024 * MIB, memory_available_bytes=1024 * MIB, cpu_count=2)))
    before = (await api.get("/models/m")).json()
    assert "calibration" not in before

    await _kills(store, local_temporal_env, _kill("r-1", 200))
    await _kills(store, local_temporal_env, _kill("r-1", 200))  # the same kill, sent again
    await _kills(store, local_temporal_env, _kill("r-2", 150))  # a smaller peak
    calibration = await store.watchdog.calibration("m")
    assert calibration is not None
    assert (calibration.peak_rss_bytes, calibration.oom_kills) == (200 * MIB, 2)
    events = await store.events.list_events(limit=100)
    assert sum(e.kind == EVENT_OOM_CALIBRATED for e in events) == 3

    # 200 MiB x 1.2: 240 MiB, above the catalog's 100 MiB.
    shown = (await api.get("/models/m")).json()
    assert shown["memory_bytes"] == 100 * MIB  # the catalog entry itself is unchanged
    assert shown["calibration"]["claimed_bytes"] == 240 * MIB
    assert shown["calibration"]["oom_kills"] == 2
    assert "calibration" not in (await api.get("/models/other")).json()
    explained = (await api.get("/placement/explain", params={"model_id": "m"})).json()
    assert explained["calibration"]["claimed_bytes"] == 240 * MIB
    assert "killed for memory 2 time(s)" in explained["calibration"]["note"]

    # Placement claims the calibrated memory.
    await store.deployments.create_deployment(
        DeploymentId("d-m"), DeploymentRequest(model_id=ModelId("m")),
        deployment_workflow_id(DeploymentId("d-m")))
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="deployment/d-m",
                                   workflow_run_id="run-1", activity_id="place-1")
    spec = DeploymentSpec(deployment_id=DeploymentId("d-m"), model_id=ModelId("m"),
                          replicas=1)
    placed = await env.run(StoreActivities(store, SETTINGS).place_replica, PlaceReplicaInput(
        spec=spec, replica_id=ReplicaId("d-m-r1"), start_timeout_s=60))
    assert [s.memory_bytes for s in placed.shards] == [240 * MIB], placed
