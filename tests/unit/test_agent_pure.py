"""Pure pieces of the agent and node model: inventory parsing, exit classification,
port choice, node state."""

from __future__ import annotations

import signal
from datetime import UTC, datetime, timedelta

import pytest

from agent.inventory import parse_meminfo, parse_nvidia_smi, read_inventory
from modelkeeper.domain.nodes import NodeRecord, NodeState, node_state
from modelkeeper.domain.shards import ExitKind, NoFreePortError, choose_port, classify_exit

pytestmark = pytest.mark.timeout(10)


def test_parse_meminfo_reads_kib_as_bytes() -> None:
    text = "MemTotal:       24576000 kB\nMemFree: 100 kB\nMemAvailable:   12288000 kB\n"
    assert parse_meminfo(text) == (24576000 * 1024, 12288000 * 1024)
    assert parse_meminfo("MemTotal: 5 kB\n") == (5 * 1024, None)
    assert parse_meminfo("") == (None, None)


def test_declared_memory_caps_what_the_node_reports(tmp_path) -> None:  # type: ignore[no-untyped-def]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 25165824 kB\nMemAvailable: 20971520 kB\n")
    inv = read_inventory(declared_memory=8 << 30, declared_cpus=4, meminfo=meminfo, gpus=[])
    assert (inv.memory_total_bytes, inv.memory_available_bytes, inv.cpu_count) == (
        8 << 30, 8 << 30, 4)
    inv = read_inventory(meminfo=meminfo, gpus=[])
    assert inv.memory_total_bytes == 25165824 * 1024
    missing = read_inventory(meminfo=tmp_path / "absent", gpus=[])
    assert missing.memory_total_bytes is None  # shown as "-", never 0


def test_parse_nvidia_smi() -> None:
    out = "0, NVIDIA H200, 143771, 0\n1, NVIDIA H200, 143771, [N/A]\n2, NVIDIA H200, 143771, 3\n"
    gpus = parse_nvidia_smi(out)
    assert [(g.index, g.memory_bytes, g.healthy) for g in gpus] == [
        (0, 143771 << 20, True), (1, 143771 << 20, True), (2, 143771 << 20, False)]


@pytest.mark.parametrize(
    ("code", "before", "after", "kernel", "kind", "words"),
    [
        (0, None, None, frozenset(), ExitKind.CLEAN, "code 0"),
        (1, None, None, frozenset(), ExitKind.ERROR, "code 1"),
        (-signal.SIGKILL, 0, 0, frozenset(), ExitKind.SIGNALLED, "SIGKILL"),
        (-signal.SIGKILL, None, None, frozenset(), ExitKind.SIGNALLED, "SIGKILL"),
        (-signal.SIGKILL, 2, 3, frozenset(), ExitKind.OOM_KILLED, "oom_kill count rose"),
        (-signal.SIGKILL, None, None, frozenset({42}), ExitKind.OOM_KILLED, "OOM killer"),
        (-signal.SIGKILL, None, None, frozenset({7}), ExitKind.SIGNALLED, "SIGKILL"),
        (-signal.SIGTERM, 2, 3, frozenset({42}), ExitKind.SIGNALLED, "SIGTERM"),
        (None, None, None, frozenset(), ExitKind.VANISHED, "unknown"),
    ],
)
def test_classify_exit_claims_oom_only_with_evidence(
    code: int | None, before: int | None, after: int | None, kernel: frozenset[int],
    kind: ExitKind, words: str,
) -> None:
    got, detail = classify_exit(code, oom_kills_before=before, oom_kills_after=after,
                                kernel_oom_pids=kernel, pid=42)
    assert got is kind and words in detail


def test_choose_port_skips_held_and_stray_ports() -> None:
    stray = {20001}
    assert choose_port(20000, 20005, {20000}, lambda p: p not in stray) == 20002
    with pytest.raises(NoFreePortError, match="20000-20001"):
        choose_port(20000, 20001, {20000}, lambda p: p not in stray)


def test_choose_port_prefers_the_port_a_relaunch_had_and_keeps_it_from_others() -> None:
    free = lambda p: True  # noqa: E731
    # A relaunch takes its old port back when it is free and ours to give.
    assert choose_port(20000, 20005, {20000}, free, prefer=20003) == 20003
    # Held by another shard, taken by a stray, or out of range: the first free one.
    assert choose_port(20000, 20005, {20003}, free, prefer=20003) == 20000
    assert choose_port(20000, 20005, set(), lambda p: p != 20003, prefer=20003) == 20000
    assert choose_port(20000, 20005, set(), free, prefer=30000) == 20000
    # Another launch passes over the ports kept for relaunches while others are free...
    assert choose_port(20000, 20002, {20000}, free, kept={20001}) == 20002
    # ...and takes one only when nothing else is left.
    assert choose_port(20000, 20001, {20000}, free, kept={20001}) == 20001
    with pytest.raises(NoFreePortError):
        choose_port(20000, 20001, {20000, 20001}, free, kept={20001}, prefer=20001)


def _node(seen_ago: float, cordoned: bool = False) -> tuple[NodeRecord, datetime]:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    record = NodeRecord(node_id="n", name="n", agent_labels={}, operator_labels={},
                        cordoned=cordoned, cordon_reason=None, memory_total_bytes=None,
                        memory_available_bytes=None, cpu_count=None, gpus=[],
                        last_seen=now - timedelta(seconds=seen_ago), registered_at=now)
    return record, now


@pytest.mark.parametrize(
    ("seen_ago", "cordoned", "state"),
    [(0, False, NodeState.READY), (5.9, False, NodeState.READY),
     (6, False, NodeState.UNREACHABLE), (59, False, NodeState.UNREACHABLE),
     (60, False, NodeState.LOST), (1, True, NodeState.CORDONED), (61, True, NodeState.LOST)],
)
def test_node_state_at_chosen_times(seen_ago: float, cordoned: bool, state: NodeState) -> None:
    record, now = _node(seen_ago, cordoned)
    assert node_state(record, now, unreachable_after_s=6, lost_after_s=60) is state


def test_operator_labels_outrank_the_agents() -> None:
    record, _ = _node(0)
    record = record.model_copy(update={"agent_labels": {"zone": "a", "gpu": "x"},
                                       "operator_labels": {"zone": "b"}})
    assert record.labels == {"zone": "b", "gpu": "x"}


def test_readiness_is_polled_fast_while_a_cold_start_waits_then_as_before() -> None:
    from agent.engine_process import (
        POLL_INTERVAL_S,
        READY_FAST_FOR_S,
        READY_POLL_FAST_S,
        ready_poll_s,
    )

    assert ready_poll_s(0.0) == READY_POLL_FAST_S < POLL_INTERVAL_S
    assert ready_poll_s(READY_FAST_FOR_S - 0.01) == READY_POLL_FAST_S
    assert ready_poll_s(READY_FAST_FOR_S) == POLL_INTERVAL_S
