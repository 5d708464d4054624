"""bench/demand's pure parts: the figures its scenarios are made of (runs, windows, gaps,
what a demand event did, when an eviction happened), how an answer is classified, and
the markdown and plot of a result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.demand.client import Answer, classify
from bench.demand.report import (
    draw,
    drops,
    gaps,
    most_in_window,
    render,
    row,
    runs_summary,
    step_kind,
)


def test_a_few_runs_give_their_median_and_nearest_rank_p90() -> None:
    ten = [0.1 * v for v in range(10, 0, -1)]
    summary = runs_summary(ten)
    assert summary == {"n": 10, "min": 0.1, "median": 0.55, "p90": 0.9, "max": 1.0}
    assert runs_summary([]) == {"n": 0}


def test_most_in_window_counts_the_worst_half_open_window() -> None:
    assert most_in_window([], 60.0) == 0
    assert most_in_window([0.0, 60.0, 120.0], 60.0) == 1  # exactly one window apart
    assert most_in_window([0.0, 59.9, 120.0], 60.0) == 2
    assert most_in_window([100.0, 0.0, 30.0, 31.0], 60.0) == 3  # unsorted input
    assert gaps([30.0, 0.0, 75.5]) == [30.0, 45.5]
    assert gaps([1.0]) == []


def test_a_demand_event_says_which_step_it_was_with_or_without_its_stamp() -> None:
    assert step_kind("2026-12-03 18:00:01: +1: 3 waiting on 1 ready for 5 s") == "add"
    assert step_kind("2026-12-03 18:00:01: -1 (d-1-r2): quiet: nothing waiting") == "retire"
    assert step_kind("+1: loading: 1 request(s) waiting") == "add"
    assert step_kind("2026-12-03 18:00:01: sleep d-1-r1: unused for 3 s") == "sleep"
    assert step_kind("wake d-1-r1: 1 request(s) waiting") == "wake"
    assert step_kind("2026-12-03 18:00:01: evicted d-2-r1 idle 1 min to place d-1") \
        == "other"


def test_an_eviction_is_a_model_whose_live_replicas_fall_to_none() -> None:
    samples = [(0.0, {"a": 0, "b": 0}), (1.0, {"a": 1, "b": 0}), (2.0, {"a": 1, "b": 0}),
               (3.0, {"a": 0, "b": 0}), (4.0, {"a": 0, "b": 1}), (5.0, {"b": 0})]
    assert drops(samples) == [(3.0, "a"), (5.0, "b")]
    assert drops([]) == []


def test_only_a_503_with_retry_after_saying_loading_is_the_documented_answer() -> None:
    body = '{"error": {"message": "model m is loading"}}'
    assert classify(200, "", {}) is Answer.OK
    assert classify(503, body, {"Retry-After": "2"}) is Answer.LOADING
    assert classify(503, body, {}) is Answer.OTHER  # no Retry-After
    assert classify(503, "no ready replica", {"retry-after": "2"}) is Answer.OTHER
    assert classify(404, body, {"Retry-After": "2"}) is Answer.OTHER
    assert classify(None, "", {}) is Answer.OTHER


def _result() -> dict[str, Any]:
    return {
        "meta": {"command": "python -m bench.demand --scenario cold wake", "date": "d",
                 "cores": 2, "python": "3.11", "code": "abc", "plot": "demand.png",
                 "settings": {"eviction protection window": "X = 60 s"}},
        "scenarios": {
            "cold": {"title": "1. Cold", "rows": [
                row("runs", 3), row("overhead (s)", 0.42, "<= 0.5", True)],
                "notes": ["a note"],
                "series": {"kind": "runs", "values": [0.4, 0.42, 0.45], "target": 0.5,
                           "ylabel": "s"}},
            "wake": {"title": "2. Wake", "rows": [row("first token (s)", 0.5, "<= 0.35",
                                                      False)],
                     "series": {"kind": "timeline", "ylabel": "ready",
                                "lines": {"ready": [(0.0, 1), (5.0, 2)]},
                                "marks": [(1.0, "16 clients")]}},
            "evict": {"title": "5. Evict", "error": "FleetError: no agent"},
        },
    }


def test_the_markdown_names_the_command_each_target_and_what_was_missed() -> None:
    text = render(_result())
    assert "`python -m bench.demand --scenario cold wake`" in text
    assert "**Targets:** 1 of 2 met; missed: wake: first token (s)." in text
    assert "| overhead (s) | 0.420 | <= 0.5 | met |" in text
    assert "| first token (s) | 0.500 | <= 0.35 | **missed** |" in text
    assert "**Not measured:** FleetError: no agent" in text
    assert "![the scenarios](demand.png)" in text
    assert "- a note" in text


@pytest.mark.slow  # matplotlib's import and first draw: some 10 s on busy cores
def test_the_plot_has_a_panel_per_scenario_with_a_series(tmp_path: Path) -> None:
    path = tmp_path / "demand.png"
    draw(_result(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
