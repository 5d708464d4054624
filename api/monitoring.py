"""Routes an operator watches: health, Prometheus metrics and the audit log.

Health is on a router of its own (``health``), open to all: `up` and readiness probes
call it without a token. Metrics and the audit log need a viewer (``router``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

from fastapi import APIRouter, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError

from modelkeeper import __version__
from modelkeeper.domain.catalog import DeploymentView
from modelkeeper.domain.events import Event
from modelkeeper.domain.nodes import NodeRecord, NodeState, node_state
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.watchdog import LEVEL_RANK
from modelkeeper.names import CONTROL_TASK_QUEUE

from .deps import SettingsDep, StoreDep, TemporalDep
from .quotas import QuotaView, quota_views

router = APIRouter()
health = APIRouter()

#: The most audit entries one GET /events answers: a day of a busy cluster, and still a
#: response of a few MB. A negative or huge limit is a 422, not a query PostgreSQL refuses.
MAX_EVENTS_LIMIT = 10_000


class Health(BaseModel):
    """What /healthz reports: each dependency, and whether a control worker polls."""

    status: str
    version: str
    database: bool
    temporal: bool
    control_workers: int


@health.get("/healthz", response_model=Health)
async def healthz(response: Response, store: StoreDep, temporal: TemporalDep, *,
                  settings: SettingsDep) -> Health:
    """Liveness of the API and its dependencies; 503 when one is down."""
    database_ok = await store.ping()
    try:
        workers = await _control_pollers(temporal, settings.temporal_namespace)
        temporal_ok = True
    except RPCError:
        workers, temporal_ok = 0, False
    ok = database_ok and temporal_ok
    if not ok:
        response.status_code = 503
    return Health(status="ok" if ok else "degraded", version=__version__,
                  database=database_ok, temporal=temporal_ok, control_workers=workers)


@router.get("/metrics", include_in_schema=False)
async def metrics(store: StoreDep, settings: SettingsDep) -> Response:
    """Prometheus gauges per deployment, per quota's scope and per node, read from the
    store at scrape time (deploy/prometheus/alerts.yml alerts on them)."""
    nodes = await store.nodes.list_nodes()
    return Response(deployment_metrics(await store.deployments.list_deployments())
                    + quota_metrics(await quota_views(store))
                    + node_memory_metrics(nodes)
                    + node_metrics(nodes, now=datetime.now(UTC),
                                   unreachable_after_s=settings.node_unreachable_after_s,
                                   lost_after_s=settings.node_lost_after_s),
                    media_type=CONTENT_TYPE_LATEST)


@router.get("/events", response_model=list[Event])
async def list_events(
    store: StoreDep, deployment_id: str | None = None,
    limit: int = Query(default=100, ge=1, le=MAX_EVENTS_LIMIT),
) -> list[Event]:
    """The audit log, newest ``limit`` entries (1 to 10,000), oldest first."""
    return await store.events.list_events(deployment_id=deployment_id, limit=limit)


class _DeploymentCollector(Collector):
    """The deployment gauges, from the deployments' views.

    Every deployment has every series, zeros included: an alert on "ready == 0 while
    desired > 0" must be able to fire, which it cannot on a series that vanishes. So
    ``modelkeeper_deployment_status`` has one series per status in ``DeploymentStatus``
    (1 for the current one, 0 for the rest), a status added there included. Metric
    families rather than labelled gauges: a scrape runs on the API's event loop, and
    families take a third of the time (300 deployments: 12 series each).
    """

    def __init__(self, deployments: list[DeploymentView]) -> None:
        self._deployments = deployments

    def collect(self) -> Iterator[Metric]:
        labels = ["deployment_id", "model_id"]
        desired = GaugeMetricFamily("modelkeeper_deployment_desired_replicas",
                                    "Replicas asked for.", labels=labels)
        ready = GaugeMetricFamily("modelkeeper_deployment_ready_replicas",
                                  "Replicas ready to serve.", labels=labels)
        parked = GaugeMetricFamily("modelkeeper_deployment_parked",
                                   "1 when parked after failed starts.", labels=labels)
        cant_place = GaugeMetricFamily("modelkeeper_deployment_cant_place",
                                       "1 when nothing fits.", labels=labels)
        failures = GaugeMetricFamily("modelkeeper_deployment_consecutive_failures",
                                     "Failed starts in a row.", labels=labels)
        status = GaugeMetricFamily("modelkeeper_deployment_status",
                                   "1 for the deployment's current status, 0 for every other.",
                                   labels=[*labels, "status"])
        for d in self._deployments:
            key = [d.deployment_id, d.model_id]
            desired.add_metric(key, d.desired_replicas)
            ready.add_metric(key, d.ready_replicas)
            parked.add_metric(key, int(d.status is DeploymentStatus.PARKED))
            cant_place.add_metric(key, int(d.status is DeploymentStatus.CANT_PLACE))
            failures.add_metric(key, d.consecutive_failures)
            for each in DeploymentStatus:
                status.add_metric([*key, each.value], int(d.status is each))
        yield from (desired, ready, parked, cant_place, failures, status)


def deployment_metrics(deployments: list[DeploymentView]) -> bytes:
    """The deployment gauges (:class:`_DeploymentCollector`) in Prometheus' text format."""
    registry = CollectorRegistry()
    registry.register(_DeploymentCollector(deployments))
    return generate_latest(registry)


