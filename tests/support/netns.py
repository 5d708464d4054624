"""Network namespaces for the tests that put a second machine in one (the first hour's
page, two machines): ``ip`` itself, and the clean-up that leaves none of a test's
processes behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable

#: One ``ip`` call: it answers at once, unless the machine is stuck.
IP_TIMEOUT_S = 30


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``, its output captured; the caller reads its return code."""
    return subprocess.run(["ip", *args], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S, check=False)


def netns_pids(ns: str) -> list[int]:
    """The processes in namespace ``ns`` (none when it does not exist)."""
    return [int(pid) for pid in ip("netns", "pids", ns).stdout.split()]


def kill_namespaces(namespaces: Iterable[str], *, timeout_s: float) -> None:
    """SIGKILL every process group with a process in ``namespaces``, until none is left
    or ``timeout_s`` has passed. Only for namespaces the test made itself: every process
    in them is the test's, and a namespace with a process in it outlives its deletion."""
    namespaces = list(namespaces)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [pid for ns in namespaces for pid in netns_pids(ns)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        time.sleep(0.2)
