"""Engine API keys: derivation format, separation between replicas, verification."""

from __future__ import annotations

import hashlib
import hmac
import string

import pytest

from modelkeeper.domain.engine_keys import KEY_PREFIX, derive_engine_key, verify_engine_key

pytestmark = pytest.mark.timeout(30)

SECRET = b"s3cret-cluster-key-0123456789abcdef"


def test_key_is_prefixed_hmac_sha256_hex() -> None:
    # The gateway derives the same key on its own, so the format is a contract.
    key = derive_engine_key(SECRET, "rep-1")
    expected = hmac.new(SECRET, b"rep-1", hashlib.sha256).hexdigest()
    assert key == KEY_PREFIX + expected
    assert key.startswith("mk-")
    assert len(key) == 3 + 64 and set(key[3:]) <= set(string.hexdigits.lower())


def test_derivation_is_deterministic() -> None:
    assert derive_engine_key(SECRET, "rep-1") == derive_engine_key(SECRET, "rep-1")


@pytest.mark.parametrize(
    ("secret_a", "replica_a", "secret_b", "replica_b"),
    [
        (SECRET, "rep-1", SECRET, "rep-2"),
        (SECRET, "rep-1", b"another-secret", "rep-1"),
        (SECRET, "rep-1", SECRET, "rep-1 "),
    ],
)
def test_different_inputs_give_different_keys(
    secret_a: bytes, replica_a: str, secret_b: bytes, replica_b: str
) -> None:
    assert derive_engine_key(secret_a, replica_a) != derive_engine_key(secret_b, replica_b)


@pytest.mark.parametrize(("secret", "replica"), [(b"", "rep-1"), (SECRET, "")])
def test_empty_inputs_are_refused(secret: bytes, replica: str) -> None:
    with pytest.raises(ValueError):
        derive_engine_key(secret, replica)


@pytest.mark.parametrize(
    ("presented", "ok"),
    [
        (derive_engine_key(SECRET, "rep-1"), True),
        (derive_engine_key(SECRET, "rep-2"), False),
        (derive_engine_key(b"other", "rep-1"), False),
        (derive_engine_key(SECRET, "rep-1").upper(), False),
        (derive_engine_key(SECRET, "rep-1")[:-1], False),
        (derive_engine_key(SECRET, "rep-1")[3:], False),
        ("", False),
        ("mk-ünïcode", False),
        ("mk-\ud800", False),
    ],
)
def test_verify(presented: str, ok: bool) -> None:
    assert verify_engine_key(SECRET, "rep-1", presented) is ok
