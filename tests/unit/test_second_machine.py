"""The rules that let a second machine join (docs/second-machine.md), each on its own:
the Temporal address the API hands an agent, what `up` serves when bound beyond loopback,
and what it says when it stops. tests/integration/test_two_machines.py runs them together
across two network namespaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.agents import agent_temporal_address
from cli import stack
from cli.main import build_parser, load_settings
from cli.stack import (
    Stopped,
    api_allowed_hosts,
    banner,
    component_env,
    describe_stop,
    ensure_join_token,
    local_host,
)
from modelkeeper.settings import Settings


def _address(temporal: str, *, peer_loopback: bool, api_host: str | None,
             configured: str | None = None) -> str:
    settings = Settings(temporal_address=temporal, agent_temporal_address=configured)
    return agent_temporal_address(settings, peer_loopback=peer_loopback, api_host=api_host)


def test_a_configured_agent_temporal_address_wins() -> None:
    assert _address("0.0.0.0:7233", peer_loopback=False, api_host="10.0.0.5",
                    configured="temporal.lan:7233") == "temporal.lan:7233"


def test_an_address_the_agent_can_use_is_handed_over_as_it_is() -> None:
    assert _address("temporal:7233", peer_loopback=False, api_host="10.0.0.5") == \
        "temporal:7233"
    assert _address("10.0.0.9:7233", peer_loopback=False, api_host="10.0.0.5") == \
        "10.0.0.9:7233"
    # An agent on the API's own machine may use loopback.
    assert _address("127.0.0.1:7233", peer_loopback=True, api_host="localhost") == \
        "127.0.0.1:7233"


@pytest.mark.parametrize("temporal", ["0.0.0.0:7234", "[::]:7234", "127.0.0.1:7234",
                                      "localhost:7234"])
def test_a_wildcard_or_loopback_becomes_the_host_the_agent_reached_the_api_by(
        temporal: str) -> None:
    assert _address(temporal, peer_loopback=False, api_host="10.200.1.1") == \
        "10.200.1.1:7234"
    assert _address(temporal, peer_loopback=False, api_host="fd00::1") == "[fd00::1]:7234"


def test_a_wildcard_for_a_local_agent_becomes_loopback() -> None:
    assert _address("0.0.0.0:7233", peer_loopback=True, api_host="127.0.0.1") == \
        "127.0.0.1:7233"


def test_with_no_host_to_go_by_the_address_is_left_alone() -> None:
    assert _address("0.0.0.0:7233", peer_loopback=False, api_host=None) == "0.0.0.0:7233"


def test_up_s_children_reach_a_wildcard_bind_on_loopback() -> None:
    assert local_host("0.0.0.0") == "127.0.0.1"
    assert local_host("::") == "::1"
    assert local_host("127.0.0.1") == "127.0.0.1"
    assert local_host("10.0.0.5") == "10.0.0.5"
    settings = Settings(bind_host="0.0.0.0", api_port=9400, temporal_port=9233,
                        postgres_port=9432, engine_key_secret="s")
    env = component_env(settings, "postgresql://x", join_token_file=Path("/d/join-token"),
                        allowed_hosts=["host-a", "10.0.0.5"])
    assert env["MODELKEEPER_API_URL"] == "http://127.0.0.1:9400"
    assert env["TEMPORAL_ADDRESS"] == "127.0.0.1:9233"
    assert env["MODELKEEPER_BIND_HOST"] == "0.0.0.0"  # the servers still listen there
    assert "@127.0.0.1:9432/" in env["MODELKEEPER_GATEWAY_DATABASE_URL"]
    assert env["MODELKEEPER_JOIN_TOKEN_FILE"] == "/d/join-token"
    assert env["MODELKEEPER_API_ALLOWED_HOSTS"] == "host-a,10.0.0.5"


def test_up_makes_a_join_token_only_when_other_machines_can_reach_it(
        tmp_path: Path) -> None:
    assert ensure_join_token(Settings(data_dir=tmp_path)) is None
    assert ensure_join_token(Settings(data_dir=tmp_path, bind_host="0.0.0.0",
                                      join_token="mine")) is None
    path = ensure_join_token(Settings(data_dir=tmp_path, bind_host="0.0.0.0"))
    assert path == tmp_path / "join-token"
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text()
    # Kept across starts: agents that joined with it rejoin with it.
    assert ensure_join_token(Settings(data_dir=tmp_path, bind_host="0.0.0.0")) == path
    assert path.read_text() == token


def test_a_wildcard_api_answers_to_this_machine_s_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "machine_names", lambda: ["host-a", "10.0.0.5"])
    assert api_allowed_hosts(Settings(bind_host="0.0.0.0", api_allowed_hosts="api.lan")) \
        == ["api.lan", "host-a", "10.0.0.5"]
    assert api_allowed_hosts(Settings(bind_host="10.0.0.5")) == []
    assert api_allowed_hosts(Settings()) == []


def test_the_banner_says_how_another_machine_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "machine_names", lambda: ["host-a", "fd00::5", "10.0.0.5"])
    text = banner(Settings(bind_host="0.0.0.0", api_port=8400),
                  join_token_file=Path("/d/join-token"))
    assert "http://127.0.0.1:8400" in text
    assert "other machines reach this one as 10.0.0.5, host-a, fd00::5" in text
    assert "join token     /d/join-token" in text
    assert ("modelkeeper agent --api-url http://10.0.0.5:8400 --join-token-file FILE "
            "--name NAME --memory 16GiB") in text
    local = banner(Settings())
    assert "join token" not in local and "--bind-host 0.0.0.0" in local


def test_the_stop_line_names_what_stopped_and_what_is_left() -> None:
    assert describe_stop(Stopped(components=("agent", "api", "postgres"), engines=2,
                                 left=())) == (
        "stopped agent (and its 2 engine(s)), api, postgres; no process of modelkeeper up "
        "is left")
    assert describe_stop(Stopped(components=("api",), engines=0,
                                 left=("pid 7 (postgres)",))) == (
        "stopped api; still running: pid 7 (postgres)")
    assert describe_stop(Stopped(components=(), engines=0, left=())) == "nothing was running"


def test_the_agent_flag_sets_stop_engines_on_exit() -> None:
    parser = build_parser()
    assert load_settings(parser.parse_args(
        ["agent", "--stop-engines-on-exit"])).agent_stop_engines_on_exit is True
    assert load_settings(parser.parse_args(["agent"])).agent_stop_engines_on_exit is False
