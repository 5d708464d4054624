"""deploy/prometheus/alerts.yml: the alert rules load as Prometheus reads them
(`promtool check rules`), each fires when it should and not when it should not
(`promtool test rules` with deploy/prometheus/alerts_test.yml), and each reads series the
API or the gateway really exports, rendered by their own code (tests/support/
exported_metrics.py). promtool is required: without it these fail, they do not skip
(Debian's `prometheus` package brings it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.monitoring import quota_metrics
from gateway.metrics import TTFT_BUCKETS
from modelkeeper.domain.nodes import NodeState
from modelkeeper.domain.status import DeploymentStatus
from tests.support.exported_metrics import (
    PROMETHEUS_SERIES,
    TARGET_LABELS,
    Series,
    exported_series,
)
from tests.support.promql import promtool, read

pytestmark = pytest.mark.timeout(30)

PROMETHEUS_DIR = Path(__file__).parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
#: promtool checks and tests these files in well under a second; this bounds a hung one.
PROMTOOL_TIMEOUT_S = 20
SEVERITIES = {"warning", "critical"}
#: Labels whose values a rule may match, with the values the code exports for each.
KNOWN_VALUES = {
    "status": {s.value for s in DeploymentStatus},
    "state": {s.value for s in NodeState},
}


def _rules() -> list[dict[str, Any]]:
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


def _alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


@pytest.fixture(scope="module")
def exported() -> dict[str, Series]:
    return exported_series()


def _run_promtool(*args: str) -> None:
    done = subprocess.run([promtool(), *args], capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_rules() -> None:
    _run_promtool("check", "rules", str(RULES))


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    _run_promtool("test", "rules", str(RULE_TESTS))


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert [str(RULES.name)] == tests["rule_files"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert set(_alerts()) == fired, "alerts no test sees fire: " + str(set(_alerts()) - fired)
    assert set(_alerts()) == quiet, "alerts no test sees quiet: " + str(set(_alerts()) - quiet)


def test_the_test_series_are_named_and_labelled_as_the_code_exports_them(
        exported: dict[str, Series]) -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    for case in tests["tests"]:
        for entry in case["input_series"]:
            name, _, labels = entry["series"].partition("{")
            if name in PROMETHEUS_SERIES:
                continue
            assert name in exported, f"{name} is exported by neither the API nor the gateway"
            given = set(re.findall(r'([a-z_]+)="', labels)) - TARGET_LABELS
            assert given == set(exported[name].labels), (name, given)


def test_each_alert_reads_only_series_the_api_or_the_gateway_exports(
        exported: dict[str, Series]) -> None:
    for alert, rule in _alerts().items():
        reading = read(rule["expr"])
        assert reading.metrics, alert
        for name in reading.metrics - PROMETHEUS_SERIES:
            assert name in exported, f"{alert} reads {name}, which nothing exports"
        labels = set(TARGET_LABELS)
        for name in reading.metrics - PROMETHEUS_SERIES:
            labels |= exported[name].labels
        assert reading.grouped <= labels, (alert, reading.grouped - labels)
        for name, matched in reading.matched:
            own = exported[name].labels if name in exported else set()
            assert matched <= set(own) | TARGET_LABELS, (alert, name, matched)
        for label, values in re.findall(r'\b(status|state)=~?"([^"]*)"', rule["expr"]):
            unknown = set(values.split("|")) - KNOWN_VALUES[label]
            assert not unknown, f"{alert} matches {label} {unknown}, which is never exported"


def test_each_alert_says_how_bad_for_how_long_and_what_to_do() -> None:
    for alert, rule in _alerts().items():
        assert alert.startswith("Modelkeeper"), alert
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for"))), f"{alert}: no `for:`"
        assert rule["labels"]["severity"] in SEVERITIES, alert
        assert set(rule["annotations"]) == {"summary", "description"}, alert
        # What to do: a command or a setting, in backticks or by name.
        description = rule["annotations"]["description"]
        assert re.search(r"`modelkeeper [a-z]|`curl |GET /|watchdog_auto_protect|"
                         r"watchdog_warn_factor", description), alert


def test_the_first_token_target_is_a_bucket_bound_of_the_gateways_histogram() -> None:
    # Only at a bound does "p95 above the target" mean exactly "over 5 % took longer".
    expr = _alerts()["ModelkeeperGatewaySlowFirstToken"]["expr"]
    target = float(re.findall(r">\s*([\d.]+)\s*$", expr)[0])
    assert target in TTFT_BUCKETS


def test_the_scrape_alert_names_the_jobs_of_the_shipped_scrape_config() -> None:
    expr = _alerts()["ModelkeeperMetricsDown"]["expr"]
    jobs = set(re.findall(r'job=~"([^"]*)"', expr)[0].split("|"))
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert jobs == {job["job_name"] for job in config["scrape_configs"]}


def test_the_scope_at_limit_alert_watches_a_metric_the_api_exports() -> None:
    rule = _alerts()["ModelkeeperScopeAtLimit"]
    expr = str(rule["expr"])
    exported = quota_metrics([]).decode()
    names = set(re.findall(r"modelkeeper_[a-z_]+", expr))
    assert names == {"modelkeeper_quota_at_limit"}
    for name in names:
        assert f"# TYPE {name} gauge" in exported


def test_promtool_accepts_the_shipped_scrape_config(tmp_path: Path) -> None:
    # promtool reads the token files the config names; they live outside the repository
    # (secrets/monitoring/ under Compose), so the copy checked names stand-ins.
    text = SCRAPE_CONFIG.read_text()
    files = set(re.findall(r"credentials_file:\s*(\S+)", text))
    assert files, "each scrape sends a token"
    for path in files:
        stand_in = tmp_path / Path(path).name
        stand_in.write_text("mko-stand-in\n")
        text = text.replace(path, str(stand_in))
    (tmp_path / "prometheus.yml").write_text(text)
    (tmp_path / RULES.name).write_text(RULES.read_text())
    _run_promtool("check", "config", str(tmp_path / "prometheus.yml"))
