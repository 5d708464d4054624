"""The gateway's database role (migration 0013): what a taken-over gateway could do to
the store with its connection, tried as an attacker would, and that the gateway still
serves on it.

As ``modelkeeper_gateway``: no CREATE, ALTER, DROP or TRUNCATE; no reading of nodes,
models, events or operator tokens; no writing of routes. It reads routes and key hashes,
and writes its own usage rows. The migration runs again harmlessly, skips a role it may
not create, and grants a role the operator made (Compose's setup).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from cli.postgres import GATEWAY_ROLE, ensure_role
from gateway.server import GatewayServer
from modelkeeper.store import Store
from modelkeeper.store.routing import RoutingStore
from modelkeeper.store.schema import MIGRATIONS_DIR
from tests.conftest import PgServer
from tests.support.gateway_support import (
    SECRET,
    add_deployment,
    add_replica,
    ready_replicas,
    settings_for,
    sims,
    until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "sim-role"
MIGRATION = MIGRATIONS_DIR / "0013_gateway_role.sql"
#: The gateway writes usage every flush interval (0.05 s here); this allows for a busy CI.
USAGE_TIMEOUT_S = 10.0

#: Statements the gateway's role must be refused, each an attack on the schema or on data
#: the gateway has no business with.
REFUSED = [
    "CREATE TABLE stolen (x int)",
    "ALTER TABLE replicas ADD COLUMN evil text",
    "ALTER TABLE api_keys DROP COLUMN revoked_at",
    "DROP TABLE replica_usage",
    "TRUNCATE deployments",
    "CREATE FUNCTION evil() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE INDEX evil ON replicas (endpoint)",
    "DROP TRIGGER replicas_notify ON replicas",
    "SELECT * FROM operator_tokens",
    "SELECT * FROM nodes",
    "SELECT * FROM models",
    "SELECT * FROM events",
    "SELECT * FROM schema_version",
    # Re-routing traffic to an endpoint of the attacker's, or deleting routes.
    "UPDATE replicas SET endpoint = 'http://attacker:1'",
    "DELETE FROM deployments",
    "INSERT INTO api_keys (key_id, name, prefix, key_sha256) VALUES ('k', 'n', 'p', 'h')",
    "UPDATE api_keys SET revoked_at = NULL",
]


def _gateway_url(pg_server: PgServer, database_url: str) -> str:
    return pg_server.url(urlsplit(database_url).path.lstrip("/"), role=GATEWAY_ROLE)


@pytest.fixture
async def as_gateway(pg_server: PgServer,
                     database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(_gateway_url(pg_server, database_url))
    try:
        yield conn
    finally:
        await conn.close()


@pytest.mark.parametrize("statement", REFUSED)
async def test_the_gateway_role_is_refused(as_gateway: asyncpg.Connection,
                                           statement: str) -> None:
    assert await as_gateway.fetchval("SELECT current_user") == GATEWAY_ROLE
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_gateway.execute(statement)


async def test_the_gateway_role_cannot_migrate(pg_server: PgServer, database_url: str) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await RoutingStore.connect(_gateway_url(pg_server, database_url), max_size=1,
                                   migrate=True)


async def test_the_gateway_serves_and_writes_usage_on_its_role(
        tmp_path: Path, pg_server: PgServer, database_url: str) -> None:
    gateway_url = _gateway_url(pg_server, database_url)
    owner = await asyncpg.connect(database_url)
    keys = await RoutingStore.connect(database_url, max_size=1, migrate=False)
    try:
        deployment = await add_deployment(owner, MODEL)
        _, key = await keys.create_api_key("role-test")
        async with sims(tmp_path, MODEL, "r-role") as (sim,):
            await add_replica(owner, deployment, sim.replica_id, sim.url)
            # No owner DSN at all: only its own role's.
            settings = settings_for(
                gateway_url, gateway_database_url=gateway_url, gateway_auth=True,
                usage_flush_interval_s=0.05).model_copy(update={"database_url": None})
            server = GatewayServer(settings, engine_key_secret=SECRET)
            await server.start()
            try:
                assert not settings.gateway_migrates
                await until(lambda: ready_replicas(server, MODEL) == ["r-role"], what="routed")
                async with httpx.AsyncClient(timeout=20) as http:
                    resp = await http.post(
                        server.url + "/v1/chat/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["message"]["content"] == "the quick"
                deadline = time.monotonic() + USAGE_TIMEOUT_S
                while not any(row.last_used_at for row in await keys.replica_usage("r-role")):
                    assert time.monotonic() < deadline, "no usage row written on the role"
                    await asyncio.sleep(0.05)
            finally:
                await server.stop()
        # A stopping gateway deletes its rows, on its role too.
        assert await keys.replica_usage("r-role") == []
    finally:
        await keys.close()
        await owner.close()


async def test_the_migration_runs_again_harmlessly(database_url: str) -> None:
    owner = await asyncpg.connect(database_url)
    try:
        await owner.execute(MIGRATION.read_text())
        granted = await owner.fetch(
            "SELECT table_name, privilege_type FROM information_schema.role_table_grants "
            "WHERE grantee = $1 ORDER BY 1, 2", GATEWAY_ROLE)
    finally:
        await owner.close()
    by_table: dict[str, set[str]] = {}
    for row in granted:
        by_table.setdefault(row["table_name"], set()).add(row["privilege_type"])
    write = {"SELECT", "INSERT", "UPDATE", "DELETE"}
    assert by_table == {"deployments": {"SELECT"}, "replicas": {"SELECT"},
                        "api_keys": {"SELECT"}, "replica_usage": write,
                        "deployment_usage": write}


@pytest.fixture
async def owner_without_createrole(pg_server: PgServer,
                                   pg_template: str) -> AsyncIterator[tuple[str, str]]:
    """A database owned by a role that may not create roles, as in docker-compose: its
    name and the owner's DSN. After ``pg_template``, whose migration as the superuser made
    the gateway's role, as an operator would have."""
    suffix = uuid.uuid4().hex[:8]
    role, database = f"mk_owner_{suffix}", f"mk_owned_{suffix}"
    admin = await asyncpg.connect(pg_server.url("postgres"))
    try:
        await ensure_role(admin, pg_server.data_dir, role)  # LOGIN NOCREATEROLE, a password
        await admin.execute(f"CREATE DATABASE {database} OWNER {role}")
        yield database, pg_server.url(database, role=role)
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_an_owner_that_may_not_create_roles_grants_the_operators_role(
        pg_server: PgServer, owner_without_createrole: tuple[str, str]) -> None:
    # The role exists cluster-wide already (the operator made it, or another database's
    # migration did); the whole chain of migrations runs as a plain owner and grants it.
    database, owner_url = owner_without_createrole
    store = await Store.connect(owner_url, max_size=1)
    try:
        assert 13 in await store.schema_versions()
    finally:
        await store.close()
    conn = await asyncpg.connect(pg_server.url(database, role=GATEWAY_ROLE))
    try:
        assert await conn.fetchval("SELECT count(*) FROM replicas") == 0
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE TABLE stolen (x int)")
    finally:
        await conn.close()


async def test_a_role_that_cannot_be_created_is_skipped_with_a_notice(
        owner_without_createrole: tuple[str, str]) -> None:
    # The same block for a role that does not exist: run as an owner that may not create
    # it, the migration must neither fail (the other migrations would roll back with it)
    # nor create anything.
    _, owner_url = owner_without_createrole
    absent = f"mk_absent_{uuid.uuid4().hex[:8]}"
    store = await Store.connect(owner_url, max_size=1)
    await store.close()
    conn = await asyncpg.connect(owner_url)
    notices: list[str] = []
    conn.add_log_listener(lambda _conn, message: notices.append(str(message)))
    try:
        await conn.execute(MIGRATION.read_text().replace(GATEWAY_ROLE, absent))
        assert not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", absent)
    finally:
        await conn.close()
    assert any(absent in notice and "may not create it" in notice for notice in notices), notices
