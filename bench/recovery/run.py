"""How long a whole-node crash leaves a one-replica deployment without service, and why.

Run it from the repository root::

    .venv/bin/python -m bench.recovery.run --crashes 20

It starts the whole stack with default settings (:mod:`bench.fleet.stack`: embedded
PostgreSQL, the Temporal dev server, the control worker, the API, the gateway and three
agents with declared memory), deploys one replica of the sim engine (16 MiB resident,
``load_time_s`` 1.0 so the load is visible and constant), and keeps a client sending it
a one-token chat completion through the gateway every 50 ms (:mod:`bench.recovery.client`).

Then, N times: find the node that hosts the replica (``GET /replicas``), kill -9 its agent
and every engine it started (``t0``), and poll ``GET /deployments/{id}`` every 50 ms for

1. **notice**: the control plane marks the replica unreachable, or the deployment leaves
   ``serving`` (``degraded``), or a replacement appears, whichever is seen first;
2. **place**: the replacement that ends up serving appears as a replica row (placed);
3. **load**: from placed until the first request through the gateway succeeds (the
   replacement is ready and routed to).

The total gap is ``t0`` to the first success through the gateway among requests sent at or
after ``t0``. Then the crashed agent is started again (same folder: it rejoins as the same
node) and the next crash waits until the deployment is steady: serving on one replica,
three nodes ready, the replica's watch running and heartbeating in its workflow, and a
request served.

This runs once per ``--claim-gib`` value, each on a fresh fleet of nodes declaring
``--node-memory`` (4 GiB): by default a 1 GiB model, which leaves the crashed node room for
a second copy, and a 3 GiB one, which does not. Placement bin-packs, and a crashed node
still looks ready for ``MODELKEEPER_NODE_UNREACHABLE_AFTER_S``, so where the replacement
goes (and so how long the gap is) depends on that room.

Results go to ``--out`` (``bench/results/recovery.md`` and ``.json``): min / median / max
of each step, the client's failed requests by status, the settings in force, and the raw
numbers of every crash, with the server's own event times beside the polled ones.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client

from bench.common import ROOT, exit_now, interrupt_on_sigterm, on_fresh_fleet
from bench.fleet.stack import NAMESPACE, Fleet
from bench.report import run_meta, write_results
from modelkeeper.domain.units import parse_bytes
from modelkeeper.names import ACTIVITY_WATCH_SHARD

from .client import SteadyClient, tally
from .report import render, settings_in_force

MODEL = "recovery-sim"
MiB, GiB = 1 << 20, 1 << 30
#: Nodes in the fleet: the crashed one and two that can take its replica.
AGENTS = 3
#: How often the control plane's view is read during a recovery: the resolution of the
#: notice and place times (each read also takes a few ms of the API's time).
POLL_S = 0.05
#: From a crash until served again. The slowest path the defaults allow is about 25 s
#: (lost-after 15 s, a failed start's 10 s backoff, the load); past two minutes the
#: recovery is stuck, and the run stops with the logs kept.
RECOVERY_TIMEOUT_S = 120.0
#: Until steady again after the agent is back (the first deployment also waits out the
#: settling window, 15 s by default).
STEADY_TIMEOUT_S = 120.0
#: How often the steady-state conditions are read between crashes.
STEADY_POLL_S = 0.2


class RecoveryError(RuntimeError):
    """A recovery or a steady state did not come in time."""


async def deploy(api: httpx.AsyncClient, *, claim_bytes: int, load_time_s: float,
                 engine_args: dict[str, Any] | None = None, model_id: str = MODEL) -> str:
    """Declare the sim model and deploy one replica of it; returns the deployment id.
    ``engine_args``: more of the sim's arguments (its speed, say)."""
    resp = await api.post("/models", json={
        "model_id": model_id, "engine": "sim", "source": "sim", "memory_bytes": claim_bytes,
        "engine_args": {"memory_bytes": 16 * MiB, "load_time_s": load_time_s,
                        **(engine_args or {})}})
    resp.raise_for_status()
    resp = await api.post("/deployments", json={"model_id": model_id, "replicas": 1})
    resp.raise_for_status()
    deployment_id: str = resp.json()["deployment_id"]
    return deployment_id


async def deployment_view(api: httpx.AsyncClient, deployment_id: str) -> dict[str, Any] | None:
    try:
        resp = await api.get(f"/deployments/{deployment_id}")
    except httpx.HTTPError:
        return None  # a slow read on busy cores: the next poll tries again
    return resp.json() if resp.status_code == 200 else None


async def _watching(temporal: Client, workflow_id: str) -> bool:
    """True when the workflow's only pending activity is one watch that has heartbeated:
    a crash from now on is detected by the heartbeat timeout, not by a watch not yet
    started."""
    desc = await temporal.get_workflow_handle(workflow_id).describe()
    pending = desc.raw_description.pending_activities
    return len(pending) == 1 and pending[0].activity_type.name == ACTIVITY_WATCH_SHARD \
        and pending[0].state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED \
        and pending[0].HasField("last_heartbeat_time")


