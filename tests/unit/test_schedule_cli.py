"""`modelkeeper schedule add / ls / rm`: the requests it builds, how it shows windows, and
its mistakes (exit 2, one sentence, before any request). No server: httpx.MockTransport
answers, with the API's shapes (api/windows.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from cli.main import build_parser
from cli.operator_cli import (
    OPERATOR_COMMANDS,
    Request,
    UsageError,
    parse_days,
    parse_prewarm,
    render,
    run_operator_command,
)
from tests.unit.test_operator_cli import DEPLOYMENTS, exit_of, unreachable

pytestmark = pytest.mark.timeout(10)

API = "http://api.test"
ADD = ["schedule", "add", "big", "--name", "day", "--days", "mon-fri", "--start", "08:00",
       "--end", "18:00", "--tz", "Europe/Berlin", "--min", "2", "--max", "4", "--prewarm",
       "5m"]
WINDOW = {"name": "day", "days": ["mon", "tue", "wed", "thu", "fri"], "start": "08:00",
          "end": "18:00", "timezone": "Europe/Berlin", "min_replicas": 2, "max_replicas": 4,
          "prewarm_s": 300}
VIEW = {"deployment_id": "d1", "window": WINDOW, "open_schedule_id": "window/d1/day/open",
        "close_schedule_id": "window/d1/day/close", "open_now": False,
        "next_open": "2026-03-02T06:55:00Z", "next_close": "2026-03-02T17:00:00Z"}


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def request_for(argv: list[str]) -> Request:
    """The request the command sends once ``big`` is found to be deployment d1."""
    first = OPERATOR_COMMANDS["schedule"].request(parse(*argv))
    assert (first.method, first.path) == ("GET", "/deployments")
    assert first.then is not None
    follow = first.then(DEPLOYMENTS)
    assert isinstance(follow, Request)
    return follow


def test_add_sends_the_window_with_days_and_prewarm_parsed() -> None:
    sent = request_for(ADD)
    assert (sent.method, sent.path, sent.body) == ("POST", "/deployments/d1/windows", WINDOW)


def test_ls_and_rm_by_deployment_id_or_model() -> None:
    assert request_for(["schedule", "ls", "big"]) == Request("GET", "/deployments/d1/windows")
    rm = request_for(["schedule", "rm", "d1", "day"])
    assert (rm.method, rm.path) == ("DELETE", "/deployments/d1/windows/day")
    assert rm.then is not None
    assert rm.then(None) == {"deployment_id": "d1", "name": "day", "removed": True}


@pytest.mark.parametrize(("value", "days"), [
    ("mon-fri", ["mon", "tue", "wed", "thu", "fri"]),
    ("sat-sun", ["sat", "sun"]),
    ("fri-mon", ["mon", "fri", "sat", "sun"]),
    ("mon,wed, fri", ["mon", "wed", "fri"]),
    ("Sun", ["sun"]),
    ("mon-sun,tue", ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]),
])
def test_days_read_lists_and_ranges_that_may_wrap(value: str, days: list[str]) -> None:
    assert parse_days(value) == days


@pytest.mark.parametrize(("value", "seconds"), [("300", 300), ("90s", 90), ("5m", 300),
                                                ("1h", 3600), ("0", 0)])
def test_prewarm_reads_seconds_minutes_and_hours(value: str, seconds: int) -> None:
    assert parse_prewarm(value) == seconds


@pytest.mark.parametrize("value", ["5x", "m", "-5m", "1.5h", ""])
def test_a_bad_prewarm_names_the_flag(value: str) -> None:
    with pytest.raises(UsageError, match="--prewarm"):
        parse_prewarm(value)


def test_ls_shows_each_window_with_when_it_opens_and_closes_next() -> None:
    shown = render(parse("schedule", "ls", "big"), [VIEW]).splitlines()
    assert shown[0].split()[:8] == ["NAME", "DAYS", "HOURS", "TIMEZONE", "MIN", "MAX",
                                    "PREWARM", "NOW"]
    assert shown[1].split() == ["day", "mon,tue,wed,thu,fri", "08:00-18:00", "Europe/Berlin",
                                "2", "4", "300s", "closed", "2026-03-02", "06:55Z",
                                "2026-03-02", "17:00Z"]
    assert json.loads(render(parse("schedule", "ls", "big", "--json"), [VIEW])) == [VIEW]


def test_add_and_rm_say_what_they_did() -> None:
    added = render(parse(*ADD), {**VIEW, "open_now": True})
    assert added.splitlines()[0] == "window day added to d1 (inside it now: opened at once)"
    assert render(parse("schedule", "rm", "d1", "day"),
                  {"deployment_id": "d1", "name": "day", "removed": True}) == \
        "window day removed from d1"


def test_the_requests_reach_the_api() -> None:
    seen: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path,
                     json.loads(request.content) if request.content else None))
        if request.url.path == "/deployments":
            return httpx.Response(200, json=DEPLOYMENTS)
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(201, json=VIEW)

    lines: list[str] = []
    for argv in (ADD, ["schedule", "rm", "big", "day"]):
        assert run_operator_command(parse(*argv), API, lines.append,
                                    transport=httpx.MockTransport(handler)) == 0
    assert [s for s in seen if s[1] != "/deployments"] == [
        ("POST", "/deployments/d1/windows", WINDOW),
        ("DELETE", "/deployments/d1/windows/day", None)]
    assert lines[-1] == "window day removed from d1"


@pytest.mark.parametrize(("argv", "words"), [
    (["schedule", "add", "big", "--name", "day"],
     ["schedule add 'big'", "--days, --start, --end, --tz, --min, --max are required"]),
    ([*ADD[:6], "mon-funday", *ADD[7:]], ["--days 'mon-funday'", "'mon-funday'", "mon..sun"]),
    ([*ADD[:-1], "5 minutes"], ["--prewarm '5 minutes'", "5m"]),
    (["schedule", "rm", "big"], ["schedule rm", "NAME", "schedule ls"]),
])
def test_a_mistake_exits_2_with_one_sentence_before_any_request(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, lines = exit_of(argv, capsys, unreachable, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("modelkeeper schedule: ")
    assert all(w in lines[0] for w in words), lines[0]


def test_an_api_refusal_exits_2_with_its_sentence(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/deployments":
            return httpx.Response(200, json=DEPLOYMENTS)
        return httpx.Response(422, json={"detail": [{
            "loc": ["body", "timezone"], "msg": "Value error, 'Berlin' is not an IANA time "
            "zone name", "input": "Berlin"}]})

    code, lines = exit_of([*ADD[:12], "Berlin", *ADD[13:]], capsys, handler, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert "timezone: Value error, 'Berlin' is not an IANA time zone name" in lines[0]

