"""The scale benchmark's report: a table of every cost per size with how it grows, the
goals, the PNG of each cost against size, and the README's short table."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MiB, KiB = 1 << 20, 1 << 10

Row = tuple[str, Callable[[dict[str, Any]], float | None], str]


def _get(data: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _q(*path: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def read(size: dict[str, Any]) -> float | None:
        value = _get(size, *path)
        return None if value is None else float(value) * scale
    return read


def _mem(name: str, key: str, unit: int) -> Callable[[dict[str, Any]], float | None]:
    return _q("memory", key, name, scale=1 / unit)


def _idle_cores(size: dict[str, Any]) -> float | None:
    """Cores the whole stack used while idle: near the machine's count, it was saturated
    (and the per-node figures above it only share out what there was)."""
    idle = size.get("idle")
    if not idle:
        return None
    return float(sum(idle["cpu_s"].values())) / float(idle["wall_s"])


def _fleet_per_node(size: dict[str, Any]) -> float | None:
    after = _get(size, "memory", "after_bytes", "fleet")
    return None if after is None else after / size["size"] / KiB


#: (label, value per size, unit). The growth column compares the smallest and largest size.
ROWS: list[Row] = [
    ("nodes registered and ready, after the fleet starts", _q("register_s"), "s"),
    ("idle, CPU per node-second: API", _q("idle", "cpu_ms_per_node_s", "api"), "ms"),
    ("idle, CPU per node-second: fleet agent (the harness)",
     _q("idle", "cpu_ms_per_node_s", "fleet"), "ms"),
    ("idle, CPU per node-second: PostgreSQL",
     _q("idle", "cpu_ms_per_node_s", "postgres"), "ms"),
    ("idle, CPU per node-second: Temporal dev server",
     _q("idle", "cpu_ms_per_node_s", "temporal"), "ms"),
    ("idle, cores the whole stack used", _idle_cores, ""),
    ("idle, heartbeat round trip p99", _q("idle", "heartbeat_s", "p99", scale=1e3), "ms"),
    ("live nodes marked silent while idle", _q("idle", "false_silences"), ""),
    ("live nodes marked silent while placing", _q("deploy", "false_silences"), ""),
    ("POST of every deployment (all of them)", _q("deploy", "post_all_s"), "s"),
    ("POST latency p50", _q("deploy", "post_latency_s", "p50", scale=1e3), "ms"),
    ("POST latency p99", _q("deploy", "post_latency_s", "p99", scale=1e3), "ms"),
    ("**first POST → all serving**", _q("deploy", "all_serving_s"), "s"),
    ("POST → placed p50", _q("deploy", "post_to_placed_s", "p50"), "s"),
    ("POST → placed p99", _q("deploy", "post_to_placed_s", "p99"), "s"),
    ("POST → ready p99", _q("deploy", "post_to_ready_s", "p99"), "s"),
    ("placements per second", _q("deploy", "placements_per_s"), "/s"),
    ("placement call p50 (PlacementStore.place_replica)", _q("deploy", "placement_ms", "p50"),
     "ms"),
    ("placement call p99", _q("deploy", "placement_ms", "p99"), "ms"),
    ("… waiting its turn behind the worker's other placements p99",
     _q("deploy", "turn_wait_ms", "p99"), "ms"),
    ("placement transaction p50 (its turn come)", _q("deploy", "transaction_ms", "p50"), "ms"),
    ("**placement transaction p99**", _q("deploy", "transaction_ms", "p99"), "ms"),
    ("… of which lock wait p50", _q("deploy", "lock_wait_ms", "p50"), "ms"),
    ("… of which lock wait p99", _q("deploy", "lock_wait_ms", "p99"), "ms"),
    ("… of which waiting for a connection p99", _q("deploy", "pool_wait_ms", "p99"), "ms"),
    ("… the rest (reads, place(), writes) p50", _q("deploy", "work_ms", "p50"), "ms"),
    ("… the rest (reads, place(), writes) p99", _q("deploy", "work_ms", "p99"), "ms"),
    ("heartbeat round trip, idle, p50", _q("heartbeat", "idle", "p50", scale=1e3), "ms"),
    ("heartbeat round trip, idle, p99", _q("heartbeat", "idle", "p99", scale=1e3), "ms"),
    ("heartbeat round trip while placing, p50",
     _q("heartbeat", "placing", "p50", scale=1e3), "ms"),
    ("heartbeat round trip while placing, p99",
     _q("heartbeat", "placing", "p99", scale=1e3), "ms"),
    ("heartbeat round trip during the recovery, p99",
     _q("heartbeat", "recovery", "p99", scale=1e3), "ms"),
    ("nodes killed at once (10 %)", _q("recovery", "killed_nodes"), ""),
    ("deployments affected", _q("recovery", "affected"), ""),
    ("**kill → every affected deployment serves again**",
     _q("recovery", "all_serving_again_s"), "s"),
    ("kill → replacement ready p50", _q("recovery", "replacement_ready_s", "p50"), "s"),
    ("**history events per deployment-hour**",
     _q("steady", "events_per_deployment_hour"), ""),
    ("Temporal RPCs per deployment-hour (all, polls included)",
     _q("steady", "summary", "all_rpcs_per_shard_hour"), ""),
    ("… of them per deployment (heartbeats, other calls)",
     _q("steady", "summary", "per_shard_rpcs_per_shard_hour"), ""),
    ("… long polls per worker-hour", _q("steady", "summary", "polls_per_worker_hour"), ""),
    ("worker memory per deployment", _mem("worker", "per_deployment_bytes", KiB), "KiB"),
    ("API memory per deployment", _mem("api", "per_deployment_bytes", KiB), "KiB"),
    ("gateway memory per deployment", _mem("gateway", "per_deployment_bytes", KiB), "KiB"),
    ("worker memory, growth per deployment",
     _mem("worker", "growth_per_deployment_bytes", KiB), "KiB"),
    ("API memory, growth per deployment",
     _mem("api", "growth_per_deployment_bytes", KiB), "KiB"),
    ("gateway memory, growth per deployment",
     _mem("gateway", "growth_per_deployment_bytes", KiB), "KiB"),
    ("fleet agent memory per node", _fleet_per_node, "KiB"),
]


def growth(sizes: Sequence[int], values: Sequence[float | None]) -> str:
    """How a cost grows from the smallest size to the largest: the exponent k of
    cost ∝ N^k, in words; "-" unless both ends have a value above zero."""
    if len(sizes) < 2 or sizes[0] == sizes[-1]:
        return "-"
    (n0, v0), (n1, v1) = (sizes[0], values[0]), (sizes[-1], values[-1])
    if v0 is None or v1 is None or v0 <= 0 or v1 <= 0:
        return "-"
    k = math.log(v1 / v0) / math.log(n1 / n0)
    if abs(k) < 0.25:
        word = "flat"
    elif k < 0:
        word = "falls"
    elif k < 0.75:
        word = "sublinear"
    elif k < 1.25:
        word = "linear"
    else:
        word = "superlinear"
    return f"N^{k:.2f} ({word})"


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("", "/s") and float(value).is_integer():
        text = f"{int(value):,}"
    elif abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}".strip()


def _sizes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every size with anything measured (one that broke down part-way included)."""
    return [s for s in result["sizes"] if "register_s" in s]


