"""deploy/alertmanager/alertmanager.yml, the receiver template for the Prometheus alerts:
every alert in deploy/prometheus/alerts.yml is routed (a critical one to the critical
receiver), and every receiver it names exists. Where Debian's ``amtool`` is installed
(prometheus-alertmanager), it checks the file and its routing itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(30)

DEPLOY = Path(__file__).parents[2] / "deploy"
CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
RULES = DEPLOY / "prometheus" / "alerts.yml"
#: amtool checks a config in well under a second; this bounds a hung one.
AMTOOL_TIMEOUT_S = 20


def _alerts() -> list[tuple[str, str]]:
    """Each alert of the rules file with its severity."""
    loaded = yaml.safe_load(RULES.read_text())
    return [(rule["alert"], rule.get("labels", {}).get("severity", ""))
            for group in loaded["groups"] for rule in group["rules"] if "alert" in rule]


def _matches(matcher: str, labels: dict[str, str]) -> bool:
    """One Alertmanager matcher (``name = "v"`` or ``name =~ "re"``) against labels."""
    found = re.fullmatch(r'\s*(\w+)\s*(=~|!=|!~|=)\s*"(.*)"\s*', matcher)
    assert found, matcher
    name, op, value = found.groups()
    have = labels.get(name, "")
    match op:
        case "=":
            return have == value
        case "!=":
            return have != value
        case "=~":
            return re.fullmatch(value, have) is not None
        case _:
            return re.fullmatch(value, have) is None


def _receiver(route: dict[str, object], labels: dict[str, str]) -> str:
    """The receiver Alertmanager picks: the first child route whose matchers all match
    (no ``continue`` in this file), else the parent's."""
    for child in route.get("routes", []):  # type: ignore[attr-defined]
        if all(_matches(m, labels) for m in child.get("matchers", [])):
            return _receiver({"receiver": route["receiver"], **child}, labels)
    return str(route["receiver"])


def test_every_alert_is_routed_and_a_critical_one_to_the_critical_receiver() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    receivers = {r["name"] for r in config["receivers"]}
    alerts = _alerts()
    assert alerts, "no alert rules found"
    for alert, severity in alerts:
        picked = _receiver(config["route"], {"alertname": alert, "severity": severity})
        assert picked in receivers, (alert, picked)
        assert picked == ("modelkeeper-critical" if severity == "critical"
                          else "modelkeeper-slack"), (alert, severity, picked)


def test_no_secret_is_written_into_the_template() -> None:
    text = CONFIG.read_text()
    assert "hooks.slack.com/services" not in text
    assert "api_url_file" in text and "credentials_file" in text


def test_amtool_accepts_the_file_and_routes_as_documented_where_installed(
        tmp_path: Path) -> None:
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (Debian: prometheus-alertmanager)")
    checked = subprocess.run([amtool, "check-config", str(CONFIG)], capture_output=True,
                             text=True, timeout=AMTOOL_TIMEOUT_S, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for alert, severity in _alerts():
        routed = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={CONFIG}",
             f"alertname={alert}", f"severity={severity}"],
            capture_output=True, text=True, timeout=AMTOOL_TIMEOUT_S, cwd=tmp_path)
        assert routed.returncode == 0, routed.stderr
        assert routed.stdout.strip() == ("modelkeeper-critical" if severity == "critical"
                                         else "modelkeeper-slack"), (alert, routed.stdout)
