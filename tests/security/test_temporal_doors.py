"""Issue 19: Temporal's doors under `up`, against a real dev server and a real UI proxy.

A web page can reach any listener on 127.0.0.1 by DNS rebinding, with its own name in
``Host``: before the fix the dev server's web UI (8233) and its HTTP API (a random port)
answered it, and a rebinding page listed histories and terminated workflows. Here every
listener of the dev server `up` starts is tried with a foreign Host, a workflow stays
running through all of it, and the UI proxy admits an admin's session only.

And issue 19's second finding: under ``--bind-host 0.0.0.0`` Temporal stays on loopback
unless the operator asks, and then `up` warns.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from api import temporal_ui
from cli import stack, temporal_server
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import ManagedProcess, free_port, tcp_accepts
from modelkeeper.settings import Settings
from modelkeeper.store.tokens import TokensStore

pytestmark = pytest.mark.timeout(90)

NAMESPACE = "default"
FOREIGN = "evil.example"
#: The proxy is a uvicorn process with one pool connection: a second or two to start.
PROXY_READY_TIMEOUT_S = 30.0
#: What a request to a loopback listener may take; a gRPC port that will not answer
#: HTTP/1 is given up on after this.
REQUEST_TIMEOUT_S = 5.0


@dataclass
class DevServer:
    proc: ManagedProcess
    port: int
    http_port: int
    metrics_port: int
    ui: temporal_server.UiListener


@pytest.fixture(scope="module")
def dev_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    folder = tmp_path_factory.mktemp("temporal")
    server = DevServer(proc=None,  # type: ignore[arg-type]
                       port=free_port(), http_port=free_port(), metrics_port=free_port(),
                       ui=temporal_server.hidden_ui_listener(free_port()))
    server.proc = temporal_server.start_dev_server(
        host="127.0.0.1", port=server.port, http_port=server.http_port,
        metrics_port=server.metrics_port, ui=server.ui, db_file=folder / "temporal.db",
        namespace=NAMESPACE, log_path=folder / "temporal.log")
    try:
        yield server
    finally:
        server.proc.stop()


def _listeners(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _try(url: str, method: str, host: str) -> httpx.Response | None:
    """A rebinding page's request: None when the listener does not speak HTTP/1."""
    try:
        return httpx.request(method, url, headers={"Host": host}, timeout=REQUEST_TIMEOUT_S)
    except (httpx.TransportError, httpx.DecodingError):
        return None


async def test_no_listener_of_the_dev_server_serves_a_rebinding_page(
        dev_server: DevServer) -> None:
    client = await Client.connect(f"127.0.0.1:{dev_server.port}", namespace=NAMESPACE)
    workflow_id = f"victim-{uuid.uuid4().hex[:8]}"
    await client.start_workflow("Nothing", id=workflow_id, task_queue="nobody")

    listeners = _listeners(dev_server.proc.pid)
    # Everything on loopback; the UI alone on its hidden address, nothing on 127.0.0.1.
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in listeners), listeners
    assert (dev_server.ui.host, dev_server.ui.port) in listeners
    assert dev_server.ui.host != "127.0.0.1"
    assert not tcp_accepts("127.0.0.1", dev_server.ui.port)
    on_loopback = {port for ip, port in listeners if ip == "127.0.0.1"}
    pinned = {dev_server.port, dev_server.http_port, dev_server.metrics_port}
    assert pinned <= on_loopback
    # start-dev's history, matching and worker services: random, and gRPC only.
    assert len(on_loopback - pinned) == 3, on_loopback

    for port in sorted(on_loopback):
        base = f"http://127.0.0.1:{port}/api/v1/namespaces/{NAMESPACE}"
        for method, url in (("GET", f"{base}/workflows"),
                            ("POST", f"{base}/workflows/{workflow_id}/terminate")):
            answer = _try(url, method, FOREIGN)
            if answer is None:  # gRPC only: the frontend and the three unpinned ones
                assert port not in {dev_server.http_port, dev_server.metrics_port}, port
                continue
            assert workflow_id not in answer.text, (port, method)
            assert not answer.is_success, (port, method, answer.status_code, answer.text)
            if port == dev_server.http_port:
                assert answer.status_code == 403 and "Host not allowed" in answer.text

    # The refusal is the Host check, not a dead port: the same request on a loopback name.
    listed = _try(f"http://127.0.0.1:{dev_server.http_port}/api/v1/namespaces/{NAMESPACE}"
                  "/workflows", "GET", f"127.0.0.1:{dev_server.http_port}")
    assert listed is not None and workflow_id in listed.text
    description = await client.get_workflow_handle(workflow_id).describe()
    assert description.status == WorkflowExecutionStatus.RUNNING
    await client.get_workflow_handle(workflow_id).terminate("test over")


