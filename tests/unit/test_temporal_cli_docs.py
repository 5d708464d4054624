"""The docs' `temporal` commands work as pasted against the stack `up` runs, whatever its
port (issue 24: they assumed 7233, and a `temporal` on PATH that only the venv has).

Every `temporal` command in docs/operations.md and the README calls the binary where
`./dev` installs it and names no address, the doc telling the reader to set
TEMPORAL_ADDRESS from the `Temporal` line of `up`'s banner; that line names the port the
stack was given and the binary's path; and the binary does read TEMPORAL_ADDRESS.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli.binaries import temporal_cli
from cli.stack import banner
from modelkeeper.settings import Settings

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "docs" / "operations.md", REPO / "README.md"]
#: Where ./dev puts the environment, and so the binary, relative to the repository.
DOCUMENTED_BINARY = ".venv/bin/temporal"
_INVOCATION = re.compile(r"(?:^|[\s;&|(])(\S*temporal)\s+(workflow|operator|batch|schedule)\b")
_CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: The CLI answers a refused connection at once; this bounds a hung one.
CLI_TIMEOUT_S = 20


def _invocations(doc: Path) -> list[tuple[str, str]]:
    """(binary as written, line) of each command line in ``doc``'s code blocks that runs
    the temporal CLI, continuation lines joined."""
    found = []
    for block in _CODE_BLOCK.findall(doc.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            match = _INVOCATION.search(line)
            if match and not line.lstrip().startswith("#"):
                found.append((match.group(1), line))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_docs_temporal_commands_use_the_venvs_binary_and_name_no_port(doc: Path) -> None:
    invocations = _invocations(doc)
    assert invocations, f"{doc.name} has no temporal command: update this test"
    for binary, line in invocations:
        assert binary == DOCUMENTED_BINARY, f"not on PATH outside the venv: {line}"
        assert "--address" not in line and not re.search(r":\d{2,5}\b", line), \
            f"names a fixed address where the stack's port is chosen: {line}"
    text = doc.read_text()
    assert "export TEMPORAL_ADDRESS=" in text, f"{doc.name} must say how to point the CLI"
    assert re.search(r"`?Temporal`? line", text), f"{doc.name} must say where the address is"


def test_the_documented_path_is_where_this_environment_keeps_the_binary() -> None:
    binary = temporal_cli()
    assert binary.resolve() == (Path(sys.prefix) / "bin" / "temporal").resolve()
    assert 'VENV="${MODELKEEPER_VENV:-.venv}"' in (REPO / "dev").read_text()
    assert ".venv/bin/" + binary.name == DOCUMENTED_BINARY


def test_the_banners_temporal_line_gives_the_stacks_port_and_the_binary(
        tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, temporal_port=17299)
    # "Temporal  HOST:PORT", not the UI's or the mTLS front's line.
    [line] = [line for line in banner(settings).splitlines()
              if re.match(r"\s*Temporal\s+[\w.\[\]:]+:\d+\s", line)]
    assert "127.0.0.1:17299" in line
    assert f"TEMPORAL_ADDRESS=127.0.0.1:17299 {temporal_cli()} workflow list" in line
    assert "7233" not in line


def test_the_cli_reads_temporal_address() -> None:
    with socket.socket() as probe:  # a port nobody listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        done = subprocess.run([str(temporal_cli()), "workflow", "list"], capture_output=True,
                              text=True, timeout=CLI_TIMEOUT_S, check=False,
                              env={"TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "HOME": "/tmp"})
    assert done.returncode != 0
    assert f"127.0.0.1:{port}" in done.stdout + done.stderr
