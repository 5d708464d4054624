"""What an idle node's task queue costs the Temporal dev server, with the server's default
partitions and with one (``DYNAMIC_CONFIG`` in :mod:`cli.temporal_server`).

Each node of a fleet polls a task queue of its own, one poll at a time, as the agent's
worker does (``PollerBehaviorSimpleMaximum(1)``, activities only). This starts the dev
server as ``up`` does (with or without the one-partition values), N such workers in this
process, waits ``--warmup`` seconds for the queues to be made, then measures the CPU of the
server (with its children) and of this process over ``--seconds``. Both variants run one
after the other in one invocation, so they share the machine's conditions::

    .venv/bin/python -m bench.scale.queue_cost --nodes 300
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
from temporalio import activity
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from cli.temporal_server import DYNAMIC_CONFIG, dev_server_argv
from modelkeeper.infra.processes import ManagedProcess, free_port, tcp_accepts


@activity.defn
async def noop() -> None:
    """Never called: the queues stay idle."""


def _cpu_s(proc: psutil.Process) -> float:
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        times = p.cpu_times()
        total += times.user + times.system
    return total


async def measure(nodes: int, *, partitions_one: bool, warmup: float,
                  seconds: float) -> tuple[float, float]:
    """CPU milliseconds per node-second: the server's and the pollers'."""
    folder = Path(tempfile.mkdtemp(prefix="mk-queue-cost-"))
    port = free_port()
    argv = dev_server_argv(host="127.0.0.1", port=port, http_port=free_port(),
                           metrics_port=free_port(), ui=None,
                           db_file=folder / "temporal.db", namespace="default")
    if not partitions_one:
        # The same command without the one-partition values: the server's default.
        for value in DYNAMIC_CONFIG:
            at = argv.index(value)
            del argv[at - 1:at + 1]
    server = ManagedProcess("temporal", argv, folder / "temporal.log")
    server.start()
    try:
        # Nothing else runs yet: waiting in this thread holds up nothing.
        server.wait_until(lambda: tcp_accepts("127.0.0.1", port), timeout=60)
        client = await Client.connect(f"127.0.0.1:{port}")
        workers = [Worker(client, task_queue=f"node-{i}", activities=[noop],
                          activity_task_poller_behavior=PollerBehaviorSimpleMaximum(1))
                   for i in range(nodes)]
        runs = [asyncio.create_task(w.run()) for w in workers]
        await asyncio.sleep(warmup)  # the queues are made: their first minute is not idle
        serving, polling = psutil.Process(server.pid), psutil.Process()
        before, started = (_cpu_s(serving), _cpu_s(polling)), time.monotonic()
        await asyncio.sleep(seconds)
        elapsed = time.monotonic() - started
        after = (_cpu_s(serving), _cpu_s(polling))
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        per = 1000 / elapsed / nodes
        return (after[0] - before[0]) * per, (after[1] - before[1]) * per
    finally:
        server.stop(grace=5)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.queue_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=300, help="idle queues (default 300)")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds before measuring (default 30)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="seconds measured (default 60)")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.seconds <= 0 or args.warmup < 0:
        parser.error(f"--nodes must be at least 1 (got {args.nodes}), --seconds above 0 "
                     f"(got {args.seconds:g}) and --warmup at least 0 (got {args.warmup:g})")
    for one in (False, True):
        server, pollers = asyncio.run(measure(args.nodes, partitions_one=one,
                                              warmup=args.warmup, seconds=args.seconds))
        label = "one partition " if one else "four (default)"
        print(f"{label}: {args.nodes} idle queues: server {server:.3f} ms CPU per "
              f"node-second, pollers {pollers:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