@pytest.fixture
def ui_proxy(dev_server: DevServer, database_url: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "MODELKEEPER_DATABASE_URL": database_url,
           "MODELKEEPER_API_ALLOWED_HOSTS": ""}
    proc = ManagedProcess("temporal-ui", [
        sys.executable, "-m", "modelkeeper", "temporal-ui", "--upstream", dev_server.ui.url,
        "--bind-host", "127.0.0.1", "--temporal-ui-port", str(port)],
        tmp_path / "temporal-ui.log", env=env)
    proc.start()
    try:
        proc.wait_until(lambda: tcp_accepts("127.0.0.1", port), PROXY_READY_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


async def test_the_ui_opens_to_an_admin_session_on_an_allowed_host_only(
        ui_proxy: str, database_url: str) -> None:
    async with await TokensStore.connect(database_url) as tokens:
        _, admin = await tokens.create_token("alice", OperatorRole.ADMIN)
        _, viewer = await tokens.create_token("grafana", OperatorRole.VIEWER)
    api = f"{ui_proxy}/api/v1/namespaces"
    login = f"{ui_proxy}{temporal_ui.LOGIN_PATH}"
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        # A rebinding page: its own name in Host, whatever it sends.
        for method, url in (("GET", api), ("GET", f"{ui_proxy}/"), ("POST", login)):
            answer = await http.request(method, url, headers={"Host": FOREIGN},
                                        data={"token": admin})
            assert answer.status_code == 400 and "namespaceInfo" not in answer.text
        # An allowed name, but no session: nothing of Temporal's.
        assert (await http.get(api)).status_code == 401
        page = await http.get(f"{ui_proxy}/", headers={"Accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"] == temporal_ui.LOGIN_PATH
        for token in (viewer, "mko-not-a-token", ""):
            refused = await http.post(login, data={"token": token})
            assert refused.status_code == 401 and not refused.cookies

        admitted = await http.post(login, data={"token": admin})
        assert admitted.status_code == 303
        cookie = admitted.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        # The client's jar now holds the session cookie, as a browser would.
        assert temporal_ui.SESSION_COOKIE in http.cookies
        opened = await http.get(api)
        assert opened.status_code == 200 and NAMESPACE in opened.text
        ui_page = await http.get(f"{ui_proxy}/", follow_redirects=True)
        assert ui_page.status_code == 200 and "<html" in ui_page.text
        # The session is no key for a page on another name.
        stolen = await http.get(api, headers={"Host": FOREIGN})
        assert stolen.status_code == 400


class _Tokens:
    def __init__(self) -> None:
        self.admin = True

    async def authenticate(self, token: str) -> object:
        from modelkeeper.store.tokens import OperatorTokenRecord

        if not self.admin:
            return None
        return OperatorTokenRecord.__new__(OperatorTokenRecord)


async def test_a_session_ends_with_its_token_and_its_time() -> None:
    now = [0.0]
    sessions = temporal_ui.Sessions(clock=lambda: now[0])
    tokens = _Tokens()
    tokens_store: TokensStore = tokens  # type: ignore[assignment]
    session = sessions.open("mko-x")
    assert await sessions.valid(session, tokens_store)
    tokens.admin = False  # revoked
    now[0] += temporal_ui.SESSION_RECHECK_S
    assert not await sessions.valid(session, tokens_store)
    tokens.admin = True
    fresh = sessions.open("mko-x")
    now[0] += temporal_ui.SESSION_TTL_S
    assert not await sessions.valid(fresh, tokens_store)
    assert not await sessions.valid(None, tokens_store)


def test_bind_host_keeps_temporal_on_loopback_unless_asked_and_then_warns(
        tmp_path: Path) -> None:
    wide = Settings(bind_host="0.0.0.0", data_dir=tmp_path)
    assert stack.temporal_host(wide) == "127.0.0.1"
    assert stack.temporal_ui_host(wide) == "127.0.0.1"
    assert stack.temporal_exposure(wide) is None
    assert "OPEN TO THE NETWORK" not in stack.banner(wide)
    # A specific address: children still reach Temporal where it is, on loopback.
    lan = Settings(bind_host="10.0.0.5", data_dir=tmp_path, engine_key_secret="x" * 64)
    env = stack.component_env(lan, "postgresql://x")
    assert env["TEMPORAL_ADDRESS"] == f"127.0.0.1:{lan.temporal_port}"

    exposed = Settings(bind_host="0.0.0.0", data_dir=tmp_path, expose_temporal_plaintext=True)
    assert stack.temporal_host(exposed) == "0.0.0.0"
    assert stack.temporal_ui_host(exposed) == "127.0.0.1"
    warning = stack.temporal_exposure(exposed)
    assert warning is not None and "TEMPORAL IS OPEN TO THE NETWORK" in warning
    assert warning in stack.banner(exposed)
    # On loopback the flag changes nothing.
    local = Settings(data_dir=tmp_path, expose_temporal_plaintext=True)
    assert stack.temporal_host(local) == "127.0.0.1" and stack.temporal_exposure(local) is None


def test_the_dev_server_command_pins_its_http_ports_and_hides_its_ui() -> None:
    ui = temporal_server.hidden_ui_listener(8233)
    argv = temporal_server.dev_server_argv(
        host="127.0.0.1", port=7233, http_port=7243, metrics_port=7244, ui=ui,
        db_file=Path("t.db"), namespace=NAMESPACE)
    joined = " ".join(argv)
    assert "--http-port 7243" in joined and "--metrics-port 7244" in joined
    assert temporal_server.http_allowed_hosts_config() in argv
    assert argv[argv.index("--ui-ip") + 1] == ui.host != "127.0.0.1"
    assert ipaddress.ip_address(ui.host).is_loopback
    headless = temporal_server.dev_server_argv(
        host="127.0.0.1", port=7233, http_port=7243, metrics_port=7244, ui=None,
        db_file=Path("t.db"), namespace=NAMESPACE)
    assert "--headless" in headless and "--ui-ip" not in headless
