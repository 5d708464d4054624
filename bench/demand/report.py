"""The demand bench's figures, its markdown and its plot. Pure but for :func:`draw`.

Each scenario's result is a dict with a ``title``, ``rows`` (one per figure: what it is,
the value measured, the target and whether it was met; :func:`row`), ``notes`` and the
``series`` its panel of the plot draws. The helpers here (:func:`runs_summary`,
:func:`most_in_window`, :func:`gaps`) are what the scenarios' figures are made of, so that
each has its test.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.stats import percentile, spread

#: The time a keeper's demand note starts with ("2026-12-03 18:00:00: ").
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d: ")
#: Figures are written to the millisecond: the polls and the clients' clocks resolve no finer.
DIGITS = 3


def runs_summary(values: Sequence[float]) -> dict[str, float]:
    """n, min, median, p90 (nearest rank) and max of a few repeated measurements;
    ``{"n": 0}`` for none."""
    if not values:
        return {"n": 0}
    least, median, most = spread(values)
    return {"n": len(values), "min": round(least, DIGITS), "median": round(median, DIGITS),
            "p90": round(percentile(values, 0.9), DIGITS), "max": round(most, DIGITS)}


def most_in_window(times: Sequence[float], window_s: float) -> int:
    """The most of ``times`` (seconds) that fall within any half-open window
    ``[t, t + window_s)``: "evictions per protection window" at its worst."""
    ordered = sorted(times)
    most, start = 0, 0
    for end, t in enumerate(ordered):
        while ordered[start] <= t - window_s:
            start += 1
        most = max(most, end - start + 1)
    return most


def gaps(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive ``times``, in order."""
    ordered = sorted(times)
    return [round(b - a, DIGITS) for a, b in itertools.pairwise(ordered)]


def step_kind(message: str) -> str:
    """What a demand event did, from the keeper's note ("<date> <time>: +1: …",
    "…: -1 (r): …", "…: sleep r: …", "…: wake r: …"): add, retire, sleep, wake or other."""
    text = STAMP.sub("", message, count=1)
    for prefix, kind in (("+1", "add"), ("-1", "retire"), ("sleep ", "sleep"),
                         ("wake ", "wake")):
        if text.startswith(prefix):
            return kind
    return "other"


def drops(samples: Sequence[tuple[float, dict[str, int]]]) -> list[tuple[float, str]]:
    """When each model's live replicas fell from some to none, in order: with no idle
    stop, every such fall on a node with room for one is an eviction."""
    found = []
    for (_, before), (t, after) in itertools.pairwise(samples):
        found += [(t, m) for m, n in before.items() if n > 0 and after.get(m, 0) == 0]
    return found


def row(figure: str, value: float | int | str | None, target: str = "",
        met: bool | None = None) -> dict[str, Any]:
    """One line of a scenario's table: ``met`` None where the issue sets no target."""
    return {"figure": figure, "value": value, "target": target, "met": met}


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _met(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: ""}[met]


def scenario_markdown(name: str, scenario: dict[str, Any]) -> list[str]:
    """One scenario: its title, the table of figures, its notes."""
    lines = [f"## {scenario['title']} (`--scenario {name}`)", ""]
    if scenario.get("error"):
        lines += [f"**Not measured:** {scenario['error']}", ""]
    if scenario.get("rows"):
        lines += ["| figure | value | target | |", "|---|---:|---|---|"]
        lines += [f"| {r['figure']} | {_cell(r['value'])} | {r['target']} | {_met(r['met'])} |"
                  for r in scenario["rows"]]
        lines.append("")
    lines += [f"- {note}" for note in scenario.get("notes", [])]
    return [*lines, ""] if scenario.get("notes") else lines


def render(result: dict[str, Any], *,
           title: str = "Following demand (issue 21): bench/demand") -> str:
    """The whole markdown: the header (command, date, machine, commit), a summary of every
    target, then each scenario."""
    meta, scenarios = result["meta"], result["scenarios"]
    lines = [f"# {title}", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}, "
             f"{meta['cores']} cores, Python {meta['python']}, code {meta['code']}"]
    lines += [f"- {k}: {v}" for k, v in meta.get("settings", {}).items()]
    if meta.get("plot"):
        lines += ["", f"![the scenarios]({meta['plot']})"]
    targets = [(name, r) for name, s in scenarios.items() for r in s.get("rows", [])
               if r["met"] is not None]
    missed = [f"{name}: {r['figure']}" for name, r in targets if not r["met"]]
    lines += ["", f"**Targets:** {len(targets) - len(missed)} of {len(targets)} met"
              + (f"; missed: {'; '.join(missed)}" if missed else "") + ".", ""]
    for name, scenario in scenarios.items():
        lines += scenario_markdown(name, scenario)
    return "\n".join(lines).rstrip() + "\n"


def draw(result: dict[str, Any], path: Path) -> None:
    """One panel per scenario measured, each from its ``series``."""
    import matplotlib
    matplotlib.use("Agg")  # no display: draw to a file
    import matplotlib.pyplot as plt

    drawn = [(n, s) for n, s in result["scenarios"].items() if s.get("series")]
    if not drawn:
        return
    fig, axes = plt.subplots(len(drawn), 1, figsize=(11, 3.2 * len(drawn)), squeeze=False)
    for ax, (name, scenario) in zip(axes[:, 0], drawn, strict=True):
        series = scenario["series"]
        ax.set_title(scenario["title"], fontsize=9)
        match series["kind"]:
            case "runs":
                # One bar per run, the target as a line.
                ys = series["values"]
                ax.bar(range(1, len(ys) + 1), ys, color="tab:blue")
                if series.get("target") is not None:
                    ax.axhline(series["target"], color="tab:red", lw=0.8, ls="--",
                               label=f"target {series['target']:g} s")
                    ax.legend(loc="upper right", fontsize=7)
                ax.set_xlabel("run")
                ax.set_ylabel(series["ylabel"])
            case "timeline":
                for label, points in series["lines"].items():
                    xs, ys = zip(*points, strict=True) if points else ((), ())
                    ax.step(xs, ys, where="post", lw=1.0, label=label)
                for x, label in series.get("marks", []):
                    ax.axvline(x, color="grey", lw=0.6, ls=":")
                    ax.annotate(label, (x, 0), fontsize=6, rotation=90, va="bottom")
                ax.set_xlabel("seconds since the scenario began")
                ax.set_ylabel(series["ylabel"])
                ax.legend(loc="upper right", fontsize=7)
            case "answers":
                for label, points in series["points"].items():
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.scatter(xs, ys, s=8, label=label)
                for x in series.get("marks", []):
                    ax.axvline(x, color="tab:red", lw=0.6, ls=":")
                ax.set_xlabel("seconds since the scenario began (dotted: evictions)")
                ax.set_ylabel(series["ylabel"])
                ax.legend(loc="upper right", fontsize=7)
            case other:
                raise ValueError(f"{name}: no way to draw a {other!r} series")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
