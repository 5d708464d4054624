"""The newcomer's frictions the API fixes (issue 24, section 8), on real PostgreSQL:

* ``GET /placement/explain`` of a deployment (or of a deployed model) applies its labels:
  it never says "fits on vm" for a deployment that needs a label no node has;
* ``GET /operations?deployment=&node=`` take names as everywhere else (a model id, a node
  name), and still ids that name nothing now (a deleted deployment's operations stay);
* a deployment's last failure keeps the generation it happened on, so that `ls` stops
  showing it once a restart has replaced what failed.
"""

from __future__ import annotations

import httpx
import pytest

from modelkeeper.domain.catalog import DeploymentStatusUpdate
from modelkeeper.domain.ids import DeploymentId, NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operations import OperationKind
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


async def _vm_and_a_deployment_needing_a_label(api: httpx.AsyncClient, store: Store) -> str:
    await store.nodes.register_node(AgentRegistration(
        node_id=NodeId("n-vm"), name="vm", labels={"zone": "a"},
        inventory=Inventory(memory_total_bytes=16 * GIB, memory_available_bytes=16 * GIB,
                            cpu_count=4)))
    for model in ("sim-a", "sim-free"):
        created = await api.post("/models", json={"model_id": model, "engine": "sim",
                                                  "source": "sim", "memory_bytes": GIB})
        assert created.status_code == 201, created.text
    resp = await api.post("/deployments", json={"model_id": "sim-a", "replicas": 1,
                                                "labels": {"gpu": "a100"}})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["deployment_id"])


async def test_explain_of_a_deployment_applies_its_labels(
        api: httpx.AsyncClient, store: Store) -> None:
    deployment_id = await _vm_and_a_deployment_needing_a_label(api, store)
    for params in ({"deployment_id": deployment_id}, {"model_id": "sim-a"}):
        shown = (await api.get("/placement/explain", params=params)).json()
        assert (shown["fits"], shown["deployment_id"], shown["model_id"]) == (
            False, deployment_id, "sim-a"), shown
        [vm] = shown["nodes"]
        assert (vm["name"], vm["fits"]) == ("vm", False)
        assert "gpu" in vm["message"], vm
    # A model not deployed asks for nothing but its own needs: it fits.
    free = (await api.get("/placement/explain", params={"model_id": "sim-free"})).json()
    assert (free["fits"], free["deployment_id"], free["nodes_chosen"]) == (True, None, ["n-vm"])
    # Neither, an unknown deployment, or a model the deployment does not run: said so.
    assert (await api.get("/placement/explain")).status_code == 422
    assert (await api.get("/placement/explain",
                          params={"deployment_id": "d-nope"})).status_code == 404
    mismatch = await api.get("/placement/explain", params={"deployment_id": deployment_id,
                                                           "model_id": "sim-free"})
    assert mismatch.status_code == 422
    [error] = mismatch.json()["detail"]
    assert error["loc"] == ["query", "model_id"] and "runs sim-a" in error["msg"]


async def test_operations_are_listed_by_deployment_and_node_names(
        api: httpx.AsyncClient, store: Store) -> None:
    deployment_id = await _vm_and_a_deployment_needing_a_label(api, store)
    restart = await store.operations.begin_next(
        OperationKind.RESTART, deployment_id, deployment_id=DeploymentId(deployment_id),
        summary="restart")
    drain = await store.operations.begin_next(OperationKind.DRAIN, "n-vm",
                                              node_id=NodeId("n-vm"), summary="drain")
    gone = await store.operations.begin_next(OperationKind.RESTART, "d-deleted",
                                             deployment_id=DeploymentId("d-deleted"))

    async def listed(**params: str) -> list[str]:
        resp = await api.get("/operations", params=params)
        assert resp.status_code == 200, resp.text
        return [o["operation_id"] for o in resp.json()]

    assert await listed(deployment="sim-a") == await listed(deployment=deployment_id) == [
        restart.operation_id]
    assert await listed(node="vm") == await listed(node="n-vm") == [drain.operation_id]
    assert await listed(deployment="d-deleted") == [gone.operation_id]
    assert await listed(deployment="nothing-at-all") == []


async def test_a_failure_keeps_the_generation_it_happened_on(
        api: httpx.AsyncClient, store: Store) -> None:
    deployment_id = await _vm_and_a_deployment_needing_a_label(api, store)

    async def written(last_failure: str | None, generation: int) -> tuple[object, ...]:
        await store.deployments.record_deployment_status(DeploymentStatusUpdate(
            deployment_id=DeploymentId(deployment_id), status=DeploymentStatus.SERVING,
            placement_error=None, consecutive_failures=0, last_failure=last_failure,
            desired_replicas=1, generation=generation))
        view = await store.deployments.get_deployment(deployment_id)
        assert view is not None
        return view.last_failure, view.last_failure_generation, view.generation

    oom = "d-r1: engine exited (oom)"
    assert await written(oom, 4) == (oom, 4, 4)
    # Written again by a restart's status writes (generation 5): it stays generation 4's.
    assert await written(oom, 5) == (oom, 4, 5)
    assert await written("d-r2: start failed", 5) == ("d-r2: start failed", 5, 5)
    assert await written(None, 6) == (None, None, 6)