def table(result: dict[str, Any], rows: Sequence[Row] = ROWS) -> str:
    good = _sizes(result)
    sizes = [s["size"] for s in good]
    head = "| | " + " | ".join(f"{n:,} nodes" for n in sizes) + " | growth |"
    lines = [head, "|---|" + "---:|" * len(sizes) + "---|"]
    # Growth between the sizes that completed, when two did: a size that broke down shows
    # a machine past saturation, whose figures say so rather than how a cost grows.
    done = [s for s in good if "error" not in s]
    basis = done if len(done) >= 2 else good
    for label, read, unit in rows:
        values = [read(s) for s in good]
        if all(v is None for v in values):
            continue
        lines.append(f"| {label} | " + " | ".join(_fmt(v, unit) for v in values)
                     + f" | {growth([s['size'] for s in basis], [read(s) for s in basis])} |")
    return "\n".join(lines) + "\n"


def goals(result: dict[str, Any]) -> list[str]:
    """One line per goal, judged at the largest size measured."""
    good = _sizes(result)
    if not good:
        return ["No size completed."]
    g = result["meta"]["goals"]
    big = max(good, key=lambda s: s["size"])
    n = f"{big['size']:,} nodes"
    checks = [
        (f"{big['size']:,} deployments serving within {g['serving_s']:.0f} s of being posted",
         _get(big, "deploy", "all_serving_s"), g["serving_s"], "s"),
        (f"placement p99 under {g['placement_p99_ms']:.0f} ms at {n}",
         _get(big, "deploy", "placement_ms", "p99"), g["placement_p99_ms"], "ms"),
        (f"recovery from a 10 % node loss within {g['recovery_s']:.0f} s at {n}",
         _get(big, "recovery", "all_serving_again_s"), g["recovery_s"], "s"),
        (f"at most {g['events_per_deployment_hour']:.0f} history events per serving "
         "deployment-hour", _get(big, "steady", "events_per_deployment_hour"),
         g["events_per_deployment_hour"], ""),
    ]
    lines = []
    for what, value, limit, unit in checks:
        if value is None:
            why = f"the run broke down first ({big['error']})" if "error" in big \
                else "not measured"
            lines.append(f"- {what}: **NOT met**: {why}")
            continue
        verdict = "met" if value <= limit else "NOT met"
        lines.append(f"- {what}: {_fmt(value, unit)}, **{verdict}**")
    return lines


