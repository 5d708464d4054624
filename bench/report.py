"""What every benchmark writes alike: the header of a run (the command as typed, the date,
the machine, the commit measured) and its results, OUT.json and OUT.md side by side. What
each result says, and how its markdown reads, stay in the bench's own report module."""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.common import code_version


def run_meta(prog: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The header every result file starts with: ``python -m PROG`` and ``argv`` (this
    process's own arguments when None), the date, the cores, Python and the commit. A
    bench adds its own fields after these."""
    return {"command": " ".join([f"python -m {prog}",
                                 *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d"), "cores": psutil.cpu_count(),
            "python": platform.python_version(), "code": code_version()}


def write_results(out: Path, document: object, markdown: str) -> None:
    """``document`` to OUT.json and ``markdown`` to OUT.md, making OUT's folder. The JSON
    goes first: a run whose markdown cannot be written keeps its numbers, and
    ``--from-json`` writes the markdown again from them."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # default=str: timestamps and paths in a result read back as the text they printed.
    out.with_suffix(".json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown)
