"""The faults the soak injects, one at a time, and nothing else: the harness never places,
moves or repairs a replica. What comes back, modelkeeper brings back.

Which fault comes next is drawn from a shuffled deck of every kind the machine allows
(:class:`Deck`): each kind once per round, in a seeded random order, so a short run still
sees many kinds and a long one sees each about equally. The gap between two faults is
drawn from the run's range (20 to 60 s by default). Each fault runs to its end (a frozen
agent is thawed, a partition healed, a crashed node's agent started again, an operation
ended) before the soak waits for things to settle and checks the claims.

Each kind is one small function (:data:`INJECTORS`), dispatched by kind.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from bench.fleet.stack import Agent
from modelkeeper.infra.processes import signal_group

from . import demand
from .demand import DemandTargets
from .fleet import SoakFleet
from .observe import live_engines


class FaultKind(StrEnum):
    NODE_CRASH = "node crash"
    AGENT_FREEZE = "agent freeze"
    ENGINE_KILL = "engine kill"
    WORKER_KILL = "worker kill"
    API_KILL = "api kill"
    GATEWAY_KILL = "gateway kill"
    TEMPORAL_RESTART = "temporal restart"
    POSTGRES_RESTART = "postgres restart"
    PARTITION = "partition"
    ROLLING_RESTART = "rolling restart"
    DRAIN = "drain"
    SCALE_TO_ZERO = "scale to zero and back"
    SLEEP_WAKE = "sleep and wake under load"
    EVICTION = "eviction"


#: Following demand (issue 21, :mod:`bench.soak.demand`): the quick soak draws these first.
DEMAND_KINDS = (FaultKind.SCALE_TO_ZERO, FaultKind.SLEEP_WAKE, FaultKind.EVICTION)


#: What each kind does, for the report.
DESCRIPTIONS = {
    FaultKind.NODE_CRASH: "kill -9 an agent and every engine it started; its agent is "
                          "started again (same folder, same node) after a while",
    FaultKind.AGENT_FREEZE: "SIGSTOP an agent (its engines keep running), SIGCONT later",
    FaultKind.ENGINE_KILL: "kill -9 one engine's process group",
    FaultKind.WORKER_KILL: "kill -9 one of the two control workers; started again",
    FaultKind.API_KILL: "kill -9 the API; started again",
    FaultKind.GATEWAY_KILL: "kill -9 the gateway; started again",
    FaultKind.TEMPORAL_RESTART: "stop the Temporal dev server and start it on its database",
    FaultKind.POSTGRES_RESTART: "stop PostgreSQL and start it on its data dir",
    FaultKind.PARTITION: "cut one agent from the API and Temporal (its namespace's only "
                         "road there stops); its engines stay reachable; healed later",
    FaultKind.ROLLING_RESTART: "POST /deployments/{id}/restart, waited until it ends",
    FaultKind.DRAIN: "POST /nodes/{id}/drain, waited until it ends; then the node is "
                     "uncordoned (the operator ends the maintenance)",
    FaultKind.SCALE_TO_ZERO: "an idle on-demand model asked for by a burst (it loads), then "
                             "left until its idle stop takes it back to zero",
    FaultKind.SLEEP_WAKE: "a sleeping on-demand model asked for by three clients (a wake), "
                          "an operator's sleep in the middle of it, then left to sleep",
    FaultKind.EVICTION: "every node but one with room for one of two big on-demand models "
                        "cordoned; one loaded there, then the other asked for, which must "
                        "evict it; cordons lifted, both left to stop idle",
}

#: A frozen agent stays frozen this long (the issue's 1 to 45 s): from a stall the
#: liveness stream rides out to one well past the point the node counts as lost.
FREEZE_S = (1.0, 45.0)
#: A partition lasts as long as a freeze, from a blip to a loss.
PARTITION_S = (1.0, 45.0)
#: A crashed node's agent comes back after this long: sometimes before its replicas were
#: replaced, sometimes long after.
NODE_DOWN_S = (5.0, 40.0)
#: An operation (restart, drain) must end within this: a replacement per replica, each a
#: few seconds, on two busy cores. Past it the soak goes on and says so.
OPERATION_TIMEOUT_S = 300.0
#: How often an operation's state is read while it runs.
OPERATION_POLL_S = 1.0
#: The drain's grace: long enough to move every replica, so the drain moves, not retires.
DRAIN_GRACE_S = 120.0


@dataclass
class Fault:
    """One injected fault: what, on what, when, and what came of it."""

    index: int
    kind: FaultKind
    t0: float
    wall: float
    target: str = ""
    #: How long the fault was held: frozen, partitioned, down, or away being restarted.
    held_s: float = 0.0
    detail: str = ""
    #: Why the API refused the operation asked for (a fault that did not happen).
    refused: str | None = None
    settled: bool = False
    settle_s: float = 0.0
    unsettled_why: str = ""
    claims: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Deck:
    """Fault kinds in a shuffled order, every kind once per round; ``first`` before all
    (in its order, outside the rounds)."""

    kinds: Sequence[FaultKind]
    rng: random.Random
    first: Sequence[FaultKind] = ()
    _left: list[FaultKind] = field(default_factory=list)
    _drawn: int = 0

    def draw(self) -> FaultKind:
        if self._drawn < len(self.first):
            self._drawn += 1
            return self.first[self._drawn - 1]
        if not self._left:
            self._left = list(self.kinds)
            self.rng.shuffle(self._left)
        return self._left.pop()


@dataclass
class Context:
    """What an injector may use: the fleet, the API (the operator's calls) and the dice."""

    fleet: SoakFleet
    api: httpx.AsyncClient
    rng: random.Random
    #: The demand models and where their requests go; None before they are deployed.
    demand: DemandTargets | None = None


async def _hosting(ctx: Context, candidates: Sequence[Agent]) -> Agent:
    """An agent among ``candidates`` whose node holds a replica (a fault there matters);
    any of them when none does or the API cannot say."""
    try:
        replicas = (await ctx.api.get("/replicas")).raise_for_status().json()
    except (httpx.HTTPError, ValueError):
        replicas = []
    busy = {n for r in replicas for n in r["nodes"]}
    hosting = [a for a in candidates if a.node_id in busy]
    return ctx.rng.choice(hosting or list(candidates))


async def node_crash(ctx: Context, fault: Fault) -> None:
    agent = await _hosting(ctx, ctx.fleet.agents)
    crash = ctx.fleet.crash(agent)
    fault.t0, fault.wall = crash.t0, crash.t0_wall
    fault.target = agent.name
    fault.detail = f"{len(crash.engine_pgids)} engine group(s) killed"
    down = ctx.rng.uniform(*NODE_DOWN_S)
    await asyncio.sleep(down)
    ctx.fleet.revive(agent)
    fault.held_s = down


async def agent_freeze(ctx: Context, fault: Fault) -> None:
    agent = await _hosting(ctx, ctx.fleet.agents)
    fault.target = agent.name
    held = ctx.rng.uniform(*FREEZE_S)
    fault.t0, fault.wall = time.monotonic(), time.time()
    ctx.fleet.freeze(agent, True)
    try:
        await asyncio.sleep(held)
    finally:
        ctx.fleet.freeze(agent, False)
    fault.held_s = held


async def partition(ctx: Context, fault: Fault) -> None:
    agent = await _hosting(ctx, ctx.fleet.partitionable())
    fault.target = agent.name
    held = ctx.rng.uniform(*PARTITION_S)
    fault.t0, fault.wall = time.monotonic(), time.time()
    ctx.fleet.partition(agent, True)
    try:
        await asyncio.sleep(held)
    finally:
        ctx.fleet.partition(agent, False)
    fault.held_s = held


async def engine_kill(ctx: Context, fault: Fault) -> None:
    engines = await asyncio.to_thread(live_engines, ctx.fleet.node_ids())
    try:
        replicas = (await ctx.api.get("/replicas")).raise_for_status().json()
    except (httpx.HTTPError, ValueError):
        replicas = []
    # A replica's engine, not an orphan on its way out (which nothing would miss).
    ready = {(r["replica_id"], n) for r in replicas if r["state"] == "ready" for n in r["nodes"]}
    candidates = sorted((k, v) for k, v in engines.items() if k in ready) \
        or sorted(engines.items())
    if not candidates:
        fault.refused = "no engine was running"
        return
    (replica_id, node_id), pids = ctx.rng.choice(candidates)
    names = {a.node_id: a.name for a in ctx.fleet.agents}
    fault.target = f"{replica_id} on {names.get(node_id, node_id)}"
    fault.t0, fault.wall = time.monotonic(), time.time()
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    fault.detail = f"pids {pids}"


async def _kill_component(ctx: Context, fault: Fault, name: str) -> None:
    fault.target = name
    fault.t0, fault.wall = time.monotonic(), time.time()
    fault.held_s = await ctx.fleet.kill_and_restart(name)


async def worker_kill(ctx: Context, fault: Fault) -> None:
    await _kill_component(ctx, fault, ctx.rng.choice(ctx.fleet.worker_names))


async def api_kill(ctx: Context, fault: Fault) -> None:
    await _kill_component(ctx, fault, "api")


async def gateway_kill(ctx: Context, fault: Fault) -> None:
    await _kill_component(ctx, fault, "gateway")


async def _restart_keeping_data(ctx: Context, fault: Fault, name: str) -> None:
    fault.target = name
    fault.t0, fault.wall = time.monotonic(), time.time()
    fault.held_s = await ctx.fleet.restart_keeping_data(name)


async def temporal_restart(ctx: Context, fault: Fault) -> None:
    await _restart_keeping_data(ctx, fault, "temporal")


async def postgres_restart(ctx: Context, fault: Fault) -> None:
    await _restart_keeping_data(ctx, fault, "postgres")


async def _operation(ctx: Context, fault: Fault, path: str, body: dict[str, Any]) -> None:
    """Ask the API for an operation and wait until it ends; a refusal is recorded."""
    fault.t0, fault.wall = time.monotonic(), time.time()
    try:
        resp = await ctx.api.post(path, json=body)
    except httpx.HTTPError as exc:
        fault.refused = f"POST {path}: {type(exc).__name__}: {exc}"
        return
    if resp.status_code != 202:
        fault.refused = f"POST {path}: {resp.status_code} {resp.text[:300]}"
        return
    operation_id = resp.json()["operation_id"]
    fault.extra["operation_id"] = operation_id
    deadline = time.monotonic() + OPERATION_TIMEOUT_S
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        await asyncio.sleep(OPERATION_POLL_S)
        try:
            got = await ctx.api.get(f"/operations/{operation_id}")
        except httpx.HTTPError:
            continue  # busy cores: ask again
        if got.status_code == 200:
            record = got.json()
            if record["state"] != "running":
                break
    fault.held_s = time.monotonic() - fault.t0
    fault.detail = f"{operation_id}: {record.get('state', 'unknown')}" + (
        f" ({record['error']})" if record.get("error") else "")
    fault.extra["steps"] = [f"{s['name']}: {s['state']}" for s in record.get("steps", [])]


async def rolling_restart(ctx: Context, fault: Fault) -> None:
    deployments = (await ctx.api.get("/deployments")).raise_for_status().json()
    dep = ctx.rng.choice(deployments)
    fault.target = dep["model_id"]
    await _operation(ctx, fault, f"/deployments/{dep['deployment_id']}/restart", {})


async def drain(ctx: Context, fault: Fault) -> None:
    agent = await _hosting(ctx, ctx.fleet.agents)
    fault.target = agent.name
    await _operation(ctx, fault, f"/nodes/{agent.node_id}/drain", {"grace_s": DRAIN_GRACE_S})
    # The drain leaves the node cordoned, as it should; the operator, done with it, lets it
    # take replicas again. Without this a long soak would cordon every node in turn.
    resp = await ctx.api.patch(f"/nodes/{agent.node_id}", json={"cordoned": False})
    if resp.status_code != 200:
        fault.detail += f"; uncordon answered {resp.status_code} {resp.text[:200]}"


Injector = Callable[[Context, Fault], Awaitable[None]]

INJECTORS: dict[FaultKind, Injector] = {
    FaultKind.NODE_CRASH: node_crash,
    FaultKind.AGENT_FREEZE: agent_freeze,
    FaultKind.ENGINE_KILL: engine_kill,
    FaultKind.WORKER_KILL: worker_kill,
    FaultKind.API_KILL: api_kill,
    FaultKind.GATEWAY_KILL: gateway_kill,
    FaultKind.TEMPORAL_RESTART: temporal_restart,
    FaultKind.POSTGRES_RESTART: postgres_restart,
    FaultKind.PARTITION: partition,
    FaultKind.ROLLING_RESTART: rolling_restart,
    FaultKind.DRAIN: drain,
    FaultKind.SCALE_TO_ZERO: demand.scale_to_zero,
    FaultKind.SLEEP_WAKE: demand.sleep_wake,
    FaultKind.EVICTION: demand.eviction,
}


async def inject(ctx: Context, fault: Fault) -> None:
    """Carry out ``fault`` (its kind's injector) to its end."""
    await INJECTORS[fault.kind](ctx, fault)
