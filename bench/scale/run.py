"""What the control plane costs at 100, 300 and 1,000 nodes, each with as many deployments,
and how each cost grows with size.

Run it from the repository root::

    .venv/bin/python -m bench.scale.run                       # 100 300 1000: bench/results/scale
    .venv/bin/python -m bench.scale.run --sizes 100 --out /tmp/scale
    .venv/bin/python -m bench.scale.run --sizes 1000 --profile worker api --out /tmp/prof

Per size, on a fresh stack (:mod:`bench.fleet.scale`: embedded PostgreSQL, the Temporal dev
server, the control worker, the API, the gateway, every setting at its default) and one
process that is N simulated nodes (``python -m bench.fleet --fleet N``, each declaring
``--node-memory``; the real agent's code per node, sim engines served in-process):

1. **register**: the fleet starts; the time until the API sees all N nodes ready;
2. **deploy**: N sim models, then N one-replica deployments posted at once (at most
   ``--post-concurrency`` in flight); the time from the first POST until every deployment
   serves, the POSTs' own latency, each deployment's POST → placed → ready (the store's
   clock: the deployment's ``created_at``, its replica's ``started_at`` and ``ready_at``),
   placements per second, and each placement's time in the store
   (``PlacementStore.place_replica``: the DEBUG lines of ``modelkeeper.store.placement``), with the
   time it waited for locks and for a pooled connection shown apart;
3. **heartbeats**: every heartbeat's round trip as the fleet's nodes saw it (agent side),
   while idle before the POSTs, while the placements run, and during the recovery;
4. **steady state**: Temporal's own counters (``service_requests`` of the frontend,
   namespace ``default``, as :mod:`bench.temporal_cost` reads them) and every workflow's
   history length, over ``--window`` seconds in which the benchmark touches nothing;
   rates per deployment-hour;
5. **memory**: the resident memory of the worker, the API and the gateway (each with its
   children), after the nodes registered and again once every deployment serves; per
   deployment, and the growth per deployment;
6. **recovery**: 10 % of the nodes, each holding replicas, die at once (the fleet's kill:
   streams cut, heartbeats stopped, workers silent, engines gone); the time until every
   affected deployment serves again from a live node, and the requests a sample of them
   answer through the gateway afterwards.

CPU seconds of each process are recorded for each phase: where the time went.

Results go to ``--out`` (``.md``, ``.json``, ``.png``: each cost against size) and, for the
committed run (the default ``--out``), the README's table between its scale-table markers.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx
import psutil
import uvloop
from temporalio.client import Client

from bench import stats
from bench.common import (
    ROOT,
    STEADY_WINDOW_S,
    interrupt_on_sigterm,
    remove_unless_kept,
    stop_fleet,
)
from bench.fleet.scale import ScaleError, ScaleFleet
from bench.fleet.stack import HOST, NAMESPACE, FleetError
from bench.report import run_meta, write_results
from bench.temporal_cost import metrics
from bench.temporal_cost.run import per_op, summarise

from .report import draw, readme_table, render

DEFAULT_OUT = ROOT / "bench" / "results" / "scale"
README = ROOT / "README.md"
MiB, GiB = 1 << 20, 1 << 30
T = TypeVar("T")

#: What each node declares and each replica claims: two replicas fit a node, so bin-packing
#: puts N deployments on N/2 nodes and leaves the other half free for the recovery.
NODE_MEMORY = "2GiB"
CLAIM_BYTES = 1 * GiB
#: What a sim says it holds (in-process: nothing for real), and how long it loads: the
#: recovery bench's 1 s, so a start is visible and constant.
ENGINE_ARGS = {"memory_bytes": 1 * MiB, "load_time_s": 1.0}
#: POSTs in flight at once: an operator's script posting as fast as the API answers.
POST_CONCURRENCY = 32
#: A fresh worker places nothing for its settling window (15 s from its start, the
#: default): the POSTs wait it out, so the deploy measures placement, not the window.
SETTLING_WINDOW_S = 15.0
#: Heartbeats sampled while nothing happens, before the POSTs.
IDLE_WINDOW_S = 10.0
#: Until every deployment serves: far past the goal (60 s at 1,000), so a slow size still
#: yields its numbers; what did not serve by then is reported.
SERVE_TIMEOUT_S = 900.0
#: Until every affected deployment serves again after the kill.
RECOVERY_TIMEOUT_S = 600.0
#: How often the store is read while waiting (one COUNT query: no load worth counting).
POLL_S = 0.25
#: After serving, before weighing memory and opening the window: the last status writes
#: and watch starts land in this time.
LEAD_IN_S = 10.0
#: The dev server adds a request to its counters up to about a second after it arrives
#: (bench/temporal_cost measured it), later on loaded cores: the benchmark's own reads of
#: the histories end this long before the first scrape, and start this long after the last.
METRICS_FLUSH_S = 5.0
#: Describes of the workflows in flight at once, before and after the window.
DESCRIBE_CONCURRENCY = 16
#: The share of the nodes that die at once, each holding replicas.
KILL_SHARE = 0.10
#: Affected models asked for one completion through the gateway after the recovery.
GATEWAY_SAMPLE = 20
#: Process names weighed and timed (bench/fleet/scale.py component_pids).
WEIGHED = ("worker", "api", "gateway")
TIMED = ("postgres", "temporal", "worker", "api", "gateway", "fleet")
#: The goals (the issue).
GOAL_SERVING_S = 60.0
GOAL_PLACEMENT_P99_MS = 50.0
GOAL_RECOVERY_S = 30.0
GOAL_EVENTS_PER_HOUR = 10.0

_TIMING = re.compile(r"^(\S+ \S+) DEBUG modelkeeper\.store\.placement: placement timing "
                     r"replica=(\S+) total_ms=([\d.]+) turn_wait_ms=([\d.]+) "
                     r"pool_wait_ms=([\d.]+) lock_wait_ms=([\d.]+) attempts=(\d+) "
                     r"outcome=(\w+)")


async def bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run ``calls`` with at most ``limit`` in flight; their results in order."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await call()
    return list(await asyncio.gather(*(one(c) for c in calls)))


class CpuClock:
    """CPU seconds of the stack's processes (with their children), read at phase ends."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._procs = {}
        for name, pid in pids.items():
            try:
                self._procs[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
        self._last = self._read()

    def _read(self) -> dict[str, float]:
        found = {}
        for name, proc in self._procs.items():
            total = 0.0
            for p in [proc, *_children(proc)]:
                try:
                    times = p.cpu_times()
                except psutil.Error:
                    continue
                total += times.user + times.system
            found[name] = total
        return found

    def lap(self) -> dict[str, float]:
        """CPU seconds each used since the last lap."""
        now = self._read()
        used = {n: round(now[n] - self._last.get(n, 0.0), 1) for n in now}
        self._last = now
        return used


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.Error:
        return []


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its children (the gateway runs workers)."""
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in [proc, *_children(proc)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def weigh(fleet: ScaleFleet) -> dict[str, int]:
    pids = fleet.component_pids()
    return {name: rss(pids[name]) for name in (*WEIGHED, "fleet") if name in pids}


async def post_all(api: httpx.AsyncClient, size: int, concurrency: int
                   ) -> tuple[list[str], list[float], float, float]:
    """N models (untimed set-up), then N deployments at once; the deployment ids, each
    POST's latency, and when the first POST went and the last answered (epoch s)."""
    def model(i: int) -> Callable[[], Awaitable[httpx.Response]]:
        return lambda: api.post("/models", json={
            "model_id": f"scale-{i:04d}", "engine": "sim", "source": "sim",
            "memory_bytes": CLAIM_BYTES, "engine_args": ENGINE_ARGS})
    for resp in await bounded([model(i) for i in range(1, size + 1)], concurrency):
        if resp.status_code != 201:
            raise ScaleError(f"POST /models: {resp.status_code} {resp.text}")

    latencies: list[float] = []

    def deployment(i: int) -> Callable[[], Awaitable[httpx.Response]]:
        async def post() -> httpx.Response:
            sent = time.monotonic()
            resp = await api.post("/deployments",
                                  json={"model_id": f"scale-{i:04d}", "replicas": 1})
            latencies.append(time.monotonic() - sent)
            return resp
        return post
    first = time.time()
    responses = await bounded([deployment(i) for i in range(1, size + 1)], concurrency)
    last = time.time()
    ids = []
    for resp in responses:
        if resp.status_code != 201:
            raise ScaleError(f"POST /deployments: {resp.status_code} {resp.text}")
        ids.append(resp.json()["deployment_id"])
    return ids, latencies, first, last


async def wait_serving(db: asyncpg.Connection, size: int, timeout: float
                       ) -> tuple[float | None, dict[str, int]]:
    """Until every deployment serves: when that was seen (epoch s; None: timed out), and
    the count per status at the end."""
    deadline = time.monotonic() + timeout
    while True:
        rows = await db.fetch("SELECT status, count(*) AS n FROM deployments GROUP BY status")
        counts = {r["status"]: r["n"] for r in rows}
        if counts.get("serving", 0) >= size:
            return time.time(), counts
        if time.monotonic() > deadline:
            return None, counts
        await asyncio.sleep(POLL_S)


@dataclass(frozen=True)
class DeployTimes:
    """One deployment on the store's clock (epoch s): posted, its first replica placed and
    ready (None: not yet)."""

    posted: float
    placed: float | None
    ready: float | None


async def deploy_times(db: asyncpg.Connection) -> list[DeployTimes]:
    """Per deployment, on the store's clock: when it was posted, placed and ready."""
    rows = await db.fetch(
        "SELECT d.deployment_id, extract(epoch FROM d.created_at) AS posted, "
        "       min(extract(epoch FROM r.started_at)) AS placed, "
        "       min(extract(epoch FROM r.ready_at)) AS ready "
        "FROM deployments d LEFT JOIN replicas r USING (deployment_id) "
        "GROUP BY d.deployment_id, d.created_at")
    return [DeployTimes(float(r["posted"]),
                        None if r["placed"] is None else float(r["placed"]),
                        None if r["ready"] is None else float(r["ready"])) for r in rows]


def placement_timings(log_path: Path, *, since: str | None = None) -> list[dict[str, Any]]:
    """The worker's placement timing lines (see PlacementStore.place_replica)."""
    found = []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        match = _TIMING.match(line)
        if match is None:
            continue
        at, replica, total, turn, pool, lock, attempts, outcome = match.groups()
        if since is not None and at < since:
            continue
        found.append({"at": at, "replica": replica, "total_ms": float(total),
                      "turn_wait_ms": float(turn), "pool_wait_ms": float(pool),
                      "lock_wait_ms": float(lock), "attempts": int(attempts),
                      "outcome": outcome})
    return found


def heartbeat_stats(samples: list[tuple[float, float]], start: float, end: float
                    ) -> dict[str, Any]:
    return stats.summary([lat for at, lat in samples if start <= at < end])


async def histories(temporal: Client, workflow_ids: Sequence[str]
                    ) -> dict[str, tuple[str, int]]:
    """Each workflow's current run id and history length."""
    async def one(wid: str) -> tuple[str, int]:
        desc = await temporal.get_workflow_handle(wid).describe()
        info = desc.raw_description.workflow_execution_info
        return info.execution.run_id, info.history_length
    found = await bounded([functools.partial(one, w) for w in workflow_ids],
                          DESCRIBE_CONCURRENCY)
    return dict(zip(workflow_ids, found, strict=True))


async def steady_window(fleet: ScaleFleet, db: asyncpg.Connection, *, size: int,
                        window_s: float) -> dict[str, Any]:
    """Temporal's counters and the histories over a window in which nothing of ours
    talks to Temporal or the API."""
    temporal_proc = next(p for p in fleet.started if p.name == "temporal")
    url = await metrics.find_metrics_url(temporal_proc.pid, HOST)
    temporal = await Client.connect(fleet.temporal_address, namespace=NAMESPACE)
    workflow_ids = [r["workflow_id"] for r in await db.fetch(
        "SELECT workflow_id FROM deployments ORDER BY deployment_id")]
    before = await histories(temporal, workflow_ids)
    await asyncio.sleep(METRICS_FLUSH_S)
    asked = time.monotonic()
    first = await metrics.scrape(url)
    t0 = (asked + time.monotonic()) / 2
    await asyncio.sleep(max(0.0, t0 + window_s - time.monotonic()))
    asked = time.monotonic()
    last = await metrics.scrape(url)
    measured_s = (asked + time.monotonic()) / 2 - t0
    await asyncio.sleep(METRICS_FLUSH_S)
    after = await histories(temporal, workflow_ids)
    counts = metrics.delta(first, last)
    rpcs = per_op(counts, "service_requests")
    persistence = per_op(counts, "persistence_requests")
    new_events = [after[w][1] - before[w][1] for w in workflow_ids
                  if after[w][0] == before[w][0]]
    continued = sum(1 for w in workflow_ids if after[w][0] != before[w][0])
    hours = size * measured_s / 3600
    summary = summarise(rpcs, persistence, shards=size, workers=size + 1,
                        window_s=measured_s)
    return {"window_s": round(measured_s, 1), "rpcs": rpcs, "persistence": persistence,
            "summary": summary, "new_events": sum(new_events),
            "events_per_deployment_hour": round(sum(new_events) / hours, 2),
            "most_new_events": max(new_events, default=0),
            "continued_as_new": continued,
            "history_length": stats.summary([float(v[1]) for v in after.values()], 0)}


async def affected_by(db: asyncpg.Connection, node_ids: Sequence[str]) -> list[str]:
    rows = await db.fetch(
        "SELECT DISTINCT r.deployment_id FROM replicas r JOIN allocations a USING (replica_id) "
        "WHERE a.node_id = ANY($1::text[])", list(node_ids))
    return sorted(r["deployment_id"] for r in rows)


async def serving_elsewhere(db: asyncpg.Connection, deployment_ids: Sequence[str],
                            dead: Sequence[str]) -> dict[str, float]:
    """Of ``deployment_ids``, those serving from a ready replica on a live node: each
    with the earliest ``ready_at`` (epoch s) of such a replica."""
    rows = await db.fetch(
        "SELECT d.deployment_id, min(extract(epoch FROM r.ready_at)) AS ready "
        "FROM deployments d JOIN replicas r USING (deployment_id) "
        "JOIN allocations a USING (replica_id) "
        "WHERE d.deployment_id = ANY($1::text[]) AND d.status = 'serving' "
        "  AND r.state = 'ready' AND NOT a.node_id = ANY($2::text[]) "
        "GROUP BY d.deployment_id", list(deployment_ids), list(dead))
    return {r["deployment_id"]: float(r["ready"]) for r in rows}


async def recovery(fleet: ScaleFleet, db: asyncpg.Connection, *, size: int,
                   seed: int) -> dict[str, Any]:
    """Kill a tenth of the nodes, each holding replicas; wait until every affected
    deployment serves from a live node again."""
    holders = await db.fetch(
        "SELECT DISTINCT n.node_id, n.name FROM nodes n JOIN allocations a USING (node_id) "
        "ORDER BY n.name")
    count = max(1, round(size * KILL_SHARE))
    if len(holders) < count:
        raise ScaleError(f"only {len(holders)} nodes hold replicas; {count} must die")
    victims = random.Random(seed).sample(list(holders), count)
    dead = [v["node_id"] for v in victims]
    affected = await affected_by(db, dead)
    record = await fleet.kill([v["name"] for v in victims])
    t0 = float(record["at"])
    seen: dict[str, float] = {}
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    ready: dict[str, float] = {}
    while len(seen) < len(affected) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        ready = await serving_elsewhere(db, affected, dead)
        now = time.time()
        for deployment_id in ready:
            seen.setdefault(deployment_id, now)
    recovered_at = max(seen.values()) if len(seen) == len(affected) else None
    by_ready = [ready[d] - t0 for d in affected if d in ready]
    return {"killed_nodes": len(dead), "killed_engines": record["engines"],
            "affected": len(affected), "recovered": len(seen),
            "killed_at": t0, "kill_signal_to_done_s": round(t0 - record["asked"], 3),
            "all_serving_again_s": None if recovered_at is None
            else round(recovered_at - t0, 2),
            "seen_serving_again_s": stats.summary([v - t0 for v in seen.values()], 2),
            "replacement_ready_s": stats.summary(by_ready, 2),
            "affected_ids": affected, "dead_node_ids": dead}


async def gateway_sample(fleet: ScaleFleet, db: asyncpg.Connection,
                         deployment_ids: Sequence[str]) -> dict[str, int]:
    """One completion through the gateway for each of a sample of the deployments."""
    rows = await db.fetch("SELECT model_id FROM deployments "
                          "WHERE deployment_id = ANY($1::text[]) ORDER BY model_id",
                          list(deployment_ids))
    models = [r["model_id"] for r in rows][:GATEWAY_SAMPLE]
    key = await fleet.client_key()
    codes: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=30.0) as gw:
        for model in models:
            try:
                resp = await gw.post(
                    f"{fleet.gateway_url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": model, "max_tokens": 1,
                          "messages": [{"role": "user", "content": "hi"}]})
                code = str(resp.status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            codes[code] = codes.get(code, 0) + 1
    return codes


async def measure(fleet: ScaleFleet, args: argparse.Namespace) -> dict[str, Any]:
    """Every phase for one size (see the module docstring)."""
    size = fleet.size
    t_begin = time.monotonic()
    # Everything on this machine shares its cores, other work included: the load says how
    # much of them the run had.
    load_before = os.getloadavg()
    await fleet.start()
    stack_up = time.monotonic()
    cpu = CpuClock(fleet.component_pids())
    registered_s = await fleet.start_fleet()
    cpu = CpuClock(fleet.component_pids())  # now with the fleet
    print(f"[{size}] {size} nodes ready {registered_s:.1f}s after the fleet started",
          flush=True)
    cpu_register = cpu.lap()
    idle_from = time.time()
    await asyncio.sleep(max(IDLE_WINDOW_S,
                            SETTLING_WINDOW_S + 1 - (time.monotonic() - stack_up)))
    idle_to = time.time()
    cpu_idle = cpu.lap()
    memory_before = weigh(fleet)
    idle_s = idle_to - idle_from
    result: dict[str, Any] = {
        "size": size, "register_s": round(registered_s, 1), "cpu_register_s": cpu_register,
        "idle": {"wall_s": round(idle_s, 1), "cpu_s": cpu_idle,
                 # What one node costs each process per second with nothing deployed: its
                 # heartbeats, its liveness stream, its worker's polls.
                 "cpu_ms_per_node_s": {n: round(v / idle_s / size * 1e3, 3)
                                       for n, v in cpu_idle.items()},
                 "heartbeat_s": heartbeat_stats(fleet.heartbeats(), idle_from, idle_to),
                 "false_silences": silences(fleet)}}
    print(f"[{size}] idle: CPU ms per node-second {result['idle']['cpu_ms_per_node_s']}; "
          f"{result['idle']['false_silences']} nodes marked silent while alive", flush=True)
    db = await asyncpg.connect(fleet.database_url)
    try:
        await deploy_and_after(fleet, db, args, result, cpu=cpu, idle=(idle_from, idle_to),
                               memory_before=memory_before)
    except (ScaleError, httpx.HTTPError) as exc:
        # What was measured stays: a size that breaks down says where, and what it cost
        # until then.
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{size}] {result['error']}", file=sys.stderr, flush=True)
    finally:
        await db.close()
    result["elapsed_s"] = round(time.monotonic() - t_begin, 1)
    result["load_average"] = {"before": [round(x, 2) for x in load_before],
                              "after": [round(x, 2) for x in os.getloadavg()]}
    return result


