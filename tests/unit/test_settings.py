"""Settings: env names, precedence, and the README's generated table."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelkeeper.launcher.cli import build_parser, load_settings
from modelkeeper.settings import Settings, config_table_markdown

pytestmark = pytest.mark.timeout(10)

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults_match_the_documented_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MODELKEEPER_API_PORT", "TEMPORAL_ADDRESS", "MODELKEEPER_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    s = Settings()
    assert (s.api_port, s.gateway_port, s.postgres_port, s.temporal_port,
            s.temporal_ui_port) == (8400, 8401, 8432, 7233, 8233)
    assert s.data_dir == Path.home() / ".local/share/modelkeeper"


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
    from modelkeeper.launcher.cli import UsageError

    args = build_parser().parse_args(["up", "--temporal-ui-port", "70000"])
    with pytest.raises(UsageError) as info:
        load_settings(args)
    message = str(info.value)
    assert "--temporal-ui-port" in message and "70000" in message and "65535" in message


def test_readme_configuration_table_is_generated_from_settings() -> None:
    text = README.read_text()
    start = text.index("<!-- config-table:start -->") + len("<!-- config-table:start -->\n")
    end = text.index("<!-- config-table:end -->")
    assert text[start:end] == config_table_markdown(), (
        "README's configuration table is stale: regenerate it with `modelkeeper config-doc`"
    )
