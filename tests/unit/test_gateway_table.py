"""The routing table, the breaker and the gateway's answers, without a network."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from gateway import responses
from gateway.breaker import Breaker, BreakerState
from gateway.streaming import _events_end
from gateway.table import Endpoint, RoutingTable
from modelkeeper.store.routing import (
    DeploymentRoute,
    ReplicaRoute,
    hash_key,
    new_client_key,
)

pytestmark = pytest.mark.timeout(10)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def route(*replicas: tuple[str, str], model: str = "m", deployment: str = "d1",
          status: str = "serving", **fields: object) -> DeploymentRoute:
    values: dict[str, object] = {
        "deployment_id": deployment, "model_id": model, "status": status,
        "desired_replicas": len(replicas), "placement_error": None, "last_failure": None,
        "consecutive_failures": 0, "created_at": T0,
        "ready": tuple(ReplicaRoute(rid, url) for rid, url in replicas),
    }
    values.update(fields)
    return DeploymentRoute(**values)  # type: ignore[arg-type]


def make_endpoint(replica: ReplicaRoute, deployment: DeploymentRoute) -> Endpoint:
    return Endpoint(replica.replica_id, replica.endpoint, deployment.deployment_id,
                    deployment.model_id, {}, Breaker(2, 1.0))


def test_update_keeps_the_live_state_of_replicas_that_stay() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("r1", "http://h:1"), ("r2", "http://h:2")))
    entry = table.models["m"]
    r1, r2 = entry.endpoints
    r1.in_flight = 3
    r1.breaker.failure(0.0)
    r2.breaker.failure(0.0)
    r2.breaker.failure(0.0)
    assert r2.breaker.state is BreakerState.OPEN
    entry.waiting = 2
    changed = entry.changed

    # r3 arrives, r2 goes, r1 stays: r1 keeps its counts and breaker, r3 starts fresh.
    change = table.apply(route(("r1", "http://h:1"), ("r3", "http://h:3")))
    assert table.models["m"] is entry, "waiters and counters live on the same entry"
    assert entry.endpoints[0] is r1
    assert (r1.in_flight, r1.breaker.failures) == (3, 1)
    assert entry.endpoints[1].replica_id == "r3"
    assert entry.endpoints[1].in_flight == 0
    assert [e.replica_id for e in change.added] == ["r3"]
    assert change.removed == (r2,)
    assert changed.is_set() and not entry.changed.is_set(), "waiters were woken"
    assert entry.waiting == 2

    # A full reload (after a reconnection) keeps live state the same way.
    table.replace_all([route(("r1", "http://h:1"), ("r3", "http://h:3"))])
    assert entry.endpoints[0] is r1 and r1.in_flight == 3


def test_same_replica_at_a_new_address_is_a_new_endpoint() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("r1", "http://h:1")))
    old = table.models["m"].endpoints[0]
    change = table.apply(route(("r1", "http://h:9")))
    new = table.models["m"].endpoints[0]
    assert new is not old and new.url == "http://h:9"
    assert change.removed == (old,) and change.added == (new,)


def test_removed_and_replaced_deployments() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("r1", "http://h:1")))
    table.apply(route(("x1", "http://h:5"), model="other", deployment="d2"))
    entry = table.models["m"]
    changed = entry.changed
    table.remove("d1")
    assert "m" not in table.models and changed.is_set()
    # A full reload drops deployments it no longer sees.
    change = table.replace_all([route(("r1", "http://h:1"))])
    assert set(table.models) == {"m"}
    assert [e.replica_id for e in change.removed] == ["x1"]
    # The model's deployment deleted and created again under a new id.
    table.apply(route(("r7", "http://h:7"), deployment="d9"))
    table.remove("d1")  # the old id no longer maps to the model
    assert [e.replica_id for e in table.models["m"].endpoints] == ["r7"]


def test_pick_least_outstanding_skipping_open_breakers_and_exclusions() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("a", "http://h:1"), ("b", "http://h:2"), ("c", "http://h:3")))
    entry = table.models["m"]
    a, b, c = entry.endpoints
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 5
    assert entry.pick(0.0) is b
    b.breaker.failure(0.0)
    b.breaker.failure(0.0)  # open until 1.0
    assert entry.pick(0.5) is a
    assert entry.pick(0.5, exclude=[a]) is c
    assert entry.pick(0.5, exclude=[a, c]) is None
    assert entry.next_trial_at() == 1.0
    assert entry.open_breakers() == 1
    assert entry.pick(1.0) is b, "due for its trial, and it has the fewest open requests"


def test_ties_are_spread_round_robin() -> None:
    table = RoutingTable(make_endpoint)
    table.apply(route(("a", "http://h:1"), ("b", "http://h:2"), ("c", "http://h:3")))
    entry = table.models["m"]
    picked = [entry.pick(0.0) for _ in range(6)]
    assert [e.replica_id for e in picked if e] == ["a", "b", "c", "a", "b", "c"]


def state(breaker: Breaker) -> BreakerState:
    """The state, read through a call so type checkers do not narrow it between steps."""
    return breaker.state


def test_breaker_opens_allows_one_trial_and_backs_off() -> None:
    breaker = Breaker(failures_to_open=3, open_s=1.0, max_open_s=3.0)
    breaker.failure(0.0)
    breaker.success()
    for _ in range(2):
        breaker.failure(0.0)
    assert breaker.state is BreakerState.CLOSED, "failures must be in a row"
    breaker.failure(10.0)
    assert state(breaker) is BreakerState.OPEN and breaker.next_trial_at() == 11.0
    assert not breaker.allows(10.5)
    breaker.begin(10.5)  # not due: no trial starts
    assert state(breaker) is BreakerState.OPEN
    assert breaker.allows(11.0)
    breaker.begin(11.0)
    assert state(breaker) is BreakerState.HALF_OPEN
    assert not breaker.allows(11.0), "only one trial at a time"
    breaker.failure(11.1)
    assert state(breaker) is BreakerState.OPEN and breaker.opened_until == pytest.approx(13.1)
    breaker.begin(13.1)
    breaker.failure(13.2)
    assert breaker.opened_until == pytest.approx(16.2), "capped at max_open_s"
    breaker.begin(16.2)
    breaker.abandon()  # the trial's client left: another trial may go
    assert breaker.allows(16.3)
    breaker.begin(16.3)
    breaker.success()
    assert state(breaker) is BreakerState.CLOSED and breaker.failures == 0
    for _ in range(3):
        breaker.failure(20.0)
    assert breaker.opened_until == 21.0, "a success resets the back-off"


@pytest.mark.parametrize(("data", "end"), [
    (b"", 0),
    (b"data: {}", 0),
    (b"data: {}\n\n", 10),
    (b"data: 1\n\ndata: 2", 9),
    (b"data: 1\r\n\r\ndata: 2\r\n\r\nda", 22),
])
def test_events_end_finds_the_last_complete_event(data: bytes, end: int) -> None:
    assert _events_end(data) == end


def test_answers_name_the_reason() -> None:
    parked = responses.hopeless(route(status="parked", last_failure="exit 1",
                                      consecutive_failures=5))
    assert parked is not None and parked.status == 503 and not parked.headers
    assert "exit 1" in parked.message and "5 failed starts" in parked.message
    cant = responses.hopeless(route(status="cant_place", placement_error="no GPU"))
    assert cant is not None and json.loads(cant.body())["error"]["reason"] == "no GPU"
    assert responses.hopeless(route(status="placing")) is None
    assert responses.hopeless(route(status="serving")) is None

    waiting = responses.not_ready(route(status="starting", desired_replicas=1),
                                  waited_s=10, retry_after_s=5, open_breakers=0)
    assert waiting.headers == [(b"retry-after", b"5")]
    assert "starting" in waiting.message
    broken = responses.not_ready(route(status="serving"), waited_s=1, retry_after_s=5,
                                 open_breakers=2)
    assert "keep failing" in broken.message

    missing = json.loads(responses.unknown_model("gtp", ["b", "a"]).body())["error"]
    assert missing["known_models"] == ["a", "b"] and "a, b" in missing["message"]

    event = responses.sse_error_event("cut")
    assert event.endswith(b"\n\ndata: [DONE]\n\n")
    assert json.loads(event.split(b"\n\n")[0][6:])["error"]["message"] == "cut"


def test_client_keys_are_random_and_stored_as_sha256() -> None:
    one, two = new_client_key(), new_client_key()
    assert one != two and one.startswith("mkc-") and len(one) == 47
    assert len(hash_key(one)) == 64 and hash_key(one) != hash_key(two)
