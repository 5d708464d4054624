"""The soak's demand faults (issue 21): what following demand does to a live cluster, done
while the clients' load goes on.

* **scale to zero and back:** an on-demand model, idle, is asked for by a burst of
  requests (it loads; the gateway holds them), then left alone until its idle stop takes
  it back to zero.
* **sleep and wake under load:** a sleeping on-demand model is asked for by a few
  clients for a while (a wake), an operator's sleep lands in the middle of it (a drain
  and a sleep with requests still coming, which wake it again), then it is left to sleep.
* **eviction:** two on-demand models, too big to share a node. Every node but one with
  room for one of them is cordoned (an operator's maintenance), one is loaded there, and
  once its protection window has passed the other is asked for: it can only place by
  evicting the first. The cordons are lifted and both are left to stop idle.

Their requests go into the clients' ledger, so each is judged as theirs are: none may go
unanswered (a 503 "loading" is an answer). These models are not in the clients' mix: the
faults alone drive them, and each fault leaves them as it found them (idle or asleep),
so the next fault starts from a known state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from .clients import Entry, Ledger, send, session

if TYPE_CHECKING:
    from .faults import Context, Fault

MiB = 1 << 20
ZERO_MODEL = "soak-demand-zero"
SLEEP_MODEL = "soak-demand-sleep"
PAIR = ("soak-demand-a", "soak-demand-b")
#: The ledger's client number of the faults' own requests (the clients count from 0).
DEMAND_CLIENT = -1
#: Unused this long, the zero model is stopped: short, so a fault is a full cycle.
ZERO_IDLE_S = 5.0
#: Unused this long, the sleeping model sleeps (and it is never stopped).
SLEEP_AFTER_S = 3.0
#: The pair's idle stop: longer than the protection window the fault waits out before it
#: asks for the second, so the first is still there to be evicted.
PAIR_IDLE_S = 15.0
#: The eviction protection window the soak runs with (a changed setting, in the report):
#: the default is minutes, and the quick soak has three of them in all.
PROTECT_S = 5.0
#: How long the gateway holds a request for these models: a placement and a load of
#: 1 s on busy cores, or an eviction's drain before it.
LOAD_WAIT_S = 30.0
#: Requests in the burst that loads the zero model (half of them streamed).
BURST = 6
#: Clients asking for the sleeping model, for this long, the operator's sleep landing
#: a third of the way in.
UNDER_LOAD_CLIENTS = 3
UNDER_LOAD_S = 6.0
#: Until a model reaches the state a fault waits for (serving, idle, asleep).
STATE_TIMEOUT_S = 90.0
STATE_POLL_S = 0.25
#: What a sleeping replica keeps of the sim's real memory (its weights).
SIM_REAL_WEIGHTS = 8 * MiB


def demand_models(*, base: dict[str, Any], claim: int,
                  node_memory: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each demand model's catalog entry (``base``, the soak's sim, renamed) and its
    scaling policy. The pair claims :func:`pair_claim` each."""
    def spec(model_id: str, memory: int, **args: Any) -> dict[str, Any]:
        return {**base, "model_id": model_id, "memory_bytes": memory,
                "weights_bytes": memory // 2,
                "engine_args": {**base["engine_args"], "weights_bytes": SIM_REAL_WEIGHTS,
                                **args}}
    on_demand = {"min_replicas": 0, "max_replicas": 1, "load_wait_s": LOAD_WAIT_S}
    pair = pair_claim(claim=claim, node_memory=node_memory)
    return [(spec(ZERO_MODEL, claim), {**on_demand, "idle_timeout_s": ZERO_IDLE_S}),
            (spec(SLEEP_MODEL, claim), {**on_demand, "sleep_after_s": SLEEP_AFTER_S}),
            *[(spec(m, pair), {**on_demand, "idle_timeout_s": PAIR_IDLE_S})
              for m in PAIR]]


