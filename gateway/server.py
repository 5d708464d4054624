"""Running the gateway: one worker in this process, or several sharing the port.

The HTTP server is uvicorn with httptools and uvloop, running the raw ASGI app of
:mod:`gateway.app` (the stack chosen by measurement; see bench/results/gateway.md). With
``gateway_workers`` > 1 each worker is its own process with its own socket bound with
SO_REUSEPORT, so the kernel spreads connections over them evenly, and a supervisor here
restarts a worker that dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from modelkeeper.infra import tracing
from modelkeeper.infra.http_server import TimedHttpProtocol, timed_protocol
from modelkeeper.infra.processes import port_is_free
from modelkeeper.infra.secrets import read_engine_key_secret, read_metrics_token
from modelkeeper.settings import Settings

from .app import Gateway
from .responses import JSON_CONTENT_TYPE, error_json
from .tracing import traced_app

log = logging.getLogger(__name__)

#: A worker that dies sooner than this after starting is failing to start, not crashing
#: under load: restarting it would only loop.
MIN_WORKER_LIFE_S = 5.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class GatewayConfigError(Exception):
    """A setting the gateway cannot run with; reported as one line."""


_NO_STORE = ("set MODELKEEPER_GATEWAY_DATABASE_URL (the gateway's own role, which may not "
             "change the schema) or MODELKEEPER_DATABASE_URL: the store the gateway routes "
             "from")


def engine_key_secret(settings: Settings) -> bytes:
    """The secret engine keys derive from: the setting, or the file `up` keeps."""
    # The API's reader too, so the two cannot disagree on where the secret lives.
    secret = read_engine_key_secret(settings)
    if not secret:
        raise GatewayConfigError(
            "set MODELKEEPER_ENGINE_KEY_SECRET (or run with the data dir of `modelkeeper up`, "
            f"which keeps it in {settings.engine_key_secret_file}): the gateway derives each "
            "engine's API key from it, and the API each node's key")
    return secret.encode()


def gateway_id(worker: int) -> str:
    """This worker's name in the usage tables."""
    return f"{socket.gethostname()}:{os.getpid()}:{worker}"


