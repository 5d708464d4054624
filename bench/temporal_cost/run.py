"""How many Temporal RPCs a serving shard costs per hour: today's defaults beside the old
one-heartbeat-a-second setting, counted by the Temporal server itself.

Run it from the repository root::

    .venv/bin/python -m bench.temporal_cost.run

For each scenario, on a fresh fleet (:mod:`bench.fleet.stack`: embedded PostgreSQL, the
Temporal dev server, the control worker, the API, the gateway and three agents), it deploys
``--shards`` sim-engine models of one replica each (16 MiB resident), waits until every
deployment serves and every replica's watch is running and has heartbeated, then reads the
server's request counters (:mod:`bench.temporal_cost.metrics`) and each deployment
workflow's history length, waits ``--window`` seconds without touching anything, and reads
both again. Nothing of the benchmark's own talks to Temporal or the API inside the window.

Scenarios (``--scenarios``, run one after another, the same window each):

* ``now``: every setting at its default: watch heartbeat timeout 60 s, the agent's worker
  with the SDK's default throttle (0.8 x the timeout: one heartbeat per 48 s).
* ``old``: as before the liveness redesign: ``MODELKEEPER_WATCH_HEARTBEAT_TIMEOUT_S=3``
  and the agent's worker throttling heartbeats to at most one a second
  (:mod:`bench.temporal_cost.old_agent`).
* ``timeout3`` (not run by default): the 3 s timeout with today's agent (throttle 2.4 s).

The target is at most :data:`TARGET_PER_SHARD_HOUR` Temporal RPCs per serving shard-hour.
Long polls are made per worker, not per shard, and are reported per worker-hour.
Results go to ``--out`` (``bench/results/temporal_cost.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

from activities.node import MAX_HEARTBEAT_THROTTLE
from agent.engine_process import POLL_INTERVAL_S as WATCH_POLL_S
from bench.common import (
    ROOT,
    STEADY_WINDOW_S,
    exit_now,
    interrupt_on_sigterm,
    on_fresh_fleet,
)
from bench.fleet.stack import HOST, NAMESPACE, Fleet
from bench.report import run_meta, write_results
from modelkeeper.names import ACTIVITY_WATCH_SHARD
from modelkeeper.settings import Settings, env_var_names

from . import metrics
from .report import render

MiB = 1 << 20
#: The project's target (the issue): Temporal RPCs per serving shard-hour.
TARGET_PER_SHARD_HOUR = 120
#: Nodes in the fleet. Each runs one Temporal worker; the control worker is one more.
AGENTS = 3
#: Memory each agent declares and each model claims: room for every shard with spare.
NODE_MEMORY = "4GiB"
CLAIM_BYTES = 512 * MiB
#: What a sim engine really holds, and how long it pretends to load (FACTS.md: it holds
#: its claim as real memory unless told less).
ENGINE_ARGS = {"memory_bytes": 16 * MiB, "load_time_s": 0.2}
#: Until every deployment serves with its watch heartbeating: a fresh worker waits out the
#: settling window (15 s) before it places anything, and six starts on two shared cores
#: take a few seconds more.
STEADY_TIMEOUT_S = 180.0
STEADY_POLL_S = 1.0
#: After steady and before the window: the last writes of the placement (store rows,
#: search attributes) land in this time, so they are not counted as steady-state cost.
LEAD_IN_S = 5.0
#: The dev server adds a request to its counters up to about a second after it arrives
#: (measured: 5 RPCs showed at 0.8 s, not at 0.3 s). The benchmark's own reads of the
#: workflows end this long before the first scrape, so none is counted in the window.
METRICS_FLUSH_S = 3.0
#: The SDK's defaults for the worker's heartbeat throttle (temporalio 1.35.0).
SDK_MAX_HEARTBEAT_THROTTLE = timedelta(seconds=60)
SDK_THROTTLE_FRACTION = 0.8
TIMEOUT_ENV = env_var_names("watch_heartbeat_timeout_s")[0]

#: Frontend operations that carry a watch's heartbeat: the cost per shard.
HEARTBEAT_OPS = frozenset({"RecordActivityTaskHeartbeat", "RecordActivityTaskHeartbeatById"})
#: Long polls: each worker keeps a few open and renews each when the server answers it
#: empty (about once a minute) or with a task. Per worker, not per shard.
POLL_OPS = frozenset({"PollActivityTaskQueue", "PollWorkflowTaskQueue",
                      "PollNexusTaskQueue"})
#: The SDK's worker heartbeat (worker status for the server and UI), once a minute per
#: SDK runtime (temporalio.runtime, worker_heartbeat_interval): per process, not per shard.
WORKER_OPS = frozenset({"RecordWorkerHeartbeat"})
#: Database requests whose operation names this are the matching service's bookkeeping of a
#: task queue (its lease, renewed every few seconds whether or not tasks flow): per queue.
TASK_QUEUE_DB = "TaskQueue"


class BenchError(RuntimeError):
    """The fleet did not reach a steady state."""


@dataclass(frozen=True)
class Scenario:
    """One fleet's settings: the children's environment and the agent command, and the
    agent worker's heartbeat throttle cap that command implies."""

    name: str
    title: str
    env: dict[str, str] = field(default_factory=dict)
    agent_command: tuple[str, ...] = (sys.executable, "-m", "modelkeeper")
    throttle_cap: timedelta = SDK_MAX_HEARTBEAT_THROTTLE
    #: What exactly runs, for the report.
    how: str = "every setting at its default; today's agent"

    def throttle_s(self) -> float:
        """How often a watch's heartbeat should reach the server: the agent calls
        heartbeat() every WATCH_POLL_S, and the worker sends at most one per
        min(0.8 x timeout, cap)."""
        timeout = float(self.env.get(TIMEOUT_ENV, _default_timeout_s()))
        return max(WATCH_POLL_S, min(SDK_THROTTLE_FRACTION * timeout,
                                     self.throttle_cap.total_seconds()))

    def settings(self) -> dict[str, Any]:
        return {TIMEOUT_ENV: float(self.env.get(TIMEOUT_ENV, _default_timeout_s())),
                "agent": " ".join(["python", *self.agent_command[1:]]),
                "heartbeat reaches the server every (s; expected)": self.throttle_s(),
                "agent's watch calls heartbeat() every (s)": WATCH_POLL_S,
                "other MODELKEEPER_* settings": "defaults"}


