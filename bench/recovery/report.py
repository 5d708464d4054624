"""The recovery benchmark's results as markdown, and the settings it measured."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from activities.node import MAX_HEARTBEAT_THROTTLE
from agent.engine_process import POLL_INTERVAL_S as AGENT_WATCH_POLL_S
from bench.stats import spread
from modelkeeper.domain.tunables import Tunables
from modelkeeper.settings import Settings, env_var_names

#: The project's target for steps 1 and 2 together (notice + place), at the median.
TARGET_NOTICE_PLACE_S = 3.0
#: Settings that decide how fast a crash is noticed and repaired: reported with the results.
REPORTED_SETTINGS = ("heartbeat_interval_s", "node_unreachable_after_s",
                     "watch_heartbeat_timeout_s", "replica_lost_after_s",
                     "start_backoff_initial_s", "settling_window_s",
                     "gateway_wait_for_replica_s", "gateway_retries")


def settings_in_force() -> dict[str, Any]:
    """The defaults a run measures (its children get no MODELKEEPER_* variable)."""
    fields = Settings.model_fields
    found: dict[str, Any] = {env_var_names(n)[0]: fields[n].default for n in REPORTED_SETTINGS}
    timings = Tunables()
    found["watch heartbeats reach the server every (s; agent poll, SDK throttle)"] = \
        max(AGENT_WATCH_POLL_S, MAX_HEARTBEAT_THROTTLE.total_seconds())
    found["Tunables.node_schedule_to_start_s"] = timings.node_schedule_to_start_s
    found["Tunables.probe_timeout_s"] = timings.probe_timeout_s
    found["surge on unreachable, precise statuses"] = "always (0.2)"
    return found


def _failed(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "0"


def _audit_placed(result: dict[str, Any]) -> float:
    """When the audit log says the replica that served was placed (seconds after t0)."""
    return float(next(p["at_s"] for p in result["placements"]
                      if p["replica"] == result["serving_replica"]))


def scenario_section(scenario: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """One scenario: the step table, the client's failures, the target, every crash."""
    results: list[dict[str, Any]] = scenario["results"]
    rows = [
        ("1. notice", "crash → replica unreachable or deployment degraded",
         [r["notice_s"] for r in results]),
        ("2. place", "notice → the replacement that served is placed (its row appears)",
         [r["place_s"] for r in results]),
        ("1 + 2", "crash → that replacement placed", [r["placed_s"] for r in results]),
        ("1 + 2, audit log", "crash → its `replica.placed` event (server clock)",
         [_audit_placed(r) for r in results]),
        ("3. load", "placed → first success through the gateway (includes the sim's "
         f"load_time_s {meta['load_time_s']:g} s)", [r["load_s"] for r in results]),
        ("total gap", "crash → first success through the gateway",
         [r["first_success_s"] for r in results]),
    ]
    lines = [
        f"## {scenario['title']}",
        "",
        f"The model claims {scenario['claim_gib']} GiB per replica on nodes declaring "
        f"{meta['node_memory']}. {len(results)} crashes.",
        "",
        "| step | from → to | min | median | max |",
        "|---|---|---|---|---|",
    ]
    for name, what, values in rows:
        lo, mid, hi = spread(values)
        lines.append(f"| {name} | {what} | {lo:.2f} s | {mid:.2f} s | {hi:.2f} s |")

    # The requests sent from the first crash on; the ones before it met the first deploy.
    window: Counter[str] = Counter()
    for r in results:
        window.update(r["failed"])
    failed = sum(window.values())
    before = scenario["client"]["sent"] - sum(r["requests"] for r in results)
    failed_before = sum(scenario["client"]["failed"].values()) - failed
    notice_place = statistics.median(r["placed_s"] for r in results)
    gap = statistics.median(r["first_success_s"] for r in results)
    load = statistics.median(r["load_s"] for r in results)
    met = notice_place <= TARGET_NOTICE_PLACE_S
    wasted = [(r["crash"], p) for r in results for p in r["placements"]
              if p["replica"] != r["serving_replica"]]
    crashed_node_tries = sum(1 for c, p in wasted
                             if p["node"] == results[c - 1]["node"])
    notice_by = Counter(r["notice_by"] for r in results)
    lines += [
        "",
        f"**Target** (1 + 2 ≤ {TARGET_NOTICE_PLACE_S:g} s at the median): "
        f"**{notice_place:.2f} s, {'met' if met else 'NOT met'}**. Total gap median "
        f"{gap:.2f} s, against {TARGET_NOTICE_PLACE_S:g} s + the load ({load:.2f} s) = "
        f"{TARGET_NOTICE_PLACE_S + load:.2f} s.",
        "",
        f"- Client, from the first crash on: {sum(r['requests'] for r in results):,} requests, "
        f"**{failed} failed** ({_failed(dict(window))}); the longest that succeeded took "
        f"{max(r['longest_ok_s'] for r in results):.2f} s (the gateway holds a request with no "
        f"live replica to send it to, up to its wait budget). Before the first crash (the "
        f"first deploy): {before:,} requests, {failed_before} failed.",
        f"- Placements that never served: {len(wasted)}, {crashed_node_tries} of them on the "
        "node that had just crashed.",
        "- First sign seen by the poll: "
        + ", ".join(f"{k} ({v})" for k, v in notice_by.most_common()) + ".",
        "- Steady again after the agent's restart (old replica stopped and released, node "
        "ready, new watch heartbeating): median "
        f"{statistics.median(r['steady_again_s'] for r in results):.1f} s.",
        "",
        "| crash | crashed → served from | notice | place | load | gap | placements (audit "
        "log, s after the crash) | failed requests |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {r['crash']} | {r['node']} → {r['serving_node']} | {r['notice_s']:.2f} s | "
          f"{r['place_s']:.2f} s | {r['load_s']:.2f} s | {r['first_success_s']:.2f} s | "
          + ", ".join(f"{p['node']} {p['at_s']:.2f}" for p in r["placements"])
          + f" | {_failed(r['failed'])} |" for r in results),
        "",
    ]
    return lines


