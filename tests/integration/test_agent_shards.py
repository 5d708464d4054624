"""The agent's shard manager with real engine processes (the sim engine; llama.cpp is
covered in test_agent_end_to_end): start, readiness, keys, watch, stop, classification,
adoption after a restart, strays."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.shards import ShardManager
from modelkeeper.domain.engine_keys import derive_engine_key, derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import (
    EngineKind,
    ExitKind,
    FetchProgress,
    ShardSpec,
    ShardStartError,
    ShardState,
)
from modelkeeper.infra.processes import free_port

pytestmark = pytest.mark.timeout(60)

SECRET = b"test-secret"
#: What the API hands node n-test at registration; the manager derives engine keys from it.
NODE_KEY = derive_node_key(SECRET, "n-test")


def _spec(replica: str, **engine_args: Any) -> ShardSpec:
    timeout = engine_args.pop("start_timeout_s", 30.0)
    return ShardSpec(replica_id=ReplicaId(replica), model_id=ModelId("sim-model"),
                     node_id=NodeId("n-test"), engine=EngineKind.SIM, source="sim",
                     memory_bytes=0, engine_args=engine_args, start_timeout_s=timeout)


def _port_block() -> tuple[int, int]:
    low = free_port()
    return low, low + 20


def _manager(agent_dir: Path, ports: tuple[int, int], node: str = "n-test") -> ShardManager:
    return ShardManager(node_id=NodeId(node), agent_dir=agent_dir, engine_host="127.0.0.1",
                        port_range=ports, node_key=derive_node_key(SECRET, node))


def _progress(_: FetchProgress) -> None:
    pass


def _kill_our_engines(node: str) -> None:
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("MODELKEEPER_NODE_ID") == node:
                os.killpg(proc.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[ShardManager]:
    m = _manager(tmp_path / "agent", _port_block())
    try:
        yield m
    finally:
        await m.close()
        _kill_our_engines("n-test")


async def test_start_serves_with_the_replica_key_only(manager: ShardManager) -> None:
    endpoint = await manager.start(_spec("r1"), _progress)
    assert endpoint.url is not None and endpoint.rank == 0
    key = derive_engine_key(NODE_KEY.encode(), "r1")
    async with httpx.AsyncClient(base_url=endpoint.url) as http:
        ok = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "sim-model",
                                   "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and ok.json()["choices"]
        assert (await http.get("/v1/models")).status_code == 401
        other = derive_engine_key(NODE_KEY.encode(), "r2")
        assert (await http.get("/v1/models",
                               headers={"Authorization": f"Bearer {other}"})).status_code == 401
    # The key reaches the engine through its environment, never its command line.
    cmdline = " ".join(psutil.Process(endpoint.pid).cmdline())
    assert key not in cmdline
    # A second start of the same replica (an activity retry) returns the same engine.
    again = await manager.start(_spec("r1"), _progress)
    assert (again.pid, again.port) == (endpoint.pid, endpoint.port)


async def test_watch_reports_sigkill_as_sigkill_with_log_tail(manager: ShardManager) -> None:
    endpoint = await manager.start(_spec("r1"), _progress)
    beats = 0

    def heartbeat() -> None:
        nonlocal beats
        beats += 1
        if beats == 3:
            os.kill(endpoint.pid, signal.SIGKILL)

    ended = await manager.watch(ReplicaId("r1"), heartbeat)
    assert ended.kind is ExitKind.SIGNALLED, ended
    assert ended.signal == signal.SIGKILL and ended.exit_code is None
    assert "SIGKILL" in ended.detail
    assert ended.log_tail, "the engine's log tail is kept"
    assert manager.reports() == []


async def test_engine_that_exits_on_its_own_is_classified(manager: ShardManager) -> None:
    await manager.start(_spec("r1", crash_after_s=0.5), _progress)
    ended = await manager.watch(ReplicaId("r1"), lambda: None)
    assert (ended.kind, ended.exit_code) == (ExitKind.ERROR, 70), ended


async def test_engine_failing_at_start_fails_the_start(manager: ShardManager) -> None:
    with pytest.raises(ShardStartError) as info:
        await manager.start(_spec("r1", fail_at_start=True), _progress)
    assert info.value.exit.kind is ExitKind.ERROR and info.value.exit.exit_code == 1
    assert any("fail" in line.lower() for line in info.value.exit.log_tail)


async def test_hang_at_start_is_bounded_by_the_start_timeout(manager: ShardManager) -> None:
    with pytest.raises(ShardStartError) as info:
        await manager.start(_spec("r1", hang=True, start_timeout_s=1.5), _progress)
    assert info.value.exit.kind is ExitKind.START_TIMEOUT
    # Nothing is left holding memory.
    assert manager.reports() == []
    await asyncio.sleep(0)  # let the loop settle before scanning processes
    assert not [p for p in psutil.process_iter(["pid"])
                if _env_of(p).get("MODELKEEPER_REPLICA_ID") == "r1"]


def _env_of(proc: psutil.Process) -> dict[str, str]:
    try:
        env: dict[str, str] = proc.environ()
        return env
    except psutil.Error:
        return {}


async def test_stop_terminates_the_group_and_is_idempotent(manager: ShardManager) -> None:
    endpoint = await manager.start(_spec("r1"), _progress)
    ended = await manager.stop(ReplicaId("r1"), grace_s=5)
    assert ended.kind is ExitKind.STOPPED
    assert not psutil.pid_exists(endpoint.pid) or psutil.Process(endpoint.pid).status() == \
        psutil.STATUS_ZOMBIE
    again = await manager.stop(ReplicaId("r1"), grace_s=5)
    assert again.kind is ExitKind.UNKNOWN_SHARD


async def test_restarted_agent_adopts_running_engines(tmp_path: Path) -> None:
    ports = _port_block()
    first = _manager(tmp_path / "agent", ports)
    try:
        endpoint = await first.start(_spec("r1"), _progress)
        await first.close()  # the agent goes away; its engine keeps running

        second = _manager(tmp_path / "agent", ports)
        adopted, killed = second.recover()
        assert adopted == ["r1"] and killed == []
        [report] = second.reports()
        assert (report.pid, report.port, report.adopted, report.state) == (
            endpoint.pid, endpoint.port, True, ShardState.READY)
        # Watched by polling: an adopted engine is not our child.
        os.kill(endpoint.pid, signal.SIGKILL)
        ended = await asyncio.wait_for(second.watch(ReplicaId("r1"), lambda: None), 10)
        assert ended.kind is ExitKind.VANISHED
        await second.close()
    finally:
        _kill_our_engines("n-test")


async def test_restarted_agent_kills_engines_it_cannot_identify(tmp_path: Path) -> None:
    ports = _port_block()
    first = _manager(tmp_path / "agent", ports)
    try:
        endpoint = await first.start(_spec("r1"), _progress)
        await first.close()
        # The record is lost (disk trouble, a hand-edited dir): nothing can describe it.
        for record in (tmp_path / "agent" / "shards").glob("*.json"):
            record.unlink()
        second = _manager(tmp_path / "agent", ports)
        adopted, killed = second.recover()
        assert adopted == [] and killed == [endpoint.pid]
        proc = psutil.Process(endpoint.pid) if psutil.pid_exists(endpoint.pid) else None
        if proc is not None:
            proc.wait(5)
        await second.close()
    finally:
        _kill_our_engines("n-test")


async def test_a_port_held_by_a_stray_process_is_never_handed_out(tmp_path: Path) -> None:
    low, high = _port_block()
    m = _manager(tmp_path / "agent", (low, high))
    with socket.socket() as stray:
        stray.bind(("127.0.0.1", low))
        stray.listen()
        try:
            endpoint = await m.start(_spec("r1"), _progress)
            assert endpoint.port == low + 1
        finally:
            await m.close()
            _kill_our_engines("n-test")


async def test_unwatched_ready_shards_are_reaped(manager: ShardManager) -> None:
    await manager.start(_spec("r1"), _progress)
    assert await manager.reap_orphans(grace_s=60) == []
    assert await manager.reap_orphans(grace_s=0) == ["r1"]
    assert manager.reports() == []


async def test_shards_the_control_plane_holds_no_claim_for_are_stopped_at_once(
        manager: ShardManager) -> None:
    """A heartbeat's answer lists the replicas claimed on this node: an engine it ran
    before that heartbeat and that is not listed (released while the node was cut off,
    and replaced elsewhere) stops now, not after the orphan grace. One launched after the
    heartbeat was sent is kept: its placement may have committed after the answer."""
    await manager.start(_spec("r1"), _progress)
    await manager.start(_spec("r2"), _progress)
    sent_at = time.monotonic()
    await manager.start(_spec("r3"), _progress)
    stopped = await manager.stop_unclaimed({ReplicaId("r2")}, ran_before=sent_at)
    assert stopped == ["r1"]
    assert sorted(r.replica_id for r in manager.reports()) == ["r2", "r3"]