#: The resources a quota counts, as the ``resource`` label names them, with each part's
#: field in Resources and Limit.
QUOTA_RESOURCES = (("memory_bytes", "memory_bytes"), ("gpus", "gpus"),
                   ("cpu_cores", "cpu_cores"))


def quota_metrics(views: list[QuotaView]) -> bytes:
    """The gauges of each scope that has a quota, in Prometheus' text format:
    ``modelkeeper_quota_held``, ``_guarantee`` and ``_limit`` per resource (a limit
    only where one is set: an unset part is unlimited, not 0), and
    ``modelkeeper_quota_at_limit`` (1 when any part has reached its limit, which the
    ``ModelkeeperScopeAtLimit`` alert watches; every scope has it, 0 included)."""
    registry = CollectorRegistry()
    labels = ["scope", "resource"]
    held = Gauge("modelkeeper_quota_held", "What the scope and those beneath it hold.",
                 labels, registry=registry)
    guarantee = Gauge("modelkeeper_quota_guarantee", "The scope's guarantee.", labels,
                      registry=registry)
    limit = Gauge("modelkeeper_quota_limit", "The scope's limit (absent: unlimited).",
                  labels, registry=registry)
    borrowed = Gauge("modelkeeper_quota_borrowed", "What the scope holds beyond its "
                     "guarantee: what may be taken back.", labels, registry=registry)
    reached = Gauge("modelkeeper_quota_at_limit", "1 when a part has reached its limit.",
                    ["scope"], registry=registry)
    for view in views:
        for resource, field in QUOTA_RESOURCES:
            held.labels(view.scope, resource).set(getattr(view.held, field))
            guarantee.labels(view.scope, resource).set(getattr(view.guarantee, field))
            borrowed.labels(view.scope, resource).set(getattr(view.borrowed, field))
            cap = getattr(view.limit, field)
            if cap is not None:
                limit.labels(view.scope, resource).set(cap)
        reached.labels(view.scope).set(int(bool(view.at_limit)))
    return generate_latest(registry)


