"""Sharing a cluster (issue 22), measured on a real stack: preemption by class, and a
scope taking back its guarantee.

Run it from the repository root (from a frozen clone, with the machine otherwise idle)::

    .venv/bin/python -m bench.capacity                      # every scenario: the committed run
    .venv/bin/python -m bench.capacity --scenario preempt --out /tmp/capacity

Each scenario starts the stack afresh (:mod:`bench.fleet.stack`) with default settings,
deploys sim models through the API as an operator would and sends requests through the
gateway as a client would; :mod:`bench.capacity.scenarios` says what each measures.
Results go to ``--out`` (``bench/results/capacity``): ``.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, exit_now, interrupt_on_sigterm, on_fresh_fleet
from bench.demand.report import render
from bench.demand.run import FleetShape, make_fleet, run_scenario
from bench.demand.stack import DemandBenchError
from bench.fleet.stack import FleetError
from bench.report import run_meta, write_results

from .scenarios import SCENARIOS, Options

#: Each scenario's nodes. Sim replicas claim 1 GiB (preempt: two fill a node) and hold
#: only a few MiB for real, so that many fit on this machine.
FLEETS = {"preempt": FleetShape(3, "2GiB"), "quota": FleetShape(2, "16GiB")}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", nargs="+", default=["all"],
                        choices=["all", *SCENARIOS], help="what to measure (default all)")
    parser.add_argument("--load-time", type=float, default=2.0,
                        help="the sim engine's load_time_s (default 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "capacity",
                        help="write OUT.md and OUT.json (default bench/results/capacity)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's folder (logs, data) even when it succeeds")
    args = parser.parse_args(argv)
    if "all" in args.scenario:
        args.scenario = list(SCENARIOS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    interrupt_on_sigterm()
    opts = Options(load_time_s=args.load_time)
    scenarios: dict[str, Any] = {}
    failed = 0
    for name in args.scenario:
        shape = FLEETS[name]
        print(f"scenario {name}: {shape.agents} node(s) of {shape.node_memory}", flush=True)
        try:
            found = on_fresh_fleet(f"mk-capacity-{name}-",
                                   functools.partial(make_fleet, shape, {}),
                                   functools.partial(run_scenario, name, opts,
                                                     scenarios=SCENARIOS),
                                   keep=args.keep)
        except (DemandBenchError, FleetError, httpx.HTTPError) as exc:
            failed += 1
            found = {"title": name, "error": f"{type(exc).__name__}: {exc}"}
            print(f"scenario {name} failed: {found['error']}", flush=True)
        if found is None:
            return 130
        scenarios[name] = found
    result = {"meta": run_meta("bench.capacity", argv), "scenarios": scenarios}
    write_results(args.out, result,
                  render(result, title="Sharing a cluster (issue 22): bench/capacity"))
    print(args.out.with_suffix(".md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    exit_now(main())
