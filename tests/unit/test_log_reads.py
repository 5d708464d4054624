"""An engine's log read for `modelkeeper logs`: whole lines, bounded, scrubbed, and a
follow that picks up where it left (modelkeeper.domain.log_reads, agent.log_reader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.log_reader import NoEngineLog, read_engine_log
from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.log_reads import EngineLogRequest, cut, valid_replica_id

NODE = NodeId("n1")
KEY = "mk-" + "a1" * 20


def _ask(tail: int = 100, after: int | None = None) -> EngineLogRequest:
    return EngineLogRequest(replica_id=ReplicaId("d-1-r1"), tail=tail, after=after)


def _log(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "d-1-r1.log"
    path.write_text(text)
    return path


def test_cut_keeps_whole_lines() -> None:
    assert cut(b"a\nb\nc", at_start=True, complete=True) == (["a", "b", "c"], 0, 5)
    # Not at the end of what is written: the partial last line waits.
    assert cut(b"a\nb\nc", at_start=True, complete=False) == (["a", "b"], 0, 4)
    # Not at a line's start: its first, partial line is dropped.
    assert cut(b"xx\nb\n", at_start=False, complete=True) == (["b"], 3, 5)
    assert cut(b"xxx", at_start=False, complete=False) == ([], 3, 3)


def test_tail_is_the_last_lines_scrubbed(tmp_path: Path) -> None:
    _log(tmp_path, "".join(f"line {i}\n" for i in range(10)) + f"key {KEY}\n")
    chunk = read_engine_log(tmp_path, NODE, _ask(tail=3))
    assert chunk.lines == ["line 8", "line 9", "key mk-<redacted>"]
    assert chunk.truncated and not chunk.restarted
    assert chunk.end_offset == chunk.size and chunk.log_path == str(tmp_path / "d-1-r1.log")
    assert read_engine_log(tmp_path, NODE, _ask(tail=0)).lines == []


def test_a_tail_reads_at_most_max_bytes(tmp_path: Path) -> None:
    _log(tmp_path, "".join(f"{i:04d}\n" for i in range(1000)))  # 5 bytes a line
    chunk = read_engine_log(tmp_path, NODE, _ask(tail=5000), max_bytes=52)
    # 52 bytes from the end: a partial line dropped, then ten whole lines.
    assert chunk.lines == [f"{i:04d}" for i in range(990, 1000)] and chunk.truncated


def test_a_follow_reads_what_was_written_since(tmp_path: Path) -> None:
    path = _log(tmp_path, "one\ntwo\n")
    first = read_engine_log(tmp_path, NODE, _ask(tail=1))
    assert first.lines == ["two"]
    with path.open("a") as f:
        f.write("three\nfou")  # a line still being written
    second = read_engine_log(tmp_path, NODE, _ask(after=first.end_offset))
    assert second.lines == ["three"]
    with path.open("a") as f:
        f.write("r\n")
    third = read_engine_log(tmp_path, NODE, _ask(after=second.end_offset))
    assert third.lines == ["four"]
    assert read_engine_log(tmp_path, NODE, _ask(after=third.end_offset)).lines == []
    # A new log (the engine launched again, shorter than where the follow was): from
    # its beginning, said so.
    path.write_text("fresh\n")
    again = read_engine_log(tmp_path, NODE, _ask(after=third.end_offset))
    assert again.restarted and again.lines == ["fresh"]


def test_no_log_and_no_path_through_the_replica_id(tmp_path: Path) -> None:
    with pytest.raises(NoEngineLog, match="no log for d-1-r1 on node n1"):
        read_engine_log(tmp_path, NODE, _ask())
    for bad in ("../secret", "a/b", ".hidden", "", "x" * 200):
        assert not valid_replica_id(bad)
        with pytest.raises(ValueError, match="cannot name a log file"):
            read_engine_log(tmp_path, NODE, EngineLogRequest(replica_id=ReplicaId(bad)))
    assert valid_replica_id("d-7ac70dfe6f-r1")


def test_a_follow_passes_a_line_longer_than_an_answer(tmp_path: Path) -> None:
    _log(tmp_path, "x" * 100)
    chunk = read_engine_log(tmp_path, NODE, _ask(after=0), max_bytes=40)
    assert chunk.lines == ["x" * 40] and chunk.end_offset == 40
