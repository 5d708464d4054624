"""The rules of :mod:`gateway.dispatch` (holding a request through an engine's recovery),
one test each, on an in-memory table with the clock as an argument."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.breaker import Breaker
from gateway.dispatch import GiveUp, Hold, HoldPolicy, SendTo, Tried, next_step, record
from gateway.table import Endpoint, RoutingTable
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.store.routing import DeploymentRoute, ReplicaRoute

pytestmark = pytest.mark.timeout(30)

MODEL = "sim-r"

POLICY = HoldPolicy(wait_s=10.0, retries=2, retry_after_s=5, load_wait_s=30.0)
OPEN_S = 5.0
T0 = 1000.0  # monotonic seconds; the request arrives then


def table_of(*replica_ids: str, status: str = "serving",
             breaker_failures: int = 5) -> RoutingTable:
    def make(replica: ReplicaRoute, route: DeploymentRoute) -> Endpoint:
        return Endpoint(replica.replica_id, replica.endpoint, route.deployment_id,
                        route.model_id, {}, Breaker(breaker_failures, OPEN_S))

    table = RoutingTable(make)
    apply(table, *replica_ids, status=status)
    return table


def apply(table: RoutingTable, *replica_ids: str, status: str = "serving") -> None:
    table.apply(DeploymentRoute(
        deployment_id="d", model_id=MODEL, status=status, desired_replicas=1,
        placement_error=None, last_failure="engine exited 1" if status == "parked" else None,
        consecutive_failures=0, created_at=datetime(2026, 1, 1, tzinfo=UTC),
        ready=tuple(ReplicaRoute(rid, f"http://h/{rid}") for rid in replica_ids)))


def endpoint(table: RoutingTable, replica_id: str) -> Endpoint:
    return next(e for e in table.models[MODEL].endpoints if e.replica_id == replica_id)


def fail(tried: Tried | None, target: Endpoint, now: float, *, refused: bool) -> Tried:
    """One attempt on ``target`` that failed before the first byte, settled as the
    gateway settles it: breaker verdict first, then the record."""
    target.breaker.begin(now)
    target.breaker.failure(now)
    return record(tried, target, why="Cannot connect" if refused else "reset",
                  refused=refused)


def step(table: RoutingTable, tried: Tried | None, now: float,
         policy: HoldPolicy = POLICY) -> object:
    return next_step(table, MODEL, tried, now, arrived=T0, policy=policy)


def test_a_replica_that_refused_is_left_for_one_not_tried_and_then_held_for() -> None:
    table = table_of("a", "b")
    a, b = endpoint(table, "a"), endpoint(table, "b")
    tried = fail(None, a, T0, refused=True)
    assert step(table, tried, T0) == SendTo(b)
    tried = fail(tried, b, T0, refused=True)
    assert step(table, tried, T0 + 1) == Hold(table.models[MODEL], T0 + POLICY.wait_s)


def test_a_dropped_connection_is_sent_again_at_once_but_only_once() -> None:
    table = table_of("a")
    a = endpoint(table, "a")
    tried = fail(None, a, T0, refused=False)
    assert step(table, tried, T0) == SendTo(a)
    tried = fail(tried, a, T0, refused=False)
    assert isinstance(step(table, tried, T0), Hold)


def test_a_replacement_gets_the_held_request_and_the_send_counts_as_a_retry() -> None:
    policy = HoldPolicy(wait_s=10.0, retries=1, retry_after_s=5, load_wait_s=30.0)
    table = table_of("a")
    tried = fail(None, endpoint(table, "a"), T0, refused=True)
    assert isinstance(step(table, tried, T0, policy), Hold)
    apply(table, "a", "b")  # the replacement is ready
    assert step(table, tried, T0 + 2, policy) == SendTo(endpoint(table, "b"))
    tried = fail(tried, endpoint(table, "b"), T0 + 2, refused=True)
    # Retries spent (1 after the first send): a fresh replica does not change that, and
    # the answer comes at once, without a hold.
    apply(table, "a", "b", "c")
    answer = step(table, tried, T0 + 2, policy)
    assert isinstance(answer, GiveUp) and answer.reply.status == 502
    assert answer.reply.message == f"No replica of `{MODEL}` could answer: Cannot connect"


def test_the_hold_ends_at_the_deadline_counted_from_arrival() -> None:
    table = table_of("a")
    tried = fail(None, endpoint(table, "a"), T0 + 3, refused=True)
    assert step(table, tried, T0 + 3) == Hold(table.models[MODEL], T0 + POLICY.wait_s)
    answer = step(table, tried, T0 + POLICY.wait_s)
    assert isinstance(answer, GiveUp)
    assert (answer.reply.status, answer.reply.code) == (502, "upstream_unavailable")
    assert "Cannot connect" in answer.reply.message
    assert "None it could be retried on was ready within 10.0s" in answer.reply.message
    # Never sent (no replica was ready all along): the 503 with Retry-After, as before.
    apply(table)
    never_sent = step(table, None, T0 + POLICY.wait_s)
    assert isinstance(never_sent, GiveUp)
    assert never_sent.reply.status == 503 and never_sent.reply.code == "model_not_ready"
    assert never_sent.reply.headers == [(b"retry-after", b"5")]


def test_a_replica_that_is_out_comes_back_through_its_breaker() -> None:
    table = table_of("a", breaker_failures=1)
    a = endpoint(table, "a")
    tried = fail(None, a, T0, refused=True)  # its breaker opens: trial at T0 + OPEN_S
    held = step(table, tried, T0 + 1)
    assert isinstance(held, Hold) and T0 + OPEN_S < held.until < T0 + OPEN_S + 0.01
    assert step(table, tried, held.until) == SendTo(a)  # the request is the trial

    # Another request's trial succeeds first: the breaker is closed, and has moved on.
    table = table_of("a", breaker_failures=2)
    a = endpoint(table, "a")
    tried = fail(None, a, T0, refused=True)  # one failure: the breaker stays closed
    assert isinstance(step(table, tried, T0 + 1), Hold)
    for _ in range(2):
        a.breaker.begin(T0 + 1)
        a.breaker.failure(T0 + 1)
    a.breaker.begin(T0 + 1 + OPEN_S)
    a.breaker.success()
    assert step(table, tried, T0 + 2 + OPEN_S) == SendTo(a)


def test_a_model_that_will_not_come_back_is_answered_at_once() -> None:
    table = table_of("a")
    tried = fail(None, endpoint(table, "a"), T0, refused=True)
    apply(table, status="parked")
    parked = step(table, tried, T0)
    assert isinstance(parked, GiveUp) and parked.reply.code == "model_parked"
    table.remove("d")
    gone = step(table, tried, T0)
    assert isinstance(gone, GiveUp) and gone.reply.status == 404


def route_of(status: str, *, desired: int = 1, last_failure: str | None = None,
             placement_error: str | None = None, failures: int = 0) -> DeploymentRoute:
    return DeploymentRoute(
        deployment_id="d", model_id=MODEL, status=status, desired_replicas=desired,
        placement_error=placement_error, last_failure=last_failure,
        consecutive_failures=failures, created_at=datetime(2026, 1, 1, tzinfo=UTC), ready=())


def test_degraded_is_held_for_its_replacement_then_told_why() -> None:
    table = table_of()
    unreachable = "d-r1 unreachable: no heartbeat from a"
    # A failed start before it went unreachable does not make the reason a failed start.
    table.apply(route_of("degraded", last_failure=unreachable, failures=1))
    assert step(table, None, T0) == Hold(table.models[MODEL], T0 + POLICY.wait_s)
    answer = step(table, None, T0 + POLICY.wait_s)
    assert isinstance(answer, GiveUp)
    assert (answer.reply.status, answer.reply.code) == (503, "model_not_ready")
    assert answer.reply.headers == [(b"retry-after", b"5")]
    assert answer.reply.extra["reason"] == (
        f"it is degraded: {unreachable}; a replacement is being placed or started")
    # No room for the replacement: still held (the unreachable one may come back), and
    # the answer says why the replacement is not coming yet.
    table.apply(route_of("degraded", last_failure=unreachable, placement_error="b: full"))
    assert isinstance(step(table, None, T0), Hold)
    late = step(table, None, T0 + POLICY.wait_s)
    assert isinstance(late, GiveUp)
    assert late.reply.extra["reason"].endswith(
        "a replacement is being placed or started, but cannot be placed yet (b: full)")


def test_stopped_is_answered_at_once_and_a_scale_up_from_zero_is_held() -> None:
    table = table_of()
    table.apply(route_of("stopped", desired=0))
    answer = step(table, None, T0)
    assert isinstance(answer, GiveUp)
    assert (answer.reply.status, answer.reply.code, answer.reply.headers) == (
        503, "model_stopped", [])
    assert answer.reply.extra == {"model": MODEL, "status": "stopped",
                                  "reason": "scaled to zero replicas"}
    # The API records a scale-up the keeper accepted before the keeper's next status:
    # stopped with a replica wanted is one on its way.
    table.apply(route_of("stopped", desired=1))
    assert isinstance(step(table, None, T0), Hold)
    answer = step(table, None, T0 + POLICY.wait_s)
    assert isinstance(answer, GiveUp) and answer.reply.code == "model_not_ready"
    assert answer.reply.extra["reason"] == "it is being scaled up from zero replicas"
    # Serving at 0 replicas (a workflow run from before the stopped status) is held as
    # before, and then says why.
    table.apply(route_of("serving", desired=0))
    assert isinstance(step(table, None, T0), Hold)
    old = step(table, None, T0 + POLICY.wait_s)
    assert isinstance(old, GiveUp) and old.reply.code == "model_not_ready"
    assert old.reply.extra["reason"] == "it is scaled to zero replicas"


# -- on demand (rules 7 to 9) -------------------------------------------------------------

ON_DEMAND = ScalingPolicy(min_replicas=0, max_replicas=2)
SINCE = datetime(2026, 1, 1, 12, 0, 3, tzinfo=UTC)


def demand_route(status: str, *, scaling: ScalingPolicy | None = ON_DEMAND, desired: int = 0,
                 loading_reason: str | None = None, placement_error: str | None = None,
                 replicas: tuple[str, ...] = ()) -> DeploymentRoute:
    return DeploymentRoute(
        deployment_id="d", model_id=MODEL, status=status, desired_replicas=desired,
        placement_error=placement_error, last_failure=None, consecutive_failures=0,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        ready=tuple(ReplicaRoute(rid, f"http://h/{rid}") for rid in replicas),
        scaling=scaling, loading_since=SINCE if loading_reason else None,
        loading_reason=loading_reason)


def test_an_on_demand_model_with_no_replica_is_held_for_its_load_then_told_it_loads() -> None:
    table = table_of()
    table.apply(demand_route("idle"))
    entry = table.models[MODEL]
    # Held, past gateway_wait_for_replica_s, up to gateway_load_wait_s; marked loading.
    assert step(table, None, T0) == Hold(entry, T0 + POLICY.load_wait_s, loading=True)
    assert step(table, None, T0 + POLICY.wait_s) == Hold(entry, T0 + POLICY.load_wait_s,
                                                         loading=True)
    table.apply(demand_route("loading", desired=1,
                             loading_reason="asked for: 3 requests waiting"))
    answer = step(table, None, T0 + POLICY.load_wait_s)
    assert isinstance(answer, GiveUp)
    reply = answer.reply
    assert (reply.status, reply.type, reply.code, reply.headers) == (
        503, "service_unavailable", "model_loading", [(b"retry-after", b"5")])
    assert reply.message == (
        f"`{MODEL}` is loading (asked for: 3 requests waiting, since "
        "2026-01-01T12:00:03+00:00): no replica was ready within 30.0s. Retry after 5s.")
    assert reply.extra == {"model": MODEL, "status": "loading",
                           "reason": "asked for: 3 requests waiting",
                           "loading_since": "2026-01-01T12:00:03+00:00"}
    # A replica became ready meanwhile: it gets the request, whatever the deadline said.
    table.apply(demand_route("serving", desired=1, replicas=("a",)))
    assert step(table, None, T0 + POLICY.load_wait_s) == SendTo(endpoint(table, "a"))


def test_the_policys_own_load_wait_is_the_budget() -> None:
    table = table_of()
    table.apply(demand_route("idle", scaling=ScalingPolicy(min_replicas=0, max_replicas=1,
                                                           load_wait_s=4.0)))
    held = step(table, None, T0)
    assert held == Hold(table.models[MODEL], T0 + 4.0, loading=True)
    answer = step(table, None, T0 + 4.0)
    assert isinstance(answer, GiveUp) and answer.reply.code == "model_loading"
    assert answer.reply.extra["reason"] == "none of it runs, and this request asked for it"
    assert answer.reply.extra["loading_since"] is None
    # A load wait of 0: answered at once, still "loading".
    table.apply(demand_route("idle", scaling=ScalingPolicy(min_replicas=0, max_replicas=1,
                                                           load_wait_s=0.0)))
    now = step(table, None, T0)
    assert isinstance(now, GiveUp) and now.reply.code == "model_loading"
    assert now.loading  # the router still asks for the load


@pytest.mark.parametrize(("status", "reason"), [
    ("idle", "none of it runs, and this request asked for it"),
    ("loading", "its first replica is on its way"),
    ("sleeping", "it is asleep and being woken"),
])
def test_the_statuses_of_one_that_follows_demand_are_held_for_a_load_with_no_policy_read(
        status: str, reason: str) -> None:
    table = table_of()
    table.apply(demand_route(status, scaling=None))
    assert step(table, None, T0) == Hold(table.models[MODEL], T0 + POLICY.load_wait_s,
                                         loading=True)
    answer = step(table, None, T0 + POLICY.load_wait_s)
    assert isinstance(answer, GiveUp) and answer.reply.code == "model_loading"
    assert answer.reply.extra["reason"] == reason


def test_a_fixed_model_at_zero_and_a_switched_off_one_are_answered_at_once() -> None:
    table = table_of()
    # Stopped at 0 with no policy: an operator's scale-down, answered at once as before.
    table.apply(demand_route("stopped", scaling=None))
    fixed = step(table, None, T0)
    assert isinstance(fixed, GiveUp) and fixed.reply.code == "model_stopped"
    # Min 0, max 0: deliberately off, whatever status it shows; no request loads it.
    for status in ("stopped", "idle"):
        table.apply(demand_route(status, scaling=ScalingPolicy(min_replicas=0,
                                                               max_replicas=0)))
        off = step(table, None, T0)
        assert isinstance(off, GiveUp)
        assert (off.reply.status, off.reply.code, off.reply.headers) == (
            503, "model_stopped", [])
        assert off.reply.extra["reason"] == (
            "switched off: its scaling policy allows 0 replicas (max_replicas 0)")
    # On demand, stopped at 0 (a status written before idle existed): a request loads it.
    table.apply(demand_route("stopped"))
    assert isinstance(step(table, None, T0), Hold)


def test_an_on_demand_model_parked_or_unplaceable_is_answered_at_once_and_a_typo_is_404(
        ) -> None:
    table = table_of()
    table.apply(demand_route("cant_place", desired=1, placement_error="a: 2 GiB short"))
    unplaceable = step(table, None, T0)
    assert isinstance(unplaceable, GiveUp) and unplaceable.reply.code == "model_cant_place"
    assert unplaceable.reply.extra["reason"] == "a: 2 GiB short"
    table.apply(demand_route("parked", desired=1))
    parked = step(table, None, T0)
    assert isinstance(parked, GiveUp) and parked.reply.code == "model_parked"
    typo = next_step(table, MODEL + "x", None, T0, arrived=T0, policy=POLICY)
    assert isinstance(typo, GiveUp)
    assert (typo.reply.status, typo.reply.code) == (404, "model_not_found")


def test_an_on_demand_model_with_a_replica_is_not_loading_when_it_fails() -> None:
    table = table_of()
    table.apply(demand_route("serving", desired=1, replicas=("a",)))
    a = endpoint(table, "a")
    tried = fail(None, a, T0, refused=True)
    # Held (not for a load: a replica is routed) within the load budget, which is the
    # model's budget for any request: a replacement is a load too.
    assert step(table, tried, T0 + 1) == Hold(table.models[MODEL], T0 + POLICY.load_wait_s)
    answer = step(table, tried, T0 + POLICY.load_wait_s)
    assert isinstance(answer, GiveUp)
    assert (answer.reply.status, answer.reply.code) == (502, "upstream_unavailable")
    # Its only replica out behind an open breaker, never sent: held for the breaker's
    # trial, not for a load (nothing is loading, so no demand is written for it).
    table = table_of("a", breaker_failures=1)
    table.apply(demand_route("serving", desired=1, replicas=("a",)))
    a = endpoint(table, "a")
    a.breaker.begin(T0)
    a.breaker.failure(T0)
    held = step(table, None, T0 + 1)
    assert isinstance(held, Hold) and not held.loading
    assert T0 + OPEN_S < held.until < T0 + OPEN_S + 0.01
