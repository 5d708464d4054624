"""How long each console page takes to answer at 300 nodes and 300 deployments.

Run it from the repository root::

    .venv/bin/python -m bench.console.run --out bench/results/console.md

On an embedded PostgreSQL of its own (started and stopped here, in a temporary folder):

1. fills the store as bench/scale/placement_alone does (its ``_populate``: N nodes of a
   real fleet's shapes, some silent and some cordoned; M models with one deployment
   each), places one replica of each deployment (``PlacementStore.place_replica``), and
   adds an operation with three steps per deployment and EVENTS audit entries;
2. builds the API (``create_app``) with operator tokens on, its store set directly
   (the pages read no Temporal), and logs in through ``POST /ui/login``;
3. asks each page CALLS times in process (httpx's ASGI transport: the whole app, its
   middleware included, but no socket), after WARMUP calls, and times each answer from
   the caller's side. Whole pages and their ``?part=live`` refreshes, which the pages
   poll every 2 s.

Each answer's wall time, and the CPU time this process spent on it (the app's own work:
routing, the store's decoding, the pure functions, the templates; not the database's),
which other processes on a shared machine do not inflate. The target (issue 24): each page
within 100 ms at p95. Also the API routes behind the pages, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx

from api.app import create_app
from bench.scale.placement_alone import (
    LOST_AFTER_S,
    START_TIMEOUT_S,
    UNREACHABLE_AFTER_S,
    _deployment,
    _populate,
    _request,
)
from bench.stats import percentile
from cli.postgres import dsn, start_postgres
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.operations import OperationKind, OperationState, OperationStep, StepState
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from modelkeeper.store import Store

DATABASE = "console_bench"


@dataclass(frozen=True)
class Timed:
    """One page's answers: wall milliseconds each, this process's CPU milliseconds each
    (the app's own work, without the database's or other processes'), and its size."""

    path: str
    times: list[float]
    cpu: list[float]
    size: int

TARGET_MS = 100.0
WARMUP = 3
#: Calls of each page profiled with --profile, after the timed ones (not timed).
PROFILED_CALLS = 5


async def _fill(store: Store, *, nodes: int, deployments: int, events: int) -> None:
    models = await _populate(store, nodes=nodes, placements=deployments, seed=7)
    for i, model in enumerate(models):
        await store.placement.place_replica(
            deployment_id=_deployment(i), replica_id=ReplicaId(f"{_deployment(i)}-r0"),
            request=_request(model), model=model, now=datetime.now(UTC),
            unreachable_after_s=UNREACHABLE_AFTER_S, lost_after_s=LOST_AFTER_S,
            start_timeout_s=START_TIMEOUT_S)
        record = await store.operations.begin_next(
            OperationKind.RESTART, _deployment(i), deployment_id=_deployment(i),
            summary=f"restart {_deployment(i)}: replace its 1 replica", requested_by="bench")
        now = datetime.now(UTC)
        await store.operations.save(record.model_copy(update={
            "state": OperationState.SUCCEEDED, "steps": [
                OperationStep(name=f"{name} {_deployment(i)}-r0", state=StepState.DONE,
                              detail="bench", started_at=now, ended_at=now)
                for name in ("start beside", "wait ready", "stop old")]}))
    for n in range(events):
        i = n % deployments
        await store.events.record_event(NewEvent(
            kind="replica.ready", message=f"{_deployment(i)}-r0 is ready (bench event {n})",
            deployment_id=_deployment(i)))


async def measure(url: str, *, nodes: int, deployments: int, events: int,
                  calls: int, profile: Path | None = None
                  ) -> list[Timed]:
    settings = Settings(database_url=url, node_unreachable_after_s=UNREACHABLE_AFTER_S,
                        node_lost_after_s=LOST_AFTER_S)
    async with await Store.connect(url) as store:
        began = time.perf_counter()
        await _fill(store, nodes=nodes, deployments=deployments, events=events)
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("ANALYZE")
        finally:
            await conn.close()
        print(f"filled in {time.perf_counter() - began:.1f}s", file=sys.stderr)
        _, token = await store.tokens.create_token("bench", OperatorRole.VIEWER)
        app = create_app(settings)
        app.state.store = store  # no lifespan: the pages need no Temporal
        one = _deployment(deployments // 2)
        pages = ["/ui", "/ui/nodes", f"/ui/nodes?page={max(1, nodes // 100)}",
                 "/ui/deployments", f"/ui/deployments/{one}", "/ui/operations",
                 f"/ui/operations/restart/{one}/1", "/ui/events",
                 f"/ui/events?deployment={one}", f"/ui/deployments/{one}/room"]
        # The API's own routes behind them, for comparison (a bearer token, JSON).
        api_routes = ["/fleet", "/nodes", "/deployments", f"/deployments/{one}/headroom"]
        results = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as http:
            login = await http.post("/ui/login", data={"token": token})
            assert login.status_code == 303, login.text
            bearer = {"Authorization": f"Bearer {token}"}
            for path in pages + api_routes:
                for live in (False, True) if path.startswith("/ui") \
                        and not path.endswith("/room") else (False,):
                    full = path + (("&" if "?" in path else "?") + "part=live" if live else "")
                    times, cpu, size = [], [], 0
                    for n in range(WARMUP + calls):
                        t0, c0 = time.perf_counter(), time.process_time()
                        resp = await http.get(full, headers=bearer)
                        elapsed = time.perf_counter() - t0
                        used = time.process_time() - c0
                        assert resp.status_code == 200, (full, resp.status_code, resp.text[:300])
                        size = len(resp.content)
                        if n >= WARMUP:
                            times.append(elapsed * 1e3)
                            cpu.append(used * 1e3)
                    results.append(Timed(full, times, cpu, size))
                    if profile is not None and not live:
                        profiler = cProfile.Profile()
                        profiler.enable()
                        for _ in range(PROFILED_CALLS):
                            await http.get(full, headers=bearer)
                        profiler.disable()
                        profile.mkdir(parents=True, exist_ok=True)
                        name = full.strip("/").replace("/", "_").replace("?", "_") or "ui"
                        profiler.dump_stats(str(profile / f"{name}.prof"))
                    print(f"{full:48s} {_row(times, size)}  cpu p50 "
                          f"{percentile(cpu, 0.5):.1f} ms", file=sys.stderr)
    return results


def _row(times: list[float], size: int) -> str:
    return (f"p50 {percentile(times, 0.5):6.1f} ms  p95 {percentile(times, 0.95):6.1f} ms  "
            f"max {max(times):6.1f} ms  mean {statistics.fmean(times):6.1f} ms  "
            f"{size / 1024:.0f} KiB")


def _markdown(results: list[Timed], args: argparse.Namespace) -> str:
    lines = [f"# Console pages at {args.nodes} nodes and {args.deployments} deployments", "",
             f"Run at load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.", "",
             f"`python -m bench.console.run --nodes {args.nodes} --deployments "
             f"{args.deployments} --events {args.events} --calls {args.calls} --out "
             "bench/results/console.md` (bench/console/run.py says what it fills and how "
             "it times: in process, the whole app, from the caller's side, "
             f"{args.calls} calls a page after {WARMUP} not counted).", "",
             "| page | p50 ms | p95 ms | max ms | CPU p50 ms | size KiB | within 100 ms (p95) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        p95 = percentile(r.times, 0.95)
        lines.append(f"| `{r.path}` | {percentile(r.times, 0.5):.1f} | {p95:.1f} | "
                     f"{max(r.times):.1f} | {percentile(r.cpu, 0.5):.1f} | "
                     f"{r.size / 1024:.0f} | {'yes' if p95 <= TARGET_MS else '**no**'} |")
    return "\n".join(lines) + "\n"


async def _create_and_measure(admin_url: str, url: str, args: argparse.Namespace
                              ) -> list[Timed]:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await admin.close()
    return await measure(url, nodes=args.nodes, deployments=args.deployments,
                         events=args.events, calls=args.calls, profile=args.profile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console.run",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--deployments", type=int, default=300)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", type=Path, help="write the table (markdown) here")
    parser.add_argument("--profile", type=Path, help="also cProfile each whole page's "
                        f"{PROFILED_CALLS} further calls, one .prof file a page, here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mk-console-bench-") as tmp:
        root = Path(tmp)
        port = free_port()
        proc = start_postgres(root / "data", "127.0.0.1", port, root / "postgres.log")
        try:
            results = asyncio.run(_create_and_measure(
                dsn("127.0.0.1", port, "postgres", data_dir=root),
                dsn("127.0.0.1", port, DATABASE, data_dir=root), args))
        finally:
            proc.stop()
    table = _markdown(results, args)
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 0 if all(percentile(r.times, 0.95) <= TARGET_MS for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
