"""Safe change under load: rolling restart, drain, switch with rollback, stop-first switch,
and a kill -9 of the control worker mid-saga, each on a fresh real stack.

Every component is the real one (PostgreSQL, the Temporal dev server, the control worker,
the API, the gateway, three agents with the sim engine), started by
:class:`bench.fleet.stack.Fleet`. Four clients send chat completions through the gateway
the whole time (open loop, one every ``--pace-ms`` each), and the saga is asked for through
the API, as an operator would. The harness never places, stops or repairs anything: it
starts the saga and reads what happened.

Per scenario it reports requests sent and failed (by status), the saga's end state and
steps, and the time each replacement took (from the move's own start and end, as the saga
recorded them). ``--quick`` runs the restart and the failed switch only (the slow test
tier runs it); the committed results are from the full run:

    python -m bench.sagas.run            # writes bench/results/sagas.md and .json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx

from bench.common import ROOT
from bench.fleet.stack import Fleet
from bench.recovery.client import SteadyClient, tally
from bench.report import run_meta, write_results
from modelkeeper.infra.processes import signal_group

T = TypeVar("T")

MiB = 1 << 20
GiB = 1 << 30
#: Nodes declare 2 GiB and each replica claims 1 GiB: a node holds two replicas, so a
#: 2-replica deployment spread over two of the three nodes leaves room for a third copy.
NODE_MEMORY = "2GiB"
CLAIM = GiB
#: What a sim replica really holds (the claim is only declared): keeps the machine free.
REAL_MEMORY = 16 * MiB
#: The sim engine loads this long, so a replacement is a visible window, not an instant.
LOAD_TIME_S = 1.0
CLIENTS = 4
#: A saga on an idle fleet ends in seconds; two minutes fails one that is stuck without
#: failing a slow one on two loaded cores.
SAGA_TIMEOUT_S = 120.0
#: Polling the API for a state; short next to the windows measured.
POLL_S = 0.2
#: A no-room drain waits this grace period before it stops what cannot move.
NO_ROOM_GRACE_S = 8.0
#: Each client sends one request this often (open loop).
PACE_S = 0.05


class SagaBenchError(RuntimeError):
    """A scenario did not reach the state it waits for; names what it saw."""


@dataclass
class Scenario:
    """One scenario's figures."""

    name: str
    sent: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    operation: dict[str, Any] = field(default_factory=dict)
    replacements_s: list[float] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bench:
    """A running fleet, its API and its clients."""

    fleet: Fleet
    api: httpx.AsyncClient
    key: str
    clients: list[SteadyClient] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    longest_gap_s: float = 0.0

    async def model(self, model_id: str, **engine_args: Any) -> None:
        resp = await self.api.post("/models", json={
            "model_id": model_id, "engine": "sim", "source": "sim", "memory_bytes": CLAIM,
            "engine_args": {"memory_bytes": REAL_MEMORY, "load_time_s": LOAD_TIME_S,
                            **engine_args}})
        _ok(resp)

    async def deploy(self, model_id: str, replicas: int) -> str:
        resp = await self.api.post("/deployments",
                                   json={"model_id": model_id, "replicas": replicas})
        _ok(resp)
        deployment_id: str = resp.json()["deployment_id"]
        await self.until(lambda: self.serving(deployment_id, replicas),
                         f"{deployment_id} serving {replicas}")
        return deployment_id

    async def deployment(self, deployment_id: str) -> dict[str, Any]:
        resp = await self.api.get(f"/deployments/{deployment_id}")
        _ok(resp)
        view: dict[str, Any] = resp.json()
        return view

    async def serving(self, deployment_id: str, replicas: int) -> bool:
        view = await self.deployment(deployment_id)
        ready = [r for r in view["replicas"] if r["state"] == "ready"]
        return view["status"] == "serving" and len(ready) == replicas == len(view["replicas"])

    async def node_ids(self) -> list[str]:
        resp = await self.api.get("/nodes")
        _ok(resp)
        return sorted(n["node_id"] for n in resp.json())

    async def cordon(self, node_id: str, cordoned: bool) -> None:
        _ok(await self.api.patch(f"/nodes/{node_id}", json={"cordoned": cordoned}))

    async def only_first_node(self) -> tuple[str, list[str]]:
        """Cordon every node but the first (in id order): what is placed now lands there.
        Returns it and the others, for :meth:`uncordon`."""
        first, *others = await self.node_ids()
        for node in others:
            await self.cordon(node, True)
        return first, others

    async def uncordon(self, nodes: list[str]) -> None:
        for node in nodes:
            await self.cordon(node, False)

    def start_clients(self, *models: str) -> None:
        """CLIENTS clients, spread over ``models``."""
        for i in range(CLIENTS):
            client = SteadyClient(url=f"{self.fleet.gateway_url}/v1/chat/completions",
                                  model=models[i % len(models)], key=self.key,
                                  pace_s=PACE_S)
            self.clients.append(client)
            self.tasks.append(asyncio.create_task(client.run()))

    async def stop_clients(self) -> tuple[int, dict[str, int]]:
        """Stop the clients; requests sent, and the failed ones by status. The longest
        wait between two successful answers is kept in ``longest_gap_s``."""
        for client in self.clients:
            client.stop()
        await asyncio.gather(*self.tasks)
        outcomes = [o for c in self.clients for o in c.outcomes]
        ends = sorted(o.ended for o in outcomes if o.ok)
        self.longest_gap_s = max((b - a for a, b in itertools.pairwise(ends)),
                                 default=0.0)
        self.clients, self.tasks = [], []
        return len(outcomes), tally(outcomes)

    async def operation(self, path: str, body: dict[str, Any] | None = None) -> str:
        resp = await self.api.post(path, json=body or {})
        _ok(resp, 202)
        operation_id: str = resp.json()["operation_id"]
        return operation_id

    async def ended(self, operation_id: str) -> dict[str, Any]:
        """The operation once it has ended."""
        async def done() -> dict[str, Any] | None:
            resp = await self.api.get(f"/operations/{operation_id}")
            if resp.status_code != 200:
                return None
            record: dict[str, Any] = resp.json()
            return record if record["state"] != "running" else None
        return await self.until(done, f"{operation_id} ended", timeout=SAGA_TIMEOUT_S)

    async def until(self, check: Callable[[], Awaitable[T | None]], what: str, *,
                    timeout: float = SAGA_TIMEOUT_S) -> T:
        """``check``'s first truthy answer, asked every POLL_S; a SagaBenchError naming
        ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                result = await check()
            except httpx.HTTPError:
                result = None  # a slow answer on busy cores: ask again
            if result:
                return result
            await asyncio.sleep(POLL_S)
        raise SagaBenchError(f"not {what} after {timeout:.0f}s")

    async def claims_match(self) -> dict[str, Any]:
        """Memory claimed in the store against what the live replicas hold."""
        conn = await asyncpg.connect(self.fleet.database_url)
        try:
            claimed = await conn.fetchval(
                "SELECT COALESCE(sum(memory_bytes), 0) FROM allocations")
            live = await conn.fetchval("SELECT count(*) FROM replicas")
        finally:
            await conn.close()
        return {"claimed_bytes": int(claimed), "replica_rows": int(live),
                "match": int(claimed) == int(live) * CLAIM}



def _ok(resp: httpx.Response, status: int = 200) -> None:
    if resp.status_code not in (status, 201):
        raise SagaBenchError(f"{resp.request.method} {resp.request.url.path}: "
                             f"{resp.status_code} {resp.text}")


def _replacement_times(record: dict[str, Any]) -> list[float]:
    """Seconds each replace step took, from its recorded start and end."""
    times = []
    for step in record.get("steps", []):
        if step["name"].startswith("replace") and step.get("started_at") and \
                step.get("ended_at") and step["state"] == "done":
            started = _when(step["started_at"])
            ended = _when(step["ended_at"])
            times.append(round(ended - started, 2))
    return times


def _when(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


# -- scenarios ------------------------------------------------------------------------------


async def rolling_restart(bench: Bench) -> Scenario:
    """Restart a 2-replica deployment with room for a third copy, under 4 clients."""
    await bench.model("sim-a")
    dep = await bench.deploy("sim-a", 2)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    record = await bench.ended(await bench.operation(f"/deployments/{dep}/restart"))
    view = await bench.deployment(dep)
    sent, failed = await bench.stop_clients()
    return Scenario("rolling restart, 2 replicas, room for a third", sent, failed, record,
                    _replacement_times(record), {
                        "state": record["state"],
                        "generations": sorted(r.get("generation", 0) for r in view["replicas"]),
                        "claims": await bench.claims_match()})


async def drain(bench: Bench) -> Scenario:
    """Drain a node that holds replicas of two deployments, under 4 clients."""
    # Both deployments land on the target: the others are cordoned while they place.
    target, others = await bench.only_first_node()
    await bench.model("sim-a")
    await bench.model("sim-b")
    dep_a = await bench.deploy("sim-a", 1)
    dep_b = await bench.deploy("sim-b", 1)
    await bench.uncordon(others)
    bench.start_clients("sim-a", "sim-b")
    await asyncio.sleep(2)
    record = await bench.ended(await bench.operation(f"/nodes/{target}/drain",
                                                     {"grace_s": 60}))
    where = [n for dep in (dep_a, dep_b) for r in (await bench.deployment(dep))["replicas"]
             for n in r["nodes"]]
    sent, failed = await bench.stop_clients()
    return Scenario("drain of a node holding 2 deployments", sent, failed, record,
                    _replacement_times(record), {
                        "state": record["state"], "left_on_drained_node": where.count(target),
                        "claims": await bench.claims_match()})


async def drain_without_room(bench: Bench) -> Scenario:
    """Drain the only node with room: the outage is bounded by the grace period."""
    target, _ = await bench.only_first_node()
    await bench.model("sim-a")
    dep = await bench.deploy("sim-a", 1)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    t0 = time.monotonic()
    record = await bench.ended(await bench.operation(
        f"/nodes/{target}/drain", {"grace_s": NO_ROOM_GRACE_S}))
    drained_after = time.monotonic() - t0
    view = await bench.deployment(dep)
    sent, failed = await bench.stop_clients()
    return Scenario(f"drain with no room elsewhere (grace {NO_ROOM_GRACE_S:.0f} s)", sent,
                    failed, record, [], {
                        "state": record["state"], "saga_s": round(drained_after, 1),
                        "deployment_status": view["status"],
                        "reason": view.get("placement_error") or view.get("last_failure"),
                        "claims": await bench.claims_match()})


async def switch_rollback(bench: Bench) -> Scenario:
    """Switch to a model that crashes at start, with room to keep A beside it."""
    await bench.model("sim-a")
    await bench.model("sim-bad", fail_at_start=True)
    dep = await bench.deploy("sim-a", 1)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    record = await bench.ended(await bench.operation(f"/deployments/{dep}/switch",
                                                     {"model_id": "sim-bad"}))
    serving = await bench.serving(dep, 1)
    sent, failed = await bench.stop_clients()
    return Scenario("switch to a model that crashes at start (A kept beside)", sent, failed,
                    record, [], {"state": record["state"], "error": record.get("error"),
                                 "serving_after": serving,
                                 "claims": await bench.claims_match()})


async def switch_stop_first(bench: Bench) -> Scenario:
    """Switch where A must stop first: only one node, with room for one replica."""
    await bench.only_first_node()
    # A replica claims 1.5 GiB of the node's 2: A and B cannot both fit.
    for model_id in ("sim-a", "sim-b"):
        _ok(await bench.api.post("/models", json={
            "model_id": model_id, "engine": "sim", "source": "sim",
            "memory_bytes": 3 * GiB // 2,
            "engine_args": {"memory_bytes": REAL_MEMORY, "load_time_s": LOAD_TIME_S}}))
    dep = await bench.deploy("sim-a", 1)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    record = await bench.ended(await bench.operation(f"/deployments/{dep}/switch",
                                                     {"model_id": "sim-b"}))
    view = await bench.deployment(dep)
    sent, failed = await bench.stop_clients()
    # The outage: the longest time without a successful answer (requests meanwhile are
    # held by the gateway, up to its wait for a replica, then answered).
    return Scenario("switch where A must stop first", sent, failed, record,
                    _replacement_times(record), {
                        "state": record["state"], "runs": view.get("runs_model_id"),
                        "outage_s": round(bench.longest_gap_s, 2),
                        "claims_bytes": (await bench.claims_match())["claimed_bytes"]})


async def _kill_worker_when(bench: Bench, operation_id: str, step_prefix: str) -> None:
    """kill -9 the control worker once the saga has begun a step named ``step_prefix``,
    and start another at once (what a process manager does)."""
    async def step_started() -> bool:
        resp = await bench.api.get(f"/operations/{operation_id}")
        steps = resp.json().get("steps", []) if resp.status_code == 200 else []
        return any(s["name"].startswith(step_prefix) for s in steps)
    await bench.until(step_started, f"{operation_id}: a step {step_prefix!r} began")
    worker = next(p for p in bench.fleet.started if p.name == "worker")
    signal_group(worker.pid, signal.SIGKILL)
    worker.stop(grace=0)
    worker.start()


async def _placed(bench: Bench, deployment_id: str) -> int:
    """Replicas ever placed for the deployment (one replica.placed event each)."""
    conn = await asyncpg.connect(bench.fleet.database_url)
    try:
        placed: int = await conn.fetchval(
            "SELECT count(*) FROM events WHERE deployment_id = $1 AND kind = 'replica.placed'",
            deployment_id)
    finally:
        await conn.close()
    return placed


async def worker_killed_mid_restart(bench: Bench) -> Scenario:
    """kill -9 the control worker while a rolling restart runs; start another."""
    await bench.model("sim-a")
    dep = await bench.deploy("sim-a", 2)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    operation_id = await bench.operation(f"/deployments/{dep}/restart")
    await _kill_worker_when(bench, operation_id, "replace")
    record = await bench.ended(operation_id)
    await bench.until(lambda: bench.serving(dep, 2), f"{dep} serving 2")
    sent, failed = await bench.stop_clients()
    return Scenario("kill -9 of the control worker mid-restart", sent, failed, record,
                    _replacement_times(record), {
                        "state": record["state"],
                        # 2 first placements + one per replacement: nothing placed twice.
                        "placed": await _placed(bench, dep), "placed_expected": 4,
                        "claims": await bench.claims_match()})


async def worker_killed_mid_drain(bench: Bench) -> Scenario:
    """kill -9 the control worker while a drain moves a replica; start another."""
    target, others = await bench.only_first_node()
    await bench.model("sim-a")
    dep = await bench.deploy("sim-a", 1)
    await bench.uncordon(others)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    operation_id = await bench.operation(f"/nodes/{target}/drain", {"grace_s": 60})
    await _kill_worker_when(bench, operation_id, "replace")
    record = await bench.ended(operation_id)
    await bench.until(lambda: bench.serving(dep, 1), f"{dep} serving 1")
    where = [n for r in (await bench.deployment(dep))["replicas"] for n in r["nodes"]]
    sent, failed = await bench.stop_clients()
    return Scenario("kill -9 of the control worker mid-drain", sent, failed, record,
                    _replacement_times(record), {
                        "state": record["state"], "left_on_drained_node": where.count(target),
                        "placed": await _placed(bench, dep), "placed_expected": 2,
                        "claims": await bench.claims_match()})


async def worker_killed_mid_switch(bench: Bench) -> Scenario:
    """kill -9 the control worker while a switch that fails rolls back; start another."""
    await bench.model("sim-a")
    # Loads for 3 s, then fails: the worker dies while B is loading.
    await bench.model("sim-bad", fail_at_start=True, load_time_s=3.0)
    dep = await bench.deploy("sim-a", 1)
    bench.start_clients("sim-a")
    await asyncio.sleep(2)
    operation_id = await bench.operation(f"/deployments/{dep}/switch",
                                         {"model_id": "sim-bad"})
    await _kill_worker_when(bench, operation_id, "replace")
    record = await bench.ended(operation_id)
    serving = await bench.serving(dep, 1)
    sent, failed = await bench.stop_clients()
    return Scenario("kill -9 of the control worker mid-switch (B fails, rolled back)", sent,
                    failed, record, [], {
                        "state": record["state"], "serving_after": serving,
                        "placed": await _placed(bench, dep), "placed_expected": 2,
                        "claims": await bench.claims_match()})


SCENARIOS: dict[str, Callable[[Bench], Awaitable[Scenario]]] = {
    "restart": rolling_restart, "drain": drain, "drain-no-room": drain_without_room,
    "switch-rollback": switch_rollback, "switch-stop-first": switch_stop_first,
    "worker-kill-restart": worker_killed_mid_restart,
    "worker-kill-drain": worker_killed_mid_drain,
    "worker-kill-switch": worker_killed_mid_switch,
}
QUICK = ("restart", "switch-rollback")


async def run_one(name: str, root: Path) -> Scenario:
    """One scenario on a fresh fleet, stopped whatever happens."""
    fleet = Fleet(root=root, node_memory=NODE_MEMORY, agent_count=3)
    try:
        await fleet.start()
        async with operator_api(fleet) as api:
            bench = Bench(fleet, api, await fleet.client_key())
            try:
                return await SCENARIOS[name](bench)
            finally:
                for client in bench.clients:
                    client.stop()
                await asyncio.gather(*bench.tasks, return_exceptions=True)
    finally:
        await asyncio.to_thread(fleet.stop)


@contextlib.asynccontextmanager
async def operator_api(fleet: Fleet) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the fleet's API that presents the fleet's admin token (the API
    refuses operators without one)."""
    async with httpx.AsyncClient(
            base_url=fleet.api_url, timeout=30,
            headers={"Authorization": f"Bearer {fleet.operator_token}"}) as api:
        yield api


