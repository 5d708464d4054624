"""Operator tokens for the control API (migration 0010): create, list, revoke, and find
the one a request presents.

Stored as client API keys are (:mod:`.routing`): a SHA-256 of a 256-bit random token
(:func:`.routing.hash_key`), and a short prefix in clear to tell tokens apart. A presented
token is found by its hash, an index lookup: the secret itself is never compared, so how
long a refusal takes says nothing about it.

One of the stores on the pool :class:`~.stores.Store` owns (``store.tokens``), as
:mod:`.operations` is; the `tokens` command opens a pool of its own (:meth:`connect`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Self

import asyncpg

from ..domain.operators import OperatorRole
from .pool import open_pool
from .routing import hash_key

#: Operator tokens look like ``mko-`` + 43 URL-safe characters (256 random bits); the
#: prefix tells one apart from a gateway client key (``mkc-``) at a glance.
OPERATOR_TOKEN_PREFIX = "mko-"
#: Characters kept in clear as a token's ``prefix``: ``mko-`` and 8 random ones, as for
#: client keys (48 bits: enough to tell tokens apart, far too few to guess the rest).
TOKEN_PREFIX_CHARS = len(OPERATOR_TOKEN_PREFIX) + 8

_COLUMNS = "token_id, name, role, prefix, created_at, revoked_at, scope"


@dataclass(frozen=True, slots=True)
class OperatorTokenRecord:
    """An operator token as listed: never the token itself."""

    token_id: str
    name: str
    role: OperatorRole
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    #: The scope of the tenancy tree it is bound to (migration 0021): it changes only the
    #: deployments owned there. None: unbound.
    scope: str | None = None


def _token(row: asyncpg.Record) -> OperatorTokenRecord:
    return OperatorTokenRecord(**{**dict(row), "role": OperatorRole(row["role"])})


def new_operator_token() -> str:
    """A fresh random operator token."""
    return OPERATOR_TOKEN_PREFIX + secrets.token_urlsafe(32)


class TokensStore:
    """The ``operator_tokens`` table over a pool."""

    def __init__(self, pool: asyncpg.Pool, *, owns_pool: bool = False) -> None:
        self._pool = pool
        self._owns_pool = owns_pool

    @classmethod
    async def connect(cls, dsn: str) -> Self:
        """A one-connection pool of its own, the schema brought up to date (the `tokens`
        command and `up` run before, or without, any API)."""
        return cls(await open_pool(dsn, max_size=1), owns_pool=True)

    async def close(self) -> None:
        """Close the pool if :meth:`connect` opened it."""
        if self._owns_pool:
            await self._pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def create_token(self, name: str, role: OperatorRole, *, scope: str | None = None
                           ) -> tuple[OperatorTokenRecord, str]:
        """Store a new token's hash; return its record and the token, which exists
        nowhere else. ``scope``: bind it to that scope of the tenancy tree."""
        token = new_operator_token()
        row = await self._pool.fetchrow(
            f"""
            INSERT INTO operator_tokens (token_id, name, role, prefix, token_sha256, scope)
            VALUES ($1, $2, $3, $4, $5, $6)
            RETURNING {_COLUMNS}
            """,
            "tok-" + secrets.token_hex(6), name, role.value, token[:TOKEN_PREFIX_CHARS],
            hash_key(token), scope)
        assert row is not None
        return _token(row), token

    async def list_tokens(self) -> list[OperatorTokenRecord]:
        """Every token, revoked ones included, oldest first."""
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM operator_tokens ORDER BY created_at, token_id")
        return [_token(row) for row in rows]

    async def revoke_tokens(self, id_or_prefix: str) -> list[OperatorTokenRecord]:
        """Revoke the active tokens whose id or prefix is ``id_or_prefix``; return them."""
        rows = await self._pool.fetch(
            f"""
            UPDATE operator_tokens SET revoked_at = now()
            WHERE (token_id = $1 OR prefix = $1) AND revoked_at IS NULL
            RETURNING {_COLUMNS}
            """,
            id_or_prefix)
        return [_token(row) for row in rows]

    async def authenticate(self, token: str) -> OperatorTokenRecord | None:
        """The active token ``token`` is, found by its hash; None when unknown or revoked.

        Read on every request, not cached: a revoked token stops working at once."""
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM operator_tokens "
            "WHERE token_sha256 = $1 AND revoked_at IS NULL", hash_key(token))
        return None if row is None else _token(row)