def silences(fleet: ScaleFleet) -> int:
    """How many times the API has marked a node silent so far (its log's lines)."""
    try:
        return (fleet.root / "logs" / "api.log").read_text(errors="replace").count(
            "went silent")
    except FileNotFoundError:
        return 0


async def deploy_and_after(fleet: ScaleFleet, db: asyncpg.Connection,
                           args: argparse.Namespace, result: dict[str, Any], *,
                           cpu: CpuClock, idle: tuple[float, float],
                           memory_before: dict[str, int]) -> None:
    """Deploy, the steady window and the recovery, filling ``result`` as each ends."""
    size = fleet.size
    idle_from, idle_to = idle
    async with httpx.AsyncClient(base_url=fleet.api_url, headers=fleet.headers(),
                                 timeout=60.0,
                                 limits=httpx.Limits(max_connections=args.post_concurrency)
                                 ) as api:
        _, post_latencies, first_post, last_post = await post_all(
            api, size, args.post_concurrency)
    print(f"[{size}] posted {size} deployments in {last_post - first_post:.1f}s",
          flush=True)
    serving_at, statuses = await wait_serving(db, size, SERVE_TIMEOUT_S)
    deploy_end = serving_at or time.time()
    cpu_deploy = cpu.lap()
    times = await deploy_times(db)
    placed = sorted(t.placed for t in times if t.placed is not None)
    timings = [t for t in placement_timings(fleet.root / "logs" / "worker.log")
               if t["outcome"] == "placed"]
    all_serving_s = None if serving_at is None else round(serving_at - first_post, 1)
    print(f"[{size}] all serving {all_serving_s}s after the first POST; {statuses}",
          flush=True)
    samples = fleet.heartbeats()
    result["deploy"] = {
        "post_all_s": round(last_post - first_post, 2),
        "post_latency_s": stats.summary(post_latencies),
        "all_serving_s": all_serving_s, "statuses_at_end": statuses,
        "post_to_placed_s": stats.summary([t.placed - t.posted for t in times
                                   if t.placed is not None], 2),
        "post_to_ready_s": stats.summary([t.ready - t.posted for t in times
                                  if t.ready is not None], 2),
        "placements_per_s": round((len(placed) - 1) / (placed[-1] - placed[0]), 1)
        if len(placed) > 1 and placed[-1] > placed[0] else None,
        "placement_ms": stats.summary([t["total_ms"] for t in timings], 1),
        "turn_wait_ms": stats.summary([t["turn_wait_ms"] for t in timings], 1),
        "transaction_ms": stats.summary([t["total_ms"] - t["turn_wait_ms"] for t in timings], 1),
        "lock_wait_ms": stats.summary([t["lock_wait_ms"] for t in timings], 1),
        "pool_wait_ms": stats.summary([t["pool_wait_ms"] for t in timings], 1),
        "work_ms": stats.summary([t["total_ms"] - t["turn_wait_ms"] - t["lock_wait_ms"]
                          - t["pool_wait_ms"] for t in timings], 1),
        "attempts": {str(k): sum(1 for t in timings if t["attempts"] == k)
                     for k in sorted({t["attempts"] for t in timings})},
        "placement_timing_lines": len(timings),
        "cpu_s": cpu_deploy,
    }
    result["heartbeat"] = {"idle": heartbeat_stats(samples, idle_from, idle_to),
                           "placing": heartbeat_stats(samples, first_post, deploy_end)}
    result["deploy"]["false_silences"] = silences(fleet) - result["idle"]["false_silences"]
    if serving_at is None:
        raise ScaleError(f"not every deployment served within {SERVE_TIMEOUT_S:.0f}s: "
                         f"{statuses}")
    await asyncio.sleep(LEAD_IN_S)
    memory_after = weigh(fleet)
    result["memory"] = {
        "before_bytes": memory_before, "after_bytes": memory_after,
        "per_deployment_bytes": {n: round(memory_after[n] / size)
                                 for n in memory_after},
        "growth_per_deployment_bytes": {
            n: round((memory_after[n] - memory_before.get(n, 0)) / size)
            for n in memory_after}}
    cpu.lap()
    if args.window > 0:
        result["steady"] = await steady_window(fleet, db, size=size,
                                               window_s=args.window)
        result["steady"]["cpu_s"] = cpu.lap()
        steady = result["steady"]
        print(f"[{size}] steady: {steady['events_per_deployment_hour']} events and "
              f"{steady['summary']['all_rpcs_per_shard_hour']} RPCs per deployment-hour",
              flush=True)
    log = fleet.root / "logs" / "worker.log"
    timed_before = len(placement_timings(log))
    result["false_silences_before_kill"] = silences(fleet)
    rec = await recovery(fleet, db, size=size, seed=args.seed)
    cpu_recovery = cpu.lap()
    replacements = [t for t in placement_timings(log)[timed_before:]
                    if t["outcome"] == "placed"]
    rec["placement_ms"] = stats.summary([t["total_ms"] for t in replacements], 1)
    rec["transaction_ms"] = stats.summary([t["total_ms"] - t["turn_wait_ms"]
                                   for t in replacements], 1)
    rec["lock_wait_ms"] = stats.summary([t["lock_wait_ms"] for t in replacements], 1)
    samples = fleet.heartbeats()
    rec_end = rec["killed_at"] + (rec["all_serving_again_s"] or RECOVERY_TIMEOUT_S)
    result["heartbeat"]["recovery"] = heartbeat_stats(samples, rec["killed_at"], rec_end)
    rec["gateway"] = await gateway_sample(fleet, db, rec["affected_ids"])
    rec["cpu_s"] = cpu_recovery
    result["recovery"] = rec
    print(f"[{size}] recovery: {rec['affected']} deployments on {rec['killed_nodes']} "
          f"nodes serving again after {rec['all_serving_again_s']}s; gateway "
          f"{rec['gateway']}", flush=True)


