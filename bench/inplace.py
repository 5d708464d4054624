"""How long an engine crash leaves a one-replica deployment without service when the
engine is relaunched in place, and whether any request fails meanwhile.

Run it from the repository root::

    .venv/bin/python -m bench.inplace --crashes 5

It starts the whole stack (:mod:`bench.fleet.stack`: embedded PostgreSQL, the Temporal dev
server, the control worker, the API, the gateway and one agent), deploys one replica of
the sim engine (``load_time_s`` 2 by default, 100 tokens/s), and runs through the gateway

* **4 closed-loop clients**, each sending a chat completion of 20 tokens (0.2 s of
  generation), not streamed, as soon as its last one is answered: a crash finds each in
  the middle of a request;
* **a probe**: a one-token chat completion every 50 ms (open loop), whose first success
  among those sent at or after a crash is when the model serves again.

Then, N times: once the deployment is steady (serving, its replica ready and watched, a
request served) and 3 s of load more (and a random part of one request's 0.2 s, so a kill
lands anywhere in the clients' requests), kill -9 the engine's process group (``t0``) and
time, from ``t0``:

* **withdrawn**: the replica is seen out of routing (``GET /deployments/{id}`` every 50
  ms: its state is no longer ``ready``);
* **ready**: it is seen ready again;
* **re-served**: the probe's first success among the requests sent at or after ``t0``
  ends; and **re-served minus the load**, the overhead of the relaunch beyond the engine's
  own load (the sim's ``load_time_s``).

Each crash says which path it took: **relaunched** (the same replica, node and endpoint,
a ``replica.relaunched`` event and no placement) or **placed again** (a new replica and a
``replica.placed`` event), and which requests failed from its ``t0`` to the next crash's.

This runs once per ``--relaunch-tries`` value, each on a fresh stack with
``MODELKEEPER_RELAUNCH_TRIES`` set to it and every other setting at its default: by
default 5 (every crash relaunched), 3 (the default: 3 relaunches in 600 s, then the
replica is placed again) and 0 (relaunching off: each crash placed again, as before).

Results go to ``--out`` (``bench/results/inplace.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

from agent.engine_process import NODE_ENV, REPLICA_ENV
from bench.common import ROOT, exit_now, interrupt_on_sigterm, on_fresh_fleet
from bench.fleet.stack import NAMESPACE, Fleet
from bench.recovery.client import REQUEST_TIMEOUT_S, Outcome, SteadyClient, tally
from bench.recovery.run import deploy, deployment_view
from bench.report import run_meta, write_results
from bench.stats import spread
from modelkeeper.domain.tunables import Tunables
from modelkeeper.names import ACTIVITY_WATCH_SHARD
from modelkeeper.settings import Settings, env_var_names

MODEL = "inplace-sim"
MiB, GiB = 1 << 20, 1 << 30
#: The closed-loop clients, the issue's 4.
CLIENTS = 4
#: Each client's request: 20 tokens at the sim's 100 tokens/s, 0.2 s of generation, not
#: streamed. A kill lands in the middle of one for each client; the engine drops its
#: connection before a byte of the answer, which the gateway may send again (a stream cut
#: after its first byte may not be, by anyone but its client).
CLIENT_TOKENS = 20
SIM_TOKENS_PER_S = 100.0
#: Steady load before each kill, plus a random share of one request's length, so that
#: kills land at any point of the clients' requests.
STEADY_LOAD_S = 3.0
#: The probe's pace: the resolution of "re-served".
PROBE_PACE_S = 0.05
#: How often the control plane's view is read during a recovery: the resolution of the
#: withdrawn and ready times.
POLL_S = 0.05
#: From a crash until served again: a relaunch takes the load and under a second more; a
#: placement one more second; past a minute it is stuck, and the run stops with the logs.
RECOVERY_TIMEOUT_S = 60.0
#: Until steady again between crashes (the first deployment also waits out the settling
#: window, 15 s by default).
STEADY_TIMEOUT_S = 120.0
STEADY_POLL_S = 0.2
#: The project's target for re-served minus the load, at the median (issue 23).
TARGET_OVER_LOAD_S = 0.5
#: Settings reported with the results (all at their defaults but relaunch_tries).
REPORTED_SETTINGS = ("relaunch_tries", "relaunch_window_s", "gateway_wait_for_replica_s",
                     "gateway_retries", "gateway_breaker_failures", "settling_window_s")


class InplaceError(RuntimeError):
    """A recovery or a steady state did not come in time."""


@dataclass
class ClosedLoop:
    """``CLIENTS`` clients, each sending its next request once the last is answered."""

    url: str
    key: str
    answers: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        body = {"model": MODEL, "max_tokens": CLIENT_TOKENS,
                "messages": [{"role": "user", "content": "relaunch bench"}]}
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                headers={"Authorization": f"Bearer {self.key}"}) as http:
            await asyncio.gather(*(self._client(http, body) for _ in range(CLIENTS)))

    def stop(self) -> None:
        self._stop.set()

    async def _client(self, http: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                async with http.post(self.url, json=body) as resp:
                    await resp.read()
                    status, error = resp.status, None
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, error = None, type(exc).__name__
            self.answers.append(Outcome(sent, time.monotonic(), status, error))

    def ended_between(self, start: float, end: float) -> list[Outcome]:
        """The requests that ended in [start, end): a crash's own are those it found in
        flight and those sent after it, until the next."""
        return [a for a in self.answers if start <= a.ended < end]


async def _watched(temporal: Client, workflow_id: str) -> bool:
    """True when the replica's watch runs and has heartbeated: the next exit is seen by
    it, not by a watch still starting."""
    desc = await temporal.get_workflow_handle(workflow_id).describe()
    return any(p.activity_type.name == ACTIVITY_WATCH_SHARD
               and p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
               and p.HasField("last_heartbeat_time")
               for p in desc.raw_description.pending_activities)


async def wait_steady(api: httpx.AsyncClient, temporal: Client, probe: SteadyClient,
                      deployment_id: str) -> dict[str, Any]:
    """Until the deployment serves on one ready, watched replica and a probe sent after
    that succeeded; returns the replica."""
    deadline = time.monotonic() + STEADY_TIMEOUT_S
    last = "nothing read yet"
    while time.monotonic() < deadline:
        view = await deployment_view(api, deployment_id)
        if view is None:
            last = "the API did not answer"
        elif view["status"] != "serving" or [r["state"] for r in view["replicas"]] != [
                "ready"]:
            last = (f"deployment {view['status']}, replicas "
                    f"{[(r['replica_id'], r['state']) for r in view['replicas']]}")
        elif not await _watched(temporal, view["workflow_id"]):
            last = "the replica's watch is not running yet"
        else:
            since = time.monotonic()
            while probe.first_success_after(since) is None:
                if time.monotonic() > deadline:
                    raise InplaceError("steady, but no probe through the gateway succeeds")
                await asyncio.sleep(STEADY_POLL_S)
            replica: dict[str, Any] = view["replicas"][0]
            return replica
        await asyncio.sleep(STEADY_POLL_S)
    raise InplaceError(f"not steady after {STEADY_TIMEOUT_S:.0f}s: {last}")


#: A log line's time, as the agent's and the sim's logging write it.
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"
#: How long the log lines of a relaunch may take to reach their files (the engine's pass
#: through the agent's log filter).
LOG_WAIT_S = 5.0


async def first_logged(path: Path, words: str, *, after_wall: float) -> float | None:
    """The wall-clock time of the first line of ``path`` holding ``words`` logged at or
    after ``after_wall``; None when none comes within LOG_WAIT_S."""
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if words not in line:
                    continue
                with contextlib.suppress(ValueError):
                    at = datetime.strptime(line[:23], LOG_TIME_FORMAT).timestamp()
                    if at >= after_wall:
                        return at
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(POLL_S)


def engine_groups(node_id: str, replica_id: str) -> tuple[list[int], set[int]]:
    """The pids of ``replica_id``'s engine on ``node_id`` and their process groups, by the
    markers every engine carries in its environment."""
    pids = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if env.get(NODE_ENV) == node_id and env.get(REPLICA_ENV) == replica_id:
                pids.append(proc.pid)
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())
    return pids, groups


async def crash_once(index: int, fleet: Fleet, api: httpx.AsyncClient, temporal: Client,
                     probe: SteadyClient, deployment_id: str, *, load_time_s: float,
                     rng: random.Random) -> dict[str, Any]:
    """Kill the replica's engine; time its withdrawal, its return and the probe's first
    success; say which path it took."""
    await wait_steady(api, temporal, probe, deployment_id)
    await asyncio.sleep(STEADY_LOAD_S + rng.uniform(0, CLIENT_TOKENS / SIM_TOKENS_PER_S))
    replica = await wait_steady(api, temporal, probe, deployment_id)
    node = replica["nodes"][0]
    pids, groups = engine_groups(node, replica["replica_id"])
    if not groups:
        raise InplaceError(f"crash {index}: no engine found for {replica['replica_id']}")
    t0, t0_wall = time.monotonic(), time.time()
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    withdrawn: float | None = None
    ready: float | None = None
    back: dict[str, Any] | None = None
    while True:
        view = await deployment_view(api, deployment_id)
        at = time.monotonic()
        if view is not None:
            states = {r["replica_id"]: r for r in view["replicas"]}
            old = states.get(replica["replica_id"])
            if withdrawn is None and (old is None or old["state"] != "ready"):
                withdrawn = at
            serving = [r for r in view["replicas"] if r["state"] == "ready"]
            if withdrawn is not None and ready is None and serving:
                ready, back = at, serving[0]
        success = probe.first_success_after(t0)
        if ready is not None and success is not None:
            break
        if at - t0 > RECOVERY_TIMEOUT_S:
            raise InplaceError(f"crash {index}: not served again {RECOVERY_TIMEOUT_S:.0f}s "
                               f"after the kill of {replica['replica_id']}'s engine")
        await asyncio.sleep(POLL_S)
    assert withdrawn is not None and ready is not None and back is not None

    events = (await api.get("/events", params={"deployment_id": deployment_id,
                                               "limit": 200})).json()
    after = [e for e in events if datetime.fromisoformat(e["at"]).timestamp() >= t0_wall]
    kinds = [e["kind"] for e in after]
    relaunched = (back["replica_id"] == replica["replica_id"]
                  and "replica.relaunched" in kinds and "replica.placed" not in kinds)
    new_pids, _ = engine_groups(back["nodes"][0], back["replica_id"])
    reserved_s = success.ended - t0
    # Where the time went, from the logs (one machine, one clock): the agent's launch of
    # the new engine, and the engine's own word that it is ready (its process start, the
    # Python interpreter's included, and its load).
    [agent] = fleet.agents
    launched = await first_logged(fleet.root / "logs" / f"{agent.name}.log",
                                  f"launched {back['replica_id']} on port", after_wall=t0_wall)
    engine_ready = await first_logged(
        agent.data_dir / "agent" / "logs" / f"{back['replica_id']}.log", "ready after",
        after_wall=t0_wall)
    result = {
        "_t0": t0,
        "crash": index,
        "path": "relaunched" if relaunched else "placed again",
        "replica": replica["replica_id"],
        "served_by": back["replica_id"],
        "node": node,
        "same_node": back["nodes"] == replica["nodes"],
        "endpoint": replica["endpoint"],
        "same_endpoint": back["endpoint"] == replica["endpoint"],
        "engine_pids_killed": pids,
        "engine_pids_after": new_pids,
        "withdrawn_s": round(withdrawn - t0, 3),
        "ready_seen_s": round(ready - t0, 3),
        "reserved_s": round(reserved_s, 3),
        "reserved_minus_load_s": round(reserved_s - load_time_s, 3),
        "launched_s": None if launched is None else round(launched - t0_wall, 3),
        "engine_ready_s": None if engine_ready is None else round(engine_ready - t0_wall, 3),
        "relaunch_note": back.get("relaunch_note"),
        "events": [{"kind": e["kind"], "message": e["message"],
                    "at_s": round(datetime.fromisoformat(e["at"]).timestamp() - t0_wall, 3)}
                   for e in after],
    }
    print(f"crash {index}: {result['path']} ({replica['replica_id']} -> "
          f"{back['replica_id']}, endpoint {'kept' if result['same_endpoint'] else 'moved'}):"
          f" withdrawn {result['withdrawn_s']:.2f}s, ready {result['ready_seen_s']:.2f}s, "
          f"re-served {reserved_s:.2f}s (load {load_time_s:g} s)", flush=True)
    return result


async def run_scenario(args: argparse.Namespace, fleet: Fleet, tries: int) -> dict[str, Any]:
    """Start the fleet, deploy, and kill the replica's engine ``args.crashes`` times."""
    await fleet.start()
    key = await fleet.client_key()
    temporal = await Client.connect(fleet.temporal_address, namespace=NAMESPACE)
    url = f"{fleet.gateway_url}/v1/chat/completions"
    probe = SteadyClient(url, MODEL, key, PROBE_PACE_S)
    load = ClosedLoop(url, key)
    results: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(
            base_url=fleet.api_url, timeout=10.0,
            headers={"Authorization": f"Bearer {fleet.operator_token}"}) as api:
        deployment_id = await deploy(api, claim_bytes=GiB, load_time_s=args.load_time,
                                     engine_args={"tokens_per_second": SIM_TOKENS_PER_S},
                                     model_id=MODEL)
        probing = asyncio.create_task(probe.run())
        loading = asyncio.create_task(load.run())
        try:
            for index in range(1, args.crashes + 1):
                results.append(await crash_once(index, fleet, api, temporal, probe,
                                                deployment_id, load_time_s=args.load_time,
                                                rng=rng))
            # The last crash's requests: until steady again, and as much load as the
            # others had after theirs.
            await wait_steady(api, temporal, probe, deployment_id)
            await asyncio.sleep(STEADY_LOAD_S)
        finally:
            probe.stop()
            load.stop()
            await asyncio.gather(probing, loading)
    first_t0 = results[0]["_t0"] if results else float("inf")
    ends = [r["_t0"] for r in results[1:]] + [float("inf")]
    for result, end in zip(results, ends, strict=True):
        start = result.pop("_t0")
        mine = load.ended_between(start, end)
        probes = probe.between(start, end)
        # The clients' requests the kill found in flight: each must still be answered.
        result["client_in_flight_at_kill"] = sum(1 for a in load.answers
                                                 if a.sent < start < a.ended)
        result["client_requests"] = len(mine)
        result["client_failed"] = dict(Counter(a.label for a in mine if not a.ok))
        result["probe_requests"] = len(probes)
        result["probe_failed"] = tally(probes)
        result["longest_client_ok_s"] = round(max((a.ended - a.sent for a in mine if a.ok),
                                                  default=0.0), 3)
    # Before the first crash the model was loading for the first time: requests sent then
    # waited out the gateway's budget (the settling window holds the first placement 15 s)
    # and some got a 503. Counted apart: the crashes are what is measured.
    before_clients = [a for a in load.answers if a.ended < first_t0]
    before_probes = [o for o in probe.outcomes if o.sent < first_t0]
    return {
        "relaunch_tries": tries,
        "results": results,
        "clients": {"sent": len(load.answers),
                    "failed": dict(Counter(a.label for a in load.answers if not a.ok)),
                    "before_first_crash": len(before_clients),
                    "failed_before_first_crash": dict(Counter(
                        a.label for a in before_clients if not a.ok))},
        "probe": {"sent": len(probe.outcomes), "failed": tally(probe.outcomes),
                  "before_first_crash": len(before_probes),
                  "failed_before_first_crash": tally(before_probes)},
    }


