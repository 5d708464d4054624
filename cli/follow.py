"""What the CLI does after a command's answer: ``events --follow`` streams the audit log
live (GET /events/stream), and ``--wait`` stays until the work the command started ends
(:mod:`modelkeeper.domain.waiting` judges when, and how), printing the events of it as
they come.

Progress goes to a terminal as a live status line (``rich``) with the events printed
above it; to anything else (a pipe, a file, a test) as plain lines, a status line only
when it changes. ``--json`` prints JSON lines: each event, then the outcome.

Exit codes: 0 when the work succeeded; 1 (``WaitFailed``) when it failed, rolled back,
was parked, could not be placed, or ``--timeout`` passed, with one line saying which;
130 when Ctrl-C stopped the wait (the work goes on); ``events --follow`` ended by Ctrl-C
exits 0, which is how it is meant to end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from modelkeeper.domain.units import format_duration
from modelkeeper.domain.waiting import (
    Goal,
    Outcome,
    Waiting,
    judge_deployment,
    judge_operation,
)

from .operator_cli import API_TIMEOUT_S, ApiError, Out, event_line

#: How often a wait reads the deployment or operation when no event arrives: events
#: wake it at once, so this only bounds how late an end without an event is seen.
POLL_S = 1.0
#: A live stream that drops (the API restarting) is opened again after this long, resuming
#: after the last event it printed.
RECONNECT_S = 1.0
#: A stream silent this long is taken as dropped and opened again: three of the API's
#: 15 s heartbeats missed (an API gone without closing the connection sends nothing).
STREAM_READ_TIMEOUT_S = 45.0
#: Exit code of a wait stopped by Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED = 130

#: Commands whose work goes on after the answer, and what their ``--wait`` waits for.
WAIT_GOALS: dict[str, Goal] = {
    "deploy": Goal.READY, "scale": Goal.READY, "retry": Goal.READY, "wake": Goal.READY,
    "sleep": Goal.ASLEEP, "rm": Goal.GONE,
    "restart": Goal.OPERATION, "switch": Goal.OPERATION, "reconfigure": Goal.OPERATION,
    "drain": Goal.OPERATION,
}


class WaitFailed(Exception):
    """The work a command started did not succeed, or not in time; exit 1."""

    exit_code = 1


# ----------------------------------------------------------------------------------------
# Server-sent events


@dataclass
class SseParser:
    """Lines of a text/event-stream in, messages out (the fields of each: id, event,
    data), as the HTML spec reads them: ``data`` lines joined, comments skipped."""

    _fields: dict[str, str] = field(default_factory=dict)
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> dict[str, str] | None:
        """The message ``line`` completes (a blank line ends one), else None."""
        if line == "":
            if not self._data and not self._fields:
                return None
            message = {**self._fields, "data": "\n".join(self._data)}
            self._fields, self._data = {}, []
            return message
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name in ("id", "event", "retry"):
            self._fields[name] = value
        return None


async def stream_events(http: httpx.AsyncClient, params: dict[str, str], *,
                        after: int | None) -> AsyncIterator[dict[str, Any]]:
    """The entries of GET /events/stream, each as GET /events has it, for as long as the
    stream lasts. A refusal (401, 422, 503) is an ``ApiError`` with the API's sentence."""
    headers = {} if after is None else {"Last-Event-ID": str(after)}
    timeout = httpx.Timeout(API_TIMEOUT_S, read=STREAM_READ_TIMEOUT_S)
    async with http.stream("GET", "/events/stream", params=params, headers=headers,
                           timeout=timeout) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise ApiError(f"GET /events/stream answered {resp.status_code}: "
                           f"{_detail(resp)}")
        parser = SseParser()
        async for line in resp.aiter_lines():
            message = parser.feed(line)
            if message is not None and "id" in message:
                yield json.loads(message["data"])


def _detail(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("detail", resp.text))
    except ValueError:
        return resp.text


# ----------------------------------------------------------------------------------------
# Rendering


def deployment_line(deployment: dict[str, Any] | None) -> str:
    """What a deployment's wait shows as its status."""
    if deployment is None:
        return "gone"
    line = (f"{deployment['model_id']}: {deployment['status']}, "
            f"{deployment['ready_replicas']}/{deployment['desired_replicas']} ready")
    moving = [f"{r['replica_id']} {r['state']}" for r in deployment.get("replicas", [])
              if r["state"] != "ready"]
    return line + (f" ({', '.join(moving)})" if moving else "")


def operation_line(operation: dict[str, Any]) -> str:
    """What a saga's wait shows as its status: its state and its latest step."""
    line = f"{operation['operation_id']}: {operation['state']}"
    steps = operation.get("steps") or []
    if steps:
        step = steps[-1]
        line += f", step {len(steps)} {step['name']} {step['state']}"
        if step.get("detail"):
            line += f": {step['detail']}"
    return line


