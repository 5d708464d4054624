"""Relaunch in place end to end: the real API and worker, real Temporal and PostgreSQL, a
real agent process and a sim engine. kill -9 of the engine's process group: the same
replica is served again on the same node and port, with no new placement, and the
replica and the audit log say it was relaunched and why."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from temporalio.testing import WorkflowEnvironment

from agent.engine_process import NODE_ENV, REPLICA_ENV

from .test_keeper_end_to_end import Stack, _assert_serves, _count_nodes, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GiB = 1 << 30
#: The sim's load: long enough that the relaunch's starting state is seen by a poll
#: every POLL_S, short enough for a test.
LOAD_TIME_S = 2.0
POLL_S = 0.05


@pytest.fixture
async def stack(local_temporal_env: WorkflowEnvironment, database_url: str,
                tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(local_temporal_env, database_url, tmp_path)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


def _engine_pids(node_id: str, replica_id: str) -> list[int]:
    """The engine processes the agent of ``node_id`` runs for ``replica_id`` (found by the
    markers every engine carries in its environment)."""
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get(NODE_ENV) == node_id and env.get(REPLICA_ENV) == replica_id:
            pids.append(proc.pid)
    return pids


async def test_kill_9_of_the_engine_is_relaunched_on_its_node_and_port_without_a_placement(
    stack: Stack,
) -> None:
    # The one setting the relaunch follows is its default: 3 tries in 600 s.
    assert (stack.settings.relaunch_tries, stack.settings.relaunch_window_s) == (3, 600.0)
    stack.start_agent("solo", "8GiB")
    await until(lambda: _count_nodes(stack, 1))
    # Named as _assert_serves asks for it; it claims 1 GiB here.
    resp = await stack.http.post("/models", json={
        "model_id": "sim-12g", "engine": "sim", "source": "sim", "memory_bytes": GiB,
        "engine_args": {"memory_bytes": 1 << 20, "load_time_s": LOAD_TIME_S}})
    assert resp.status_code == 201, resp.text
    resp = await stack.http.post("/deployments", json={"model_id": "sim-12g"})
    assert resp.status_code == 201, resp.text
    deployment_id = resp.json()["deployment_id"]

    async def serving() -> dict[str, Any] | None:
        view = await stack.get(f"/deployments/{deployment_id}")
        ready = [r for r in view["replicas"] if r["state"] == "ready"]
        return ready[0] if view["status"] == "serving" and ready else None

    replica = await until(serving)
    await _assert_serves(stack, replica)
    node = replica["nodes"][0]
    [pid] = _engine_pids(node, replica["replica_id"])

    killed_at = time.monotonic()
    os.killpg(os.getpgid(pid), signal.SIGKILL)

    # Out of routing (starting) while it loads again, saying why; then ready again.
    seen: list[tuple[str, str | None]] = []

    async def relaunched() -> dict[str, Any] | None:
        view = await stack.get(f"/deployments/{deployment_id}")
        [r] = view["replicas"]
        if not seen or seen[-1] != (r["state"], r["relaunch_note"]):
            seen.append((r["state"], r["relaunch_note"]))
        ready = r["state"] == "ready" and r["relaunch_note"] is not None
        return r if ready and view["status"] == "serving" else None

    again = await until(relaunched, timeout=60, interval=POLL_S)
    served_in = time.monotonic() - killed_at
    note = ("engine exited (signalled: killed by SIGKILL); relaunched in place on "
            f"{node}, try 1 of 3 in 600 s")
    assert ("starting", note) in seen, seen
    # The same replica, node and port (its endpoint), a new engine process.
    assert (again["replica_id"], again["nodes"], again["endpoint"]) == (
        replica["replica_id"], replica["nodes"], replica["endpoint"])
    assert again["relaunch_note"] == note
    [new_pid] = _engine_pids(node, replica["replica_id"])
    assert new_pid != pid
    await _assert_serves(stack, again)

    events = await stack.get(f"/events?deployment_id={deployment_id}")
    kinds = [e["kind"] for e in events]
    # No new placement, no stop: one replica.placed, ever.
    assert kinds.count("replica.placed") == 1, kinds
    [exited] = [e for e in events if e["kind"] == "replica.exited"]
    assert exited["message"] == "signalled: killed by SIGKILL"
    [event] = [e for e in events if e["kind"] == "replica.relaunched"]
    assert (event["replica_id"], event["message"]) == (replica["replica_id"], note)
    assert event["data"]["nodes"] == [node] and event["data"]["attempt"] == 1
    view = await stack.get(f"/deployments/{deployment_id}")
    assert view["last_failure"] == f"{replica['replica_id']}: {note}"
    # Detection (a watch polls every 0.25 s), the load, readiness and the store write.
    assert served_in < LOAD_TIME_S + 5, served_in
    print(f"\nrelaunched in place and served {served_in:.2f}s after kill -9 of its engine "
          f"(load {LOAD_TIME_S:g} s)")
