"""`up`'s embedded PostgreSQL asks every role for its password (issue 19, finding 4).

It used to trust every local connection: as ``nobody``, ``psql -U postgres`` inserted an
admin operator token and ran commands with ``COPY ... TO PROGRAM``. Here, on the embedded
server itself (``postgres.start_postgres`` and ``postgres.provision``, as `up` runs them,
without the rest of the stack):

* another OS user, without the password files, is refused as every role;
* the owner role (the API's, the worker's, the CLI's) migrates and makes tokens, but is no
  superuser; the gateway's role creates nothing and reads no operator token;
* a data dir made by an older `up` (trust auth, a superuser without a password, a schema
  the superuser owns) is upgraded in place at the next start;
* `modelkeeper tokens` works for `up`'s user and is one sentence, exit 2, for another.

Root only: another OS user exists for the test only when it can switch to one.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from cli import main as cli
from cli import postgres
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.store import Store
from modelkeeper.store.tokens import TokensStore

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(os.geteuid() != 0, reason="switching to another OS user needs root"),
]

HOST = "127.0.0.1"
DATABASE = "modelkeeper"
#: The other local user of the finding.
OTHER_USER = "nobody"
ROLES = ("postgres", "modelkeeper", "modelkeeper_gateway")
#: pg_hba.conf as `initdb --auth=trust` wrote it for an older `up`.
TRUSTING_HBA = """\
local   all             all                                     trust
host    all             all             127.0.0.1/32            trust
host    all             all             ::1/128                 trust
local   replication     all                                     trust
host    replication     all             127.0.0.1/32            trust
host    replication     all             ::1/128                 trust
"""


@dataclass
class Local:
    """An embedded server as `up` runs it: its data dir, port and process."""

    data_dir: Path
    port: int
    proc: ManagedProcess | None = None

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "postgres"

    def start(self) -> None:
        self.proc = postgres.start_postgres(self.pgdata, HOST, self.port,
                                            self.data_dir / "postgres.log")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def url(self, role: str, database: str = DATABASE) -> str:
        return postgres.dsn(HOST, self.port, database, data_dir=self.data_dir, role=role)


@pytest.fixture
def local() -> Iterator[Local]:
    # Under /tmp as conftest's server: tmp_path's parents are private to root, and the
    # server's own user would be let through them.
    with tempfile.TemporaryDirectory(prefix="mk-pg-auth-") as tmp:
        server = Local(Path(tmp), free_port())
        try:
            yield server
        finally:
            server.stop()


def _psql_as_other_user(port: int, role: str) -> subprocess.CompletedProcess[str]:
    """What the finding ran: psql as another local user, with no password (-w: never
    prompt), a statement only a superuser may run."""
    return subprocess.run(
        [str(postgres.POSTGRES_BIN_PATH / "psql"), "-w", "-h", HOST, "-p", str(port),
         "-U", role, "-d", "postgres", "-c", "COPY (SELECT 1) TO PROGRAM 'true'"],
        capture_output=True, text=True, timeout=30, check=False, user=OTHER_USER,
        env={"PATH": "/usr/bin:/bin"}, cwd="/")


def test_another_local_user_without_the_password_is_refused(local: Local) -> None:
    local.start()
    result = _psql_as_other_user(local.port, "postgres")
    assert result.returncode != 0, result.stdout
    assert "password" in result.stderr, result.stderr
    hba = (local.pgdata / "pg_hba.conf").read_text()
    assert "trust" not in [line.split()[-1] for line in hba.splitlines()
                           if line.strip() and not line.startswith("#")], hba


def test_every_role_needs_its_password_and_only_up_s_user_reads_them(local: Local) -> None:
    local.start()
    asyncio.run(postgres.provision(local.data_dir, HOST, local.port))
    for role in ROLES:
        result = _psql_as_other_user(local.port, role)
        assert result.returncode != 0 and "password" in result.stderr, (role, result)
    secrets = local.data_dir / "secrets"
    assert secrets.stat().st_mode & 0o777 == 0o700
    for role in ROLES:
        passfile = secrets / f"{role}.pgpass"
        assert passfile.stat().st_mode & 0o777 == 0o600, role
        read = subprocess.run(["cat", str(passfile)], capture_output=True, text=True,
                              check=False, user=OTHER_USER, cwd="/")
        assert read.returncode != 0 and read.stdout == "", role

    async def wrong_password() -> None:
        await asyncpg.connect(f"postgresql://postgres:guess@{HOST}:{local.port}/postgres")

    with pytest.raises(asyncpg.InvalidPasswordError):
        asyncio.run(wrong_password())


async def _owner_and_gateway_rights(local: Local) -> None:
    """The owner migrates and makes an admin token but cannot run programs or make roles;
    the gateway reads its routes but creates nothing and reads no operator token."""
    async with await TokensStore.connect(local.url("modelkeeper")) as tokens:
        await tokens.create_token("alice", OperatorRole.ADMIN)
    owner = await asyncpg.connect(local.url("modelkeeper"))
    try:
        assert await owner.fetchval(
            "SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles "
            "WHERE rolname = current_user") is False
        for statement in ("COPY (SELECT 1) TO PROGRAM 'true'", "CREATE ROLE evil LOGIN",
                          "ALTER ROLE modelkeeper SUPERUSER"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await owner.execute(statement)
    finally:
        await owner.close()
    gateway = await asyncpg.connect(local.url("modelkeeper_gateway"))
    try:
        assert await gateway.fetchval("SELECT count(*) FROM replicas") == 0
        for statement in ("CREATE TABLE stolen (x int)", "SELECT * FROM operator_tokens",
                          "INSERT INTO operator_tokens DEFAULT VALUES"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await gateway.execute(statement)
    finally:
        await gateway.close()


def test_the_owner_and_the_gateway_have_what_they_need_and_no_more(local: Local) -> None:
    local.start()
    asyncio.run(postgres.provision(local.data_dir, HOST, local.port))
    asyncio.run(_owner_and_gateway_rights(local))


async def _as_an_older_up_left_it(local: Local) -> str:
    """The database of an older `up`: made and migrated by the superuser, holding an
    admin token; the gateway's role (migration 0013's) has no password, nor the
    superuser. Returns the token."""
    admin = await asyncpg.connect(local.url("postgres", "postgres"))
    try:
        await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()
    async with await TokensStore.connect(local.url("postgres")) as tokens:
        _, token = await tokens.create_token("old-admin", OperatorRole.ADMIN)
    admin = await asyncpg.connect(local.url("postgres", "postgres"))
    try:
        await admin.execute("ALTER ROLE modelkeeper_gateway PASSWORD NULL")
        await admin.execute("ALTER ROLE postgres PASSWORD NULL")
    finally:
        await admin.close()
    return token


async def _upgraded(local: Local, token: str) -> None:
    async with await TokensStore.connect(local.url("modelkeeper")) as tokens:
        record = await tokens.authenticate(token)
        assert record is not None and record.name == "old-admin", "data kept"
    owner = await asyncpg.connect(local.url("modelkeeper"))
    try:
        not_owned = await owner.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
            "AND tableowner <> 'modelkeeper'")
        assert not_owned == [], not_owned
        functions = await owner.fetch(
            "SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace "
            "AND proowner <> 'modelkeeper'::regrole")
        assert functions == [], functions
    finally:
        await owner.close()
    # A migration after the upgrade runs as the owner.
    store = await Store.connect(local.url("modelkeeper"), max_size=1)
    await store.close()
    await _owner_and_gateway_rights(local)


def test_an_older_trusting_data_dir_is_upgraded_in_place(
        local: Local, caplog: pytest.LogCaptureFixture) -> None:
    local.start()
    token = asyncio.run(_as_an_older_up_left_it(local))
    local.stop()
    # What the older up left on disk: initdb's trusting pg_hba.conf, no password files.
    hba = local.pgdata / "pg_hba.conf"
    owner = hba.stat()
    hba.write_text(TRUSTING_HBA)
    os.chown(hba, owner.st_uid, owner.st_gid)
    for passfile in (local.data_dir / "secrets").iterdir():
        passfile.unlink()

    with caplog.at_level("WARNING", logger=postgres.__name__):
        local.start()
    assert "trusted connections without a password" in caplog.text
    assert hba.read_text() == postgres.HBA_CONF
    result = _psql_as_other_user(local.port, "postgres")
    assert result.returncode != 0 and "password" in result.stderr, result
    asyncio.run(postgres.provision(local.data_dir, HOST, local.port))
    asyncio.run(_upgraded(local, token))
    # And once more: a start of an upgraded data dir changes nothing and still serves.
    local.stop()
    local.start()
    asyncio.run(postgres.provision(local.data_dir, HOST, local.port))
    asyncio.run(_upgraded(local, token))


def _as_other_user(run: Callable[[], int]) -> tuple[int, str]:
    """``run()`` in a forked child that became OTHER_USER: its exit code and output. A
    fork, not a new interpreter: the interpreter lives where that user cannot read."""
    entry = pwd.getpwnam(OTHER_USER)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.close(read_end)
            # Onto the pipe, whatever pytest's capture put in their place.
            sys.stdout = sys.stderr = os.fdopen(write_end, "w")
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            code = run()
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as out:
        output = out.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output


def test_tokens_works_for_up_s_user_and_is_one_sentence_for_another(
        local: Local, capsys: pytest.CaptureFixture[str]) -> None:
    local.start()
    asyncio.run(postgres.provision(local.data_dir, HOST, local.port))
    argv = ["tokens", "create", "bob", "--role", "viewer", "--data-dir", str(local.data_dir),
            "--postgres-port", str(local.port)]
    assert cli.run(argv) == 0
    assert capsys.readouterr().out.startswith("mko-")

    import gateway.keys_cli  # noqa: F401 - imported here: the other user cannot read it

    code, output = _as_other_user(lambda: cli.run(argv))
    assert code == 2, output
    passfile = local.data_dir / "secrets" / "modelkeeper.pgpass"
    assert output.strip() == (
        f"modelkeeper tokens: MODELKEEPER_DATABASE_URL is unset, and the password file of "
        f"the local `modelkeeper up`'s database, {passfile}, cannot be read (Permission "
        "denied): run this as the user who runs `up`, with its --data-dir, or set "
        "MODELKEEPER_DATABASE_URL")
