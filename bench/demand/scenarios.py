"""The six scenarios of issue 21's acceptance, each on a fresh stack (:mod:`bench.demand.run`
builds it as :data:`FLEETS` says), each returning its figures (:mod:`bench.demand.report`).

1. **cold**: an on-demand sim model (``load_time_s`` 2) stopped idle; a streamed request,
   first token; minus the engine's own load time, the orchestration overhead.
2. **wake**: the same model slept after a short ``sleep_after_s``; request to first token,
   against the engine's wake time.
3. **standby**: one serving replica and one warm standby (asleep, other node), a load time
   of 10 s; kill -9 of the serving node; until a request is answered again.
4. **step**: a max-4 model from 1 to 16 clients and back: the time to each replica added,
   failed requests, the return to base, the gaps between steps.
5. **evict**: two on-demand models, room for one, asked alternately every 10 s: every
   answer a 200 or the 503 "loading", evictions per protection window.
6. **idle**: an idle and a sleeping deployment's history over a window, and the history
   each scaling step costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.recovery.client import SteadyClient, tally

from .client import Answer, Ask, ClosedLoop, first_token, session
from .report import drops, gaps, most_in_window, row, runs_summary, step_kind
from .stack import DEMAND_EVENT, POLL_S, DemandBenchError, Stack, ready, sim_model

#: The issue's targets.
TARGET_COLD_OVERHEAD_S = 0.5
TARGET_WAKE_OVER_S = 0.15
TARGET_STANDBY_S = 1.0
#: An idle or sleeping deployment's history events per hour.
TARGET_IDLE_EVENTS_PER_H = 0

#: Unused this long, an on-demand replica is stopped (cold) or slept (wake): short, so
#: that runs follow each other quickly, and longer than one request.
COLD_IDLE_S = 3.0
WAKE_SLEEP_AFTER_S = 3.0
#: Never, within a run: the idle stop a sleeping replica would otherwise reach (a day).
NEVER_S = 86_400.0
#: The gateway holds a request for a loading model this long (the policy's load_wait_s):
#: longer than a load of 2 s (cold, wake, step), so that those requests are served.
LOAD_WAIT_S = 15.0
#: Until a status comes: a first placement waits out the settling window (15 s), a stop
#: drains, two busy cores stretch each step.
STATUS_TIMEOUT_S = 120.0
#: The standby scenario's load time: ten times a wake, so a served-again time under a
#: second can only be a wake (the issue's figure).
STANDBY_LOAD_TIME_S = 10.0
#: The standby client's pace: the resolution of the served-again time.
STANDBY_PACE_S = 0.05
#: From a crash until served again: past this the standby path is broken.
STANDBY_TIMEOUT_S = 120.0
#: The step load's policy: the issue's max 4 from a base of 1, with rule periods short
#: enough for a run of minutes (the defaults are 1 and 10 minutes).
STEP_MAX = 4
STEP_UP_AFTER_S = 5.0
STEP_DOWN_AFTER_S = 20.0
STEP_CLIENTS = 16
#: Tokens per answer and the sim's speed: each request holds a slot for a second.
STEP_TOKENS = 20
STEP_TOKENS_PER_SECOND = 20.0
#: What makes requests wait at a sim replica: it runs this many at once, as vLLM's
#: --max-num-seqs, and queues the rest (its ``vllm:num_requests_waiting`` says how many).
STEP_ENGINE_ARGS: dict[str, Any] = {"max_num_seqs": 2}
#: One client before the step, and at most this long at 16 for the fourth replica.
STEP_BASE_S = 10.0
STEP_HIGH_TIMEOUT_S = 150.0
#: At 16 clients after the fourth replica is ready: a few rule periods with nothing added.
STEP_HOLD_S = 2 * STEP_UP_AFTER_S
#: Back to one client: three quiet periods to base, with room for the watch's ticks.
STEP_BACK_TIMEOUT_S = 6 * STEP_DOWN_AFTER_S
#: The evict scenario: the issue's alternation, and a hold shorter than the alternation
#: so that a request waits out its hold before the next is sent.
EVICT_EVERY_S = 10.0
EVICT_LOAD_WAIT_S = 5.0
#: The idle scenario: the sleeping model sleeps after this, and neither is stopped.
IDLE_SLEEP_AFTER_S = 3.0


@dataclass(frozen=True)
class Options:
    """What the command line sets."""

    runs: int
    load_time_s: float
    wake_time_s: float
    evict_duration_s: float
    idle_window_s: float
    protect_s: float


Scenario = Callable[[Stack, Options], Awaitable[dict[str, Any]]]


def _on_demand(**extra: float) -> dict[str, Any]:
    return {"min_replicas": 0, "max_replicas": 1, "load_wait_s": LOAD_WAIT_S, **extra}


async def _first_tokens(stack: Stack, model: str, before_each: Callable[[], Awaitable[float]],
                        runs: int) -> tuple[Ask, list[Ask]]:
    """A first request (the warm-up: the first placement waits out the settling window),
    then ``runs`` requests, each after ``before_each``; every one must be a 200."""
    async with session(stack.key) as http:
        warm = await first_token(http, stack.chat_url, model)
        if warm.answer is not Answer.OK:
            raise DemandBenchError(f"{model} first request: {warm.status} {warm.detail}")
        asks = []
        for index in range(1, runs + 1):
            waited = await before_each()
            ask = await first_token(http, stack.chat_url, model)
            if ask.answer is not Answer.OK or ask.ttft_s is None:
                raise DemandBenchError(f"{model} run {index}: {ask.status} {ask.detail}")
            print(f"{model} run {index}: first token {ask.ttft_s:.3f}s "
                  f"(waited {waited:.1f}s for the state)", flush=True)
            asks.append(ask)
    return warm, asks


async def cold(stack: Stack, opts: Options) -> dict[str, Any]:
    model = "demand-cold"
    dep = await stack.deploy(sim_model(model, load_time_s=opts.load_time_s),
                             _on_demand(idle_timeout_s=COLD_IDLE_S))
    await stack.wait_status(dep, "idle", timeout=STATUS_TIMEOUT_S)

    async def stopped() -> float:
        return await stack.wait_status(dep, "idle", timeout=STATUS_TIMEOUT_S)
    warm, asks = await _first_tokens(stack, model, stopped, opts.runs)
    overheads = [(a.ttft_s or 0.0) - opts.load_time_s for a in asks]
    summary = runs_summary(overheads)
    return {
        "title": f"1. Cold start from zero (sim load_time_s {opts.load_time_s:g})",
        "rows": [row("runs", summary["n"]),
                 row("first token, median (s)", runs_summary([a.ttft_s or 0.0 for a in asks])
                     .get("median")),
                 row("overhead = first token - load time, median (s)", summary.get("median"),
                     f"<= {TARGET_COLD_OVERHEAD_S:g}",
                     summary.get("median", float("inf")) <= TARGET_COLD_OVERHEAD_S),
                 row("overhead p90 (s)", summary.get("p90")),
                 row("overhead min / max (s)", f"{summary.get('min')} / {summary.get('max')}")],
        "notes": [f"each run after the replica was stopped idle (idle_timeout_s "
                  f"{COLD_IDLE_S:g}) and the deployment read `idle`; a streamed request "
                  "through the gateway, timed to its first content chunk",
                  f"the first request after the stack started (not counted: it waits out "
                  f"the settling window) took {warm.ttft_s or 0.0:.3f}s"],
        "raw": {"overhead_s": [round(o, 3) for o in overheads]},
        "series": {"kind": "runs", "values": overheads, "target": TARGET_COLD_OVERHEAD_S,
                   "ylabel": "overhead (s)"},
    }


def is_asleep(view: dict[str, Any]) -> bool:
    """Sleeping, its replicas asleep (not draining into sleep)."""
    return view["status"] == "sleeping" and bool(view["replicas"]) and all(
        r["state"] == "sleeping" for r in view["replicas"])


async def wake(stack: Stack, opts: Options) -> dict[str, Any]:
    model = "demand-wake"
    dep = await stack.deploy(
        sim_model(model, load_time_s=opts.load_time_s, wake_time_s=opts.wake_time_s),
        _on_demand(sleep_after_s=WAKE_SLEEP_AFTER_S, idle_timeout_s=NEVER_S))

    async def asleep() -> float:
        # The deployment reads `sleeping` from the sleep's decision on, while its replica
        # still drains: a request then meets a replica falling asleep, not asleep.
        return await stack.wait_for(dep, is_asleep, what="asleep", timeout=STATUS_TIMEOUT_S)
    _, asks = await _first_tokens(stack, model, asleep, opts.runs)
    ttfts = [a.ttft_s or 0.0 for a in asks]
    summary = runs_summary(ttfts)
    target = opts.wake_time_s + TARGET_WAKE_OVER_S
    return {
        "title": f"2. Wake from sleep (sim wake_time_s {opts.wake_time_s:g})",
        "rows": [row("runs", summary["n"]),
                 row("request -> first token, median (s)", summary.get("median"),
                     f"<= {target:g}", summary.get("median", float("inf")) <= target),
                 row("p90 (s)", summary.get("p90")),
                 row("over the wake time, median (s)",
                     round(summary.get("median", 0.0) - opts.wake_time_s, 3))],
        "notes": [f"each run after the replica was slept (sleep_after_s "
                  f"{WAKE_SLEEP_AFTER_S:g}): the deployment read `sleeping` and its "
                  "replica `sleeping` (drained, asleep)"],
        "raw": {"ttft_s": [round(t, 3) for t in ttfts]},
        "series": {"kind": "runs", "values": ttfts, "target": target,
                   "ylabel": "first token (s)"},
    }


def _standby_ready(view: dict[str, Any]) -> bool:
    states = sorted(r["state"] for r in view["replicas"])
    return view["status"] == "serving" and states == ["ready", "sleeping"]


async def standby(stack: Stack, opts: Options) -> dict[str, Any]:
    model = "demand-standby"
    dep = await stack.deploy(
        sim_model(model, load_time_s=STANDBY_LOAD_TIME_S, wake_time_s=opts.wake_time_s),
        {"min_replicas": 1, "max_replicas": 1, "warm_standby": 1, "load_wait_s": LOAD_WAIT_S})
    fleet = stack.fleet
    client = SteadyClient(stack.chat_url, model, stack.key, STANDBY_PACE_S)
    await stack.wait_for(dep, _standby_ready, what="serving with a standby",
                         timeout=2 * STATUS_TIMEOUT_S)
    sending = asyncio.create_task(client.run())
    gaps_s: list[float] = []
    crashes: list[dict[str, Any]] = []
    unrestored = ""
    try:
        for index in range(1, opts.runs + 1):
            view = await stack.view(dep)
            assert view is not None  # wait_for just read it
            [serving] = [r for r in view["replicas"] if r["state"] == "ready"]
            [standby_replica] = [r for r in view["replicas"] if r["state"] == "sleeping"]
            agent = fleet.agent_of(serving["nodes"][0])
            crash = fleet.crash(agent)
            while (success := client.first_success_after(crash.t0)) is None:
                if time.monotonic() - crash.t0 > STANDBY_TIMEOUT_S:
                    raise DemandBenchError(f"crash {index}: not served again after "
                                           f"{STANDBY_TIMEOUT_S:.0f}s")
                await asyncio.sleep(POLL_S)
            gap = success.ended - crash.t0
            after = await stack.view(dep)
            woke = after is not None and any(
                r["replica_id"] == standby_replica["replica_id"] and r["state"] == "ready"
                for r in after["replicas"])
            gaps_s.append(gap)
            crashes.append({"crash": index, "node": agent.name, "served_again_s": round(gap, 3),
                            "standby_woken": woke})
            print(f"crash {index}: {agent.name}: served again after {gap:.3f}s "
                  f"({'the standby woke' if woke else 'not the standby'})", flush=True)
            fleet.revive(agent)
            try:
                await stack.wait_for(dep, _standby_ready, what="serving with a standby again",
                                     timeout=2 * STATUS_TIMEOUT_S)
            except DemandBenchError as exc:
                # The crashes so far are measured; the next needs a standby to wake.
                unrestored = f"after crash {index}: {exc}"
                break
            while not all([await fleet.node_ready(a) for a in fleet.agents]):
                await asyncio.sleep(POLL_S)
    finally:
        client.stop()
        await sending
    summary = runs_summary(gaps_s)
    woken = sum(1 for c in crashes if c["standby_woken"])
    return {
        "title": f"3. Warm standby (load_time_s {STANDBY_LOAD_TIME_S:g}, "
                 f"wake_time_s {opts.wake_time_s:g}, two nodes)",
        "rows": [row("crashes", summary["n"], f"{opts.runs}", summary["n"] == opts.runs),
                 row("kill -9 of the serving node -> served again, median (s)",
                     summary.get("median"), f"<= {TARGET_STANDBY_S:g}",
                     summary.get("median", float("inf")) <= TARGET_STANDBY_S),
                 row("p90 (s)", summary.get("p90")),
                 row("served by the woken standby", f"{woken} of {len(crashes)}"),
                 row("failed requests (by status)", str(tally(client.outcomes)) or "0")],
        "notes": [*([f"**the standby was not restored** {unrestored}"] if unrestored else []),
                  f"a client sends a one-token completion every {STANDBY_PACE_S * 1e3:.0f} ms; "
                  "served again = the first success among requests sent after the kill",
                  "between crashes the node's agent is started again and the run waits "
                  "until the deployment serves with its standby asleep again"],
        "raw": {"crashes": crashes},
        "series": {"kind": "runs", "values": gaps_s, "target": TARGET_STANDBY_S,
                   "ylabel": "served again after (s)"},
    }


async def _sample(stack: Stack, dep: str, samples: list[tuple[float, int]],
                  stop: asyncio.Event) -> None:
    while not stop.is_set():
        view = await stack.view(dep)
        if view is not None:
            samples.append((time.monotonic(), ready(view)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


async def step(stack: Stack, opts: Options) -> dict[str, Any]:
    model = "demand-step"
    dep = await stack.deploy(
        sim_model(model, load_time_s=opts.load_time_s, tokens_per_second=STEP_TOKENS_PER_SECOND,
                  **STEP_ENGINE_ARGS),
        {"min_replicas": 1, "max_replicas": STEP_MAX, "scale_up_waiting": 1,
         "scale_up_after_s": STEP_UP_AFTER_S, "scale_down_after_s": STEP_DOWN_AFTER_S,
         "load_wait_s": LOAD_WAIT_S})
    await stack.wait_for(dep, lambda v: v["status"] == "serving" and ready(v) == 1,
                         what="serving on one replica", timeout=STATUS_TIMEOUT_S)
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    t0, t0_wall = time.monotonic(), time.time()
    sampler = asyncio.create_task(_sample(stack, dep, samples, stop))
    async with session(stack.key) as http:
        load = ClosedLoop(http, stack.chat_url, model, STEP_TOKENS)
        try:
            await load.resize(1)
            await asyncio.sleep(STEP_BASE_S)
            up_at = time.monotonic()
            await load.resize(STEP_CLIENTS)
            try:
                await stack.wait_for(dep, lambda v: ready(v) >= STEP_MAX,
                                     what=f"{STEP_MAX} ready", timeout=STEP_HIGH_TIMEOUT_S)
                short = ""
            except DemandBenchError as exc:
                short = str(exc)  # the figures say how far it went
            await asyncio.sleep(STEP_HOLD_S)
            down_at = time.monotonic()
            await load.resize(1)
            back_s = await stack.wait_for(
                dep, lambda v: ready(v) == 1 and len(v["replicas"]) == 1,
                what="back to one replica", timeout=STEP_BACK_TIMEOUT_S)
        finally:
            await load.resize(0)
            stop.set()
            await sampler
    events = [e for e in await stack.events(dep, DEMAND_EVENT) if e["t"] >= t0_wall]
    adds = [e["t"] - t0_wall for e in events if step_kind(e["message"]) == "add"]
    retires = [e["t"] - t0_wall for e in events if step_kind(e["message"]) == "retire"]
    reached = {k: next((t - up_at for t, n in samples if t >= up_at and n >= k), None)
               for k in range(2, STEP_MAX + 1)}
    failed = [a for a in load.asks if a.answer is not Answer.OK]
    rows = [row(f"to replica {k} ready, after the step to {STEP_CLIENTS} clients (s)",
                None if s is None else round(s, 3)) for k, s in reached.items()]
    most = max((n for _, n in samples), default=0)
    rows += [
        row("most replicas ready under load", most, f"{STEP_MAX}", most == STEP_MAX),
        row("requests", len(load.asks)),
        row("failed requests", len(failed), "0", not failed),
        row("back to 1 replica after the load fell (s)", round(back_s, 3),
            f"within {STEP_BACK_TIMEOUT_S:g}", True),
        row(f"most additions in any {STEP_UP_AFTER_S:g} s", most_in_window(adds, STEP_UP_AFTER_S),
            "<= 1", most_in_window(adds, STEP_UP_AFTER_S) <= 1),
        row(f"most removals in any {STEP_DOWN_AFTER_S:g} s",
            most_in_window(retires, STEP_DOWN_AFTER_S), "<= 1",
            most_in_window(retires, STEP_DOWN_AFTER_S) <= 1),
    ]
    return {
        "title": f"4. Step load: max {STEP_MAX}, 1 -> {STEP_CLIENTS} clients -> 1 "
                 f"(scale_up_after_s {STEP_UP_AFTER_S:g}, scale_down_after_s "
                 f"{STEP_DOWN_AFTER_S:g})",
        "rows": rows,
        "notes": [*([f"**not at max under load:** {short}"] if short else []),
                  f"closed-loop clients, each a streamed {STEP_TOKENS}-token completion after "
                  f"another at {STEP_TOKENS_PER_SECOND:g} tokens/s; sim engine args "
                  f"{STEP_ENGINE_ARGS}",
                  f"gaps between additions (s): {gaps(adds)}; between removals: "
                  f"{gaps(retires)}",
                  *[f"failed: {a.status} {a.detail}" for a in failed[:10]],
                  *[f"demand event at {e['t'] - t0_wall:.1f}s: {e['message']}"
                    for e in events]],
        "raw": {"adds_s": adds, "retires_s": retires},
        "series": {"kind": "timeline", "ylabel": "ready replicas",
                   "lines": {"ready replicas": [(round(t - t0, 2), n) for t, n in samples]},
                   "marks": [(round(up_at - t0, 2), f"{STEP_CLIENTS} clients"),
                             (round(down_at - t0, 2), "1 client")]},
    }


#: Replica states that hold a node's room (what an eviction frees).
LIVE_STATES = frozenset({"starting", "ready", "sleeping", "unreachable"})


async def evict(stack: Stack, opts: Options) -> dict[str, Any]:
    models = ["demand-evict-a", "demand-evict-b"]
    deps = {m: await stack.deploy(sim_model(m, load_time_s=opts.load_time_s),
                                  {"min_replicas": 0, "max_replicas": 1,
                                   "load_wait_s": EVICT_LOAD_WAIT_S}) for m in models}
    for dep in deps.values():
        await stack.wait_status(dep, "idle", timeout=STATUS_TIMEOUT_S)
    samples: list[tuple[float, dict[str, int]]] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            counts = {}
            for m, dep in deps.items():
                view = await stack.view(dep)
                if view is not None:
                    counts[m] = sum(1 for r in view["replicas"] if r["state"] in LIVE_STATES)
            samples.append((time.monotonic(), counts))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)

    t0, t0_wall = time.monotonic(), time.time()
    sampler = asyncio.create_task(sample())
    asks: list[Ask] = []
    async with session(stack.key) as http:
        sent: list[asyncio.Task[Ask]] = []
        index = 0
        while time.monotonic() - t0 < opts.evict_duration_s:
            sent.append(asyncio.create_task(
                first_token(http, stack.chat_url, models[index % 2])))
            index += 1
            await asyncio.sleep(max(0.0, t0 + index * EVICT_EVERY_S - time.monotonic()))
        asks = list(await asyncio.gather(*sent))
    stop.set()
    await sampler
    evictions = drops(samples)
    times = [t - t0 for t, _ in evictions]
    worst = most_in_window(times, opts.protect_s)
    by_answer = {a.value: sum(1 for x in asks if x.answer is a) for a in Answer}
    events = [e for d in deps.values() for e in await stack.events(d, DEMAND_EVENT)
              if e["t"] >= t0_wall and "evict" in e["message"]]
    return {
        "title": f"5. Two on-demand models, room for one, asked alternately every "
                 f"{EVICT_EVERY_S:g} s for {opts.evict_duration_s / 60:g} min",
        "rows": [row("requests", len(asks)),
                 row("answered 200", by_answer[Answer.OK.value]),
                 row('answered 503 "loading" (with Retry-After)',
                     by_answer[Answer.LOADING.value]),
                 row("any other answer", by_answer[Answer.OTHER.value], "0",
                     by_answer[Answer.OTHER.value] == 0),
                 row("evictions", len(evictions)),
                 row(f"most evictions in any protection window ({opts.protect_s:g} s)", worst,
                     "<= 1", worst <= 1),
                 row("gaps between evictions (s)", str(gaps(times)))],
        "notes": [f"one node with room for one replica; no idle stop, so every replica that "
                  f"went is an eviction; load_wait_s {EVICT_LOAD_WAIT_S:g}",
                  *[f"other answer: {a.model} {a.status} {a.detail}"
                    for a in asks if a.answer is Answer.OTHER][:10],
                  *[f"event at {e['t'] - t0_wall:.1f}s: {e['message']}" for e in events]],
        "raw": {"evictions_s": [round(t, 2) for t in times]},
        "series": {"kind": "answers", "ylabel": "request -> answer (s)",
                   "points": {a.value: [(round(x.sent - t0, 2), round(x.ended - x.sent, 3))
                                        for x in asks if x.answer is a] for a in Answer},
                   "marks": [round(t, 2) for t in times]},
    }


async def idle(stack: Stack, opts: Options) -> dict[str, Any]:
    stopped_model, sleeping_model = "demand-idle-stopped", "demand-idle-sleeping"
    stopped = await stack.deploy(sim_model(stopped_model, load_time_s=opts.load_time_s),
                                 _on_demand(idle_timeout_s=COLD_IDLE_S))
    sleeper = await stack.deploy(
        sim_model(sleeping_model, load_time_s=opts.load_time_s, wake_time_s=opts.wake_time_s),
        _on_demand(sleep_after_s=IDLE_SLEEP_AFTER_S, idle_timeout_s=NEVER_S))
    async with session(stack.key) as http:
        await first_token(http, stack.chat_url, sleeping_model)
        await stack.wait_for(sleeper, is_asleep, what="asleep", timeout=STATUS_TIMEOUT_S)
        await stack.wait_status(stopped, "idle", timeout=STATUS_TIMEOUT_S)
        # From a quiet history: the last step's trailing writes are the step's, not idle's.
        before = {d: await stack.quiet_history(d) for d in (stopped, sleeper)}
        print(f"idle and sleeping; watching their histories for {opts.idle_window_s:.0f}s",
              flush=True)
        await asyncio.sleep(opts.idle_window_s)
        after = {d: await stack.history_length(d) for d in (stopped, sleeper)}

        # Then one step of each kind, and the history each cost.
        steps: list[tuple[str, int]] = []

        async def cost(what: str, dep: str, act: Callable[[], Awaitable[object]]) -> None:
            run_before, length_before = await stack.quiet_history(dep)
            await act()
            run_after, length_after = await stack.quiet_history(dep)
            steps.append((what, length_after - length_before if run_after == run_before
                          else -1))
        async def ask(model: str, dep: str) -> None:
            await first_token(http, stack.chat_url, model)
            await stack.wait_status(dep, "serving", timeout=STATUS_TIMEOUT_S)
        await cost("load (idle -> serving)", stopped, lambda: ask(stopped_model, stopped))
        await cost("idle stop (serving -> idle)", stopped, lambda: stack.wait_status(
            stopped, "idle", timeout=STATUS_TIMEOUT_S))
        await cost("wake (sleeping -> serving)", sleeper, lambda: ask(sleeping_model, sleeper))
        await cost("sleep (serving -> sleeping)", sleeper, lambda: stack.wait_for(
            sleeper, is_asleep, what="asleep", timeout=STATUS_TIMEOUT_S))
    names = {stopped: "idle (stopped)", sleeper: "sleeping"}
    rows = []
    for dep, name in names.items():
        (run0, len0), (run1, len1) = before[dep], after[dep]
        per_hour = (len1 - len0) * 3600 / opts.idle_window_s if run0 == run1 else None
        rows.append(row(f"{name}: history events per hour (over {opts.idle_window_s:g} s)",
                        None if per_hour is None else round(per_hour, 1),
                        f"{TARGET_IDLE_EVENTS_PER_H}",
                        per_hour is not None and per_hour <= TARGET_IDLE_EVENTS_PER_H))
    rows += [row(f"history events of one step: {what}", n if n >= 0 else "continued as new")
             for what, n in steps]
    return {
        "title": "6. Idle and sleeping deployments: Temporal history",
        "rows": rows,
        "notes": ["history length from Temporal's DescribeWorkflowExecution of each "
                  "deployment workflow's current run, before and after the window",
                  "the window and each step start from a quiet history (unchanged for 3 s), "
                  "and a step's events end once it is quiet again after the status the "
                  "step leads to"],
        "raw": {"before": before, "after": after, "steps": steps},
    }


SCENARIOS: dict[str, Scenario] = {"cold": cold, "wake": wake, "standby": standby,
                                  "step": step, "evict": evict, "idle": idle}