def pair_claim(*, claim: int, node_memory: int) -> int:
    """What each of the pair claims: a node's memory less one and a half sim claims. One
    fits on a node with at most that much claimed (some node has, with the soak's few
    replicas on four nodes), and two never fit on one node (at the defaults, 4 GiB nodes
    and 1 GiB claims: 2.5 GiB each)."""
    return node_memory - claim * 3 // 2


@dataclass
class DemandTargets:
    """What the demand faults send to and read: the gateway, the ledger, the deployments."""

    url: str
    key: str
    ledger: Ledger
    #: Model id to deployment id.
    deployments: dict[str, str]
    protect_s: float
    #: What each of the pair claims (:func:`pair_claim`).
    pair_bytes: int


class DemandFaultError(RuntimeError):
    """A state a demand fault waits for did not come: recorded in the fault's detail."""


async def _view(api: httpx.AsyncClient, deployment_id: str) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        resp = await api.get(f"/deployments/{deployment_id}")
        if resp.status_code == 200:
            found: dict[str, Any] = resp.json()
            return found
    return None


async def _until(api: httpx.AsyncClient, deployment_id: str, *statuses: str) -> float:
    """Wait until the deployment reads one of ``statuses``; the seconds it took."""
    t0 = time.monotonic()
    last = "nothing read yet"
    while time.monotonic() - t0 < STATE_TIMEOUT_S:
        view = await _view(api, deployment_id)
        if view is not None:
            if view["status"] in statuses:
                return time.monotonic() - t0
            last = view["status"]
        await asyncio.sleep(STATE_POLL_S)
    raise DemandFaultError(f"{deployment_id} not {'/'.join(statuses)} after "
                           f"{STATE_TIMEOUT_S:.0f}s (it read {last})")


async def _ask(http: aiohttp.ClientSession, targets: DemandTargets, model: str,
               count: int) -> list[Entry]:
    """``count`` requests to ``model`` at once, alternately streamed, in the ledger."""
    entries = [targets.ledger.open(client=DEMAND_CLIENT, model=model, stream=i % 2 == 1)
               for i in range(count)]
    await asyncio.gather(*(send(http, targets.url, e) for e in entries))
    return entries


def _answers(entries: list[Entry]) -> str:
    kinds: dict[str, int] = {}
    for e in entries:
        kind = e.verdict.kind if e.verdict is not None else "no verdict"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))


def _targets(ctx: Context) -> DemandTargets:
    assert ctx.demand is not None, "the soak deploys the demand models before any fault"
    return ctx.demand


async def scale_to_zero(ctx: Context, fault: Fault) -> None:
    targets = _targets(ctx)
    dep = targets.deployments[ZERO_MODEL]
    fault.target = ZERO_MODEL
    try:
        await _until(ctx.api, dep, "idle")
        fault.t0, fault.wall = time.monotonic(), time.time()
        async with session(targets.key) as http:
            entries = await _ask(http, targets, ZERO_MODEL, BURST)
        loaded = time.monotonic() - fault.t0
        back = await _until(ctx.api, dep, "idle")
        fault.detail = (f"from zero: {_answers(entries)} in {loaded:.1f}s; back to idle "
                        f"{back:.1f}s later")
    except DemandFaultError as exc:
        fault.detail = str(exc)
    fault.held_s = time.monotonic() - fault.t0


