"""The one pool every store of a process shares: how it opens, and how its rows read.

:class:`~.stores.Store` owns the pool and hands it to each store of an aggregate
(nodes, placement, deployments, ...); :meth:`.TokensStore.connect` opens one of its own
the same way.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pydantic_core

from ..domain.nodes import PortRange
from .schema import apply_migrations


def decode_jsonb(text: str) -> Any:
    """A jsonb value as the Python value ``json.loads`` gives, three times faster.

    pydantic_core's parser: placement decodes three jsonb columns of every node, and with
    ``json.loads`` that was a fifth of its time at 1,000 nodes. The two agree on what
    PostgreSQL prints (big integers, float rounding, escapes: tests/integration/
    test_placement_views.py), except that this one refuses nesting deeper than 200
    levels, which only a model's free-form ``engine_args`` could reach: those go to
    ``json.loads``, so such a model stays readable.
    """
    try:
        return pydantic_core.from_json(text)
    except ValueError:
        return json.loads(text)


async def init_connection(conn: asyncpg.Connection) -> None:
    # jsonb columns come back as Python objects, not strings.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=decode_jsonb,
                              schema="pg_catalog")


async def open_pool(dsn: str, *, min_size: int = 1, max_size: int = 10,
                    migrate: bool = True) -> asyncpg.Pool:
    """Open a pool to ``dsn`` and, unless told not to, bring the schema up to date (see
    :func:`.schema.apply_migrations`); the pool is closed again if that fails."""
    pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size,
                                     init=init_connection)
    if migrate:
        try:
            await apply_migrations(pool)
        except BaseException:
            await pool.close()
            raise
    return pool


def record(row: asyncpg.Record) -> dict[str, Any]:
    return dict(row.items())


def port_range(low: int | None, high: int | None) -> PortRange | None:
    return None if low is None or high is None else PortRange(low=low, high=high)
