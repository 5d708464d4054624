"""Graceful stop without a network: the rules of check_drain, one test each, and the
gateway's table and usage snapshot keeping a replica that left routing counted until its
requests end."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from gateway.breaker import Breaker
from gateway.table import Endpoint, RoutingTable
from gateway.usage import snapshot
from modelkeeper.domain.draining import (
    DEFAULT_GRACE_S,
    Drained,
    DrainReplicaInput,
    GraceOver,
    StillDraining,
    UsageReport,
    check_drain,
)
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.store.routing import DeploymentRoute, ReplicaRoute, ReplicaUsage

pytestmark = pytest.mark.timeout(10)

MARK = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
INTERVAL_S = 1.0
GRACE_S = 30.0


def at(seconds: float) -> datetime:
    """``seconds`` after the mark (negative: before it)."""
    return MARK + timedelta(seconds=seconds)


def row(gateway: str, in_flight: int, written: float) -> UsageReport:
    return UsageReport(gateway_id=gateway, in_flight=in_flight, updated_at=at(written))


def check(*reports: UsageReport, now: float) -> object:
    return check_drain(reports, marked_at=MARK, now=at(now), grace_s=GRACE_S,
                       flush_interval_s=INTERVAL_S)


def test_rule1_fresh_rows_at_zero_are_drained_at_once() -> None:
    verdict = check(row("g1", 0, 0.05), row("g2", 0, 0.1), now=0.2)
    assert isinstance(verdict, Drained) and "2 gateway worker(s)" in verdict.reason


def test_rule1_a_fresh_row_with_requests_keeps_it_draining() -> None:
    assert check(row("g1", 0, 0.05), row("g2", 2, 0.1), now=0.2) == StillDraining(
        in_flight=2, pending=())


def test_rule1_a_row_written_at_the_mark_itself_is_not_fresh() -> None:
    # Stamped no later than the mark: written by a worker that may still route it.
    assert check(row("g1", 0, 0.0), now=0.2) == StillDraining(in_flight=0, pending=("g1",))


def test_rule2_a_worker_not_heard_from_since_the_mark_holds_the_drain() -> None:
    # g2 reported 0 before the mark, but it may have routed a request there since.
    verdict = check(row("g1", 0, 0.1), row("g2", 0, -0.5), now=0.6)
    assert verdict == StillDraining(in_flight=0, pending=("g2",))


def test_rule2_a_dead_workers_row_is_ignored() -> None:
    # Five intervals without a write: the worker is gone (its count, 3, went with it).
    assert isinstance(check(row("g1", 0, 0.1), row("dead", 3, -4.9), now=0.2), Drained)
    assert isinstance(check(row("g1", 0, 0.1), row("dead", 3, -4.7), now=0.2), StillDraining)


def test_rule3_no_row_at_all_is_drained_after_one_flush_interval_not_before() -> None:
    assert check(now=0.9) == StillDraining(in_flight=0, pending=())
    verdict = check(now=1.0)
    assert isinstance(verdict, Drained) and "no gateway worker" in verdict.reason


def test_rule4_grace_over_counts_fresh_and_pending_requests() -> None:
    late = check(row("g1", 1, 29.5), row("g2", 2, -1.0), now=30.0)
    assert late == GraceOver(in_flight=1, pending=())  # g2 went stale meanwhile: gone
    both = check_drain([row("g1", 1, 0.5), row("g2", 2, -0.5)], marked_at=MARK, now=at(2.0),
                       grace_s=1.5, flush_interval_s=INTERVAL_S)
    assert both == GraceOver(in_flight=3, pending=("g2",))


def test_rule4_drained_wins_over_grace_at_the_same_moment() -> None:
    assert isinstance(check(row("g1", 0, 29.0), now=31.0), Drained)


def test_rule5_otherwise_still_draining() -> None:
    assert check(row("g1", 1, 0.5), now=10.0) == StillDraining(in_flight=1, pending=())


def test_drain_input_grace_is_bounded() -> None:
    assert DrainReplicaInput(replica_id=ReplicaId("r")).grace_s == DEFAULT_GRACE_S == 30.0
    for bad in (0, -1, 3600.5):
        with pytest.raises(ValidationError, match="grace_s"):
            DrainReplicaInput(replica_id=ReplicaId("r"), grace_s=bad)
    assert DrainReplicaInput(replica_id=ReplicaId("r"), grace_s=3600).grace_s == 3600


# -- the gateway's side ---------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def route(*replicas: tuple[str, str]) -> DeploymentRoute:
    return DeploymentRoute(
        deployment_id="d1", model_id="m", status="serving", desired_replicas=len(replicas),
        placement_error=None, last_failure=None, consecutive_failures=0, created_at=T0,
        ready=tuple(ReplicaRoute(rid, url) for rid, url in replicas))


def make_endpoint(replica: ReplicaRoute, deployment: DeploymentRoute) -> Endpoint:
    return Endpoint(replica.replica_id, replica.endpoint, deployment.deployment_id,
                    deployment.model_id, {}, Breaker(2, 1.0))


def test_an_endpoint_leaving_routing_is_reported_until_written_down_to_zero() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("a", "http://h:1"), ("b", "http://h:2")))
    a, b = table.models["m"].endpoints
    a.in_flight = 2

    table.apply(route(("b", "http://h:2")))  # a is draining
    assert a.leaving and not b.leaving and table.leaving == {a}
    assert table.models["m"].pick(0.0) is b, "no new request goes to a"
    rows = snapshot(table)
    assert rows.replicas == [ReplicaUsage("b", 0, None)]
    assert rows.leaving == [ReplicaUsage("a", 2, None)]
    assert rows.done == []
    table.forget_left(rows.done)
    assert table.leaving == {a}

    a.in_flight = 0  # its last request ended
    rows = snapshot(table)
    assert rows.leaving == [ReplicaUsage("a", 0, None)] and rows.done == [a]
    table.forget_left(rows.done)  # written: a is forgotten
    assert table.leaving == set()
    assert snapshot(table).leaving == []


def test_an_idle_endpoint_leaving_is_reported_once_at_zero() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("a", "http://h:1")))
    table.remove("d1")
    rows = snapshot(table)
    assert rows.leaving == [ReplicaUsage("a", 0, None)]
    table.forget_left(rows.done)
    assert snapshot(table).leaving == []


def test_a_replica_routed_again_at_a_new_address_has_one_row_with_both_counts() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("a", "http://h:1")))
    old = table.models["m"].endpoints[0]
    old.in_flight, old.last_used = 1, 100.0
    table.apply(route(("a", "http://h:9")))
    new = table.models["m"].endpoints[0]
    new.in_flight, new.last_used = 2, 50.0
    rows = snapshot(table)
    # The store keeps one row per worker and replica, checked against the replica's state.
    assert rows.replicas == [ReplicaUsage("a", 3, datetime.fromtimestamp(100.0, UTC))]
    assert rows.leaving == []
