"""Migration 0004 on a database that already holds claims: GPU claims made before it get
their GPU memory back, so a retried placement of an old replica still tells vLLM and
SGLang how much GPU memory its shard holds."""

from __future__ import annotations

import pytest

from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.nodes import AgentRegistration, GpuInfo, Inventory
from modelkeeper.domain.shards import EngineKind
from modelkeeper.store import Store, load_migrations

pytestmark = pytest.mark.timeout(60)

GIB = 1024**3


async def test_existing_gpu_claims_get_their_gpu_memory(empty_database_url: str) -> None:
    before = [m for m in load_migrations() if m.version < 4]
    async with await Store.connect(empty_database_url, migrate=False) as store:
        await store.migrate(before)
        await store.register_node(AgentRegistration(
            node_id=NodeId("a"), name="a",
            inventory=Inventory(memory_total_bytes=512 * GIB, gpus=[
                GpuInfo(index=i, name="H100", memory_bytes=(80 + i) * GIB)
                for i in range(4)])))
        await store.create_model(CatalogModel(model_id=ModelId("m"), engine=EngineKind.VLLM,
                                              source="org/m", memory_bytes=GIB, gpus=2))
        await store.create_deployment(DeploymentId("d1"), DeploymentRequest(model_id="m"),
                                      "wf-d1")
        # Claims as the code before 0004 wrote them: no gpu_memory_bytes column yet.
        await store._pool.execute(
            "INSERT INTO replicas (replica_id, deployment_id, state) VALUES "
            "('gpu', 'd1', 'ready'), ('cpu', 'd1', 'ready')")
        await store._pool.execute(
            "INSERT INTO allocations (replica_id, node_id, rank, memory_bytes, gpu_indices) "
            "VALUES ('gpu', 'a', 0, 1, '{1,3}'), ('cpu', 'a', 0, 1, '{}')")

        assert await store.migrate() == [m.version for m in load_migrations()][3:]

        rows = await store._pool.fetch(
            "SELECT replica_id, gpu_memory_bytes FROM allocations ORDER BY replica_id")
    assert {r["replica_id"]: r["gpu_memory_bytes"] for r in rows} == {
        "cpu": None, "gpu": (81 + 83) * GIB}
