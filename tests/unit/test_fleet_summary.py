"""The fleet summary: one test per rule of modelkeeper.domain.fleet's docstring."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from modelkeeper.domain.catalog import DeploymentView, ReplicaView
from modelkeeper.domain.demand import ReplicaUse
from modelkeeper.domain.eviction import Candidate, VictimClaim
from modelkeeper.domain.fleet import (
    UNASKED_AFTER_S,
    UNNAMED_GPU_CLASS,
    FleetNode,
    FleetSummary,
    summarise,
)
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import GpuInfo, NodeRecord, NodeState
from modelkeeper.domain.status import DeploymentStatus, ReplicaState
from modelkeeper.domain.units import GIB

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
H100 = "NVIDIA H100 80GB HBM3"


def fleet_node(name: str, *, state: NodeState = NodeState.READY, mem_gib: int | None = 64,
               claimed_gib: int = 0, gpus: list[GpuInfo] | None = None,
               gpus_claimed: list[int] | None = None) -> FleetNode:
    record = NodeRecord(
        node_id=NodeId(f"id-{name}"), name=name, agent_labels={}, operator_labels={},
        cordoned=state is NodeState.CORDONED, cordon_reason=None,
        memory_total_bytes=None if mem_gib is None else mem_gib * GIB,
        memory_available_bytes=None, cpu_count=None, gpus=gpus or [], last_seen=NOW,
        registered_at=NOW, memory_claimed_bytes=claimed_gib * GIB,
        gpus_claimed=gpus_claimed or [])
    return FleetNode(record=record, state=state)


def gpu(index: int, name: str = H100, *, healthy: bool = True) -> GpuInfo:
    return GpuInfo(index=index, name=name, memory_bytes=80 * GIB, healthy=healthy)


def deployment(deployment_id: str, *, status: DeploymentStatus = DeploymentStatus.SERVING,
               placement_error: str | None = None, states: list[ReplicaState] | None = None,
               model: str = "m") -> DeploymentView:
    replicas = [ReplicaView(replica_id=ReplicaId(f"{deployment_id}-r{i}"),
                            deployment_id=DeploymentId(deployment_id), model_id=ModelId(model),
                            nodes=[], state=s, endpoint=None, started_at=None, ready_at=None)
                for i, s in enumerate(states or [])]
    return DeploymentView(
        deployment_id=DeploymentId(deployment_id), model_id=ModelId(model), status=status,
        placement_error=placement_error, desired_replicas=len(replicas),
        ready_replicas=0, consecutive_failures=0, last_failure=None, min_nodes=1,
        node_ids=None, labels={}, replicas=replicas, workflow_id=f"deployment/{deployment_id}",
        created_at=NOW, updated_at=NOW)


def used(replica_id: str, *, idle_min: float | None, state: ReplicaState = ReplicaState.READY,
         gib: int = 8) -> Candidate:
    return Candidate(
        replica_id=ReplicaId(replica_id), deployment_id=DeploymentId(replica_id[:3]),
        policy=None, state=state, ready_at=NOW - timedelta(days=1),
        claims=[VictimClaim(node_id=NodeId("id-a"), memory_bytes=gib * GIB)],
        use=None if idle_min is None else ReplicaUse(
            replica_id=ReplicaId(replica_id), in_flight=0,
            last_used_at=NOW - timedelta(minutes=idle_min),
            reporting_since=NOW - timedelta(days=1)))


def summary(nodes: list[FleetNode], deployments: list[DeploymentView] | None = None,
            usage: list[Candidate] | None = None) -> FleetSummary:
    return summarise(nodes=nodes, deployments=deployments or [], usage=usage or [],
                     models_in_catalog=5, now=NOW)


def test_rule1_capacity_counts_ready_nodes_only_and_every_node_by_state() -> None:
    found = summary([fleet_node("a", claimed_gib=16), fleet_node("b", state=NodeState.CORDONED),
                     fleet_node("c", state=NodeState.UNREACHABLE, gpus=[gpu(0)])])
    assert found.nodes == {"cordoned": 1, "ready": 1, "unreachable": 1}
    assert (found.memory.total_bytes, found.memory.used_bytes, found.memory.free_bytes) == (
        64 * GIB, 16 * GIB, 48 * GIB)
    assert found.gpus == []


def test_rule2_free_memory_is_floored_per_node_and_unknown_memory_counted_apart() -> None:
    # a is over-claimed (came back reporting less): its deficit is not taken off b's room.
    found = summary([fleet_node("a", mem_gib=8, claimed_gib=12), fleet_node("b", mem_gib=16),
                     fleet_node("old", mem_gib=None)])
    assert (found.memory.total_bytes, found.memory.used_bytes, found.memory.free_bytes) == (
        24 * GIB, 12 * GIB, 16 * GIB)
    assert found.nodes_memory_unknown == 1


def test_rule3_gpus_by_class_and_unhealthy_ones_neither_used_nor_free() -> None:
    found = summary([
        fleet_node("a", gpus=[gpu(0), gpu(1), gpu(2, healthy=False), gpu(3, healthy=False)],
                   gpus_claimed=[0, 3]),
        fleet_node("b", gpus=[gpu(0, "  "), gpu(1, "NVIDIA L4")])])
    by_class = {g.gpu_class: (g.total, g.used, g.free, g.unhealthy) for g in found.gpus}
    # GPU 3 is claimed but unhealthy: unhealthy, not used.
    assert by_class == {H100: (4, 1, 1, 2), UNNAMED_GPU_CLASS: (1, 0, 1, 0),
                        "NVIDIA L4": (1, 0, 1, 0)}


def test_rule4_free_whole_nodes_are_ready_nodes_with_no_claim() -> None:
    found = summary([fleet_node("busy", claimed_gib=1), fleet_node("gpu-held", gpus=[gpu(0)],
                                                                   gpus_claimed=[0]),
                     fleet_node("free-b"), fleet_node("free-a"),
                     fleet_node("cordoned", state=NodeState.CORDONED)])
    assert found.free_whole_nodes == ["free-a", "free-b"]


def test_rule5_counts() -> None:
    found = summary([], [deployment("d-1", states=[ReplicaState.READY, ReplicaState.SLEEPING]),
                         deployment("d-2", states=[ReplicaState.READY], model="m"),
                         deployment("d-3", model="other")])
    assert (found.deployments, found.replicas, found.replica_total) == (
        3, {"ready": 2, "sleeping": 1}, 3)
    assert (found.models_in_catalog, found.models_deployed) == (5, 2)


def test_rule6_what_cannot_be_placed_with_its_reason() -> None:
    found = summary([], [
        deployment("d-1", status=DeploymentStatus.CANT_PLACE,
                   placement_error="node a: 8.0 GiB free, needs 24.0 GiB"),
        deployment("d-2", status=DeploymentStatus.SERVING,
                   placement_error="standby: node a: 0 of 1 GPUs free, needs 1"),
        deployment("d-3")])
    assert [(w.deployment_id, w.status, w.reason) for w in found.cant_place] == [
        ("d-1", DeploymentStatus.CANT_PLACE, "node a: 8.0 GiB free, needs 24.0 GiB"),
        ("d-2", DeploymentStatus.SERVING, "standby: node a: 0 of 1 GPUs free, needs 1")]


def test_rule7_unasked_most_idle_first_and_unknown_is_not_idle() -> None:
    hour_min = UNASKED_AFTER_S / 60
    found = summary([], usage=[
        used("d-a-r1", idle_min=hour_min + 1), used("d-b-r1", idle_min=hour_min * 3,
                                                    state=ReplicaState.SLEEPING),
        used("d-c-r1", idle_min=hour_min - 1), used("d-d-r1", idle_min=None),
        used("d-e-r1", idle_min=hour_min * 9, state=ReplicaState.STARTING)])
    assert [u.replica_id for u in found.unasked] == ["d-b-r1", "d-a-r1"]
    assert found.unasked[0].idle_s == pytest.approx(3 * UNASKED_AFTER_S)
    assert found.unasked[0].memory_bytes == 8 * GIB and found.unasked[0].nodes == ["id-a"]
    assert [(u.replica_id, u.idle_s) for u in found.usage_unknown] == [("d-d-r1", None)]
