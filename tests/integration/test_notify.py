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
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from aiohttp import web
from fastapi import Request
from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from activities.notify import NotifyActivities
from activities.operations import OperationsActivities
from activities.store import StoreActivities
from api.app import create_app
from api.liveness import on_silent
from api.quotas import QuotaExceeded, quota_exceeded
from api.watchdog import watch_memory
from modelkeeper.domain.capacity import LimitBreach
from modelkeeper.domain.catalog import DeploymentStatusUpdate
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import DeploymentId, NodeId, OperationId
from modelkeeper.domain.nodes import AgentHeartbeat, AgentRegistration, Inventory
from modelkeeper.domain.notify import (
    HEADER_IDEMPOTENCY_KEY,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    CantPlaceWatchInput,
    Notice,
    NoticeKind,
    notice_workflow_id,
    quota_notice,
    verify,
)
from modelkeeper.domain.operations import OperationKind, OperationRecord, OperationState
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.watchdog import MemoryLevel, MemoryReport
from modelkeeper.infra.notify import start_notice
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.names import CONTROL_TASK_QUEUE, cant_place_watch_id
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from tests.workflows.test_deployment_workflow import record_history
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
        delivered_run = client.get_workflow_handle(notice_workflow_id(notice))
        result = await delivered_run.result()
        assert result == "node.silent node-a delivered to webhook-1, slack-1"
        await record_history(delivered_run, "notify_delivered")
        by_path = {a["path"]: a for a in recv.arrived}
        assert by_path["/slack"]["body"] == {
            "text": "[modelkeeper] node.silent node-a: parked after 5 failed start(s) in a "
                    "row"}
        assert by_path["/hook"]["problem"] is None

        recv.refuse_with = 404
        refused = _notice(NoticeKind.QUOTA_AT_LIMIT, "acme/memory")
        started = time.monotonic()
        assert await start_notice(client, refused, settings)
        refused_run = client.get_workflow_handle(notice_workflow_id(refused))
        with pytest.raises(WorkflowFailureError) as failed:
            await refused_run.result()
        await record_history(refused_run, "notify_refused")
        assert time.monotonic() - started < 10  # the 404 is final, not retried
        message = str(failed.value.cause)
        assert "webhook-1: refused: webhook-1: HTTP 404 no such hook" in message, message
        assert "slack-1: refused" in message, message


async def test_cant_place_is_notified_only_after_it_lasted(
        local_temporal_env: WorkflowEnvironment, store: Store, tmp_path: Path,
        receiver: tuple[Receiver, str]) -> None:
    """The watch sleeps (a durable timer, in real time: the stretch is measured by the
    database's clock) until the stretch is notify_cant_place_after_s old, then notifies
    if it still is; a deployment placeable again meanwhile is not notified."""
    recv, base = receiver
    client = local_temporal_env.client
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
        stuck_run = await client.start_workflow(
            CantPlaceWatch.run, CantPlaceWatchInput(deployment_id="d-stuck", after_s=1.0),
            id=cant_place_watch_id("d-stuck"), task_queue=CONTROL_TASK_QUEUE,
            execution_timeout=timedelta(seconds=60))
        stuck = await stuck_run.result()
        await record_history(stuck_run, "cant_place_watch_sent")
        assert stuck.startswith("cant_place for 0 min") and stuck.endswith("(sent)"), stuck
        await until(lambda: len(recv.delivered) == 1, "the cant_place notice delivered")
        body = recv.arrived[0]["body"]
        assert isinstance(body, dict)
        assert (body["kind"], body["subject"]) == ("deployment.cant_place", "d-stuck")

        await status("d-fine", "cant_place")
        handle = await client.start_workflow(
            CantPlaceWatch.run, CantPlaceWatchInput(deployment_id="d-fine", after_s=1.0),
            id=cant_place_watch_id("d-fine"), task_queue=CONTROL_TASK_QUEUE)
        await status("d-fine", "serving")
        assert await handle.result() == "d-fine is placeable again (or gone)"
        await record_history(handle, "cant_place_watch_recovered")
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


async def test_notify_test_answers_each_target_and_is_audited(
        local_temporal_env: WorkflowEnvironment, database_url: str, store: Store,
        tmp_path: Path, receiver: tuple[Receiver, str]) -> None:
    """POST /notify/test sends at once (no workflow), answers each target, records an
    audit event; with no target, a 409 that names the settings."""
    recv, base = receiver
    client = local_temporal_env.client
    common: dict[str, Any] = {"database_url": database_url, "api_auth": False,
              "temporal_address": client.service_client.config.target_host,
              "temporal_namespace": client.namespace}
    app = create_app(Settings(**common, notify_webhook_urls=[f"{base}/hook"],
                              notify_slack_urls=[f"{base}/missing"],
                              notify_secret_file=_secret_file(tmp_path)))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
        resp = await http.post("/notify/test")
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert [(r["target"], r["format"], r["delivered"], r["status"]) for r in results] == [
        ("webhook-1", "webhook", True, 200), ("slack-1", "slack", False, 404)]
    assert recv.arrived[0]["problem"] is None
    body = recv.arrived[0]["body"]
    assert isinstance(body, dict) and body["kind"] == "notify.test"
    events = [e for e in await store.events.list_events() if e.kind == "notify.test"]
    assert [e.message for e in events] == [
        "test notification: webhook-1 delivered; slack-1 failed"]

    bare = create_app(Settings(**common))
    async with bare.router.lifespan_context(bare), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=bare), base_url="http://localhost") as http:
        resp = await http.post("/notify/test")
    assert resp.status_code == 409
    assert "MODELKEEPER_NOTIFY_WEBHOOK_URLS" in resp.json()["detail"]


