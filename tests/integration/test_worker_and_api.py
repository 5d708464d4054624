"""The control worker and the API against a real Temporal dev server and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import httpx
import pytest
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from api.app import create_app
from modelkeeper.names import CONTROL_TASK_QUEUE
from modelkeeper.settings import Settings
from worker.main import run_worker

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.events import Event, NewEvent

pytestmark = pytest.mark.timeout(90)


@workflow.defn(sandboxed=False)  # test-only; the module imports httpx
class RecordViaControlWorker:
    """Runs on a test queue and sends its activity to the control worker's queue."""

    @workflow.run
    async def run(self, event: NewEvent) -> Event:
        result: Event = await workflow.execute_activity(
            "record_event", event, result_type=Event, task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=20))
        return result


async def test_worker_runs_store_activities_and_api_sees_them(
    local_temporal_env: WorkflowEnvironment, database_url: str,
) -> None:
    client = local_temporal_env.client
    settings = Settings(database_url=database_url,
                        temporal_address=client.service_client.config.target_host,
                        temporal_namespace=client.namespace, api_auth=False)
    stop = asyncio.Event()
    worker_task = asyncio.create_task(run_worker(settings, stop))
    app = create_app(settings)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost",
        ) as http:
            # Readiness, not a sleep: poll until the worker's pollers are visible.
            for _ in range(400):
                health = (await http.get("/healthz")).json()
                if health["control_workers"] >= 1:
                    break
                await asyncio.sleep(0.05)
            assert health["status"] == "ok"
            assert (health["database"], health["temporal"], health["control_workers"]) == (
                True, True, 1)

            test_queue = f"test-{uuid.uuid4()}"
            async with Worker(client, task_queue=test_queue,
                              workflows=[RecordViaControlWorker]):
                event = await client.execute_workflow(
                    RecordViaControlWorker.run,
                    NewEvent(kind="probe", message="through temporal"),
                    id=f"probe-{uuid.uuid4()}", task_queue=test_queue,
                )
            assert event.message == "through temporal"
            events = (await http.get("/events")).json()
            assert [(e["event_id"], e["kind"]) for e in events] == [(event.event_id, "probe")]
    finally:
        stop.set()
        await asyncio.wait_for(worker_task, 30)
