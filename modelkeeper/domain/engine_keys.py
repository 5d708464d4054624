"""Per-replica engine API keys, derived rather than stored.

Each engine process gets its own key, ``mk-`` + HMAC-SHA256(secret, replica id) in hex.
Anything holding the cluster secret (the agent that starts the engine, the gateway that
calls it) computes the same key independently, so keys are never written to the
database or sent over the wire, and a key leaked from one replica opens no other.
"""

from __future__ import annotations

import hashlib
import hmac

#: Marks a string as a modelkeeper engine key, so one found in a log is recognisable.
KEY_PREFIX = "mk-"


def derive_engine_key(secret: bytes, replica_id: str) -> str:
    """The API key of the engine serving ``replica_id``: ``mk-`` + 64 hex digits."""
    if not secret:
        # HMAC with an empty key is a plain hash of a guessable id: no secret at all.
        raise ValueError("the engine key secret must not be empty")
    if not replica_id:
        raise ValueError("replica_id must not be empty")
    digest = hmac.new(secret, replica_id.encode("utf-8"), hashlib.sha256).hexdigest()
    return KEY_PREFIX + digest


def verify_engine_key(secret: bytes, replica_id: str, presented: str) -> bool:
    """Whether ``presented`` is the key of ``replica_id``, compared in constant time.

    Constant time so that the response time of a wrong guess does not reveal how many
    leading characters were right.
    """
    expected = derive_engine_key(secret, replica_id)
    # Compared as bytes: compare_digest refuses non-ASCII str, and a presented key comes
    # from outside, so it may hold anything, lone surrogates included.
    return hmac.compare_digest(
        expected.encode("utf-8"), presented.encode("utf-8", errors="surrogatepass")
    )
