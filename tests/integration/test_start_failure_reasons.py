"""A failed start's reason names its cause and where the full log is: a real sim engine
started with an argument it refuses (exit code and its last log line), and a source URL
that answers 404 on a local server (the URL and the answer), through the agent's shard
manager."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from agent.engines.base import LaunchPlan
from agent.engines.sim import SimAdapter
from agent.fetch import FetchRefused
from agent.shards import ShardManager
from modelkeeper.domain.engine_keys import derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import (
    EngineKind,
    ExitKind,
    FetchProgress,
    ShardSpec,
    ShardStartError,
)
from modelkeeper.domain.sources import SourcePolicy
from modelkeeper.infra.processes import free_port

pytestmark = pytest.mark.timeout(60)

NODE = NodeId("n-start-failure")
LOOPBACK = SourcePolicy(schemes=frozenset({"http"}), hosts=("127.0.0.1",))


class BadArgSim(SimAdapter):
    """The sim, started with a --load-time it refuses (argparse: exit 2, and a usage
    error as its last line)."""

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        plan = super().launch_plan(spec, host=host, port=port, api_key=api_key)
        return plan.model_copy(update={"argv": [*plan.argv, "--load-time", "soon"]})


def _quiet(_: FetchProgress) -> None:
    pass


def _spec(replica: str, source: str = "sim") -> ShardSpec:
    return ShardSpec(replica_id=ReplicaId(replica), model_id=ModelId("sim-model"),
                     node_id=NODE, engine=EngineKind.SIM, source=source,
                     memory_bytes=0, start_timeout_s=30.0)


@pytest.fixture
async def shards(tmp_path: Path) -> AsyncIterator[ShardManager]:
    low = free_port()
    manager = ShardManager(node_id=NODE, agent_dir=tmp_path / "agent",
                           engine_host="127.0.0.1", port_range=(low, low + 20),
                           node_key=derive_node_key(b"start-failure-secret", NODE),
                           adapter_factory=lambda _spec: BadArgSim(),
                           source_policy=LOOPBACK)
    try:
        yield manager
    finally:
        await manager.close()
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.environ().get("MODELKEEPER_NODE_ID") == NODE:
                    os.killpg(proc.pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue


@pytest.fixture
def missing_file() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404, "Not Found")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/gone/model.gguf"
    finally:
        httpd.shutdown()


async def test_an_engine_that_refuses_its_arguments_names_code_last_line_and_log(
        shards: ShardManager, tmp_path: Path) -> None:
    with pytest.raises(ShardStartError) as failed:
        await shards.start(_spec("r-bad-args"), _quiet)
    ended = failed.value.exit
    assert (ended.kind, ended.exit_code) == (ExitKind.ERROR, 2), ended
    log_path = tmp_path / "agent" / "logs" / "r-bad-args.log"
    assert ended.detail.startswith("exited with code 2; last log line: "), ended.detail
    assert "argument --load-time: invalid" in ended.detail
    assert ended.detail.endswith(
        f"; full log: {log_path} on node {NODE}, or `modelkeeper logs r-bad-args`")
    # The log is where the reason says, and holds the line it quotes.
    assert "argument --load-time: invalid" in log_path.read_text()
    # The start's progress is gone once it failed: nothing stale reaches the heartbeat.
    assert shards.start_progress() == []


async def test_a_source_that_answers_404_is_named_with_the_answer(
        shards: ShardManager, missing_file: str) -> None:
    with pytest.raises(FetchRefused) as refused:
        await shards.start(_spec("r-missing", missing_file), _quiet)
    assert str(refused.value) == (
        f"source={missing_file!r}: could not be fetched: {missing_file} answered 404 "
        "Not Found")
    assert shards.start_progress() == []
