"""Schedule windows on the dev server (the time-skipping test server has no schedules): a
real DeploymentWorkflow on the faked cluster of test_deployment_workflow, a window's two
Temporal Schedules made as the API makes them (modelkeeper.infra.schedules), each fired
with ``trigger()``; the real WindowWorkflow and its activities (activities/windows.py)
carry the window to the deployment."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from temporalio.client import Client, ScheduleHandle, ScheduleOverlapPolicy, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.windows import WindowActivities
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.ids import DeploymentId, ModelId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.schedules import ScheduleWindow, WindowInput
from modelkeeper.infra import schedules
from modelkeeper.names import (
    CONTROL_TASK_QUEUE,
    ROOM_WATCH_TASK_QUEUE,
    deployment_workflow_id,
    node_task_queue,
    window_schedule_id,
)
from tests.workflows.test_deployment_workflow import (
    NODE,
    FakeCluster,
    _tunables,
    record_history,
)
from workflows.deployment import DeploymentInput, DeploymentWorkflow, WorkflowStatus
from workflows.window import WindowWorkflow

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

D = DeploymentId("d-window")
#: Weekdays, nine to five in Berlin: the test fires the schedules by hand, whenever it runs.
WINDOW = ScheduleWindow(name="day", days=["mon", "tue", "wed", "thu", "fri"], start="09:00",
                        end="17:00", timezone="Europe/Berlin", min_replicas=2,
                        max_replicas=2, prewarm_s=600)
#: A workflow run the schedule starts is answered in well under a second here.
UNTIL_S = 60


@contextlib.asynccontextmanager
async def _workers(env: WorkflowEnvironment, cluster: FakeCluster) -> AsyncIterator[None]:
    """The control worker as `modelkeeper worker` has it for this (the deployment and the
    window workflows, the fake store activities and the real window ones), the node's and
    the room watch's."""
    control, node = cluster.activities()
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow, WindowWorkflow],
                      activities=[*control, *WindowActivities(env.client).all()]), \
            Worker(env.client, task_queue=node_task_queue(NODE), activities=node), \
            Worker(env.client, task_queue=ROOM_WATCH_TASK_QUEUE,
                   activities=[cluster.room_watch()]):
        yield


async def _start(client: Client) -> WorkflowHandle[DeploymentWorkflow, str]:
    # A policy of one replica (min = max = 1): what a window's close returns to. Without
    # follows_demand, so no usage watch runs (nothing here reports usage).
    spec = DeploymentSpec(deployment_id=D, model_id=ModelId("m"), replicas=1,
                          scaling=ScalingPolicy.fixed(1))
    return await client.start_workflow(
        DeploymentWorkflow.run, DeploymentInput(spec=spec, tunables=_tunables(),
                                                search_attributes=False),
        id=deployment_workflow_id(D), task_queue=CONTROL_TASK_QUEUE)


async def _until(handle: WorkflowHandle[DeploymentWorkflow, str],
                 check: Callable[[WorkflowStatus], bool]) -> WorkflowStatus:
    async def poll() -> WorkflowStatus:
        while not check(view := await handle.query(DeploymentWorkflow.status)):
            await asyncio.sleep(0.05)
        return view

    return await asyncio.wait_for(poll(), UNTIL_S)


def _serving(n: int) -> Callable[[WorkflowStatus], bool]:
    return lambda v: (v.keeper.spec.replicas == n and len(v.keeper.replicas) == n
                      and all(r.phase.value == "ready" for r in v.keeper.replicas))


async def _runs_ended(client: Client, schedule_id: str, count: int,
                      record: str | None = None) -> list[str]:
    """The results of the first ``count`` runs the schedule started, once each has ended;
    the last one's history saved as ``record`` (for test_window_replay.py) when asked."""
    handle = client.get_schedule_handle(schedule_id)

    async def poll() -> list[str]:
        while True:
            actions = (await handle.describe()).info.recent_actions
            if len(actions) >= count:
                runs = [client.get_workflow_handle(a.action.workflow_id)
                        for a in actions[:count]]
                results = [await r.result() for r in runs]
                if record is not None:
                    await record_history(runs[-1], record)
                return results
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), UNTIL_S)


