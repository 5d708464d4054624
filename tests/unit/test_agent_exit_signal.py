"""agent.engine_process.ExitSignal: a watch wakes when its engine's process ends, not at
its next poll; without a process to wait on, the wait is the plain sleep it replaces."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from agent.engine_process import ExitSignal

pytestmark = pytest.mark.timeout(60)

#: Far longer than any exit takes to be seen: a wait that ran to it saw nothing.
LONG_S = 30.0


async def test_a_wait_ends_when_the_process_ends_not_at_its_timeout() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    signal = ExitSignal(proc.pid)
    try:
        # It runs: a wait times out, and the next one still wakes at the end.
        started = time.monotonic()
        await signal.wait(0.2)
        assert time.monotonic() - started >= 0.19
        waiting = asyncio.create_task(signal.wait(LONG_S))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        killed = time.monotonic()
        proc.kill()
        await asyncio.wait_for(waiting, LONG_S / 2)
        assert time.monotonic() - killed < 5.0
        # Once it has fired, later waits sleep their time (no spin on a readable fd).
        started = time.monotonic()
        await signal.wait(0.2)
        assert time.monotonic() - started >= 0.19
    finally:
        signal.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("pid", [os.getpid(), 2**22 + 1], ids=["the agent itself", "gone"])
async def test_without_a_process_to_wait_on_it_sleeps(pid: int) -> None:
    """An engine served inside the agent has the agent's pid; a pid that is gone has no
    pidfd: each wait is its timeout."""
    signal = ExitSignal(pid)
    started = time.monotonic()
    await signal.wait(0.2)
    assert 0.19 <= time.monotonic() - started < 5.0
    signal.close()
