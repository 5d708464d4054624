"""`up`'s Temporal mTLS front: the door agents on other machines use (issue 19, finding 2).

Under ``--bind-host`` the dev server stays on loopback; `up` makes a CA of its own and
certificates in ``<data_dir>/temporal-mtls`` and runs ``modelkeeper temporal-front`` on the
bind host, which requires a client certificate from that CA. Checked here against the
real dev server and a real Temporal client (modelkeeper.infra.temporal.connect):

* a client with the agent certificate `up` made gets through, in process and through the
  ``temporal-front`` command `up` supervises;
* a client without a certificate, and one with a certificate from another CA, do not;
* the files are 0600 in a 0700 folder, made once and kept;
* the API hands an agent on another machine the front's address, not the dev server's.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import stat
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from cli import stack
from modelkeeper.infra import pki, temporal
from modelkeeper.infra.processes import ManagedProcess, free_port, tcp_accepts
from modelkeeper.infra.tls_front import TlsFront, server_context
from modelkeeper.settings import Settings
from tests.security.test_nodes_and_keys import (
    JOIN_TOKEN,
    REMOTE_PEER,
    bearer,
    node_api,
    registration,
)

pytestmark = pytest.mark.timeout(60)

#: The names `up` would put on the front's certificate on a machine of the LAN.
NAMES = ["stack.lan", "10.0.0.5", *stack.LOOPBACK_NAMES]
#: A refused handshake fails at once; this only bounds a hang.
REFUSAL_TIMEOUT_S = 20.0
#: `python -m modelkeeper temporal-front` imports and listens in about a second.
FRONT_START_TIMEOUT_S = 30.0


def _now() -> datetime:
    return datetime.now(UTC)


def _agent_settings(files: pki.MtlsFiles) -> Settings:
    """What an agent on another machine sets, with the three files copied from `up`'s."""
    return Settings(temporal_tls_ca_file=files.ca, temporal_tls_cert_file=files.agent_cert,
                    temporal_tls_key_file=files.agent_key)


@pytest.fixture
def files(tmp_path: Path) -> pki.MtlsFiles:
    return pki.ensure_mtls_files(tmp_path / "temporal-mtls", NAMES, now=_now())


@pytest.fixture
async def front(files: pki.MtlsFiles,
                local_temporal_env: WorkflowEnvironment) -> AsyncIterator[TlsFront]:
    host, _, port = local_temporal_env.client.service_client.config.target_host.rpartition(":")
    context = server_context(ca_file=files.ca, cert_file=files.server_cert,
                             key_file=files.server_key)
    tls_front = TlsFront(context, upstream_host=host, upstream_port=int(port))
    await tls_front.start("127.0.0.1", 0)
    try:
        yield tls_front
    finally:
        await tls_front.close()


async def test_an_agent_with_up_s_certificate_reaches_temporal(
        files: pki.MtlsFiles, front: TlsFront,
        local_temporal_env: WorkflowEnvironment) -> None:
    security = temporal.security_from_settings(_agent_settings(files))
    # No server name set: the client checks 127.0.0.1, which is on the certificate.
    client = await temporal.connect(f"127.0.0.1:{front.port}",
                                    local_temporal_env.client.namespace, security=security)
    # A real call through the front, beyond the handshake connect already made.
    assert [w async for w in client.list_workflows()] == []
    assert front.identities and set(front.identities) == {pki.AGENT_IDENTITY}


async def _refused(settings: Settings, front: TlsFront, namespace: str) -> None:
    security = temporal.security_from_settings(settings)
    with pytest.raises(RuntimeError, match="Failed client connect"):
        await asyncio.wait_for(
            temporal.connect(f"127.0.0.1:{front.port}", namespace, security=security),
            REFUSAL_TIMEOUT_S)
    assert front.identities == []


async def test_a_client_without_a_certificate_is_refused(
        files: pki.MtlsFiles, front: TlsFront,
        local_temporal_env: WorkflowEnvironment) -> None:
    await _refused(Settings(temporal_tls_ca_file=files.ca), front,
                   local_temporal_env.client.namespace)


