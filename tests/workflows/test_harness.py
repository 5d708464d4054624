"""The time-skipping harness itself: durable timers are skipped, activities faked by name."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.events import Event, NewEvent

pytestmark = pytest.mark.timeout(60)


@workflow.defn(sandboxed=True)
class SleepThenRecord:
    @workflow.run
    async def run(self, event: NewEvent) -> Event:
        await workflow.sleep(timedelta(hours=1))
        result: Event = await workflow.execute_activity(
            "record_event", event, result_type=Event,
            start_to_close_timeout=timedelta(seconds=10))
        return result


async def test_an_hour_of_workflow_time_passes_in_seconds(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    recorded: list[NewEvent] = []

    @activity.defn(name="record_event")
    async def fake_record_event(event: NewEvent) -> Event:
        recorded.append(event)
        return Event(**event.model_dump(), event_id=7, at=activity.info().started_time)

    queue = f"harness-{uuid.uuid4()}"
    async with Worker(time_skipping_env.client, task_queue=queue,
                      workflows=[SleepThenRecord], activities=[fake_record_event]):
        started = time.monotonic()
        result = await time_skipping_env.client.execute_workflow(
            SleepThenRecord.run, NewEvent(kind="probe", message="hello"),
            id=f"wf-{uuid.uuid4()}", task_queue=queue)
        assert time.monotonic() - started < 30
    assert result.event_id == 7 and result.message == "hello"
    assert [e.kind for e in recorded] == ["probe"]