class Progress(Protocol):
    """Where a follow or a wait reports: each event, the status as it changes, the end."""

    def event(self, event: dict[str, Any]) -> None: ...

    def status(self, line: str) -> None: ...

    def note(self, line: str) -> None: ...

    def close(self) -> None: ...


class PlainProgress:
    """Plain lines: each event, and the status each time it changes (``--json``: JSON
    lines, the status left out)."""

    def __init__(self, out: Out, *, as_json: bool = False,
                 flush: Callable[[], None] = sys.stdout.flush) -> None:
        self._out = out
        self._json = as_json
        #: Each line leaves at once: a pipe's reader (grep, a log shipper) sees it live,
        #: not when a block buffer fills.
        self._flush = flush
        self._last_status: str | None = None

    def event(self, event: dict[str, Any]) -> None:
        self._out(json.dumps(event, default=str) if self._json else event_line(event))
        self._flush()

    def status(self, line: str) -> None:
        if not self._json and line != self._last_status:
            self._out(f"... {line}")
            self._flush()
        self._last_status = line

    def note(self, line: str) -> None:
        if not self._json:
            self._out(line)
            self._flush()

    def close(self) -> None:
        pass


class LiveProgress:
    """A terminal: a spinner and the status on one line that updates in place, with the
    elapsed time; events printed above it."""

    def __init__(self, console: Console, *, started_at: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._console = console
        self._started_at = started_at
        self._clock = clock
        self._status = "waiting"
        self._spinner = Spinner("dots", text=self._status)
        self._live = Live(self._spinner, console=console, transient=True,
                          refresh_per_second=8)
        self._live.start()

    def event(self, event: dict[str, Any]) -> None:
        self._console.print(event_line(event), markup=False, highlight=False,
                            soft_wrap=True)

    def status(self, line: str) -> None:
        self._status = line
        elapsed = format_duration(round(self._clock() - self._started_at))
        self._spinner.update(text=f"{line}  [{elapsed}]")
        self._live.refresh()

    def note(self, line: str) -> None:
        self._console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._live.stop()


def make_progress(out: Out, *, as_json: bool, started_at: float,
                  terminal: bool | None = None) -> Progress:
    """Live on a terminal (unless ``--json``), plain lines otherwise."""
    if terminal is None:
        terminal = sys.stdout.isatty()
    if terminal and not as_json:
        return LiveProgress(Console(), started_at=started_at)
    return PlainProgress(out, as_json=as_json)


# ----------------------------------------------------------------------------------------
# Following and waiting


@dataclass(frozen=True)
class Connection:
    """How to reach the API: its URL, the headers (the token) and, for tests, a
    transport."""

    base_url: str
    headers: dict[str, str]
    transport: httpx.AsyncBaseTransport | None = None

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                 timeout=API_TIMEOUT_S, transport=self.transport)


def stream_params(args: argparse.Namespace) -> dict[str, str]:
    """``events``' filters as the stream's query."""
    return {name: value for name in ("deployment", "node", "kind")
            if (value := getattr(args, name, None)) is not None}


async def follow(connection: Connection, params: dict[str, str], progress: Progress, *,
                 after: int | None) -> None:
    """Print each entry as it comes, for ever (until cancelled); a dropped stream is
    opened again, resuming after the last entry printed. A refusal is an ``ApiError``."""
    last = after
    async with connection.client() as http:
        while True:
            try:
                async for event in stream_events(http, params, after=last):
                    progress.event(event)
                    last = int(event["event_id"])
            except httpx.HTTPError as exc:
                progress.note(f"(the event stream dropped: {exc or type(exc).__name__}; "
                              "reconnecting)")
            await asyncio.sleep(RECONNECT_S)


def run_follow(connection: Connection, args: argparse.Namespace, out: Out, *,
               after: int | None) -> int:
    """``events --follow``: live until Ctrl-C, which exits 0."""
    progress = make_progress(out, as_json=args.json, started_at=time.monotonic(),
                             terminal=False)
    try:
        asyncio.run(follow(connection, stream_params(args), progress, after=after))
    except KeyboardInterrupt:
        return 0
    finally:
        progress.close()
    return 0


@dataclass(frozen=True)
class Target:
    """What a wait watches: a deployment or an operation, and the stream's filter."""

    waiting: Waiting
    deployment_id: str | None = None
    operation_id: str | None = None
    #: The stream's query: the deployment's events, or a drained node's.
    params: dict[str, str] = field(default_factory=dict)

    @property
    def what(self) -> str:
        return self.operation_id or f"deployment {self.deployment_id}"


def wait_target(args: argparse.Namespace, result: dict[str, Any], *,
                started_at: float) -> Target:
    """What ``--wait`` of ``args.command`` watches, from the command's answer."""
    goal = WAIT_GOALS[args.command]
    if goal is Goal.OPERATION:
        scope = ({"deployment": result["deployment_id"]} if result.get("deployment_id")
                 else {"node": result["node_id"]})
        return Target(Waiting(goal, started_at), operation_id=result["operation_id"],
                      params=scope)
    return Target(Waiting(goal, started_at, first_status=result.get("status"),
                          replica_id=getattr(args, "replica", None)),
                  deployment_id=result["deployment_id"],
                  params={"deployment": result["deployment_id"]})


