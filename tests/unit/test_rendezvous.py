"""The rendezvous rules: which port rank 0 takes (modelkeeper.domain.shards), how an
address is written and read (modelkeeper.domain.addresses), and the link check of a rank
above 0 (agent.links)."""

from __future__ import annotations

import asyncio

import pytest

from agent.links import LINK_CHECK_INTERVAL_S, LINK_FAILURES, LinkWatch
from modelkeeper.domain.addresses import format_address, split_address
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec, rendezvous_port
from modelkeeper.infra.processes import free_port


def test_rank_0_takes_the_highest_port_no_other_rendezvous_holds() -> None:
    assert rendezvous_port(20000, 20999, set()) == 20999
    assert rendezvous_port(20000, 20999, {20999, 20998}) == 20997
    assert rendezvous_port(20000, 20000, set()) == 20000
    assert rendezvous_port(20000, 20001, {20000, 20001}) is None


@pytest.mark.parametrize("host, port, text", [
    ("10.0.0.1", 5000, "10.0.0.1:5000"),
    ("fd00::1", 5000, "[fd00::1]:5000"),
    ("gpu-a.internal", 1, "gpu-a.internal:1"),
])
def test_addresses_are_written_and_read_one_way(host: str, port: int, text: str) -> None:
    assert format_address(host, port) == text
    assert split_address(text) == (host, port)


@pytest.mark.parametrize("text", ["", "host", "host:", ":5000", "h:0", "h:65536", "h:x"])
def test_a_bad_address_reads_as_none(text: str) -> None:
    assert split_address(text) is None


def _spec(rank: int, leader: str | None, world_size: int = 2) -> ShardSpec:
    return ShardSpec(replica_id=ReplicaId("r1"), model_id=ModelId("m"), node_id=NodeId("n-b"),
                     engine=EngineKind.SIM, source="sim", memory_bytes=1, rank=rank,
                     world_size=world_size, leader_address=leader)


def test_only_ranks_above_0_of_a_multi_node_replica_check_a_link() -> None:
    assert LinkWatch.of(_spec(0, "h:1")) is None
    assert LinkWatch.of(_spec(0, None, world_size=1)) is None
    watch = LinkWatch.of(_spec(1, "[fd00::1]:5000"))
    assert watch is not None and (watch.host, watch.port) == ("fd00::1", 5000)


async def test_a_link_counts_as_lost_after_failures_in_a_row_and_recovers_before() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    watch = LinkWatch.of(_spec(1, f"127.0.0.1:{port}"))
    assert watch is not None
    now = 0.0
    assert await watch.poll(now) is None and watch.failures == 0
    # Not due yet: no check at all.
    assert await watch.poll(now + LINK_CHECK_INTERVAL_S / 2) is None
    server.close()
    await server.wait_closed()
    for i in range(1, LINK_FAILURES):
        now += LINK_CHECK_INTERVAL_S
        assert await watch.poll(now) is None and watch.failures == i
    # Back before the last failure: counted from zero again.
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    now += LINK_CHECK_INTERVAL_S
    assert await watch.poll(now) is None and watch.failures == 0
    server.close()
    await server.wait_closed()
    lost = None
    for _ in range(LINK_FAILURES):
        now += LINK_CHECK_INTERVAL_S
        lost = await watch.poll(now)
    assert lost == (f"rank 1 on node n-b cannot reach rank 0's rendezvous at 127.0.0.1:{port}: "
                    f"Connection refused ({LINK_FAILURES} checks in a row over "
                    f"{(LINK_FAILURES - 1) * LINK_CHECK_INTERVAL_S:.0f}s)")


async def test_an_address_nobody_listens_on_is_refused_not_waited_for() -> None:
    watch = LinkWatch.of(_spec(1, f"127.0.0.1:{free_port()}"))
    assert watch is not None
    async with asyncio.timeout(5):
        assert await watch.poll(0.0) is None
    assert watch.last_error == "Connection refused"
