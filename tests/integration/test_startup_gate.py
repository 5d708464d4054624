"""The start-up gate with the real shard manager and sim engines on one node
(max_concurrent_startups=1): one load at a time, in order, the queue visible in the
reports, the fit checked again, the wait bounded, and stops never delayed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.engine_process import REPLICA_ENV
from agent.shards import ShardManager
from modelkeeper.domain.engine_keys import derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import (
    EngineKind,
    ExitKind,
    FetchProgress,
    ShardReport,
    ShardSpec,
    ShardStartError,
    ShardState,
)
from modelkeeper.infra.processes import free_port

pytestmark = pytest.mark.timeout(60)

#: Its own node id: cleanup kills engines by node, and other test files use "n-test".
NODE = "n-gate"
SECRET = b"test-secret"
MIB = 1 << 20
#: Long enough that the second start is seen queued while the first loads, even on a
#: busy 2-core machine where a sim takes most of a second to come up.
FIRST_LOAD_S = 2.5


def _spec(replica: str, *, held_bytes: int = 0, start_timeout_s: float = 30.0,
          **engine_args: Any) -> ShardSpec:
    # The sim holds engine_args.memory_bytes as real memory, whatever its claim: keep it
    # small. It is also what the fit check counts for a sim.
    return ShardSpec(replica_id=ReplicaId(replica), model_id=ModelId("sim-model"),
                     node_id=NodeId(NODE), engine=EngineKind.SIM, source="sim",
                     memory_bytes=MIB, engine_args={**engine_args, "memory_bytes": held_bytes},
                     start_timeout_s=start_timeout_s)


def _manager(agent_dir: Path, **kwargs: Any) -> ShardManager:
    low = free_port()
    return ShardManager(node_id=NodeId(NODE), agent_dir=agent_dir, engine_host="127.0.0.1",
                        port_range=(low, low + 20), node_key=derive_node_key(SECRET, NODE),
                        max_concurrent_startups=1, **kwargs)


def _quiet(_: FetchProgress) -> None:
    pass


def _env_of(proc: psutil.Process) -> dict[str, str]:
    try:
        env: dict[str, str] = proc.environ()
        return env
    except psutil.Error:
        return {}


def _engine_pids(replica: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["pid"])
            if _env_of(p).get(REPLICA_ENV) == replica
            and _env_of(p).get("MODELKEEPER_NODE_ID") == NODE]


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
        made.append(_manager(tmp_path / f"agent{len(made)}", **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for m in made:
            await m.close()
        _kill_our_engines()


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _report(m: ShardManager, replica: str) -> ShardReport | None:
    return next((r for r in m.reports() if r.replica_id == replica), None)


def _log_time(path: Path, needle: str) -> datetime:
    """When the sim engine logged the first line containing ``needle`` (its own clock)."""
    for line in path.read_text().splitlines():
        if needle in line:
            return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"{needle!r} not in {path}")


async def test_second_start_loads_only_after_the_first_is_ready(
        managers: Callable[..., ShardManager], tmp_path: Path) -> None:
    m = managers()
    first = asyncio.create_task(m.start(_spec("r1", load_time_s=FIRST_LOAD_S), _quiet))
    await _until(lambda: _report(m, "r1") is not None, "r1 to launch")

    places: list[tuple[int, list[ReplicaId]]] = []
    at_launch: dict[str, ShardState] = {}

    def second_progress(progress: FetchProgress) -> None:
        if progress.phase == "launching":
            at_launch.update({r.replica_id: r.state for r in m.reports()})

    second = asyncio.create_task(m.start(
        _spec("r2"), second_progress,
        on_queued=lambda position, waiting_for: places.append((position, waiting_for))))
    await _until(lambda: places != [], "r2 to queue")

    # While r1 loads, r2 is reported queued, first in line, with no process at all.
    queued = _report(m, "r2")
    assert queued is not None and queued.queued_position == 1, m.reports()
    assert (queued.state, queued.pid, queued.port) == (ShardState.STARTING, 0, 0)
    loading = _report(m, "r1")
    assert loading is not None and loading.state is ShardState.STARTING
    assert loading.queued_position is None
    assert places[0] == (1, ["r1"])
    assert _engine_pids("r2") == []

    await first
    endpoint = await second
    assert endpoint.url is not None
    # The manager launched r2 only once r1 was ready ...
    assert at_launch == {"r1": ShardState.READY}, at_launch
    # ... and the engines' own logs agree: r2 began after r1 was ready.
    logs = tmp_path / "agent0" / "logs"
    ready = _log_time(logs / "r1.log", "ready after")
    began = _log_time(logs / "r2.log", "listening")
    assert began >= ready, (ready, began)
    assert [r.queued_position for r in m.reports()] == [None, None]


async def test_stops_are_never_delayed_by_the_queue(
        managers: Callable[..., ShardManager]) -> None:
    m = managers()
    await m.start(_spec("r0"), _quiet)
    first = asyncio.create_task(m.start(_spec("r1", load_time_s=FIRST_LOAD_S * 2), _quiet))
    await _until(lambda: _report(m, "r1") is not None, "r1 to launch")
    second = asyncio.create_task(m.start(_spec("r2"), _quiet))
    await _until(lambda: getattr(_report(m, "r2"), "queued_position", None) == 1,
                 "r2 to queue")

    # A stop of a running engine while r1 loads and r2 waits: done at once, the load and
    # the queue untouched.
    began = time.monotonic()
    stopped = await m.stop(ReplicaId("r0"), grace_s=5)
    assert stopped.kind is ExitKind.STOPPED
    assert time.monotonic() - began < FIRST_LOAD_S, "the stop waited for the start-up gate"
    assert getattr(_report(m, "r1"), "state", None) is ShardState.STARTING
    assert getattr(_report(m, "r2"), "queued_position", None) == 1

    # A stop of the queued start takes it out of the queue at once; its start fails.
    began = time.monotonic()
    stopped = await m.stop(ReplicaId("r2"), grace_s=5)
    assert time.monotonic() - began < 0.5
    assert stopped.kind is ExitKind.STOPPED and "queued" in stopped.detail
    with pytest.raises(ShardStartError) as info:
        await second
    assert info.value.exit.kind is ExitKind.STOPPED
    assert _report(m, "r2") is None and _engine_pids("r2") == []

    # A stop of the loading engine frees the slot: the next start goes without queueing.
    await m.stop(ReplicaId("r1"), grace_s=5)
    with pytest.raises(ShardStartError):
        await first
    places: list[int] = []
    await m.start(_spec("r3"), _quiet, on_queued=lambda position, _: places.append(position))
    assert places == []


async def test_fit_is_checked_again_when_the_turn_comes(
        managers: Callable[..., ShardManager]) -> None:
    available: list[int | None] = [None]  # unreadable at first: never a reason to refuse
    m = managers(available_memory=lambda: available[0])
    first = asyncio.create_task(m.start(_spec("r1", load_time_s=FIRST_LOAD_S), _quiet))
    await _until(lambda: _report(m, "r1") is not None, "r1 to launch")
    second = asyncio.create_task(m.start(
        _spec("r2", held_bytes=512 * MIB), _quiet))  # refused: never launched, never held
    await _until(lambda: getattr(_report(m, "r2"), "queued_position", None) == 1,
                 "r2 to queue")
    available[0] = 64 * MIB  # memory outside modelkeeper grew meanwhile
    await first
    with pytest.raises(ShardStartError) as info:
        await second
    detail = info.value.exit.detail
    assert "r2" in detail and str(512 * MIB) in detail and str(64 * MIB) in detail, detail
    assert _report(m, "r2") is None and _engine_pids("r2") == []
    # The slot is free again: a start that fits goes at once.
    available[0] = 1 << 40
    await asyncio.wait_for(m.start(_spec("r3"), _quiet), 20)


async def test_the_queue_wait_is_bounded_so_the_answer_beats_temporals_timeout(
        managers: Callable[..., ShardManager]) -> None:
    m = managers()
    first = asyncio.create_task(m.start(_spec("r1", load_time_s=FIRST_LOAD_S * 2), _quiet))
    await _until(lambda: _report(m, "r1") is not None, "r1 to launch")
    # Temporal gives the whole start 41 s: a 30 s load and the 10 s answer margin leave
    # 1 s to queue.
    began = time.monotonic()
    with pytest.raises(ShardStartError) as info:
        await m.start(_spec("r2", start_timeout_s=30), _quiet, answer_within_s=41)
    waited = time.monotonic() - began
    assert info.value.exit.kind is ExitKind.START_TIMEOUT
    assert "r2 still queued behind r1 after 1s" in info.value.exit.detail
    assert 0.9 < waited < FIRST_LOAD_S, waited
    assert _report(m, "r2") is None
    await first
