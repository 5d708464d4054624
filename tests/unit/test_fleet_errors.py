"""`python -m bench.fleet --fleet N` given what it cannot run with: one sentence naming the flag,
the value and the limit, exit code 2, no traceback, and nothing written to the data dir.
Every case is refused before a node is made, so none starts anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.fleet.nodes
from bench.fleet import command
from bench.fleet.nodes import (
    FILES_PER_NODE,
    FILES_PER_PROCESS,
    MAX_FLEET_SIZE,
    fleet_size_problem,
)
from cli import main as cli

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MODELKEEPER_ setting from the machine (a declared memory, a token file) and no
    logging set up for the whole test process."""
    for var in [v for v in os.environ if v.startswith("MODELKEEPER_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(cli, "_configure_logging", lambda settings: None)
    monkeypatch.setattr(command, "configure_logging", lambda level: None)


def _agent(data_dir: Path, *flags: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.run(["agent", "--data-dir", str(data_dir), *flags])
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    return code, err.strip()


def _fleet(data_dir: Path, *flags: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = command.run(["--data-dir", str(data_dir), *flags])
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    return code, err.strip()


@pytest.mark.parametrize(("flags", "sentence"), [
    (["--fleet", "0"], "--fleet 0: a fleet has at least 1 node"),
    (["--fleet", "-3", "--memory", "2GiB"], "--fleet -3: a fleet has at least 1 node"),
    (["--fleet", "100000", "--memory", "2GiB"],
     f"--fleet 100000: a fleet has at most {MAX_FLEET_SIZE} nodes (2 engine ports each, "
     "of the 65535 there are)"),
    (["--fleet", "5"], "--fleet 5: give each simulated node its capacity with --memory SIZE"),
    (["--fleet", "5", "--memory", "2GiB", "--llama-server", "/bin/true"],
     "--fleet 5 --llama-server /bin/true: a fleet serves only the sim engine"),
    (["--fleet", "600", "--memory", "2GiB", "--engine-port-range", "20000-20999"],
     "--engine-port-range 20000-20999: 1000 port(s) for --fleet 600 is fewer than 2 a "
     "node; give a range of at least 1200 ports, or at most --fleet 500"),
    (["--fleet", "5", "--memory", "2GiB", "--engine-port-range", "21000-20000"],
     "--engine-port-range / MODELKEEPER_ENGINE_PORT_RANGE 21000-20000: ports run from 1 "
     "to 65535, the low end first"),
    (["--fleet", "5", "--memory", "2GiB", "--engine-port-range", "70000-70010"],
     "--engine-port-range / MODELKEEPER_ENGINE_PORT_RANGE 70000-70010: ports run from 1 "
     "to 65535"),
    (["--fleet", "5", "--memory", "2GiB", "--name", "bad name!"],
     "--name 'bad name!': --fleet 5 names the nodes bad name!-0001 to bad name!-0005, and "
     "a node's name must be a host name"),
    (["--fleet", "5", "--memory", "2GiB", "--name", "x" * 60],
     f"--fleet 5 names the nodes {'x' * 60}-0001 to {'x' * 60}-0005, and a node's name "
     "must be a host name: letters, digits, '.', '-' and '_', starting with a letter or "
     "digit, at most 64 characters"),
])
def test_a_fleet_it_cannot_run_is_one_sentence_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], sentence: str,
) -> None:
    data = tmp_path / "data"
    code, err = _fleet(data, *flags, capsys=capsys)
    assert code == 2
    assert err.startswith("bench.fleet: ") and "\n" not in err
    assert sentence in err
    assert not data.exists()  # refused before anything was written


def test_more_nodes_than_open_files_allow_names_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench.fleet.nodes, "open_files_limit", lambda: 1024)
    most = (1024 - FILES_PER_PROCESS) // FILES_PER_NODE
    code, err = _fleet(tmp_path / "data", "--fleet", str(most + 1), "--memory", "2GiB",
                       "--engine-port-range", "20000-29999", capsys=capsys)
    assert code == 2
    assert (f"--fleet {most + 1}: {most + 1} nodes hold about "
            f"{(most + 1) * FILES_PER_NODE + FILES_PER_PROCESS} files open "
            f"({FILES_PER_NODE} a node), and this process may open 1024 (ulimit -n): at most "
            f"{most} nodes") in err


def test_the_size_rules_in_order() -> None:
    assert fleet_size_problem(1, open_files=None) is None
    assert fleet_size_problem(MAX_FLEET_SIZE, open_files=None) is None
    assert fleet_size_problem(0, open_files=None) == "--fleet 0: a fleet has at least 1 node"
    too_many = fleet_size_problem(MAX_FLEET_SIZE + 1, open_files=None)
    assert too_many is not None and f"at most {MAX_FLEET_SIZE} nodes" in too_many
    # The limit on open files fits exactly: one node more does not.
    fits = (20000 - FILES_PER_PROCESS) // FILES_PER_NODE
    assert fleet_size_problem(fits, open_files=20000) is None
    assert fleet_size_problem(fits + 1, open_files=20000) is not None
    # A limit below even one node's files: at most 0, said as such.
    tiny = fleet_size_problem(1, open_files=10)
    assert tiny is not None and "at most 0 nodes" in tiny


def test_a_data_dir_it_cannot_write_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    data = blocker / "data"
    code, err = _fleet(data, "--fleet", "2", "--memory", "2GiB", capsys=capsys)
    assert code == 2
    assert (f"--data-dir / MODELKEEPER_DATA_DIR {data}: the agent keeps its files in "
            f"{data / 'agent' / 'fleet'} and cannot write there (Not a directory)") in err


def test_a_single_agent_says_the_same_of_its_data_dir_and_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _agent(blocker / "data", "--api-url", "http://127.0.0.1:9", capsys=capsys)
    assert code == 2 and "cannot write there (Not a directory)" in err
    code, err = _agent(tmp_path / "data", "--name", "bad name!", capsys=capsys)
    assert code == 2 and "--name 'bad name!': a node's name must be a host name" in err


@pytest.mark.parametrize("value", ["abc", "2.5", ""])
def test_a_fleet_size_that_is_no_number_names_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str,
) -> None:
    with pytest.raises(SystemExit) as exited:
        command.run(["--data-dir", str(tmp_path), "--fleet", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (f"argument --fleet: {value!r} is not a number of nodes: a whole number from 1 "
            f"to {MAX_FLEET_SIZE}") in err


def test_the_command_itself_exits_2_without_a_traceback(tmp_path: Path) -> None:
    """The console script's path end to end (its own process, os._exit included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELKEEPER_")}
    done = subprocess.run([sys.executable, "-m", "bench.fleet", "--fleet", "0",
                           "--data-dir", str(tmp_path / "data")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=25,
                          check=False)
    assert done.returncode == 2
    assert done.stderr == "bench.fleet: --fleet 0: a fleet has at least 1 node\n"
    assert done.stdout == ""
