"""The CA and certificates of `up`'s Temporal mTLS front, made once in the data dir.

One folder (mode 0700, every file 0600) holds:

* ``ca.pem`` and ``ca.key``: a CA of this stack's own, trusted by nothing else. Its key
  never leaves this machine.
* ``server.pem`` and ``server.key``: the front's certificate, for this machine's names and
  addresses. Issued again, from the same CA, when those names change (a new address, a
  new ``--bind-host``): agents trust the CA, not this certificate, so they need nothing new.
* ``agent.pem`` and ``agent.key``: the client certificate agents on other machines present,
  copied there with ``ca.pem`` (:data:`AGENT_FILES`).

Made with the ``cryptography`` package, in-process: no ``openssl`` binary is needed. A new
CA (its files removed) issues both leaves again, which revokes every copied agent file.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
SERVER_CERT_FILE = "server.pem"
SERVER_KEY_FILE = "server.key"
AGENT_CERT_FILE = "agent.pem"
AGENT_KEY_FILE = "agent.key"
#: What an agent on another machine needs copied (with the join token).
AGENT_FILES = (CA_FILE, AGENT_CERT_FILE, AGENT_KEY_FILE)
#: The subject of the agents' certificate: what the front logs for each connection.
AGENT_IDENTITY = "modelkeeper-agent"
#: Ten years for the CA and both certificates: nothing renews them yet (docs/security.md
#: says so), and an expiry would stop every remote agent at once, years from now, with no
#: warning. Revoking is removing the folder (a new CA) and copying the agent files again.
VALIDITY = timedelta(days=3650)
#: Certificates start this long before they are made: a joining machine whose clock is a
#: little behind would otherwise refuse a certificate "not yet valid".
CLOCK_SKEW = timedelta(hours=1)
#: The folder holds the CA's key: only its owner may list or enter it.
FOLDER_MODE = 0o700
FILE_MODE = 0o600


@dataclass(frozen=True)
class MtlsFiles:
    """Where the CA and certificates are (see the module docstring)."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / CA_FILE

    @property
    def server_cert(self) -> Path:
        return self.folder / SERVER_CERT_FILE

    @property
    def server_key(self) -> Path:
        return self.folder / SERVER_KEY_FILE

    @property
    def agent_cert(self) -> Path:
        return self.folder / AGENT_CERT_FILE

    @property
    def agent_key(self) -> Path:
        return self.folder / AGENT_KEY_FILE


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the start, whole or not at all: a
    temporary file renamed over it, so a crash never leaves half a key."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: what every TLS stack here speaks (Python's OpenSSL, the SDK's rustls).
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _make_ca(files: MtlsFiles, *, label: str, now: datetime) -> None:
    key = _new_key()
    name = _name(f"modelkeeper up CA ({label})")
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(files.folder / CA_KEY_FILE, _key_pem(key))
    _write_private(files.ca, _cert_pem(cert))


def _issue(files: MtlsFiles, *, cert_path: Path, key_path: Path, subject: str,
           usage: x509.ObjectIdentifier, alt_names: Sequence[str], now: datetime) -> None:
    """A leaf certificate signed by the folder's CA, for ``usage`` (server or client)."""
    ca_key = serialization.load_pem_private_key(
        (files.folder / CA_KEY_FILE).read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{files.folder / CA_KEY_FILE} is not the EC key up makes; remove "
                         f"{files.folder} and start up again to make a new CA")
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    key = _new_key()
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject)).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                              critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=True, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=False,
                   crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if alt_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_alt_name(n) for n in alt_names]), critical=False)
    _write_private(key_path, _key_pem(key))
    _write_private(cert_path, _cert_pem(builder.sign(ca_key, hashes.SHA256())))


def server_names(cert_path: Path) -> frozenset[str]:
    """The names and addresses a certificate is for (its subject alternative names)."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset([*alt.get_values_for_type(x509.DNSName),
                      *(str(a) for a in alt.get_values_for_type(x509.IPAddress))])


def _canonical(names: Sequence[str]) -> list[str]:
    """``names`` as a certificate holds them: addresses in their short form, no brackets,
    no duplicates."""
    out = []
    for name in names:
        try:
            out.append(str(ipaddress.ip_address(name.strip("[]"))))
        except ValueError:
            out.append(name.lower())
    return list(dict.fromkeys(out))


def ensure_mtls_files(folder: Path, names: Sequence[str], *, now: datetime) -> MtlsFiles:
    """The front's CA and certificates in ``folder``, made on first use and kept.

    ``names``: the host names and addresses the front's certificate must carry, the ones
    agents dial. The server certificate is issued again when they differ from the ones it
    holds; a missing CA makes a new one and issues both certificates again. The folder is
    set to 0700 and every file to 0600 on each call, whoever changed them.
    """
    files = MtlsFiles(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    folder.chmod(FOLDER_MODE)
    wanted = _canonical(names)
    new_ca = not (files.ca.exists() and (folder / CA_KEY_FILE).exists())
    if new_ca:
        _make_ca(files, label=wanted[0] if wanted else "this machine", now=now)
    if new_ca or not (files.agent_cert.exists() and files.agent_key.exists()):
        _issue(files, cert_path=files.agent_cert, key_path=files.agent_key,
               subject=AGENT_IDENTITY, usage=ExtendedKeyUsageOID.CLIENT_AUTH, alt_names=(),
               now=now)
    if (new_ca or not (files.server_cert.exists() and files.server_key.exists())
            or server_names(files.server_cert) != frozenset(wanted)):
        _issue(files, cert_path=files.server_cert, key_path=files.server_key,
               subject=wanted[0] if wanted else "modelkeeper-temporal",
               usage=ExtendedKeyUsageOID.SERVER_AUTH, alt_names=wanted, now=now)
    for path in folder.iterdir():
        path.chmod(FILE_MODE)
    return files
