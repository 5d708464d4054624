"""What the soak watches while it runs; none of it changes anything.

* :class:`TruthProbe`: once a second, what the API says of each deployment beside what the
  gateway actually serves (one small request per deployment). It also gives the ready
  replicas per deployment over time and, from the probes, when service came back after
  each fault.
* :class:`ResourceSampler`: CPU and resident memory of each control-plane process (its
  whole process group: PostgreSQL's backends count as PostgreSQL).
* :func:`check_claims`: memory claimed in the store against the replicas that really run.
* :func:`wait_settled`: until no operation runs and every deployment serves on ready
  replicas on ready nodes, or a bounded wait passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import asyncpg
import httpx
import psutil

from agent.engine_process import NODE_ENV, REPLICA_ENV
from modelkeeper.infra.processes import ManagedProcess

from .clients import Outcome, judge_failure, judge_reply

#: The status-truth probe's pace: the issue's "once a second".
TICK_S = 1.0
#: A probe gets the gateway's own answer: it holds a request up to 10 s for a ready replica
#: and then says 503, and a loaded llama.cpp answers in seconds. Past this, no answer.
PROBE_TIMEOUT_S = 15.0
#: The API's read at each tick gets as long; longer is an API that does not answer.
API_TIMEOUT_S = 2.0
#: Resource samples: often enough for a mean and a peak over minutes, cheap on two cores.
SAMPLE_S = 5.0
#: How often the settled conditions are read.
SETTLE_POLL_S = 1.0
#: Settled means settled for this long: right after a kill the API still shows the old
#: state (an engine's exit is noticed within seconds), which must not pass for settled.
SETTLE_STABLE_S = 10.0
#: How often the claims are compared with the engines between faults, to time how long
#: an engine runs without a claim (or a claim stays without an engine).
CLAIM_SCAN_S = 5.0
#: How long the store may be away when the claims are read (PostgreSQL restarting).
STORE_RETRY_S = 30.0


# -- status truth ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Probe:
    """One deployment at one tick: the API's word and the gateway's deed."""

    model: str
    #: The API's status and ready replicas; None when the API did not answer.
    status: str | None
    ready: int | None
    #: A probe answered 200 in time; None when the gateway itself was not reachable.
    served: bool | None
    #: When the probe ended (monotonic).
    ended: float
    why: str = ""

    @property
    def api_says_servable(self) -> bool | None:
        """The API claims a request can be served: a replica is ready (status serving, or
        degraded with a ready replica). The gateway routes to ready replicas only."""
        return None if self.ready is None else self.ready > 0

    def agrees(self, later: Probe | None) -> bool | None:
        """Whether word and deed match; None when one side could not be asked.

        ``later`` is the same deployment at the first tick after this probe ended: a
        status that changed while the probe was out (a replica ready a second later, the
        gateway holding the probe meanwhile) agrees with the outcome either way.
        """
        if self.served is None or self.api_says_servable is None:
            return None
        return self.api_says_servable == self.served or (
            later is not None and later.api_says_servable == self.served)


@dataclass(frozen=True, slots=True)
class Tick:
    t: float
    probes: tuple[Probe, ...]

    @property
    def serving(self) -> bool:
        """Every deployment answered through the gateway, and had a ready replica (as far
        as the API could say): a request the gateway held until a replacement was ready is
        answered in the end, but nothing served it meanwhile."""
        return all(p.served and (p.ready is None or p.ready > 0) for p in self.probes)

    @property
    def api_serving(self) -> bool:
        """The API shows every deployment serving."""
        return all(p.status == "serving" for p in self.probes)


@dataclass
class TruthProbe:
    """Every :data:`TICK_S`, reads ``GET /deployments`` and probes each model."""

    api: httpx.AsyncClient
    gateway_url: str
    key: str
    models: Sequence[str]
    ticks: list[Tick] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        pending: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout, headers=headers) as http:
            next_at = time.monotonic()
            while not self._stop.is_set():
                # Open loop: a slow tick (a held probe) does not delay the next one.
                task = asyncio.create_task(self._tick(http))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_at = max(next_at + TICK_S, time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), next_at - time.monotonic())
            await asyncio.gather(*pending)
        self.ticks.sort(key=lambda t: t.t)

    def stop(self) -> None:
        self._stop.set()

    async def _tick(self, http: aiohttp.ClientSession) -> None:
        t = time.monotonic()
        view, *served = await asyncio.gather(
            self._read_api(), *(self._probe(http, m) for m in self.models))
        by_model = {d["model_id"]: d for d in view} if view is not None else {}
        probes = []
        for model, (ok, ended, why) in zip(self.models, served, strict=True):
            dep = by_model.get(model)
            probes.append(Probe(model, dep["status"] if dep else None,
                                int(dep["ready_replicas"]) if dep else None, ok, ended, why))
        self.ticks.append(Tick(t, tuple(probes)))

    async def _read_api(self) -> list[dict[str, Any]] | None:
        try:
            resp = await self.api.get("/deployments", timeout=API_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        deployments: list[dict[str, Any]] = resp.json()
        return deployments

    async def _probe(self, http: aiohttp.ClientSession,
                     model: str) -> tuple[bool | None, float, str]:
        served, why = await self._send(http, model)
        return served, time.monotonic(), why

    async def _send(self, http: aiohttp.ClientSession, model: str) -> tuple[bool | None, str]:
        body = {"model": model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "probe"}]}
        try:
            async with http.post(f"{self.gateway_url}/v1/chat/completions", json=body) as resp:
                verdict = judge_reply(resp.status, await resp.read())
        except aiohttp.ClientConnectorError:
            return None, "gateway not reachable"
        except TimeoutError:
            return False, f"no answer within {PROBE_TIMEOUT_S:.0f}s"
        except aiohttp.ClientError as exc:
            return False, judge_failure(exc).kind
        return verdict.outcome is Outcome.OK, "" if verdict.outcome is Outcome.OK else verdict.kind


# -- resources ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    t: float
    name: str
    cpu_percent: float
    rss_bytes: int


@dataclass
class ResourceSampler:
    """CPU (percent of one core) and RSS of each named process group, every SAMPLE_S."""

    groups: dict[str, ManagedProcess]
    samples: list[Usage] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: CPU seconds per (pid, create time) at the last sample: the baseline of the next.
    _cpu: dict[tuple[int, float], float] = field(default_factory=dict)
    _last_t: float | None = None

    async def run(self) -> None:
        while not self._stop.is_set():
            self.samples.extend(await asyncio.to_thread(self._sample))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()

    def _sample(self) -> list[Usage]:
        t = time.monotonic()
        members: dict[int, list[psutil.Process]] = defaultdict(list)
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                members[os.getpgid(proc.pid)].append(proc)
        cpu: dict[tuple[int, float], float] = {}
        out = []
        for name, leader in self.groups.items():
            if leader.poll() is not None or leader.popen is None:
                continue  # down (being restarted): no sample
            used, rss = 0.0, 0
            for proc in members.get(leader.pid, []):
                try:
                    with proc.oneshot():
                        key = (proc.pid, proc.create_time())
                        times = proc.cpu_times()
                        rss += proc.memory_info().rss
                except psutil.Error:
                    continue
                cpu[key] = times.user + times.system
                # A process new since the last sample used all its CPU time since then.
                used += cpu[key] - self._cpu.get(key, 0.0)
            if self._last_t is not None:
                out.append(Usage(t, name, round(100 * used / (t - self._last_t), 1), rss))
        self._cpu, self._last_t = cpu, t
        return out


# -- claims ---------------------------------------------------------------------------------


@dataclass
class ClaimCheck:
    """Memory claimed in the store against the engines that really run."""

    after: str
    settled: bool
    claimed_bytes: int = 0
    #: Claims whose replica has a live engine on the claimed node.
    held_bytes: int = 0
    #: Claims with no live engine behind them: memory reserved for nothing.
    leaked: list[dict[str, Any]] = field(default_factory=list)
    #: Live engines with no replica row or no claim on their node: memory held unclaimed.
    orphans: list[dict[str, Any]] = field(default_factory=list)
    #: Replica rows that claim nothing at all.
    unclaimed: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def match(self) -> bool:
        return self.error is None and not (self.leaked or self.orphans or self.unclaimed)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "match": self.match}


def live_engines(nodes: Collection[str]) -> dict[tuple[str, str], list[int]]:
    """Running engine processes of ``nodes`` by (replica, node), from the markers in their
    environment. Only ours: other stacks on the machine (a test run) have engines too."""
    found: dict[tuple[str, str], list[int]] = defaultdict(list)
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
        except (psutil.Error, ProcessLookupError):
            continue
        if REPLICA_ENV in env and env.get(NODE_ENV) in nodes:
            found[(env[REPLICA_ENV], env[NODE_ENV])].append(proc.pid)
    return found


async def check_claims(database_url: str, nodes: Collection[str], *, after: str,
                       settled: bool) -> ClaimCheck:
    """Read the allocations and replicas, then the engines of ``nodes`` that run, and
    compare."""
    check = ClaimCheck(after=after, settled=settled)
    deadline = time.monotonic() + STORE_RETRY_S
    while True:
        try:
            conn = await asyncpg.connect(database_url, timeout=API_TIMEOUT_S)
            break
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                check.error = f"the store did not answer within {STORE_RETRY_S:.0f}s: {exc}"
                return check
            await asyncio.sleep(SETTLE_POLL_S)
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            claims = await conn.fetch(
                "SELECT a.replica_id, a.node_id, a.memory_bytes, r.state, r.deployment_id "
                "FROM allocations a JOIN replicas r USING (replica_id)")
            replicas = await conn.fetch("SELECT replica_id, state, deployment_id FROM replicas")
    finally:
        await conn.close()
    engines = await asyncio.to_thread(live_engines, nodes)
    claimed_on = {(c["replica_id"], c["node_id"]) for c in claims}
    for c in claims:
        row = {k: c[k] for k in ("replica_id", "node_id", "memory_bytes", "state",
                                 "deployment_id")}
        check.claimed_bytes += int(c["memory_bytes"])
        if (c["replica_id"], c["node_id"]) in engines:
            check.held_bytes += int(c["memory_bytes"])
        else:
            check.leaked.append(row)
    for (replica_id, node_id), pids in sorted(engines.items()):
        if (replica_id, node_id) not in claimed_on:
            check.orphans.append({"replica_id": replica_id, "node_id": node_id, "pids": pids})
    with_claim = {c["replica_id"] for c in claims}
    check.unclaimed = [dict(r) for r in replicas if r["replica_id"] not in with_claim]
    return check


# -- settled --------------------------------------------------------------------------------


def deployment_steady(status: str, states: list[str], desired: int) -> bool:
    """Serving on every replica it wants; or, on demand, idle with none, or asleep."""
    match status:
        case "serving":
            return states == ["ready"] * desired
        case "idle":
            return not states
        case "sleeping":
            return bool(states) and set(states) == {"sleeping"}
    return False


async def settled_now(api: httpx.AsyncClient, nodes: int) -> str | None:
    """Why things have not settled; None once they have."""
    try:
        deployments = (await api.get("/deployments")).raise_for_status().json()
        running = (await api.get("/operations", params={"state": "running"})
                   ).raise_for_status().json()
        node_list = (await api.get("/nodes")).raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        return f"the API did not answer ({type(exc).__name__}: {exc})"
    if running:
        return f"operation {running[0]['operation_id']} running"
    for dep in deployments:
        states = sorted(r["state"] for r in dep["replicas"])
        if not deployment_steady(dep["status"], states, dep["desired_replicas"]):
            return f"{dep['model_id']} {dep['status']}, replicas {states}"
    unready = [n["name"] for n in node_list if n["state"] != "ready"]
    if unready or len(node_list) < nodes:
        return f"nodes not ready: {unready or f'{len(node_list)} of {nodes} registered'}"
    return None


async def wait_settled(api: httpx.AsyncClient, *, nodes: int,
                       timeout: float) -> tuple[bool, float, str]:
    """Wait until :func:`settled_now` has held for SETTLE_STABLE_S; (settled, seconds
    waited until it began to hold, the last reason it did not)."""
    t0 = time.monotonic()
    why: str | None = "not read yet"
    since: float | None = None
    while time.monotonic() - t0 < timeout:
        why = await settled_now(api, nodes)
        now = time.monotonic()
        if why is not None:
            since = None
        elif since is None:
            since = now
        elif now - since >= SETTLE_STABLE_S:
            return True, since - t0, ""
        await asyncio.sleep(SETTLE_POLL_S)
    return False, time.monotonic() - t0, why or "settled, but not for long enough"


@dataclass
class Episode:
    """A stretch of time during which one replica's claim and engine disagreed."""

    what: str
    replica_id: str
    node_id: str
    first: float
    last: float
    first_wall: float


