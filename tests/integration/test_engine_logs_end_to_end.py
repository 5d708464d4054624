"""`modelkeeper logs` end to end: the real API (with operator tokens), worker, Temporal,
PostgreSQL and an agent process running a sim engine. The tail is read on the node through
the agent; a viewer token is refused (a log may hold prompts); --follow prints lines as
they are written, scrubbed of keys, and Ctrl-C ends it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from cli.main import build_parser
from cli.operator_cli import UsageError, run_operator_command
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.store.tokens import TokensStore
from tests.integration.test_keeper_end_to_end import Stack, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MIB = 1 << 20
#: A key of ours, as an engine's log could show one; it must never reach the operator.
LEAKED_KEY = "mk-" + "k3y" * 12


@pytest.fixture
async def stack(local_temporal_env: WorkflowEnvironment, database_url: str,
                tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(local_temporal_env, database_url, tmp_path)
    s.settings = s.settings.model_copy(update={"api_auth": True})
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def _tokens(database_url: str) -> tuple[str, str]:
    async with await TokensStore.connect(database_url) as tokens:
        _, admin = await tokens.create_token("ops", OperatorRole.ADMIN)
        _, viewer = await tokens.create_token("grafana", OperatorRole.VIEWER)
    return admin, viewer


async def _cli(stack: Stack, token: str, *argv: str) -> str:
    lines: list[str] = []
    args = build_parser().parse_args([*argv, "--api-url", stack.api_url])
    # In a thread: the CLI is synchronous, and the API runs on this test's event loop.
    assert await asyncio.to_thread(run_operator_command, args, stack.api_url, lines.append,
                                   token=token) == 0
    return "\n".join(lines)


async def _line(stream: asyncio.StreamReader, timeout: float = 30) -> str:
    return (await asyncio.wait_for(stream.readline(), timeout)).decode().rstrip("\n")


async def test_logs_tail_follow_and_a_viewer_refused(stack: Stack, tmp_path: Path) -> None:
    admin, viewer = await _tokens(stack.settings.database_url or "")
    stack.http.headers["Authorization"] = f"Bearer {admin}"
    stack.start_agent("n1", "8GiB")

    async def node_ready() -> bool:
        return any(n["state"] == "ready" for n in await stack.get("/nodes"))

    await until(node_ready)
    resp = await stack.http.post("/models", json={
        "model_id": "talky", "engine": "sim", "source": "sim", "memory_bytes": 64 * MIB,
        "engine_args": {"memory_bytes": MIB}})
    assert resp.status_code == 201, resp.text
    resp = await stack.http.post("/deployments", json={"model_id": "talky"})
    assert resp.status_code == 201, resp.text
    deployment_id = resp.json()["deployment_id"]

    async def serving() -> dict[str, Any] | None:
        view: dict[str, Any] = await stack.get(f"/deployments/{deployment_id}")
        return view if view["status"] == "serving" else None

    [replica] = (await until(serving, timeout=60))["replicas"]
    replica_id = replica["replica_id"]
    log_file = tmp_path / "n1" / "agent" / "logs" / f"{replica_id}.log"

    # The tail, read on the node: the file's last lines, as they are there.
    shown = await _cli(stack, admin, "logs", replica_id, "--tail", "3")
    written = [line for line in log_file.read_text().splitlines()][-3:]
    assert shown.splitlines() == written and written

    # What one read costs (a workflow and an activity on the node): printed, not bound.
    took = []
    for _ in range(10):
        started = time.monotonic()
        assert (await stack.http.get(f"/replicas/{replica_id}/logs?tail=100")).status_code == 200
        took.append(time.monotonic() - started)
    print(f"\nlogs read: median {statistics.median(took) * 1000:.0f} ms, "
          f"max {max(took) * 1000:.0f} ms over {len(took)}")

    # A viewer token reads deployments, never a log (it may hold prompts).
    resp = await stack.http.get(f"/replicas/{replica_id}/logs",
                                headers={"Authorization": f"Bearer {viewer}"})
    assert resp.status_code == 403
    assert "needs an admin token, since a log may hold prompts" in resp.json()["detail"]
    with pytest.raises(UsageError, match="needs an admin token"):
        await _cli(stack, viewer, "logs", replica_id)
    # Bounds: a tail past the limit is the user's mistake, named.
    with pytest.raises(UsageError, match=r"logs --tail 9999: give 0 to 5000 lines"):
        await _cli(stack, admin, "logs", replica_id, "--tail", "9999")
    resp = await stack.http.get("/replicas/no-such-replica/logs")
    assert resp.status_code == 404 and "is unknown" in resp.json()["detail"]

    # --follow prints what is written from now on, scrubbed, until Ctrl-C.
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modelkeeper", "logs", replica_id, "--follow", "--tail", "1",
        "--api-url", stack.api_url, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env={**os.environ, "MODELKEEPER_TOKEN": admin})
    assert follower.stdout is not None and follower.stderr is not None
    try:
        # A line of the log: the follow is on, from the end of the log as it was.
        assert await _line(follower.stdout) in log_file.read_text().splitlines()
        with log_file.open("a") as log:
            log.write(f"a line written after the follow began, key {LEAKED_KEY}\n")
            log.write("and another\n")
        # Lines the engine writes meanwhile may come between: read up to ours.
        printed = [await _line(follower.stdout)]
        while printed[-1] != "and another":
            printed.append(await _line(follower.stdout))
        assert "a line written after the follow began, key mk-<redacted>" in printed
        assert not any(LEAKED_KEY in line for line in printed)
        follower.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(follower.wait(), 30) == 0
        stderr = (await follower.stderr.read()).decode()
        assert "Traceback" not in stderr, stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(follower.pid, signal.SIGKILL)