def profile_summary(path: Path, top: int = 25) -> list[dict[str, Any]]:
    """The functions that took the most time of their own in a profile."""
    import pstats

    if not path.exists():
        return []
    found = []
    profile = pstats.Stats(str(path))
    # Each function's (calls, primitive calls, own time, cumulative time, callers): set by
    # Stats.load_stats and read by its own printers, but not declared in typeshed's stub.
    entries = profile.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in entries.values()) or 1.0
    for (file, line, func), (_, calls, tt, ct, _) in sorted(
            entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]:
        found.append({"function": f"{Path(file).name}:{line}({func})", "calls": calls,
                      "own_s": round(tt, 2), "own_share": round(tt / total, 3),
                      "cumulative_s": round(ct, 2)})
    return found


def run_size(size: int, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"mk-scale-{size}-"))
    fleet = ScaleFleet(root, node_memory=args.node_memory, size=size,
                       profile=tuple(args.profile))
    ok = False
    try:
        result = uvloop.run(measure(fleet, args))
        ok = True
    except (ScaleError, FleetError) as exc:
        result = {"size": size, "error": str(exc)}
        print(f"[{size}] {exc}", file=sys.stderr, flush=True)
    finally:
        stop_fleet(fleet)
        profiles = {name: profile_summary(root / "profiles" / f"{name}.prof")
                    for name in args.profile}
        remove_unless_kept(root, keep=args.keep or not ok)
    if profiles:
        result["profiles"] = profiles
    return result


