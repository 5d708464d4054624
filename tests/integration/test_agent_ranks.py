"""A multi-node replica's shards on two agents' shard managers, with real sim engines in
their multi-rank mode: both start together and rank 0 serves once rank 1 joined; a rank
killed takes rank 0 down with the reason in its log; a rank that can no longer reach rank
0's rendezvous is stopped and ends LINK_LOST; a rendezvous port held by a stray process
refuses the start by name (agent.shard_startup, agent.links)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from agent import links
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
from modelkeeper.infra.processes import free_port
from tests.integration.test_agent_shards import _kill_our_engines

pytestmark = pytest.mark.timeout(60)

SECRET = b"test-secret"
HOST = "127.0.0.1"


def _progress(_: FetchProgress) -> None:
    pass


def _spec(node: str, rank: int, leader: str) -> ShardSpec:
    return ShardSpec(replica_id=ReplicaId("r1"), model_id=ModelId("sim-model"),
                     node_id=NodeId(node), engine=EngineKind.SIM, source="sim",
                     memory_bytes=0, rank=rank, world_size=2, leader_address=leader,
                     start_timeout_s=20.0)


@pytest.fixture
async def managers(tmp_path: Path) -> AsyncIterator[tuple[ShardManager, ShardManager, int]]:
    """Agents of nodes n-a and n-b on one machine, each with its own port block; and the
    rendezvous port the control plane would give rank 0 on n-a (the top of its block)."""
    made = []
    for node in ("n-a", "n-b"):
        low = free_port()
        made.append(ShardManager(node_id=NodeId(node), agent_dir=tmp_path / node,
                                 engine_host=HOST, port_range=(low, low + 10),
                                 node_key=derive_node_key(SECRET, node)))
    a_low = made[0]._startup._ports[0]
    try:
        yield made[0], made[1], a_low + 10
    finally:
        for m in made:
            await m.close()
        _kill_our_engines("n-a")
        _kill_our_engines("n-b")


async def test_two_ranks_start_together_and_a_killed_rank_takes_rank_0_down(
        managers: tuple[ShardManager, ShardManager, int]) -> None:
    a, b, port = managers
    leader = f"{HOST}:{port}"
    rank0, rank1 = await asyncio.gather(a.start(_spec("n-a", 0, leader), _progress),
                                        b.start(_spec("n-b", 1, leader), _progress))
    assert rank0.url is not None and rank1.url is None
    # Rank 0's HTTP port is never its rendezvous port.
    assert rank0.port != port
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{rank0.url}/health")).status_code == 200

    os.kill(rank1.pid, signal.SIGKILL)
    ended0, ended1 = await asyncio.gather(a.watch(ReplicaId("r1"), lambda: None),
                                          b.watch(ReplicaId("r1"), lambda: None))
    assert ended1.kind is ExitKind.SIGNALLED and ended1.signal == signal.SIGKILL
    assert ended0.kind is ExitKind.ERROR and ended0.exit_code == 1
    assert any("rank 1" in line and "left the rendezvous" in line
               for line in ended0.log_tail), ended0.log_tail


async def test_a_rank_cut_off_from_rank_0_is_stopped_as_link_lost(
        managers: tuple[ShardManager, ShardManager, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(links, "LINK_CHECK_INTERVAL_S", 0.2)
    _, b, port = managers
    joined: list[asyncio.StreamWriter] = []

    async def fake_rank0(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.readline() == b"rank 1\n":
            writer.write(b"welcome\n")
            joined.append(writer)  # held open: the engine's own connection stays up
        else:
            writer.close()

    server = await asyncio.start_server(fake_rank0, HOST, port)
    try:
        rank1 = await b.start(_spec("n-b", 1, f"{HOST}:{port}"), _progress)
        # A rank without HTTP is started once it runs; it joins rank 0 on its own.
        async with asyncio.timeout(20):
            while not joined:
                await asyncio.sleep(0.05)
        # Rank 0's address stops answering (its node moved, or the link broke) while
        # the connection the engine holds is still up: only the link check can tell.
        server.close()
        await server.wait_closed()
        async with asyncio.timeout(30):
            ended = await b.watch(ReplicaId("r1"), lambda: None)
    finally:
        for writer in joined:
            writer.close()
    assert ended.kind is ExitKind.LINK_LOST
    assert ended.detail.startswith(
        f"rank 1 on node n-b cannot reach rank 0's rendezvous at {HOST}:{port}: "
        "Connection refused (3 checks in a row"), ended.detail
    # Stopped, not left running: its process is gone and the agent runs no shard.
    with pytest.raises(ProcessLookupError):
        os.kill(rank1.pid, 0)
    assert b.reports() == []


async def test_a_rendezvous_port_held_by_a_stray_process_refuses_the_start(
        managers: tuple[ShardManager, ShardManager, int]) -> None:
    a, _, port = managers
    with socket.socket() as stray:
        stray.bind((HOST, port))
        stray.listen()
        with pytest.raises(ShardStartError) as refused:
            await a.start(_spec("n-a", 0, f"{HOST}:{port}"), _progress)
    assert refused.value.exit.kind is ExitKind.ERROR
    assert refused.value.exit.detail == f"rank 0's rendezvous port {port} on node n-a is in use"
    assert a.reports() == []


async def test_each_rank_is_adopted_by_its_own_agent_after_a_restart(
        managers: tuple[ShardManager, ShardManager, int], tmp_path: Path) -> None:
    a, b, port = managers
    leader = f"{HOST}:{port}"
    rank0, rank1 = await asyncio.gather(a.start(_spec("n-a", 0, leader), _progress),
                                        b.start(_spec("n-b", 1, leader), _progress))
    # Rank 1's agent goes away and comes back: the engine kept running, and the group
    # with it (rank 0 still serves).
    await b.close()
    again = ShardManager(node_id=NodeId("n-b"), agent_dir=tmp_path / "n-b",
                         engine_host=HOST, port_range=b._startup._ports,
                         node_key=derive_node_key(SECRET, "n-b"))
    try:
        adopted, killed = again.recover()
        assert adopted == ["r1"] and killed == []
        [report] = again.reports()
        assert (report.pid, report.rank, report.adopted) == (rank1.pid, 1, True)
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{rank0.url}/health")).status_code == 200
        # Adopted, it is watched as before: its end takes rank 0 down.
        os.kill(rank1.pid, signal.SIGKILL)
        ended1, ended0 = await asyncio.gather(again.watch(ReplicaId("r1"), lambda: None),
                                              a.watch(ReplicaId("r1"), lambda: None))
        assert ended1.kind is ExitKind.VANISHED
        assert ended0.kind is ExitKind.ERROR and ended0.exit_code == 1
    finally:
        await again.close()
