"""The README's examples run as written: each shell block marked ``<!-- readme-test -->``
is run line by line against a real `modelkeeper up --no-demo`, in order, as a newcomer
would type it (the `modelkeeper` on PATH, as after `. .venv/bin/activate`).

Between two commands it waits, as a person reading the output would, until no operation
is running and no deployment is still placing or starting: the commands answer at once
and their work goes on (a second operation on a deployment while one runs is a 409)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_up import Up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "<!-- readme-test"
#: A command answers in seconds; the operation it starts (a restart, a switch, a drain
#: with its grace) runs on for up to a minute on two loaded cores.
COMMAND_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 120.0
#: Statuses a deployment rests in; any other is work still under way.
RESTING = {"serving", "cant_place", "stopped", "parked", "degraded"}


def readme_commands() -> list[str]:
    """Every command of the marked blocks, in order; a line ending in a backslash is
    joined with the next, as the shell does."""
    commands: list[str] = []
    for block in re.findall(MARK + r".*?-->\n```sh\n(.*?)```", README.read_text(), re.S):
        command = ""
        for line in block.splitlines():
            if line.rstrip().endswith("\\"):
                command += line.rstrip()[:-1] + " "
                continue
            command += line
            if command.strip():
                commands.append(command.strip())
            command = ""
    return commands


def test_the_marked_blocks_are_found() -> None:
    commands = readme_commands()
    assert len(commands) >= 10, commands
    assert commands[0].startswith("modelkeeper models add sim-1g")
    assert all(c.startswith("modelkeeper ") for c in commands), commands


class NoDemoUp(Up):
    def argv(self) -> list[str]:
        return [*super().argv(), "--no-demo"]


def _settle(api: str, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last: Any = None
    while time.monotonic() < deadline:
        running = httpx.get(f"{api}/operations", params={"state": "running"},
                            headers=headers, timeout=10).json()
        deployments = httpx.get(f"{api}/deployments", headers=headers, timeout=10).json()
        busy = [d["deployment_id"] for d in deployments if d["status"] not in RESTING]
        if not running and not busy:
            return
        last = (running, busy)
        time.sleep(0.5)
    raise AssertionError(f"still busy after {SETTLE_TIMEOUT_S:.0f}s: {last}")


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
                f"{done.stdout}\n{done.stderr}\n{up.logs()}")
            _settle(api, up.operator())
        # The last command removed the deployment: nothing of it is left.
        deployments = httpx.get(f"{api}/deployments", headers=up.operator(), timeout=10)
        assert deployments.json() == []
    finally:
        up.kill_everything()
