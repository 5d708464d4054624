"""A component as ``python -m modelkeeper COMPONENT`` runs it (the fleet as ``python -m
bench.fleet`` does), with what the scale benchmark reads from it: each placement's timing
(the DEBUG lines of ``modelkeeper.store.placement``), and with ``--profile PATH`` a cProfile
of its main thread, written to PATH on SIGUSR2 (and again on each later SIGUSR2).

Run it as ``python -m bench.scale.component [--profile PATH] COMPONENT [ARGS...]``
(``worker``, ``api``, or ``fleet --fleet N ...``).
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import signal
from pathlib import Path
from types import FrameType

from bench.fleet import command as fleet
from cli.main import main
from modelkeeper.store.placement import PLACEMENT_TIMING_LOGGER


def _profiled(path: Path) -> None:
    """Profile the main thread (where the event loop runs) from now on; SIGUSR2 writes
    what was seen so far to ``path``."""
    profiler = cProfile.Profile()

    def dump(signum: int, frame: FrameType | None) -> None:
        profiler.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(path))
        profiler.enable()

    signal.signal(signal.SIGUSR2, dump)
    profiler.enable()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.scale.component")
    parser.add_argument("--profile", type=Path, help="cProfile the component; SIGUSR2 "
                        "writes the profile here")
    parser.add_argument("component", choices=["worker", "api", "fleet"])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the component's own flags")
    args = parser.parse_args()
    # A level on this logger alone: the worker's other loggers stay at its log level.
    logging.getLogger(PLACEMENT_TIMING_LOGGER).setLevel(logging.DEBUG)
    if args.profile is not None:
        _profiled(args.profile)
    if args.component == "fleet":
        fleet.main(args.args)
    else:
        main([args.component, *args.args])
