"""The API's per-node series (api.monitoring.node_metrics): each node's state, judged at
scrape time as GET /nodes judges it, one series per state so that an alert on "silent"
has a series to fire on, and its memory, with what is unknown left out rather than 0."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.monitoring import node_metrics
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import NodeRecord, NodeState

pytestmark = pytest.mark.timeout(30)

GIB = 1 << 30
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _node(name: str, *, quiet_s: float, silent: bool = False, cordoned: bool = False,
          available: int | None = 40 * GIB) -> NodeRecord:
    return NodeRecord(node_id=NodeId(f"n-{name}"), name=name, agent_labels={},
                      operator_labels={}, cordoned=cordoned, cordon_reason=None,
                      memory_total_bytes=64 * GIB, memory_available_bytes=available,
                      cpu_count=8, gpus=[], last_seen=NOW - timedelta(seconds=quiet_s),
                      registered_at=NOW - timedelta(days=1),
                      silent_since=NOW if silent else None, memory_claimed_bytes=8 * GIB)


def _samples(nodes: list[NodeRecord]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = node_metrics(nodes, now=NOW, unreachable_after_s=6, lost_after_s=60).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _state(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], node: str
           ) -> dict[str, float]:
    return {dict(labels)["state"]: value for (name, labels), value in samples.items()
            if name == "modelkeeper_node_state" and dict(labels)["node"] == node}


def test_each_node_has_one_series_per_state_with_its_own_at_one() -> None:
    samples = _samples([_node("ready", quiet_s=1), _node("quiet", quiet_s=10),
                        _node("silent", quiet_s=1, silent=True),
                        _node("gone", quiet_s=120, cordoned=True),
                        _node("fenced", quiet_s=1, cordoned=True)])
    expected = {"ready": NodeState.READY, "quiet": NodeState.UNREACHABLE,
                "silent": NodeState.UNREACHABLE, "gone": NodeState.LOST,
                "fenced": NodeState.CORDONED}
    for node, state in expected.items():
        assert _state(samples, node) == {s.value: float(s is state) for s in NodeState}, node


def test_memory_and_last_seen_are_exported_and_an_unknown_figure_is_absent() -> None:
    samples = _samples([_node("box", quiet_s=5, available=None)])
    key = (("node", "box"), ("node_id", "n-box"))
    assert samples["modelkeeper_node_memory_total_bytes", key] == 64 * GIB
    assert samples["modelkeeper_node_memory_claimed_bytes", key] == 8 * GIB
    assert ("modelkeeper_node_memory_available_bytes", key) not in samples
    assert samples["modelkeeper_node_last_seen_timestamp_seconds", key] == (
        NOW - timedelta(seconds=5)).timestamp()
