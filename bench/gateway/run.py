"""The gateway's overhead, measured against calling the same engine directly.

Run it from the repository root::

    .venv/bin/python -m bench.gateway.run --out bench/results/gateway.md

In one run it starts an embedded PostgreSQL, one zero-latency sim engine, the real
gateway (``modelkeeper gateway``, one worker and then several), and the bare Starlette +
httpx passthrough the issue quotes as the reference, and measures each of them with the
same lean load generator (:mod:`bench.gateway.loadgen`):

* latency: one connection, requests back to back: p50 and p99, and what each adds to
  calling the engine directly;
* throughput: many connections: requests per second, and the server's CPU per request;
* streaming: 64-token streams, one at a time: what the proxy adds per chunk.

``--traces`` measures instead the cost of tracing: the gateway (one worker) with tracing
off, on as it comes (``MODELKEEPER_OTLP_ENDPOINT`` pointing at a stand-in collector,
:mod:`bench.gateway.otlp_sink`; one request in a hundred traced), and on tracing every
request, in turn, ``--rounds`` times each, and writes its own table
(bench/results/traces.md).

``--stacks`` also measures raw-ASGI passthroughs on different servers and clients (how
the gateway's stack was chosen; the granian row only where ``granian`` is installed, e.g.
``pip install granian==2.8.9``, which the project does not depend on); ``--litellm PYTHON``
adds LiteLLM's proxy, run with the interpreter of a virtual environment where
``litellm[proxy]`` is installed (it took 83 s to install here).

The whole machine is shared: the load generator, the engine and the proxy all run on
the same (2) cores, as they would on a small node. Numbers are for comparison within
one run, not absolute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import psutil
import uvloop

from agent.engines.sim_server import API_KEY_ENV
from bench.common import ROOT
from bench.stats import percentile
from cli.postgres import dsn, start_postgres
from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.store.routing import RoutingStore

from . import loadgen, trace_cost

HOST = "127.0.0.1"
MODEL = "bench-model"
REPLICA = "bench-r1"
#: The node the bench's replica runs on, as far as the store is concerned.
NODE = "bench-node"
SECRET = "bench-secret"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8}
STREAM = {**CHAT, "max_tokens": 64, "stream": True}


@dataclass
class Target:
    """A server to measure: where it listens, what to send it, which processes it is."""

    name: str
    port: int
    headers: dict[str, str]
    processes: list[ManagedProcess]
    note: str = ""
    results: dict[str, float] = field(default_factory=dict)

    def cpu_seconds(self) -> float:
        """CPU time used so far by the target's processes and their children."""
        total = 0.0
        for managed in self.processes:
            try:
                proc = psutil.Process(managed.pid)
                procs = [proc, *proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    times = p.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                total += times.user + times.system
        return total


def start(name: str, argv: list[str], env: dict[str, str], logs: Path) -> ManagedProcess:
    """Start a server process in its own group, logging to ``logs``."""
    process = ManagedProcess(name, argv, logs / f"{name}.log", env={**os.environ, **env},
                             cwd=ROOT)
    process.start()
    return process


def wait_serving(process: ManagedProcess, port: int, path: str, body: dict[str, object],
                 headers: dict[str, str], timeout: float = 60.0) -> None:
    """Wait until a real request through ``port`` succeeds."""
    def ok() -> bool:
        try:
            resp = httpx.post(f"http://{HOST}:{port}{path}", json=body, headers=headers,
                              timeout=2)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
    process.wait_until(ok, timeout, interval=0.2)


async def measure(target: Target, duration: float, concurrencies: Sequence[int]) -> None:
    """Latency, throughput and streaming for one target."""
    chat = loadgen.build_request(HOST, target.port, "/v1/chat/completions",
                                 json.dumps(CHAT).encode(), target.headers)
    stream = loadgen.build_request(HOST, target.port, "/v1/chat/completions",
                                   json.dumps(STREAM).encode(), target.headers)

    latency = await loadgen.run(HOST, target.port, chat, concurrency=1, duration_s=duration)
    _check(target, latency)
    totals = [s.total_s for s in latency.samples]
    target.results.update(p50_ms=percentile(totals, 0.5) * 1e3,
                          p99_ms=percentile(totals, 0.99) * 1e3,
                          rate_c1=latency.rate)

    best = 0.0
    for concurrency in concurrencies:
        before = target.cpu_seconds()
        result = await loadgen.run(HOST, target.port, chat, concurrency=concurrency,
                                   duration_s=duration)
        cpu = target.cpu_seconds() - before
        _check(target, result)
        target.results[f"rate_c{concurrency}"] = result.rate
        if result.rate > best:
            best = result.rate
            target.results["rate_max"] = result.rate
            target.results["rate_max_c"] = concurrency
            target.results["cpu_us_per_req"] = cpu / len(result.samples) * 1e6

    before = target.cpu_seconds()
    streamed = await loadgen.run(HOST, target.port, stream, concurrency=1,
                                 duration_s=duration)
    cpu = target.cpu_seconds() - before
    _check(target, streamed)
    events = statistics.median(s.events for s in streamed.samples)
    target.results.update(
        stream_p50_ms=percentile([s.total_s for s in streamed.samples], 0.5) * 1e3,
        stream_ttfb_ms=percentile([s.first_byte_s for s in streamed.samples], 0.5) * 1e3,
        stream_events=events,
        # The proxy's CPU per relayed event: what each chunk costs it, however the
        # chunks happen to be coalesced on the way.
        cpu_us_per_chunk=cpu / max(1, sum(s.events for s in streamed.samples)) * 1e6)


def _check(target: Target, result: loadgen.Result) -> None:
    bad = [s.status for s in result.samples if s.status != 200]
    if bad or result.errors or not result.samples:
        raise RuntimeError(f"{target.name}: {len(bad)} non-200 answers ({set(bad)}), "
                           f"{result.errors} connection errors, {len(result.samples)} samples")


async def setup_store(url: str, *, admin_url: str) -> str:
    """Schema, one deployment with one ready replica, and a client key; returns the key.
    ``admin_url`` reaches the server's ``postgres`` database, to create ``url``'s."""
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute("CREATE DATABASE bench")
    finally:
        await admin.close()
    routes = await RoutingStore.connect(url)
    try:
        _, key = await routes.create_api_key("bench")
    finally:
        await routes.close()
    return key


async def add_route(url: str, engine_url: str) -> None:
    # Rows as the control plane would write them (benchmark fixture, like the tests').
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("INSERT INTO models (model_id, engine, source, memory_bytes) "
                           "VALUES ($1, 'sim', 'sim', 1)", MODEL)
        await conn.execute("INSERT INTO deployments (deployment_id, model_id, replicas, "
                           "status, workflow_id) VALUES ('bench-d', $1, 1, 'serving', "
                           "'deployment/bench-d')", MODEL)
        # endpoint_node_id: the node the store checked the endpoint against; the gateway
        # derives the engine key from that node's key.
        await conn.execute("INSERT INTO replicas (replica_id, deployment_id, state, endpoint, "
                           "endpoint_node_id) VALUES ($1, 'bench-d', 'ready', $2, $3)",
                           REPLICA, engine_url, NODE)
    finally:
        await conn.close()


def gateway_target(name: str, workers: int, db_url: str, key: str, logs: Path, *,
                   otlp_endpoint: str = "", trace_ratio: float | None = None) -> Target:
    port = free_port()
    env = {"MODELKEEPER_DATABASE_URL": db_url, "MODELKEEPER_ENGINE_KEY_SECRET": SECRET,
           "MODELKEEPER_GATEWAY_PORT": str(port), "MODELKEEPER_BIND_HOST": HOST,
           "MODELKEEPER_GATEWAY_WORKERS": str(workers), "MODELKEEPER_LOG_LEVEL": "WARNING",
           "MODELKEEPER_OTLP_ENDPOINT": otlp_endpoint}
    if trace_ratio is not None:
        env["MODELKEEPER_GATEWAY_TRACE_RATIO"] = str(trace_ratio)
    proc = start(name.replace(" ", "-"), [sys.executable, "-m", "modelkeeper", "gateway"],
                 env, logs)
    headers = {"Authorization": f"Bearer {key}"}
    wait_serving(proc, port, "/v1/chat/completions", CHAT, headers)
    return Target(name, port, headers, [proc])


def uvicorn_target(name: str, app: str, engine_url: str, engine_key: str, logs: Path,
                   note: str = "", server: str = "uvicorn") -> Target:
    port = free_port()
    env = {"PASSTHROUGH_UPSTREAM": engine_url, "PASSTHROUGH_KEY": engine_key}
    if server == "granian":
        argv = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", HOST,
                "--port", str(port), "--loop", "uvloop", "--log-level", "warning", app]
    else:
        argv = [sys.executable, "-m", "uvicorn", app, "--host", HOST, "--port", str(port),
                "--no-access-log", "--log-level", "warning", "--loop", "uvloop",
                "--http", "httptools"]
    proc = start(name.replace(" ", "-").replace("+", ""), argv, env, logs)
    wait_serving(proc, port, "/v1/chat/completions", CHAT, {})
    return Target(name, port, {}, [proc], note)


