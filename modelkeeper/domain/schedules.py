"""Scaling by the clock: schedule windows. Pure: the window, and the time where a rule
needs it, come in as arguments.

A :class:`ScheduleWindow` is what an operator sends: on these days of the week, from
``start`` to ``end`` (wall-clock ``HH:MM`` in ``timezone``; an ``end`` at or before
``start`` is the next day's, so a window may run past midnight), the deployment's
replicas are bounded by the window's ``min_replicas`` and ``max_replicas`` instead of its
policy's. The window opens ``prewarm_s`` before ``start``, so the replicas its minimum
adds have loaded when it starts.

Days of the week and ``HH:MM``, not a cron expression: the open and the close are two
edges of one window that must agree (the close of a window past midnight falls on the next
day), each field is checked on its own with a sentence naming it, and the form maps one to
one onto Temporal's calendar specs. A cron pair could express windows this cannot (the
first Monday of a month), at the price of a parser, and of an open and a close that need
not belong together.

Each window is two Temporal Schedules (modelkeeper.infra.schedules): one fires at
:func:`open_calendar`, one at :func:`close_calendar`, both in the window's time zone
(``time_zone_name``), so daylight saving time is the Temporal server's to apply. A prewarm
is wall-clock time: on the night the clocks change, a prewarm that spans the change is an
hour longer or shorter.

The rules, each with its test in ``tests/unit/test_schedules.py``:

1. Days are unique; ``start`` differs from ``end``; min is at most max; the time zone is
   an IANA name this Python knows.
2. The window with its prewarm lasts under a day: a longer one would open before its
   previous day's close, which would then close it.
3. The open fires ``prewarm_s`` before ``start``, on the day before where that crosses
   midnight; the close fires at ``end``, on the next day where the window runs past
   midnight.
4. :func:`open_at`: whether ``now`` lies in an occurrence of the window, its prewarm
   included (a window created while it is open is opened at once).
"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from functools import cache
from typing import Literal, Self
from zoneinfo import ZoneInfo, available_timezones

from pydantic import Field, field_validator, model_validator

from .base import Frozen, Tolerant
from .bounds import MAX_REPLICAS, JsonInt
from .demand import SetWindowRequest, WindowBounds
from .ids import DeploymentId

#: Days as an operator writes them, in Temporal's numbering (``day_of_week`` 0 is Sunday).
DAY_NAMES: tuple[str, ...] = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
Day = Literal["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
#: A window's name goes into its schedules' ids and their workflows' ids
#: (modelkeeper.names.window_schedule_id): short, and nothing a URL or an id must escape.
WINDOW_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
MAX_WINDOW_NAME_CHARS = 32
#: ``HH:MM``, 00:00 to 23:59.
HHMM_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
#: Six hours of prewarm: a load takes minutes (a 70B from a cold cache, tens of them);
#: more than hours ahead is a typo (minutes for seconds), not a lead time.
MAX_PREWARM_S = 6 * 3600
#: A time zone name is an IANA key ("Europe/Berlin"); the longest is 32 characters.
MAX_TIMEZONE_CHARS = 64

_DAY_S = 86_400
_WEEK_DAYS = 7

Edge = Literal["open", "close"]


#: Names in some zoneinfo directories that name no place: "localtime" is whichever zone
#: this host is set to, which the Temporal server's host need not share.
_NOT_ZONES = frozenset({"localtime"})


@cache
def _known_timezones() -> frozenset[str]:
    # Read once: it walks the zoneinfo directories. A name outside it (a path) is refused
    # even where ZoneInfo would load some file by it.
    return frozenset(available_timezones()) - _NOT_ZONES


def _seconds(hhmm: str) -> int:
    hours, minutes = hhmm.split(":")
    return int(hours) * 3600 + int(minutes) * 60


class ScheduleWindow(Frozen):
    """A window as an operator sends it (POST /deployments/{id}/windows): strict JSON
    types, unknown keys refused, each field bounded."""

    name: str = Field(min_length=1, max_length=MAX_WINDOW_NAME_CHARS,
                      pattern=WINDOW_NAME_PATTERN)
    days: list[Day] = Field(min_length=1, max_length=_WEEK_DAYS)
    start: str = Field(pattern=HHMM_PATTERN, description="HH:MM, wall clock in timezone")
    end: str = Field(pattern=HHMM_PATTERN, description="HH:MM; at or before start: the "
                     "next day's (past midnight)")
    timezone: str = Field(min_length=1, max_length=MAX_TIMEZONE_CHARS,
                          description="IANA time zone name, e.g. Europe/Berlin or UTC")
    min_replicas: JsonInt = Field(ge=0, le=MAX_REPLICAS)
    max_replicas: JsonInt = Field(ge=0, le=MAX_REPLICAS)
    prewarm_s: JsonInt = Field(default=0, ge=0, le=MAX_PREWARM_S,
                               description="open this long before start")

    @field_validator("days")
    @classmethod
    def _unique_days(cls, days: list[Day]) -> list[Day]:
        repeated = sorted({d for d in days if days.count(d) > 1}, key=DAY_NAMES.index)
        if repeated:
            raise ValueError(f"{', '.join(repeated)} given more than once")
        return days

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, name: str) -> str:
        if name not in _known_timezones():
            raise ValueError(f"{name!r} is not an IANA time zone name (such as "
                             "Europe/Berlin, America/New_York or UTC)")
        return name

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"max_replicas = {self.max_replicas} is below min_replicas = "
                             f"{self.min_replicas}")
        if self.start == self.end:
            raise ValueError(f"end = {self.end!r} equals start: a window lasts under a day "
                             "(for always, set the deployment's policy instead)")
        if self.duration_s + self.prewarm_s >= _DAY_S:
            raise ValueError(
                f"prewarm_s = {self.prewarm_s} with the {self.start}-{self.end} window lasts "
                f"{(self.duration_s + self.prewarm_s) / 3600:g} h; the two must stay under "
                "24 h, or the window would open before its previous day's close")
        return self

    @property
    def duration_s(self) -> int:
        """From start to end (past midnight when end is at or before start)."""
        return (_seconds(self.end) - _seconds(self.start)) % _DAY_S

    @property
    def bounds(self) -> WindowBounds:
        """What the deployment's ``set_window`` takes while the window is open."""
        return WindowBounds(name=self.name, min_replicas=self.min_replicas,
                            max_replicas=self.max_replicas)