async def _read(http: httpx.AsyncClient, path: str) -> dict[str, Any] | None:
    """GET ``path``: its JSON, None for a 404; an ``ApiError`` for anything else."""
    try:
        resp = await http.get(path)
    except httpx.HTTPError as exc:
        raise ApiError(f"cannot reach the API at {http.base_url}: {exc}") from exc
    if resp.status_code == 404:
        return None
    if resp.status_code != 200:
        raise ApiError(f"GET {path} answered {resp.status_code}: {_detail(resp)}")
    answer: dict[str, Any] = resp.json()
    return answer


async def wait(connection: Connection, target: Target, progress: Progress, *,
               after: int | None, timeout_s: float,
               clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Watch ``target`` until it ends or ``timeout_s`` passes, printing its events as
    they come; how it ended. Each event wakes a read at once; without events it reads
    every :data:`POLL_S`."""
    poke = asyncio.Event()
    waiting = target.waiting

    async def printed() -> None:
        with contextlib.suppress(ApiError):  # no stream: the reads still see the end
            async with connection.client() as events:
                async for event in stream_events(events, target.params, after=after):
                    progress.event(event)
                    poke.set()

    stream = asyncio.create_task(printed())
    status = "waiting"
    try:
        async with connection.client() as http, asyncio.timeout(timeout_s):
            while True:
                poke.clear()
                outcome: Outcome | None = None
                try:
                    if target.operation_id is not None:
                        operation = await _read(http, f"/operations/{target.operation_id}")
                        if operation is None:
                            return Outcome(False, f"{target.operation_id} is not known to "
                                                  "the API")
                        status = operation_line(operation)
                        outcome = judge_operation(operation)
                    else:
                        deployment = await _read(http,
                                                 f"/deployments/{target.deployment_id}")
                        if deployment is not None:
                            waiting = waiting.seen(deployment["status"])
                        status = deployment_line(deployment)
                        outcome = judge_deployment(waiting, deployment, now=clock())
                except ApiError as exc:
                    # An API restarting is no end of the work: read again until the timeout.
                    progress.note(f"(no answer from the API: {exc}; retrying)")
                progress.status(status)
                if outcome is not None:
                    return outcome
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(poke.wait(), POLL_S)
    except TimeoutError:
        return Outcome(False, f"timed out after {format_duration(timeout_s)} "
                              f"(--timeout): {status}")
    finally:
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await stream


def last_event_id(http: httpx.Client) -> int:
    """The newest entry's id (0: none), read before a command is sent, so that its wait
    prints every event the command caused. A failure to read it is no reason to fail the
    command: the wait then prints only what comes after it starts (None)."""
    try:
        resp = http.get("/events", params={"limit": "1"})
        entries = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        entries = None
    if not entries:
        return 0
    return int(entries[-1]["event_id"])


def run_wait(connection: Connection, args: argparse.Namespace, result: Any, out: Out, *,
             after: int | None) -> int:
    """``--wait``: 0 when the work succeeded; ``WaitFailed`` (exit 1) with why when it
    did not; 130 on Ctrl-C."""
    started_at = time.monotonic()
    target = wait_target(args, result, started_at=started_at)
    progress = make_progress(out, as_json=args.json, started_at=started_at)
    try:
        outcome = asyncio.run(wait(connection, target, progress, after=after,
                                   timeout_s=args.timeout))
    except KeyboardInterrupt:
        progress.close()
        sys.stderr.write(f"stopped waiting; {target.what} goes on ("
                         + (f"modelkeeper operations show {target.operation_id}"
                            if target.operation_id else "modelkeeper ls") + ")\n")
        return INTERRUPTED
    progress.close()
    took = format_duration(round(time.monotonic() - started_at))
    if args.json:
        out(json.dumps({"waited_for": target.what, "ok": outcome.ok,
                        "reason": outcome.reason}))
    if not outcome.ok:
        raise WaitFailed(f"{target.what}: {outcome.reason}")
    if not args.json:
        out(f"done in {took}: {outcome.reason}")
    return 0


class FollowUp:
    """The CLI's :class:`~cli.operator_cli.Afterwards`: ``events --follow`` and
    ``--wait``."""

    def wanted(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "wait", False) or getattr(args, "follow", False))

    def mark(self, args: argparse.Namespace, http: httpx.Client) -> int | None:
        return last_event_id(http) if getattr(args, "wait", False) else None

    def run(self, args: argparse.Namespace, result: Any, *, base_url: str,
            headers: dict[str, str], mark: int | None, out: Out) -> int:
        connection = Connection(base_url, headers)
        if args.command == "events":
            # Resume after the newest entry shown: none is missed, none shown twice.
            after = int(result[-1]["event_id"]) if result else 0
            return run_follow(connection, args, out, after=after)
        return run_wait(connection, args, result, out, after=mark)
