"""A watch hands its heartbeat to the SDK at most once per a share of its heartbeat timeout
(activities/node.py): the shard manager polls four times a second, and each call into the
SDK costs the agent CPU even though the SDK sends one per 0.8 x the timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from activities.node import WATCH_BEAT_MAX_GAP_S, NodeActivities, at_most_every
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.shards import ExitKind, ShardExit, WatchShardInput
from tests.support.node_activities import StubRunner, heartbeat_env


def test_a_beat_goes_at_once_then_once_per_gap() -> None:
    now = [0.0]
    beats: list[float] = []
    beat = at_most_every(5.0, lambda: beats.append(now[0]), clock=lambda: now[0])
    for t in (0.0, 0.25, 4.75, 5.0, 5.25, 9.9, 10.1):
        now[0] = t
        beat()
    assert beats == [0.0, 5.0, 10.1]


class _PollingRunner(StubRunner):
    """Polls like the shard manager: a heartbeat call every tick, then the engine exits."""

    def __init__(self, ticks: int) -> None:
        self.ticks = ticks

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit:
        for _ in range(self.ticks):
            heartbeat()
        return ShardExit(replica_id=replica_id, kind=ExitKind.CLEAN, exit_code=0)


async def test_a_watch_beats_once_however_often_its_manager_polls_within_the_gap() -> None:
    env, beats = heartbeat_env(heartbeat_timeout=timedelta(seconds=60))
    ended = await env.run(NodeActivities(_PollingRunner(ticks=40)).watch_shard,
                          WatchShardInput(replica_id=ReplicaId("r-1")))
    assert ended.kind is ExitKind.CLEAN
    # 40 polls in well under WATCH_BEAT_MAX_GAP_S: the first heartbeat only.
    assert len(beats) == 1


async def test_a_short_heartbeat_timeout_shortens_the_gap() -> None:
    # The old 3 s timeout: a beat per 0.3 s at most, well inside it.
    env, beats = heartbeat_env(heartbeat_timeout=timedelta(seconds=3))
    runner = _SlowRunner(ticks=8, tick_s=0.1)
    await env.run(NodeActivities(runner).watch_shard, WatchShardInput(replica_id=ReplicaId("r")))
    assert 2 <= len(beats) <= 4, beats
    assert WATCH_BEAT_MAX_GAP_S > 0.3


class _SlowRunner(_PollingRunner):
    def __init__(self, ticks: int, tick_s: float) -> None:
        super().__init__(ticks)
        self.tick_s = tick_s

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit:
        for _ in range(self.ticks):
            heartbeat()
            await asyncio.sleep(self.tick_s)
        return ShardExit(replica_id=replica_id, kind=ExitKind.CLEAN, exit_code=0)