def _default_timeout_s() -> float:
    return float(Settings.model_fields["watch_heartbeat_timeout_s"].default)


OLD_AGENT = (sys.executable, "-m", "bench.temporal_cost.old_agent")
SCENARIOS = {
    "now": Scenario("now", "defaults now: watch heartbeat timeout 60 s, SDK default "
                    "throttle"),
    "old": Scenario("old", "old setting: timeout 3 s, heartbeats throttled to 1 s (agent "
                    "before 3f64917)", env={TIMEOUT_ENV: "3"}, agent_command=OLD_AGENT,
                    throttle_cap=MAX_HEARTBEAT_THROTTLE,
                    how=f"{TIMEOUT_ENV}=3 for every component (the API passes it to the "
                    "deployment workflows), and the agents run as `python -m "
                    "bench.temporal_cost.old_agent`: today's agent whose Worker gets "
                    "max_heartbeat_throttle_interval and default_heartbeat_throttle_interval "
                    "= activities.node.MAX_HEARTBEAT_THROTTLE (1 s) again, as it did before "
                    "3f64917; no setting brings that back"),
    "timeout3": Scenario("timeout3", "timeout 3 s with today's agent (SDK default "
                         "throttle, 2.4 s)", env={TIMEOUT_ENV: "3"},
                         how=f"{TIMEOUT_ENV}=3 for every component; today's agent"),
}