async def test_a_certificate_from_another_ca_is_refused(
        tmp_path: Path, files: pki.MtlsFiles, front: TlsFront,
        local_temporal_env: WorkflowEnvironment) -> None:
    # Another stack's agent files: a CA of its own, unknown to this front.
    other = pki.ensure_mtls_files(tmp_path / "other-stack", NAMES, now=_now())
    await _refused(Settings(temporal_tls_ca_file=files.ca,
                            temporal_tls_cert_file=other.agent_cert,
                            temporal_tls_key_file=other.agent_key), front,
                   local_temporal_env.client.namespace)


def test_the_front_speaks_tls_1_2_or_later_and_requires_a_certificate(
        files: pki.MtlsFiles) -> None:
    context = server_context(ca_file=files.ca, cert_file=files.server_cert,
                             key_file=files.server_key)
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_REQUIRED
    context.verify_mode = ssl.CERT_OPTIONAL
    with pytest.raises(ValueError, match="CERT_REQUIRED"):
        TlsFront(context, upstream_host="127.0.0.1", upstream_port=1)


def test_up_s_ca_and_certificates_are_private_and_made_once(tmp_path: Path) -> None:
    folder = tmp_path / "data" / "temporal-mtls"
    files = pki.ensure_mtls_files(folder, NAMES, now=_now())
    assert stat.S_IMODE(folder.stat().st_mode) == pki.FOLDER_MODE == 0o700
    made = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(made) == {pki.CA_FILE, pki.CA_KEY_FILE, pki.SERVER_CERT_FILE,
                         pki.SERVER_KEY_FILE, pki.AGENT_CERT_FILE, pki.AGENT_KEY_FILE}
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert pki.server_names(files.server_cert) == {"stack.lan", "10.0.0.5", "localhost",
                                                   "127.0.0.1", "::1"}

    # Loosened by hand, tightened again; nothing made again.
    folder.chmod(0o755)
    files.agent_key.chmod(0o644)
    pki.ensure_mtls_files(folder, NAMES, now=_now())
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(files.agent_key.stat().st_mode) == 0o600
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == made

    # A new address: a new server certificate from the same CA; agents' copies still hold.
    pki.ensure_mtls_files(folder, [*NAMES, "10.0.0.6"], now=_now())
    assert "10.0.0.6" in pki.server_names(files.server_cert)
    for name in (pki.CA_FILE, pki.CA_KEY_FILE, pki.AGENT_CERT_FILE, pki.AGENT_KEY_FILE):
        assert (folder / name).read_bytes() == made[name], name


async def test_the_temporal_front_command_up_runs_admits_the_agent_certificate(
        tmp_path: Path, local_temporal_env: WorkflowEnvironment) -> None:
    settings = Settings(data_dir=tmp_path, bind_host="127.0.0.1")
    files = pki.ensure_mtls_files(settings.temporal_mtls_dir, NAMES, now=_now())
    port = free_port()
    upstream = local_temporal_env.client.service_client.config.target_host
    proc = ManagedProcess(stack.TEMPORAL_FRONT, [
        sys.executable, "-m", "modelkeeper", "temporal-front", "--upstream", upstream,
        "--bind-host", "127.0.0.1", "--temporal-mtls-port", str(port),
        "--data-dir", str(tmp_path)], tmp_path / "front.log")
    proc.start()
    try:
        await asyncio.to_thread(proc.wait_until, lambda: tcp_accepts("127.0.0.1", port),
                                FRONT_START_TIMEOUT_S)
        client = await temporal.connect(
            f"127.0.0.1:{port}", local_temporal_env.client.namespace,
            security=temporal.security_from_settings(_agent_settings(files)))
        assert [w async for w in client.list_workflows()] == []
        security = temporal.security_from_settings(Settings(temporal_tls_ca_file=files.ca))
        with pytest.raises(RuntimeError, match="Failed client connect"):
            await asyncio.wait_for(temporal.connect(
                f"127.0.0.1:{port}", local_temporal_env.client.namespace,
                security=security), REFUSAL_TIMEOUT_S)
    finally:
        proc.stop(grace=0)