def render(results: list[Scenario], meta: dict[str, Any]) -> str:
    lines = ["# Safe change under load", "",
             f"`{meta['command']}` on {meta['date']}, {meta['cores']} cores, code "
             f"{meta['code']}. {CLIENTS} clients, one request every {PACE_S * 1e3:.0f} ms "
             f"each, through the gateway; sim engine loading {LOAD_TIME_S} s.", "",
             "| scenario | requests | failed | saga ended | time per replacement (s) |",
             "|---|---:|---:|---|---|"]
    for r in results:
        failed = sum(r.failed.values())
        lines.append(f"| {r.name} | {r.sent} | {failed}"
                     f"{' ' + json.dumps(r.failed) if failed else ''} | "
                     f"{r.operation.get('state', '-')} | "
                     f"{', '.join(f'{t:.1f}' for t in r.replacements_s) or '-'} |")
    lines += ["", "## Checks", ""]
    for r in results:
        lines.append(f"- **{r.name}**: {json.dumps(r.checks)}")
    lines += ["", "## Steps, as each saga recorded them", ""]
    for r in results:
        lines.append(f"### {r.name}: `{r.operation.get('operation_id', '-')}`")
        lines.append("")
        for step in r.operation.get("steps", []):
            lines.append(f"- {step['name']}: {step['state']}"
                         f"{' - ' + step['detail'] if step.get('detail') else ''}")
        if r.operation.get("error"):
            lines.append(f"- error: {r.operation['error']}")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sagas.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS),
                        default=list(SCENARIOS))
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)} (the slow test tier)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sagas",
                        help="write OUT.md and OUT.json (default bench/results/sagas)")
    args = parser.parse_args(argv)
    names = list(QUICK) if args.quick else args.scenarios
    results = []
    for name in names:
        root = Path(tempfile.mkdtemp(prefix=f"mk-sagas-{name}-"))
        results.append(asyncio.run(run_one(name, root)))
        shutil.rmtree(root, ignore_errors=True)
    meta = run_meta("bench.sagas.run", argv)
    markdown = render(results, meta)
    print(markdown)
    write_results(args.out, {"meta": meta, "scenarios": [r.__dict__ for r in results]},
                  markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
