"""A start's progress as people read it: percentages, rates, the lines ``ls`` shows, and
a queued start shown as ``queued`` (modelkeeper.domain.start_progress)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from cli import operator_cli
from cli.main import build_parser
from cli.operator_cli import _ls_text
from modelkeeper.domain.catalog import DeploymentView, ReplicaView
from modelkeeper.domain.engine_logs import failure_detail
from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.keeper import Phase, Placed, Scale, details
from modelkeeper.domain.start_progress import (
    StartProgress,
    download_rate,
    keep_window,
    ordinal,
    percent,
    shown,
    summary,
)
from tests.unit.test_keeper import serving_one

MIB = 1 << 20
NOW = datetime(2026, 12, 4, 18, 0, tzinfo=UTC)


def test_percent_needs_a_total_and_never_passes_100() -> None:
    assert percent(MIB, 4 * MIB) == 25.0
    assert percent(1, 3) == 33.3
    assert percent(MIB, None) is None
    assert percent(MIB, 0) is None
    assert percent(5, 4) == 100.0


def test_rate_is_the_mean_over_the_window_and_follows_a_stall() -> None:
    samples: tuple[tuple[float, int], ...] = ((0.0, 0),)
    assert download_rate(samples) is None
    for t in range(1, 11):  # 1 MiB a second for 10 s
        samples = keep_window(samples, float(t), t * MIB)
    assert download_rate(samples) == MIB
    assert samples[0][0] <= 10.0 - 5.0  # one sample older than the window is kept
    assert len(samples) <= 7
    for t in range(11, 17):  # then nothing for 6 s: the rate falls to 0
        samples = keep_window(samples, float(t), 10 * MIB)
    assert download_rate(samples) == 0.0


def test_ordinals() -> None:
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"]


def test_summaries_name_bytes_share_rate_and_what_a_start_waits_for() -> None:
    rid = ReplicaId("r-1")
    fetching = StartProgress(replica_id=rid, phase="fetching", bytes_done=45 * MIB,
                             bytes_total=98 * MIB, rate_bytes_per_s=3.25 * MIB)
    assert summary(fetching, "n1") == (
        "downloading 45.0 MiB of 98.0 MiB (45.9 %), 3.2 MiB/s on n1")
    unknown = StartProgress(replica_id=rid, phase="fetching", bytes_done=2048)
    assert summary(unknown, "n1") == "downloading 2.0 KiB on n1"
    queued = StartProgress(replica_id=rid, phase="queued", queue_position=2,
                           waiting_for=[ReplicaId("r-0")])
    assert summary(queued, "n1") == (
        "queued 2nd in line at n1's start-up gate, waiting for r-0 to load")
    assert summary(StartProgress(replica_id=rid, phase="loading"), "n1") == (
        "engine loading on n1, waiting until it answers ready")
    # A phase a newer agent names is shown as said.
    assert summary(StartProgress(replica_id=rid, phase="unpacking"), "n1") == "unpacking on n1"


def _replica(state: str, progress: StartProgress | None, rid: str = "r-1") -> ReplicaView:
    return ReplicaView(
        replica_id=ReplicaId(rid), deployment_id="d-1", model_id="m", nodes=[NodeId("n-1a2b")],
        state=state, endpoint=None, started_at=NOW, ready_at=None,
        progress=None if progress is None else shown(
            progress, node_id=NodeId("n-1a2b"), node_name="n1", updated_at=NOW))


def _deployment(status: str, replicas: list[ReplicaView]) -> DeploymentView:
    return DeploymentView(
        deployment_id="d-1", model_id="m", status=status, placement_error=None,
        desired_replicas=len(replicas),
        ready_replicas=sum(1 for r in replicas if r.state == "ready"),
        consecutive_failures=0, last_failure=None, min_nodes=1, node_ids=None, labels={},
        replicas=replicas, workflow_id="deployment/d-1", created_at=NOW, updated_at=NOW)


def test_a_start_waiting_at_the_gate_shows_as_queued() -> None:
    queued = StartProgress(replica_id=ReplicaId("r-1"), phase="queued", queue_position=1,
                           waiting_for=[ReplicaId("r-0")])
    replica = _replica("starting", queued)
    assert replica.shown_state == "queued" and replica.state == "starting"
    assert _deployment("starting", [replica]).shown_status == "queued"
    # Another start of it downloading: the deployment is starting, not all queued.
    fetching = _replica("starting", StartProgress(replica_id=ReplicaId("r-2"),
                                                  phase="fetching"), rid="r-2")
    assert fetching.shown_state == "starting"
    assert _deployment("starting", [replica, fetching]).shown_status == "starting"
    # A ready one beside it does not count.
    ready = _replica("ready", None, rid="r-3")
    assert _deployment("starting", [ready, replica]).shown_status == "queued"
    assert _deployment("serving", [ready]).shown_status == "serving"
    # The view round-trips through JSON (the CLI and tests read it back).
    again = DeploymentView.model_validate(_deployment("starting", [replica]).model_dump(
        mode="json"))
    assert again.shown_status == "queued" and again.replicas[0].progress is not None


def test_ls_shows_queued_and_the_progress_line() -> None:
    fetching = StartProgress(replica_id=ReplicaId("r-1"), phase="fetching",
                             bytes_done=MIB, bytes_total=4 * MIB, rate_bytes_per_s=MIB)
    queued = StartProgress(replica_id=ReplicaId("r-2"), phase="queued", queue_position=1,
                           waiting_for=[ReplicaId("r-9")])
    views: list[dict[str, Any]] = [
        _deployment("starting", [_replica("starting", fetching)]).model_dump(mode="json"),
        _deployment("starting", [_replica("starting", queued, "r-2")]).model_dump(
            mode="json")]
    text = _ls_text(argparse.Namespace(), views)
    first, second = text.splitlines()[1:]
    assert "starting" in first
    assert "r-1 downloading 1.0 MiB of 4.0 MiB (25.0 %), 1.0 MiB/s on n1" in first
    assert " queued " in second
    assert "r-2 queued 1st in line at n1's start-up gate, waiting for r-9 to load" in second


def test_a_failed_start_names_its_last_log_line_and_where_the_log_is() -> None:
    where = "full log: /d/logs/r-1.log on node n1, or `modelkeeper logs r-1`"
    assert failure_detail("exited with code 2", ["usage: sim", "error: bad --x", ""],
                                log_path="/d/logs/r-1.log", node="n1",
                                replica_id="r-1") == (
        f"exited with code 2; last log line: 'error: bad --x'; {where}")
    # A known cause in the log is named already (exit_detail): the last line is not added.
    oom = ["torch.OutOfMemoryError: CUDA out of memory", "bye"]
    assert failure_detail("exited with code 1: the GPU ran out of memory", oom,
                                log_path="/d/logs/r-1.log", node="n1",
                                replica_id="r-1") == (
        f"exited with code 1: the GPU ran out of memory; {where}")
    assert failure_detail("exited with code 1", [], log_path="/d/logs/r-1.log",
                                node="n1", replica_id="r-1") == f"exited with code 1; {where}"


def test_the_web_ui_details_say_where_a_start_shows_its_progress() -> None:
    k = serving_one()
    assert "Start progress" not in details(k.state)
    k.step(Scale(replicas=2))
    assert any(r.phase is Phase.PLACING for r in k.state.replicas)
    k.step(Placed(replica_id=k.state.replicas[-1].replica_id, nodes=[NodeId("b")]))
    text = details(k.state)
    assert "| starting |" in text
    assert "Start progress (download, place in the node's start-up queue): " in text


def test_logs_follow_asks_from_the_last_end_and_ctrl_c_ends_it_cleanly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(operator_cli, "FOLLOW_INTERVAL_S", 0.0)
    asked: list[dict[str, str]] = []
    chunks = [(["one", "two"], 8), ([], 8), (["three"], 14)]

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/replicas/d-1-r1/logs"
        asked.append(dict(request.url.params))
        if len(asked) > len(chunks):
            raise KeyboardInterrupt  # the operator's Ctrl-C, during a read
        lines, end = chunks[len(asked) - 1]
        return httpx.Response(200, json={
            "replica_id": "d-1-r1", "node_id": "n1", "log_path": "/x.log", "lines": lines,
            "start_offset": 0, "end_offset": end, "size": end, "truncated": False,
            "restarted": False})

    printed: list[str] = []
    args = build_parser().parse_args(["logs", "d-1-r1", "--follow", "--tail", "2"])
    assert operator_cli.run_operator_command(args, "http://api", printed.append,
                                             transport=httpx.MockTransport(handler)) == 0
    assert printed == ["one\ntwo", "three"]
    assert asked[0] == {"tail": "2", "rank": "0"}
    assert [a.get("after") for a in asked[1:]] == ["8", "8", "14"]


def test_logs_bounds_are_the_users_mistake() -> None:
    args = build_parser().parse_args(["logs", "d-1-r1", "--tail", "5001"])
    with pytest.raises(operator_cli.UsageError, match="logs --tail 5001: give 0 to 5000"):
        operator_cli.run_operator_command(args, "http://api", print)


def test_a_heartbeat_carries_starts_only_when_there_are_some() -> None:
    from agent.main import _heartbeat_json
    from modelkeeper.domain.nodes import AgentHeartbeat, Inventory

    quiet = _heartbeat_json(AgentHeartbeat(inventory=Inventory()))
    # Absent: an API older than progress (AgentHeartbeat is strict there) takes it.
    assert "starts" not in quiet
    busy = _heartbeat_json(AgentHeartbeat(inventory=Inventory(), starts=[StartProgress(
        replica_id=ReplicaId("r-1"), phase="fetching", bytes_done=1, bytes_total=2)]))
    assert busy["starts"] == [{
        "replica_id": "r-1", "rank": 0, "phase": "fetching", "bytes_done": 1,
        "bytes_total": 2, "rate_bytes_per_s": None, "queue_position": None,
        "waiting_for": []}]
    # The API reads it back as it was sent.
    assert AgentHeartbeat.model_validate(busy).starts[0].bytes_total == 2


def test_ctrl_c_before_a_follows_first_answer_ends_it_quietly() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise KeyboardInterrupt

    args = build_parser().parse_args(["logs", "d-1-r1", "--follow"])
    assert operator_cli.run_operator_command(args, "http://api", print,
                                             transport=httpx.MockTransport(handler)) == 0
