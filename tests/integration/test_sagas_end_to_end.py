"""Sagas end to end, as an operator runs them: a real stack (PostgreSQL, Temporal, the
control worker, the API, the gateway, three agents with sim engines), four clients
sending requests through the gateway the whole time, and the saga asked for through the
API. The scenarios are bench/sagas/run.py's (its --quick set); the full set and its
figures are in bench/results/sagas.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sagas.run import run_one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_rolling_restart_under_load_fails_no_request(tmp_path: Path) -> None:
    result = await run_one("restart", tmp_path)
    assert result.operation["state"] == "succeeded", result.operation
    assert result.sent > 100 and result.failed == {}, result.failed
    # Both replicas end on the new generation, and the claims match the live replicas.
    assert result.checks["generations"] == [1, 1], result.checks
    assert result.checks["claims"]["match"], result.checks
    assert len(result.replacements_s) == 2


async def test_a_switch_to_a_model_that_crashes_rolls_back_and_fails_no_request(
    tmp_path: Path,
) -> None:
    result = await run_one("switch-rollback", tmp_path)
    assert result.operation["state"] == "rolled_back", result.operation
    assert "sim-bad" in (result.operation.get("error") or ""), result.operation
    assert result.checks["serving_after"] is True
    assert result.sent > 100 and result.failed == {}, result.failed
    assert result.checks["claims"]["match"], result.checks