def render(scenarios: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The whole results file."""
    lines = [
        "# Recovery from a whole-node crash",
        "",
        f"Made with `{meta['command']}` on {meta['date']}: {meta['cores']} cores shared with "
        f"other work, Python {meta['python']}, code {meta.get('code', '?')}"
        + (f"; {meta['note']}" if meta["note"] else "")
        + ". A crash is kill -9 of the agent holding the deployment's one replica and of "
        "every engine it started; once the model serves again the agent is restarted (it "
        "rejoins as the same node), and the next crash waits for a steady state. A client "
        f"sends a one-token chat completion through the gateway every {meta['pace_ms']:g} ms "
        "(open loop) throughout.",
        "",
    ]
    for scenario in scenarios:
        lines += scenario_section(scenario, meta)
    lines += [
        "## Settings and set-up",
        "",
        "Every setting is its default: the children get no `MODELKEEPER_*` or `TEMPORAL_*` "
        "variable beyond where the servers are. Each agent is given only its declared "
        "memory and a port range for its engines (three agents share one machine). The "
        "gateway keeps client auth on, with a key issued in the store.",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| `{k}` | {v} |" for k, v in meta["settings"].items()),
        "",
        f"{meta['agents']} agents; the sim engine holds 16 MiB (`engine_args.memory_bytes`) "
        f"and loads for `load_time_s` {meta['load_time_s']:g} s. Step times are seen by "
        f"polling `GET /deployments/{{id}}` every {meta['poll_ms']:g} ms (each is late by up "
        "to one interval plus the read); the audit-log row and `recovery.json` give the "
        "server's own timestamps (`deployment.degraded`, `replica.placed`, ...) for every "
        "crash.",
        "",
    ]
    return "\n".join(lines)
