"""The node activities (activities/node.py) run alone on the SDK's ActivityEnvironment: a
shard runner that does only what a test gives it, and an environment that records every
heartbeat."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from temporalio.testing import ActivityEnvironment

from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.shards import (
    FetchProgress,
    ShardEndpoint,
    ShardExit,
    ShardReport,
    ShardSpec,
)


class StubRunner:
    """A ShardRunner that runs nothing and reports no shard: a test's subclass overrides
    the call its activity makes; any other call fails the test."""

    async def start(self, spec: ShardSpec, on_progress: Callable[[FetchProgress], None], *,
                    on_queued: Callable[[int, list[ReplicaId]], None] | None = None,
                    answer_within_s: float | None = None) -> ShardEndpoint:
        raise NotImplementedError

    async def watch(self, replica_id: ReplicaId, heartbeat: Callable[[], None]) -> ShardExit:
        raise NotImplementedError

    async def stop(self, replica_id: ReplicaId, grace_s: float) -> ShardExit:
        raise NotImplementedError

    async def sleep(self, replica_id: ReplicaId) -> None:
        raise NotImplementedError

    async def wake(self, replica_id: ReplicaId, heartbeat: Callable[[], None], *,
                   answer_within_s: float | None = None) -> None:
        raise NotImplementedError

    def reports(self) -> list[ShardReport]:
        return []


def heartbeat_env(**info: Any) -> tuple[ActivityEnvironment, list[tuple[Any, ...]]]:
    """An ActivityEnvironment whose activity info has the fields ``info`` names replaced
    (its timeouts, say), and the list that gets each heartbeat's details, one tuple a
    heartbeat."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, **info)
    beats: list[tuple[Any, ...]] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    return env, beats
