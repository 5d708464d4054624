"""Replay recorded histories of the notification workflows against today's code: a change
that would break a notice in flight fails here (it must be versioned with
workflow.patched).

Recorded by tests/integration/test_notify.py with MODELKEEPER_RECORD_HISTORIES=1: a
notice delivered to a webhook and a Slack target, one refused for good, and a cant_place
watch that sent its notice and one that found the deployment placeable again."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.notify import CantPlaceWatch, NotifyWorkflow

pytestmark = pytest.mark.timeout(60)

HISTORIES = sorted([
    *(Path(__file__).resolve().parents[1] / "histories").glob("notify_*.json"),
    *(Path(__file__).resolve().parents[1] / "histories").glob("cant_place_watch_*.json")])


def test_each_path_has_a_history() -> None:
    assert {p.stem for p in HISTORIES} == {
        "notify_delivered", "notify_refused", "cant_place_watch_sent",
        "cant_place_watch_recovered"}


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_replay(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[NotifyWorkflow, CantPlaceWatch],
                        data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
