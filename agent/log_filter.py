"""The log filter: what stands between an engine's output and its log file.

An engine writes to a pipe, never to its log: this process reads the other end, scrubs
every secret from what it reads (:func:`modelkeeper.domain.redact.scrub_secrets`, with the
exact keys the engine was given) and appends the rest to the log, which the agent opened
for it as this process's stdout. SGLang, for one, logs its arguments, its API key among
them, the moment it starts; a log on disk must not hold what any process of the node's
users could read.

Why a process of its own, and not the agent reading the pipe: engines outlive their agent
(a restarted agent adopts them). A pipe whose reader died with the agent would kill an
engine with SIGPIPE at its next line, or block it once the pipe's buffer filled. This
process belongs to neither: it runs in a session of its own (a signal for the engine's
group or the agent's terminal does not reach it), holds no marker an agent hunts strays
by, and exits when the pipe closes, that is when the engine and everything it started
that kept its output are gone. The agent waits for that end before it reads the log's
tail, so the tail holds an engine's last words.

Run as ``python -m agent.log_filter``, with the engine's secrets in
:data:`SECRETS_ENV` (one a line), which it removes from its environment first. It imports
the standard library and the scrubber only, so it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence

from modelkeeper.domain.redact import scrub_secrets

#: Where the filter finds the values to scrub, one a line. Set only in its environment.
SECRETS_ENV = "MODELKEEPER_LOG_FILTER_SECRETS"
#: The module the filter runs as.
ENTRY_MODULE = "agent.log_filter"
#: Variables the filter takes from the engine's environment: what an interpreter needs
#: to start and find our package. Never the engine's markers: an agent that hunts
#: unidentified engines by them must not take the filter for one (it ends with its
#: engine anyway).
FILTER_ENV_NAMES = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "LANG", "LC_ALL", "TMPDIR")

#: Bytes read from the pipe at once: the pipe's own buffer, so one read empties it.
READ_BYTES = 64 * 1024
#: A line longer than this is written in parts (a progress bar redrawn with ``\r`` for an
#: hour, a model dumped on one line): the filter must not hold an engine's output without
#: end. Each part is cut after a character no secret holds, so no secret is split.
MAX_PENDING_BYTES = 64 * 1024

#: Characters that may belong to a secret or to an escape of one (see
#: :mod:`modelkeeper.domain.redact`): a long line is never cut after one of them.
_SECRET_BYTES = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-\\%")
_LINE_ENDS = (b"\n", b"\r")


def secret_values(env: Mapping[str, str], secret_words: Iterable[str]) -> list[str]:
    """The values of ``env`` whose names hold one of ``secret_words``: every secret an
    engine is given travels in a variable so named (its API key under whatever name its
    engine reads), and only those are so named (the agent drops any other)."""
    words = tuple(secret_words)
    return [value for name, value in env.items()
            if value and any(word in name.upper() for word in words)]


def filter_command(python: str, engine_env: Mapping[str, str],
                   secrets: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the filter for an engine run with
    ``engine_env`` that was given ``secrets``."""
    env = {name: engine_env[name] for name in FILTER_ENV_NAMES if name in engine_env}
    env[SECRETS_ENV] = "\n".join(secrets)
    return [python, "-m", ENTRY_MODULE], env


def take_secrets(environ: MutableMapping[str, str]) -> list[str]:
    """The values to scrub, removed from ``environ``."""
    return [v for v in environ.pop(SECRETS_ENV, "").split("\n") if v]


class LineScrubber:
    """Bytes in, scrubbed bytes out, a line at a time: a secret is scrubbed only where
    it is seen whole, so nothing is written before the end of its line (or of a part cut
    where no secret can be split; see :data:`MAX_PENDING_BYTES`).

    Bytes that are not UTF-8 pass through as they came (``surrogateescape``).
    """

    def __init__(self, known: Sequence[str], *, max_pending: int = MAX_PENDING_BYTES) -> None:
        self._known = tuple(known)
        self._max_pending = max_pending
        self._pending = bytearray()

    def _scrub(self, data: bytes) -> bytes:
        text = data.decode("utf-8", errors="surrogateescape")
        return scrub_secrets(text, known=self._known).encode("utf-8",
                                                              errors="surrogateescape")

    def _cut(self) -> int:
        """Where the pending bytes may be written up to: after their last line end, or,
        past the limit, after their last byte no secret holds (all of them without one)."""
        end = max(self._pending.rfind(mark) for mark in _LINE_ENDS) + 1
        if end > 0 or len(self._pending) < self._max_pending:
            return end
        for index in range(len(self._pending) - 1, -1, -1):
            if self._pending[index] not in _SECRET_BYTES:
                return index + 1
        # A part of nothing but key characters: scrubbed as it is (a secret inside it
        # goes; one cut off at its end would leave its first part).
        return len(self._pending)

    def feed(self, chunk: bytes) -> bytes:
        """Take ``chunk``; what may be written now."""
        self._pending += chunk
        cut = self._cut()
        if cut == 0:
            return b""
        ready = bytes(self._pending[:cut])
        del self._pending[:cut]
        return self._scrub(ready)

    def close(self) -> bytes:
        """The rest, at the end of the output."""
        rest, self._pending = bytes(self._pending), bytearray()
        return self._scrub(rest) if rest else b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def pump(read: Callable[[], bytes], write: Callable[[bytes], None],
         scrubber: LineScrubber) -> int:
    """Move everything ``read`` yields through ``scrubber`` to ``write`` until ``read``
    returns nothing (the pipe closed). Returns the bytes dropped because writing failed.

    A write that fails (a full disk) drops its part and the filter reads on: an engine
    whose log cannot be written must not block on its output. Once writing works again,
    the log says how much is missing.
    """
    dropped = 0
    while True:
        chunk = read()
        out = scrubber.feed(chunk) if chunk else scrubber.close()
        if out:
            try:
                if dropped:
                    write(f"[log filter: {dropped} bytes of output lost: the log could "
                          f"not be written]\n".encode())
                    dropped = 0
                write(out)
            except OSError:
                dropped += len(out)
        if not chunk:
            return dropped


def main() -> int:
    """Scrub stdin into stdout until stdin closes; the exit code."""
    known = take_secrets(os.environ)
    # The agent's terminal closing, or a Ctrl-C there, is no reason to stop: the filter
    # ends with its engine's output. (It runs in a session of its own; this is for one
    # started by hand.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    source, sink = sys.stdin.fileno(), sys.stdout.fileno()
    pump(lambda: os.read(source, READ_BYTES), lambda data: _write_all(sink, data),
         LineScrubber(known))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
