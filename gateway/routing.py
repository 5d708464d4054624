"""Routing: which replica a request goes to, and what happens when none can take it.

The strategy is in units of its own, apart from the proxy that carries it out: the
first pick is :meth:`gateway.table.ModelRoute.pick` (fewest requests open, round robin
among equals, breaker permitting), and everything after a first pick that finds nothing
or fails is :func:`gateway.dispatch.next_step`, pure, rule by rule. :class:`Router` only
carries out their answers: send (through :mod:`gateway.forwarding`), hold, or give up.
A new routing signal belongs in such a unit, not in a branch here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from modelkeeper.infra import tracing
from modelkeeper.settings import Settings

from .asgi import Send, send_reply
from .dispatch import GiveUp, Hold, HoldPolicy, SendTo, Tried, next_step, record
from .forwarding import REFUSED, Forwarder, Replied, RetryElsewhere
from .metrics import GatewayMetrics
from .responses import ErrorReply
from .streaming import describe
from .table import Endpoint, ModelRoute, RoutingTable
from .tracing import traced_attempt


def model_list(table: RoutingTable) -> dict[str, Any]:
    """``/v1/models``: every model the table knows, in OpenAI's shape, with its replicas,
    its status (``idle``, ``loading`` and ``sleeping`` for one that follows demand), the
    bounds of its scaling policy, and since when and why it loads on demand."""
    data = []
    for model_id in sorted(table.models):
        entry = table.models[model_id]
        route = entry.route
        scaling = route.scaling
        since = route.loading_since
        data.append({
            "id": model_id, "object": "model",
            "created": int(route.created_at.timestamp()), "owned_by": "modelkeeper",
            "status": route.status, "ready_replicas": len(entry.endpoints),
            "desired_replicas": route.desired_replicas,
            # No policy: fixed at its replicas, min = max.
            "min_replicas": route.desired_replicas if scaling is None else scaling.min_replicas,
            "max_replicas": route.desired_replicas if scaling is None else scaling.max_replicas,
            "on_demand": route.loads_on_demand,
            "loading_since": None if since is None else since.isoformat(),
            "loading_reason": route.loading_reason,
        })
    return {"object": "list", "data": data}


#: Called when a request starts being held for a model none of whose replicas is ready,
#: and no other request of this worker was held for it: write the waiting count now.
DemandHandler = Callable[[ModelRoute], None]


class Router:
    """Routes requests over the table's replicas, holding them while none can take them."""

    def __init__(self, settings: Settings, *, table: RoutingTable, metrics: GatewayMetrics,
                 forwarder: Forwarder, on_demand: DemandHandler) -> None:
        self.table = table
        self.metrics = metrics
        # Bound once: the hot path pays no lookup through the forwarder, and no check
        # of whether it traces.
        self._attempt = (traced_attempt(forwarder.attempt) if tracing.ON
                         else forwarder.attempt)
        self._on_demand = on_demand
        self._policy = HoldPolicy(wait_s=settings.gateway_wait_for_replica_s,
                                  retries=settings.gateway_retries,
                                  retry_after_s=settings.gateway_retry_after_s,
                                  load_wait_s=settings.gateway_load_wait_s)

    async def route(self, path: str, body: bytes, entry: ModelRoute, send: Send,
                    started: float) -> int:
        """Pick a replica and send the request; when none can be picked, or a connection
        fails before any byte came back, do what :func:`~gateway.dispatch.next_step` says:
        send it (again), hold it until a replica it may go to is ready, or answer with an
        error. Returns the HTTP status given to the client.

        The hot path is the first pick and one attempt: nothing else is computed or
        allocated (not even the deadline) unless that pick finds nothing or fails."""
        model = entry.route.model_id
        endpoint = entry.pick(time.monotonic())
        tried: Tried | None = None
        arrived: float | None = None
        while True:
            if endpoint is None:
                if arrived is None:
                    # ``started`` is on the perf_counter clock; breakers are on monotonic.
                    arrived = time.monotonic() - (time.perf_counter() - started)
                found = await self._next_endpoint(model, tried, arrived)
                if isinstance(found, ErrorReply):
                    await send_reply(send, found)
                    return found.status
                endpoint = found
                if tried is not None:
                    self.metrics.retries.labels(model).inc()
            match await self._attempt(endpoint, path, body, send=send, started=started):
                case Replied(status=status):
                    return status
                case RetryElsewhere(error=error):
                    tried = record(tried, endpoint, why=describe(error),
                                   refused=isinstance(error, REFUSED))
                    endpoint = None

    async def _next_endpoint(self, model: str, tried: Tried | None,
                             arrived: float) -> Endpoint | ErrorReply:
        """The replica to send the request to, once there is one it may go to; or the
        error to answer with. Holds the request meanwhile, woken by the store's
        notifications and by breakers changing or coming due, never by polling."""
        counted = False
        while True:
            now = time.monotonic()
            match next_step(self.table, model, tried, now, arrived=arrived,
                            policy=self._policy):
                case SendTo(endpoint=endpoint):
                    return endpoint
                case GiveUp(reply=reply, loading=loading):
                    if loading and not counted:
                        self._turned_away(model)
                    return reply
                case Hold(entry=entry, until=until, loading=loading):
                    if loading and not counted:
                        counted = True
                        self.metrics.held_for_load.labels(model).inc()
                    await self._hold(entry, until - now)

    def _turned_away(self, model: str) -> None:
        """A request for a model that loads was answered "loading" without being held (a
        load wait of 0): it still asks for the load, as a held one would (rule 8)."""
        entry = self.table.models[model]
        entry.turned_away += 1
        if entry.turned_away == 1 and entry.waiting == 0:
            self._on_demand(entry)

    async def _hold(self, entry: ModelRoute, timeout: float) -> None:
        """Wait until ``entry`` changes, ``timeout`` seconds at most; counted as waiting.

        The first request held for a model none of whose replicas is ready has the count
        written at once (``on_demand``): that row is what asks the control plane to load
        or wake it, and a tick is too long to add to a load. Only the rise from 0 does, so
        a thousand requests held together cost one write, not a thousand."""
        changed = entry.changed
        model = entry.route.model_id
        entry.waiting += 1
        if entry.waiting == 1 and not entry.endpoints:
            self._on_demand(entry)
        self.metrics.waiting.labels(model).inc()
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            entry.waiting -= 1
            self.metrics.waiting.labels(model).dec()
