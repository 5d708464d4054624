"""The metric series modelkeeper really exports, rendered by its own code, for the tests
that check what alert rules and dashboards read (tests/unit/test_prometheus_rules.py,
tests/unit/test_grafana_dashboard.py).

The API's: its ``GET /metrics`` route itself, called with a store that holds one of each
thing (a deployment in each status, a node with its memory known, a scope with a limit),
so a renderer added to the route is covered, and one that reads something this store
lacks fails here rather than going unchecked. The gateway's: every metric of
:class:`GatewayMetrics`, each touched once with a value for each of its labels, found by
type rather than listed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from prometheus_client.metrics import Counter, Gauge, Histogram, MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from api.monitoring import metrics
from gateway.metrics import GatewayMetrics
from modelkeeper.domain.capacity import Holding, Limit, Quota, Resources
from modelkeeper.domain.catalog import DeploymentView
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.nodes import NodeRecord
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.settings import Settings

GIB = 1 << 30
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)

#: Series Prometheus makes itself, which rules and panels may read beside the exported
#: ones: for every target it scrapes (``up`` and the scrape's own figures), and the
#: alerts its rules hold (``ALERTS``).
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                               "ALERTS"})
#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})


@dataclass(frozen=True)
class Series:
    """One exported series name: the family it belongs to, its type and its labels."""

    family: str
    kind: str
    labels: frozenset[str]


def _deployments() -> list[DeploymentView]:
    """One deployment in each status, so that a query for any status finds one."""
    return [DeploymentView(
        deployment_id=DeploymentId(f"d-{i}"), model_id=ModelId(f"model-{status.value}"),
        status=status, placement_error=None, desired_replicas=2,
        ready_replicas=int(status is DeploymentStatus.DEGRADED) + 2 * int(
            status is DeploymentStatus.SERVING),
        consecutive_failures=3 * int(status is DeploymentStatus.PARKED), last_failure=None,
        min_nodes=1, node_ids=None, labels={}, replicas=[], workflow_id=f"deployment/d-{i}",
        created_at=NOW, updated_at=NOW) for i, status in enumerate(DeploymentStatus)]


def _node() -> NodeRecord:
    return NodeRecord(node_id=NodeId("n-1"), name="gpu-1", agent_labels={},
                      operator_labels={}, cordoned=False, cordon_reason=None,
                      memory_total_bytes=64 * GIB, memory_available_bytes=40 * GIB,
                      cpu_count=16, gpus=[], last_seen=NOW, registered_at=NOW,
                      memory_claimed_bytes=8 * GIB)


async def _returns(value: Any) -> Any:
    return value


def _store() -> Any:
    """What the metrics route reads of the store: a deployment in each status, a node,
    a scope with a limit."""
    quota = Quota(scope="acme", guarantee=Resources(memory_bytes=8 * GIB),
                  limit=Limit(memory_bytes=16 * GIB, gpus=2, cpu_cores=8))
    holding = Holding(owner="acme", resources=Resources(memory_bytes=8 * GIB, gpus=1))
    return SimpleNamespace(
        deployments=SimpleNamespace(list_deployments=lambda: _returns(_deployments())),
        nodes=SimpleNamespace(list_nodes=lambda: _returns([_node()])),
        quotas=SimpleNamespace(list_quotas=lambda: _returns([quota]),
                               holdings=lambda: _returns([holding])))


def api_exposition() -> str:
    """The API's ``GET /metrics`` body for a store holding one of each thing."""
    response = asyncio.run(metrics(_store(), Settings()))
    return bytes(response.body).decode()


#: Label values the gateway's metrics are touched with, where a query filters on them (a
#: 5xx code); any other label gets a made-up value.
GATEWAY_LABEL_VALUES = {"code": "503", "model": "qwen", "replica": "r-1"}


def _touch(metric: MetricWrapperBase) -> None:
    values = (GATEWAY_LABEL_VALUES.get(n, f"x-{n}") for n in metric._labelnames)
    labelled: Any = metric.labels(*values) if metric._labelnames else metric
    if isinstance(metric, Histogram):
        labelled.observe(0.5)
    elif isinstance(metric, Counter | Gauge):
        labelled.inc()
    else:
        raise AssertionError(f"a metric of an unknown type: {metric!r}")


def gateway_exposition() -> str:
    """The gateway's ``/metrics`` body once each of its metrics has a value."""
    gateway = GatewayMetrics()
    found = [m for m in vars(gateway).values() if isinstance(m, MetricWrapperBase)]
    assert found, "GatewayMetrics holds no metric"
    for metric in found:
        _touch(metric)
    return gateway.render().decode()


def series_of(exposition: str) -> dict[str, Series]:
    """Each sample name of a text exposition (``_total``, ``_bucket`` and the like
    included, ``_created`` not) with its family, type and label names."""
    result: dict[str, Series] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            # ``_created`` exists in one process only: the gateway's workers, summed in
            # multiprocess mode, do not export it, so nothing may rely on it.
            if not sample.name.endswith("_created"):
                result[sample.name] = Series(family.name, family.type,
                                             frozenset(sample.labels))
    return result


def exported_series() -> dict[str, Series]:
    """Every series name the API or the gateway exports."""
    api, gateway = series_of(api_exposition()), series_of(gateway_exposition())
    assert not set(api) & set(gateway), "the API and the gateway export the same name"
    return {**api, **gateway}


def _promtool_values(kind: str, value: float, points: int) -> str:
    """A series' values in promtool's notation: a counter (or a histogram's bucket, count
    and sum) grows by its value each step, so that rate() sees traffic; a gauge holds."""
    if kind in {"counter", "histogram"}:
        return f"{value:g}+{value:g}x{points}"
    return f"{value:g}x{points}"


def promtool_input_series(points: int) -> list[dict[str, str]]:
    """Every exported series as a promtool unit test's ``input_series``, scraped as the
    shipped scrape config names the jobs, over ``points`` steps."""
    result = []
    for job, exposition in (("modelkeeper-api", api_exposition()),
                            ("modelkeeper-gateway", gateway_exposition())):
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = {**sample.labels, "job": job, "instance": f"{job}:1"}
                body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                result.append({"series": f"{sample.name}{{{body}}}",
                               "values": _promtool_values(family.type, sample.value, points)})
    return result