#: The two ways a claim and an engine disagree.
ENGINE_WITHOUT_CLAIM = "engine without a claim"
CLAIM_WITHOUT_ENGINE = "claim without an engine"


@dataclass
class ClaimWatch:
    """Every CLAIM_SCAN_S, compares claims and engines; keeps each disagreement's span.

    Some are expected for a while: a crashed node's claims stay until its replicas are
    declared lost, and an engine the control plane gave up on while its node was silent
    runs until the agent's orphan reaper stops it (``orphan_grace_s`` unwatched).
    """

    database_url: str
    nodes: Collection[str]
    episodes: list[Episode] = field(default_factory=list)
    _open: dict[tuple[str, str, str], Episode] = field(default_factory=dict)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while not self._stop.is_set():
            check = await check_claims(self.database_url, self.nodes, after="scan",
                                       settled=False)
            if check.error is None:
                self._note(check)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), CLAIM_SCAN_S)
        self.episodes.extend(self._open.values())
        self.episodes.sort(key=lambda e: e.first)

    def stop(self) -> None:
        self._stop.set()

    def _note(self, check: ClaimCheck) -> None:
        now, wall = time.monotonic(), time.time()
        seen = {(ENGINE_WITHOUT_CLAIM, o["replica_id"], o["node_id"]) for o in check.orphans}
        seen |= {(CLAIM_WITHOUT_ENGINE, c["replica_id"], c["node_id"]) for c in check.leaked}
        for key in seen:
            episode = self._open.setdefault(key, Episode(*key, first=now, last=now,
                                                         first_wall=wall))
            episode.last = now
        for key in [k for k in self._open if k not in seen]:
            self.episodes.append(self._open.pop(key))

    def still_open(self) -> list[Episode]:
        return list(self._open.values())