async def sleep_wake(ctx: Context, fault: Fault) -> None:
    targets = _targets(ctx)
    dep = targets.deployments[SLEEP_MODEL]
    fault.target = SLEEP_MODEL
    try:
        async with session(targets.key) as http:
            view = await _view(ctx.api, dep)
            if view is not None and view["status"] == "idle":
                await _ask(http, targets, SLEEP_MODEL, 1)  # its first load
            await _until(ctx.api, dep, "sleeping")
            fault.t0, fault.wall = time.monotonic(), time.time()
            entries: list[Entry] = []
            stop = asyncio.Event()

            async def client() -> None:
                while not stop.is_set():
                    entries.extend(await _ask(http, targets, SLEEP_MODEL, 1))
            clients = [asyncio.create_task(client()) for _ in range(UNDER_LOAD_CLIENTS)]
            await asyncio.sleep(UNDER_LOAD_S / 3)
            try:
                resp = await ctx.api.post(f"/deployments/{dep}/sleep", json={})
                slept = f"the operator's sleep answered {resp.status_code}"
            except httpx.HTTPError as exc:
                slept = f"the operator's sleep failed: {type(exc).__name__}"
            await asyncio.sleep(UNDER_LOAD_S * 2 / 3)
            stop.set()
            await asyncio.gather(*clients)
        asleep = await _until(ctx.api, dep, "sleeping")
        fault.detail = (f"woken under load: {_answers(entries)}; {slept}; asleep again "
                        f"{asleep:.1f}s later")
    except DemandFaultError as exc:
        fault.detail = str(exc)
    fault.held_s = time.monotonic() - fault.t0


async def _set_cordons(ctx: Context, node_ids: list[str], cordoned: bool) -> list[str]:
    """Cordon or uncordon ``node_ids``; the answers that were not 200."""
    refused = []
    for node_id in node_ids:
        try:
            resp = await ctx.api.patch(f"/nodes/{node_id}", json={"cordoned": cordoned})
            if resp.status_code != 200:
                refused.append(f"{node_id}: {resp.status_code} {resp.text[:100]}")
        except httpx.HTTPError as exc:
            refused.append(f"{node_id}: {type(exc).__name__}")
    return refused


async def eviction(ctx: Context, fault: Fault) -> None:
    targets = _targets(ctx)
    victim, wanted = PAIR if ctx.rng.random() < 0.5 else PAIR[::-1]
    fault.target = f"{victim} for {wanted}"
    for model in PAIR:
        await _until(ctx.api, targets.deployments[model], "idle")
    try:
        nodes = (await ctx.api.get("/nodes")).raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        fault.refused = f"the API did not answer: {type(exc).__name__}"
        return
    # A node with room for one of the pair and not for two: with the others cordoned,
    # the second can only come by evicting the first.
    fits = sorted(n["node_id"] for n in nodes if n["state"] == "ready" and not n["cordoned"]
                  and targets.pair_bytes <= (n["memory_free_bytes"] or 0)
                  < 2 * targets.pair_bytes)
    if not fits:
        fault.refused = (f"no node with room for one {targets.pair_bytes >> 20} MiB replica "
                         "and not two")
        return
    room = ctx.rng.choice(fits)
    others = [n["node_id"] for n in nodes if n["node_id"] != room and not n["cordoned"]]
    fault.t0, fault.wall = time.monotonic(), time.time()
    refused = await _set_cordons(ctx, others, True)
    try:
        async with session(targets.key) as http:
            first = await _ask(http, targets, victim, 1)
            await _until(ctx.api, targets.deployments[victim], "serving")
            # A replica is safe from eviction this long after it starts serving.
            await asyncio.sleep(targets.protect_s)
            second = await _ask(http, targets, wanted, BURST // 2)
        await _until(ctx.api, targets.deployments[wanted], "serving")
        gone = await _until(ctx.api, targets.deployments[victim], "idle")
        fault.detail = (f"{victim} loaded ({_answers(first)}), then {wanted} asked: "
                        f"{_answers(second)}; {victim} idle {gone:.1f}s after {wanted} served")
    except DemandFaultError as exc:
        fault.detail = str(exc)
    finally:
        refused += await _set_cordons(ctx, others, False)
    if refused:
        fault.detail += f"; cordons refused: {refused}"
    with contextlib.suppress(DemandFaultError):
        await _until(ctx.api, targets.deployments[wanted], "idle")
    fault.held_s = time.monotonic() - fault.t0
