"""Forwarding: one attempt of one request on one replica.

The body goes unchanged, with the replica's own engine key (derived here from the
cluster secret, never the client's key), over one pooled aiohttp session. The answer is
relayed by :mod:`gateway.streaming`. The attempt settles the replica's live state once,
when it ends: its in-flight count and its breaker's verdict.

A failure before the first byte comes back as :class:`RetryElsewhere` only when the
engine cannot have acted on the request (:data:`RETRYABLE`); whether and where to send
it again is routing's to decide (:mod:`gateway.routing`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.infra.secrets import read_previous_engine_key_secret
from modelkeeper.settings import Settings
from modelkeeper.store.routing import DeploymentRoute, ReplicaRoute

from . import responses
from .asgi import Send, send_reply
from .breaker import Breaker
from .metrics import GatewayMetrics
from .streaming import AnswerRelay, describe
from .table import Endpoint, RoutingTable

log = logging.getLogger(__name__)

#: What an engine answers a key it does not hold.
ENGINE_KEY_REFUSED = 401
#: Failures before the first byte that are safe to send to another replica: the engine
#: never saw the request (refused), or dropped the connection before answering.
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
             aiohttp.ClientOSError)
#: How a pooled connection fails that the engine closed while it sat idle. llama.cpp's
#: server closes the connection after each streamed response without a ``Connection:
#: close``; reusing it at once failed 6 of 12 back-to-back requests sent to it directly
#: (issue 27). The request never reached the engine, so it goes again at once on a new
#: connection, and it is no failure of the engine's: not counted, logged or held against
#: its breaker. A refused connect (``ClientConnectorError``, itself a ``ClientOSError``)
#: was a new connection already, and is not one of these.
STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
#: Of those, the failure to connect at all: nothing listens there, so the request does not
#: go back to that replica at once (rule 3 of :mod:`gateway.dispatch`), while a dropped
#: connection (perhaps a kept-alive one the engine had closed) may be tried once more.
REFUSED = aiohttp.ClientConnectorError


@dataclass(frozen=True, slots=True)
class Replied:
    """An attempt's outcome: the client has its answer, with this HTTP status."""

    status: int


@dataclass(frozen=True, slots=True)
class RetryElsewhere:
    """An attempt's outcome: nothing was sent to the client, and the error (one of
    :data:`RETRYABLE`) says the engine never saw the request or dropped it unanswered."""

    error: BaseException


#: What one attempt on one replica came to.
Outcome = Replied | RetryElsewhere


def _engine_headers(key: str) -> dict[str, str]:
    """What the gateway sends an engine with each request: its key and a content type."""
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


class EngineKeys:
    """The key each engine is sent: derived from the cluster secret per replica, and,
    while a secret rotation's grace period lasts, from the previous secret as well."""

    def __init__(self, settings: Settings, *, engine_key_secret: bytes) -> None:
        if not engine_key_secret:
            raise ValueError("the engine key secret must not be empty")
        self.settings = settings
        self._secret = engine_key_secret
        previous = read_previous_engine_key_secret(settings)
        #: The cluster secret being rotated out, while its grace period lasts.
        self._previous_secret = None if previous is None else previous.encode()
        #: Per replica, headers with the key derived from the previous secret: tried once
        #: when the engine refuses the current one (it started before the rotation).
        self._fallback_headers: dict[str, dict[str, str]] = {}

    def make_endpoint(self, replica: ReplicaRoute, route: DeploymentRoute) -> Endpoint:
        """A fresh endpoint for a replica, with its engine key and a closed breaker."""
        # The engine's key derives from the key of the node its endpoint was checked
        # against, in that node's key epoch then (modelkeeper.domain.engine_keys): the
        # gateway holds the cluster secret, so it derives both steps.
        key = replica_engine_key(self._secret, node_id=replica.node_id,
                                 replica_id=replica.replica_id, key_epoch=replica.key_epoch)
        if self._previous_secret is not None:
            self._fallback_headers[replica.replica_id] = _engine_headers(replica_engine_key(
                self._previous_secret, node_id=replica.node_id,
                replica_id=replica.replica_id, key_epoch=replica.key_epoch))
        breaker = Breaker(self.settings.gateway_breaker_failures,
                          self.settings.gateway_breaker_open_s)
        return Endpoint(replica.replica_id, replica.endpoint, route.deployment_id,
                        route.model_id, _engine_headers(key), breaker)

    def take_fallback(self, replica_id: str) -> dict[str, str] | None:
        """The previous secret's headers for ``replica_id``, once; None when there are
        none (no rotation under way, or already taken)."""
        return self._fallback_headers.pop(replica_id, None)