class _NodeMemoryCollector(Collector):
    """The memory watchdog's series (docs/capacity.md, "The memory watchdog"): each
    node's level as a number (0 ok, 1 warn, 2 critical; the alert
    ``ModelkeeperNodeMemoryCritical`` fires on 2) and its changes as a counter, both read
    from the nodes' rows, so every API process answers the same."""

    def __init__(self, nodes: list[NodeRecord]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[Metric]:
        labels = ["node_id", "node"]
        level = GaugeMetricFamily("modelkeeper_node_memory_level",
                                  "The node's memory level: 0 ok, 1 warn, 2 critical.",
                                  labels=labels)
        changes = CounterMetricFamily("modelkeeper_node_memory_level_changes",
                                      "Times the node's memory level changed.",
                                      labels=labels)
        for node in self._nodes:
            key = [node.node_id, node.name]
            level.add_metric(key, LEVEL_RANK[node.memory_level])
            changes.add_metric(key, node.memory_level_changes)
        yield level
        yield changes


def node_memory_metrics(nodes: list[NodeRecord]) -> bytes:
    """The per-node memory series in Prometheus' text format."""
    registry = CollectorRegistry()
    registry.register(_NodeMemoryCollector(nodes))
    return generate_latest(registry)


class _NodeCollector(Collector):
    """Each node's liveness and memory, from the nodes' rows, judged at ``now``.

    ``modelkeeper_node_state`` has one series per state in ``NodeState`` (1 for the
    node's state, judged as ``GET /nodes`` judges it, 0 for the rest), so the
    ``ModelkeeperNodeSilent`` alert has a series to fire on, and a state added there is
    exported too. ``modelkeeper_node_last_seen_timestamp_seconds`` is its last heartbeat
    (Unix time). Memory: the total and what its replicas claim, and what its agent last
    measured available (absent while unknown, rather than a 0 that reads as full).
    Metric families rather than labelled gauges: a third of the time at 300 nodes.
    """

    def __init__(self, nodes: list[NodeRecord], *, now: datetime, unreachable_after_s: float,
                 lost_after_s: float) -> None:
        self._nodes = nodes
        self._now = now
        self._unreachable_after_s = unreachable_after_s
        self._lost_after_s = lost_after_s

    def collect(self) -> Iterator[Metric]:
        labels = ["node_id", "node"]
        state = GaugeMetricFamily("modelkeeper_node_state",
                                  "1 for the node's current state, 0 for every other.",
                                  labels=[*labels, "state"])
        last_seen = GaugeMetricFamily("modelkeeper_node_last_seen_timestamp_seconds",
                                      "When the node's agent last sent a heartbeat (Unix "
                                      "time).", labels=labels)
        total = GaugeMetricFamily("modelkeeper_node_memory_total_bytes",
                                  "The node's memory, as its agent reports it.", labels=labels)
        claimed = GaugeMetricFamily("modelkeeper_node_memory_claimed_bytes",
                                    "What the replicas placed on the node claim.",
                                    labels=labels)
        available = GaugeMetricFamily("modelkeeper_node_memory_available_bytes",
                                      "What the node's agent last measured available.",
                                      labels=labels)
        for node in self._nodes:
            key = [node.node_id, node.name]
            now_state = node_state(node, self._now,
                                   unreachable_after_s=self._unreachable_after_s,
                                   lost_after_s=self._lost_after_s)
            for each in NodeState:
                state.add_metric([*key, each.value], int(now_state is each))
            last_seen.add_metric(key, node.last_seen.timestamp())
            claimed.add_metric(key, node.memory_claimed_bytes)
            if node.memory_total_bytes is not None:
                total.add_metric(key, node.memory_total_bytes)
            if node.memory_available_bytes is not None:
                available.add_metric(key, node.memory_available_bytes)
        yield from (state, last_seen, total, claimed, available)


def node_metrics(nodes: list[NodeRecord], *, now: datetime, unreachable_after_s: float,
                 lost_after_s: float) -> bytes:
    """Each node's liveness and memory (:class:`_NodeCollector`) in Prometheus' text
    format."""
    registry = CollectorRegistry()
    registry.register(_NodeCollector(nodes, now=now, unreachable_after_s=unreachable_after_s,
                                     lost_after_s=lost_after_s))
    return generate_latest(registry)


async def _control_pollers(client: Client, namespace: str) -> int:
    """How many worker identities poll the control task queue (activities or workflows)."""
    identities: set[str] = set()
    for queue_type in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
                       TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
        resp = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(namespace=namespace,
                                     task_queue=TaskQueue(name=CONTROL_TASK_QUEUE),
                                     task_queue_type=queue_type)
        )
        identities.update(p.identity for p in resp.pollers)
    return len(identities)