def litellm_target(python: str, engine_url: str, engine_key: str, logs: Path) -> Target:
    port = free_port()
    config = logs / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {engine_url}/v1\n"
        f"      api_key: {engine_key}\n")
    litellm = str(Path(python).parent / "litellm")
    env = {"LITELLM_MASTER_KEY": "sk-bench", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LITELLM_LOG": "ERROR"}
    proc = start("litellm", [litellm, "--config", str(config), "--host", HOST,
                             "--port", str(port), "--num_workers", "1"], env, logs)
    headers = {"Authorization": "Bearer sk-bench"}
    wait_serving(proc, port, "/v1/chat/completions", CHAT, headers, timeout=180)
    version = subprocess.run([python, "-c", "import importlib.metadata as m;"
                              "print(m.version('litellm'))"], capture_output=True, text=True,
                             check=False).stdout.strip()
    return Target(f"LiteLLM {version} proxy", port, headers, [proc],
                  "`pip install 'litellm[proxy]'` in a venv of its own; one worker, "
                  "LITELLM_MASTER_KEY set, LITELLM_LOCAL_MODEL_COST_MAP=True")


def render(targets: list[Target], direct: Target, command: str, duration: float) -> str:
    """The results as markdown."""
    d = direct.results
    lines = [
        "# Gateway overhead",
        "",
        f"Made with `{command}` on {time.strftime('%Y-%m-%d')}: {psutil.cpu_count()} cores, "
        f"Python {platform.python_version()}, {duration:.0f} s per measurement. The load "
        "generator, the zero-latency sim engine and the proxy share the machine's cores.",
        "",
        "| | p50 | p99 | added p50 | added p99 | req/s (1 conn) | max req/s (conns) "
        "| server CPU per request | 64-token stream p50 | stream: first byte "
        "| stream: added per chunk | stream: server CPU per chunk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        r = t.results
        if t is direct:
            added = "-", "-", "-"
        else:
            per_chunk = (r["stream_p50_ms"] - d["stream_p50_ms"]) / d["stream_events"]
            added = (f"{r['p50_ms'] - d['p50_ms']:+.3f} ms", f"{r['p99_ms'] - d['p99_ms']:+.3f} ms",
                     f"{per_chunk * 1e3:+.0f} µs")
        lines.append(
            f"| {t.name} | {r['p50_ms']:.3f} ms | {r['p99_ms']:.3f} ms | {added[0]} | "
            f"{added[1]} | {r['rate_c1']:,.0f} | {r['rate_max']:,.0f} ({r['rate_max_c']:.0f}) | "
            f"{r['cpu_us_per_req']:,.0f} µs | {r['stream_p50_ms']:.2f} ms "
            f"({r['stream_events']:.0f} events) | {r['stream_ttfb_ms']:.2f} ms | {added[2]} | "
            f"{r['cpu_us_per_chunk']:.1f} µs |")
    notes = [
        f"- {direct.name}: `python -m agent.engines.sim_server`, zero latency; the client "
        "sends its engine key itself.",
        "- modelkeeper gateway: `modelkeeper gateway` with client auth on (a key from the "
        "store), routing from PostgreSQL, metrics and usage as in production.",
        "- added per chunk: (stream p50 through the proxy - direct) / events. A proxy that "
        "relays while the engine still writes hides its cost here; the CPU column shows it.",
        *(f"- {t.name}: {t.note}" for t in targets if t.note),
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> str:
    command = "python -m bench.gateway.run " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="mk-bench-") as tmp:
        logs = Path(tmp)
        pg_port = free_port()
        pg = start_postgres(logs / "pg", HOST, pg_port, logs / "postgres.log")
        started: list[ManagedProcess] = [pg]
        try:
            db_url = dsn(HOST, pg_port, "bench", data_dir=logs)
            # Its own DSN, not db_url cut at its last "/": the DSN ends in the password
            # file's path, which has slashes of its own.
            key = await setup_store(db_url,
                                    admin_url=dsn(HOST, pg_port, "postgres", data_dir=logs))
            engine_key = replica_engine_key(SECRET.encode(), node_id=NODE, replica_id=REPLICA)
            sim_port = free_port()
            sim = start("sim", [sys.executable, "-m", "agent.engines.sim_server", "--host", HOST,
                                "--port", str(sim_port), "--model", MODEL,
                                "--log-level", "WARNING"],
                        # A data dir of its own tells test clean-ups (which kill leftover
                        # engines by environment) that this engine is not theirs.
                        {API_KEY_ENV: engine_key, "MODELKEEPER_DATA_DIR": str(logs)}, logs)
            started.append(sim)
            engine_url = f"http://{HOST}:{sim_port}"
            direct_headers = {"Authorization": f"Bearer {engine_key}"}
            wait_serving(sim, sim_port, "/v1/chat/completions", CHAT, direct_headers)
            await add_route(db_url, engine_url)

            direct = Target("direct to the sim engine", sim_port, direct_headers, [sim])
            if args.traces:
                return await _traces(args, direct, db_url, key, logs, started, command)
            builders: list[Callable[[], Target]] = [
                lambda: gateway_target("modelkeeper gateway (1 worker)", 1, db_url, key, logs),
                lambda: uvicorn_target(
                    "bare Starlette + httpx passthrough", "bench.gateway.passthroughs:"
                    "starlette_httpx", engine_url, engine_key, logs,
                    note="the issue's reference: no auth, routing or metrics; uvicorn with "
                    "httptools and uvloop"),
                lambda: gateway_target(f"modelkeeper gateway ({args.workers} workers)",
                                       args.workers, db_url, key, logs),
            ]
            if args.stacks:
                builders += [
                    lambda: uvicorn_target(
                        "raw ASGI + aiohttp on uvicorn", "bench.gateway.passthroughs:"
                        "asgi_aiohttp", engine_url, engine_key, logs,
                        note="the gateway's stack with nothing on top: its floor"),
                    lambda: uvicorn_target(
                        "raw ASGI + httpx on uvicorn", "bench.gateway.passthroughs:"
                        "asgi_httpx", engine_url, engine_key, logs,
                        note="same server, httpx without pool limits as the client"),
                ]
                if _installed("granian"):
                    builders.append(lambda: uvicorn_target(
                        "raw ASGI + aiohttp on granian", "bench.gateway.passthroughs:"
                        "asgi_aiohttp", engine_url, engine_key, logs, server="granian",
                        note="granian (Rust HTTP server) instead of uvicorn"))
            if args.litellm:
                builders.append(lambda: litellm_target(args.litellm, engine_url, engine_key,
                                                       logs))

            targets = [direct]
            await measure(direct, args.duration, args.concurrency)
            print(f"{direct.name}: {direct.results}", flush=True)
            for build in builders:
                target = build()
                started += target.processes
                try:
                    await measure(target, args.duration, args.concurrency)
                finally:
                    for proc in target.processes:
                        proc.stop()
                print(f"{target.name}: {target.results}", flush=True)
                targets.append(target)
            return render(targets, direct, command, args.duration)
        finally:
            for proc in reversed(started):
                proc.stop()


TRACING_OFF = "off"
TRACING_ON = "on (default: 1 in 100)"
TRACING_ALL = "on, every request"


def _sink_count(url: str) -> int:
    count: int = httpx.get(url + "/count", timeout=60).json()["spans"]
    return count


async def _traces(args: argparse.Namespace, direct: Target, db_url: str, key: str,
                  logs: Path, started: list[ManagedProcess], command: str) -> str:
    """The gateway with tracing off and on, alternately, ``args.rounds`` times each."""
    sink_port = free_port()
    sink = start("otlp-sink", [sys.executable, "-m", "bench.gateway.otlp_sink", "--host",
                               HOST, "--port", str(sink_port)], {}, logs)
    started.append(sink)
    sink_url = f"http://{HOST}:{sink_port}"
    def ready() -> bool:
        try:
            return _sink_count(sink_url) == 0
        except httpx.HTTPError:
            return False

    sink.wait_until(ready, 30, interval=0.2)
    await measure(direct, args.duration, args.concurrency)
    print(f"{direct.name}: {direct.results}", flush=True)
    rows: list[tuple[int, Target, int]] = []
    variants: list[tuple[str, str, float | None]] = [
        (TRACING_OFF, "", None), (TRACING_ON, sink_url, None), (TRACING_ALL, sink_url, 1.0)]
    for round_ in range(1, args.rounds + 1):
        for variant, endpoint, ratio in variants:
            name = f"gateway, tracing {variant}"
            before = _sink_count(sink_url)
            target = gateway_target(name, 1, db_url, key, logs, otlp_endpoint=endpoint,
                                    trace_ratio=ratio)
            try:
                await measure(target, args.duration, args.concurrency)
            finally:
                for proc in target.processes:
                    proc.stop()  # SIGTERM: the gateway exports what it still holds
            spans = _sink_count(sink_url) - before
            print(f"round {round_} {name}: {target.results} ({spans} spans)", flush=True)
            rows.append((round_, target, spans))
    # Then tracing's own CPU per request, in this process, away from the HTTP noise.
    costs = await trace_cost.measure(sink_url)
    gateway_cpu_us = statistics.fmean(t.results["cpu_us_per_req"] for _, t, _ in rows
                                      if t.name.endswith(TRACING_OFF))
    return (render_traces(rows, direct, command, args.duration) + "\n"
            + trace_cost.render(costs, gateway_cpu_us=gateway_cpu_us))


def render_traces(rows: list[tuple[int, Target, int]], direct: Target, command: str,
                  duration: float) -> str:
    """The traces benchmark as markdown: each run, then on against off."""
    lines = [
        "# Traces: what tracing costs the gateway",
        "",
        f"Made with `{command}` on {time.strftime('%Y-%m-%d')}: {psutil.cpu_count()} cores, "
        f"Python {platform.python_version()}, {duration:.0f} s per measurement, the gateway "
        "(one worker) with tracing off, on as it comes (gateway_trace_ratio 0.01: one request "
        "in a hundred without a traceparent is traced), and on for every request "
        "(gateway_trace_ratio 1), in turn, against a zero-latency sim engine "
        f"({direct.results['rate_max']:,.0f} req/s direct). A traced request makes five "
        "spans when streamed, four when whole, exported to a stand-in OTLP/HTTP collector "
        "on the same machine (bench/gateway/otlp_sink.py, which parses nothing until the "
        "end). The load generator, the engine, the collector and the gateway share the "
        "cores.",
        "",
        "| round | tracing | max req/s (conns) | gateway CPU per request | p50 | added p50 "
        "| stream first byte | spans exported |",
        "|---|---|---|---|---|---|---|---|",
    ]
    d = direct.results
    for round_, t, spans in rows:
        r = t.results
        lines.append(
            f"| {round_} | {t.name.split('tracing ', 1)[1]} | {r['rate_max']:,.0f} "
            f"({r['rate_max_c']:.0f}) | {r['cpu_us_per_req']:,.0f} µs | {r['p50_ms']:.3f} ms | "
            f"{r['p50_ms'] - d['p50_ms']:+.3f} ms | {r['stream_ttfb_ms']:.2f} ms | {spans:,} |")
    def of(variant: str) -> list[dict[str, float]]:
        return [t.results for _, t, _ in rows if t.name.endswith(variant)]

    def mean(results: list[dict[str, float]], key: str) -> float:
        return statistics.fmean(r[key] for r in results)

    off = of(TRACING_OFF)
    lines.append("")
    for variant in (TRACING_ON, TRACING_ALL):
        on = of(variant)
        rate = mean(on, "rate_max") / mean(off, "rate_max") - 1
        cpu = mean(on, "cpu_us_per_req") / mean(off, "cpu_us_per_req") - 1
        lines.append(
            f"- {variant} against off, means of the rounds: throughput {rate:+.1%}, gateway "
            f"CPU per request {cpu:+.1%}, p50 "
            f"{mean(on, 'p50_ms') - mean(off, 'p50_ms'):+.3f} ms.")
    return "\n".join(lines) + "\n"


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway.run",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds per measurement (default 5)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64],
                        help="connections for the throughput runs (default 16 64)")
    parser.add_argument("--workers", type=int, default=2,
                        help="workers of the multi-worker gateway run (default 2)")
    parser.add_argument("--stacks", action="store_true",
                        help="also measure raw passthroughs on other server/client stacks")
    parser.add_argument("--litellm", metavar="PYTHON",
                        help="the python of a venv with litellm[proxy], to measure it too")
    parser.add_argument("--traces", action="store_true",
                        help="measure the gateway with tracing off and on instead")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of off and on with --traces (default 2)")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    markdown = uvloop.run(run(args))
    print(markdown)
    if args.out:
        args.out.write_text(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
