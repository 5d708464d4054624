"""Tracing on changes no workflow's commands: every recorded history (deployments, sagas,
schedule windows) replays with the Temporal SDK's OpenTelemetry interceptor as the worker
carries it while tracing is on, inside the default sandbox, and a replay makes no span.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from modelkeeper.infra import temporal, tracing
from modelkeeper.settings import Settings
from tests.support.otlp_receiver import OtlpReceiver, otlp_receiver
from worker.main import ALL_WORKFLOWS

pytestmark = pytest.mark.timeout(120)

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as collector:
        tracing.setup(Settings(otlp_endpoint=collector.url), service="modelkeeper-worker")
        try:
            yield collector
        finally:
            tracing.shutdown()


def _workflow_id(path: Path) -> str:
    # The deployment workflow's ids are deployment/<id>; the others replay under any.
    prefix = "" if path.name.startswith(("saga_", "window_")) else "deployment/"
    return prefix + path.stem


async def test_every_history_replays_with_the_tracing_interceptor(
        receiver: OtlpReceiver) -> None:
    assert len(HISTORIES) >= 30
    [carried] = temporal._tracing_interceptors()  # what a worker's client carries now
    assert isinstance(carried, TracingInterceptor)
    replayer = Replayer(workflows=ALL_WORKFLOWS, data_converter=pydantic_data_converter,
                        interceptors=[carried])
    failures = {}
    for path in HISTORIES:
        history = WorkflowHistory.from_json(_workflow_id(path), path.read_text())
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if result.replay_failure is not None:
            failures[path.name] = result.replay_failure
    assert failures == {}
    tracing.shutdown()
    assert receiver.received() == []
