"""The windows routes (api/windows.py) against real PostgreSQL and a real Temporal dev
server: a window is two Temporal Schedules, listed back with when they fire; mistakes are
422s naming the field; unknown deployments and windows are 404s; a deleted deployment's
windows go with it; a window added while inside it opens at once (with a worker).
Who may call them (viewer reads, admin writes) is tests/security/test_api_auth.py's,
which tries every operator route."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from modelkeeper.domain.catalog import DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.names import CONTROL_TASK_QUEUE, deployment_workflow_id, window_schedule_id
from modelkeeper.store import Store
from tests.workflows.test_deployment_workflow import FakeCluster
from tests.workflows.test_window import _workers
from workflows.deployment import DeploymentInput, DeploymentWorkflow

pytestmark = pytest.mark.timeout(60)

SIM = {"model_id": "sim-a", "engine": "sim", "source": "sim", "memory_bytes": 1 << 30}
ALL_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _hhmm(at: datetime) -> str:
    return at.strftime("%H:%M")


def window(*, inside: bool = False, **fields: Any) -> dict[str, Any]:
    """A window every day, in UTC: around now (``inside``) or three hours from now, never
    at the edge of either whenever the test runs."""
    now = datetime.now(UTC)
    start, end = ((now - timedelta(hours=1), now + timedelta(hours=1)) if inside
                  else (now + timedelta(hours=3), now + timedelta(hours=4)))
    return {"name": "day", "days": ALL_DAYS, "start": _hhmm(start), "end": _hhmm(end),
            "timezone": "UTC", "min_replicas": 2, "max_replicas": 3, "prewarm_s": 0,
            **fields}


async def _deployment(app: FastAPI, api: httpx.AsyncClient) -> DeploymentId:
    """A deployment of sim-a with its running workflow, made as POST /deployments makes
    one (its row, then its workflow), without reading the catalog entry back."""
    assert (await api.post("/models", json=SIM)).status_code == 201
    d = DeploymentId("d-windows")
    store: Store = app.state.store
    await store.deployments.create_deployment(
        d, DeploymentRequest(model_id=ModelId("sim-a")), deployment_workflow_id(d))
    temporal: Client = app.state.temporal
    await temporal.start_workflow(
        DeploymentWorkflow.run, DeploymentInput(spec=DeploymentSpec(
            deployment_id=d, model_id=ModelId("sim-a"), replicas=1)),
        id=deployment_workflow_id(d), task_queue=CONTROL_TASK_QUEUE)
    return d


async def _exists(client: Client, schedule_id: str) -> bool:
    try:
        await client.get_schedule_handle(schedule_id).describe()
    except RPCError as err:
        assert err.status is RPCStatusCode.NOT_FOUND
        return False
    return True


async def test_a_window_is_added_listed_and_removed(app: FastAPI,
                                                    api: httpx.AsyncClient) -> None:
    d = await _deployment(app, api)
    sent = window()
    added = await api.post(f"/deployments/{d}/windows", json=sent)
    assert added.status_code == 201, added.text
    view = added.json()
    assert view["window"] == sent
    assert view["open_now"] is False
    assert (view["open_schedule_id"], view["close_schedule_id"]) == (
        f"window/{d}/day/open", f"window/{d}/day/close")
    next_open = datetime.fromisoformat(view["next_open"])
    assert timedelta(hours=2) < next_open - datetime.now(UTC) < timedelta(hours=3, minutes=1)
    assert datetime.fromisoformat(view["next_close"]) - next_open == timedelta(hours=1)
    for edge in ("open", "close"):
        assert await _exists(app.state.temporal, window_schedule_id(d, "day", edge))

    listed = await api.get(f"/deployments/{d}/windows")
    assert listed.status_code == 200
    assert [w["window"] for w in listed.json()] == [sent]
    again = await api.post(f"/deployments/{d}/windows", json=window(min_replicas=1))
    assert again.status_code == 409
    assert "has a window named 'day' already" in again.json()["detail"]

    removed = await api.delete(f"/deployments/{d}/windows/day")
    assert removed.status_code == 204, removed.text
    assert (await api.get(f"/deployments/{d}/windows")).json() == []
    for edge in ("open", "close"):
        assert not await _exists(app.state.temporal, window_schedule_id(d, "day", edge))
    gone = await api.delete(f"/deployments/{d}/windows/day")
    assert gone.status_code == 404
    assert f"deployment {d} has no window named 'day'" in gone.json()["detail"]

    kinds = [e["kind"] for e in (await api.get("/events", params={"deployment_id": d})).json()]
    assert "deployment.window_added" in kinds and "deployment.window_removed" in kinds


@pytest.mark.parametrize(("fields", "loc", "says"), [
    ({"timezone": "Berlin"}, ["body", "timezone"], "'Berlin' is not an IANA time zone"),
    ({"min_replicas": 4}, ["body"], "max_replicas = 3 is below min_replicas = 4"),
    ({"days": ["mon", "funday"]}, ["body", "days", 1], "Input should be"),
    ({"start": "25:00"}, ["body", "start"], "should match pattern"),
    ({"prewarm_s": 86_400}, ["body", "prewarm_s"], "less than or equal to 21600"),
    ({"name": "../x"}, ["body", "name"], "should match pattern"),
    ({"min_replicas": "2"}, ["body", "min_replicas"], "must be an integer"),
])
async def test_a_mistake_is_a_422_naming_the_field(
    app: FastAPI, api: httpx.AsyncClient, fields: dict[str, Any], loc: list[Any], says: str,
) -> None:
    d = await _deployment(app, api)
    resp = await api.post(f"/deployments/{d}/windows", json=window(**fields))
    assert resp.status_code == 422, resp.text
    [error] = resp.json()["detail"]
    assert error["loc"] == loc
    assert says in error["msg"]
    assert (await api.get(f"/deployments/{d}/windows")).json() == []


async def test_an_unknown_deployment_is_a_404_on_each_route(api: httpx.AsyncClient) -> None:
    for method, path, body in [("POST", "/deployments/d-nope/windows", window()),
                               ("GET", "/deployments/d-nope/windows", None),
                               ("DELETE", "/deployments/d-nope/windows/day", None)]:
        resp = await api.request(method, path, json=body)
        assert resp.status_code == 404, (method, resp.text)
        assert "deployment 'd-nope' does not exist" in resp.json()["detail"]
    bad_name = await api.delete("/deployments/d-nope/windows/Not%20A%20Name")
    assert bad_name.status_code == 422
    assert bad_name.json()["detail"][0]["loc"] == ["path", "name"]


async def test_deleting_a_deployment_removes_its_windows(app: FastAPI,
                                                         api: httpx.AsyncClient) -> None:
    d = await _deployment(app, api)
    for name in ("day", "night"):
        assert (await api.post(f"/deployments/{d}/windows",
                               json=window(name=name))).status_code == 201
    deleted = await api.delete(f"/deployments/{d}")
    assert deleted.status_code == 202, deleted.text
    for name in ("day", "night"):
        for edge in ("open", "close"):
            assert not await _exists(app.state.temporal, window_schedule_id(d, name, edge))


@pytest.mark.slow
async def test_a_window_added_while_inside_it_opens_at_once(
    local_temporal_env: WorkflowEnvironment, app: FastAPI, api: httpx.AsyncClient,
) -> None:
    async with _workers(local_temporal_env, FakeCluster()):
        d = await _deployment(app, api)
        added = await api.post(f"/deployments/{d}/windows", json=window(inside=True))
        assert added.status_code == 201, added.text
        assert added.json()["open_now"] is True
        status = await app.state.temporal.get_workflow_handle_for(
            DeploymentWorkflow.run, deployment_workflow_id(d)).query(DeploymentWorkflow.status)
        assert status.keeper.window is not None
        assert status.keeper.window.name == "day"
        assert status.keeper.spec.replicas == 2  # raised to the window's min at once
        events = (await api.get("/events", params={"deployment_id": d})).json()
        [event] = [e for e in events if e["kind"] == "deployment.window_added"]
        assert "opened at once (2 replica(s) wanted)" in event["message"]
