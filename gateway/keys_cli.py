"""`modelkeeper keys create|ls|revoke`: client API keys for the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from modelkeeper.names import LOCAL_DATABASE_OWNER, local_database_passfile, local_database_url
from modelkeeper.settings import Settings
from modelkeeper.store.routing import ApiKeyRecord, RoutingStore


class LocalDatabaseError(Exception):
    """The database of the local `up` is not this user's to open: a sentence, exit 2."""


def database_url(settings: Settings) -> str:
    """MODELKEEPER_DATABASE_URL, or else the database of a local `modelkeeper up`, as the
    owner of its schema, whose password `up` keeps in a file only its user may read.

    Raises :class:`LocalDatabaseError` naming that file when this user cannot read it
    (another user's `up`, or none has run with this data dir): asyncpg would only say
    that the password was wrong."""
    if settings.database_url:
        return settings.database_url
    passfile = local_database_passfile(settings.data_dir, LOCAL_DATABASE_OWNER)
    try:
        with passfile.open():
            pass
    except OSError as err:
        raise LocalDatabaseError(
            f"MODELKEEPER_DATABASE_URL is unset, and the password file of the local "
            f"`modelkeeper up`'s database, {passfile}, cannot be read ({err.strerror}): "
            "run this as the user who runs `up`, with its --data-dir, or set "
            "MODELKEEPER_DATABASE_URL") from err
    return local_database_url(settings.bind_host, settings.postgres_port,
                              data_dir=settings.data_dir)


def _row(key: ApiKeyRecord) -> str:
    revoked = key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else "-"
    return (f"{key.key_id:<16} {key.prefix + '…':<16} {key.name:<24} "
            f"{key.created_at.isoformat(timespec='seconds'):<26} {revoked}")


async def _run(settings: Settings, action: str, argument: str | None,
               out: Callable[[str], None]) -> int:
    routes = await RoutingStore.connect(database_url(settings), max_size=1)
    try:
        if action == "create":
            record, key = await routes.create_api_key(argument or "unnamed")
            out(key)
            out(f"# key {record.key_id} ({record.name}); it is shown this once, only its "
                "hash is stored. Send it as `Authorization: Bearer <key>`.")
            return 0
        if action == "ls":
            out(f"{'ID':<16} {'PREFIX':<16} {'NAME':<24} {'CREATED':<26} REVOKED")
            for record in await routes.list_api_keys():
                out(_row(record))
            return 0
        if action == "revoke":
            assert argument is not None
            revoked = await routes.revoke_api_keys(argument)
            if not revoked:
                out(f"no active key has the id or prefix {argument!r}")
                return 1
            for record in revoked:
                out(f"revoked {record.key_id} ({record.name}, {record.prefix}…)")
            return 0
        raise ValueError(f"unknown keys action {action!r}")
    finally:
        await routes.close()


def run_keys_command(settings: Settings, action: str, argument: str | None,
                     out: Callable[[str], None]) -> int:
    """Run one `keys` action against the store; the exit code."""
    return asyncio.run(_run(settings, action, argument, out))
