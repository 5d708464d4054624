"""The secrets grep of a full run: no key or secret in any log, Temporal history, event
or API response.

A real stack, each component its own process with its own log file, as in production:
PostgreSQL, the Temporal dev server, the control worker, the API (operator tokens on),
the gateway (client keys on, on its own database role) and an agent with a sim engine.
The test joins the agent with a join token, deploys a sim model, and sends a request
through the gateway with a client key. Then it searches:

* every log file: each component's, the engine's, PostgreSQL's and Temporal's;
* the recorded history of every workflow, the deployment's included, as JSON;
* the event history (GET /events);
* every API and gateway response the test received, and the API's listings;

for the cluster secret, every key derivable from it (each ``derive_*`` function of
:mod:`modelkeeper.domain.engine_keys` applied to every node and replica id, and again to
what that yields), the join token, the node's credential, the client API key and the
operator token. Each appears nowhere. Secrets are random per run, so a match can only be
a leak of this run.

Then for any secret of a kind we make, known to the test or not (:data:`SECRET_KINDS`):
one of our prefixed keys or tokens (``mk-``, ``mkn-``, ``mkc-``, ``mko-``), or 64 bare hex
digits (the cluster secret's form). A secret the test does not know of (a key derived
some other way) is caught by its look.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from agent.engines.sim_server import API_KEY_ENV
from cli import temporal_server
from cli.postgres import GATEWAY_ROLE, SUPERUSER, read_password
from modelkeeper.domain import engine_keys
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra import temporal
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.names import deployment_workflow_id
from modelkeeper.store.routing import RoutingStore
from modelkeeper.store.tokens import TokensStore
from tests.conftest import PgServer
from tests.support.node_keys import key_epoch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HOST = "127.0.0.1"
NAMESPACE = "default"
MODEL = "sim-secrets"
#: What the scraper sends to the gateway's /metrics (searched for like every other secret).
METRICS_TOKEN = "mkm-secrets-grep-scrape-token-0123456789abcdef"
GiB = 1 << 30
#: Interpreters starting on a busy 2-core machine; a healthy stack is up in a fraction.
START_TIMEOUT_S = 120.0
SERVE_TIMEOUT_S = 120.0
#: Environment variables of the developer's shell that would change what the children
#: do (a production Temporal's TLS, another database): dropped before ours are set.
INHERITED_PREFIXES = ("MODELKEEPER_", "TEMPORAL_")
#: What a secret of each kind we make looks like, written here rather than taken from the
#: scrubber, which is under test. Prefixed: engine key (mk-), node key (mkn-), node
#: credential and client API key (mkc-), operator token (mko-).
SECRET_KINDS = {
    "a prefixed key or token": re.compile(r"mk[a-z]?-[A-Za-z0-9_\-]{32,}"),
    "64 bare hex digits (the cluster secret's form)":
        re.compile(r"(?<![0-9A-Fa-f])[0-9A-Fa-f]{64}(?![0-9A-Fa-f])"),
}
#: The derivation functions of engine_keys are applied this many times over: cluster
#: secret -> node key -> engine key. One more round than the chain is long costs little
#: and catches a longer chain.
DERIVATION_ROUNDS = 3


@dataclass
class Run:
    """A running stack, what it was given, and everything it answered."""

    tmp: Path
    database_url: str
    api_url: str
    gateway_url: str
    temporal_address: str
    cluster_secret: str
    join_token: str
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    #: Every API and gateway response body the test received, with what it answered.
    responses: list[tuple[str, str]] = field(default_factory=list)
    operator_token: str = ""
    client_key: str = ""

    def record(self, response: httpx.Response) -> None:
        self.responses.append((f"{response.request.method} {response.request.url}",
                               response.text))


def _base_env(tmp: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(INHERITED_PREFIXES)}
    env.update({
        "MODELKEEPER_BIND_HOST": HOST,
        # The strictest level: a secret logged at DEBUG is a secret in a log file.
        "MODELKEEPER_LOG_LEVEL": "DEBUG",
        "MODELKEEPER_DATA_DIR": str(tmp / "data"),
        "MODELKEEPER_SETTLING_WINDOW_S": "0",
        "MODELKEEPER_HEARTBEAT_INTERVAL_S": "0.5",
    })
    return env


def _start(run: Run, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
    proc = ManagedProcess(name, [sys.executable, "-m", "modelkeeper", *argv],
                          run.tmp / "logs" / f"{name}.log", env=env)
    proc.start()
    run.processes[name] = proc
    return proc


def _http_ready(url: str, check: Callable[[httpx.Response], bool]) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return check(httpx.get(url, timeout=1.0))
        except httpx.HTTPError:
            return False
    return ready


async def _until(check: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.2)


def _kill_engines(agent_dir: Path) -> None:
    """Engines outlive their agent by design; the test owns their clean-up (only this
    test's: others may run beside it)."""
    node_file = agent_dir / "node_id"
    if not node_file.exists():
        return
    node_id = node_file.read_text().strip()
    for proc in psutil.process_iter(["pid"]):
        try:
            marker = proc.environ().get("MODELKEEPER_NODE_ID")
        except psutil.Error:
            continue
        if marker == node_id:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
async def run(tmp_path: Path, pg_server: PgServer, database_url: str) -> AsyncIterator[Run]:
    (tmp_path / "logs").mkdir()
    api_port, gateway_port, temporal_port = free_port(), free_port(), free_port()
    stack = Run(tmp=tmp_path, database_url=database_url,
                api_url=f"http://{HOST}:{api_port}", gateway_url=f"http://{HOST}:{gateway_port}",
                temporal_address=f"{HOST}:{temporal_port}",
                cluster_secret=secrets.token_hex(32), join_token=secrets.token_urlsafe(32))
    join_token_file = tmp_path / "join-token"
    join_token_file.write_text(stack.join_token + "\n")
    join_token_file.chmod(0o600)
    db = urlsplit(database_url)
    agent_dir = tmp_path / "agent"

    temporal_proc = temporal_server.start_dev_server(
        host=HOST, port=temporal_port, http_port=free_port(), metrics_port=free_port(),
        ui=None, db_file=tmp_path / "temporal" / "db",
        namespace=NAMESPACE, log_path=tmp_path / "logs" / "temporal.log")
    stack.processes["temporal"] = temporal_proc
    try:
        base = _base_env(tmp_path)
        control = {**base, "MODELKEEPER_DATABASE_URL": database_url,
                   "TEMPORAL_ADDRESS": stack.temporal_address, "TEMPORAL_NAMESPACE": NAMESPACE}
        _start(stack, "worker", ["worker"], control)
        api = _start(stack, "api", ["api"], {
            **control, "MODELKEEPER_API_PORT": str(api_port),
            "MODELKEEPER_JOIN_TOKEN_FILE": str(join_token_file),
            "MODELKEEPER_ENGINE_KEY_SECRET": stack.cluster_secret})
        await asyncio.to_thread(api.wait_until, _http_ready(
            f"{stack.api_url}/healthz",
            lambda r: r.status_code == 200 and r.json().get("control_workers", 0) >= 1),
            START_TIMEOUT_S, 0.2)
        # As in production: the gateway holds no DSN of the schema's owner, and with
        # client auth on its /metrics answers the scraper's token.
        (tmp_path / "metrics-token").write_text(METRICS_TOKEN + "\n")
        _start(stack, "gateway", ["gateway"], {
            "MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE": str(tmp_path / "metrics-token"),
            **base, "MODELKEEPER_GATEWAY_PORT": str(gateway_port),
            "MODELKEEPER_GATEWAY_DATABASE_URL": pg_server.url(db.path.lstrip("/"),
                                                              role=GATEWAY_ROLE),
            "MODELKEEPER_GATEWAY_AUTH": "true", "MODELKEEPER_USAGE_FLUSH_INTERVAL_S": "0.2",
            "MODELKEEPER_ENGINE_KEY_SECRET": stack.cluster_secret})
        low = free_port()
        _start(stack, "agent", [
            "agent", "--data-dir", str(agent_dir), "--name", "secrets-node",
            "--memory", "16GiB", "--engine-port-range", f"{low}-{low + 20}"], {
            **base, "MODELKEEPER_API_URL": stack.api_url,
            "MODELKEEPER_JOIN_TOKEN_FILE": str(join_token_file)})
        yield stack
    finally:
        for name in ("agent", "gateway", "api", "worker", "temporal"):
            proc = stack.processes.get(name)
            if proc is not None:
                proc.stop(grace=10)
        _kill_engines(agent_dir / "agent")


# -- what to search for ---------------------------------------------------------------------


def _derivations() -> list[Callable[[bytes, str], str]]:
    """Every ``derive_*`` of engine_keys taking (key, id): today the node key and the
    engine key; whatever is added later is searched for too."""
    found: list[Callable[[bytes, str], str]] = []
    for name, function in inspect.getmembers(engine_keys, inspect.isfunction):
        positional = [p for p in inspect.signature(function).parameters.values()
                      if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        if name.startswith("derive_") and len(positional) == 2:
            found.append(function)
    assert found, "engine_keys derives nothing any more: update this test"
    return found


def _derived_keys(cluster_secret: str, ids: set[str],
                  epochs: dict[str, str | None]) -> dict[str, str]:
    """Each key derivable from the cluster secret and ``ids``, by a name that says how
    (never the key itself, which must not end up in a test report either). A derivation
    that takes a node's ``key_epoch`` (migration 0015) is given the id's epoch from
    ``epochs``, and none (the scheme before it) as well."""
    keys: dict[str, str] = {"the cluster secret": cluster_secret}
    frontier = dict(keys)
    for _ in range(DERIVATION_ROUNDS):
        produced: dict[str, str] = {}
        for how, key in frontier.items():
            for derive in _derivations():
                for id_ in sorted(ids):
                    takes_epoch = "key_epoch" in inspect.signature(derive).parameters
                    for epoch in ({epochs.get(id_), None} if takes_epoch else {None}):
                        with contextlib.suppress(ValueError):
                            value = (derive(key.encode(), id_, key_epoch=epoch)
                                     if takes_epoch else derive(key.encode(), id_))
                            produced.setdefault(
                                f"{derive.__name__}({how}, {id_}, epoch {epoch})", value)
        fresh = {how: v for how, v in produced.items() if v not in keys.values()}
        keys.update(fresh)
        frontier = fresh
    return keys


def _needles(named: dict[str, str]) -> dict[str, str]:
    """The secrets, and each without its prefix (``mk-``, ``mkn-``, ``mkc-``...): a log
    that cut the prefix off still leaks the key."""
    needles = {}
    for how, value in named.items():
        needles[how] = value
        prefix, dash, rest = value.partition("-")
        if dash and prefix.startswith("mk") and len(rest) >= 32:
            needles[f"{how}, without its prefix"] = rest
    return needles


def _log_files(run: Run, pg_server: PgServer) -> Iterator[Path]:
    yield from sorted(run.tmp.rglob("*.log"))
    yield pg_server.process.log_path


# -- the run ---------------------------------------------------------------------------------


async def test_no_secret_in_logs_history_events_or_responses(run: Run,
                                                             pg_server: PgServer) -> None:
    async with await TokensStore.connect(run.database_url) as tokens:
        _, run.operator_token = await tokens.create_token("secrets-grep", OperatorRole.ADMIN)
    keys = await RoutingStore.connect(run.database_url, max_size=1, migrate=False)
    try:
        _, run.client_key = await keys.create_api_key("secrets-grep")
    finally:
        await keys.close()

    async with httpx.AsyncClient(
            base_url=run.api_url, timeout=30,
            headers={"Authorization": f"Bearer {run.operator_token}"},
            event_hooks={"response": [_reader(run)]}) as api:

        async def node_ready() -> Any:
            nodes = (await api.get("/nodes")).json()
            return [n for n in nodes if n["state"] == "ready"]

        [node] = await _until(node_ready, timeout=START_TIMEOUT_S, what="the agent to join")
        resp = await api.post("/models", json={
            "model_id": MODEL, "engine": "sim", "source": "sim", "memory_bytes": GiB,
            "engine_args": {"memory_bytes": 1 << 20}})
        assert resp.status_code == 201, resp.text
        resp = await api.post("/deployments", json={"model_id": MODEL})
        assert resp.status_code == 201, resp.text
        deployment_id = resp.json()["deployment_id"]

        async def serving() -> Any:
            view = (await api.get(f"/deployments/{deployment_id}")).json()
            return view if view["status"] == "serving" else None

        view = await _until(serving, timeout=SERVE_TIMEOUT_S, what="the sim to serve")
        replica_ids = {r["replica_id"] for r in view["replicas"]}

        async with httpx.AsyncClient(
                base_url=run.gateway_url, timeout=30,
                headers={"Authorization": f"Bearer {run.client_key}"},
                event_hooks={"response": [_reader(run)]}) as gateway:
            await _until(_http_ready(f"{run.gateway_url}/healthz",
                                     lambda r: r.status_code == 200),
                         timeout=START_TIMEOUT_S, what="the gateway")

            async def answered() -> httpx.Response | None:
                resp = await gateway.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3})
                return resp if resp.status_code == 200 else None

            chat = await _until(answered, timeout=SERVE_TIMEOUT_S, what="a gateway answer")
            assert chat.json()["choices"][0]["message"]["content"] == "the quick brown"
            await gateway.get("/v1/models")
            metrics = await gateway.get("/metrics",
                                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
            assert metrics.status_code == 200, metrics.text

        # The listings an operator (or an attacker with a viewer token) reads.
        for path in ("/nodes", f"/nodes/{node['node_id']}", "/models", f"/models/{MODEL}",
                     "/deployments", f"/deployments/{deployment_id}", "/replicas",
                     "/operations", "/healthz", "/metrics", "/openapi.json",
                     f"/events?deployment_id={deployment_id}"):
            await api.get(path)
        events = await api.get("/events")
        assert events.status_code == 200, events.text
        assert any(e.get("deployment_id") == deployment_id for e in events.json())

    histories = await _histories(run)
    assert any(workflow_id == deployment_workflow_id(deployment_id)
               for workflow_id, _ in histories), [w for w, _ in histories]

    # The keys the engines were actually given, from their environment: the search below
    # must know them, or it could miss a leak of a key derived some other way.
    engine_keys_given = _engine_keys_given(node["node_id"])
    assert engine_keys_given, "no engine of this node found"

    # Stopped before the search, so what each process logs on its way out is searched too.
    for name in ("agent", "gateway", "api", "worker"):
        run.processes[name].stop(grace=10)

    credential_file = run.tmp / "agent" / "agent" / "node_credential"
    named = {"the join token": run.join_token, "the client API key": run.client_key,
             "the operator token": run.operator_token,
             "the gateway's metrics token": METRICS_TOKEN}
    if credential_file.exists():
        named["the node credential"] = credential_file.read_text().strip()
    named.update(_derived_keys(
        run.cluster_secret, {node["node_id"], *replica_ids},
        {node["node_id"]: await key_epoch(run.database_url, node["node_id"])}))
    # The database passwords the components connected with (through password files).
    for role in (SUPERUSER, GATEWAY_ROLE):
        password = read_password(pg_server.data_dir, role)
        assert password is not None, role
        named[f"the database password of {role}"] = password
    needles = _needles(named)
    assert engine_keys_given <= set(needles.values()), "an engine key the search misses"

    places: dict[str, str] = {}
    for log_file in _log_files(run, pg_server):
        places[f"log {log_file}"] = log_file.read_text(errors="replace")
    for index, (workflow_id, history) in enumerate(histories):
        places[f"history of {workflow_id} (run {index})"] = history
    for what, body in run.responses:
        places[f"response to {what}"] = body

    # The search looks where the run left its traces: a search of empty files finds nothing.
    assert any(deployment_id in text for place, text in places.items()
               if place.startswith("history of deployment/"))
    assert any(next(iter(replica_ids)) in text for place, text in places.items()
               if place.startswith("log "))

    leaks = [f"{how} in {place}" for place, text in places.items()
             for how, needle in needles.items() if needle in text]
    assert not leaks, "secrets leaked:\n" + "\n".join(leaks)
    # Named by kind and place, never by value: the report must not hold a secret.
    lookalikes = [f"{kind} in {place}" for place, text in places.items()
                  for kind, pattern in SECRET_KINDS.items() if pattern.search(text)]
    assert not lookalikes, "secret-like values found:\n" + "\n".join(lookalikes)


def _engine_keys_given(node_id: str) -> set[str]:
    """The API keys in the environment of this node's engines (marked by its id)."""
    found = set()
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get("MODELKEEPER_NODE_ID") == node_id and env.get(API_KEY_ENV):
            found.add(env[API_KEY_ENV])
    return found


def _reader(run: Run) -> Callable[[httpx.Response], Any]:
    async def read(response: httpx.Response) -> None:
        await response.aread()
        run.record(response)
    return read


async def _histories(run: Run) -> list[tuple[str, str]]:
    """The recorded history of every workflow run of the stack (the deployment's, and any
    other: a continued-as-new run is a run of its own), as (workflow id, JSON)."""
    client = await temporal.connect(run.temporal_address, NAMESPACE,
                                    security=temporal.PLAINTEXT)
    result = []
    async for execution in client.list_workflows():
        handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
        history = await handle.fetch_history()
        result.append((execution.id, history.to_json()))
    return result
