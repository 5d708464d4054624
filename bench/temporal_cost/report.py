"""The Temporal cost benchmark's results as markdown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else "NOT met"


def _by_op(scenarios: Sequence[dict[str, Any]], key: str) -> list[str]:
    lines = ["| operation | " + " | ".join(sc["scenario"] for sc in scenarios) + " |",
             "|---|" + "---|" * len(scenarios)]
    for op in sorted({op for sc in scenarios for op in sc[key]}):
        lines.append(f"| {op} | " + " | ".join(
            str(sc[key].get(op, 0)) for sc in scenarios) + " |")
    return lines


def _writes_per_heartbeat(scenario: dict[str, Any]) -> str:
    s = scenario["summary"]
    if not s["heartbeat_rpcs"]:
        return "no heartbeat"
    return f"{s['workflow_db_requests'] / s['heartbeat_rpcs']:.2f} writes"


def render(scenarios: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The summary table, the verdict, every operation counted, and each deployment's
    history over the window."""
    target = meta["target_per_shard_hour"]
    first = scenarios[0]
    lines = [
        "# Temporal RPCs per serving shard",
        "",
        f"Made with `{meta['command']}` on {meta['date']}: {meta['cores']} cores, Python "
        f"{meta['python']}, code {meta['code']}. Whole run {meta['total_s']:.0f} s."
        + (f" {meta['note']}" if meta["note"] else ""),
        "",
        "Each scenario runs on a fresh fleet (`bench/fleet/stack.py`: embedded "
        "PostgreSQL, the Temporal dev server, control worker, API, gateway, "
        f"{meta['agents']} agents declaring {meta['node_memory']}), one after another. It "
        f"deploys {first['shards']} sim-engine models of one replica each (engine_args "
        f"`{meta['engine_args']}`), waits until all serve and every watch has heartbeated, "
        f"waits {meta['lead_in_s']:.0f} s, reads each workflow's history length, waits "
        f"{meta['metrics_flush_s']:.0f} s (the server's counters lag by up to a second), "
        "and counts a steady window: no fault, and no request from the benchmark to the "
        f"API or Temporal. Counted: {meta['counted']}. The dev server's own system worker "
        "(namespace `temporal_system`) and the internal history and matching calls are "
        "left out. Rates scale the window's counts to an hour.",
        "",
        "| scenario | window | heartbeat RPCs | per shard-hour (expected) "
        "| per-shard RPCs¹ | per shard-hour | long polls per worker-hour "
        "| worker heartbeats per worker-hour | every RPC ÷ shards, per shard-hour² "
        "| workflow DB requests per shard-hour³ | new history events |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sc in scenarios:
        s = sc["summary"]
        events = sum(d["new_events"] for d in sc["deployments"])
        lines.append(
            f"| {sc['title']} | {sc['window_s']:.0f} s | {s['heartbeat_rpcs']} | "
            f"{s['heartbeat_per_shard_hour']:,.0f} "
            f"({sc['expected_heartbeats_per_shard_hour']:,.0f}) | {s['per_shard_rpcs']} | "
            f"**{s['per_shard_rpcs_per_shard_hour']:,.0f}** | "
            f"{s['polls_per_worker_hour']:,.0f} | "
            f"{s['worker_heartbeats_per_worker_hour']:,.0f} | "
            f"{s['all_rpcs_per_shard_hour']:,.0f} | {s['workflow_db_per_shard_hour']:,.0f} | "
            f"{events} |")
    workers = first["workers"]
    lines += [
        "",
        "1. Every frontend RPC in namespace `default` except long polls "
        "(`Poll*TaskQueue`) and the SDK's `RecordWorkerHeartbeat`, which each worker "
        "process makes whatever the number of shards it watches.",
        f"2. Everything, long polls and worker heartbeats of the {workers} worker processes "
        f"(control worker and {workers - 1} agents) included, spread over only "
        f"{first['shards']} shards. These per-worker costs do not grow with the shards.",
        "3. `persistence_requests` other than the matching service's task-queue "
        "bookkeeping (`*TaskQueue*`, lease renewals per queue, shown below): here only "
        "`UpdateWorkflowExecution`. "
        + ", ".join(f"{sc['scenario']}: {_writes_per_heartbeat(sc)}" for sc in scenarios)
        + " per heartbeat; the server's metrics do not say what the extra writes are "
        "(likely the heartbeat-timeout timer being re-armed).",
        "",
        f"**Target: ≤ {target} Temporal RPCs per serving shard-hour.**",
        "",
    ]
    for sc in scenarios:
        s = sc["summary"]
        per_worker = s["polls_per_worker_hour"] + s["worker_heartbeats_per_worker_hour"]
        lines.append(
            f"- **{sc['scenario']}**: {s['per_shard_rpcs_per_shard_hour']:,.0f} per-shard "
            f"RPCs per shard-hour ({s['heartbeat_per_shard_hour']:,.0f} of them heartbeats): "
            f"**{_verdict(s['per_shard_rpcs_per_shard_hour'], target)}**. Each worker "
            f"process adds about {per_worker:,.0f} RPCs per hour (long polls and worker "
            "heartbeats) whatever it watches; charged to these "
            f"{sc['shards']} shards that is {s['all_rpcs_per_shard_hour']:,.0f} per "
            f"shard-hour. Ran: {sc['how']}. Settings: "
            + "; ".join(f"{k} = {v}" for k, v in sc["settings"].items()) + ".")
    lines += ["", "## Every frontend operation counted in the window", "",
              *_by_op(scenarios, "frontend_rpcs"), "",
              "Database requests (`persistence_requests`, namespace `default`, every "
              "service):", "", *_by_op(scenarios, "persistence_requests"), "",
              "## History events per deployment over the window", "",
              "| scenario | deployment | history length before → after | new events "
              "| status after |", "|---|---|---|---|---|"]
    for sc in scenarios:
        for d in sc["deployments"]:
            run = "" if d["same_run"] else " (continued as new)"
            lines.append(f"| {sc['scenario']} | {d['deployment_id']} | "
                         f"{d['history_before']} → {d['history_after']}{run} | "
                         f"{d['new_events']} | {d['status_after']}, replicas "
                         f"{', '.join(d['replicas_after'])} |")
    lines.append("")
    return "\n".join(lines)
