"""Settings: env names, precedence, and the README's generated table."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cli.main import build_parser, load_settings
from modelkeeper.domain.keeper import KeeperConfig
from modelkeeper.domain.tunables import (
    AgentTunables,
    ControlTunables,
    GatewayTunables,
    KeeperTunables,
    LivenessTunables,
    NotifyTunables,
    Tunables,
    WatchdogTunables,
)
from modelkeeper.settings import ROOT_DATA_DIR, Settings, config_table_markdown

pytestmark = pytest.mark.timeout(10)

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults_match_the_documented_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MODELKEEPER_API_PORT", "TEMPORAL_ADDRESS", "MODELKEEPER_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert (s.api_port, s.gateway_port, s.postgres_port, s.temporal_port,
            s.temporal_ui_port) == (8400, 8401, 8432, 7233, 8233)
    expected = (ROOT_DATA_DIR if os.geteuid() == 0
                else Path.home() / ".local/share/modelkeeper")
    assert s.data_dir == expected


@pytest.mark.parametrize("euid", [0, 1000])
def test_the_default_data_dir_needs_no_permission_change_above_it(
        monkeypatch: pytest.MonkeyPatch, euid: int) -> None:
    # PostgreSQL runs as its own system user under root, and must reach the data dir:
    # every folder above the default must already let any user pass, so `up` opens none
    # (it once made /root world-readable). As another user the server runs as that user,
    # who reaches their own home.
    monkeypatch.delenv("MODELKEEPER_DATA_DIR", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    data_dir = Settings().data_dir
    if euid != 0:
        assert data_dir == Path.home() / ".local/share/modelkeeper"
        return
    assert data_dir == Path("/var/lib/modelkeeper")
    assert Path("/root") not in [data_dir, *data_dir.parents]
    for folder in data_dir.parents:
        if folder.exists():
            assert folder.stat().st_mode & stat.S_IXOTH, f"{folder} is not world-traversable"


def test_the_data_dir_variable_still_wins(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("MODELKEEPER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert Settings().data_dir == tmp_path


def test_temporal_uses_the_cli_variable_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal.internal:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "prod")
    s = Settings()
    assert (s.temporal_address, s.temporal_namespace) == ("temporal.internal:7233", "prod")


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MODELKEEPER_API_PORT", "9000")
    monkeypatch.setenv("MODELKEEPER_DATA_DIR", "/nowhere")
    args = build_parser().parse_args(["up", "--api-port", "9100", "--data-dir", str(tmp_path)])
    s = load_settings(args)
    assert s.api_port == 9100
    assert s.data_dir == tmp_path
    args = build_parser().parse_args(["up"])
    assert load_settings(args).api_port == 9000


def test_bad_port_names_field_value_and_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.main import UsageError

    args = build_parser().parse_args(["up", "--temporal-ui-port", "70000"])
    with pytest.raises(UsageError) as info:
        load_settings(args)
    message = str(info.value)
    assert "--temporal-ui-port" in message and "70000" in message and "65535" in message


def test_a_rule_across_fields_is_one_sentence_naming_both(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.main import UsageError

    monkeypatch.setenv("MODELKEEPER_NODE_SILENT_AFTER_MAX_S", "1")
    with pytest.raises(UsageError) as info:
        load_settings(build_parser().parse_args(["api"]))
    assert str(info.value) == (
        "node_silent_after_max_s (MODELKEEPER_NODE_SILENT_AFTER_MAX_S) = 1 is below "
        "node_silent_after_s = 1.5: damping only stretches the liveness deadline, so its "
        "limit must be at least the deadline")


def test_readme_configuration_table_is_generated_from_settings() -> None:
    text = README.read_text()
    start = text.index("<!-- config-table:start -->") + len("<!-- config-table:start -->\n")
    end = text.index("<!-- config-table:end -->")
    assert text[start:end] == config_table_markdown(), (
        "README's configuration table is stale: regenerate it with `modelkeeper config-doc`"
    )


def test_each_tunable_default_lives_once() -> None:
    """Settings inherits the tunables' fields (modelkeeper.domain.tunables): the same
    defaults, limits and reasons, re-declared nowhere. A deployment started without the
    API runs with exactly what the API would send (Settings.tunables), and the keeper's
    own config defaults are the tunables'."""
    groups = (KeeperTunables, ControlTunables, LivenessTunables, AgentTunables, GatewayTunables,
              WatchdogTunables, NotifyTunables)
    settings = Settings.model_construct()  # the defaults, whatever the environment says
    for group in groups:
        for name, field in group.model_fields.items():
            mine = Settings.model_fields[name]
            assert (mine.default, mine.description, mine.metadata) == (
                field.default, field.description, field.metadata), name
    assert settings.tunables() == Tunables()
    assert Tunables().watch_heartbeat_timeout_s == 60.0  # 3 s once, in WorkflowTimings
    assert KeeperConfig() == KeeperConfig.of(Tunables())