def render(result: dict[str, Any]) -> str:
    meta = result["meta"]
    good = _sizes(result)
    out = [
        "# The control plane at 100, 300 and 1,000 nodes",
        "",
        f"Made with `{meta['command']}` on {meta['date']}: {meta['cores']} cores and "
        f"{meta['memory_gib']} GiB shared by every process below, Python {meta['python']}, "
        f"code {meta['code']}. Whole run {meta['elapsed_s']:.0f} s.",
        "",
        "Each size runs on a fresh stack (bench/fleet/scale.py: embedded PostgreSQL, the "
        "Temporal dev server, the control worker, the API, the gateway, every setting at its "
        "default) and one process that is N simulated nodes (`python -m bench.fleet "
        f"--fleet N --memory {meta['node_memory']}`: the real agent's code for each node, "
        "each with its own id, credential, task queue and Temporal worker, registration, "
        "heartbeats every 2 s and liveness stream; sim engines served in-process). N sim "
        f"models claiming {meta['claim_bytes'] // (1 << 30)} GiB each (engine_args "
        f"`{meta['engine_args']}`) get one one-replica deployment each, POSTed at once "
        f"({meta['post_concurrency']} in flight); two replicas fit a node, so placement "
        "packs them onto half the nodes. Then a steady window of "
        f"{meta['window_s']:.0f} s in which the benchmark touches nothing, then "
        f"{meta['kill_share']:.0%} of the nodes, each holding replicas, die at once.",
        "",
    ]
    if meta.get("profiled"):
        out += [f"**Profiled run** ({', '.join(meta['profiled'])} under cProfile): "
                "slower than unprofiled; its numbers are for finding where time goes, "
                "not for the table of record.", ""]
    out += ["## Goals", "", *goals(result), ""]
    for failed in (s for s in result["sizes"] if "error" in s):
        out += [f"- {failed['size']:,} nodes: **did not complete**: {failed['error']}", ""]
    if meta.get("notes"):
        out += [meta["notes"].rstrip(), ""]
    out += ["## Every cost, per size", "", table(result),
            "Growth: the exponent k of cost ∝ N^k between the smallest and the largest size "
            "that completed (a size that broke down is a machine past saturation).",
            "Placement in the store is `PlacementStore.place_replica` as the worker timed it (its "
            "DEBUG lines, `modelkeeper.store.placement`): every attempt of the claim "
            "transaction, with the time spent waiting on advisory locks and on a pooled "
            "connection shown apart. POST → placed and POST → ready are on the store's "
            "clock (the deployment's `created_at`, its replica's `started_at` and "
            "`ready_at`). Heartbeat round trips are what the fleet's nodes saw (sent at the "
            "agent, answered at the agent), so they include the fleet's own event loop. "
            "Memory is resident memory with children, measured once the nodes are up "
            "(before) and once every deployment serves (after).",
            "", f"![each cost against size]({meta.get('png', 'scale.png')})", ""]
    out += ["## Where the CPU went", "",
            "CPU seconds each process used in each phase (all processes share the cores).",
            ""]
    procs = ("postgres", "temporal", "worker", "api", "gateway", "fleet")
    out.append("| size | phase | wall | " + " | ".join(procs) + " |")
    out.append("|---|---|---:|" + "---:|" * len(procs))
    for s in good:
        phases = [("register", s.get("register_s"), s.get("cpu_register_s")),
                  ("idle", _get(s, "idle", "wall_s"), _get(s, "idle", "cpu_s")),
                  ("deploy", _get(s, "deploy", "all_serving_s"), _get(s, "deploy", "cpu_s")),
                  ("steady window", _get(s, "steady", "window_s"), _get(s, "steady", "cpu_s")),
                  ("recovery", _get(s, "recovery", "all_serving_again_s"),
                   _get(s, "recovery", "cpu_s"))]
        for phase, wall, cpu in phases:
            if cpu is None:
                continue
            out.append(f"| {s['size']:,} | {phase} | {_fmt(wall, 's')} | "
                       + " | ".join(f"{cpu.get(p, 0):.1f}" for p in procs) + " |")
    out.append("")
    for other in meta.get("other_runs") or []:
        d = other.get("deploy") or {}
        out += [f"Another run of {other['size']:,} nodes ({other.get('note', 'same code')}, "
                f"load average before "
                f"{(other.get('load_average') or {}).get('before')}): "
                f"{other.get('error', 'completed')}; live nodes marked silent while placing: "
                f"{d.get('false_silences')}; heartbeat round trip while placing: "
                f"{(other.get('heartbeat') or {}).get('placing')}.", ""]
    out += ["## Per size", ""]
    for s in good:
        d, r = s.get("deploy", {}), s.get("recovery", {})
        st = s.get("steady", {})
        load = s.get("load_average") or {}
        out += [f"### {s['size']:,} nodes", "",
                f"- Load average (1, 5, 15 min) before: {load.get('before')}, after: "
                f"{load.get('after')}; whole size {s.get('elapsed_s')} s.",
                f"- Placement attempts per call: {d.get('attempts')}; timing lines read: "
                f"{d.get('placement_timing_lines')}.",
                f"- Statuses when the deploy ended: {d.get('statuses_at_end')}."]
        if st:
            out += [f"- Steady window {st['window_s']} s: {st['new_events']} new history "
                    f"events in all ({st['most_new_events']} at most in one workflow), "
                    f"{st['continued_as_new']} continued as new; history length "
                    f"{st['history_length']}. Frontend RPCs: {st['rpcs']}."]
        if r:
            out += [f"- Recovery: {r['killed_nodes']} nodes with {r['killed_engines']} "
                    f"engines killed; {r['recovered']} of {r['affected']} affected "
                    f"deployments serving again; first seen serving again "
                    f"{r['seen_serving_again_s']} s after the kill; replacements ready "
                    f"{r['replacement_ready_s']} s; gateway after: {r.get('gateway')}."]
        for name, top in (s.get("profiles") or {}).items():
            if not top:
                continue
            out += ["", f"Hottest functions of the {name} (own time, cProfile):", "",
                    "| function | calls | own s | share | cumulative s |",
                    "|---|---:|---:|---:|---:|"]
            out += [f"| `{t['function']}` | {t['calls']:,} | {t['own_s']} | "
                    f"{t['own_share']:.1%} | {t['cumulative_s']} |" for t in top[:15]]
        out.append("")
    return "\n".join(out)