def bind_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening TCP socket (SO_REUSEPORT when several workers share the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class GatewayHttpProtocol(TimedHttpProtocol):
    """The HTTP protocol every server that faces clients shares
    (:mod:`modelkeeper.infra.http_server`: header and body deadlines, a header cap counted
    as the bytes arrive, a lingering close), with the gateway's error shape: the answers it
    writes below the app (a 400, 408 or 431) are OpenAI's, as every other error the gateway
    gives, so a client's error handling needs one parser."""

    def error_body(self, message: str, code: str) -> tuple[bytes, bytes]:
        # Each is the request's own fault (malformed, too large, too slow).
        return JSON_CONTENT_TYPE, error_json(message, "invalid_request_error", code)


def gateway_protocol(settings: Settings) -> type[TimedHttpProtocol]:
    """:class:`GatewayHttpProtocol` with the settings' deadlines."""
    return timed_protocol("GatewayHttpProtocol", base=GatewayHttpProtocol,
                          header_timeout_s=settings.gateway_header_timeout_s,
                          body_timeout_s=settings.gateway_body_timeout_s)


def uvicorn_config(app: Gateway, settings: Settings) -> uvicorn.Config:
    """The server settings: the measured-fastest protocol stack (httptools, bounded in
    time and header size by :class:`GatewayHttpProtocol`), no access log (a log line per
    request would cost more than the gateway's own work)."""
    return uvicorn.Config(
        # While tracing is on, a span around each completion (gateway.tracing).
        traced_app(app, ratio=settings.gateway_trace_ratio) if tracing.ON else app,
        loop="uvloop",
        http=gateway_protocol(settings), lifespan="on", access_log=False,
        log_config=None, log_level=settings.log_level.lower(),
        # OpenAI clients keep connections open between requests; closing them after 5 s
        # idle (uvicorn's default) would make them reconnect all the time.
        timeout_keep_alive=75, backlog=2048,
        # Client addresses are not used, so X-Forwarded-For need not be parsed per request;
        # and no Server header advertising the software.
        proxy_headers=False, server_header=False,
        # On SIGTERM, streams in progress get this long to finish before they are cut.
        timeout_graceful_shutdown=30,
    )


def _build_gateway(settings: Settings, secret: bytes, worker: int) -> Gateway:
    # Its own role's DSN when it has one (no DDL rights; Gateway.startup then applies no
    # migrations), so the process that faces clients cannot change the schema.
    database_url = settings.gateway_store_url
    if database_url is None:
        raise GatewayConfigError(_NO_STORE)
    try:
        return Gateway(settings, database_url=database_url, engine_key_secret=secret,
                       gateway_id=gateway_id(worker))
    except ValueError as err:  # a setting's file (the metrics token) cannot be used
        raise GatewayConfigError(str(err)) from err


def _serve_one(settings: Settings, secret: bytes, worker: int, *, reuse_port: bool) -> int:
    """Run one worker until SIGINT/SIGTERM; the exit code."""
    # Here, in each worker: a spawned worker starts with a fresh interpreter.
    tracing.setup(settings, service="modelkeeper-gateway")
    gateway = _build_gateway(settings, secret, worker)
    sock = bind_socket(settings.bind_host, settings.gateway_port, reuse_port=reuse_port)
    server = uvicorn.Server(uvicorn_config(gateway, settings))
    server.run(sockets=[sock])
    return 0 if server.started else 1


def _worker_main(settings: Settings, secret: bytes, worker: int) -> None:
    """Entry point of a worker process (spawned: it starts with a fresh interpreter)."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    raise SystemExit(_serve_one(settings, secret, worker, reuse_port=True))


def run_gateway(settings: Settings) -> int:
    """`modelkeeper gateway`: serve until SIGINT/SIGTERM; the exit code."""
    secret = engine_key_secret(settings)
    if settings.gateway_store_url is None:
        raise GatewayConfigError(_NO_STORE)
    try:
        read_metrics_token(settings)  # before any worker starts: one line, exit code 2
    except ValueError as err:
        raise GatewayConfigError(str(err)) from err
    host, port = settings.bind_host, settings.gateway_port
    # Checked without SO_REUSEPORT: another gateway on the port would otherwise quietly
    # share its traffic with this one.
    if not port_is_free(host, port):
        raise GatewayConfigError(f"port {port} on {host} is in use; choose another with "
                                 "--gateway-port or MODELKEEPER_GATEWAY_PORT")
    if settings.gateway_workers == 1:
        return _serve_one(settings, secret, 0, reuse_port=False)
    return _supervise(settings, secret)


def _supervise(settings: Settings, secret: bytes) -> int:
    """Start ``gateway_workers`` processes, restart any that dies, stop all on a signal."""
    metrics_dir = tempfile.mkdtemp(prefix="modelkeeper-gateway-metrics-")
    # Read by prometheus_client when each spawned worker imports it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    context = multiprocessing.get_context("spawn")
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def start(index: int) -> tuple[BaseProcess, float]:
        process = context.Process(target=_worker_main, args=(settings, secret, index),
                                  name=f"gateway-worker-{index}", daemon=False)
        process.start()
        return process, time.monotonic()

    workers = [start(i) for i in range(settings.gateway_workers)]
    log.info("gateway: %d workers on %s:%d", len(workers), settings.bind_host,
             settings.gateway_port)
    code = 0
    try:
        while not stopping:
            time.sleep(0.2)
            if stopping:
                # A signal to the whole group reaches the workers too; their exits are
                # part of stopping, not failures to restart.
                break
            for index, (process, started) in enumerate(workers):
                if process.is_alive():
                    continue
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(process.pid, metrics_dir)  # type: ignore[no-untyped-call]
                if time.monotonic() - started < MIN_WORKER_LIFE_S:
                    log.error("gateway worker %d exited with code %s while starting; stopping",
                              index, process.exitcode)
                    stopping, code = True, 1
                    break
                log.error("gateway worker %d died (exit code %s); restarting it", index,
                          process.exitcode)
                workers[index] = start(index)
    finally:
        for process, _ in workers:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        for process, _ in workers:
            process.join(15)
            if process.is_alive():
                process.kill()
                process.join(5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone: it is not the
    process's main server, and Ctrl-C must still reach whoever embeds it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """One gateway worker inside the current event loop (tests, benchmarks)."""

    def __init__(self, settings: Settings, *, engine_key_secret: bytes, worker: int = 0) -> None:
        self.gateway = _build_gateway(settings, engine_key_secret, worker)
        self.settings = settings
        self._server = _EmbeddedServer(uvicorn_config(self.gateway, settings))
        self._task: asyncio.Task[None] | None = None
        self.url = f"http://{settings.bind_host}:{settings.gateway_port}"

    async def start(self, timeout_s: float = 30.0) -> None:
        """Serve in the background; return once the gateway answers."""
        sock = bind_socket(self.settings.bind_host, self.settings.gateway_port,
                           reuse_port=False)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the gateway failed to start (see the log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not started after {timeout_s}s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop serving and wait until every connection is closed."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
