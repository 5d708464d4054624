"""Schedule windows, pure (modelkeeper.domain.schedules): the rules in its docstring, in
order, and the schedule ids (modelkeeper.names)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from modelkeeper.domain.demand import SetWindowRequest, WindowBounds
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.domain.schedules import (
    Calendar,
    ScheduleWindow,
    WindowInput,
    close_calendar,
    open_at,
    open_calendar,
)
from modelkeeper.names import window_schedule_id, window_schedules_prefix

BERLIN = ZoneInfo("Europe/Berlin")
# Days of the week as Temporal numbers them.
SUN, MON, TUE, WED, THU, FRI, SAT = range(7)


def window(**fields: Any) -> ScheduleWindow:
    return ScheduleWindow.model_validate({
        "name": "day", "days": ["mon", "tue", "wed", "thu", "fri"], "start": "08:00",
        "end": "18:00", "timezone": "Europe/Berlin", "min_replicas": 2, "max_replicas": 4,
        "prewarm_s": 300, **fields})


def refusal(**fields: Any) -> tuple[str, str]:
    """The one error a window with ``fields`` gets: where, and what it says."""
    with pytest.raises(ValidationError) as caught:
        window(**fields)
    errors = caught.value.errors()
    assert len(errors) == 1, errors
    return ".".join(str(p) for p in errors[0]["loc"]), errors[0]["msg"]


# -- rule 1: each field checked, naming it ----------------------------------------------


def test_a_sound_window_is_taken() -> None:
    w = window()
    assert w.duration_s == 10 * 3600
    assert w.bounds == WindowBounds(name="day", min_replicas=2, max_replicas=4)


@pytest.mark.parametrize(("fields", "where", "says"), [
    ({"timezone": "Mars/Olympus"}, "timezone", "'Mars/Olympus' is not an IANA time zone"),
    ({"timezone": "../../etc/passwd"}, "timezone", "is not an IANA time zone"),
    ({"timezone": "localtime"}, "timezone", "is not an IANA time zone"),
    ({"days": ["mon", "mon", "tue"]}, "days", "mon given more than once"),
    ({"days": []}, "days", "at least 1"),
    ({"days": ["monday"]}, "days.0", "'sun', 'mon'"),
    ({"start": "8:00"}, "start", "should match pattern"),
    ({"end": "24:00"}, "end", "should match pattern"),
    ({"min_replicas": 5}, "", "max_replicas = 4 is below min_replicas = 5"),
    ({"max_replicas": 65}, "max_replicas", "less than or equal to 64"),
    ({"min_replicas": "2"}, "min_replicas", "must be an integer, not str"),
    ({"prewarm_s": 6 * 3600 + 1}, "prewarm_s", "less than or equal to 21600"),
    ({"prewarm_s": -1}, "prewarm_s", "greater than or equal to 0"),
    ({"name": "Day Shift"}, "name", "should match pattern"),
    ({"name": "x" * 33}, "name", "at most 32"),
    ({"end": "08:00"}, "", "end = '08:00' equals start"),
    ({"colour": "blue"}, "colour", "Extra inputs are not permitted"),
])
def test_each_mistake_names_its_field(fields: dict[str, Any], where: str, says: str) -> None:
    loc, msg = refusal(**fields)
    assert loc == where
    assert says in msg


def test_utc_and_zones_by_their_iana_names_are_taken() -> None:
    for name in ("UTC", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe"):
        assert window(timezone=name).timezone == name


# -- rule 2: a window and its prewarm last under a day -----------------------------------


def test_a_window_and_its_prewarm_must_last_under_a_day() -> None:
    assert window(start="08:00", end="07:00", prewarm_s=3599).duration_s == 23 * 3600
    loc, msg = refusal(start="08:00", end="07:00", prewarm_s=3600)
    assert loc == ""
    assert "prewarm_s = 3600 with the 08:00-07:00 window lasts 24 h" in msg


# -- rule 3: the calendars ----------------------------------------------------------------


def test_open_is_start_less_prewarm_and_close_is_end_on_the_same_days() -> None:
    w = window()
    weekdays = (MON, TUE, WED, THU, FRI)
    assert open_calendar(w) == Calendar(days_of_week=weekdays, hour=7, minute=55, second=0)
    assert close_calendar(w) == Calendar(days_of_week=weekdays, hour=18, minute=0, second=0)


def test_a_window_past_midnight_closes_on_the_next_day() -> None:
    w = window(days=["fri", "sat"], start="22:00", end="02:30", prewarm_s=0)
    assert w.duration_s == 4.5 * 3600
    assert open_calendar(w) == Calendar(days_of_week=(FRI, SAT), hour=22, minute=0, second=0)
    assert close_calendar(w) == Calendar(days_of_week=(SUN, SAT), hour=2, minute=30,
                                         second=0)


def test_a_prewarm_across_midnight_opens_on_the_day_before() -> None:
    # Sunday's and Monday's 00:10 open 15 minutes early: Saturday's and Sunday's 23:55.
    w = window(days=["sun", "mon"], start="00:10", end="06:00", prewarm_s=15 * 60)
    assert open_calendar(w) == Calendar(days_of_week=(SUN, SAT), hour=23, minute=55,
                                        second=0)
    assert close_calendar(w) == Calendar(days_of_week=(SUN, MON), hour=6, minute=0, second=0)


def test_a_prewarm_in_seconds_lands_on_its_second() -> None:
    w = window(days=["wed"], start="09:00", end="10:00", prewarm_s=90)
    assert open_calendar(w) == Calendar(days_of_week=(WED,), hour=8, minute=58, second=30)


# -- rule 4: open_at ------------------------------------------------------------------------


def at(year: int, month: int, day: int, hour: int, minute: int = 0, second: int = 0,
       zone: ZoneInfo = BERLIN) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=zone)


def test_open_at_counts_the_prewarm_and_ends_at_end() -> None:
    w = window()  # weekdays 08:00-18:00 Berlin, opening 07:55
    monday = (2026, 3, 2)
    assert not open_at(w, at(*monday, 7, 54, 59))
    assert open_at(w, at(*monday, 7, 55))
    assert open_at(w, at(*monday, 17, 59, 59))
    assert not open_at(w, at(*monday, 18, 0))
    assert not open_at(w, at(2026, 3, 1, 12))  # a Sunday
    # The same instants in another zone read the same.
    assert open_at(w, at(*monday, 7, 55).astimezone(UTC))
    assert not open_at(w, at(*monday, 18, 0).astimezone(UTC))


def test_open_at_past_midnight_is_the_day_it_started() -> None:
    w = window(days=["fri"], start="22:00", end="02:00", prewarm_s=0)
    friday, saturday = (2026, 3, 6), (2026, 3, 7)
    assert open_at(w, at(*friday, 23, 0))
    assert open_at(w, at(*saturday, 1, 59))
    assert not open_at(w, at(*saturday, 2, 0))
    assert not open_at(w, at(*saturday, 23, 0))  # Saturday has no window of its own


def test_open_at_a_prewarm_that_began_the_day_before() -> None:
    w = window(days=["mon"], start="00:10", end="06:00", prewarm_s=15 * 60)
    assert open_at(w, at(2026, 3, 1, 23, 55))  # Sunday evening: Monday's prewarm
    assert not open_at(w, at(2026, 3, 1, 23, 54))


def test_open_at_is_wall_clock_across_a_dst_change() -> None:
    # Berlin springs forward on 2026-03-29 (a Sunday) at 02:00 to 03:00. A Sunday window
    # 01:00-05:00 is then 3 real hours long, and 05:00 is 03:00 UTC, not 04:00.
    w = window(days=["sun"], start="01:00", end="05:00", prewarm_s=0)
    assert open_at(w, datetime(2026, 3, 29, 2, 59, tzinfo=UTC))
    assert not open_at(w, datetime(2026, 3, 29, 3, 0, tzinfo=UTC))


# -- the window workflow's input ------------------------------------------------------------


def test_the_input_asks_the_deployment_to_open_or_close_by_name() -> None:
    w = window()
    d = DeploymentId("d-1")
    opening = WindowInput.of(w, deployment_id=d, workflow_id="deployment/d-1", edge="open")
    closing = WindowInput.of(w, deployment_id=d, workflow_id="deployment/d-1", edge="close")
    assert opening.request == SetWindowRequest(window=w.bounds)
    assert closing.request == SetWindowRequest(closing="day")
    assert opening.summary().startswith("open window day of d-1: min 2, max 4 (day: mon,")
    assert "Europe/Berlin" in closing.summary()


def test_schedule_ids_are_under_the_deployments_prefix() -> None:
    d = DeploymentId("d-1")
    assert window_schedule_id(d, "day", "open") == "window/d-1/day/open"
    assert window_schedule_id(d, "day", "close").startswith(window_schedules_prefix(d))
    # Another deployment's prefix never covers these (d-1 vs d-10).
    assert not window_schedule_id(DeploymentId("d-10"), "day", "open").startswith(
        window_schedules_prefix(d))
