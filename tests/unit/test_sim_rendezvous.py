"""The sim engine's multi-rank mode behaves as the real engines' rendezvous: rank 0 serves
only when every rank has joined, a link check counts for nothing, and a rank that leaves
takes the others down with an error (agent.engines.sim_rendezvous)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agent.engines.sim_rendezvous import RANK_LOST_EXIT_CODE
from agent.engines.sim_server import SimConfig, serve
from modelkeeper.infra.processes import free_port

HOST = "127.0.0.1"
#: Generous for two shared cores; every wait below ends as soon as its condition holds.
WAIT_S = 20.0


def _config(rank: int, leader_port: int, *, world_size: int = 2) -> SimConfig:
    return SimConfig(host=HOST, port=free_port(), model="m", rank=rank,
                     world_size=world_size, leader=(HOST, leader_port), join_timeout_s=WAIT_S)


async def _health(client: httpx.AsyncClient, config: SimConfig) -> tuple[int, str]:
    try:
        answer = await client.get(f"http://{HOST}:{config.port}/health")
    except httpx.HTTPError:
        return 0, "not listening"
    return answer.status_code, answer.text


async def _until_health(client: httpx.AsyncClient, config: SimConfig,
                        want: int, text: str = "") -> str:
    async with asyncio.timeout(WAIT_S):
        while True:
            status, body = await _health(client, config)
            if status == want and text in body:
                return body
            await asyncio.sleep(0.05)


async def test_rank_0_serves_once_every_rank_joined_and_exits_when_one_leaves() -> None:
    leader_port = free_port()
    zero, one = _config(0, leader_port), _config(1, leader_port)
    stop0, stop1 = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(timeout=2) as client:
        rank0 = asyncio.create_task(serve(zero, None, stop=stop0))
        try:
            body = await _until_health(client, zero, 503, "1/2 ranks joined")
            assert "waiting for ranks" in body
            # A link check (connect, say nothing, close) is not a rank.
            _, writer = await asyncio.open_connection(HOST, leader_port)
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.3)
            assert (await _health(client, zero))[0] == 503
            rank1 = asyncio.create_task(serve(one, None, stop=stop1))
            await _until_health(client, zero, 200)
            assert not rank0.done()
            # Rank 1 ends (its process would be killed): rank 0 exits with an error.
            stop1.set()
            assert await asyncio.wait_for(rank1, WAIT_S) == 0
            assert await asyncio.wait_for(rank0, WAIT_S) == RANK_LOST_EXIT_CODE
        finally:
            stop0.set()
            stop1.set()


async def test_a_rank_exits_when_rank_0_leaves() -> None:
    leader_port = free_port()
    zero, one = _config(0, leader_port), _config(1, leader_port)
    stop0, stop1 = asyncio.Event(), asyncio.Event()
    async with httpx.AsyncClient(timeout=2) as client:
        # Rank 1 first: it keeps trying until rank 0 listens, as a torch rank does.
        rank1 = asyncio.create_task(serve(one, None, stop=stop1))
        rank0 = asyncio.create_task(serve(zero, None, stop=stop0))
        try:
            await _until_health(client, zero, 200)
            stop0.set()
            assert await asyncio.wait_for(rank0, WAIT_S) == 0
            assert await asyncio.wait_for(rank1, WAIT_S) == RANK_LOST_EXIT_CODE
        finally:
            stop0.set()
            stop1.set()


async def test_a_rank_that_cannot_reach_rank_0_gives_up_at_its_timeout() -> None:
    one = SimConfig(host=HOST, port=free_port(), model="m", rank=1, world_size=2,
                    leader=(HOST, free_port()), join_timeout_s=0.5)
    assert await asyncio.wait_for(serve(one, None, stop=asyncio.Event()),
                                  WAIT_S) == RANK_LOST_EXIT_CODE


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "2"], "needs --leader"),
    (["--world-size", "2", "--rank", "2", "--leader", "h:1"], "must be below"),
    (["--leader", "nohost"], "must be host:port"),
])
def test_bad_rank_flags_are_refused(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from agent.engines.sim_server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--model", "m", *argv])
    assert message in capsys.readouterr().err
