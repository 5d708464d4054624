"""The benchmarks' fleet of simulated nodes (bench/fleet/nodes.py) without a control plane:
sim engines served in-process through the shard manager, each node's share of ports and
its name, what a dead node's activities do, and the command's refusals. The whole fleet
against a real stack is tests/integration/test_fleet_agent.py."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.engines.base import EngineConfigError
from agent.engines.sim import SimAdapter
from agent.engines.sim_inprocess import InProcessSims
from agent.engines.sim_server import CRASH_EXIT_CODE
from agent.main import AgentConfigError
from agent.shards import ShardManager
from bench.fleet.command import parse
from bench.fleet.nodes import Mortal, SimulatedFleet, node_names, port_ranges, run_fleet
from cli.main import load_settings
from modelkeeper.domain.engine_keys import derive_engine_key, derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ExitKind, FetchProgress, ShardSpec
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings

pytestmark = pytest.mark.timeout(30)

NODE_KEY = derive_node_key(b"fleet-test-secret", "n-fleet")


def _spec(replica: str, **engine_args: Any) -> ShardSpec:
    return ShardSpec(replica_id=ReplicaId(replica), model_id=ModelId("sim-model"),
                     node_id=NodeId("n-fleet"), engine=EngineKind.SIM, source="sim",
                     memory_bytes=1 << 30, engine_args=engine_args, start_timeout_s=20.0)


def _progress(_: FetchProgress) -> None:
    pass


def _manager(tmp_path: Path, sims: InProcessSims) -> ShardManager:
    low = free_port()
    return ShardManager(node_id=NodeId("n-fleet"), agent_dir=tmp_path / "node",
                        engine_host="127.0.0.1", port_range=(low, low + 10),
                        node_key=NODE_KEY, launcher=sims,
                        available_memory=lambda: 1 << 30)


async def _chat(url: str, key: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return await http.post(f"{url}/v1/chat/completions",
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": "sim-model", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]})


async def test_an_in_process_sim_starts_serves_with_its_key_and_stops(tmp_path: Path) -> None:
    sims = InProcessSims()
    manager = _manager(tmp_path, sims)
    try:
        endpoint = await manager.start(_spec("r-1", memory_bytes=4096), _progress)
        assert endpoint.url is not None
        key = derive_engine_key(NODE_KEY.encode(), "r-1")
        assert (await _chat(endpoint.url, key)).status_code == 200
        assert (await _chat(endpoint.url, "not-the-key")).status_code == 401
        # What it says it holds is what its node reports as taken; nothing is allocated.
        assert sims.held_bytes() == 4096
        ended = await manager.stop(ReplicaId("r-1"), grace_s=5.0)
        assert ended.kind is ExitKind.STOPPED and ended.exit_code == 0
        assert sims.held_bytes() == 0
        with pytest.raises(httpx.ConnectError):
            await _chat(endpoint.url, key)
    finally:
        await manager.close()


async def test_a_killed_sim_reads_as_sigkill_and_a_crash_keeps_the_process(
        tmp_path: Path) -> None:
    sims = InProcessSims()
    manager = _manager(tmp_path, sims)
    try:
        await manager.start(_spec("r-kill"), _progress)
        await manager.start(_spec("r-crash", crash_after_s=0.3), _progress)
        assert sims.kill_all() == 2
        killed = await manager.watch(ReplicaId("r-kill"), lambda: None)
        assert killed.signal == signal.SIGKILL
        await manager.start(_spec("r-crash-2", crash_after_s=0.3), _progress)
        crashed = await manager.watch(ReplicaId("r-crash-2"), lambda: None)
        # The crash ends the engine with its code; this process (the test) goes on.
        assert crashed.exit_code == CRASH_EXIT_CODE
    finally:
        await manager.close()


def test_only_the_sim_engine_is_served_in_process(tmp_path: Path) -> None:
    sims = InProcessSims()
    with pytest.raises(EngineConfigError, match="only the sim engine"):
        sims("engine r", ["/usr/bin/llama-server", "--port", "1"], tmp_path / "log", {})
    # The sim's own plan is accepted as it would be launched as a child.
    plan = SimAdapter().launch_plan(_spec("r-plan"), host="127.0.0.1", port=1, api_key="k")
    engine = sims("engine r-plan", list(plan.argv), tmp_path / "log", dict(plan.env))
    assert engine.config.port == 1 and engine.poll() is None


def test_each_node_gets_its_own_ports_and_a_sortable_name() -> None:
    assert port_ranges(20000, 20011, 3) == [(20000, 20003), (20004, 20007), (20008, 20011)]
    with pytest.raises(AgentConfigError, match="at least 2000 ports"):
        port_ranges(20000, 20999, 1000)
    assert node_names("sim", 3) == ["sim-0001", "sim-0002", "sim-0003"]
    assert node_names("sim", 12000)[-1] == "sim-12000"


async def test_a_fleet_holds_nodes_with_their_own_identity(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, node_memory="2GiB", node_name="box",
                        engine_port_range="21000-21011")
    fleet = SimulatedFleet(settings, 3)
    again = SimulatedFleet(settings, 3)
    await fleet.close()
    await again.close()
    ids = [n.node.node_id for n in fleet.nodes]
    assert len(set(ids)) == 3
    # Ids are kept in each node's folder: a restarted fleet is the same nodes.
    assert [n.node.node_id for n in again.nodes] == ids
    first = fleet.nodes[0].node
    assert first.name == "box-0001"
    assert (first.engine_ports.low, first.engine_ports.high) == (21000, 21003)
    inventory = first.inventory()
    assert inventory.memory_total_bytes == 2 << 30 and inventory.gpus == []


async def test_a_fleet_needs_declared_memory_and_says_so(tmp_path: Path) -> None:
    size, args = parse(["--fleet", "3", "--data-dir", str(tmp_path)])
    assert size == 3
    # The command turns this error into one line and exit code 2, as for every agent error.
    with pytest.raises(AgentConfigError, match="--memory"):
        await run_fleet(load_settings(args), asyncio.Event(), size=size)


class _Runner:
    """A shard manager whose watch returns when told, heartbeating meanwhile."""

    def __init__(self) -> None:
        self.beats = 0
        self.done = asyncio.Event()

    async def watch(self, replica_id: ReplicaId, heartbeat: Any) -> str:
        while not self.done.is_set():
            heartbeat()
            self.beats += 1
            await asyncio.sleep(0.01)
        return "exited"


async def test_a_dead_node_answers_nothing_until_the_fleet_stops() -> None:
    runner = _Runner()
    mortal = Mortal(runner)  # type: ignore[arg-type]
    watch = asyncio.create_task(mortal.watch(ReplicaId("r"), lambda: None))
    try:
        await asyncio.sleep(0.05)
        assert runner.beats > 0  # alive, it heartbeats
        mortal.die()
        await asyncio.sleep(0.02)  # the death lands (one last beat may be under way)
        beats = runner.beats
        await asyncio.sleep(0.05)  # a live runner beats every 10 ms: five more by now
        assert runner.beats == beats  # its heartbeats died with it
        runner.done.set()  # the engine "exits": a live node would answer now
        await asyncio.sleep(0.05)
        assert not watch.done()  # no answer
        watch.cancel()  # the worker's shutdown cancels it: still no answer
        await asyncio.sleep(0.05)
        assert not watch.done()
    finally:
        # Also on a failed assert: a watch left in limbo would hang the loop's teardown.
        mortal.release()
        runner.done.set()
    with pytest.raises(asyncio.CancelledError):
        await watch


async def test_a_live_node_answers_through_its_mortal_runner() -> None:
    runner = _Runner()
    mortal = Mortal(runner)  # type: ignore[arg-type]
    watch = asyncio.create_task(mortal.watch(ReplicaId("r"), lambda: None))
    await asyncio.sleep(0.03)
    runner.done.set()
    assert await asyncio.wait_for(watch, 2.0) == "exited"
