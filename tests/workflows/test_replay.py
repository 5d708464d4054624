"""Replay recorded histories against today's DeploymentWorkflow: a change that would break
running deployments fails here (it must be versioned with workflow.patched)."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.deployment import DeploymentWorkflow

pytestmark = pytest.mark.timeout(60)

#: The deployment workflow's histories; the sagas' (saga_*.json) replay in test_saga_replay,
#: the schedule windows' (window_*.json) in test_window_replay, the notices' (notify_*.json,
#: cant_place_watch_*.json) in test_notify_replay.
HISTORIES = sorted(p for p in (Path(__file__).resolve().parents[1] / "histories").glob("*.json")
                   if not p.name.startswith(("saga_", "window_", "notify_",
                                             "cant_place_watch_")))


def test_histories_are_committed() -> None:
    assert len(HISTORIES) >= 2, "record them: MODELKEEPER_RECORD_HISTORIES=1 pytest tests/workflows"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_replay(path: Path) -> None:
    history = WorkflowHistory.from_json(f"deployment/{path.stem}", path.read_text())
    replayer = Replayer(workflows=[DeploymentWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
