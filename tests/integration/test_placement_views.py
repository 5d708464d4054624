"""The nodes as placement reads them, on a real PostgreSQL.

Placement builds each :class:`NodeView` straight from its own row (``_placement_view``
over ``_PLACEMENT_NODE_SELECT``, or ``_PLACEMENT_NODES_BY_ID`` for its locked re-read), not
through a :class:`NodeRecord` first. What must hold:

* the view is the one built through the record (the store's ``NodeRecord`` read, then the
  conversion placement used before), for every node shape a fleet has: GPU nodes (one GPU
  unhealthy, indices reported out of order), nodes without memory figures, operator labels
  over the agent's, silent nodes, cordoned (draining) nodes, claims of several GPUs and of
  fractional cores, a replica draining; at every state a node can be in;
* the jsonb decoder gives the values ``json.loads`` gives, for whatever a jsonb column may
  hold (every Store query that reads one goes through it).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import (
    AgentRegistration,
    GpuInfo,
    Inventory,
    NodeRecord,
    NodeUpdate,
    node_state,
)
from modelkeeper.domain.placement import CantPlace, GpuView, NodeView, PlacementRequest
from modelkeeper.domain.shards import EngineKind
from modelkeeper.store import Store, placement

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
UNREACHABLE_AFTER_S = 6.0
LOST_AFTER_S = 60.0


def _through_record(record: NodeRecord, now: datetime) -> NodeView:
    """The view as placement built it before: from the validated record."""
    return NodeView(
        node_id=record.node_id, name=record.name,
        state=node_state(record, now, unreachable_after_s=UNREACHABLE_AFTER_S,
                         lost_after_s=LOST_AFTER_S),
        labels=record.labels, memory_total_bytes=record.memory_total_bytes,
        memory_claimed_bytes=record.memory_claimed_bytes, cpu_count=record.cpu_count,
        cpu_claimed=record.cpu_claimed,
        gpus=[GpuView(index=g.index, memory_bytes=g.memory_bytes, healthy=g.healthy)
              for g in record.gpus],
        gpu_claimed=record.gpus_claimed)


def _gpus(indices: list[int], *, unhealthy: int | None = None) -> list[GpuInfo]:
    return [GpuInfo(index=i, name="H100", memory_bytes=80 * GIB, healthy=i != unhealthy)
            for i in indices]


async def _register(store: Store, node_id: str, inv: Inventory,
                    labels: dict[str, str] | None = None) -> None:
    await store.nodes.register_node(AgentRegistration(node_id=NodeId(node_id), name=node_id,
                                                       labels=labels or {}, inventory=inv))


async def _place(store: Store, n: int, *, node: str, memory_gib: int, gpus: int | None = None,
                 cpu_cores: float | None = None) -> None:
    model = CatalogModel(model_id=ModelId(f"m{n}"), engine=EngineKind.SIM, source="org/m",
                         memory_bytes=memory_gib * GIB, gpus=gpus, cpu_cores=cpu_cores)
    await store.catalog.create_model(model)
    deployment = DeploymentId(f"d{n}")
    await store.deployments.create_deployment(
        deployment, DeploymentRequest(model_id=model.model_id), f"wf-d{n}")
    result = await store.placement.place_replica(
        deployment_id=deployment, replica_id=ReplicaId(f"r{n}"),
        request=PlacementRequest(model_id=model.model_id, memory_bytes=model.memory_bytes,
                                 gpus=gpus, cpu_cores=cpu_cores, node_ids=[NodeId(node)]),
        model=model, now=datetime.now(UTC), unreachable_after_s=UNREACHABLE_AFTER_S,
        lost_after_s=LOST_AFTER_S, start_timeout_s=60.0)
    assert not isinstance(result, CantPlace), result.summary


async def _fleet(store: Store) -> None:
    await _register(store, "gpu-a", Inventory(
        memory_total_bytes=1024 * GIB, memory_available_bytes=900 * GIB, cpu_count=96,
        gpus=_gpus([3, 1, 0, 2, 7, 6, 5, 4], unhealthy=5)),
        labels={"gpu": "h100", "zone": "a"})
    await _register(store, "gpu-b", Inventory(
        memory_total_bytes=512 * GIB, memory_available_bytes=512 * GIB, cpu_count=64,
        gpus=_gpus([0, 1, 2, 3])), labels={"gpu": "h100"})
    await _register(store, "cpu-a", Inventory(
        memory_total_bytes=64 * GIB, memory_available_bytes=60 * GIB, cpu_count=16))
    await _register(store, "old-agent", Inventory())
    await _register(store, "silent", Inventory(
        memory_total_bytes=128 * GIB, memory_available_bytes=128 * GIB, cpu_count=32))
    await _register(store, "draining", Inventory(
        memory_total_bytes=256 * GIB, memory_available_bytes=256 * GIB, cpu_count=32,
        gpus=_gpus([0, 1])), labels={"zone": "b"})
    # Claims: several GPUs in one claim (its memory must count once, not once per GPU),
    # two claims on one node, fractional cores, and a replica draining on a cordoned node.
    await _place(store, 1, node="gpu-a", memory_gib=100, gpus=3, cpu_cores=4.5)
    await _place(store, 2, node="gpu-a", memory_gib=30, gpus=1, cpu_cores=0.25)
    await _place(store, 3, node="cpu-a", memory_gib=8, cpu_cores=0.5)
    await _place(store, 4, node="old-agent", memory_gib=4)
    await _place(store, 5, node="draining", memory_gib=16, gpus=2)
    await store.deployments.mark_replica_draining("r5")
    await store.nodes.update_node("draining", NodeUpdate(cordoned=True, cordon_reason="drain"))
    await store.nodes.update_node("gpu-a", NodeUpdate(labels={"zone": "c", "rack": "7"}))
    await store.nodes.mark_node_silent("silent", since=datetime.now(UTC))


@pytest.mark.parametrize("later_s", [0.0, UNREACHABLE_AFTER_S + 1, LOST_AFTER_S + 1],
                         ids=["ready", "unreachable", "lost"])
async def test_view_from_the_row_is_the_view_through_the_record(store: Store,
                                                                later_s: float) -> None:
    await _fleet(store)
    now = datetime.now(UTC) + timedelta(seconds=later_s)
    expected = [_through_record(r, now) for r in await store.nodes.list_nodes()]

    def from_rows(rows: list[Any]) -> list[NodeView]:
        # A fresh cache: every view is built from its row here.
        return placement._NodeViews().of(rows, now, unreachable_after_s=UNREACHABLE_AFTER_S,
                                       lost_after_s=LOST_AFTER_S, every_node=True)

    # Through the store's own method (by name), and placement's two reads.
    assert await store.placement.list_node_views(now, unreachable_after_s=UNREACHABLE_AFTER_S,
                                                 lost_after_s=LOST_AFTER_S) == expected
    by_id = sorted(expected, key=lambda v: v.node_id)
    assert from_rows(await store._pool.fetch(
        placement._PLACEMENT_NODE_SELECT + " ORDER BY n.node_id")) == by_id
    rows = await store._pool.fetch(placement._PLACEMENT_NODES_BY_ID + " ORDER BY n.node_id",
                                   ["gpu-a", "draining", "cpu-a", "gone"])
    assert from_rows(rows) == [v for v in by_id if v.node_id in {"gpu-a", "draining", "cpu-a"}]
    # The fleet has the shapes the docstring names, so the comparison above covers them.
    views = {v.node_id: v for v in expected}
    assert views["gpu-a"].gpu_claimed == [0, 1, 2, 3]
    assert views["gpu-a"].memory_claimed_bytes == 130 * GIB
    assert views["gpu-a"].cpu_claimed == 4.75
    assert views["gpu-a"].labels == {"gpu": "h100", "zone": "c", "rack": "7"}
    assert [g.index for g in views["gpu-a"].gpus] == list(range(8))
    assert views["old-agent"].memory_total_bytes is None
    if later_s == 0.0:
        assert {v.node_id: v.state.value for v in expected} == {
            "cpu-a": "ready", "draining": "cordoned", "gpu-a": "ready", "gpu-b": "ready",
            "old-agent": "ready", "silent": "unreachable"}


async def test_a_view_is_reused_only_while_its_node_is_unchanged(store: Store) -> None:
    """The store keeps each node's view between placements' reads (``_NodeViews``): the
    same object while nothing it is built from changed, a new one, equal to a view built
    from scratch, after a heartbeat that moves only what placement does not read; and a
    new one after each change it does read: a claim, labels, a state, a removal."""
    await _fleet(store)
    views = placement._NodeViews()

    async def read(at: datetime) -> dict[str, NodeView]:
        rows = await store._pool.fetch(placement._PLACEMENT_NODE_SELECT + " ORDER BY n.node_id")
        fresh = placement._NodeViews().of(rows, at, unreachable_after_s=UNREACHABLE_AFTER_S,
                                        lost_after_s=LOST_AFTER_S, every_node=True)
        kept = views.of(rows, at, unreachable_after_s=UNREACHABLE_AFTER_S,
                        lost_after_s=LOST_AFTER_S, every_node=True)
        assert kept == fresh  # reused or not, always the view its row gives
        return {v.node_id: v for v in kept}

    now = datetime.now(UTC)
    first = await read(now)
    # A heartbeat: last_seen and the memory available move, nothing placement reads.
    await store.nodes.heartbeat_node("cpu-a", Inventory(
        memory_total_bytes=64 * GIB, memory_available_bytes=59 * GIB, cpu_count=16),
        UNREACHABLE_AFTER_S)
    second = await read(now)
    assert all(second[n] is first[n] for n in first)
    # A claim, labels, a state: each node that changed gets a new view, the others not.
    await _place(store, 6, node="cpu-a", memory_gib=1)
    await store.nodes.update_node("gpu-b", NodeUpdate(labels={"zone": "d"}))
    await store.nodes.update_node("silent", NodeUpdate(cordoned=True))
    third = await read(now)
    changed = {n for n in first if third[n] is not second[n]}
    assert changed == {"cpu-a", "gpu-b", "silent"}
    assert third["cpu-a"].memory_claimed_bytes == 9 * GIB
    # Time alone changes states: past the unreachable deadline every view is new.
    later = await read(now + timedelta(seconds=UNREACHABLE_AFTER_S + 1))
    assert {n for n in first if later[n] is third[n]} == {"draining", "silent"}  # cordoned
    # A removed node is not kept.
    await store._pool.execute("DELETE FROM allocations WHERE node_id = 'gpu-b'")
    await store._pool.execute("DELETE FROM nodes WHERE node_id = 'gpu-b'")
    await read(now)
    assert "gpu-b" not in views._by_node


#: Values a jsonb column may hold, as JSON text: what the decoder must read as json.loads
#: does (numbers past 64 bits, floats that need every digit, escapes, nesting past
#: pydantic_core's limit of 200, which only a model's free-form engine_args could reach).
JSONB_TEXTS = [
    "{}", "[]", "null", "true", '""',
    '{"gpu": "h100", "zone": "a"}',
    '[{"index": 0, "name": "H100", "healthy": true, "memory_bytes": 85899345920}]',
    "123456789012345678901234567890", "-9223372036854775809", "0", "-0", "-0.0",
    "0.1", "1.0", "4.35", "1e-7", "1.5e300", "2.5e-324", "1.7976931348623157e308",
    "0.1000000000000000055511151231257827", "12345678901234567890.5",
    '"tab\\tnewline\\nquote\\"backslash\\\\ \\u00e9 \\ud83d\\ude00 \\u0001"',
    '{"engine_args": {"nested": ' + "[" * 300 + "1" + "]" * 300 + "}}",
]


async def test_jsonb_decodes_as_json_loads(store: Store) -> None:
    rows = await store._pool.fetch(
        "SELECT t::jsonb AS value, t::jsonb::text AS printed FROM unnest($1::text[]) t",
        JSONB_TEXTS)
    for row in rows:
        # json.dumps tells 1 from 1.0 and keeps every digit of a float: equal dumps, equal
        # values of equal types.
        assert json.dumps(row["value"]) == json.dumps(json.loads(row["printed"]))
