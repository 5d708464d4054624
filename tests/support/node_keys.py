"""A node's key epoch as the store holds it, for tests that derive an engine's key from the
cluster secret as the gateway does (``replica_engine_key(..., key_epoch=...)``)."""

from __future__ import annotations

import asyncpg


async def key_epoch(database_url: str, node_id: str) -> str | None:
    """``nodes.key_epoch`` of ``node_id`` (migration 0015); None for an unknown node or one
    without an epoch."""
    conn = await asyncpg.connect(database_url)
    try:
        epoch: str | None = await conn.fetchval(
            "SELECT key_epoch FROM nodes WHERE node_id = $1", node_id)
        return epoch
    finally:
        await conn.close()
