"""Following demand (issue 21), measured on a real stack: cold start from zero, wake from
sleep, warm standby, step load, two models with room for one, idle history.

Run it from the repository root::

    .venv/bin/python -m bench.demand --scenario all --runs 10      # the committed run
    .venv/bin/python -m bench.demand --scenario cold --runs 3 --out /tmp/demand
    .venv/bin/python -m bench.demand --scenario evict --evict-duration 120 --out /tmp/demand

Each scenario starts the stack afresh (:mod:`bench.fleet.stack`: embedded PostgreSQL, the
Temporal dev server, the control worker, the API, the gateway and the agents its fleet
needs, :data:`FLEETS`), with default settings but the protection window when
``--protect-s`` is given, deploys sim models with a scaling policy and sends requests
through the gateway as a client would. What each measures is in
:mod:`bench.demand.scenarios`.

Results go to ``--out`` (``bench/results/demand``): ``.md``, ``.json`` and ``.png``. With
``--merge`` the scenarios run now replace theirs in an existing ``OUT.json`` and the rest
are kept, so one scenario can be measured again without the others.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from temporalio.client import Client

from bench.common import ROOT, exit_now, interrupt_on_sigterm, on_fresh_fleet
from bench.fleet.stack import NAMESPACE, Fleet, FleetError
from bench.report import run_meta, write_results

from .report import draw, render
from .scenarios import SCENARIOS, Options
from .stack import API_TIMEOUT_S, DemandBenchError, Stack, protection_setting


class FleetShape(NamedTuple):
    agents: int
    node_memory: str


#: Each scenario's nodes. Sim models claim 1 GiB (512 MiB of weights): ``evict``'s node
#: has room for one replica; ``standby`` needs a second node for its standby; ``step``
#: room for four replicas.
FLEETS = {"cold": FleetShape(1, "4GiB"), "wake": FleetShape(1, "4GiB"),
          "standby": FleetShape(2, "4GiB"), "step": FleetShape(2, "4GiB"),
          "evict": FleetShape(1, "1536MiB"), "idle": FleetShape(1, "4GiB")}
def make_fleet(shape: FleetShape, extra_env: dict[str, str], root: Path) -> Fleet:
    return Fleet(root, node_memory=shape.node_memory, agent_count=shape.agents,
                 extra_env=extra_env)


async def run_scenario(name: str, opts: Any, fleet: Fleet, *,
                       scenarios: Mapping[str, Callable[[Stack, Any], Awaitable[dict[str, Any]]]]
                       = SCENARIOS) -> dict[str, Any]:
    """Start ``fleet`` and run one of ``scenarios`` on it (bench.capacity passes its own)."""
    await fleet.start()
    key = await fleet.client_key()
    temporal = await Client.connect(fleet.temporal_address, namespace=NAMESPACE)
    async with httpx.AsyncClient(
            base_url=fleet.api_url, timeout=API_TIMEOUT_S,
            headers={"Authorization": f"Bearer {fleet.operator_token}"}) as api:
        return await scenarios[name](Stack(fleet, api, temporal, key), opts)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.demand",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", nargs="+", default=["all"],
                        choices=["all", *SCENARIOS], help="what to measure (default all)")
    parser.add_argument("--runs", type=int, default=10,
                        help="repeats of cold, wake and standby (default 10)")
    parser.add_argument("--load-time", type=float, default=2.0,
                        help="the sim engine's load_time_s (default 2, the issue's)")
    parser.add_argument("--wake-time", type=float, default=0.2,
                        help="the sim engine's wake_time_s (default 0.2, the issue's)")
    parser.add_argument("--evict-duration", type=float, default=600.0,
                        help="seconds of alternate asking in evict (default 600, the issue's)")
    parser.add_argument("--idle-window", type=float, default=600.0,
                        help="seconds the idle scenario watches the histories (default 600)")
    parser.add_argument("--protect-s", type=float, default=None,
                        help="the eviction protection window, seconds (default: the "
                        "setting's default, measured as it is)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "demand",
                        help="write OUT.md, OUT.json, OUT.png (default bench/results/demand)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other scenarios of an existing OUT.json")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's folder (logs, data) even when it succeeds")
    parser.add_argument("--from-json", type=Path, metavar="JSON",
                        help="run nothing: write the markdown and plot again from OUT.json")
    args = parser.parse_args(argv)
    if "all" in args.scenario:
        args.scenario = list(SCENARIOS)
    return args


def write(result: dict[str, Any], out: Path) -> None:
    """OUT.json, OUT.md and OUT.png (linked from the markdown by its name, beside it)."""
    png = out.with_suffix(".png")
    result["meta"]["plot"] = png.name
    write_results(out, result, render(result))
    draw(result, png)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.from_json:
        write(json.loads(args.from_json.read_text()), args.out)
        return 0
    interrupt_on_sigterm()
    setting = protection_setting()
    extra_env: dict[str, str] = {}
    protect_s = args.protect_s
    if setting is not None and protect_s is not None:
        extra_env[setting[0]] = str(protect_s)
    elif setting is not None:
        protect_s = setting[1]
    opts = Options(runs=args.runs, load_time_s=args.load_time, wake_time_s=args.wake_time,
                   evict_duration_s=args.evict_duration, idle_window_s=args.idle_window,
                   protect_s=protect_s if protect_s is not None else float("nan"))
    saved = args.out.with_suffix(".json")
    scenarios: dict[str, Any] = (json.loads(saved.read_text())["scenarios"]
                                 if args.merge and saved.exists() else {})
    failed = 0
    for name in args.scenario:
        shape = FLEETS[name]
        print(f"scenario {name}: {shape.agents} node(s) of {shape.node_memory}", flush=True)
        try:
            found = on_fresh_fleet(
                f"mk-demand-{name}-",
                functools.partial(make_fleet, shape, extra_env),
                functools.partial(run_scenario, name, opts), keep=args.keep)
        except (DemandBenchError, FleetError, httpx.HTTPError) as exc:
            failed += 1
            found = {"title": name, "error": f"{type(exc).__name__}: {exc}"}
            print(f"scenario {name} failed: {found['error']}", flush=True)
        if found is None:
            return 130
        scenarios[name] = found
    meta = {**run_meta("bench.demand", argv),
            "settings": {"eviction protection window": (
                f"{setting[0]} = {protect_s:g} s" if setting else "no such setting yet")}}
    result = {"meta": meta, "scenarios": {n: scenarios[n] for n in SCENARIOS
                                          if n in scenarios}}
    write(result, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    exit_now(main())
