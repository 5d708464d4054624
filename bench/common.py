"""What every benchmark's run module does alike: the commit it measured, what a SIGTERM
means, a fleet in a fresh folder stopped whatever happens, and how the process ends. Each
bench's tunables (node memory, claims, timeouts) stay in its own run module, beside the
reason for its values. What a run writes is :mod:`bench.report`'s."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, Protocol, TypeVar

import uvloop

ROOT = Path(__file__).resolve().parents[1]

#: A steady window three watch heartbeat periods long at the defaults (48 s): each watch
#: lands the same number of heartbeats in it whatever its phase (at 150 s a watch lands 3
#: or 4 depending on when it started).
STEADY_WINDOW_S = 144.0


class Stoppable(Protocol):
    def stop(self) -> None: ...


T = TypeVar("T")
F = TypeVar("F", bound=Stoppable)


def code_version() -> str:
    """The commit measured, and whether the working tree differed from it (others edit
    it while a run goes on; a component restarted mid-run imports what is there then)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no")
               .splitlines() if line]
    return git("rev-parse", "--short", "HEAD").strip() + (
        f" with uncommitted changes to {', '.join(changed)}" if changed else "")


def interrupt_on_sigterm() -> None:
    """A SIGTERM ends the run as Ctrl-C does: through the run's clean-up."""
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)


def stop_fleet(fleet: Stoppable) -> None:
    """Stop every process of ``fleet``. A second Ctrl-C or SIGTERM must not cut the
    clean-up short and leave servers up: both are ignored while the fleet stops."""
    handlers = (signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.signal(signal.SIGTERM, signal.SIG_IGN))
    fleet.stop()
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])


def remove_unless_kept(root: Path, *, keep: bool) -> None:
    """Remove a run's folder (logs, data), or say where it is when ``keep``: a failed run
    keeps it, as does --keep."""
    if keep:
        print(f"logs and data kept in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def on_fresh_fleet(prefix: str, make: Callable[[Path], F],
                   run: Callable[[F], Coroutine[Any, Any, T]], *, keep: bool) -> T | None:
    """``run`` on the fleet ``make`` builds in a fresh folder (named from ``prefix``), on
    uvloop; the fleet stopped whatever happens, its folder removed unless ``keep`` or the
    run failed. None when interrupted (Ctrl-C, or SIGTERM after
    :func:`interrupt_on_sigterm`)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    fleet = make(root)
    ok = False
    try:
        result = uvloop.run(run(fleet))
        ok = True
        return result
    except KeyboardInterrupt:
        print("interrupted: stopping every process started", file=sys.stderr)
        return None
    finally:
        stop_fleet(fleet)
        remove_unless_kept(root, keep=keep or not ok)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once stdout and stderr are flushed, without the
    interpreter's finalization: the Temporal SDK's runtime can abort there (FACTS.md,
    sdk-python#300)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
