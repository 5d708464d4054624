"""Child processes that live in their own process group and die with it.

Everything modelkeeper starts (servers under ``up``, engines under an agent, servers in
tests) goes through :class:`ManagedProcess`, so stopping always reaches grandchildren
too: a server that forks workers must not outlive the command that started it.

Logs are created readable by their owner and group only (:data:`LOG_MODE`): a server's or
an engine's log may say more than every user of the machine should read.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

#: The mode of every log a managed process writes: its owner writes, its Unix group reads,
#: nobody else. An existing log is tightened to it, never widened.
LOG_MODE = 0o640
#: How long :meth:`ManagedProcess.stop` waits for a log filter to write the last of its
#: child's output once the child's group is gone: the filter reads what is left in a pipe
#: (64 KiB at most) and exits, in milliseconds. It is left to finish on its own past this
#: (a grandchild that left the group still holds the pipe).
LOG_DRAIN_TIMEOUT_S = 2.0


def open_log(path: Path) -> IO[bytes]:
    """``path`` opened to append, created with :data:`LOG_MODE` (tightened to it if it
    was wider), its folder created if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, LOG_MODE)
    try:
        mode = os.fstat(fd).st_mode & 0o777
        if mode & ~LOG_MODE:
            os.fchmod(fd, mode & LOG_MODE)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


class ProcessExitedError(RuntimeError):
    """A child exited while we were waiting for it to become ready."""


@dataclass
class ManagedProcess:
    """A child process started in a new session (its own process group)."""

    name: str
    argv: Sequence[str]
    log_path: Path
    # Out of repr(): an engine's environment holds its key.
    env: Mapping[str, str] | None = field(default=None, repr=False)
    cwd: Path | None = None
    user: str | None = None
    #: A command that reads the child's output on its stdin and writes it to the log (its
    #: stdout), instead of the child writing the log itself: how an agent scrubs secrets
    #: from engine logs (:mod:`agent.log_filter`). It runs in a session of its own, beside
    #: the child, and must exit when its stdin closes.
    log_filter: Sequence[str] | None = None
    log_filter_env: Mapping[str, str] | None = field(default=None, repr=False)
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)
    filter_popen: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        """Start the child, appending its stdout and stderr to ``log_path`` (through the
        log filter, when there is one).

        May be called again once the child has exited and :meth:`stop` has run: that is how
        `up` restarts a component, with the same command, environment and log.
        """
        if self._log is not None:
            # Left open by a start whose Popen raised: a supervisor retrying must not leak.
            self._log.close()
        self._log = open_log(self.log_path)
        output: IO[bytes] | int = self._log
        if self.log_filter is not None:
            output = self._start_filter(self._log)
        try:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                user=self.user,
                # A new session makes the child a group leader, so killpg reaches everything
                # it forks, and a Ctrl-C in our terminal is not delivered to it twice.
                start_new_session=True,
            )
        finally:
            if isinstance(output, int):
                # The child holds the pipe's write end now (or failed to start, and the
                # filter, seeing it closed, exits).
                os.close(output)

    def _start_filter(self, log: IO[bytes]) -> int:
        """Start the log filter on a new pipe; the pipe's write end, for the child."""
        assert self.log_filter is not None
        read_end, write_end = os.pipe()
        try:
            self.filter_popen = subprocess.Popen(
                list(self.log_filter),
                stdin=read_end,
                # Its own errors go to the log too: they are the only trace of a filter
                # that failed.
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.log_filter_env) if self.log_filter_env is not None else None,
                cwd=self.cwd,
                user=self.user,
                # Not in the child's group: a signal for the child must leave the filter
                # to write the child's last words, and end it only by closing the pipe.
                start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        return write_end

    @property
    def pid(self) -> int:
        """The child's pid (also its process group id)."""
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the child's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
        """Poll ``ready`` until it is true; fail early if the child exits first."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                raise ProcessExitedError(
                    f"{self.name} exited with code {code} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}")
            time.sleep(interval)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the whole group, then SIGKILL it after ``grace`` seconds."""
        if self.popen is None:
            return None
        try:
            if self.popen.poll() is None:
                signal_group(self.popen.pid, signal.SIGTERM)
                try:
                    self.popen.wait(grace)
                except subprocess.TimeoutExpired:
                    signal_group(self.popen.pid, signal.SIGKILL)
                    self.popen.wait(5)
            # The leader may be gone while children it forked linger in the group.
            signal_group(self.popen.pid, signal.SIGKILL)
            self._drain_log()
            return self.popen.returncode
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def _drain_log(self) -> None:
        """Wait (LOG_DRAIN_TIMEOUT_S at most) for the log filter to write the last of the
        child's output and exit."""
        if self.filter_popen is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.filter_popen.wait(LOG_DRAIN_TIMEOUT_S)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group, ignoring a group that is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (we try to bind it ourselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A free port *outside* the kernel's ephemeral range.

    Ports the kernel hands out for ``bind(0)`` are also what other servers (the Temporal dev
    server opens several) and outgoing connections get, so a port picked that way can be
    taken between our check and the child's bind. Picking below the ephemeral range, at
    random, makes that collision rare instead of routine.
    """
    low, _ = _ephemeral_range()
    floor = 10000 if low > 11000 else 1024
    for _ in range(200):
        port = random.randrange(floor, low)
        if port_is_free(host, port):
            return port
    raise RuntimeError(f"no free port found in {floor}..{low - 1} on {host}")


def tcp_accepts(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when a TCP connection to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