#: The README's rows: the goals' numbers and how they grow.
README_ROWS: list[Row] = [
    ("first POST → all serving", _q("deploy", "all_serving_s"), "s"),
    ("placement call p99 (its queue included)", _q("deploy", "placement_ms", "p99"), "ms"),
    ("placement transaction p50", _q("deploy", "transaction_ms", "p50"), "ms"),
    ("live nodes marked silent while placing", _q("deploy", "false_silences"), ""),
    ("heartbeat round trip while placing p99",
     _q("heartbeat", "placing", "p99", scale=1e3), "ms"),
    ("10 % of nodes killed → all serving again", _q("recovery", "all_serving_again_s"), "s"),
    ("history events per deployment-hour", _q("steady", "events_per_deployment_hour"), ""),
    ("Temporal RPCs per deployment-hour",
     _q("steady", "summary", "all_rpcs_per_shard_hour"), ""),
    ("worker + API + gateway memory per deployment",
     lambda s: sum(_get(s, "memory", "per_deployment_bytes", n) or 0
                   for n in ("worker", "api", "gateway")) / KiB or None, "KiB"),
]


def readme_table(result: dict[str, Any]) -> str:
    return table(result, README_ROWS)


def draw(result: dict[str, Any], path: Path) -> None:
    """Each cost against size, log-log, with the goals as dashed lines."""
    import matplotlib
    matplotlib.use("Agg")  # no display: draw to a file
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    good = _sizes(result)
    sizes = [s["size"] for s in good]
    goals_ = result["meta"]["goals"]
    panels: list[tuple[str, list[tuple[str, Callable[[dict[str, Any]], float | None]]],
                       float | None]] = [
        ("first POST → all serving (s)", [("all serving", _q("deploy", "all_serving_s")),
                                           ("POST → placed p99",
                                            _q("deploy", "post_to_placed_s", "p99"))],
         goals_["serving_s"]),
        ("placement (ms)", [("call p99, its queue included",
                             _q("deploy", "placement_ms", "p99")),
                            ("transaction p50", _q("deploy", "transaction_ms", "p50")),
                            ("transaction p99", _q("deploy", "transaction_ms", "p99")),
                            ("lock wait p99", _q("deploy", "lock_wait_ms", "p99"))],
         goals_["placement_p99_ms"]),
        ("heartbeat round trip p99 (ms)",
         [("idle", _q("heartbeat", "idle", "p99", scale=1e3)),
          ("placing", _q("heartbeat", "placing", "p99", scale=1e3)),
          ("recovery", _q("heartbeat", "recovery", "p99", scale=1e3))], None),
        ("10 % killed → all serving again (s)",
         [("all", _q("recovery", "all_serving_again_s")),
          ("replacement ready p50", _q("recovery", "replacement_ready_s", "p50"))],
         goals_["recovery_s"]),
        ("per deployment-hour (0 events: not drawn)", [("Temporal RPCs",
                                  _q("steady", "summary", "all_rpcs_per_shard_hour")),
                                 ("history events",
                                  _q("steady", "events_per_deployment_hour"))],
         goals_["events_per_deployment_hour"]),
        ("memory per deployment (KiB)",
         [(n, _mem(n, "per_deployment_bytes", KiB)) for n in ("worker", "api", "gateway")],
         None),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (title, series, goal) in zip(axes.flat, panels, strict=True):
        for label, read in series:
            pts = [(n, v) for n, v in zip(sizes, (read(s) for s in good), strict=True)
                   if v is not None and v > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if goal is not None:
            ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label="goal")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("nodes (= deployments)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bench/scale: cost against size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