async def wait_steady(fleet: Fleet, api: httpx.AsyncClient, temporal: Client,
                      client: SteadyClient, deployment_id: str) -> dict[str, Any]:
    """Wait until the deployment serves on one ready replica, every node is ready, the
    replica is watched, and a request sent after all that succeeded; returns the replica."""
    deadline = time.monotonic() + STEADY_TIMEOUT_S
    last = "nothing read yet"
    while time.monotonic() < deadline:
        view = await deployment_view(api, deployment_id)
        if view is None:
            last = "the API did not answer"
        elif view["status"] != "serving" or len(view["replicas"]) != 1 \
                or view["replicas"][0]["state"] != "ready":
            last = (f"deployment {view['status']}, replicas "
                    f"{[(r['replica_id'], r['state']) for r in view['replicas']]}")
        elif not all([await fleet.node_ready(a) for a in fleet.agents]):
            last = "not every node is ready"
        elif not await _watching(temporal, view["workflow_id"]):
            last = "the replica's watch is not running yet"
        else:
            since = time.monotonic()
            while client.first_success_after(since) is None:
                if time.monotonic() > deadline:
                    raise RecoveryError("steady, but no request through the gateway succeeds")
                await asyncio.sleep(STEADY_POLL_S)
            replica: dict[str, Any] = view["replicas"][0]
            return replica
        await asyncio.sleep(STEADY_POLL_S)
    raise RecoveryError(f"not steady after {STEADY_TIMEOUT_S:.0f}s: {last}")


async def crash_once(index: int, fleet: Fleet, api: httpx.AsyncClient, temporal: Client,
                     client: SteadyClient, deployment_id: str) -> dict[str, Any]:
    """Crash the node that hosts the replica, time each step back to service, revive it."""
    replicas = [r for r in (await api.get("/replicas")).json()
                if r["deployment_id"] == deployment_id]
    [old] = replicas
    agent = fleet.agent_of(old["nodes"][0])
    names = {a.node_id: a.name for a in fleet.agents}
    crash = fleet.crash(agent)
    t0 = crash.t0

    notice: float | None = None
    notice_by = ""
    first_seen: dict[str, float] = {}
    ready_at: float | None = None
    serving_replica: dict[str, Any] | None = None
    while True:
        view = await deployment_view(api, deployment_id)
        at = time.monotonic()
        if view is not None:
            reps = {r["replica_id"]: r for r in view["replicas"]}
            others = {rid: r for rid, r in reps.items() if rid != old["replica_id"]}
            for rid in others:
                first_seen.setdefault(rid, at)
            if notice is None:
                original = reps.get(old["replica_id"])
                if view["status"] != "serving":
                    notice_by = f"deployment {view['status']}"
                elif original is None or original["state"] != "ready":
                    notice_by = f"replica {original['state'] if original else 'gone'}"
                elif others:
                    notice_by = "replacement placed"
                notice = at if notice_by else None
            ready = [r for r in others.values() if r["state"] == "ready"]
            if ready_at is None and ready:
                ready_at, serving_replica = at, ready[0]
        success = client.first_success_after(t0)
        if serving_replica is not None and success is not None:
            break
        if at - t0 > RECOVERY_TIMEOUT_S:
            raise RecoveryError(f"crash {index}: not served again {RECOVERY_TIMEOUT_S:.0f}s "
                                f"after the crash of {agent.name}")
        await asyncio.sleep(POLL_S)
    assert notice is not None and serving_replica is not None and success is not None

    fleet.revive(agent)
    steady_from = time.monotonic()
    await wait_steady(fleet, api, temporal, client, deployment_id)
    steady_s = time.monotonic() - steady_from

    events = (await api.get("/events", params={"deployment_id": deployment_id,
                                               "limit": 200})).json()
    def since_t0(stamp: str) -> float:
        return round(datetime.fromisoformat(stamp).timestamp() - crash.t0_wall, 3)
    after = [e for e in events if datetime.fromisoformat(e["at"]).timestamp() >= crash.t0_wall]
    placed = serving_replica["replica_id"]
    result = {
        "_t0": t0,
        "crash": index,
        "t0_wall": round(crash.t0_wall, 3),
        "node": agent.name,
        "node_id": agent.node_id,
        "replica": old["replica_id"],
        "engine_pgids_killed": list(crash.engine_pgids),
        "notice_s": round(notice - t0, 3),
        "notice_by": notice_by,
        "placed_s": round(first_seen[placed] - t0, 3),
        "first_placed_s": round(min(first_seen.values()) - t0, 3),
        "ready_seen_s": round((ready_at or 0) - t0, 3),
        "first_success_s": round(success.ended - t0, 3),
        "first_success_sent_s": round(success.sent - t0, 3),
        "serving_replica": placed,
        "serving_node": names.get(serving_replica["nodes"][0], serving_replica["nodes"][0]),
        "placements": [{"replica": e["replica_id"], "at_s": since_t0(e["at"]),
                        "node": names.get((e.get("data") or {}).get("nodes", ["?"])[0], "?")}
                       for e in after if e["kind"] == "replica.placed"],
        "events": [{"kind": e["kind"], "at_s": since_t0(e["at"]), "message": e["message"]}
                   for e in after],
        "steady_again_s": round(steady_s, 3),
    }
    result["place_s"] = round(result["placed_s"] - result["notice_s"], 3)
    result["load_s"] = round(result["first_success_s"] - result["placed_s"], 3)
    wasted = [p for p in result["placements"] if p["replica"] != placed]
    print(f"crash {index}: {agent.name} -> {result['serving_node']}: notice "
          f"{result['notice_s']:.2f}s ({notice_by}), place {result['place_s']:.2f}s, load "
          f"{result['load_s']:.2f}s, gap {result['first_success_s']:.2f}s"
          + (f"; {len(wasted)} placement(s) that never served: {wasted}" if wasted else ""),
          flush=True)
    return result


