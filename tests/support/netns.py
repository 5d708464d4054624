"""Network namespaces for the tests that put a second machine in one (the first hour's
page, two machines): ``ip`` itself, and the clean-up that leaves none of a test's
processes behind."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

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


# -- machines on one link: `up` in one namespace, agents in others ---------------------------

#: Killing what runs in the namespaces at the end: ten seconds of SIGKILL rounds.
KILL_TIMEOUT_S = 10.0
#: `up` on a fresh data dir in a namespace: PostgreSQL's initdb, Temporal, four Python
#: components, on two shared cores.
UP_READY_TIMEOUT_S = 240.0

#: Run inside a namespace: one HTTP request, its answer printed as JSON. The test's own
#: process stays in the root namespace, which reaches none of the link's addresses.
REQUEST_SCRIPT = """
import json, sys, httpx
method, url, body, token = json.loads(sys.argv[1])
headers = {"Authorization": "Bearer " + token} if token else {}
try:
    resp = httpx.request(method, url, json=body, headers=headers, timeout=60)
    print(json.dumps({"status": resp.status_code, "text": resp.text}))
except httpx.HTTPError as exc:
    print(json.dumps({"status": None, "text": repr(exc)}))
"""


def must(*args: str) -> None:
    """``ip ARGS``, which must succeed."""
    done = ip(*args)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"


def skip_reason() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the slow tier as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


@dataclass
class Machines:
    """A namespace for the stack and one per agent, on one bridge in the stack's, each
    with its own address: machines on one link, as a rack's are."""

    stack_ns: str
    agent_ns: list[str]
    stack_ip: str
    agent_ips: list[str]
    logs: list[Path] = field(default_factory=list)

    def spawn(self, ns: str, argv: list[str], log: Path | None = None,
              ) -> subprocess.Popen[str]:
        """Start ``argv`` in ``ns``, in a process group of its own (killed in cleanup with
        everything else in the namespace); stdout to ``log``, or a pipe when None."""
        out: int | IO[str]
        if log is None:
            out = subprocess.PIPE
        else:
            self.logs.append(log)
            out = open(log, "w")  # noqa: SIM115 - the child holds it; closed below
        try:
            return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out,
                                    stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        finally:
            if log is not None:
                assert not isinstance(out, int)
                out.close()

    def request(self, method: str, url: str, *, body: Any = None,
                token: str | None = None) -> tuple[int | None, str]:
        """One HTTP request sent from the stack's namespace."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.stack_ns, sys.executable, "-c", REQUEST_SCRIPT,
             json.dumps([method, url, body, token])],
            capture_output=True, text=True, timeout=90, check=False)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        return answer["status"], answer["text"]

    def kill_everything(self) -> None:
        """SIGKILL every process group with a process in any of the namespaces: all of
        them are this test's, and a namespace with a process in it outlives its deletion."""
        kill_namespaces((self.stack_ns, *self.agent_ns), timeout_s=KILL_TIMEOUT_S)

    def delete(self) -> None:
        # Deleting a namespace destroys the veth ends inside it, and with them the pairs.
        for ns in (self.stack_ns, *self.agent_ns):
            ip("netns", "del", ns)

    def log_tails(self) -> str:
        return "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-4000:]}"
                       for p in self.logs if p.exists())

    def until(self, what: str, check: Callable[[], Any], timeout: float) -> Any:
        """Poll ``check`` each second until it answers something true; fail with every
        log's tail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(1.0)
        pytest.fail(f"{what} not within {timeout:.0f}s{self.log_tails()}")

    def wait_for_banner(self, proc: subprocess.Popen[str]) -> str:
        """`up`'s output up to its last banner line."""
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + UP_READY_TIMEOUT_S
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Press Ctrl-C"):
                return "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
        pytest.fail(f"up exited ({proc.wait()}):\n{''.join(lines)}{self.log_tails()}")


@contextlib.contextmanager
def machines(prefix: str, agents: int) -> Iterator[Machines]:
    """``agents`` agent namespaces and the stack's, joined by a bridge in the stack's;
    skipped, saying why, where namespaces cannot be made. Everything started in them is
    killed by process group, and the namespaces deleted, whatever happens."""
    why = skip_reason()
    if why is not None:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}{random.randrange(100)}"
    subnet = random.randrange(1, 254)
    made = Machines(stack_ns=f"{prefix}-a-{tag}",
                    agent_ns=[f"{prefix}-{i}-{tag}" for i in range(agents)],
                    stack_ip=f"10.201.{subnet}.1",
                    agent_ips=[f"10.201.{subnet}.{i + 2}" for i in range(agents)])
    try:
        added = ip("netns", "add", made.stack_ns)
        if added.returncode != 0:
            pytest.skip(f"cannot create a network namespace here: {added.stderr.strip()}")
        bridge = "br0"
        must("-n", made.stack_ns, "link", "add", bridge, "type", "bridge")
        must("-n", made.stack_ns, "addr", "add", f"{made.stack_ip}/24", "dev", bridge)
        must("-n", made.stack_ns, "link", "set", bridge, "up")
        # `up` talks to its own servers on loopback, which a new namespace has down.
        must("-n", made.stack_ns, "link", "set", "lo", "up")
        for i, (ns, address) in enumerate(zip(made.agent_ns, made.agent_ips, strict=True)):
            must("netns", "add", ns)
            # Made inside the stack's namespace, so no name is ever taken in the root one.
            end, peer = f"v{i}", f"v{i}p"
            must("-n", made.stack_ns, "link", "add", end, "type", "veth", "peer", "name", peer)
            must("-n", made.stack_ns, "link", "set", peer, "netns", ns)
            must("-n", made.stack_ns, "link", "set", end, "master", bridge)
            must("-n", made.stack_ns, "link", "set", end, "up")
            must("-n", ns, "addr", "add", f"{address}/24", "dev", peer)
            must("-n", ns, "link", "set", peer, "up")
            must("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        made.kill_everything()
        made.delete()