class Forwarder:
    """Sends requests to engines: the connection pool, and each attempt."""

    def __init__(self, settings: Settings, *, keys: EngineKeys, table: RoutingTable,
                 metrics: GatewayMetrics, on_left: Callable[[Endpoint], None]) -> None:
        self.settings = settings
        self._keys = keys
        self._table = table
        self.metrics = metrics
        self._answers = AnswerRelay(metrics)
        #: Called when the last request of an endpoint out of routing ends.
        self._on_left = on_left
        self._session: aiohttp.ClientSession | None = None
        #: For the one send again after a stale pooled connection: a connection of its
        #: own, never one from the pool, closed after its response.
        self._fresh: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """Open the connection pool to the engines (inside the running event loop)."""
        settings = self.settings
        timeout = aiohttp.ClientTimeout(total=None,
                                        connect=settings.gateway_connect_timeout_s,
                                        sock_read=settings.gateway_read_timeout_s)
        self._session = aiohttp.ClientSession(
            # No pool limit: the engines bound concurrency, and a gateway-side cap would
            # queue requests invisibly instead of counting them as in flight.
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            # Engines set no cookies worth keeping; skipping the jar saves work per request.
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=timeout, auto_decompress=False,
            # Nothing of the gateway's own: engines see the client's body, the engine key
            # and a content type, no User-Agent or Accept-Encoding added on the way.
            skip_auto_headers=("User-Agent", "Accept-Encoding"))
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True, ttl_dns_cache=300),
            cookie_jar=aiohttp.DummyCookieJar(), timeout=timeout, auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"))

    async def close(self) -> None:
        """Close the connection pools."""
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()

    async def attempt(self, endpoint: Endpoint, path: str, body: bytes, *, send: Send,
                      started: float) -> Outcome:
        """Send the request to one replica and relay its answer, unless the connection
        failed before the first byte in a way that is safe to retry elsewhere.

        The replica's in-flight count and breaker are settled here, once, before this
        returns (or raises, e.g. when the client leaves: no verdict then)."""
        endpoint.breaker.begin(time.monotonic())
        endpoint.in_flight += 1
        endpoint.requests += 1
        self.metrics.in_flight_of(endpoint.model, endpoint.replica_id).inc()
        verdict: bool | None = None
        try:
            try:
                response = await self._post_with_key_fallback(endpoint, path, body)
            except RETRYABLE as exc:
                # The engine never saw the request or dropped it unanswered.
                verdict = False
                self._answers.upstream_error(endpoint, exc)
                return RetryElsewhere(exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Timed out or garbled before the first byte: the engine may be working on
                # it, so sending it again would double the load. Not retried.
                verdict = False
                self._answers.upstream_error(endpoint, exc)
                status = 504 if isinstance(exc, TimeoutError) else 502
                reply = responses.upstream_failed(endpoint.model, describe(exc), status)
                await send_reply(send, reply)
                return Replied(reply.status)
            try:
                verdict, status = await self._answers.relay(response, endpoint, send, started)
            finally:
                response.close()
            return Replied(status)
        finally:
            self._finish_attempt(endpoint, verdict)

    async def _session_post(self, url: str, body: bytes,
                            headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send on a pooled connection; when that connection turns out to have been
        closed by the engine, once more on a new one (see ``STALE_CONNECTION``). A failure
        of the new connection is the engine's, and goes to the caller."""
        assert self._session is not None and self._fresh is not None
        try:
            return await self._session.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise
        except STALE_CONNECTION:
            self.metrics.stale_connections.inc()
            return await self._fresh.post(url, data=body, headers=headers)

    async def _post_with_key_fallback(self, endpoint: Endpoint, path: str,
                                      body: bytes) -> aiohttp.ClientResponse:
        """Send the request with the replica's key; while a secret rotation's grace period
        lasts, an engine that refuses it (401: it started before the rotation, with a key
        derived from the previous secret) gets the request once more with that key, which
        the endpoint keeps from then on. A 401 means the engine did not run the request,
        so sending it again is safe."""
        response = await self._session_post(endpoint.url + path, body, endpoint.headers)
        if response.status != ENGINE_KEY_REFUSED:
            return response
        fallback = self._keys.take_fallback(endpoint.replica_id)
        if fallback is None:
            return response
        response.close()
        log.info("replica %s refused the current engine key; using the previous secret's "
                 "(it started before the rotation)", endpoint.replica_id)
        endpoint.headers = fallback
        return await self._session_post(endpoint.url + path, body, endpoint.headers)

    def _finish_attempt(self, endpoint: Endpoint, verdict: bool | None) -> None:
        endpoint.in_flight -= 1
        endpoint.last_used = time.time()
        self.metrics.in_flight_of(endpoint.model, endpoint.replica_id).dec()
        breaker = endpoint.breaker
        before = breaker.state
        if verdict is True:
            breaker.success()
        elif verdict is False:
            breaker.failure(time.monotonic())
        else:
            breaker.abandon()
        if breaker.state is not before:
            self.metrics.set_breaker(endpoint.replica_id, breaker.state)
            log.warning("replica %s of %s: circuit breaker %s", endpoint.replica_id,
                        endpoint.model, breaker.state.name.lower())
            # Held requests may go there now (a trial succeeded) or at another time.
            entry = self._table.models.get(endpoint.model)
            if entry is not None:
                entry.notify_changed()
        if endpoint.leaving and endpoint.in_flight == 0:
            self._on_left(endpoint)