async def test_the_open_schedule_raises_the_count_to_the_windows_min_and_the_close_returns_it(
    local_temporal_env: WorkflowEnvironment,
) -> None:
    client = local_temporal_env.client
    cluster = FakeCluster()
    async with _workers(local_temporal_env, cluster):
        deployment = await _start(client)
        await _until(deployment, _serving(1))

        await schedules.create_window(client, WINDOW, deployment_id=D,
                                      workflow_id=deployment_workflow_id(D))
        listed = await schedules.list_windows(client, D, now=datetime.now(UTC))
        assert [(w.window, w.open_schedule_id) for w in listed] == [
            (WINDOW, window_schedule_id(D, "day", "open"))]
        # Temporal applies the zone: the next open is 08:50 Berlin, 06:50 or 07:50 UTC.
        next_open = listed[0].next_open
        assert next_open is not None
        assert next_open.astimezone(ZoneInfo(WINDOW.timezone)).strftime("%H:%M") == "08:50"
        assert next_open - datetime.now(UTC) < timedelta(days=4)

        opening = client.get_schedule_handle(window_schedule_id(D, "day", "open"))
        closing = client.get_schedule_handle(window_schedule_id(D, "day", "close"))
        await opening.trigger()
        view = await _until(deployment, _serving(2))
        assert view.keeper.window is not None
        assert view.keeper.window.name == "day"
        assert await _runs_ended(client, opening.id, 1, record="window_open") == [
            "window day open on d-window: 2 replica(s) wanted"]

        await closing.trigger()
        view = await _until(deployment, _serving(1))
        assert view.keeper.window is None
        assert await _runs_ended(client, closing.id, 1, record="window_close") == [
            "window day closed on d-window: 1 replica(s) wanted"]

        # The deployment goes, its windows left behind (as a terminate by hand leaves
        # them): the next firing finds no deployment and removes both schedules.
        await deployment.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(deployment.result(), UNTIL_S)
        # The firing's run, awaited (not the schedules' absence polled): a run that fails
        # says why here. Fired within a second of the first open, it shares that run's
        # workflow id (a schedule names runs to the second): its update must still be its
        # own, not answered with the first one's outcome (activities/windows.py).
        await opening.trigger(overlap=ScheduleOverlapPolicy.ALLOW_ALL)
        gone_run = await asyncio.wait_for(_another_run(client, opening.id, seen=1), UNTIL_S)
        try:
            result = await asyncio.wait_for(gone_run.result(), UNTIL_S)
        except TimeoutError:
            raise AssertionError(f"the firing's run did not end: {await _stuck(gone_run)}") \
                from None
        assert "deployment d-window is gone" in result, result
        assert "its schedules were removed" in result, result
        await asyncio.wait_for(_gone(opening), UNTIL_S)
        await asyncio.wait_for(_gone(closing), UNTIL_S)
        await record_history(gone_run, "window_gone")


async def test_a_second_firing_in_the_same_second_is_its_own_update(
    local_temporal_env: WorkflowEnvironment,
) -> None:
    """A schedule names its runs to the second, so two firings within one second share a
    workflow id. The second, after the deployment went, must find it gone and say so, not
    be answered the first one's outcome (the update id was the workflow id: test_window's
    schedules were left behind in busy suites)."""
    client = local_temporal_env.client
    cluster = FakeCluster()
    request = WindowInput.of(WINDOW, deployment_id=D, workflow_id=deployment_workflow_id(D),
                             edge="open")
    run_id = f"{window_schedule_id(D, 'day', 'open')}-2026-12-04T09:00:00Z"
    async with _workers(local_temporal_env, cluster):
        deployment = await _start(client)
        await _until(deployment, _serving(1))
        first = await client.execute_workflow(WindowWorkflow.run, request, id=run_id,
                                              task_queue=CONTROL_TASK_QUEUE)
        assert first == "window day open on d-window: 2 replica(s) wanted"
        await deployment.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(deployment.result(), UNTIL_S)
        second = await asyncio.wait_for(client.execute_workflow(
            WindowWorkflow.run, request, id=run_id, task_queue=CONTROL_TASK_QUEUE), UNTIL_S)
        assert "deployment d-window is gone" in second, second


async def _stuck(handle: WorkflowHandle[Any, Any]) -> str:
    """What a run that does not end is waiting on: its pending activities, with their
    attempts and last failures."""
    description = await handle.describe()
    pending = description.raw_description.pending_activities
    return "; ".join(f"{a.activity_type.name} attempt {a.attempt}: "
                     f"{a.last_failure.message or 'no failure yet'}" for a in pending) \
        or f"no pending activity ({description.status})"


async def _another_run(client: Client, schedule_id: str, *, seen: int) -> WorkflowHandle[
        Any, str]:
    """The run a schedule started after the ``seen`` it had started, once visible (the
    schedule itself may be gone by then: its run removes it)."""
    while True:
        runs = [r async for r in client.list_workflows(
            f'WorkflowId STARTS_WITH "{schedule_id}"')]
        if len(runs) > seen:
            newest = max(runs, key=lambda r: r.start_time)
            return client.get_workflow_handle(newest.id, run_id=newest.run_id,
                                              result_type=str)
        await asyncio.sleep(0.05)


async def _gone(handle: ScheduleHandle) -> None:
    while True:
        try:
            await handle.describe()
        except RPCError as err:
            assert err.status is RPCStatusCode.NOT_FOUND
            return
        await asyncio.sleep(0.05)
