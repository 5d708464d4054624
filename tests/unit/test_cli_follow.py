"""`modelkeeper events` and ``--wait`` (cli/follow.py) without a server: the SSE parser,
the event lines, the flags, the progress on a terminal and off one, and a wait that ends
in success, a rollback and a timeout against httpx.MockTransport."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import httpx
import pytest
from rich.console import Console

from cli.follow import (
    WAIT_GOALS,
    Connection,
    LiveProgress,
    PlainProgress,
    SseParser,
    Target,
    make_progress,
    wait,
    wait_target,
)
from cli.main import build_parser
from cli.main import run as cli_run
from cli.operator_cli import (
    COMMANDS,
    OPERATOR_COMMANDS,
    Request,
    UsageError,
    event_line,
    render,
)
from modelkeeper.domain.waiting import Goal, Outcome, Waiting

pytestmark = pytest.mark.timeout(20)

EVENT: dict[str, Any] = {
    "event_id": 7, "at": "2026-12-04T18:00:01.123456Z", "kind": "replica.ready",
    "message": "r-1 of sim-1g is ready on vm", "deployment_id": "d-1", "node_id": "n-vm",
    "replica_id": "r-1", "data": {}, "actor": None}


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def test_the_sse_parser_reads_messages_and_skips_comments() -> None:
    parser = SseParser()
    lines = ["retry: 3000", "", ": keepalive", "", "id: 7", "event: replica.ready",
             "data: {\"a\":", "data: 1}", ""]
    messages = [m for m in map(parser.feed, lines) if m is not None]
    assert messages == [{"retry": "3000", "data": ""},
                        {"id": "7", "event": "replica.ready", "data": "{\"a\":\n1}"}]


def test_an_event_line_has_time_kind_where_and_message() -> None:
    assert event_line(EVENT) == (
        "2026-12-04 18:00:01Z  replica.ready            d-1/n-vm/r-1         "
        "r-1 of sim-1g is ready on vm")
    assert "  -  " in event_line({**EVENT, "deployment_id": None, "node_id": None,
                                  "replica_id": None})


def test_events_asks_for_the_filters_given_and_bounds_the_limit() -> None:
    request = OPERATOR_COMMANDS["events"].request(
        parse("events", "--deployment", "sim-1g", "--node", "vm", "--kind", "replica."))
    assert request == Request("GET", "/events", params={
        "deployment": "sim-1g", "node": "vm", "kind": "replica."})
    follow = OPERATOR_COMMANDS["events"].request(parse("events", "--follow"))
    assert follow.params == {"limit": "10"}
    with pytest.raises(UsageError, match="--limit 0: must be 1 to 10,000"):
        OPERATOR_COMMANDS["events"].request(parse("events", "--limit", "0"))


def test_events_prints_lines_or_json_lines() -> None:
    assert render(parse("events"), [EVENT, EVENT]).splitlines() == [event_line(EVENT)] * 2
    assert render(parse("events"), []) == "(no events)"
    lines = render(parse("events", "--json"), [EVENT, EVENT]).splitlines()
    assert [json.loads(line) for line in lines] == [EVENT, EVENT]


def test_every_command_that_starts_work_takes_wait_and_timeout() -> None:
    assert {c.name for c in COMMANDS if c.waits} == set(WAIT_GOALS)
    args = parse("restart", "sim-1g", "--wait", "--timeout", "2m")
    assert (args.wait, args.timeout) == (True, 120.0)
    assert parse("restart", "sim-1g").wait is False
    with pytest.raises(SystemExit) as refused:
        parse("restart", "sim-1g", "--wait", "--timeout", "0")
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        parse("ls", "--wait")  # ls starts nothing


def test_a_wait_watches_the_operation_or_the_deployment_the_answer_names() -> None:
    started = {"operation_id": "restart/d-1/1", "deployment_id": "d-1", "node_id": None,
               "state": "running"}
    target = wait_target(parse("restart", "x"), started, started_at=5.0)
    assert (target.operation_id, target.params) == ("restart/d-1/1", {"deployment": "d-1"})
    drain = wait_target(parse("drain", "vm"), {**started, "operation_id": "drain/n-vm/1",
                                               "deployment_id": None, "node_id": "n-vm"},
                        started_at=5.0)
    assert drain.params == {"node": "n-vm"}
    retry = wait_target(parse("retry", "x"), {"deployment_id": "d-1", "status": "parked"},
                        started_at=5.0)
    assert retry.waiting == Waiting(Goal.READY, 5.0, first_status="parked")
    wake = wait_target(parse("wake", "x", "--replica", "r-2"),
                       {"deployment_id": "d-1", "status": "serving"}, started_at=5.0)
    assert wake.waiting.replica_id == "r-2"


# --- Progress ----------------------------------------------------------------------------


def test_plain_progress_prints_each_event_and_a_status_only_when_it_changes() -> None:
    lines: list[str] = []
    progress = PlainProgress(lines.append)
    progress.status("sim-1g: placing, 0/1 ready")
    progress.status("sim-1g: placing, 0/1 ready")
    progress.event(EVENT)
    progress.status("sim-1g: serving, 1/1 ready")
    assert lines == ["... sim-1g: placing, 0/1 ready", event_line(EVENT),
                     "... sim-1g: serving, 1/1 ready"]
    quiet: list[str] = []
    as_json = PlainProgress(quiet.append, as_json=True)
    as_json.status("x")
    as_json.event(EVENT)
    assert [json.loads(line) for line in quiet] == [EVENT]


def test_off_a_terminal_the_progress_is_plain_lines() -> None:
    assert isinstance(make_progress(print, as_json=False, started_at=0.0, terminal=False),
                      PlainProgress)
    assert isinstance(make_progress(print, as_json=True, started_at=0.0, terminal=True),
                      PlainProgress)


def test_on_a_terminal_the_status_is_one_live_line_with_events_above_it() -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120, color_system=None)
    now = [100.0]
    progress = LiveProgress(console, started_at=100.0, clock=lambda: now[0])
    progress.status("sim-1g: starting, 0/1 ready")
    now[0] = 112.0
    progress.event(EVENT)
    progress.status("sim-1g: serving, 1/1 ready")
    progress.close()
    shown = screen.getvalue()
    assert event_line(EVENT) in shown
    assert "sim-1g: serving, 1/1 ready  [12s]" in shown
    # The status line is redrawn in place (cursor control), and gone once closed.
    assert "\x1b[" in shown
    assert shown.rstrip("\n").endswith("\x1b[2K")  # the last thing done: erase the line


# --- A wait against a mock API ----------------------------------------------------------


def _api(operations: list[dict[str, Any]]) -> httpx.MockTransport:
    """GET /operations/X answers each of ``operations`` in turn (the last for ever); the
    event stream is refused, as by an API at its cap: the reads still see the end."""
    answers = iter(operations)
    last: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/events/stream":
            return httpx.Response(503, json={"detail": "too many streams"})
        assert request.url.path == "/operations/switch/d-1/1"
        last[:] = [next(answers, last[0] if last else operations[-1])]
        return httpx.Response(200, json=last[0])
    return httpx.MockTransport(handle)


def _operation(state: str, error: str | None = None) -> dict[str, Any]:
    return {"operation_id": "switch/d-1/1", "state": state, "error": error, "steps": [
        {"name": "surge r-2", "state": "failed" if error else "done", "detail": ""}]}


def _target() -> Target:
    return Target(Waiting(Goal.OPERATION, 0.0), operation_id="switch/d-1/1",
                  params={"deployment": "d-1"})


@pytest.mark.parametrize(("answers", "outcome"), [
    ([_operation("running"), _operation("succeeded")],
     Outcome(True, "switch/d-1/1 succeeded")),
    ([_operation("running"), _operation("rolled_back", "r-2 failed to start: exit 1")],
     Outcome(False, "switch/d-1/1 rolled_back: r-2 failed to start: exit 1")),
])
async def test_a_wait_ends_with_the_operations_outcome(
        answers: list[dict[str, Any]], outcome: Outcome, monkeypatch: pytest.MonkeyPatch,
        ) -> None:
    monkeypatch.setattr("cli.follow.POLL_S", 0.01)
    lines: list[str] = []
    got = await wait(Connection("http://api.test", {}, transport=_api(answers)), _target(),
                     PlainProgress(lines.append), after=0, timeout_s=5)
    assert got == outcome
    assert lines[0] == "... switch/d-1/1: running, step 1 surge r-2 done"


async def test_a_wait_that_outlasts_its_timeout_fails_saying_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cli.follow.POLL_S", 0.01)
    got = await asyncio.wait_for(wait(
        Connection("http://api.test", {}, transport=_api([_operation("running")])),
        _target(), PlainProgress(lambda _: None), after=0, timeout_s=0.2), 5)
    assert not got.ok
    assert got.reason.startswith("timed out after 0.2s (--timeout): switch/d-1/1: running")


def test_a_failed_wait_exits_1_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Through `modelkeeper switch --wait`: the answer, the progress, then exit 1 and the
    reason on stderr, no traceback."""
    monkeypatch.setattr("cli.follow.POLL_S", 0.01)
    waited = _api([_operation("running"), _operation("rolled_back", "r-2 exit 1")])
    started = {"operation_id": "switch/d-1/1", "deployment_id": "d-1", "node_id": None,
               "summary": "switch sim-1g to sim-bad", "state": "running"}

    def command(request: httpx.Request) -> httpx.Response:
        match request.method, request.url.path:
            case "GET", "/events":
                return httpx.Response(200, json=[EVENT])
            case "GET", "/deployments":
                return httpx.Response(200, json=[{"deployment_id": "d-1",
                                                  "model_id": "sim-1g"}])
            case "POST", "/deployments/d-1/switch":
                return httpx.Response(202, json=started)
        raise AssertionError(request)

    real_client = httpx.Client
    monkeypatch.setattr("cli.operator_cli.httpx.Client", lambda **kw: real_client(
        **{**kw, "transport": httpx.MockTransport(command)}))
    monkeypatch.setattr("cli.follow.Connection.client", lambda self: httpx.AsyncClient(
        base_url=self.base_url, transport=waited))
    code = cli_run(["switch", "sim-1g", "sim-bad", "--wait", "--api-url", "http://api.test"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "switch/d-1/1 started" in out
    assert err.strip() == ("modelkeeper switch: switch/d-1/1: switch/d-1/1 rolled_back: "
                           "r-2 exit 1")
    assert "Traceback" not in out + err


async def test_a_wait_reads_again_when_the_api_does_not_answer_for_a_while(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An API restarting mid-wait (a 502 from a proxy, then the answer) is no outcome."""
    monkeypatch.setattr("cli.follow.POLL_S", 0.01)
    answers = iter([httpx.Response(502, text="bad gateway"),
                    httpx.Response(200, json=_operation("succeeded"))])

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/events/stream":
            return httpx.Response(503, json={"detail": "too many streams"})
        return next(answers)

    lines: list[str] = []
    got = await wait(Connection("http://api.test", {}, transport=httpx.MockTransport(handle)),
                     _target(), PlainProgress(lines.append), after=0, timeout_s=5)
    assert got == Outcome(True, "switch/d-1/1 succeeded")
    assert lines[0].startswith("(no answer from the API: GET /operations/switch/d-1/1 "
                               "answered 502"), lines
