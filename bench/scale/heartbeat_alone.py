"""What one agent heartbeat costs the API, and nothing else: the API process's CPU seconds
per ``POST /nodes/{id}/heartbeat`` and the heartbeat's round trip.

Run it as ``python -m bench.scale.heartbeat_alone --nodes 300 --seconds 20``.

The stack is the smallest the route runs on: an embedded PostgreSQL, the Temporal dev
server (the API's lifespan connects to it; nothing here signals a workflow) and the API as
``python -m modelkeeper api``, its own process, at its default settings. No worker, no
gateway, no engines: the CPU read is the API's alone.

1. N nodes register through the API from loopback (no join token: each is issued a real
   credential, stored hashed, as a first join is).
2. Each node sends one heartbeat, unmeasured: the first one confirms its credential and
   warms the API's pool and caches.
3. For ``--seconds``, the N simulated agents heartbeat with their credentials and a GPU
   node's inventory (8 GPUs, memory available moving a little each beat, one shard
   reported): either as fast as ``--concurrency`` requests in flight allow (the default:
   what the API can take), or each node every ``--pace`` seconds (2 is the agent's own
   interval) so that the load is the real one.

The API's CPU is read from ``/proc/<pid>/stat`` (user + system) before and after the
measured window; ``idle`` is the same read over a quiet second before it, so a background
cost shows apart. The bodies are serialised once per node beforehand: the benchmark's own
CPU, on the same cores, should go to sending, not to building JSON.

``--api-source DIR`` runs the API from another checkout (a ``git worktree`` of an older
commit): its process gets that folder first on ``PYTHONPATH`` and as its working folder,
so the same benchmark measures old code and new.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.fleet.stack import (
    HOST,
    NAMESPACE,
    SECRET,
    clean_environ,
    start_database_and_temporal,
    wait_ready,
)
from bench.stats import percentile
from modelkeeper.infra.processes import ManagedProcess, free_port

#: A component on two shared cores takes a few seconds to import and connect.
READY_TIMEOUT_S = 90.0
#: Registrations in flight at once: enough to be quick, few enough not to time out.
REGISTER_CONCURRENCY = 16
#: A request slower than this is a failure of the stack, not a sample.
REQUEST_TIMEOUT_S = 30.0
#: The quiet window before the load, over which the API's background CPU is read.
IDLE_WINDOW_S = 1.0
#: A GPU node's inventory as an agent on a real 8-GPU server reports it.
GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEMORY_BYTES = 85_520_809_984
GPUS_PER_NODE = 8
NODE_MEMORY_BYTES = 2_164_154_105_856
CPUS_PER_NODE = 224
#: Distinct bodies per node: memory available moves between beats, as /proc/meminfo does.
BODY_VARIANTS = 4
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: How long the API is given to write its profile before it is stopped.
PROFILE_DUMP_S = 3.0


@dataclass
class SimNode:
    """One simulated agent: its id, credential and ready-made heartbeat bodies."""

    node_id: str
    credential: str = ""
    bodies: list[bytes] = field(default_factory=list)
    beats: int = 0

    def next_body(self) -> bytes:
        body = self.bodies[self.beats % len(self.bodies)]
        self.beats += 1
        return body


@dataclass
class Samples:
    """What the measured window saw."""

    round_trips: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0

    def add(self, status: int, seconds: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status == 200:
            self.round_trips.append(seconds)


def inventory(index: int, variant: int) -> dict[str, Any]:
    gpus = [{"index": i, "name": GPU_NAME, "memory_bytes": GPU_MEMORY_BYTES, "healthy": True}
            for i in range(GPUS_PER_NODE)]
    available = NODE_MEMORY_BYTES // 2 - variant * 7_340_032 - index * 4096
    return {"memory_total_bytes": NODE_MEMORY_BYTES, "memory_available_bytes": available,
            "cpu_count": CPUS_PER_NODE, "gpus": gpus}


def shard(index: int) -> dict[str, Any]:
    port = 20000 + index * 4
    return {"replica_id": f"bench-r{index}", "model_id": "bench-model", "rank": 0,
            "state": "ready", "port": port, "pid": 100000 + index,
            "url": f"http://{HOST}:{port}", "adopted": False}


def heartbeat_bodies(index: int) -> list[bytes]:
    return [json.dumps({"inventory": inventory(index, v), "shards": [shard(index)]}).encode()
            for v in range(BODY_VARIANTS)]


def registration(node: SimNode, index: int) -> dict[str, Any]:
    port = 20000 + index * 4
    return {"node_id": node.node_id, "name": node.node_id, "labels": {"rack": str(index % 8)},
            "inventory": inventory(index, 0), "shards": [], "agent_version": "bench",
            "engine_host": HOST, "engine_ports": {"low": port, "high": port + 3}}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (fields 14 and 15 of /proc/<pid>/stat, counted
    after the command name, which may itself hold spaces)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


#: The API's registration burst here (registration_burst, at its upper bound): every node
#: registers from loopback at once, and pacing registrations is not what this measures.
REGISTRATION_BURST = 1_000_000


class Stack:
    """PostgreSQL, Temporal and the API, in one temporary folder."""

    def __init__(self, root: Path, api_source: Path | None, profile: Path | None) -> None:
        self.root = root
        self.api_source = api_source
        self.profile = profile
        self.started: list[ManagedProcess] = []
        self.api: ManagedProcess | None = None
        self.api_url = ""
        self.api_module = ""

    async def start(self) -> None:
        logs = self.root / "logs"
        database_url, temporal_address = await start_database_and_temporal(
            self.root, self.started)
        api_port = free_port()
        self.api_url = f"http://{HOST}:{api_port}"
        env = {**clean_environ(),
               "MODELKEEPER_DATA_DIR": str(self.root / "data"),
               "MODELKEEPER_BIND_HOST": HOST,
               "MODELKEEPER_API_PORT": str(api_port),
               "MODELKEEPER_API_URL": self.api_url,
               "MODELKEEPER_DATABASE_URL": database_url,
               "MODELKEEPER_ENGINE_KEY_SECRET": SECRET,
               "MODELKEEPER_REGISTRATION_BURST": str(REGISTRATION_BURST),
               "TEMPORAL_ADDRESS": temporal_address,
               "TEMPORAL_NAMESPACE": NAMESPACE}
        if self.api_source is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(self.api_source), *filter(None, [env.get("PYTHONPATH")])])
        # Which code the API will run, asked of the same interpreter, environment and folder.
        self.api_module = subprocess.run(
            [sys.executable, "-c", "import api.agents as m; print(m.__file__)"], env=env,
            cwd=self.api_source, capture_output=True, text=True, check=True).stdout.strip()
        argv = [sys.executable, "-m", "modelkeeper", "api"]
        if self.profile is not None:
            # Run from this checkout's bench package whatever the API's source: the
            # component wrapper only starts the profiler, then runs that source's API.
            env["PYTHONPATH"] = os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]),
                                                 str(Path(__file__).parents[2])])
            argv = [sys.executable, "-m", "bench.scale.component", "--profile",
                    str(self.profile), "api"]
        self.api = ManagedProcess("api", argv, logs / "api.log", env=env, cwd=self.api_source)
        self.api.start()
        self.started.append(self.api)
        await wait_ready(self.api, self._api_ready, READY_TIMEOUT_S)

    async def _api_ready(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2.0) as http:
                return (await http.get(f"{self.api_url}/healthz")).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        for proc in reversed(self.started):
            proc.stop(grace=5.0)


async def register_all(http: httpx.AsyncClient, count: int) -> list[SimNode]:
    nodes = [SimNode(node_id=f"hb-{i:05d}", bodies=heartbeat_bodies(i)) for i in range(count)]
    gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

    async def one(index: int, node: SimNode) -> None:
        async with gate:
            resp = await http.post("/nodes/register", json=registration(node, index))
        if resp.status_code != 200 or not resp.json().get("node_credential"):
            raise RuntimeError(f"registering {node.node_id}: {resp.status_code} {resp.text}")
        node.credential = resp.json()["node_credential"]

    await asyncio.gather(*(one(i, n) for i, n in enumerate(nodes)))
    return nodes


async def beat(http: httpx.AsyncClient, node: SimNode, samples: Samples | None) -> None:
    t0 = time.perf_counter()
    try:
        resp = await http.post(f"/nodes/{node.node_id}/heartbeat", content=node.next_body(),
                               headers={"Authorization": f"Bearer {node.credential}",
                                        "Content-Type": "application/json"})
    except httpx.HTTPError:
        if samples is not None:
            samples.errors += 1
        return
    if samples is not None:
        samples.add(resp.status_code, time.perf_counter() - t0)
    elif resp.status_code != 200:
        raise RuntimeError(f"warm-up heartbeat of {node.node_id}: {resp.status_code} "
                           f"{resp.text}")


def client(base_url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections,
                          max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT_S)


async def flat_out(lanes: list[httpx.AsyncClient], nodes: list[SimNode], *,
                   seconds: float, samples: Samples) -> None:
    """One heartbeat in flight per lane at all times, the nodes taken in turn."""
    turn = itertools.cycle(nodes)
    deadline = time.monotonic() + seconds

    async def lane(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await beat(http, next(turn), samples)

    await asyncio.gather(*(lane(http) for http in lanes))


async def paced(lanes: list[httpx.AsyncClient], nodes: list[SimNode], *, interval: float,
                seconds: float, samples: Samples) -> None:
    """Each node every ``interval`` seconds over its own connection, at a random phase, as
    the agent's loop sends them (it waits the interval after each answer)."""
    deadline = time.monotonic() + seconds

    async def agent(http: httpx.AsyncClient, node: SimNode) -> None:
        await asyncio.sleep(random.uniform(0, interval))
        while time.monotonic() < deadline:
            await beat(http, node, samples)
            await asyncio.sleep(interval)

    await asyncio.gather(*(agent(http, n) for http, n in zip(lanes, nodes, strict=True)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mk-hb-") as tmp:
        stack = Stack(Path(tmp), args.api_source, args.profile)
        try:
            await stack.start()
            assert stack.api is not None
            # One client, so one connection, per lane: an agent holds its own (and one
            # pool shared by hundreds of requests in flight costs the client more than
            # the API, on the same two cores).
            async with contextlib.AsyncExitStack() as clients:
                shared = await clients.enter_async_context(
                    client(stack.api_url, REGISTER_CONCURRENCY))
                t0 = time.monotonic()
                nodes = await register_all(shared, args.nodes)
                registered_s = time.monotonic() - t0
                lanes = [await clients.enter_async_context(client(stack.api_url, 1))
                         for _ in range(args.nodes if args.pace else args.concurrency)]

                async def warm(index: int, http: httpx.AsyncClient) -> None:
                    for node in nodes[index::len(lanes)]:
                        await beat(http, node, None)

                await asyncio.gather(*(warm(i, http) for i, http in enumerate(lanes)))
                pid = stack.api.pid
                idle0 = cpu_seconds(pid)
                await asyncio.sleep(IDLE_WINDOW_S)
                idle_s = cpu_seconds(pid) - idle0
                samples = Samples()
                cpu0, wall0, own0 = cpu_seconds(pid), time.monotonic(), time.process_time()
                if args.pace:
                    await paced(lanes, nodes, interval=args.pace, seconds=args.seconds,
                                samples=samples)
                else:
                    await flat_out(lanes, nodes, seconds=args.seconds, samples=samples)
                cpu_s, wall_s = cpu_seconds(pid) - cpu0, time.monotonic() - wall0
                own_s = time.process_time() - own0
                if args.profile is not None:
                    os.kill(pid, signal.SIGUSR2)  # the component writes its profile
                    await asyncio.sleep(PROFILE_DUMP_S)
        finally:
            stack.stop()
    ok = len(samples.round_trips)
    return {
        "nodes": args.nodes, "mode": f"paced {args.pace:g}s" if args.pace
        else f"concurrency {args.concurrency}",
        "api_module": stack.api_module,
        "registered_s": round(registered_s, 2),
        "window_s": round(wall_s, 2), "heartbeats_ok": ok,
        "heartbeats_per_s": round(ok / wall_s, 1),
        "statuses": {str(k): v for k, v in sorted(samples.statuses.items())},
        "transport_errors": samples.errors,
        "api_cpu_s": round(cpu_s, 3), "api_cores": round(cpu_s / wall_s, 3),
        "client_cores": round(own_s / wall_s, 3),
        "api_idle_cpu_ms_per_s": round(idle_s * 1000 / IDLE_WINDOW_S, 1),
        "api_cpu_ms_per_heartbeat": round(cpu_s * 1000 / ok, 3) if ok else None,
        "round_trip_ms": {"p50": round(percentile(samples.round_trips, 0.50) * 1000, 2)
                          if ok else math.nan,
                          "p99": round(percentile(samples.round_trips, 0.99) * 1000, 2)
                          if ok else math.nan,
                          "mean": round(statistics.fmean(samples.round_trips) * 1000, 2)
                          if ok else None},
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.heartbeat_alone",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="length of the measured window")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="heartbeats in flight at once (ignored with --pace)")
    parser.add_argument("--pace", type=float, default=None,
                        help="each node every PACE seconds instead (the agent's is 2)")
    parser.add_argument("--api-source", type=Path, default=None,
                        help="run the API from this checkout (e.g. a git worktree)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="cProfile the API's window into this file (its CPU figures "
                             "then include the profiler's own)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    if args.api_source is not None:
        args.api_source = args.api_source.resolve()
    if args.profile is not None:
        args.profile = args.profile.resolve()
    result = asyncio.run(run(args))
    rt = result["round_trip_ms"]
    print(f"heartbeat_alone: {result['nodes']} nodes, {result['mode']}, "
          f"{result['window_s']} s, API code {result['api_module']}")
    print(f"  heartbeats answered 200: {result['heartbeats_ok']} "
          f"({result['heartbeats_per_s']}/s); statuses {result['statuses']}, "
          f"transport errors {result['transport_errors']}")
    print(f"  API CPU: {result['api_cpu_s']} s ({result['api_cores']} cores; idle "
          f"{result['api_idle_cpu_ms_per_s']} ms/s; this client {result['client_cores']} "
          "cores) = "
          f"{result['api_cpu_ms_per_heartbeat']} ms per heartbeat")
    print(f"  round trip: p50 {rt['p50']} ms, p99 {rt['p99']} ms, mean {rt['mean']} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
