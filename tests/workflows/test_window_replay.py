"""Replay recorded histories of WindowWorkflow against today's code: a change that would
break a window's run in flight fails here (it must be versioned with workflow.patched).

Recorded by tests/workflows/test_window.py with MODELKEEPER_RECORD_HISTORIES=1: an open,
a close, and a firing that found its deployment gone and removed its schedules."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.window import WindowWorkflow

pytestmark = pytest.mark.timeout(60)

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("window_*.json"))


def test_each_path_has_a_history() -> None:
    assert {p.stem for p in HISTORIES} == {"window_open", "window_close", "window_gone"}


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_replay(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[WindowWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