# -- the report ------------------------------------------------------------------------------


def settings_in_force() -> dict[str, Any]:
    """The defaults a run measures (MODELKEEPER_RELAUNCH_TRIES set per scenario)."""
    fields = Settings.model_fields
    found: dict[str, Any] = {env_var_names(n)[0]: fields[n].default for n in REPORTED_SETTINGS}
    found["Tunables.start_timeout_s"] = Tunables().start_timeout_s
    return found


def _failed(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "0"


def _title(tries: int) -> str:
    if tries == 0:
        return "Relaunching off (MODELKEEPER_RELAUNCH_TRIES=0): each crash placed again"
    return f"MODELKEEPER_RELAUNCH_TRIES={tries}" + (" (the default)" if tries == 3 else "")


def scenario_section(scenario: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    results: list[dict[str, Any]] = scenario["results"]
    load = meta["load_time_s"]
    lines = [f"## {_title(scenario['relaunch_tries'])}", ""]
    paths = Counter(r["path"] for r in results)
    lines.append(f"{len(results)} crashes: " + ", ".join(
        f"{n} {path}" for path, n in sorted(paths.items())) + ".")
    lines += ["", "| path | crashes | withdrawn (min / median / max) | ready again | "
              "re-served | re-served minus the load |", "|---|---|---|---|---|---|"]
    for path in sorted(paths):
        mine = [r for r in results if r["path"] == path]
        cells = []
        for key in ("withdrawn_s", "ready_seen_s", "reserved_s", "reserved_minus_load_s"):
            lo, mid, hi = spread([r[key] for r in mine])
            cells.append(f"{lo:.2f} / **{mid:.2f}** / {hi:.2f} s")
        lines.append(f"| {path} | {len(mine)} | " + " | ".join(cells) + " |")
    timed = [r for r in results if r["launched_s"] is not None
             and r["engine_ready_s"] is not None]
    if timed:
        lines += ["", "Where the time went, from the logs (median of the crashes whose lines "
                  "were found):", "",
                  "| step | from → to | median |", "|---|---|---|"]
        steps = [
            ("notice and act", "kill → the agent launches the new engine",
             [r["launched_s"] for r in timed]),
            ("the engine's own start", "launched → the engine logs it is ready (its "
             f"process start, Python's included, and its load of {load:g} s)",
             [r["engine_ready_s"] - r["launched_s"] for r in timed]),
            ("back in routing", "engine ready → the probe's first success (the agent's "
             "readiness probe, the keeper, the store write, the gateway)",
             [r["reserved_s"] - r["engine_ready_s"] for r in timed]),
        ]
        for name, what, values in steps:
            lines.append(f"| {name} | {what} | {statistics.median(values):.2f} s |")
    failed = Counter[str]()
    for r in results:
        failed.update(r["client_failed"])
        failed.update(r["probe_failed"])
    relaunched = [r["reserved_minus_load_s"] for r in results if r["path"] == "relaunched"]
    lines.append("")
    if relaunched:
        median = statistics.median(relaunched)
        met = "met" if median <= TARGET_OVER_LOAD_S else "missed"
        lines.append(f"**Target** (relaunched: re-served ≤ the load + {TARGET_OVER_LOAD_S:g} s "
                     f"at the median, 0 failed requests): **{median:.2f} s over the load "
                     f"({load:g} s), {met}**; failed requests from the first crash on: "
                     f"**{_failed(dict(failed))}**.")
    else:
        lines.append(f"Failed requests from the first crash on: **{_failed(dict(failed))}**.")
    clients, probe = scenario["clients"], scenario["probe"]
    lines += ["", f"- Closed-loop clients ({CLIENTS}, {CLIENT_TOKENS} tokens each, not "
              f"streamed): {clients['sent']:,} requests in the run; before the first crash "
              f"(the model's first load, which the settling window delays 15 s) "
              f"{clients['before_first_crash']:,}, failed: "
              f"{_failed(clients['failed_before_first_crash'])}; in all, failed: "
              f"{_failed(clients['failed'])}.",
              f"- Probe (1 token every {PROBE_PACE_S * 1e3:.0f} ms): {probe['sent']:,} "
              f"requests; before the first crash {probe['before_first_crash']:,}, failed: "
              f"{_failed(probe['failed_before_first_crash'])}; in all, failed: "
              f"{_failed(probe['failed'])}.",
              "", "| crash | path | replica → served by | same node, endpoint | withdrawn | "
              "ready | re-served | minus load | clients in flight at the kill | client requests "
              "ended before the next crash (failed) | longest client ok | probe failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['crash']} | {r['path']} | {r['replica']} → {r['served_by']} | "
            f"{'yes' if r['same_node'] else 'no'}, {'yes' if r['same_endpoint'] else 'no'} | "
            f"{r['withdrawn_s']:.2f} s | {r['ready_seen_s']:.2f} s | {r['reserved_s']:.2f} s | "
            f"{r['reserved_minus_load_s']:+.2f} s | {r['client_in_flight_at_kill']} | "
            f"{r['client_requests']} "
            f"({_failed(r['client_failed'])}) | {r['longest_client_ok_s']:.2f} s | "
            f"{_failed(r['probe_failed'])} |")
    notes = [r["relaunch_note"] for r in results if r["path"] == "relaunched"]
    if notes:
        lines += ["", f"The replica's note after the last relaunch: \"{notes[-1]}\"."]
    return lines


def render(scenarios: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Relaunch in place: an engine crash under load",
        "",
        f"Made with `{meta['command']}` on {meta['date']}: {meta['cores']} cores shared "
        f"with other work (load average {meta['loadavg_before'][0]:g} before the run, "
        f"{meta['loadavg_after'][0]:g} after), Python {meta['python']}, code {meta['code']}"
        + (f"; {meta['note']}" if meta.get("note") else "") + ".",
        "",
        f"One agent, one replica of the sim engine (`load_time_s` {meta['load_time_s']:g} s, "
        f"{SIM_TOKENS_PER_S:g} tokens/s), {CLIENTS} closed-loop clients and a probe through "
        "the gateway (auth on). A crash is kill -9 of the engine's process group, once the "
        "deployment is steady (serving, watched, a probe served) and after 3 s more of "
        "load. "
        "Times are from the kill: *withdrawn* and *ready* as `GET /deployments/{id}` shows "
        f"them (polled every {POLL_S * 1e3:.0f} ms, so late by up to that and a read), "
        "*re-served* when the probe's first request sent after the kill succeeds, "
        "*re-served minus the load* what the crash cost beyond the engine's own load.",
        "",
    ]
    by_path: dict[str, list[float]] = {}
    for scenario in scenarios:
        for r in scenario["results"]:
            by_path.setdefault(r["path"], []).append(r["reserved_minus_load_s"])
    if by_path:
        lines += ["Re-served minus the load, median over every scenario: " + "; ".join(
            f"{path} {statistics.median(values):.2f} s ({len(values)} crashes)"
            for path, values in sorted(by_path.items())) + ".", ""]
    for scenario in scenarios:
        lines += [*scenario_section(scenario, meta), ""]
    lines += ["## Settings", "", "Every setting is its default except "
              "`MODELKEEPER_RELAUNCH_TRIES`, set per scenario.", "", "| setting | default |",
              "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in meta["settings"].items()]
    return "\n".join(lines) + "\n"


def make_fleet(root: Path, *, tries: int) -> Fleet:
    """One node (4 GiB declared), every setting at its default but the relaunch tries."""
    return Fleet(root, node_memory="4GiB", agent_count=1,
                 extra_env={"MODELKEEPER_RELAUNCH_TRIES": str(tries)})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inplace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--crashes", type=int, default=5, help="engine crashes (default 5)")
    parser.add_argument("--load-time", type=float, default=2.0,
                        help="the sim engine's load_time_s (default 2.0)")
    parser.add_argument("--relaunch-tries", type=int, nargs="+", default=[5, 3, 0],
                        help="MODELKEEPER_RELAUNCH_TRIES; one scenario (a fresh stack) per "
                        "value (default 5 3 0: every crash relaunched, the default bound, "
                        "relaunching off)")
    parser.add_argument("--seed", type=int, default=23,
                        help="seed of the kills' random offsets (default 23)")
    parser.add_argument("--note", default="", help="a remark for the results header")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "inplace",
                        help="write OUT.md and OUT.json (default bench/results/inplace)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run's folder (logs, data) even when it succeeds")
    parser.add_argument("--from-json", type=Path, metavar="JSON",
                        help="run nothing: write the markdown again from a saved OUT.json")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        args.out.with_suffix(".md").write_text(render(saved["scenarios"], saved["meta"]))
        return 0

    interrupt_on_sigterm()
    # The machine's load around the run: its cores are shared, and every step here is
    # CPU-bound (process starts, Temporal's hops, the store).
    load_before = [round(x, 2) for x in os.getloadavg()]
    scenarios = []
    for tries in args.relaunch_tries:
        scenario = on_fresh_fleet(
            "mk-inplace-", functools.partial(make_fleet, tries=tries),
            functools.partial(run_scenario, args, tries=tries), keep=args.keep)
        if scenario is None:
            return 130
        scenarios.append(scenario)
    meta = {**run_meta("bench.inplace", argv), "note": args.note,
            "load_time_s": args.load_time, "crashes": args.crashes, "seed": args.seed,
            "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "settings": settings_in_force()}
    markdown = render(scenarios, meta)
    print(markdown)
    write_results(args.out, {"meta": meta, "scenarios": scenarios}, markdown)
    return 0


if __name__ == "__main__":
    exit_now(main())