async def run_scenario(args: argparse.Namespace, fleet: Fleet,
                       claim_gib: int) -> dict[str, Any]:
    """Start the fleet, deploy, and crash the replica's node ``args.crashes`` times."""
    await fleet.start()
    key = await fleet.client_key()
    temporal = await Client.connect(fleet.temporal_address, namespace=NAMESPACE)
    client = SteadyClient(f"{fleet.gateway_url}/v1/chat/completions", MODEL, key,
                          args.pace_ms / 1e3)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(
            base_url=fleet.api_url, timeout=10.0,
            headers={"Authorization": f"Bearer {fleet.operator_token}"}) as api:
        deployment_id = await deploy(api, claim_bytes=claim_gib * GiB,
                                     load_time_s=args.load_time)
        sending = asyncio.create_task(client.run())
        try:
            await wait_steady(fleet, api, temporal, client, deployment_id)
            started = time.monotonic()
            for index in range(1, args.crashes + 1):
                results.append(await crash_once(index, fleet, api, temporal, client,
                                                deployment_id))
            print(f"{len(results)} crashes in {time.monotonic() - started:.0f}s", flush=True)
        finally:
            client.stop()
            await sending
    # Each crash owns the requests sent from its t0 until the next crash's.
    ends = [r["_t0"] for r in results[1:]] + [float("inf")]
    for result, end in zip(results, ends, strict=True):
        mine = client.between(result.pop("_t0"), end)
        result["requests"] = len(mine)
        result["failed"] = tally(mine)
        result["longest_ok_s"] = round(max((o.ended - o.sent for o in mine if o.ok),
                                           default=0.0), 3)
    ok = [o.ended - o.sent for o in client.outcomes if o.ok]
    room = parse_bytes(args.node_memory) >= 2 * claim_gib * GiB
    return {
        "claim_gib": claim_gib,
        "title": (f"{claim_gib} GiB model: the crashed node still has room for a second copy"
                  if room else f"{claim_gib} GiB model: no room for a second copy on the "
                  "crashed node"),
        "crashed_node_has_room": room,
        "results": results,
        "client": {"sent": len(client.outcomes), "failed": tally(client.outcomes),
                   "longest_ok_s": round(max(ok), 3) if ok else 0.0},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--crashes", type=int, default=20, help="node crashes (default 20)")
    parser.add_argument("--pace-ms", type=float, default=50.0,
                        help="one client request every this many ms (default 50)")
    parser.add_argument("--load-time", type=float, default=1.0,
                        help="the sim engine's load_time_s (default 1.0)")
    parser.add_argument("--node-memory", default="4GiB",
                        help="memory each agent declares (default 4GiB)")
    parser.add_argument("--claim-gib", type=int, nargs="+", default=[1, 3],
                        help="memory the model claims per replica, GiB; one scenario (a "
                        "fresh fleet) per value (default 1 3: the crashed node has room "
                        "for a second copy, then it has not)")
    parser.add_argument("--note", default="", help="a remark for the results header")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recovery",
                        help="write OUT.md and OUT.json (default bench/results/recovery)")
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
    scenarios = []
    for claim_gib in args.claim_gib:
        scenario = on_fresh_fleet(
            "mk-recovery-",
            lambda root: Fleet(root, node_memory=args.node_memory, agent_count=AGENTS),
            functools.partial(run_scenario, args, claim_gib=claim_gib), keep=args.keep)
        if scenario is None:
            return 130
        scenarios.append(scenario)
    meta = {
        **run_meta("bench.recovery.run", argv),
        "note": args.note, "pace_ms": args.pace_ms,
        "poll_ms": POLL_S * 1e3, "load_time_s": args.load_time, "agents": AGENTS,
        "node_memory": args.node_memory, "settings": settings_in_force(),
    }
    markdown = render(scenarios, meta)
    print(markdown)
    write_results(args.out, {"meta": meta, "scenarios": scenarios}, markdown)
    return 0


if __name__ == "__main__":
    exit_now(main())
