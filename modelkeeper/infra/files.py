"""Private files: what modelkeeper keeps in a data dir is its user's alone.

A data dir holds secrets (the cluster secret, tokens, database passwords) and state that
maps the whole fleet (Temporal's history, logs, shard records with every endpoint). `up`
and the agent make their folder 0700 and run with :data:`PRIVATE_UMASK`, so that every
file they and their children create is 0600 and every folder 0700, whatever the caller's
umask (commonly 022, which made these 0644 in a 0755 folder).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

#: No bit for the group or others on anything created: files 0600, folders 0700.
PRIVATE_UMASK = 0o077


@contextmanager
def private_files() -> Iterator[None]:
    """Within: every file this process and the children it starts create is private
    (:data:`PRIVATE_UMASK`). The umask is the process's; it is put back on the way out,
    for a caller in the same process (tests)."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def make_private_dir(path: Path, *, traverse_gid: int | None = None) -> None:
    """Create ``path`` (mode 0700), or take the group's and others' bits off the folder
    that is there, which an older version made 0755.

    ``traverse_gid``: a group that keeps ``g+x`` (pass, not list) when it owns the folder:
    PostgreSQL's system user under root, which must pass through to its pgdata
    (``launcher.postgres._grant_to`` gives it that)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    keep = stat.S_IXGRP if traverse_gid is not None and st.st_gid == traverse_gid else 0
    private = (mode & 0o700) | (mode & keep)
    if private != mode:
        log.info("%s: mode %04o -> %04o (its files are this user's alone)", path, mode, private)
        path.chmod(private)
