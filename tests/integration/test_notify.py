"""Notifications against a real Temporal dev server, PostgreSQL and a webhook receiver on a
free port (docs/operations.md, "Notifications").

The acceptance test: a notice whose first delivery is held by the receiver survives a
``kill -9`` of the control worker, is delivered once by the next worker, and the same
condition seen again within the hour is not sent again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from temporalio.client import Client, WorkflowFailureError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.notify import NotifyActivities
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.notify import (
    HEADER_IDEMPOTENCY_KEY,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    CantPlaceWatchInput,
    Notice,
    NoticeKind,
    notice_workflow_id,
    verify,
)
from modelkeeper.infra.notify import start_notice
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.names import CONTROL_TASK_QUEUE, cant_place_watch_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from workflows.notify import CantPlaceWatch, NotifyWorkflow

SECRET = "test-notify-secret"


@dataclass
class Receiver:
    """A webhook receiver that checks signatures, counts deliveries by idempotency key,
    and, while ``hold_first``, holds the first request it gets until ``release``."""

    secret: str
    hold_first: bool = False
    #: Refuse every request with this status (a wrong URL's 404).
    refuse_with: int | None = None
    arrived: list[dict[str, object]] = field(default_factory=list)
    delivered: dict[str, int] = field(default_factory=dict)
    first_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        key = request.headers.get(HEADER_IDEMPOTENCY_KEY, "")
        problem = verify(self.secret, timestamp=request.headers.get(HEADER_TIMESTAMP, ""),
                         body=body, signed=request.headers.get(HEADER_SIGNATURE, ""),
                         now=time.time())
        self.arrived.append({"key": key, "problem": problem, "body": json.loads(body),
                             "path": request.path})
        if self.hold_first and not self.first_arrived.is_set():
            self.first_arrived.set()
            await self.release.wait()  # the worker is killed meanwhile
            return web.Response(status=503)
        if self.refuse_with is not None:
            return web.Response(status=self.refuse_with, text="no such hook")
        if problem is not None and request.path != "/slack":
            return web.Response(status=401, text=problem)
        self.delivered[key] = self.delivered.get(key, 0) + 1
        return web.Response(status=200, text="ok")


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    recv = Receiver(SECRET)
    app = web.Application()
    app.router.add_post("/hook", recv.handle)
    app.router.add_post("/slack", recv.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield recv, f"http://127.0.0.1:{port}"
    finally:
        recv.release.set()
        await runner.cleanup()


async def until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        await asyncio.sleep(0.05)


def _secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "notify-secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def _notice(kind: NoticeKind = NoticeKind.PARKED, subject: str | None = None) -> Notice:
    return Notice(kind=kind, subject=subject or f"d-{uuid.uuid4().hex[:8]}",
                  message="parked after 5 failed start(s) in a row", at=datetime.now(UTC),
                  data={"consecutive_failures": 5})


def _worker(tmp_path: Path, name: str, client: Client, database_url: str,
            env: dict[str, str]) -> ManagedProcess:
    return ManagedProcess(
        name, [sys.executable, "-m", "modelkeeper", "worker"], tmp_path / f"{name}.log",
        env={**os.environ, "MODELKEEPER_DATABASE_URL": database_url,
             "TEMPORAL_ADDRESS": client.service_client.config.target_host,
             "TEMPORAL_NAMESPACE": client.namespace,
             "MODELKEEPER_DATA_DIR": str(tmp_path / "data"), **env})


@pytest.mark.slow
@pytest.mark.long
async def test_a_notice_survives_a_kill_9_of_the_worker_and_is_delivered_once(
        local_temporal_env: WorkflowEnvironment, database_url: str, tmp_path: Path,
        receiver: tuple[Receiver, str]) -> None:
    recv, base = receiver
    recv.hold_first = True
    client = local_temporal_env.client
    env = {"MODELKEEPER_NOTIFY_WEBHOOK_URLS": f"{base}/hook",
           "MODELKEEPER_NOTIFY_SECRET_FILE": str(_secret_file(tmp_path))}
    settings = Settings(notify_webhook_urls=[f"{base}/hook"],
                        notify_secret_file=Path(env["MODELKEEPER_NOTIFY_SECRET_FILE"]))
    first = _worker(tmp_path, "worker-1", client, database_url, env)
    second = _worker(tmp_path, "worker-2", client, database_url, env)
    notice = _notice()
    workflow_id = notice_workflow_id(notice)
    try:
        first.start()
        assert await start_notice(client, notice, settings)
        # The first delivery reaches the receiver, which holds it unanswered...
        await asyncio.wait_for(recv.first_arrived.wait(), 60)
        # ... while the worker that sent it dies without a word.
        os.killpg(first.pid, signal.SIGKILL)
        assert first.popen is not None
        first.popen.wait(10)
        recv.release.set()
        # The same condition seen again within the hour is not started again.
        assert not await start_notice(client, notice.model_copy(
            update={"message": "seen again"}), settings)
        second.start()
        result = await asyncio.wait_for(client.get_workflow_handle(workflow_id).result(), 90)
    finally:
        first.stop()
        second.stop()
    key = f"{workflow_id}/webhook-1"
    assert result == f"{notice.kind.value} {notice.subject} delivered to webhook-1"
    # Two attempts (the held one and the retry), one idempotency key, one delivery.
    assert [a["key"] for a in recv.arrived] == [key, key]
    assert all(a["problem"] is None for a in recv.arrived), recv.arrived
    assert recv.delivered == {key: 1}
    body = recv.arrived[-1]["body"]
    assert isinstance(body, dict)
    assert (body["kind"], body["subject"], body["id"]) == (
        "deployment.parked", notice.subject, key)
    # After the delivery too: still the same hour, still not sent again.
    assert not await start_notice(client, notice, settings)
    assert len(recv.arrived) == 2


async def test_each_target_gets_its_shape_and_a_refusal_is_not_retried(
        local_temporal_env: WorkflowEnvironment, store: Store, tmp_path: Path,
        receiver: tuple[Receiver, str]) -> None:
    """In-process worker: a webhook gets signed JSON, a Slack target ``{"text": ...}``;
    a 404 fails the notice at once (no retries for hours), naming the target."""
    recv, base = receiver
    client = local_temporal_env.client
    settings = Settings(notify_webhook_urls=[f"{base}/hook"],
                        notify_slack_urls=[f"{base}/slack"],
                        notify_secret_file=_secret_file(tmp_path))
    async with Worker(client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[NotifyWorkflow, CantPlaceWatch],
                      activities=NotifyActivities(settings, store, client).all()):
        notice = _notice(NoticeKind.NODE_SILENT, "node-a")
        assert await start_notice(client, notice, settings)
        result = await client.get_workflow_handle(notice_workflow_id(notice)).result()
        assert result == "node.silent node-a delivered to webhook-1, slack-1"
        by_path = {a["path"]: a for a in recv.arrived}
        assert by_path["/slack"]["body"] == {
            "text": "[modelkeeper] node.silent node-a: parked after 5 failed start(s) in a "
                    "row"}
        assert by_path["/hook"]["problem"] is None

        recv.refuse_with = 404
        refused = _notice(NoticeKind.QUOTA_AT_LIMIT, "acme/memory")
        started = time.monotonic()
        assert await start_notice(client, refused, settings)
        with pytest.raises(WorkflowFailureError) as failed:
            await client.get_workflow_handle(notice_workflow_id(refused)).result()
        assert time.monotonic() - started < 10  # the 404 is final, not retried
        message = str(failed.value.cause)
        assert "webhook-1: refused: webhook-1: HTTP 404 no such hook" in message, message
        assert "slack-1: refused" in message, message


async def test_cant_place_is_notified_only_after_it_lasted(
        time_skipping_env: WorkflowEnvironment, store: Store, tmp_path: Path,
        receiver: tuple[Receiver, str]) -> None:
    """The watch sleeps (a durable timer, skipped here) until the stretch is
    notify_cant_place_after_s old, then notifies if it still is; a deployment placeable
    again meanwhile is not notified."""
    recv, base = receiver
    client = time_skipping_env.client
    settings = Settings(notify_webhook_urls=[f"{base}/hook"],
                        notify_secret_file=_secret_file(tmp_path))

    async def status(deployment_id: str, value: str) -> None:
        await store.events.record_event(NewEvent(
            kind=f"deployment.{value}", deployment_id=deployment_id, message=value))

    async with Worker(client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[NotifyWorkflow, CantPlaceWatch],
                      activities=NotifyActivities(settings, store, client).all()):
        await status("d-stuck", "placing")
        await status("d-stuck", "cant_place")
        stuck = await client.execute_workflow(
            CantPlaceWatch.run, CantPlaceWatchInput(deployment_id="d-stuck", after_s=0.5),
            id=cant_place_watch_id("d-stuck"), task_queue=CONTROL_TASK_QUEUE,
            execution_timeout=timedelta(seconds=60))
        assert stuck.startswith("cant_place for 0 min") and stuck.endswith("(sent)"), stuck
        await until(lambda: len(recv.delivered) == 1, "the cant_place notice delivered")
        body = recv.arrived[0]["body"]
        assert isinstance(body, dict)
        assert (body["kind"], body["subject"]) == ("deployment.cant_place", "d-stuck")

        await status("d-fine", "cant_place")
        handle = await client.start_workflow(
            CantPlaceWatch.run, CantPlaceWatchInput(deployment_id="d-fine", after_s=3600),
            id=cant_place_watch_id("d-fine"), task_queue=CONTROL_TASK_QUEUE)
        await status("d-fine", "serving")
        assert await handle.result() == "d-fine is placeable again (or gone)"
    assert len(recv.arrived) == 1


async def test_the_store_finds_when_the_unplaceable_stretch_began(store: Store) -> None:
    async def status(value: str) -> datetime:
        return (await store.events.record_event(NewEvent(
            kind=f"deployment.{value}", deployment_id="d-1", message=value))).at

    assert (await store.events.cant_place_since("d-1")).since is None
    await status("placing")
    began = await status("cant_place")
    await status("cant_place")  # a new reason, the same stretch
    seen = await store.events.cant_place_since("d-1")
    assert seen.since == began and seen.now >= began
    await status("starting")
    assert (await store.events.cant_place_since("d-1")).since is None
    again = await status("cant_place")
    assert (await store.events.cant_place_since("d-1")).since == again
    await store.events.record_event(NewEvent(kind="deployment.deleted", deployment_id="d-1",
                                             message="deleted"))
    assert (await store.events.cant_place_since("d-1")).since is None
