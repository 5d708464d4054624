"""deploy/prometheus/alerts.yml: the alert rules load as Prometheus reads them. Where
``promtool`` is installed it checks the file itself; without it, the file's structure is
checked here (never skipped): groups of named rules, each alert with an expression over
metrics the API exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from api.monitoring import quota_metrics

pytestmark = pytest.mark.timeout(30)

RULES = Path(__file__).parents[2] / "deploy" / "prometheus" / "alerts.yml"
#: promtool checks a rules file in well under a second; this bounds a hung one.
PROMTOOL_TIMEOUT_S = 20


def _rules() -> list[dict[str, object]]:
    loaded = yaml.safe_load(RULES.read_text())
    assert isinstance(loaded, dict) and set(loaded) == {"groups"}
    rules = []
    for group in loaded["groups"]:
        assert isinstance(group["name"], str) and group["name"]
        assert set(group) <= {"name", "interval", "rules", "limit"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations",
                                 "keep_firing_for"}
            assert ("alert" in rule) != ("record" in rule)
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            rules.append(rule)
    return rules


def test_the_scope_at_limit_alert_watches_a_metric_the_api_exports() -> None:
    [rule] = [r for r in _rules() if r.get("alert") == "ModelkeeperScopeAtLimit"]
    expr = str(rule["expr"])
    exported = quota_metrics([]).decode()
    names = set(re.findall(r"modelkeeper_[a-z_]+", expr))
    assert names == {"modelkeeper_quota_at_limit"}
    for name in names:
        assert f"# TYPE {name} gauge" in exported
    assert re.fullmatch(r"\d+[smh]", str(rule["for"]))
    assert "summary" in rule["annotations"]  # type: ignore[operator]


def test_promtool_accepts_the_file_where_installed() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        # The structure test above stands in for it; say so rather than skip silently.
        print("promtool not installed: checked the rules' structure only")
        _rules()
        return
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=PROMTOOL_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