class Calendar(Frozen):
    """When a schedule fires, as Temporal's calendar spec has it (each field one value,
    ``days_of_week`` 0 for Sunday), in the window's time zone. Plain numbers: the domain
    imports no temporalio (modelkeeper.infra.schedules builds the spec)."""

    days_of_week: tuple[int, ...]
    hour: int = Field(ge=0, le=23)
    minute: int = Field(ge=0, le=59)
    second: int = Field(ge=0, le=59)


def _calendar(days: list[Day], at_s: int) -> Calendar:
    """``at_s`` seconds from the start of each of ``days`` (negative: the day before, past
    a day: the day after)."""
    shift, at = divmod(at_s, _DAY_S)
    shifted = sorted({(DAY_NAMES.index(d) + shift) % _WEEK_DAYS for d in days})
    return Calendar(days_of_week=tuple(shifted), hour=at // 3600, minute=at % 3600 // 60,
                    second=at % 60)


def open_calendar(window: ScheduleWindow) -> Calendar:
    """Rule 3: ``prewarm_s`` before ``start``, on the day before where that crosses
    midnight."""
    return _calendar(window.days, _seconds(window.start) - window.prewarm_s)


def close_calendar(window: ScheduleWindow) -> Calendar:
    """Rule 3: at ``end``, on the next day where the window runs past midnight."""
    return _calendar(window.days, _seconds(window.start) + window.duration_s)


def open_at(window: ScheduleWindow, now: datetime) -> bool:
    """Rule 4: whether ``now`` (aware) lies in an occurrence of the window, from its open
    (prewarm included) to its close. Wall-clock arithmetic in the window's zone, as
    Temporal's calendars count."""
    zone = ZoneInfo(window.timezone)
    local = now.astimezone(zone)
    start = time.fromisoformat(window.start)
    # A window and its prewarm last under a day: yesterday's occurrence may still be open,
    # tomorrow's may have opened early (its prewarm), none further.
    for offset in (-1, 0, 1):
        day: date = local.date() + timedelta(days=offset)
        if DAY_NAMES[(day.weekday() + 1) % _WEEK_DAYS] not in window.days:
            continue
        begins = datetime.combine(day, start, tzinfo=zone)
        opens = begins - timedelta(seconds=window.prewarm_s)
        closes = begins + timedelta(seconds=window.duration_s)
        if opens <= now < closes:
            return True
    return False


def describe(window: ScheduleWindow) -> str:
    """One line: ``day: mon,tue 08:00-18:00 Europe/Berlin, min 2, max 4, prewarm 300 s``."""
    prewarm = f", prewarm {window.prewarm_s} s" if window.prewarm_s else ""
    return (f"{window.name}: {','.join(window.days)} {window.start}-{window.end} "
            f"{window.timezone}, min {window.min_replicas}, max {window.max_replicas}"
            f"{prewarm}")


# -- what the window workflow takes ---------------------------------------------------------


class WindowInput(Tolerant):
    """WindowWorkflow's input, as each of a window's two schedules starts it (recorded in
    the schedule's action and in each run's history: a field added later needs a default),
    and the input of its activities. The window's bounds, not the window: a workflow
    decodes it in its sandbox, where the time zone check's file reads have no place."""

    deployment_id: DeploymentId
    #: The deployment's workflow (its row's ``workflow_id``).
    workflow_id: str
    edge: Edge
    bounds: WindowBounds
    #: :func:`describe` of the window, for the web UI and the run's result.
    described: str = ""

    @classmethod
    def of(cls, window: ScheduleWindow, *, deployment_id: DeploymentId, workflow_id: str,
           edge: Edge) -> WindowInput:
        return cls(deployment_id=deployment_id, workflow_id=workflow_id, edge=edge,
                   bounds=window.bounds, described=describe(window))

    @property
    def request(self) -> SetWindowRequest:
        """The deployment's ``set_window`` for this edge."""
        if self.edge == "open":
            return SetWindowRequest(window=self.bounds)
        return SetWindowRequest(closing=self.bounds.name)

    def summary(self) -> str:
        """What the web UI shows for the schedule and each of its runs."""
        verb = (f"open window {self.bounds.name} of {self.deployment_id}: min "
                f"{self.bounds.min_replicas}, max {self.bounds.max_replicas}"
                if self.edge == "open"
                else f"close window {self.bounds.name} of {self.deployment_id}")
        return f"{verb} ({self.described})" if self.described else verb


class WindowView(Tolerant):
    """GET /deployments/{id}/windows: a window, its two schedules, and when they fire."""

    deployment_id: DeploymentId
    window: ScheduleWindow
    open_schedule_id: str
    close_schedule_id: str
    #: Whether the window is open now (its prewarm included), by the clock.
    open_now: bool
    next_open: datetime | None = None
    next_close: datetime | None = None
