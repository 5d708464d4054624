"""The long fuzz of the control API: schemathesis, every check and every phase including
stateful (:mod:`bench.fuzz.schema`, the suite's configuration), cycled for ``--minutes``
with a ``--seed`` the suite does not use (its own is 11), as an ``--role``:

* ``admin``: the whole API; the acceptance is 0 responses of 5xx and every status
  documented (no failure of any check);
* ``viewer`` or ``none``: the same, and nothing may change: every table of the store is
  read before and after and must be the same.

Run it from the repository root::

    .venv/bin/python -m bench.fuzz.run --seed 101 --minutes 10 --role admin
    .venv/bin/python -m bench.fuzz.run --live --minutes 10

By default the API runs in this process (served as `modelkeeper api` serves it,
``api.server.served``) on an embedded PostgreSQL and the Temporal dev server, with the
control worker, on free ports under a temporary folder. With a viewer or no token the API
is given a join token the fuzzer does not have: without one, any process on loopback may
register a node, by design (`up`'s default, docs/security.md), and that is the
registration door, not what a viewer token can do.

``--live`` fuzzes a whole `modelkeeper up` stack instead (a temporary data dir, free
ports, the demo on: SmolLM2-135M on llama.cpp), once with a viewer token and once with
none (``--minutes`` each), then checks that the fuzz could not take over the local node
or the demo: the node is still registered and its agent still heartbeats with its own
credential (its ``last_seen`` moves on after the fuzz), and the demo deployment still
exists and answers a chat completion through the gateway.

Each run appends a section to ``--out``.md (bench/results/fuzz.md) and an entry to
``--out``.json: the command, the commit, cases, responses by status, failures by check.
``--smoke`` marks a short run that shows the runner works, not a result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from api.app import create_app
from api.server import served
from bench.common import ROOT, code_version, interrupt_on_sigterm
from bench.fleet.stack import NAMESPACE, start_database_and_temporal
from bench.fuzz.schema import Report, fuzz
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from worker.main import run_worker

#: Examples per operation and phase in one cycle; with --minutes the phases are cycled
#: until the time is spent, so this sets how often each phase comes round, not the total.
MAX_EXAMPLES = 50
#: Steps of one stateful scenario: long enough for create, deploy, scale, drain, delete.
STATEFUL_MAX_STEPS = 20
ROLES = ("admin", "viewer", "none")
DEFAULT_OUT = ROOT / "bench" / "results" / "fuzz"
SECRET = "fuzz-bench-secret"
#: A join token the fuzzer is never given (see the module docstring).
JOIN_TOKEN = "fuzz-bench-join-token-not-given-to-the-fuzzer"
#: How long `up` may take to print its banner: PostgreSQL, Temporal, the API, the worker,
#: the gateway and the agent start, and the demo model loads (a minute on 2 cores).
UP_READY_TIMEOUT_S = 300.0
#: How long after the fuzz the local node's agent must have heartbeated: its interval is
#: 5 s by default, so three of them.
HEARTBEAT_WITHIN_S = 15.0
#: The demo's answer through the gateway: llama.cpp on CPU, a few tokens.
COMPLETION_TIMEOUT_S = 60.0


@dataclass
class Run:
    """One fuzz run's outcome, as written to the results."""

    label: str
    command: str
    seed: int
    minutes: float
    role: str
    report: Report
    smoke: bool
    #: Tables whose rows differ after a run that may change nothing; None when not read.
    changed_tables: list[str] | None = None
    #: What the live checks found, each a line; empty when all held.
    live_problems: list[str] = field(default_factory=list)
    live_checks: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (self.report.server_errors == 0 and not self.report.failures
                and not self.report.errors and not self.changed_tables
                and not self.live_problems)


# -- the store, read whole --------------------------------------------------------------