async def _started(client: Client, prefix: str) -> str:
    """The workflow id under ``prefix`` for this hour or the last (a test that straddles
    an hour), as the server describes it."""
    now = datetime.now(UTC)
    for at in (now, now - timedelta(hours=1)):
        workflow_id = f"{prefix}/{at:%Y%m%d%H}"
        try:
            await client.get_workflow_handle(workflow_id).describe()
        except RPCError:
            continue
        return workflow_id
    raise AssertionError(f"no workflow {prefix}/<this hour>")


async def test_the_keeper_and_the_sagas_start_their_notices(
        local_temporal_env: WorkflowEnvironment, store: Store, tmp_path: Path) -> None:
    """Where the conditions are recorded: the keeper's status activity starts a parked
    notice and a cant_place watch; a saga's record of rollback_incomplete its notice.
    No worker runs: they wait in Temporal's queue, which is what survives a crash."""
    client = local_temporal_env.client
    settings = Settings(notify_webhook_urls=["http://127.0.0.1:9/hook"],
                        notify_secret_file=_secret_file(tmp_path))
    keeper = StoreActivities(store, settings, client)

    def update(deployment_id: str, status: DeploymentStatus) -> DeploymentStatusUpdate:
        return DeploymentStatusUpdate(deployment_id=deployment_id, status=status,
                                      placement_error="no node has 64 GiB free",
                                      consecutive_failures=5, last_failure="exit 1",
                                      desired_replicas=1)

    await ActivityEnvironment().run(keeper.record_deployment_status,
                                    update("d-parked", DeploymentStatus.PARKED))
    await ActivityEnvironment().run(keeper.record_deployment_status,
                                    update("d-stuck", DeploymentStatus.CANT_PLACE))
    await ActivityEnvironment().run(keeper.record_deployment_status,
                                    update("d-fine", DeploymentStatus.SERVING))
    sagas = OperationsActivities(store, client, settings)
    await ActivityEnvironment().run(sagas.record_operation, OperationRecord(
        operation_id=OperationId("switch/d-s/1"), kind=OperationKind.SWITCH,
        deployment_id=DeploymentId("d-s"), state=OperationState.ROLLBACK_INCOMPLETE,
        error="replica r-1 could not be restored: node a is gone"))

    parked = await client.get_workflow_handle(
        await _started(client, "notify/deployment.parked/d-parked")).describe()
    assert parked.workflow_type == "Notify"
    watch = await client.get_workflow_handle(cant_place_watch_id("d-stuck")).describe()
    assert watch.workflow_type == "CantPlaceWatch"
    await _started(client, "notify/operation.rollback_incomplete/switch/d-s/1")
    with pytest.raises(RPCError):
        await client.get_workflow_handle(cant_place_watch_id("d-fine")).describe()


async def test_a_quota_refusal_starts_its_notice_once_an_hour(
        local_temporal_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """The API's 409 for a limit passed also starts a quota.at_limit notice, per scope and
    part; a second refusal within the hour starts none (the answer is the same 409)."""
    client = local_temporal_env.client
    settings = Settings(notify_webhook_urls=["http://127.0.0.1:9/hook"],
                        notify_secret_file=_secret_file(tmp_path))
    request = cast(Request, SimpleNamespace(app=SimpleNamespace(
        state=SimpleNamespace(temporal=client, settings=settings))))
    breach = QuotaExceeded(LimitBreach(scope="acme/a", part="memory", held=16 << 30,
                                       asked=16 << 30, limit=24 << 30))
    for _ in range(2):
        resp = await quota_exceeded(request, breach)
        assert resp.status_code == 409
    await _started(client, "notify/quota.at_limit/acme/a/memory")
    # The hour's id is taken: the same refusal again starts nothing.
    assert not await start_notice(client, quota_notice(
        "acme/a", "memory", "again", {}, now=datetime.now(UTC)), settings)


async def test_the_api_notifies_a_critical_node_and_a_node_gone_silent(
        local_temporal_env: WorkflowEnvironment, store: Store, tmp_path: Path) -> None:
    """The heartbeat's watchdog (on the change to critical) and the liveness verdict start
    their notices; a node that stays critical starts no more."""
    client = local_temporal_env.client
    settings = Settings(notify_webhook_urls=["http://127.0.0.1:9/hook"],
                        notify_secret_file=_secret_file(tmp_path))
    node = NodeId("n-1")
    await store.nodes.register_node(AgentRegistration(
        node_id=node, name="box", inventory=Inventory(
            memory_total_bytes=64 << 30, memory_available_bytes=1 << 30, cpu_count=2)))
    beat = AgentHeartbeat(inventory=Inventory(), memory=MemoryReport(
        level=MemoryLevel.CRITICAL, available_bytes=1 << 30, margin_bytes=8 << 30,
        reason="1.0 GiB available, below the 8.0 GiB margin"))
    await watch_memory(node, beat, store=store, temporal=client, settings=settings,
                       now=datetime.now(UTC))
    critical = await client.get_workflow_handle(
        await _started(client, "notify/node.memory_critical/n-1")).describe()
    assert critical.workflow_type == "Notify"
    await on_silent(node, "no ping for 1.5 s", store=store, temporal=client,
                    settings=settings)
    await _started(client, "notify/node.silent/n-1")