def test_up_runs_the_front_only_when_temporal_stays_on_loopback(tmp_path: Path) -> None:
    wide = Settings(bind_host="0.0.0.0", data_dir=tmp_path, engine_key_secret="x" * 64)
    assert stack.temporal_mtls_front(wide)
    assert stack.component_env(wide, "postgresql://x")["MODELKEEPER_AGENT_TEMPORAL_PORT"] \
        == str(wide.temporal_mtls_port)
    plaintext = wide.model_copy(update={"expose_temporal_plaintext": True})
    local = Settings(data_dir=tmp_path, engine_key_secret="x" * 64)
    for settings in (plaintext, local):
        assert not stack.temporal_mtls_front(settings)
        assert "MODELKEEPER_AGENT_TEMPORAL_PORT" not in stack.component_env(
            settings, "postgresql://x")


def test_the_banner_says_which_files_an_agent_copies_and_what_it_sets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "machine_names", lambda: ["host-a", "10.0.0.5"])
    text = stack.banner(Settings(bind_host="0.0.0.0", data_dir=tmp_path),
                        join_token_file=tmp_path / "join-token")
    folder = tmp_path / "temporal-mtls"
    assert f"Temporal mTLS  10.0.0.5:{Settings().temporal_mtls_port}" in text
    for name in ("ca.pem", "agent.pem", "agent.key"):
        assert str(folder / name) in text
    for var in ("MODELKEEPER_TEMPORAL_TLS_CA_FILE=DIR/ca.pem",
                "MODELKEEPER_TEMPORAL_TLS_CERT_FILE=DIR/agent.pem",
                "MODELKEEPER_TEMPORAL_TLS_KEY_FILE=DIR/agent.key"):
        assert var in text
    assert "OPEN TO THE NETWORK" not in text


async def test_the_api_hands_a_remote_agent_the_mtls_front(
        tmp_path: Path, local_temporal_env: WorkflowEnvironment, database_url: str) -> None:
    # The port as `up` hands it to its API.
    env = stack.component_env(Settings(bind_host="0.0.0.0", data_dir=tmp_path,
                                       engine_key_secret="x" * 64), "postgresql://x")
    port = int(env["MODELKEEPER_AGENT_TEMPORAL_PORT"])
    async with node_api(local_temporal_env, database_url, client=REMOTE_PEER,
                        agent_temporal_port=port, api_allowed_hosts=["stack.lan"]) as remote:
        remote.http.base_url = "http://stack.lan"
        resp = await remote.http.post(
            "/nodes/register", json=registration("n-far", engine_host=REMOTE_PEER[0]),
            headers=bearer(JOIN_TOKEN))
        assert resp.status_code == 200, resp.text
        assert resp.json()["temporal_address"] == f"stack.lan:{port}"
    # `up`'s own agent, on loopback, keeps the dev server's own address.
    async with node_api(local_temporal_env, database_url,
                        agent_temporal_port=port) as local:
        resp = await local.http.post("/nodes/register", json=registration("n-here"),
                                     headers=bearer(JOIN_TOKEN))
        assert resp.status_code == 200, resp.text
        assert resp.json()["temporal_address"] == \
            local_temporal_env.client.service_client.config.target_host


def test_the_front_s_port_is_checked_only_when_the_front_runs(tmp_path: Path) -> None:
    # Every port `up` needs, free, except the front's, which another program holds.
    ports = {use.field: free_port() for use in stack.PORTS}
    local = Settings(data_dir=tmp_path, **ports)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        held = taken.getsockname()[1]
        stack.check_ports(local.model_copy(update={"temporal_mtls_port": held}))
        wide = local.model_copy(update={"bind_host": "0.0.0.0", "temporal_mtls_port": held})
        with pytest.raises(stack.StackError, match="Temporal's mTLS front"):
            stack.check_ports(wide)