async def snapshot(database_url: str) -> dict[str, list[str]]:
    """Every row of every table in the public schema, as sorted text."""
    conn = await asyncpg.connect(database_url)
    try:
        tables = [row["table_name"] for row in await conn.fetch(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1")]
        return {table: sorted(repr(tuple(row)) for row in
                              await conn.fetch(f'SELECT * FROM "{table}"'))
                for table in tables}
    finally:
        await conn.close()


def changed(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    return sorted(table for table in before.keys() | after.keys()
                  if before.get(table) != after.get(table))


# -- in process -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def in_process_api(root: Path, *, open_registration: bool,
                         ) -> AsyncIterator[tuple[str, Store, str]]:
    """The API served over HTTP with the control worker, on a database and Temporal of
    its own under ``root``: its URL, its store and the database's URL."""
    started: list[ManagedProcess] = []
    try:
        database_url, temporal_address = await start_database_and_temporal(root, started)
        settings = Settings(
            database_url=database_url, temporal_address=temporal_address,
            temporal_namespace=NAMESPACE, engine_key_secret=SECRET, settling_window_s=0,
            api_port=free_port(), join_token=None if open_registration else JOIN_TOKEN)
        app = create_app(settings)
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(settings, stop))
        try:
            async with served(app, settings) as url:
                yield url, app.state.store, database_url
        finally:
            stop.set()
            await worker
    finally:
        for process in reversed(started):
            process.stop()


async def fuzz_in_process(args: argparse.Namespace, command: str) -> Run:
    with tempfile.TemporaryDirectory(prefix="modelkeeper-fuzz-") as folder:
        async with in_process_api(Path(folder),
                                  open_registration=args.role == "admin") as (url, store, db):
            token = None
            if args.role != "none":
                role = OperatorRole.ADMIN if args.role == "admin" else OperatorRole.VIEWER
                _, token = await store.tokens.create_token(f"fuzz-{args.role}", role)
            before = await snapshot(db) if args.role != "admin" else None
            report = await asyncio.to_thread(
                fuzz, url, token, seed=args.seed, max_examples=MAX_EXAMPLES,
                stateful_max_steps=STATEFUL_MAX_STEPS, max_time_s=round(args.minutes * 60))
            run = Run(label=f"in process, {args.role}", command=command, seed=args.seed,
                      minutes=args.minutes, role=args.role, report=report, smoke=args.smoke)
            if before is not None:
                run.changed_tables = changed(before, await snapshot(db))
            return run


# -- against `modelkeeper up` -----------------------------------------------------------


class LiveStack:
    """A `modelkeeper up` on free ports with its data under ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.ports = {name: free_port() for name in
                      ("api", "gateway", "postgres", "temporal", "temporal-ui")}
        self.api = f"http://127.0.0.1:{self.ports['api']}"
        self.gateway = f"http://127.0.0.1:{self.ports['gateway']}"
        self.process = ManagedProcess(
            "up", [sys.executable, "-m", "modelkeeper", "up", "--data-dir", str(data_dir),
                   *(arg for name, port in self.ports.items()
                     for arg in (f"--{name}-port", str(port)))],
            data_dir.parent / "up.log")

    def admin(self) -> dict[str, str]:
        token = (self.data_dir / "operator-token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    async def start(self) -> None:
        self.process.start()
        deadline = time.monotonic() + UP_READY_TIMEOUT_S
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"`up` exited; see {self.process.log_path}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"`up` not ready in {UP_READY_TIMEOUT_S:.0f}s; see "
                                       f"{self.process.log_path}")
                with contextlib.suppress(httpx.HTTPError, OSError):
                    if (self.data_dir / "operator-token").exists():
                        deployments = (await http.get(f"{self.api}/deployments",
                                                      headers=self.admin())).json()
                        if any(d.get("ready_replicas") for d in deployments):
                            return
                await asyncio.sleep(1.0)

    def viewer_token(self) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "modelkeeper", "tokens", "create", "fuzz-viewer", "--role",
             "viewer", "--data-dir", str(self.data_dir),
             "--postgres-port", str(self.ports["postgres"])],
            capture_output=True, text=True, check=True).stdout
        return next(word for word in out.split() if word.startswith("mko-"))

    async def state(self) -> dict[str, Any]:
        """The local node and the demo, as an admin sees them."""
        node_id = (self.data_dir / "agent" / "node_id").read_text().strip()
        async with httpx.AsyncClient(base_url=self.api, timeout=10,
                                     headers=self.admin()) as http:
            node = await http.get(f"/nodes/{node_id}")
            deployments = (await http.get("/deployments")).json()
        return {"node_id": node_id, "node": node.json() if node.status_code == 200 else None,
                "deployments": deployments}

    async def check_after(self, before: dict[str, Any], fuzz_ended: datetime,
                          ) -> tuple[list[str], list[str]]:
        """What held and what did not: the node's agent heartbeats on, the demo serves."""
        held: list[str] = []
        problems: list[str] = []
        node_id = before["node_id"]
        deadline = time.monotonic() + HEARTBEAT_WITHIN_S
        while True:
            after = await self.state()
            node = after["node"]
            seen = None if node is None else datetime.fromisoformat(node["last_seen"])
            if (seen is not None and seen > fuzz_ended) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        if node is None:
            problems.append(f"the local node {node_id} is no longer registered")
        elif seen is None or seen <= fuzz_ended:
            problems.append(f"the local node {node_id} has not heartbeated since the fuzz "
                            f"ended (last_seen {node['last_seen']})")
        else:
            held.append(f"node {node_id} ({node['name']}) registered, state "
                        f"{node['state']}, heartbeating with its own credential "
                        f"(last_seen {node['last_seen']}, after the fuzz)")
        demo_ids = {d["deployment_id"] for d in before["deployments"]}
        kept = [d for d in after["deployments"] if d["deployment_id"] in demo_ids]
        if len(kept) != len(demo_ids):
            gone = demo_ids - {d["deployment_id"] for d in kept}
            problems.append(f"deployments gone: {sorted(gone)}")
        for deployment in kept:
            async with httpx.AsyncClient(timeout=COMPLETION_TIMEOUT_S) as http:
                answer = await http.post(f"{self.gateway}/v1/chat/completions", json={
                    "model": deployment["model_id"], "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}]})
            if answer.status_code != 200:
                problems.append(f"{deployment['model_id']} does not serve: "
                                f"{answer.status_code} {answer.text[:200]}")
            else:
                held.append(f"deployment {deployment['deployment_id']} "
                            f"({deployment['model_id']}) exists, status "
                            f"{deployment['status']}, and answers through the gateway")
        registered = {n["node_id"] for n in await self._nodes()}
        if len(registered) > 1:
            held.append(f"nodes registered besides the local one, by the fuzz runs so far "
                        f"(loopback registration is open without a join token, by design): "
                        f"{len(registered) - 1}")
        return held, problems

    async def _nodes(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=self.api, timeout=10,
                                     headers=self.admin()) as http:
            nodes: list[dict[str, Any]] = (await http.get("/nodes")).json()
            return nodes

    def stop(self) -> None:
        self.process.stop(grace=60)


async def fuzz_live(args: argparse.Namespace, command: str) -> list[Run]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="modelkeeper-fuzz-live-") as folder:
        stack = LiveStack(Path(folder) / "data")
        try:
            await stack.start()
            viewer = stack.viewer_token()
            for role, token in (("viewer", viewer), ("none", None)):
                before = await stack.state()
                report = await asyncio.to_thread(
                    fuzz, stack.api, token, seed=args.seed, max_examples=MAX_EXAMPLES,
                    stateful_max_steps=STATEFUL_MAX_STEPS,
                    max_time_s=round(args.minutes * 60))
                ended = datetime.now(UTC)
                run = Run(label=f"live `up`, {role}", command=command, seed=args.seed,
                          minutes=args.minutes, role=role, report=report, smoke=args.smoke)
                run.live_checks, run.live_problems = await stack.check_after(before, ended)
                runs.append(run)
        finally:
            stack.stop()
    return runs


# -- results ----------------------------------------------------------------------------


def write_results(runs: Sequence[Run], out: Path) -> None:
    """Append each run to ``out``.md and ``out``.json."""
    version = code_version()
    at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    entries = []
    sections = []
    for run in runs:
        report = run.report
        entry = {"label": run.label, "command": run.command, "seed": run.seed,
                 "minutes": run.minutes, "role": run.role, "smoke": run.smoke,
                 "commit": version, "at": at, "passed": run.passed, **report.as_json(),
                 "changed_tables": run.changed_tables, "live_checks": run.live_checks,
                 "live_problems": run.live_problems}
        entries.append(entry)
        kind = "smoke run (shows the runner works; not a result)" if run.smoke else "result"
        lines = [f"## {run.label}, seed {run.seed}, {run.minutes:g} min: "
                 f"{'PASSED' if run.passed else 'FAILED'} ({kind})", "",
                 f"`{run.command}` on {version}, {at}.", "",
                 f"- {report.cases} cases in {report.scenarios} scenarios; phases "
                 f"{', '.join(report.phases)}",
                 "- responses by status: " + ", ".join(
                     f"{status}: {count}" for status, count in sorted(report.statuses.items())),
                 f"- 5xx: {report.server_errors}",
                 f"- failures by check: {dict(sorted(report.failed_checks.items())) or 'none'}",
                 f"- errors: {len(report.errors)}"]
        if run.changed_tables is not None:
            lines.append(f"- tables changed: {', '.join(run.changed_tables) or 'none'}")
        lines += [f"- {line}" for line in run.live_checks]
        lines += [f"- **{line}**" for line in run.live_problems]
        for title, where in sorted(report.failures.items()):
            lines.append(f"- failure `{title}`: " + "; ".join(
                example.splitlines()[0] for example in sorted(set(where))[:3]))
        lines += [f"- error: {error}" for error in report.errors]
        sections.append("\n".join(lines) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    md = out.with_suffix(".md")
    if not md.exists():
        md.write_text("# Fuzzing the control API\n\nWritten by `python -m bench.fuzz.run` "
                      "(see its docstring): schemathesis, every check and every phase "
                      "including stateful, with seeds the suite does not use.\n\n")
    with md.open("a") as handle:
        handle.write("\n" + "\n".join(sections))
    data = out.with_suffix(".json")
    existing = json.loads(data.read_text()) if data.exists() else []
    data.write_text(json.dumps([*existing, *entries], indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=101)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--role", choices=ROLES, default="admin")
    parser.add_argument("--live", action="store_true",
                        help="fuzz a `modelkeeper up` stack (viewer, then no token)")
    parser.add_argument("--smoke", action="store_true",
                        help="a short run that shows the runner works, not a result")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.seed == 11:
        parser.error("--seed 11 is the suite's own (tests/security/test_fuzz_api.py)")
    command = "python -m bench.fuzz.run " + shlex.join(sys.argv[1:] if argv is None
                                                        else list(argv))
    interrupt_on_sigterm()
    runs = (asyncio.run(fuzz_live(args, command)) if args.live
            else [asyncio.run(fuzz_in_process(args, command))])
    for run in runs:
        print(f"{run.label}: {'passed' if run.passed else 'FAILED'}\n{run.report.describe()}")
        for line in run.live_problems:
            print(f"! {line}")
    write_results(runs, args.out)
    return 0 if all(run.passed for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
