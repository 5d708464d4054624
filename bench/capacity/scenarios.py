"""Issue 22's acceptance on a real stack, each scenario on a fresh one
(:mod:`bench.capacity.run` builds it as :data:`~bench.capacity.run.FLEETS` says).

1. **preempt**: three nodes filled with ``opportunistic`` sim deployments, each streaming
   answers to its own clients; then a ``critical`` deployment that needs one node's room.
   It must serve within its load time + 3 s; exactly the replicas that make the room are
   stopped, drained (no request in flight at the preemption fails), and show "preempted
   by"; deleting the critical one brings them back by themselves.
2. **quota**: team A guaranteed 16 GiB with a limit of 24 GiB; team B borrows the whole
   cluster. A deploys within its guarantee: B's borrowed replicas that make the room are
   taken back and A is placed. A deploy over A's limit is refused with the numbers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bench.demand.client import Answer, ClosedLoop, session
from bench.demand.report import row
from bench.demand.stack import POLL_S, Stack, ready, sim_model

GiB = 1 << 30
#: The issue's target: the critical deployment serves within its load time plus this.
TARGET_OVER_LOAD_S = 3.0
#: Until the fill's deployments all serve: a first placement waits out the settling
#: window (15 s), and six sim loads share two busy cores.
FILL_TIMEOUT_S = 180.0
#: Until the critical deployment serves; past this preemption is broken.
SERVE_TIMEOUT_S = 90.0
#: Until the victims serve again once the critical one is gone: its drain (the default
#: 30 s grace) and stop, the victims' room watch and their loads.
BACK_TIMEOUT_S = 180.0
#: Each fill deployment's clients, and each answer's length at the sim's speed: answers
#: of 2 s, so that some are in flight whenever the preemption comes.
CLIENTS_PER_MODEL = 2
TOKENS = 40
TOKENS_PER_SECOND = 20.0


@dataclass(frozen=True)
class Options:
    """What the command line sets."""

    load_time_s: float


Scenario = Callable[[Stack, Options], Awaitable[dict[str, Any]]]


async def _deploy(stack: Stack, model: dict[str, Any], **fields: Any) -> str:
    await stack.post("/models", model)
    made = await stack.post("/deployments", {"model_id": model["model_id"], **fields})
    return str(made["deployment_id"])


def _nodes_of(view: dict[str, Any]) -> set[str]:
    return {n for r in view["replicas"] if r["state"] == "ready" for n in r.get("nodes", [])}


async def preempt(stack: Stack, opts: Options) -> dict[str, Any]:
    engine = {"load_time_s": opts.load_time_s, "tokens_per_second": TOKENS_PER_SECOND}
    low = [f"cap-low-{i}" for i in range(6)]
    deps = {m: await _deploy(stack, sim_model(m, **engine), replicas=1,
                             capacity_class="opportunistic") for m in low}
    for dep in deps.values():
        await stack.wait_for(dep, lambda v: ready(v) == 1, what="serving",
                             timeout=FILL_TIMEOUT_S)
    placed = {m: _nodes_of(await _view(stack, d)) for m, d in deps.items()}
    async with session(stack.key) as http:
        loops = [ClosedLoop(http, stack.chat_url, m, TOKENS) for m in low]
        for loop in loops:
            await loop.resize(CLIENTS_PER_MODEL)
        await asyncio.sleep(2 * TOKENS / TOKENS_PER_SECOND)  # every client mid-answer
        critical = {**sim_model("cap-critical", **engine), "memory_bytes": 2 * GiB}
        t0 = time.monotonic()
        crit = await _deploy(stack, critical, replicas=1, capacity_class="critical")
        serve_s = await stack.wait_for(crit, lambda v: ready(v) == 1, what="serving",
                                       timeout=SERVE_TIMEOUT_S)
        serve_s = time.monotonic() - t0
        crit_nodes = _nodes_of(await _view(stack, crit))
        await asyncio.sleep(2 * TOKENS / TOKENS_PER_SECOND)  # answers in flight end
        for loop in loops:
            await loop.resize(0)
    views = {m: await _view(stack, d) for m, d in deps.items()}
    victims = sorted(m for m, v in views.items() if ready(v) == 0)
    said = {m: " ".join(str(views[m].get(k) or "") for k in ("placement_error",
                                                              "demand_note"))
            for m in victims}
    shown = [m for m in victims if "preempted by" in said[m]]
    on_its_node = sorted(m for m, nodes in placed.items() if nodes & crit_nodes)
    asks = [a for loop in loops for a in loop.asks]
    in_flight = [a for a in asks if a.sent < t0]
    failed_in_flight = [a for a in in_flight if a.answer is not Answer.OK]
    refused_after = [a for a in asks if a.sent >= t0 and a.answer is not Answer.OK]
    victim_failures = [a for a in refused_after if a.status != 503]
    # Room returns: the critical deployment goes, the victims come back by themselves.
    t1 = time.monotonic()
    (await stack.api.delete(f"/deployments/{crit}")).raise_for_status()
    for m in victims:
        await stack.wait_for(deps[m], lambda v: ready(v) == 1, what="serving again",
                             timeout=BACK_TIMEOUT_S)
    back_s = time.monotonic() - t1
    target = opts.load_time_s + TARGET_OVER_LOAD_S
    return {
        "title": "1. Three nodes full of opportunistic replicas; a critical deployment "
                 "that needs one node's room",
        "rows": [
            row("critical: POST to serving (s)", round(serve_s, 2),
                f"<= load {opts.load_time_s:g} + {TARGET_OVER_LOAD_S:g}", serve_s <= target),
            row("replicas stopped", len(victims), "those on its node",
                victims == on_its_node and len(victims) > 0),
            row("victims showing 'preempted by'", len(shown), str(len(victims)),
                len(shown) == len(victims)),
            row("requests in flight at the preemption", len(in_flight)),
            row("... that failed", len(failed_in_flight), "0", not failed_in_flight),
            row("requests after it, refused with 503 while their model waits for room",
                len(refused_after) - len(victim_failures)),
            row("... answered any other way than 200 or that 503", len(victim_failures),
                "0", not victim_failures),
            row("victims serving again after the critical one is deleted (s)",
                round(back_s, 1), "by themselves", True),
        ],
        "notes": [f"6 opportunistic sim deployments of 1 GiB on 3 nodes of 2 GiB, "
                  f"{CLIENTS_PER_MODEL} clients each streaming {TOKENS / TOKENS_PER_SECOND:g}"
                  f"-second answers; the critical model claims 2 GiB; load_time_s "
                  f"{opts.load_time_s:g}",
                  f"victims {victims} on {sorted(crit_nodes)}; replicas on that node "
                  f"before: {on_its_node}",
                  *[f"{m}: {said[m].strip()}" for m in victims],
                  *[f"failed: {a.model} {a.status} {a.detail}"
                    for a in [*failed_in_flight, *victim_failures]][:10]],
        "raw": {"serve_s": serve_s, "back_s": back_s, "victims": victims},
    }


async def _view(stack: Stack, deployment_id: str) -> dict[str, Any]:
    view = await stack.view(deployment_id)
    while view is None:
        await asyncio.sleep(POLL_S)
        view = await stack.view(deployment_id)
    return view


#: The quota scenario's sizes: each replica claims 8 GiB of the two 16 GiB nodes (declared;
#: a sim holds a few MiB for real); team a is guaranteed two of them and limited to three.
QUOTA_REPLICA = 8 * GiB
QUOTA_GUARANTEE = 16 * GiB
QUOTA_LIMIT = 24 * GiB


async def quota(stack: Stack, opts: Options) -> dict[str, Any]:
    engine = {"load_time_s": opts.load_time_s}
    (await stack.api.put("/quotas/team-a", json={
        "guarantee": {"memory_bytes": QUOTA_GUARANTEE},
        "limit": {"memory_bytes": QUOTA_LIMIT}})).raise_for_status()
    # Team b, promised nothing, borrows the whole cluster while team a is idle.
    borrowers = {m: await _deploy(stack, {**sim_model(m, **engine),
                                          "memory_bytes": QUOTA_REPLICA},
                                  replicas=1, owner="team-b")
                 for m in (f"cap-b-{i}" for i in range(4))}
    for dep in borrowers.values():
        await stack.wait_for(dep, lambda v: ready(v) == 1, what="serving",
                             timeout=FILL_TIMEOUT_S)
    t0 = time.monotonic()
    a = await _deploy(stack, {**sim_model("cap-a", **engine), "memory_bytes": QUOTA_REPLICA},
                      replicas=2, owner="team-a")
    await stack.wait_for(a, lambda v: ready(v) == 2, what="serving both replicas",
                         timeout=SERVE_TIMEOUT_S)
    serve_s = time.monotonic() - t0
    views = {m: await _view(stack, d) for m, d in borrowers.items()}
    taken = sorted(m for m, v in views.items() if ready(v) == 0)
    said = [m for m in taken if "preempted by" in " ".join(
        str(views[m].get(k) or "") for k in ("placement_error", "demand_note"))]
    # Over the limit: a second deployment of 2 x 8 GiB would take team a to 32 GiB.
    await stack.post("/models", {**sim_model("cap-a-more", **engine),
                                 "memory_bytes": QUOTA_REPLICA})
    over = await stack.api.post("/deployments", json={"model_id": "cap-a-more", "replicas": 2,
                                                      "owner": "team-a"})
    refusal = over.json() if over.status_code == 409 else {}
    numbers = refusal.get("quota") or {}
    quotas = {q["scope"]: q for q in (await stack.api.get("/quotas")).json()}
    held = quotas.get("team-a", {}).get("held", {}).get("memory_bytes")
    return {
        "title": "2. Team a guaranteed 16 GiB (limit 24 GiB); team b borrowing the whole "
                 "cluster",
        "rows": [
            row("team a's 2 x 8 GiB: POST to both serving (s)", round(serve_s, 2)),
            row("team b's replicas taken back", len(taken), "2", len(taken) == 2),
            row("... showing 'preempted by'", len(said), str(len(taken)),
                len(said) == len(taken) and bool(taken)),
            row("team a holds (GiB)", None if held is None else held / GiB, "16",
                held == QUOTA_GUARANTEE),
            row("a deploy over team a's limit", over.status_code, "409",
                over.status_code == 409),
            row("... naming scope, held, asked and limit",
                "yes" if {"scope", "held", "asked", "limit"} <= set(numbers) else "no",
                "yes", {"scope", "held", "asked", "limit"} <= set(numbers)),
        ],
        "notes": ["2 nodes of 16 GiB; team b: 4 standard deployments of one 8 GiB sim "
                  "replica each; team a: one standard deployment of two",
                  f"taken back: {taken}",
                  f"refusal: {refusal.get('detail', over.text[:300])}"],
        "raw": {"serve_s": serve_s, "taken": taken, "refusal": refusal},
    }


SCENARIOS: dict[str, Scenario] = {"preempt": preempt, "quota": quota}