def write(result: dict[str, Any], out: Path) -> None:
    """OUT.json, OUT.png and OUT.md; and the README's table for the committed run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    result["meta"]["png"] = png.name
    draw(result, png)
    write_results(out, result, render(result))
    if out.resolve() == DEFAULT_OUT.resolve():
        update_readme(readme_table(result))


def update_readme(table: str, readme: Path = README) -> None:
    """Put ``table`` between the README's scale-table markers."""
    start, end = "<!-- scale-table:start -->\n", "<!-- scale-table:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        print("README has no scale-table markers: table not written", file=sys.stderr)
        return
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + start + table + end + tail)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000],
                        help="nodes per run, each with as many deployments "
                        "(default 100 300 1000)")
    parser.add_argument("--node-memory", default=NODE_MEMORY,
                        help=f"memory each node declares (default {NODE_MEMORY}: two "
                        f"{CLAIM_BYTES // GiB} GiB replicas)")
    parser.add_argument("--window", type=float, default=STEADY_WINDOW_S,
                        help=f"seconds of steady state counted (default {STEADY_WINDOW_S:.0f}; "
                        "0 skips it)")
    parser.add_argument("--post-concurrency", type=int, default=POST_CONCURRENCY,
                        help=f"POSTs in flight at once (default {POST_CONCURRENCY})")
    parser.add_argument("--seed", type=int, default=13, help="which nodes die (default 13)")
    parser.add_argument("--profile", nargs="*", default=[],
                        choices=["worker", "api", "fleet"],
                        help="run these components under cProfile (slower: not for the "
                        "committed numbers); the report lists their hottest functions")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="write OUT.md, OUT.json and OUT.png (default bench/results/scale)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's folder (logs, data) even when it succeeds")
    parser.add_argument("--from-json", type=Path, metavar="JSON",
                        help="run nothing: write the markdown, PNG and table from OUT.json")
    parser.add_argument("--notes", type=Path, metavar="MD",
                        help="markdown put under the goals (what a profile found, what is "
                        "left), kept in the JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        if args.notes:
            result["meta"]["notes"] = args.notes.read_text()
        write(result, args.out)
        return 0

    interrupt_on_sigterm()
    started = time.monotonic()
    sizes = []
    try:
        for size in args.sizes:
            sizes.append(run_size(size, args))
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130
    result = {
        "meta": {
            **run_meta("bench.scale.run", argv),
            "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
            "node_memory": args.node_memory, "claim_bytes": CLAIM_BYTES,
            "engine_args": ENGINE_ARGS, "post_concurrency": args.post_concurrency,
            "window_s": args.window, "kill_share": KILL_SHARE, "seed": args.seed,
            "profiled": list(args.profile),
            "notes": args.notes.read_text() if args.notes else None,
            "elapsed_s": round(time.monotonic() - started, 1),
            "goals": {"serving_s": GOAL_SERVING_S, "placement_p99_ms": GOAL_PLACEMENT_P99_MS,
                      "recovery_s": GOAL_RECOVERY_S,
                      "events_per_deployment_hour": GOAL_EVENTS_PER_HOUR},
        },
        "sizes": sizes,
    }
    write(result, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0 if all("error" not in s for s in sizes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
