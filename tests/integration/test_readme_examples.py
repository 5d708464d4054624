"""The README's examples run as written: each shell block marked ``<!-- readme-test -->``
is run line by line against a real `modelkeeper up --no-demo`, in order, as a newcomer
would type it (the `modelkeeper` on PATH, as after `. .venv/bin/activate`).

One command follows the other at once, as when a block is pasted whole: the README's
commands that start work say ``--wait``, so each ends before the next begins (without it,
a restart followed by a reconfigure was a 409). Meanwhile `modelkeeper events --follow`
runs beside them, as in a second terminal: it must print the deploy's events live, and
end at Ctrl-C with exit 0. Last, a switch to a model that cannot start: ``--wait`` exits 1
with the rollback's reason."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

import httpx
import pytest

from tests.integration.test_up import Up
from tests.support.doc_blocks import marked_blocks, shell_commands

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(420)]

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "readme-test"
#: A command answers in seconds; with --wait it lasts as long as the work it started (a
#: restart, a switch, a drain with its grace): up to a minute on two loaded cores.
COMMAND_TIMEOUT_S = 90.0
#: Lines of up's output kept for a failure: its restarts and give-ups, one line each.
UP_OUTPUT_LINES = 200


def readme_commands() -> list[str]:
    """Every command of the marked shell blocks, in order."""
    return [command for block in marked_blocks(README.read_text(), MARK)
            for command in shell_commands(block.body)]


def test_the_marked_blocks_are_found() -> None:
    commands = readme_commands()
    assert len(commands) >= 10, commands
    assert commands[0].startswith("modelkeeper models add sim-1g")
    assert all(c.startswith("modelkeeper ") for c in commands), commands


class NoDemoUp(Up):
    """`up --no-demo`, whose output after the banner is kept (the last UP_OUTPUT_LINES
    lines): the restarts and give-ups it reports explain an API that stopped answering."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.recent: deque[str] = deque(maxlen=UP_OUTPUT_LINES)

    def argv(self) -> list[str]:
        return [*super().argv(), "--no-demo"]

    def start(self) -> str:
        banner = super().start()
        # Read on a thread: unread, a full pipe would also stall up's supervision loop.
        threading.Thread(target=self._keep_reading, daemon=True).start()
        return banner

    def _keep_reading(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.recent.append(line)

    def explain(self) -> str:
        """What up said since its banner, whether it still runs, and its components' logs."""
        code = None if self.proc is None else self.proc.poll()
        state = "still runs" if code is None else f"exited {code}"
        return (f"\n--- up ({state}), its last {UP_OUTPUT_LINES} lines after the banner\n"
                + "".join(list(self.recent)) + self.logs())


def test_the_readme_examples_run_as_written(tmp_path: Path) -> None:
    up = NoDemoUp(tmp_path / "data")
    follower: subprocess.Popen[str] | None = None
    try:
        up.start()
        api = f"http://127.0.0.1:{up.ports['api']}"
        env = {**os.environ, "MODELKEEPER_API_URL": api,
               "MODELKEEPER_DATA_DIR": str(up.data_dir),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        follower = subprocess.Popen(["modelkeeper", "events", "--follow"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
        followed = _Lines(follower)
        for command in readme_commands():
            _run(command, env, up)
        # The last command removed the deployment, and --wait saw it gone: nothing is left.
        deployments = httpx.get(f"{api}/deployments", headers=up.operator(), timeout=10)
        assert deployments.json() == []
        _no_operation_runs(api, up)

        # The follower printed the deploy's events as they came, and ends at Ctrl-C.
        followed.wait_for("deployment.deleted", FOLLOW_TIMEOUT_S)
        for kind in ("deployment.created", "replica.placed", "deployment.serving",
                     "operation.started"):
            assert any(kind in line for line in followed.lines), (kind, followed.lines)
        os.killpg(follower.pid, signal.SIGINT)
        assert follower.wait(timeout=COMMAND_TIMEOUT_S) == 0, followed.lines
        assert not any("Traceback" in line for line in followed.lines), followed.lines

        # A switch to a model that cannot start rolls back: --wait exits 1, saying so.
        _run(f"modelkeeper models add sim-bad {BAD_MODEL}", env, up)
        _run("modelkeeper deploy sim-1g --replicas 1 --wait", env, up)
        failed = subprocess.run(["modelkeeper", "switch", "sim-1g", "sim-bad", "--wait"],
                                env=env, capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S, check=False)
        assert failed.returncode == 1, f"{failed.stdout}\n{failed.stderr}{up.explain()}"
        [reason] = failed.stderr.strip().splitlines()
        assert reason.startswith("modelkeeper switch: switch/") and "rolled_back" in reason, \
            reason
        assert "replica.start_failed" in failed.stdout, failed.stdout
    finally:
        if follower is not None and follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
        up.kill_everything()


#: The sim model a switch cannot start: its engine exits 1 once loading ends.
BAD_MODEL = ("--engine sim --source sim --memory 1GiB --engine-arg memory_bytes=67108864 "
             "--engine-arg fail_at_start=true")
#: From the last README command to its events at the follower: a stream delivers in
#: milliseconds; generous for two loaded cores.
FOLLOW_TIMEOUT_S = 30.0


def _run(command: str, env: dict[str, str], up: NoDemoUp) -> None:
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    assert done.returncode == 0, (
        f"README command failed ({done.returncode}): {command}\n"
        f"{done.stdout}\n{done.stderr}{up.explain()}")


def _no_operation_runs(api: str, up: NoDemoUp) -> None:
    running = httpx.get(f"{api}/operations", params={"state": "running"},
                        headers=up.operator(), timeout=10).json()
    assert running == [], f"{running}{up.explain()}"


class _Lines:
    """What a background command prints, read on a thread (a full pipe would stall it)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> None:
        with self._changed:
            found = self._changed.wait_for(
                lambda: any(text in line for line in self.lines), timeout_s)
        assert found, (text, self.lines)
