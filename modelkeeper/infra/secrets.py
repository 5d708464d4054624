"""Reading secrets the same way in every process, and making new ones.

The API and the gateway derive keys from one cluster secret (the API each node's key, the
gateway each engine's too); if they looked for it in different places, the gateway would
send keys the engines refuse. Agents hold no cluster secret at all: they get their node's
key at registration (:mod:`modelkeeper.domain.engine_keys`).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from ..domain.engine_keys import NODE_CREDENTIAL_PREFIX
from ..settings import Settings

#: Random bytes in a node credential: 256 bits, so its stored SHA-256 cannot be searched.
CREDENTIAL_BYTES = 32
#: Random bytes in a node's key epoch: it need not be secret (the cluster secret is), only
#: never drawn twice for one node id; 128 bits never repeat.
KEY_EPOCH_BYTES = 16


def read_engine_key_secret(settings: Settings) -> str | None:
    """MODELKEEPER_ENGINE_KEY_SECRET, or else the file `up` keeps in its data dir."""
    if settings.engine_key_secret:
        return settings.engine_key_secret
    try:
        return settings.engine_key_secret_file.read_text().strip() or None
    except FileNotFoundError:
        return None


def read_previous_engine_key_secret(settings: Settings) -> str | None:
    """The secret being rotated out (``engine_key_secret_previous``), while its grace
    period lasts; None otherwise. The gateway falls back to keys derived from it for
    engines started before the rotation (docs/security.md, "Rotating the cluster
    secret")."""
    return settings.engine_key_secret_previous or None


def _read_token_file(path: Path, field: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as err:
        raise ValueError(f"{field} = {str(path)!r}: cannot read it ({err.strerror})") from err
    if not token:
        raise ValueError(f"{field} = {str(path)!r}: the file is empty")
    return token


def read_join_token(settings: Settings) -> str | None:
    """The join token: MODELKEEPER_JOIN_TOKEN, or else the file ``join_token_file`` names
    (``--join-token-file``, which keeps it off the command line). None when neither is set.

    Raises ``ValueError`` naming the setting when the file cannot be read or is empty: an
    agent that meant to present a token must not quietly present none.
    """
    if settings.join_token:
        return settings.join_token
    if settings.join_token_file is not None:
        return _read_token_file(settings.join_token_file, "join_token_file")
    return None


def read_metrics_token(settings: Settings) -> str | None:
    """The token the gateway's /metrics asks of a scraper: the file
    ``gateway_metrics_token_file`` names, read once at start; None when unset. Raises
    ``ValueError`` naming the setting when the file cannot be read or is empty."""
    if settings.gateway_metrics_token_file is None:
        return None
    return _read_token_file(settings.gateway_metrics_token_file, "gateway_metrics_token_file")


def new_node_credential() -> str:
    """A fresh node credential: ``mkc-`` + 256 random bits, base64url."""
    return NODE_CREDENTIAL_PREFIX + secrets.token_urlsafe(CREDENTIAL_BYTES)


def new_key_epoch() -> str:
    """A fresh key epoch for a node that joins (:func:`~modelkeeper.domain.engine_keys.
    derive_node_key`): hex, so it holds no NUL."""
    return secrets.token_hex(KEY_EPOCH_BYTES)
