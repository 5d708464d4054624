"""Preemption between two DeploymentWorkflows on the time-skipping server, every activity
faked (issue 22): the critical deployment finds no room, seeks it (find_eviction names the
opportunistic replica to preempt), signals the victim's workflow and waits; the victim is
drained with the short grace, keeps its count and says who took its room; the room's
release lets the critical one place; when room returns the victim is placed again by
itself. Both histories are recorded for replay (patch ``capacity-preemption``)."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.ids import DeploymentId, ModelId, ReplicaId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import EvictionFound, PreemptTarget
from modelkeeper.names import CONTROL_TASK_QUEUE, deployment_workflow_id
from tests.workflows.test_deployment_workflow import (
    FakeCluster,
    Running,
    _tunables,
    _until,
    _workers,
    record_history,
)
from workflows.deployment import DeploymentInput, DeploymentWorkflow

pytestmark = pytest.mark.timeout(90)

LOW, CRIT = DeploymentId("d-low"), DeploymentId("d-crit")
REASON = "preempted by d-crit: a lower class (opportunistic) than critical"


async def _start(env: WorkflowEnvironment, cluster: FakeCluster, deployment_id: DeploymentId,
                 capacity_class: CapacityClass) -> Running:
    spec = DeploymentSpec(deployment_id=deployment_id, model_id=ModelId(f"m-{deployment_id}"),
                          replicas=1, capacity_class=capacity_class)
    handle: WorkflowHandle[DeploymentWorkflow, str] = await env.client.start_workflow(
        DeploymentWorkflow.run,
        DeploymentInput(spec=spec, tunables=_tunables(), search_attributes=False),
        id=deployment_workflow_id(deployment_id), task_queue=CONTROL_TASK_QUEUE)
    return Running(env, cluster, handle)


async def test_a_critical_deployment_preempts_and_the_victim_comes_back_by_itself(
        time_skipping_env: WorkflowEnvironment) -> None:
    cluster = FakeCluster(room_beats=True)
    async with _workers(time_skipping_env, cluster):
        low = await _start(time_skipping_env, cluster, LOW, CapacityClass.OPPORTUNISTIC)
        await low.until(DeploymentStatus.SERVING)
        victim = ReplicaId(f"{LOW}-r1")
        # The cluster is full: nothing places; the seek names the victim.
        cluster.cant_place = "node a: 0.0 GiB free, needs 2.0 GiB"
        cluster.eviction = EvictionFound(
            reason="preempting d-low-r1 (opportunistic) to place d-crit",
            preempt=[PreemptTarget(replica_id=victim, deployment_id=LOW, reason=REASON)])
        crit = await _start(time_skipping_env, cluster, CRIT, CapacityClass.CRITICAL)
        # The victim is drained with the preemption's short grace, and stopped.
        await _until(lambda: victim in cluster.stopped)
        assert cluster.drain_graces[victim] == _tunables().preempt_grace_s
        assert cluster.sought == [CRIT]
        view = await crit.until(DeploymentStatus.CANT_PLACE)
        # The victim keeps its count, and says who took its room while it waits.
        lost = await low.until(DeploymentStatus.CANT_PLACE)
        assert lost.keeper.spec.replicas == 1
        assert (lost.keeper.placement_error or "").startswith(REASON)
        # The victim's release made the room (the fake: room anywhere now): the critical
        # one places; it sought room once.
        cluster.cant_place = None
        await crit.handle.signal(DeploymentWorkflow.nodes_changed)
        view = await crit.until(DeploymentStatus.SERVING)
        assert view.keeper.placement_error is None and cluster.sought == [CRIT]
        # Room returns for the victim too (a node change): placed again by itself.
        await low.handle.signal(DeploymentWorkflow.nodes_changed)
        back = await low.until(DeploymentStatus.SERVING)
        assert back.keeper.preempted is None
        await record_history(crit.handle, "preempt_preemptor")
        await record_history(low.handle, "preempt_victim")
