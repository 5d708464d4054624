"""A deployment's schedule windows as Temporal Schedules: made, listed and removed here and
nowhere else (the API's routes, the API's delete of a deployment, and the windows'
clean-up activity call these).

Each window is two schedules, ``window/<deployment>/<name>/open`` and ``.../close``
(modelkeeper.names.window_schedule_id), in the window's time zone: the server applies
daylight saving time. Each starts a WindowWorkflow (by its name: this room lies below the
workflows) on the control queue, which asks the deployment for ``set_window``. The window
as the operator sent it rides in each schedule's memo: listing reads it back, so the
schedules are the one home of a deployment's windows, and the web UI's Schedules page
shows each with its summary.
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleCalendarSpec,
    SchedulePolicy,
    ScheduleRange,
    ScheduleSpec,
    ScheduleState,
)
from temporalio.service import RPCError, RPCStatusCode

from ..domain.ids import DeploymentId
from ..domain.schedules import (
    Calendar,
    Edge,
    ScheduleWindow,
    WindowInput,
    WindowView,
    close_calendar,
    open_at,
    open_calendar,
)
from ..names import (
    CONTROL_TASK_QUEUE,
    WORKFLOW_WINDOW,
    window_schedule_id,
    window_schedules_prefix,
)

#: The memo key under which each schedule keeps its window, as sent.
WINDOW_MEMO_KEY = "window"
EDGES: tuple[Edge, Edge] = ("open", "close")
#: A window's workflow is one update to a deployment that answers within a workflow task;
#: ten minutes covers a control worker restarting, and ends a run whose deployment's
#: worker is gone instead of leaving it for the next day's run to skip over.
WINDOW_RUN_TIMEOUT = timedelta(minutes=10)
#: A close missed while the Temporal server was down still runs when it is back, within a
#: day: a window left open holds its replicas. An open is caught up only while its window
#: lasts (opening a window that has ended would hold them until the next close).
CLOSE_CATCHUP = timedelta(days=1)
#: Temporal refuses a catch-up window under ten seconds.
MIN_CATCHUP = timedelta(seconds=10)


class WindowExistsError(Exception):
    """The deployment has a window by that name already."""


def _spec(calendar: Calendar, timezone: str) -> ScheduleSpec:
    return ScheduleSpec(
        calendars=[ScheduleCalendarSpec(
            day_of_week=[ScheduleRange(d) for d in calendar.days_of_week],
            hour=[ScheduleRange(calendar.hour)], minute=[ScheduleRange(calendar.minute)],
            second=[ScheduleRange(calendar.second)])],
        time_zone_name=timezone)


def _schedule(window: ScheduleWindow, *, deployment_id: DeploymentId, workflow_id: str,
              edge: Edge) -> Schedule:
    request = WindowInput.of(window, deployment_id=deployment_id, workflow_id=workflow_id,
                             edge=edge)
    if edge == "open":
        calendar = open_calendar(window)
        catchup = max(timedelta(seconds=window.duration_s + window.prewarm_s), MIN_CATCHUP)
    else:
        calendar, catchup = close_calendar(window), CLOSE_CATCHUP
    return Schedule(
        action=ScheduleActionStartWorkflow(
            WORKFLOW_WINDOW, request, id=window_schedule_id(deployment_id, window.name, edge),
            task_queue=CONTROL_TASK_QUEUE, execution_timeout=WINDOW_RUN_TIMEOUT,
            static_summary=request.summary()),
        spec=_spec(calendar, window.timezone),
        policy=SchedulePolicy(catchup_window=catchup),
        state=ScheduleState(note=request.summary()))


async def create_window(client: Client, window: ScheduleWindow, *,
                        deployment_id: DeploymentId, workflow_id: str) -> None:
    """Make the window's two schedules; :class:`WindowExistsError` when its name is taken.
    Both or neither: a failure after the first removes it before raising."""
    made: list[str] = []
    done = False
    try:
        for edge in EDGES:
            schedule_id = window_schedule_id(deployment_id, window.name, edge)
            await client.create_schedule(
                schedule_id, _schedule(window, deployment_id=deployment_id,
                                       workflow_id=workflow_id, edge=edge),
                memo={WINDOW_MEMO_KEY: window.model_dump(mode="json")})
            made.append(schedule_id)
        done = True
    except ScheduleAlreadyRunningError:
        raise WindowExistsError(f"deployment {deployment_id} has a window named "
                                f"{window.name!r} already") from None
    finally:
        if not done:
            await _delete_each(client, made)


async def _delete_each(client: Client, schedule_ids: list[str]) -> bool:
    """Delete each schedule; whether any existed (one already gone is not an error)."""
    existed = False
    for schedule_id in schedule_ids:
        try:
            await client.get_schedule_handle(schedule_id).delete()
            existed = True
        except RPCError as err:
            if err.status is not RPCStatusCode.NOT_FOUND:
                raise
    return existed


async def delete_window(client: Client, deployment_id: DeploymentId, name: str) -> bool:
    """Remove a window's schedules; whether it had any."""
    return await _delete_each(client, [window_schedule_id(deployment_id, name, edge)
                                       for edge in EDGES])


