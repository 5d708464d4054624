"""deploy/grafana/modelkeeper.json, the Grafana dashboard: every query names only series
the API or the gateway really exports, rendered by their own code (tests/support/
exported_metrics.py), with labels those series carry; every query is valid PromQL
(`promtool check rules` on them); and the provisioning files that load it into Compose's
Grafana point at it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.exported_metrics import (
    PROMETHEUS_SERIES,
    TARGET_LABELS,
    Series,
    exported_series,
    promtool_input_series,
)
from tests.support.promql import plain, promtool, read

pytestmark = pytest.mark.timeout(30)

GRAFANA = Path(__file__).parents[2] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "modelkeeper.json"
PROVISIONING = GRAFANA / "provisioning"
PROMTOOL_TIMEOUT_S = 20
#: The dashboard's data source is a variable, so that it imports into any Grafana.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: Sections an operator looks for (issue 24: fleet, deployments, nodes, gateway, quotas).
ROWS = {"Fleet", "Deployments", "Nodes", "Gateway", "Quotas"}


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _variables() -> dict[str, str]:
    """What each of the dashboard's own variables stands for in a checked query: an
    "All" value where it has one (a regex over every value)."""
    values = {}
    for variable in _dashboard()["templating"]["list"]:
        values[variable["name"]] = variable.get("allValue", "")
    return values


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable, as Prometheus
    would run them."""
    variables = _variables()
    found = []
    for panel in _panels(_dashboard()["panels"]):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}",
                          plain(target["expr"], variables)))
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = query.removeprefix("label_values(").removesuffix(")")
            assert inner != query, f"variable {variable['name']}: {query!r}"
            metric, _, label = inner.rpartition(",")
            found.append((f"variable {variable['name']}",
                          f"max by ({label.strip()}) ({plain(metric, variables)})"))
    return found


@pytest.fixture(scope="module")
def exported() -> dict[str, Series]:
    return exported_series()


def test_every_query_names_a_series_the_api_or_the_gateway_exports(
        exported: dict[str, Series]) -> None:
    queries = _queries()
    assert len(queries) > 20
    for where, expr in queries:
        reading = read(expr)
        assert reading.metrics, f"{where}: no metric in {expr!r}"
        unknown = reading.metrics - set(exported) - PROMETHEUS_SERIES
        assert not unknown, f"{where}: {sorted(unknown)} exported by neither the API nor " \
                            f"the gateway"
        if reading.metrics & PROMETHEUS_SERIES:
            continue  # Prometheus' own series: their labels are its own
        labels = set(TARGET_LABELS).union(*(exported[n].labels for n in reading.metrics))
        assert reading.grouped <= labels, f"{where}: no such label {reading.grouped - labels}"
        for name, matched in reading.matched:
            assert matched <= exported[name].labels | TARGET_LABELS, (where, name, matched)


def test_the_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, (_, expr) in enumerate(_queries())]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=PROMTOOL_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_covers_the_fleet_deployments_nodes_gateway_and_quotas() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    panels = list(_panels(dashboard["panels"]))
    assert {p["title"] for p in panels if p["type"] == "row"} == ROWS
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == DATASOURCE, panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == DATASOURCE, panel["title"]


def test_compose_grafana_is_provisioned_with_the_dashboard_and_the_prometheus_source(
) -> None:
    [source] = yaml.safe_load(
        (PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus"
    [provider] = yaml.safe_load(
        (PROVISIONING / "dashboards" / "modelkeeper.yml").read_text())["providers"]
    assert provider["type"] == "file"
    # The Compose file mounts the dashboard where the provider reads.
    compose = yaml.safe_load((GRAFANA.parents[1] / "docker-compose.temporal.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    assert mounted[f"{provider['options']['path']}/{DASHBOARD.name}"] == \
        f"./{DASHBOARD.relative_to(GRAFANA.parents[1])}"
    assert mounted["/etc/grafana/provisioning"] == \
        f"./{PROVISIONING.relative_to(GRAFANA.parents[1])}"
    host, _, port = source["url"].removeprefix("http://").partition(":")
    assert host in compose["services"] and port == "9090"


def test_every_query_finds_data_in_what_the_api_and_the_gateway_export(
        tmp_path: Path) -> None:
    # Each query, run by promtool over the series the code renders (a deployment in each
    # status, a node, a scope, gateway traffic), returns something: `absent(query)` is
    # empty. A query on a misspelt label value or a series that exists only in theory
    # shows "No data" forever; this catches it.
    queries = _queries()
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": promtool_input_series(points=20),
        "promql_expr_test": [{"expr": f"absent({expr})", "eval_time": "10m",
                              "exp_samples": []} for _, expr in queries]}]}
    path = tmp_path / "dashboard_test.yml"
    path.write_text(yaml.safe_dump(tests))
    done = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=PROMTOOL_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
