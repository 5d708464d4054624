"""An engine that dies of a known fatal error leaves the cause in the reason of its exit:
a real process started through the agent's shard manager (its log filter and log tail
included), printing the line vLLM's CUDA out of memory prints and exiting 1."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from agent.shards import ShardManager
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.shards import ExitKind, FetchProgress, ShardStartError
from modelkeeper.infra.processes import free_port
from tests.support.script_engine import ScriptAdapter, manager, spec

pytestmark = pytest.mark.timeout(60)

NODE = "n-fatal-log"
OOM_LINE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
            "GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free.")
#: Prints what vLLM prints when the GPU runs out of memory while loading, then exits 1 once
#: the test creates the file named by its argument (after the start has returned, so the
#: exit is seen by the watch, as an engine dying after its start would be).
ENGINE = ("import os, sys, time\n"
          "print('INFO loading weights', flush=True)\n"
          f"print({OOM_LINE!r}, file=sys.stderr, flush=True)\n"
          "print('RuntimeError: Engine core initialization failed.', file=sys.stderr,"
          " flush=True)\n"
          "go = sys.argv[1]\n"
          "while not os.path.exists(go):\n"
          "    time.sleep(0.01)\n"
          "sys.exit(1)\n")


def _quiet(_: FetchProgress) -> None:
    pass


@pytest.fixture
async def go_file(tmp_path: Path) -> AsyncIterator[Path]:
    yield tmp_path / "go"
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("MODELKEEPER_NODE_ID") == NODE:
                os.killpg(proc.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue


async def test_a_cuda_oom_is_named_in_the_exit_reason(tmp_path: Path, go_file: Path) -> None:
    shards: ShardManager = manager(str(tmp_path / "agent"), NODE, free_port(),
                                   ScriptAdapter(ENGINE, str(go_file)))
    try:
        try:
            await shards.start(spec("r-oom", NODE), _quiet)
        except ShardStartError as failed:  # it may end before its start is seen through
            ended = failed.exit
        else:
            go_file.touch()
            ended = await shards.watch(ReplicaId("r-oom"), lambda: None)
    finally:
        go_file.touch()
        await shards.close()
    assert (ended.kind, ended.exit_code) == (ExitKind.ERROR, 1), ended
    log_path = tmp_path / "agent" / "logs" / "r-oom.log"
    assert ended.detail == ("exited with code 1: the GPU ran out of memory (CUDA out of "
                            f"memory) (log: {OOM_LINE!r}); full log: {log_path} on node "
                            f"{NODE}, or `modelkeeper logs r-oom`"), ended.detail
    assert OOM_LINE in ended.log_tail