async def _schedule_ids(client: Client, deployment_id: DeploymentId) -> list[str]:
    prefix = window_schedules_prefix(deployment_id)
    # The server filters by prefix; the check after it keeps a server that ignored the
    # query from handing back another deployment's schedules.
    listed = await client.list_schedules(f'ScheduleId STARTS_WITH "{prefix}"')
    return sorted([s.id async for s in listed if s.id.startswith(prefix)])


def _names(deployment_id: DeploymentId, schedule_ids: list[str]) -> list[str]:
    prefix = window_schedules_prefix(deployment_id)
    return sorted({sid.removeprefix(prefix).rpartition("/")[0] for sid in schedule_ids})


async def delete_windows(client: Client, deployment_id: DeploymentId) -> list[str]:
    """Remove every window of a deployment (it is being deleted); the names removed.

    The list is Temporal's visibility, which may lag a schedule made a moment ago: a window
    missed here removes its own schedules when it next fires and finds no deployment
    (workflows/window.py)."""
    names = _names(deployment_id, await _schedule_ids(client, deployment_id))
    for name in names:
        await delete_window(client, deployment_id, name)
    return names


async def list_windows(client: Client, deployment_id: DeploymentId, *,
                       now: datetime) -> list[WindowView]:
    """The deployment's windows, each with when its schedules fire next, by name.

    Each window is read from its open schedule's memo (described, not listed: a listing's
    memo is visibility's copy). A window whose open schedule is gone (removed by hand
    in the web UI) is left out; its close, if left, only closes what is not open."""
    views = []
    for name in _names(deployment_id, await _schedule_ids(client, deployment_id)):
        next_times: dict[Edge, datetime | None] = {}
        window: ScheduleWindow | None = None
        for edge in EDGES:
            try:
                described = await client.get_schedule_handle(
                    window_schedule_id(deployment_id, name, edge)).describe()
            except RPCError as err:
                if err.status is not RPCStatusCode.NOT_FOUND:
                    raise
                next_times[edge] = None
                continue
            times = described.info.next_action_times
            next_times[edge] = times[0] if times else None
            if edge == "open":
                with contextlib.suppress(KeyError):
                    window = ScheduleWindow.model_validate(
                        await described.memo_value(WINDOW_MEMO_KEY))
        if window is None:
            continue
        views.append(WindowView(
            deployment_id=deployment_id, window=window,
            open_schedule_id=window_schedule_id(deployment_id, name, "open"),
            close_schedule_id=window_schedule_id(deployment_id, name, "close"),
            open_now=open_at(window, now), next_open=next_times.get("open"),
            next_close=next_times.get("close")))
    return views
