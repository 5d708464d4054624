"""Sleep and wake with the real shard manager and sim engines (which speak vLLM's sleep
dialect) on one node with one start-up slot (agent/shard_sleep.py's rules): idempotent, a
shard not run here refused for good, a sleep never delayed, a wake waiting while a start
holds the gate, a wake whose memory is gone refused, and a stop of a queued wake stopping
the engine. The node activities over them map the errors to the types workflows match."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from temporalio.exceptions import ApplicationError

from activities.node import NodeActivities
from agent.shards import ShardManager
from modelkeeper.domain.engine_keys import derive_engine_key, derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import (
    EngineKind,
    ExitKind,
    FetchProgress,
    ShardNotHereError,
    ShardReport,
    ShardSpec,
    ShardStartError,
    SleepShardInput,
    SleepWakeError,
    WakeShardInput,
)
from modelkeeper.infra.processes import free_port
from modelkeeper.names import ERROR_SHARD_NOT_HERE, ERROR_SLEEP_WAKE_FAILED
from tests.support.node_activities import heartbeat_env

pytestmark = pytest.mark.timeout(60)

#: Its own node id: cleanup kills engines by node, and other test files use others.
NODE = "n-sleep"
SECRET = b"test-secret"
MIB = 1 << 20
#: Long enough that a wake is seen waiting while the start loads, even on a busy 2-core
#: machine where a sim takes most of a second to come up.
LOAD_S = 2.5


def _spec(replica: str, **engine_args: Any) -> ShardSpec:
    # Held memory kept at 0 (the sim holds engine_args.memory_bytes for real): the fit
    # check for a wake counts the claim's share beyond weights_bytes, tested on its own.
    return ShardSpec(replica_id=ReplicaId(replica), model_id=ModelId("sim-model"),
                     node_id=NodeId(NODE), engine=EngineKind.SIM, source="sim",
                     memory_bytes=MIB,
                     engine_args={"memory_bytes": 0, "wake_time_s": 0.0, **engine_args})


def _env_of(proc: psutil.Process) -> dict[str, str]:
    try:
        env: dict[str, str] = proc.environ()
        return env
    except psutil.Error:
        return {}


def _kill_our_engines() -> None:
    for proc in psutil.process_iter(["pid"]):
        if _env_of(proc).get("MODELKEEPER_NODE_ID") == NODE:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


@pytest.fixture
async def managers(tmp_path: Path) -> AsyncIterator[Callable[..., ShardManager]]:
    made: list[ShardManager] = []

    def make(**kwargs: Any) -> ShardManager:
        low = free_port()
        made.append(ShardManager(
            node_id=NodeId(NODE), agent_dir=tmp_path / f"agent{len(made)}",
            engine_host="127.0.0.1", port_range=(low, low + 20),
            node_key=derive_node_key(SECRET, NODE), max_concurrent_startups=1, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for m in made:
            await m.close()
        _kill_our_engines()


def _quiet(_: FetchProgress) -> None:
    pass


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _report(m: ShardManager, replica: str) -> ShardReport | None:
    return next((r for r in m.reports() if r.replica_id == replica), None)


async def _engine_sleeps(url: str, replica: str) -> bool:
    key = derive_engine_key(derive_node_key(SECRET, NODE).encode(), ReplicaId(replica))
    async with httpx.AsyncClient() as client:
        answer = await client.get(url + "/is_sleeping",
                                  headers={"Authorization": f"Bearer {key}"})
    value: bool = answer.json()["is_sleeping"]
    return value


async def test_sleep_and_wake_are_idempotent(managers: Callable[..., ShardManager]) -> None:
    m = managers()
    endpoint = await m.start(_spec("r1"), _quiet)
    assert endpoint.url is not None
    beats: list[None] = []
    # Waking an awake shard succeeds and changes nothing.
    await m.wake(ReplicaId("r1"), lambda: beats.append(None))
    assert not await _engine_sleeps(endpoint.url, "r1")

    await m.sleep(ReplicaId("r1"))
    assert await _engine_sleeps(endpoint.url, "r1")
    report = _report(m, "r1")
    assert report is not None and report.sleeping
    await m.sleep(ReplicaId("r1"))  # asleep already: succeeds
    assert await _engine_sleeps(endpoint.url, "r1")

    await m.wake(ReplicaId("r1"), lambda: beats.append(None))
    assert not await _engine_sleeps(endpoint.url, "r1")
    report = _report(m, "r1")
    assert report is not None and not report.sleeping
    assert beats, "the wake heartbeats"


async def test_a_shard_not_here_is_refused_for_good(
        managers: Callable[..., ShardManager]) -> None:
    m = managers()
    with pytest.raises(ShardNotHereError):
        await m.sleep(ReplicaId("r-none"))
    with pytest.raises(ShardNotHereError):
        await m.wake(ReplicaId("r-none"), lambda: None)
    activities = NodeActivities(m)
    env, _ = heartbeat_env()
    with pytest.raises(ApplicationError) as slept:
        await env.run(activities.sleep_shard, SleepShardInput(replica_id=ReplicaId("x")))
    with pytest.raises(ApplicationError) as woken:
        await env.run(activities.wake_shard, WakeShardInput(replica_id=ReplicaId("x")))
    for info in (slept, woken):
        assert (info.value.type, info.value.non_retryable) == (ERROR_SHARD_NOT_HERE, True)


async def test_a_wake_waits_while_a_start_holds_the_gate_and_a_sleep_never_does(
        managers: Callable[..., ShardManager]) -> None:
    m = managers()
    await m.start(_spec("r-asleep"), _quiet)
    await m.start(_spec("r-awake"), _quiet)
    await m.sleep(ReplicaId("r-asleep"))

    loading = asyncio.create_task(m.start(_spec("r-load", load_time_s=LOAD_S), _quiet))
    await _until(lambda: _report(m, "r-load") is not None, "r-load to launch")
    # A sleep while r-load holds the slot: at once.
    began = time.monotonic()
    await m.sleep(ReplicaId("r-awake"))
    assert time.monotonic() - began < LOAD_S / 2, "the sleep waited for the start-up gate"

    beats: list[None] = []
    waking = asyncio.create_task(m.wake(ReplicaId("r-asleep"), lambda: beats.append(None)))
    await _until(lambda: getattr(_report(m, "r-asleep"), "queued_position", None) == 1,
                 "the wake to queue")
    await _until(lambda: len(beats) > 1, "the queued wake to heartbeat")
    report = _report(m, "r-load")
    assert report is not None and report.state.value == "starting"
    assert not waking.done()
    endpoint = await loading
    await waking
    # It woke only once the load was over.
    report = _report(m, "r-asleep")
    assert report is not None and not report.sleeping and report.queued_position is None
    assert endpoint.url is not None


async def test_a_wake_whose_memory_is_gone_is_refused(
        managers: Callable[..., ShardManager]) -> None:
    available = [1 << 40]
    m = managers(available_memory=lambda: available[0])
    # It claims 1 MiB, keeps 256 KiB asleep: waking takes back 768 KiB.
    await m.start(_spec("r1", memory_bytes=MIB, weights_bytes=256 << 10), _quiet)
    await m.sleep(ReplicaId("r1"))
    available[0] = 512 << 10
    with pytest.raises(SleepWakeError) as info:
        await m.wake(ReplicaId("r1"), lambda: None)
    assert not info.value.retryable and str(768 << 10) in str(info.value)
    report = _report(m, "r1")
    assert report is not None and report.sleeping
    # Through the activity: the same refusal, non-retryable, as the workflow matches it.
    env, _ = heartbeat_env()
    with pytest.raises(ApplicationError) as failed:
        await env.run(NodeActivities(m).wake_shard, WakeShardInput(replica_id=ReplicaId("r1")))
    assert (failed.value.type, failed.value.non_retryable) == (ERROR_SLEEP_WAKE_FAILED, True)
    # The gate is free again: the next wake, with the memory back, goes through.
    available[0] = 1 << 40
    await env.run(NodeActivities(m).wake_shard, WakeShardInput(replica_id=ReplicaId("r1")))
    report = _report(m, "r1")
    assert report is not None and not report.sleeping


async def test_a_stop_of_a_queued_wake_stops_the_engine(
        managers: Callable[..., ShardManager]) -> None:
    m = managers()
    await m.start(_spec("r-asleep"), _quiet)
    await m.sleep(ReplicaId("r-asleep"))
    loading = asyncio.create_task(m.start(_spec("r-load", load_time_s=LOAD_S * 2), _quiet))
    await _until(lambda: _report(m, "r-load") is not None, "r-load to launch")
    waking = asyncio.create_task(m.wake(ReplicaId("r-asleep"), lambda: None))
    await _until(lambda: getattr(_report(m, "r-asleep"), "queued_position", None) == 1,
                 "the wake to queue")

    stopped = await m.stop(ReplicaId("r-asleep"), grace_s=5)
    assert stopped.kind is ExitKind.STOPPED
    with pytest.raises(SleepWakeError) as info:
        await waking
    assert not info.value.retryable and "stopped" in str(info.value)
    assert _report(m, "r-asleep") is None
    await m.stop(ReplicaId("r-load"), grace_s=5)
    with pytest.raises(ShardStartError):
        await loading


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_sleep_and_wake_in_each_engines_dialect(
        managers: Callable[..., ShardManager], dialect: str) -> None:
    """The agent's calls against a sim speaking vLLM's or SGLang's dialect: SGLang's
    release and resume of the KV cache (no way to ask whether it sleeps: the agent's record
    decides), vLLM's sleep and wake (the engine says)."""
    m = managers()
    endpoint = await m.start(_spec("r-d", dialect=dialect), _quiet)
    assert endpoint.url is not None
    key = derive_engine_key(derive_node_key(SECRET, NODE).encode(), ReplicaId("r-d"))
    auth = {"Authorization": f"Bearer {key}"}
    body = {"prompt": "x", "max_tokens": 1}
    for _ in range(2):  # the second of each changes nothing
        await m.sleep(ReplicaId("r-d"))
        report = _report(m, "r-d")
        assert report is not None and report.sleeping
    async with httpx.AsyncClient(base_url=endpoint.url, headers=auth) as client:
        if dialect == "sglang":
            # Released: it refuses work (vLLM would queue it until the wake).
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 503
        else:
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        for _ in range(2):
            await m.wake(ReplicaId("r-d"), lambda: None)
            report = _report(m, "r-d")
            assert report is not None and not report.sleeping
        assert (await client.post("/v1/completions", json=body)).status_code == 200