async def deploy(api: httpx.AsyncClient, shards: int) -> list[str]:
    """One sim model and a one-replica deployment of it per shard; the deployment ids."""
    ids = []
    for i in range(1, shards + 1):
        model = f"cost-sim-{i}"
        resp = await api.post("/models", json={
            "model_id": model, "engine": "sim", "source": "sim",
            "memory_bytes": CLAIM_BYTES, "engine_args": ENGINE_ARGS})
        resp.raise_for_status()
        resp = await api.post("/deployments", json={"model_id": model, "replicas": 1})
        resp.raise_for_status()
        ids.append(resp.json()["deployment_id"])
    return ids


async def _not_steady(api: httpx.AsyncClient, temporal: Client,
                      deployment_id: str) -> str | None:
    """Why a deployment is not steady yet, or None: serving on one ready replica, and its
    workflow's only pending activity is a started watch that has heartbeated."""
    resp = await api.get(f"/deployments/{deployment_id}")
    if resp.status_code != 200:
        return f"{deployment_id}: the API answered {resp.status_code}"
    view = resp.json()
    states = [r["state"] for r in view["replicas"]]
    if view["status"] != "serving" or states != ["ready"]:
        return f"{deployment_id}: {view['status']}, replicas {states}"
    desc = await temporal.get_workflow_handle(view["workflow_id"]).describe()
    pending = desc.raw_description.pending_activities
    watching = len(pending) == 1 and pending[0].activity_type.name == ACTIVITY_WATCH_SHARD \
        and pending[0].state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED \
        and pending[0].HasField("last_heartbeat_time")
    return None if watching else f"{deployment_id}: the watch is not heartbeating yet"


async def wait_steady(api: httpx.AsyncClient, temporal: Client,
                      deployment_ids: Sequence[str]) -> float:
    """Wait until every deployment is steady; returns how long that took."""
    started = time.monotonic()
    last = "nothing read yet"
    while time.monotonic() - started < STEADY_TIMEOUT_S:
        reasons = [r for d in deployment_ids
                   if (r := await _not_steady(api, temporal, d)) is not None]
        if not reasons:
            return time.monotonic() - started
        last = "; ".join(reasons)
        await asyncio.sleep(STEADY_POLL_S)
    raise BenchError(f"not steady after {STEADY_TIMEOUT_S:.0f}s: {last}")


