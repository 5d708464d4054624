"""The rooms contract (pyproject.toml, [tool.importlinter]) can fail.

./dev test runs `lint-imports` on the tree as it is; these tests show that each kind of
wrong arrow the contract exists for really breaks it, on a copy of the packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "modelkeeper", "cli", "api", "worker", "gateway", "agent", "workflows", "activities",
]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.timeout(60)


def lint_copy(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """Run the contract on a copy of the packages with ``line`` appended to ``module``."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    if line:
        path = tmp_path / (module.replace(".", "/") + ".py")
        path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    # lint-imports puts its working directory first on sys.path, so the copy is analysed,
    # not the installed tree.
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)


def test_the_copy_itself_keeps_the_contract(tmp_path: Path) -> None:
    result = lint_copy(tmp_path, "", "")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("gateway.breaker", "import agent.identity", "The gateway and the API never import"),
    ("api.deps", "import agent.shards", "The gateway and the API never import"),
    ("agent.identity", "import modelkeeper.store", "The agent never imports"),
    ("workflows.deployment", "import aiohttp", "Workflows stay deterministic"),
    # The hot path never reaches Temporal's side (issue 20, section 6: these four passed).
    ("gateway.breaker", "import workflows.deployment", "The gateway is Temporal-free"),
    ("gateway.breaker", "import activities.node", "The gateway is Temporal-free"),
    ("gateway.breaker", "import temporalio.client", "The gateway is Temporal-free"),
    # Replayed code reads no settings and does no I/O.
    ("workflows.deployment", "import modelkeeper.settings", "Workflows stay deterministic"),
    ("workflows.deployment", "import modelkeeper.infra.processes",
     "Workflows stay deterministic"),
    ("workflows.drain", "import socket", "Workflows stay deterministic"),
    ("modelkeeper.domain.units", "import temporalio", "The domain is pure"),
    ("modelkeeper.domain.units", "import modelkeeper.store", "Rooms: each imports"),
    ("modelkeeper.store.stores", "import cli.main", "Rooms: each imports"),
])
def test_a_wrong_arrow_breaks_the_contract(tmp_path: Path, module: str, line: str,
                                           broken: str) -> None:
    result = lint_copy(tmp_path, module, line)
    assert result.returncode != 0
    tail = result.stdout.split("Broken contracts", 1)[-1]
    assert broken in tail, result.stdout
