"""A start's progress where people look, end to end: the real API, worker, Temporal,
PostgreSQL and an agent process with sim engines. A download served in held steps shows
its bytes, share and rate moving in GET /deployments/{id} and in `ls`; a start waiting at
the node's start-up gate shows as ``queued``, naming whom it waits for."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from cli.main import build_parser
from cli.operator_cli import run_operator_command
from tests.integration.test_keeper_end_to_end import Stack, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MIB = 1 << 20
SIZE = 4 * MIB
#: The server sends its body in chunks of this size, at most RATE bytes a second: a
#: bounded rate, so the download has a rate to show.
CHUNK = MIB // 4
RATE = 8 * MIB


class HeldFile:
    """A file served in steps: the server sends up to ``allowed`` bytes, then waits until
    the test allows more."""

    def __init__(self) -> None:
        self.allowed = 0
        self.changed = threading.Condition()
        self.closing = False

    def allow(self, n: int) -> None:
        with self.changed:
            self.allowed = n
            self.changed.notify_all()

    def wait_allowed(self, sent: int) -> bool:
        with self.changed:
            self.changed.wait_for(lambda: self.allowed > sent or self.closing, timeout=60)
            return not self.closing


@pytest.fixture
def held_file() -> Iterator[tuple[str, HeldFile]]:
    held = HeldFile()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(SIZE))
            self.end_headers()
            sent = 0
            while sent < SIZE:
                if sent >= held.allowed and not held.wait_allowed(sent):
                    return
                step = min(CHUNK, held.allowed - sent, SIZE - sent)
                self.wfile.write(b"w" * step)
                self.wfile.flush()
                sent += step
                # The rate's bound (a pace, not a synchronisation).
                threading.Event().wait(step / RATE)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/weights.gguf", held
    finally:
        with held.changed:
            held.closing = True
            held.changed.notify_all()
        httpd.shutdown()


@pytest.fixture
async def stack(local_temporal_env: WorkflowEnvironment, database_url: str, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    # The test's file is served over plain http on loopback, which the default source
    # policy refuses: the API and the agent (which inherits the environment) allow it.
    monkeypatch.setenv("MODELKEEPER_SOURCE_SCHEMES", "http,https")
    monkeypatch.setenv("MODELKEEPER_SOURCE_HOSTS", "127.0.0.1")
    s = Stack(local_temporal_env, database_url, tmp_path)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def _deploy(stack: Stack, model_id: str, source: str, **engine_args: Any) -> str:
    resp = await stack.http.post("/models", json={
        "model_id": model_id, "engine": "sim", "source": source, "memory_bytes": 64 * MIB,
        "engine_args": {"memory_bytes": MIB, **engine_args}})
    assert resp.status_code == 201, resp.text
    resp = await stack.http.post("/deployments", json={"model_id": model_id})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["deployment_id"])


async def _replica(stack: Stack, deployment_id: str) -> dict[str, Any] | None:
    view = await stack.get(f"/deployments/{deployment_id}")
    return view["replicas"][0] if view["replicas"] else None


async def _ls(stack: Stack, *flags: str) -> str:
    lines: list[str] = []
    args = build_parser().parse_args(["ls", *flags, "--api-url", stack.api_url])
    # In a thread: the CLI is synchronous, and the API runs on this test's event loop.
    assert await asyncio.to_thread(run_operator_command, args, stack.api_url,
                                   lines.append) == 0
    return "\n".join(lines)


async def test_download_progress_and_queue_show_in_the_api_and_ls(
        stack: Stack, held_file: tuple[str, HeldFile]) -> None:
    url, held = held_file
    stack.start_agent("n1", "8GiB")
    await until(lambda: _ready_nodes(stack))

    # A start waits at the gate while another loads (one slot, the default).
    slow = await _deploy(stack, "slow-load", "sim", load_time_s=8.0)

    async def loading() -> dict[str, Any] | None:
        replica = await _replica(stack, slow)
        progress = replica and replica["progress"]
        return replica if progress and progress["phase"] in ("launching", "loading") else None

    slow_replica = await until(loading, timeout=60)
    behind = await _deploy(stack, "behind", "sim")

    async def queued() -> dict[str, Any] | None:
        replica = await _replica(stack, behind)
        return replica if replica and replica["shown_state"] == "queued" else None

    waiting = await until(queued, timeout=30)
    assert waiting["state"] == "starting"
    assert waiting["progress"]["queue_position"] == 1
    assert waiting["progress"]["waiting_for"] == [slow_replica["replica_id"]]
    view = await stack.get(f"/deployments/{behind}")
    assert view["shown_status"] == "queued" and view["status"] == "starting"
    listed = await _ls(stack)
    row = next(line for line in listed.splitlines() if line.startswith(behind))
    assert " queued " in row
    assert (f"queued 1st in line at n1's start-up gate, waiting for "
            f"{slow_replica['replica_id']} to load") in row
    await until(lambda: _serving(stack, slow), timeout=60)
    await until(lambda: _serving(stack, behind), timeout=60)

    # A download, held at 1 MiB, then at 3 MiB: the progress moves in the API and ls.
    held.allow(MIB)
    fetched = await _deploy(stack, "fetched", url)

    async def downloaded(n: int) -> dict[str, Any] | None:
        replica = await _replica(stack, fetched)
        progress = replica and replica["progress"]
        return progress if progress and progress["bytes_done"] == n else None

    first = await until(lambda: downloaded(MIB), timeout=60)
    assert first["phase"] == "fetching" and first["bytes_total"] == SIZE
    assert first["percent"] == 25.0
    assert "downloading 1.0 MiB of 4.0 MiB (25.0 %)" in await _ls(stack)
    held.allow(3 * MIB)
    second = await until(lambda: downloaded(3 * MIB), timeout=60)
    assert second["percent"] == 75.0
    assert second["updated_at"] > first["updated_at"]
    # Bytes arrived within the rate window: a rate is shown, bounded by the server's.
    assert second["rate_bytes_per_s"] is not None and 0 < second["rate_bytes_per_s"] <= RATE
    listed = json.loads(await _ls(stack, "--json"))
    [row_json] = [d for d in listed if d["deployment_id"] == fetched]
    assert row_json["replicas"][0]["progress"]["bytes_done"] == 3 * MIB
    assert "downloading 3.0 MiB of 4.0 MiB (75.0 %)" in await _ls(stack)
    held.allow(SIZE)
    view = await until(lambda: _serving(stack, fetched), timeout=60)
    # Ready: no progress is shown any more.
    assert view["replicas"][0]["progress"] is None
    assert view["replicas"][0]["shown_state"] == "ready"


async def _ready_nodes(stack: Stack) -> bool:
    return any(n["state"] == "ready" for n in await stack.get("/nodes"))


async def _serving(stack: Stack, deployment_id: str) -> dict[str, Any] | None:
    view: dict[str, Any] = await stack.get(f"/deployments/{deployment_id}")
    return view if view["status"] == "serving" else None
