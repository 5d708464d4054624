"""The README's examples run as written: each shell block marked ``<!-- readme-test -->``
is run line by line against a real `modelkeeper up --no-demo`, in order, as a newcomer
would type it (the `modelkeeper` on PATH, as after `. .venv/bin/activate`).

Between two commands it waits, as a person reading the output would, until no operation
is running and no deployment is still placing or starting: the commands answer at once
and their work goes on (a second operation on a deployment while one runs is a 409)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_up import Up
from tests.support.doc_blocks import marked_blocks, shell_commands

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(420)]

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "readme-test"
#: A command answers in seconds; the operation it starts (a restart, a switch, a drain
#: with its grace) runs on for up to a minute on two loaded cores.
COMMAND_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 120.0
#: Lines of up's output kept for a failure: its restarts and give-ups, one line each.
UP_OUTPUT_LINES = 200
#: Statuses a deployment rests in; any other is work still under way.
RESTING = {"serving", "cant_place", "stopped", "parked", "degraded"}


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


def _settle(api: str, up: NoDemoUp) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last: Any = None
    while time.monotonic() < deadline:
        try:
            running = httpx.get(f"{api}/operations", params={"state": "running"},
                                headers=up.operator(), timeout=10).json()
            deployments = httpx.get(f"{api}/deployments", headers=up.operator(),
                                    timeout=10).json()
        except httpx.HTTPError as exc:
            raise AssertionError(f"the API stopped answering between two README commands: "
                                 f"{exc!r}{up.explain()}") from exc
        busy = [d["deployment_id"] for d in deployments if d["status"] not in RESTING]
        if not running and not busy:
            return
        last = (running, busy)
        time.sleep(0.5)
    raise AssertionError(f"still busy after {SETTLE_TIMEOUT_S:.0f}s: {last}{up.explain()}")


def test_the_readme_examples_run_as_written(tmp_path: Path) -> None:
    up = NoDemoUp(tmp_path / "data")
    try:
        up.start()
        api = f"http://127.0.0.1:{up.ports['api']}"
        env = {**os.environ, "MODELKEEPER_API_URL": api,
               "MODELKEEPER_DATA_DIR": str(up.data_dir),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        for command in readme_commands():
            done = subprocess.run(["bash", "-c", command], env=env, capture_output=True,
                                  text=True, timeout=COMMAND_TIMEOUT_S, check=False)
            assert done.returncode == 0, (
                f"README command failed ({done.returncode}): {command}\n"
                f"{done.stdout}\n{done.stderr}{up.explain()}")
            _settle(api, up)
        # The last command removed the deployment: nothing of it is left.
        deployments = httpx.get(f"{api}/deployments", headers=up.operator(), timeout=10)
        assert deployments.json() == []
    finally:
        up.kill_everything()
