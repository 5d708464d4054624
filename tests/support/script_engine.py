"""A fake engine: a Python one-liner started through the agent's own start path
(:class:`agent.shards.ShardManager`, its environment, its log filter), for tests of what
reaches an engine's log.

Run as a module, it is also an agent that starts one such engine and then waits to be
killed: ``python -m tests.support.script_engine AGENT_DIR NODE_ID LOW_PORT SCRIPT``. It
prints ``started PID`` once the engine runs.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from agent.engines.base import LaunchPlan, ReadyCheck
from agent.shards import ShardManager
from modelkeeper.domain.engine_keys import derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, FetchProgress, ShardSpec

#: Where the fake engine finds its key: SGLang's entry script reads the same variable.
API_KEY_ENV = "MODELKEEPER_ENGINE_API_KEY"
#: The cluster secret of these tests (node keys are derived from it).
SECRET = b"script-engine-test-secret"


class ScriptAdapter:
    """An :class:`agent.engines.base.EngineAdapter` whose engine is ``python -c SCRIPT
    ARGS...``, given its key in :data:`API_KEY_ENV` as SGLang is. It serves no HTTP, so a
    start returns once it runs."""

    kind: EngineKind = EngineKind.SIM

    def __init__(self, script: str, *args: str) -> None:
        self.script = script
        self.args = list(args)

    def launch_plan(self, spec: ShardSpec, *, host: str, port: int, api_key: str) -> LaunchPlan:
        return LaunchPlan(argv=[sys.executable, "-c", self.script, *self.args],
                          env={API_KEY_ENV: api_key}, serves_http=False)

    async def check_ready(self, client: httpx.AsyncClient, base_url: str, api_key: str,
                          model_name: str) -> ReadyCheck:
        return ReadyCheck(ready=True, detail="serves no HTTP")


def spec(replica: str, node: str) -> ShardSpec:
    """A shard of the fake engine."""
    return ShardSpec(replica_id=ReplicaId(replica), model_id=ModelId("script-model"),
                     node_id=NodeId(node), engine=EngineKind.SIM, source="script",
                     memory_bytes=0, start_timeout_s=30.0)


def manager(agent_dir: str, node: str, low_port: int, adapter: ScriptAdapter) -> ShardManager:
    """A shard manager that runs ``adapter``'s engine for every spec."""
    return ShardManager(node_id=NodeId(node), agent_dir=Path(agent_dir),
                        engine_host="127.0.0.1", port_range=(low_port, low_port + 20),
                        node_key=derive_node_key(SECRET, node),
                        adapter_factory=lambda _spec: adapter)


def _progress(_: FetchProgress) -> None:
    pass


async def _run_agent(agent_dir: str, node: str, low_port: int, script: str) -> None:
    shards = manager(agent_dir, node, low_port, ScriptAdapter(script))
    endpoint = await shards.start(spec("r-outlives", node), _progress)
    sys.stdout.write(f"started {endpoint.pid}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    asyncio.run(_run_agent(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
