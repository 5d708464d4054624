"""What `up` gives PostgreSQL's system user under root: its data dir and the way to it.
A private data dir is opened to that user alone; a private folder above a data dir
chosen there gets traverse only, never read (``o+rx`` once made /root readable to every
user); an installation it cannot reach is copied into the data dir rather than opened.

Root only: the system user exists only under root, and only root can chown."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli import postgres

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(os.geteuid() != 0, reason="PostgreSQL runs as a system user only "
                                                 "under root, and only root can chown"),
]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder under /tmp that any user may pass, as /var/lib is: pytest's own tmp_path
    lies under a private folder, which is exactly what these tests must control."""
    folder = Path(tempfile.mkdtemp(prefix="mk-pg-access-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def user() -> str:
    name = postgres.system_user()
    assert name is not None
    return name


def test_a_private_folder_above_a_chosen_data_dir_gets_traverse_only_with_a_warning(
        base: Path, user: str, caplog: pytest.LogCaptureFixture) -> None:
    home = base / "root-like"
    home.mkdir(mode=0o700)
    pgdata = home / "modelkeeper" / "postgres"
    pgdata.mkdir(parents=True)
    with caplog.at_level("WARNING", logger=postgres.__name__):
        postgres._grant_to(user, pgdata)
    assert _mode(home) == 0o701  # others may pass, not list: never o+r again
    [record] = caplog.records
    # Names the setting, the folder, its mode before, and how to need no change at all.
    message = record.getMessage()
    assert "data_dir" in message and str(home) in message and "0700" in message
    assert "/var/lib/modelkeeper" in message
    assert _mode(base) == 0o755


def test_a_private_data_dir_is_opened_to_the_system_user_alone(base: Path, user: str) -> None:
    data_dir = base / "modelkeeper"
    data_dir.mkdir(mode=0o700)
    pgdata = data_dir / "postgres"
    pgdata.mkdir()
    postgres._grant_to(user, pgdata)
    entry = pwd.getpwnam(user)
    # Its group may pass (not list); others still may not; the folder above is unchanged.
    assert _mode(data_dir) == 0o710 and data_dir.stat().st_gid == entry.pw_gid
    assert data_dir.stat().st_uid == 0
    assert _mode(base) == 0o755
    assert (pgdata.stat().st_uid, pgdata.stat().st_gid) == (entry.pw_uid, entry.pw_gid)


def test_a_data_dir_the_user_can_pass_is_not_changed(base: Path, user: str) -> None:
    data_dir = base / "modelkeeper"
    data_dir.mkdir(mode=0o755)
    pgdata = data_dir / "postgres"
    pgdata.mkdir()
    postgres._grant_to(user, pgdata)
    assert (_mode(data_dir), data_dir.stat().st_gid) == (0o755, 0)


def test_binaries_it_cannot_reach_are_copied_into_the_data_dir(
        base: Path, user: str, monkeypatch: pytest.MonkeyPatch) -> None:
    private = base / "venv-under-root"
    (private / "pginstall" / "bin").mkdir(parents=True)
    (private / "pginstall" / "share").mkdir()
    binary = private / "pginstall" / "bin" / "postgres"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o700)
    (private / "pginstall" / "share" / "postgres.bki").write_text("data")
    (private / "pginstall" / "share" / "postgres.bki").chmod(0o600)
    private.chmod(0o700)
    monkeypatch.setattr(postgres, "POSTGRES_BIN_PATH", private / "pginstall" / "bin")
    pgdata = base / "modelkeeper" / "postgres"
    pgdata.mkdir(parents=True)

    bin_path = postgres._bin_path_for(user, pgdata)
    assert bin_path.parent.parent == base / "modelkeeper"
    assert bin_path.parent.name.startswith("pginstall-")
    assert _mode(private) == 0o700  # the installation's folder stays private
    # The copy can be read and run by any user, and is reused next time.
    assert _mode(bin_path / "postgres") == 0o755
    assert _mode(bin_path.parent / "share" / "postgres.bki") == 0o644
    assert postgres._bin_path_for(user, pgdata) == bin_path

    # An installation every user can reach is run where it is.
    private.chmod(0o755)
    assert postgres._bin_path_for(user, pgdata) == private / "pginstall" / "bin"
