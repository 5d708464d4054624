"""The newcomer's frictions with `up` and the CLI beside it (issue 24, section 8):

* the CLI honours MODELKEEPER_API_PORT (settings derive api_url from it), and `up`'s
  banner prints the export a second shell needs when the stack is not where a plain
  shell's CLI looks;
* the banner's "add a node on this machine" hint gives the second agent engine ports
  apart from the first's;
* MODELKEEPER_GATEWAY_AUTH=true under `up` reaches the gateway's own settings;
* a second `up` on the same data dir is one line naming it and the running stack's
  ports, exit 2, before any port is tried or any server started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli import main as cli_main
from cli import stack
from cli.main import build_parser, load_settings
from modelkeeper.settings import Settings, local_api_url

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MODELKEEPER_"):
            monkeypatch.delenv(name)


# -- 1. the CLI and the API's port --------------------------------------------------------

def test_the_cli_talks_to_the_port_the_api_is_set_to(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake(args: Any, api_url: str, **_: Any) -> int:
        seen.append(api_url)
        return 0

    monkeypatch.setattr(cli_main, "run_operator_command", fake)
    assert cli_main.run(["ls"]) == 0
    monkeypatch.setenv("MODELKEEPER_API_PORT", "8411")
    assert cli_main.run(["ls"]) == 0
    monkeypatch.setenv("MODELKEEPER_BIND_HOST", "0.0.0.0")
    assert cli_main.run(["ls"]) == 0
    # MODELKEEPER_API_URL still wins over the port.
    monkeypatch.setenv("MODELKEEPER_API_URL", "http://api.example:9000")
    assert cli_main.run(["ls"]) == 0
    assert seen == ["http://127.0.0.1:8400", "http://127.0.0.1:8411", "http://127.0.0.1:8411",
                    "http://api.example:9000"]


def test_the_api_url_follows_the_bind_host() -> None:
    assert local_api_url("::", 8400) == "http://[::1]:8400"
    assert local_api_url("10.0.0.5", 8401) == "http://10.0.0.5:8401"
    assert Settings(api_port=8500, bind_host="10.0.0.5").api_url == "http://10.0.0.5:8500"
    assert Settings(api_port=8500, api_url="http://x:1").api_url == "http://x:1"


def test_the_banner_prints_the_export_a_second_shell_needs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    default = stack.banner(Settings())
    assert "export" not in default
    moved = stack.banner(Settings(api_port=8500, data_dir=tmp_path))
    [line] = [x for x in moved.splitlines() if "export" in x]
    assert line.split("   (")[0] == (
        f"  CLI            export MODELKEEPER_API_URL=http://127.0.0.1:8500 "
        f"MODELKEEPER_TOKEN_FILE={tmp_path / 'operator-token'}")
    # Exported, that line is what the CLI then uses.
    for word in line.split("export ")[1].split("   (")[0].split():
        monkeypatch.setenv(*word.split("=", 1))
    shell = Settings()
    assert shell.api_url == "http://127.0.0.1:8500"
    assert shell.token_file == tmp_path / "operator-token"


# -- 6. a second agent on this machine ---------------------------------------------------

def test_the_add_a_node_hint_gives_engine_ports_apart_from_the_first_agents() -> None:
    settings = Settings()
    [hint] = [x for x in stack.banner(settings).splitlines() if "add a node" in x]
    low, high = settings.engine_ports
    given = hint.split("--engine-port-range ")[1].split()[0]
    other_low, other_high = (int(p) for p in given.split("-"))
    assert other_high - other_low == high - low
    assert other_high < low or other_low > high
    assert "--name NAME" in hint
    # Parsed by the agent's own flags, it is a valid range.
    args = build_parser().parse_args(["agent", "--engine-port-range", given])
    assert load_settings(args).engine_ports == (other_low, other_high)
    assert stack.next_port_range(20000, 20999) == "21000-21999"
    assert stack.next_port_range(65000, 65535) == "64464-64999"


# -- 7. client keys under up --------------------------------------------------------------

@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_gateway_auth_asked_for_in_the_environment_reaches_the_gateway(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str) -> None:
    monkeypatch.setenv("MODELKEEPER_GATEWAY_AUTH", value)
    settings = load_settings(build_parser().parse_args(["up", "--data-dir", str(tmp_path)]))
    env = stack.env_for("gateway", stack.component_env(settings, "postgresql://x"))
    # What the gateway process reads, from exactly the environment `up` gives it.
    monkeypatch.setattr(os, "environ", env)
    assert Settings().gateway_auth is True
    assert "AUTH OFF" not in stack.banner(settings)


# -- 8. a second up on the same data dir -------------------------------------------------

def test_a_second_up_on_the_data_dir_is_one_line_naming_it_and_the_ports(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = Settings(data_dir=tmp_path, api_port=8511, gateway_port=8512)
    held = stack.lock_data_dir(first)
    try:
        with pytest.raises(stack.StackError) as refused:
            stack.lock_data_dir(Settings(data_dir=tmp_path))
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(f"data dir {tmp_path} is in use by a running modelkeeper "
                                  f"up (pid {os.getpid()}; the API 8511, the gateway 8512, ")
        assert "MODELKEEPER_API_URL=http://127.0.0.1:8511" in message
        # Through the command: exit 2, the one line, no port tried, no server started.
        assert cli_main.run(["up", "--data-dir", str(tmp_path), "--no-demo"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("modelkeeper up: data dir ")
        assert not (tmp_path / "postgres").exists()
    finally:
        held.close()
    # Released with its holder: the next up takes it.
    stack.lock_data_dir(first).close()
    assert (tmp_path / stack.UP_LOCK_FILE).stat().st_mode & 0o077 == 0


def test_the_lock_goes_with_the_process_however_it_ends(tmp_path: Path) -> None:
    # A holder killed (no clean stop) leaves the file, never the lock.
    code = ("import sys, time; from cli import stack; from modelkeeper.settings import "
            f"Settings; held = stack.lock_data_dir(Settings(data_dir={str(tmp_path)!r})); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(stack.StackError, match=f"pid {holder.pid};"):
            stack.lock_data_dir(Settings(data_dir=tmp_path))
    finally:
        os.killpg(holder.pid, 9)
        holder.wait(10)
    stack.lock_data_dir(Settings(data_dir=tmp_path)).close()


def test_a_postgresql_left_running_is_named_in_one_line(tmp_path: Path) -> None:
    pgdata = tmp_path / "postgres"
    pgdata.mkdir()
    (pgdata / "postmaster.pid").write_text(f"{os.getpid()}\n{pgdata}\n1700000000\n5499\n")
    with pytest.raises(stack.StackError) as refused:
        stack.lock_data_dir(Settings(data_dir=tmp_path))
    assert str(refused.value) == (
        f"PostgreSQL is still running on {pgdata} (pid {os.getpid()}, port 5499) though no "
        "modelkeeper up holds its data dir: a stack that did not stop cleanly left it; "
        f"stop it (kill {os.getpid()}) and run up again")
    # A stale file (its pid gone) is PostgreSQL's own to start past.
    (pgdata / "postmaster.pid").write_text("99999999\n")
    stack.lock_data_dir(Settings(data_dir=tmp_path)).close()
