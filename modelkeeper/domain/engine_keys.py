"""Engine API keys, derived rather than stored: the one module that derives them.

Two steps, so that no node holds a secret that opens another node's engines:

1. **Node key** = ``mkn-`` + HMAC-SHA256(cluster secret, ``NODE_KEY_CONTEXT_V2`` + node
   id + NUL + key epoch), in hex. The key epoch is random, drawn when the node joins
   (``nodes.key_epoch``, migration 0015) and kept while it re-registers, so a node removed
   and joined again (the remedy for a stolen credential) gets a new key, and a running
   engine keeps matching across agent restarts. A node that joined before epochs has none
   (None here): its key is the first scheme's, ``NODE_KEY_CONTEXT`` + node id, until it
   joins again. The API derives it and hands it to the node's agent at registration; the
   cluster secret itself never leaves the API and the gateway.
2. **Engine key** = ``mk-`` + HMAC-SHA256(node key, replica id), in hex. The agent derives
   it from its node key for each engine it starts; the gateway, which holds the cluster
   secret, derives both steps (:func:`replica_engine_key`).

A node key yields the keys of replicas on that node only: the key of a replica on another
node is keyed by that node's key, which is an HMAC output the first node cannot compute.
Keys are never written to the database or sent over Temporal; a key leaked from one
replica opens no other.

The agent imports this module to derive, the gateway to derive both steps; neither
imports the other.
"""

from __future__ import annotations

import hashlib
import hmac

#: Marks a string as a modelkeeper engine key, so one found in a log is recognisable.
KEY_PREFIX = "mk-"
#: Marks a node key (what an agent gets at registration).
NODE_KEY_PREFIX = "mkn-"
#: Marks a node's credential (what an agent presents on every call after registering).
#: Every prefix of ours is ``mk``, at most one letter and ``-``: one pattern scrubs them
#: all (:mod:`modelkeeper.domain.redact`).
NODE_CREDENTIAL_PREFIX = "mkc-"

#: Prefixed to the node id before it is MACed: a node key is then never the HMAC of a
#: bare string that some other use of the cluster secret might also MAC (an older release
#: derived engine keys as HMAC(secret, replica id), and a node could be named like a
#: replica).
NODE_KEY_CONTEXT = b"modelkeeper node key v1\x00"
#: ... and of the node keys with a key epoch. Another context, so that no node id and
#: epoch MAC to what some id alone did under the first. Epochs and ids hold no NUL
#: (checked below), so the separator is unambiguous.
NODE_KEY_CONTEXT_V2 = b"modelkeeper node key v2\x00"


def _mac_hex(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def derive_node_key(secret: bytes, node_id: str, *, key_epoch: str | None = None) -> str:
    """The node key of ``node_id`` in ``key_epoch``: ``mkn-`` + 64 hex digits. The API's
    and the gateway's. ``key_epoch`` None: a node that joined before epochs (the first
    scheme, which depends on the id alone)."""
    if not secret:
        # HMAC with an empty key is a plain hash of a guessable id: no secret at all.
        raise ValueError("the engine key secret must not be empty")
    if not node_id:
        raise ValueError("node_id must not be empty")
    if key_epoch is None:
        return NODE_KEY_PREFIX + _mac_hex(secret, NODE_KEY_CONTEXT + node_id.encode("utf-8"))
    if not key_epoch or "\x00" in key_epoch or "\x00" in node_id:
        raise ValueError("a key epoch must be non-empty, and neither it nor the node id "
                         "may hold NUL")
    return NODE_KEY_PREFIX + _mac_hex(
        secret, NODE_KEY_CONTEXT_V2 + node_id.encode("utf-8") + b"\x00"
        + key_epoch.encode("utf-8"))


def derive_engine_key(key: bytes, replica_id: str) -> str:
    """The API key of the engine serving ``replica_id``: ``mk-`` + 64 hex digits.

    ``key`` is the node key of the node the replica's rank 0 runs on (as bytes: the
    agent's ``node_key.encode()``).
    """
    if not key:
        raise ValueError("the node key must not be empty")
    if not replica_id:
        raise ValueError("replica_id must not be empty")
    return KEY_PREFIX + _mac_hex(key, replica_id.encode("utf-8"))


def replica_engine_key(secret: bytes, *, node_id: str, replica_id: str,
                       key_epoch: str | None = None) -> str:
    """Both steps at once: the key the gateway sends to ``replica_id`` on ``node_id`` in
    ``key_epoch`` (the one recorded with the replica's endpoint)."""
    return derive_engine_key(derive_node_key(secret, node_id, key_epoch=key_epoch).encode(),
                             replica_id)


def verify_engine_key(key: bytes, replica_id: str, presented: str) -> bool:
    """Whether ``presented`` is the key of ``replica_id`` under ``key``, compared in
    constant time.

    Constant time so that the response time of a wrong guess does not reveal how many
    leading characters were right.
    """
    expected = derive_engine_key(key, replica_id)
    # Compared as bytes: compare_digest refuses non-ASCII str, and a presented key comes
    # from outside, so it may hold anything, lone surrogates included.
    return hmac.compare_digest(
        expected.encode("utf-8"), presented.encode("utf-8", errors="surrogatepass")
    )

