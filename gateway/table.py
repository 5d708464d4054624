"""The routing table: each model's deployment and the live state of its ready replicas.

The table is rebuilt piece by piece from the store (one deployment per notification),
but an :class:`Endpoint` object, which carries a replica's in-flight count and breaker,
is kept for as long as its replica stays ready at the same address. A replica that was
serving therefore keeps its counts and its breaker when another replica of the same
model appears, moves or goes, instead of starting from cold.

An endpoint that leaves routing (its replica is draining, stopping or gone) with requests
still open is kept aside, in :attr:`RoutingTable.leaving`, until the usage reporter has
written its count down to 0: a drain waits for exactly that row before the engine stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from modelkeeper.store.routing import DeploymentRoute, ReplicaRoute

from .breaker import Breaker, BreakerState


class Endpoint:
    """A ready replica and what the gateway knows about it right now."""

    __slots__ = ("breaker", "deployment_id", "engine_waiting", "headers", "in_flight",
                 "last_used", "leaving", "model", "replica_id", "requests", "url")

    def __init__(self, replica_id: str, url: str, deployment_id: str, model: str,
                 headers: dict[str, str], breaker: Breaker) -> None:
        self.replica_id = replica_id
        #: Base URL without a trailing slash; request paths (``/v1/...``) are appended.
        self.url = url.rstrip("/")
        self.deployment_id = deployment_id
        self.model = model
        #: Sent with every request: the replica's own engine key, never the client's.
        self.headers = headers
        self.breaker = breaker
        #: Requests sent and not yet finished.
        self.in_flight = 0
        #: Requests ever sent (for tests and debugging).
        self.requests = 0
        #: Wall-clock time (``time.time()``) the last request ended; 0 when never used.
        self.last_used = 0.0
        #: Out of routing for good: no request picks it any more, and the ones it still
        #: has open are counted until they end (the table's :attr:`~RoutingTable.leaving`).
        self.leaving = False
        #: Requests waiting in the engine's own queue, as last scraped
        #: (:mod:`gateway.engine_queue`); None: unknown, or its engine has no such gauge.
        self.engine_waiting: int | None = None

    def __repr__(self) -> str:
        return (f"Endpoint({self.replica_id!r}, {self.url!r}, in_flight={self.in_flight}, "
                f"breaker={self.breaker.state.name})")


#: Builds a fresh Endpoint for a replica of a deployment.
EndpointFactory = Callable[[ReplicaRoute, DeploymentRoute], Endpoint]


class ModelRoute:
    """One model: its deployment as last read, its endpoints, and who waits for them.

    The object itself lives as long as the model is known, so waiters and counters
    survive updates; only its fields change.
    """

    __slots__ = ("_next", "changed", "endpoints", "last_request", "route", "turned_away",
                 "waiting")

    def __init__(self, route: DeploymentRoute) -> None:
        self.route = route
        self.endpoints: tuple[Endpoint, ...] = ()
        #: Set (and replaced by a fresh one) on every update, waking requests that wait
        #: for a replica: they are woken by the store's notifications, not by polling.
        self.changed = asyncio.Event()
        #: Requests waiting for a replica of this model right now.
        self.waiting = 0
        #: Requests answered "loading" without being held (a load wait of 0) since the
        #: usage was last written: written as waiting once, so that they ask for the load
        #: as a held request does (:mod:`gateway.usage`).
        self.turned_away = 0
        #: Wall-clock time of the last request for this model; 0 when none.
        self.last_request = 0.0
        self._next = 0

    def notify_changed(self) -> None:
        """Wake every request waiting on this model."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def pick(self, now: float, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The endpoint with the fewest outstanding requests whose breaker lets a request
        through, skipping ``exclude``; ties go round-robin so equal replicas share load."""
        endpoints = self.endpoints
        count = len(endpoints)
        if count == 0:
            return None
        start = self._next
        self._next = start + 1 if start + 1 < count else 0
        best: Endpoint | None = None
        for i in range(count):
            index = start + i
            endpoint = endpoints[index if index < count else index - count]
            if endpoint in exclude or not endpoint.breaker.allows(now):
                continue
            if best is None or endpoint.in_flight < best.in_flight:
                best = endpoint
        return best

    def next_trial_at(self) -> float | None:
        """The earliest time an open breaker of this model lets a trial through."""
        times = [t for e in self.endpoints if (t := e.breaker.next_trial_at()) is not None]
        return min(times) if times else None

    def open_breakers(self) -> int:
        """How many of the endpoints are out because their breaker is open."""
        return sum(1 for e in self.endpoints if e.breaker.state is BreakerState.OPEN)


@dataclass(frozen=True, slots=True)
class TableChange:
    """What one update did, for metrics and logs."""

    added: tuple[Endpoint, ...] = ()
    removed: tuple[Endpoint, ...] = ()


class RoutingTable:
    """Models by name, each with its live endpoints."""

    def __init__(self, make_endpoint: EndpointFactory) -> None:
        self._make_endpoint = make_endpoint
        self.models: dict[str, ModelRoute] = {}
        self._model_of: dict[str, str] = {}  # deployment id -> model id
        #: Endpoints out of routing whose count has not yet been written down to 0: the
        #: usage reporter still writes their rows, so a drain sees their requests end.
        self.leaving: set[Endpoint] = set()

    def endpoints(self) -> Iterator[Endpoint]:
        """Every endpoint of every model."""
        for model in self.models.values():
            yield from model.endpoints

    def apply(self, route: DeploymentRoute) -> TableChange:
        """Take in the current state of one deployment, keeping the live state of each
        endpoint whose replica is still ready at the same address."""
        entry = self.models.get(route.model_id)
        if entry is None:
            entry = self.models[route.model_id] = ModelRoute(route)
        elif entry.route.deployment_id != route.deployment_id:
            # The model's deployment was deleted and created anew: a different deployment.
            self._model_of.pop(entry.route.deployment_id, None)
        old_by_id = {e.replica_id: e for e in entry.endpoints}
        kept: list[Endpoint] = []
        added: list[Endpoint] = []
        for replica in route.ready:
            endpoint = old_by_id.pop(replica.replica_id, None)
            if endpoint is None or endpoint.url != replica.endpoint.rstrip("/"):
                if endpoint is not None:
                    old_by_id[replica.replica_id] = endpoint  # same id, new address: gone
                endpoint = self._make_endpoint(replica, route)
                added.append(endpoint)
            kept.append(endpoint)
        entry.route = route
        entry.endpoints = tuple(kept)
        self._model_of[route.deployment_id] = route.model_id
        entry.notify_changed()
        removed = tuple(old_by_id.values())
        self._leave(removed)
        return TableChange(tuple(added), removed)

    def remove(self, deployment_id: str) -> TableChange:
        """Forget a deleted deployment; requests waiting for it are woken (to a 404)."""
        model = self._model_of.pop(deployment_id, None)
        if model is None:
            return TableChange()
        entry = self.models.pop(model)
        entry.notify_changed()
        self._leave(entry.endpoints)
        return TableChange(removed=entry.endpoints)

    def _leave(self, endpoints: Iterable[Endpoint]) -> None:
        """Set aside endpoints that left routing, idle ones too: one row written after
        they left, even at 0, is what tells a drain that this worker holds nothing there."""
        for endpoint in endpoints:
            endpoint.leaving = True
            self.leaving.add(endpoint)

    def forget_left(self, reported: Iterable[Endpoint]) -> None:
        """Drop endpoints out of routing whose count of 0 is now in the store; they get
        no new requests, so their count stays 0 and their row stays true."""
        for endpoint in reported:
            if endpoint.in_flight == 0:
                self.leaving.discard(endpoint)

    def replace_all(self, routes: Iterable[DeploymentRoute]) -> TableChange:
        """Take in every deployment at once (at start and after a reconnection); those not
        listed are gone. Live state is kept exactly as :meth:`apply` keeps it."""
        added: list[Endpoint] = []
        removed: list[Endpoint] = []
        seen: set[str] = set()
        for route in routes:
            seen.add(route.deployment_id)
            change = self.apply(route)
            added += change.added
            removed += change.removed
        for deployment_id in [d for d in self._model_of if d not in seen]:
            removed += self.remove(deployment_id).removed
        return TableChange(tuple(added), tuple(removed))
