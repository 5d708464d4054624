"""`modelkeeper up` end to end, as a user runs it: a real process tree on free ports."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from cli import binaries
from modelkeeper.infra.processes import free_port
from modelkeeper.names import local_database_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Up:
    """A running `modelkeeper up` and the ports it was given."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.ports = {name: free_port() for name in
                      ("api", "gateway", "postgres", "temporal", "temporal-ui",
                       "temporal-http", "temporal-metrics", "temporal-mtls")}
        self.proc: subprocess.Popen[str] | None = None
        self.descendants: list[psutil.Process] = []
        #: What `up` printed after the banner, once interrupted.
        self.stop_output = ""

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "modelkeeper", "up", "--data-dir", str(self.data_dir)]
        for name, port in self.ports.items():
            argv += [f"--{name}-port", str(port)]
        return argv

    def operator(self) -> dict[str, str]:
        """The header that presents the admin token `up` wrote, as the CLI sends it."""
        token = (self.data_dir / "operator-token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def start(self) -> str:
        """Start and wait for the banner; return what it printed."""
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        out = "".join(lines)
        assert self.proc.poll() is None, out + self.logs()
        parent = psutil.Process(self.proc.pid)
        self.descendants = parent.children(recursive=True)
        return out

    def logs(self) -> str:
        folder = self.data_dir / "logs"
        return "".join(f"\n--- {p.name}\n" + p.read_text()[-3000:]
                       for p in sorted(folder.glob("*.log")))

    def interrupt(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.stop_output, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode

    def kill_everything(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in self.descendants:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def temporal(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(binaries.temporal_cli()), *args, "--address",
             f"127.0.0.1:{self.ports['temporal']}"],
            capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    stack = Up(tmp_path / "data")
    try:
        yield stack
    finally:
        stack.kill_everything()


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_up_serves_persists_and_stops_cleanly(up: Up) -> None:
    banner = up.start()
    api = f"http://127.0.0.1:{up.ports['api']}"
    assert f"{api}/docs" in banner
    assert f"http://127.0.0.1:{up.ports['temporal-ui']}" in banner

    # The demo model is deployed on a fresh install and served by real llama.cpp, through
    # the gateway, exactly as the README's quick start asks it.
    assert "demo model     smollm2-135m: serving" in banner, banner + up.logs()
    token_file = up.data_dir / "operator-token"
    assert f"operator token {token_file}" in banner
    assert token_file.stat().st_mode & 0o777 == 0o600
    # What up and its children wrote is theirs alone (issue 19): no group or other bit
    # but the g+x PostgreSQL's own user gets under root to reach its data.
    for path in (up.data_dir / "logs" / "api.log", up.data_dir / "temporal" / "temporal.db",
                 *(up.data_dir / "agent" / "shards").iterdir(),
                 up.data_dir / "secrets" / "modelkeeper.pgpass"):
        assert path.stat().st_mode & 0o077 == 0, path
    assert up.data_dir.stat().st_mode & 0o067 == 0

    # Another shell: the CLI reaches this stack (not on the default port or data dir) with
    # the export its banner prints, and nothing else of MODELKEEPER_ in its environment.
    [export] = [line for line in banner.splitlines() if "export " in line]
    shell = {k: v for k, v in os.environ.items() if not k.startswith("MODELKEEPER_")}
    shell.update(w.split("=", 1) for w in export.split("export ")[1].split("   (")[0].split())
    ls = subprocess.run([sys.executable, "-m", "modelkeeper", "ls"], env=shell,
                        capture_output=True, text=True, timeout=60, check=False)
    assert ls.returncode == 0 and "smollm2-135m" in ls.stdout, ls.stdout + ls.stderr
    # A second up on the same data dir (on other ports): one line naming it and this
    # stack's ports, exit 2, and this stack untouched.
    second = subprocess.run(Up(up.data_dir).argv(), capture_output=True, text=True,
                            timeout=60, check=False)
    assert second.returncode == 2, second.stdout + second.stderr
    [line] = second.stderr.strip().splitlines()
    assert f"data dir {up.data_dir} is in use by a running modelkeeper up" in line
    assert f"the API {up.ports['api']}" in line and "Traceback" not in second.stdout
    assert up.proc is not None and up.proc.poll() is None
    assert httpx.get(f"{api}/deployments", timeout=5).status_code == 401
    [demo] = httpx.get(f"{api}/deployments", timeout=5, headers=up.operator()).json()
    assert (demo["model_id"], demo["ready_replicas"]) == ("smollm2-135m", 1)
    assert "AUTH OFF" in banner
    answer = httpx.post(
        f"http://127.0.0.1:{up.ports['gateway']}/v1/chat/completions", timeout=60,
        json={"model": "smollm2-135m", "max_tokens": 16,
              "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]

    health = httpx.get(f"{api}/healthz", timeout=5).json()
    assert health["status"] == "ok" and health["control_workers"] >= 1
    docs = httpx.get(f"{api}/docs", timeout=5)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert httpx.get(f"{api}/openapi.json", timeout=5).json()["info"]["title"] == "modelkeeper"
    # The Temporal UI opens to the operator token's session only (issue 19).
    ui_url = f"http://127.0.0.1:{up.ports['temporal-ui']}"
    assert httpx.get(f"{ui_url}/api/v1/namespaces", timeout=5).status_code == 401
    with httpx.Client(base_url=ui_url, timeout=5) as ui:
        login = ui.post("/_modelkeeper/login", data={"token": token_file.read_text().strip()})
        assert login.status_code == 303, login.text
        assert ui.get("/api/v1/namespaces").status_code == 200

    # A workflow nobody polls for stays Running: it must still be there after a restart.
    workflow_id = f"persist-{uuid.uuid4()}"
    started = up.temporal("workflow", "start", "--type", "Nothing", "--task-queue", "nobody",
                          "--workflow-id", workflow_id)
    assert started.returncode == 0, started.stderr
    listed = up.temporal("workflow", "list")
    assert listed.returncode == 0 and workflow_id in listed.stdout

    # A row written through the store must survive as well.
    import asyncio

    from modelkeeper.domain.events import NewEvent
    from modelkeeper.store import Store

    # As the schema's owner, with the password file `up` keeps (the superuser's is `up`'s).
    dsn = local_database_url("127.0.0.1", up.ports["postgres"], data_dir=up.data_dir)

    async def write_then_read(write: bool) -> list[str]:
        async with await Store.connect(dsn) as store:
            if write:
                await store.events.record_event(NewEvent(kind="probe", message="kept"))
            return [e.message for e in await store.events.list_events() if e.kind == "probe"]

    assert asyncio.run(write_then_read(True)) == ["kept"]

    children = list(up.descendants)
    assert len(children) >= 4
    assert up.interrupt() == 0
    # It says what it stopped, newest first, the demo's engine with the agent, and that
    # nothing is left (which the check below confirms from outside).
    last = up.stop_output.strip().splitlines()[-1]
    assert last == ("stopped agent (and its 1 engine(s)), gateway, api, worker, temporal-ui, "
                    "temporal, postgres; no process of modelkeeper up is left"), up.stop_output
    deadline = time.monotonic() + 10
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(children) == [], [p.cmdline() for p in _alive(children)]

    banner = up.start()
    # Ctrl-C stopped the engine too; the keeper placed the demo again (not re-deployed).
    assert "smollm2-135m: serving" in banner, banner + up.logs()
    assert len(httpx.get(f"{api}/deployments", timeout=5, headers=up.operator()).json()) == 1
    described = up.temporal("workflow", "describe", "--workflow-id", workflow_id, "-o", "json")
    assert described.returncode == 0, described.stderr + up.logs()
    info = json.loads(described.stdout)["workflowExecutionInfo"]
    assert info["status"] == "WORKFLOW_EXECUTION_STATUS_RUNNING", info
    assert asyncio.run(write_then_read(False)) == ["kept"]
    assert up.interrupt() == 0


def test_up_with_api_port_taken_prints_one_line(up: Up) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", up.ports["api"]))
        blocker.listen()
        result = subprocess.run(up.argv(), capture_output=True, text=True, timeout=60,
                                check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(up.ports["api"]) in lines[0] and "--api-port" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (up.data_dir / "postgres").exists()  # nothing was started
