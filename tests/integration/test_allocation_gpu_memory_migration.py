"""Migration 0004 on a database that already holds claims: GPU claims made before it get
their GPU memory back, so a retried placement of an old replica still tells vLLM and
SGLang how much GPU memory its shard holds."""

from __future__ import annotations

import pytest

from modelkeeper.domain.nodes import GpuInfo
from modelkeeper.store import Store, load_migrations

pytestmark = pytest.mark.timeout(60)

GIB = 1024**3


async def test_existing_gpu_claims_get_their_gpu_memory(empty_database_url: str) -> None:
    before = [m for m in load_migrations() if m.version < 4]
    async with await Store.connect(empty_database_url, migrate=False) as store:
        await store.migrate(before)
        # Rows as the schema before 0004 holds them, written in SQL: today's store code
        # writes columns later migrations added.
        gpus = [GpuInfo(index=i, name="H100", memory_bytes=(80 + i) * GIB).model_dump()
                for i in range(4)]
        await store._pool.execute(
            "INSERT INTO nodes (node_id, name, memory_total_bytes, gpus) "
            "VALUES ('a', 'a', $1, $2)", 512 * GIB, gpus)
        await store._pool.execute(
            "INSERT INTO models (model_id, engine, source, memory_bytes, gpus) "
            "VALUES ('m', 'vllm', 'org/m', $1, 2)", GIB)
        await store._pool.execute(
            "INSERT INTO deployments (deployment_id, model_id, replicas, workflow_id) "
            "VALUES ('d1', 'm', 1, 'wf-d1')")
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
