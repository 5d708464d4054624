"""Replay recorded histories of the saga workflows against today's code: a change that
would break a saga in flight fails here (it must be versioned with workflow.patched).

Recorded by tests/workflows/test_sagas.py with MODELKEEPER_RECORD_HISTORIES=1: per saga a
happy path and a compensation (restart: a replacement that fails and is cancelled; drain:
no room elsewhere, retired at the deadline, and a cancel that uncordons; switch: B crashing
at start, rolled back, and a cancel that rolls back a completed replace). Issue 24's patches
(docs/keeper.md, "Patches in 0.3"): ``*_completes`` a failed restart and a rolled-back
switch completing with their record, ``saga_drain_beside_restart`` a drain judging by its
node; the histories recorded before them replay the old paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.drain import DrainSaga
from workflows.restart import RestartSaga
from workflows.switch import SwitchSaga

pytestmark = pytest.mark.timeout(60)

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("saga_*.json"))


def test_each_saga_has_histories() -> None:
    names = {p.stem for p in HISTORIES}
    for saga in ("restart", "drain", "switch"):
        assert {n for n in names if n.startswith(f"saga_{saga}")} - {f"saga_{saga}"}, (
            f"record a happy path and a compensation of {saga}: "
            "MODELKEEPER_RECORD_HISTORIES=1 pytest tests/workflows/test_sagas.py")
        assert f"saga_{saga}" in names


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_replay(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[RestartSaga, DrainSaga, SwitchSaga],
                        data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