async def histories(api: httpx.AsyncClient, temporal: Client,
                    deployment_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each deployment's workflow run and history length, and its status in the API."""
    found = {}
    for deployment_id in deployment_ids:
        view = (await api.get(f"/deployments/{deployment_id}")).json()
        desc = await temporal.get_workflow_handle(view["workflow_id"]).describe()
        info = desc.raw_description.workflow_execution_info
        found[deployment_id] = {"workflow_id": view["workflow_id"],
                                "run_id": info.execution.run_id,
                                "history_length": info.history_length,
                                "status": view["status"],
                                "replicas": [r["state"] for r in view["replicas"]]}
    return found


def per_op(counts: metrics.Scrape, counter: str) -> dict[str, int]:
    """What the fleet's namespace counted per operation: frontend RPCs, or database calls
    from any service."""
    found: Counter[str] = Counter()
    for key, value in counts.items():
        if key.counter == counter and key.namespace == NAMESPACE and (
                counter != "service_requests" or key.service == "frontend"):
            found[key.operation] += value
    return dict(sorted(found.items()))


def summarise(rpcs: dict[str, int], persistence: dict[str, int], *, shards: int,
              workers: int, window_s: float) -> dict[str, Any]:
    """Counts in the window and their rates per shard-hour or worker-hour.

    Every RPC that is neither a long poll nor a worker heartbeat is charged to the shards
    (``per_shard_rpcs``): the heartbeats, and anything else the fleet did in the window.
    """
    shard_h, worker_h = shards * window_s / 3600, workers * window_s / 3600
    heartbeat = sum(v for op, v in rpcs.items() if op in HEARTBEAT_OPS)
    polls = sum(v for op, v in rpcs.items() if op in POLL_OPS)
    worker = sum(v for op, v in rpcs.items() if op in WORKER_OPS)
    total = sum(rpcs.values())
    per_shard = total - polls - worker
    queue_db = sum(v for op, v in persistence.items() if TASK_QUEUE_DB in op)
    workflow_db = sum(persistence.values()) - queue_db
    return {
        "heartbeat_rpcs": heartbeat, "per_shard_rpcs": per_shard, "poll_rpcs": polls,
        "worker_heartbeat_rpcs": worker, "all_rpcs": total,
        "workflow_db_requests": workflow_db, "task_queue_db_requests": queue_db,
        "heartbeat_per_shard_hour": round(heartbeat / shard_h, 1),
        "per_shard_rpcs_per_shard_hour": round(per_shard / shard_h, 1),
        "all_rpcs_per_shard_hour": round(total / shard_h, 1),
        "polls_per_worker_hour": round(polls / worker_h, 1),
        "worker_heartbeats_per_worker_hour": round(worker / worker_h, 1),
        "workflow_db_per_shard_hour": round(workflow_db / shard_h, 1),
        "task_queue_db_per_hour": round(queue_db * 3600 / window_s, 1),
    }


async def run_scenario(fleet: Fleet, scenario: Scenario, *, shards: int,
                       window_s: float) -> dict[str, Any]:
    """Start the fleet, deploy, wait steady, and count what the window costs Temporal."""
    t_start = time.monotonic()
    await fleet.start()
    temporal_proc = fleet.started[1]  # postgres, then the dev server (Fleet.start)
    url = await metrics.find_metrics_url(temporal_proc.pid, HOST)
    temporal = await Client.connect(fleet.temporal_address, namespace=NAMESPACE)
    async with httpx.AsyncClient(
            base_url=fleet.api_url, timeout=10.0,
            headers={"Authorization": f"Bearer {fleet.operator_token}"}) as api:
        deployment_ids = await deploy(api, shards)
        steady_s = await wait_steady(api, temporal, deployment_ids)
        print(f"[{scenario.name}] {shards} shards steady {steady_s:.1f}s after deploy; "
              f"window {window_s:.0f}s", flush=True)
        await asyncio.sleep(LEAD_IN_S)
        before = await histories(api, temporal, deployment_ids)
        await asyncio.sleep(METRICS_FLUSH_S)
        # The window: two scrapes, nothing of ours in between.
        # A scrape of ~5,000 series takes a second or so on busy cores: each is taken
        # to have read the counters half-way through.
        asked = time.monotonic()
        first = await metrics.scrape(url)
        t0 = (asked + time.monotonic()) / 2
        await asyncio.sleep(max(0.0, t0 + window_s - time.monotonic()))
        asked = time.monotonic()
        last = await metrics.scrape(url)
        measured_s = (asked + time.monotonic()) / 2 - t0
        after = await histories(api, temporal, deployment_ids)
    counts = metrics.delta(first, last)
    rpcs = per_op(counts, "service_requests")
    persistence = per_op(counts, "persistence_requests")
    workers = 1 + len(fleet.agents)
    deployments = [{
        "deployment_id": d, "workflow_id": before[d]["workflow_id"],
        "history_before": before[d]["history_length"],
        "history_after": after[d]["history_length"],
        "new_events": after[d]["history_length"] - before[d]["history_length"],
        "same_run": before[d]["run_id"] == after[d]["run_id"],
        "status_after": after[d]["status"], "replicas_after": after[d]["replicas"],
    } for d in deployment_ids]
    summary = summarise(rpcs, persistence, shards=shards, workers=workers,
                        window_s=measured_s)
    result = {
        "scenario": scenario.name, "title": scenario.title, "settings": scenario.settings(),
        "env": scenario.env, "shards": shards, "workers": workers,
        "window_s": round(measured_s, 3), "steady_after_deploy_s": round(steady_s, 1),
        "expected_heartbeats_per_shard_hour": round(3600 / scenario.throttle_s(), 1),
        "summary": summary,
        "how": scenario.how,
        "frontend_rpcs": rpcs, "persistence_requests": persistence,
        "deployments": deployments,
        # Every series that moved in the window, any service or namespace: [start, end].
        "raw": {"metrics_url": url,
                "series": {k.label(): [first.get(k, 0), last[k]] for k in sorted(
                    counts, key=metrics.Key.label)}},
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    s = summary
    print(f"[{scenario.name}] heartbeats {s['heartbeat_rpcs']} "
          f"({s['heartbeat_per_shard_hour']}/shard-h), per-shard RPCs "
          f"{s['per_shard_rpcs']} ({s['per_shard_rpcs_per_shard_hour']}/shard-h), "
          f"polls {s['poll_rpcs']} ({s['polls_per_worker_hour']}/worker-h), new history "
          f"events {sum(d['new_events'] for d in deployments)}", flush=True)
    return result


def _run_fleet(args: argparse.Namespace, scenario: Scenario) -> dict[str, Any] | None:
    """One scenario on a fresh fleet, stopped whatever happens; None when interrupted."""
    return on_fresh_fleet(
        f"mk-temporal-cost-{scenario.name}-",
        lambda root: Fleet(root, node_memory=NODE_MEMORY, agent_count=AGENTS,
                           extra_env=dict(scenario.env), agent_command=scenario.agent_command),
        lambda fleet: run_scenario(fleet, scenario, shards=args.shards, window_s=args.window),
        keep=args.keep)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.temporal_cost.run",
                                     description=__doc__.split("\n\n")[0])
    # Two fleets with the default window take about six minutes.
    parser.add_argument("--window", type=float, default=STEADY_WINDOW_S,
                        help="seconds of steady state counted per scenario (default "
                        f"{STEADY_WINDOW_S:.0f}: three heartbeat periods at the defaults)")
    parser.add_argument("--shards", type=int, default=6,
                        help="one-replica sim deployments, all serving (default 6)")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS),
                        default=["now", "old"], help="default: now old")
    parser.add_argument("--note", default="", help="a remark for the results header")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "temporal_cost",
                        help="write OUT.md and OUT.json (default bench/results/temporal_cost)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's folder (logs, data) even when it succeeds")
    parser.add_argument("--from-json", type=Path, metavar="JSON",
                        help="run nothing: write the markdown again from a saved OUT.json")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        args.out.with_suffix(".md").write_text(render(saved["scenarios"], saved["meta"]))
        return 0

    interrupt_on_sigterm()
    started = time.monotonic()
    results = []
    for name in args.scenarios:
        result = _run_fleet(args, SCENARIOS[name])
        if result is None:
            return 130
        results.append(result)
    meta = {
        **run_meta("bench.temporal_cost.run", argv),
        "note": args.note, "target_per_shard_hour": TARGET_PER_SHARD_HOUR,
        "agents": AGENTS, "node_memory": NODE_MEMORY, "claim_bytes": CLAIM_BYTES,
        "engine_args": ENGINE_ARGS, "lead_in_s": LEAD_IN_S, "metrics_flush_s": METRICS_FLUSH_S,
        "window_s_requested": args.window, "total_s": round(time.monotonic() - started, 1),
        "counted": "service_requests{service_name=\"frontend\",namespace=\"default\"} and "
                   "persistence_requests{namespace=\"default\"} from the dev server's "
                   "/metrics, end of window minus start",
    }
    markdown = render(results, meta)
    # Written before anything is printed: a closed stdout must not lose the run.
    write_results(args.out, {"meta": meta, "scenarios": results}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    exit_now(main())
