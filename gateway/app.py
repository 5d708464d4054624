"""The gateway as a raw ASGI application.

No web framework: a framework's routing, request objects and middleware cost more per
request than everything the gateway itself does, and the gateway has five routes. The
upstream client is aiohttp, whose connection pool stays cheap under concurrency (httpx's
did not: see bench/results/gateway.md for the measured choice).

Per request, on the hot path: check the key (a clock read for the keys' freshness, one
SHA-256 and a dict lookup), parse the body to find the model, pick the ready replica with
the fewest requests open, send the body unchanged with the replica's own engine key, and
pass the answer back. Everything
else (no replica to pick, a connection failing before the answer) is decided off that
path, in :mod:`gateway.dispatch`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg

from modelkeeper.domain.engine_keys import replica_engine_key
from modelkeeper.domain.output_bounds import OutputRefusal, bound_output
from modelkeeper.infra.secrets import read_metrics_token, read_previous_engine_key_secret
from modelkeeper.settings import Settings
from modelkeeper.store.routing import (
    ChangeListener,
    DeploymentRoute,
    ReplicaRoute,
    RoutingStore,
)

from . import responses
from .breaker import Breaker, BreakerState
from .dispatch import GiveUp, Hold, HoldPolicy, SendTo, Tried, next_step, record
from .edge import HostCheck, MetricsGuard, json_body_refusal
from .metrics import CONTENT_TYPE, UNKNOWN_MODEL, GatewayMetrics
from .responses import JSON_HEADERS, ErrorReply, Headers
from .table import Endpoint, ModelRoute, RoutingTable, TableChange
from .table_listener import KEY_REFRESH_S, TableListener
from .usage import UsageReporter

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Largest request body accepted (prompts with long contexts are large, but not this).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Largest answer an engine may give to a request that is not streamed: the gateway holds
#: it whole before passing it on. A reply of a million tokens of text is under 8 MB, and
#: one of 4,096 tokens with 20 alternatives each (the most a request may ask for) about
#: 7 MB; past this, an engine is misbehaving, and holding more would let one reply (or a
#: few) take the gateway's memory. Longer answers are streamed, which holds no more than
#: one event.
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: Largest server-sent event an engine may send while streaming: the gateway holds an
#: event until it is complete. One event is one chunk of one choice, a few hundred bytes,
#: a few KiB with 20 alternatives per token; this leaves room for an engine that sends a
#: whole answer as one event, and stops one that never ends its line.
MAX_EVENT_BYTES = 1024 * 1024
CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, "/v1/completions"})
#: HTTP status the gateway records for a request whose client went away (nginx's).
CLIENT_CLOSED = 499
#: What an engine answers a key it does not hold.
ENGINE_KEY_REFUSED = 401
#: Failures before the first byte that are safe to send to another replica: the engine
#: never saw the request (refused), or dropped the connection before answering.
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
             aiohttp.ClientOSError)
#: Of those, the failure to connect at all: nothing listens there, so the request does not
#: go back to that replica at once (rule 3 of :mod:`gateway.dispatch`), while a dropped
#: connection (perhaps a kept-alive one the engine had closed) may be tried once more.
REFUSED = aiohttp.ClientConnectorError


#: Retry-After (seconds) of the 503 for keys too stale to trust: the gateway re-reads
#: them every few seconds, so a client may try again soon.
STALE_KEYS_RETRY_AFTER_S = 5
def bound_max_tokens(payload: dict[str, Any], body: bytes, bound: int | None, *,
                     model_default: int | None = None,
                     model_limit: int | None = None,
                     max_choices: int = 1) -> bytes | ErrorReply:
    """The body to send under the bounds on output per request
    (:func:`modelkeeper.domain.output_bounds.bound_output` decides, rule by rule): the
    gateway's ``bound`` (``gateway_max_tokens``, for every key), the model's own (its
    catalog ``default_max_tokens`` and ``max_tokens_limit``), and ``max_choices``
    (``gateway_max_choices``). A refusal is a 400 naming the field, its value and the limit.

    Unchanged (the same bytes) when nothing needs to change. A field is set by appending
    it to the body's bytes rather than dumping the payload again: the body has been parsed
    as an object with a ``model``, so it ends in ``}`` after its last member, and a
    duplicate member is overridden by the last one.
    """
    decided = bound_output(payload, bound=bound, model_default=model_default,
                           model_limit=model_limit, max_choices=max_choices)
    if isinstance(decided, OutputRefusal):
        return responses.bad_request(decided.message, decided.code, param=decided.field)
    if not decided:
        return body
    end = body.rstrip().rindex(b"}")
    added = b"".join(b',"' + name.encode() + b'":' + str(value).encode()
                     for name, value in decided.items())
    return body[:end] + added + body[end:]


def request_problem(path: str, payload: dict[str, Any]) -> ErrorReply | None:
    """Why a request an engine would accept must not reach it: one with nothing to
    answer, which an engine takes as leave to generate from nothing until its limit (an
    empty ``messages`` kept a demo replica busy for 22 s). None when there is no problem.
    The rest of the body is the engine's to judge."""
    if path == CHAT_PATH:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return responses.bad_request(
                f"`messages` is {messages!r}: a chat completion needs a list of at least "
                "one message", "invalid_messages", param="messages")
        return None
    prompt = payload.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        return responses.bad_request(
            f"`prompt` is {prompt!r}: a completion needs a prompt that is not empty",
            "invalid_prompt", param="prompt")
    return None


class KeyRateLimiter:
    """A token bucket per API key: ``burst`` requests at once, refilled at ``rate_per_s``.

    In this worker's memory: each gateway worker limits the connections it serves.
    """

    __slots__ = ("_buckets", "burst", "rate_per_s")

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        #: key id -> [tokens left, when they were counted (time.monotonic())]
        self._buckets: dict[str, list[float]] = {}

    def take(self, key_id: str, now: float) -> ErrorReply | None:
        """Spend one request of ``key_id``'s bucket; a 429 saying when to retry if empty."""
        bucket = self._buckets.get(key_id)
        if bucket is None:
            bucket = self._buckets[key_id] = [self.burst, now]
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate_per_s)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            wait = math.ceil((1.0 - tokens) / self.rate_per_s)
            return ErrorReply(
                429, f"This API key is over its rate of {self.rate_per_s:g} requests per "
                f"second (bursts of {self.burst:g}); retry in {wait} s.",
                "rate_limit_error", "rate_limit_exceeded",
                headers=[(b"retry-after", str(wait).encode())])
        bucket[0] = tokens - 1.0
        return None


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Replied:
    """An attempt's outcome: the client has its answer, with this HTTP status."""

    status: int


@dataclass(frozen=True, slots=True)
class _RetryElsewhere:
    """An attempt's outcome: nothing was sent to the client, and the error (one of
    :data:`RETRYABLE`) says the engine never saw the request or dropped it unanswered."""

    error: BaseException


#: What one attempt on one replica came to.
_Outcome = _Replied | _RetryElsewhere


def _error_kind(exc: BaseException) -> str:
    """The ``kind`` label of an upstream error."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return "reset"
    return "protocol"


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, aiohttp.ClientError) else f"{type(exc).__name__}: {text}"


def _events_end(data: bytes) -> int:
    """Where the last complete server-sent event in ``data`` ends; 0 when none does."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class _Watch:
    """Watches for the client going away while its request is being served.

    After the body has been read, the server's ``receive`` answers only when the client
    disconnects (or the response is complete): a task waiting on it cancels the request's
    own task, which closes the upstream connection, so the engine stops generating for
    nobody.
    """

    __slots__ = ("finished", "gone", "task", "watcher")

    def __init__(self, receive: Receive) -> None:
        self.finished = False
        self.gone = False
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not self.finished:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.finished = True
        self.watcher.cancel()


class Gateway:
    """The ASGI application, with its connections to the store and the engines."""

    def __init__(self, settings: Settings, *, database_url: str, engine_key_secret: bytes,
                 gateway_id: str) -> None:
        if not engine_key_secret:
            raise ValueError("the engine key secret must not be empty")
        self.settings = settings
        self.database_url = database_url
        self.gateway_id = gateway_id
        self._secret = engine_key_secret
        previous = read_previous_engine_key_secret(settings)
        #: The cluster secret being rotated out, while its grace period lasts.
        self._previous_secret = None if previous is None else previous.encode()
        #: Per replica, headers with the key derived from the previous secret: tried once
        #: when the engine refuses the current one (it started before the rotation).
        self._fallback_headers: dict[str, dict[str, str]] = {}
        self.metrics = GatewayMetrics()
        self.table = RoutingTable(self._make_endpoint)
        self._key_hashes: dict[str, str] = {}
        self._auth = settings.gateway_auth
        #: When (``time.monotonic()``) the read that gave ``_key_hashes`` began, and until
        #: when they may be trusted: a revoked key must stop working within the bound
        #: even while the store is unreachable, so past it every keyed request is refused.
        self._keys_read_at = float("-inf")
        self._keys_trusted_until = float("-inf")
        self._key_max_staleness_s = settings.gateway_key_max_staleness_s
        self._max_tokens = settings.gateway_max_tokens
        self._max_choices = settings.gateway_max_choices
        self._hosts = HostCheck(settings)
        self._metrics_guard = MetricsGuard(read_metrics_token(settings), auth=self._auth)
        self._limiter = (None if settings.gateway_key_rate_per_s is None else
                         KeyRateLimiter(settings.gateway_key_rate_per_s,
                                        settings.gateway_key_burst))
        self.routes: RoutingStore | None = None
        self._changes: TableListener | None = None
        self._session: aiohttp.ClientSession | None = None
        self._usage: UsageReporter | None = None
        self._policy = HoldPolicy(wait_s=settings.gateway_wait_for_replica_s,
                                  retries=settings.gateway_retries,
                                  retry_after_s=settings.gateway_retry_after_s)

    # -- lifecycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        """Connect to the store (applying pending migrations unless it has a role of its
        own, which may not), load routes and keys, and start listening for changes."""
        if not self._auth:
            for line in ("*" * 72,
                         "CLIENT AUTHENTICATION IS OFF (MODELKEEPER_GATEWAY_AUTH=false).",
                         "Anyone who can reach this port can use every model it serves.",
                         "For local use only; create keys with `modelkeeper keys create`.",
                         "*" * 72):
                log.warning("%s", line)
        self.routes = await RoutingStore.connect(self.database_url,
                                                 migrate=self.settings.gateway_migrates)
        self._changes = TableListener(self.database_url, self.routes, self.table,
                                      on_change=self._applied, on_keys=self._keys_read,
                                      key_refresh_s=min(KEY_REFRESH_S,
                                                        self._key_max_staleness_s / 3))
        await self._changes.start()
        timeout = aiohttp.ClientTimeout(total=None,
                                        connect=self.settings.gateway_connect_timeout_s,
                                        sock_read=self.settings.gateway_read_timeout_s)
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
        self._usage = UsageReporter(self.routes, self.table, self.gateway_id,
                                    self.settings.usage_flush_interval_s)
        self._usage.start()
        log.info("gateway %s ready: %d model(s), %d ready replica(s), auth %s",
                 self.gateway_id, len(self.table.models), sum(1 for _ in self.table.endpoints()),
                 "on" if self._auth else "OFF")

    async def shutdown(self) -> None:
        """Stop background work and close every connection."""
        if self._usage is not None:
            await self._usage.close()
        if self._changes is not None:
            await self._changes.close()
        if self._session is not None:
            await self._session.close()
        if self.routes is not None:
            await self.routes.close()

    # -- routes from the store -------------------------------------------------------------------

    @property
    def listener(self) -> ChangeListener | None:
        """The LISTEN connection to the store (None before startup)."""
        return None if self._changes is None else self._changes.listener

    def _make_endpoint(self, replica: ReplicaRoute, route: DeploymentRoute) -> Endpoint:
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

    def _applied(self, change: TableChange) -> None:
        for endpoint in change.added:
            self.metrics.set_breaker(endpoint.replica_id, BreakerState.CLOSED)
            log.info("routing %s to replica %s at %s", endpoint.model, endpoint.replica_id,
                     endpoint.url)
        for endpoint in change.removed:
            if endpoint.in_flight == 0:
                # With requests still open its series goes when they end (_left), or the
                # gauge would be counted down from nothing.
                self.metrics.forget_replica(endpoint.model, endpoint.replica_id)
            log.info("replica %s of %s is out of routing (%d request(s) in flight)",
                     endpoint.replica_id, endpoint.model, endpoint.in_flight)
        if change.removed and self._usage is not None:
            # A drain waits for this worker's row written after the replica left routing.
            self._usage.nudge()

    def _left(self, endpoint: Endpoint) -> None:
        """The last request of an endpoint out of routing ended: write that down now (a
        drain is waiting for it) and drop its series, unless the replica is routed again
        at another address, whose series it shares."""
        if self._usage is not None:
            self._usage.nudge()
        entry = self.table.models.get(endpoint.model)
        if entry is None or all(e.replica_id != endpoint.replica_id for e in entry.endpoints):
            self.metrics.forget_replica(endpoint.model, endpoint.replica_id)

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                        TimeoutError, ValueError) as exc:
                    log.error("gateway failed to start: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        # One pass over the headers for everything the gateway reads of them.
        host = content_type = authorization = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"content-type":
                content_type = value
            elif name == b"authorization" and authorization is None:
                authorization = value
        if (refusal := self._hosts.refusal(host)) is not None:
            await self._refuse(send, refusal)
        elif path in COMPLETION_PATHS:
            if method != "POST":
                await self._reply(send, ErrorReply(405, "use POST", "invalid_request_error",
                                                   "method_not_allowed"))
            elif (refusal := (self._admit(authorization)
                              or json_body_refusal(content_type))) is not None:
                await self._refuse(send, refusal)
            else:
                await self._completion(path, receive, send)
        elif path == "/v1/models":
            if method != "GET":
                await self._reply(send, ErrorReply(405, "use GET", "invalid_request_error",
                                                   "method_not_allowed"))
            elif (refusal := self._admit(authorization)) is not None:
                await self._refuse(send, refusal)
            else:
                await self._send_json(send, 200, responses.dumps(self._models()))
        elif path == "/metrics":
            if (refusal := self._metrics_guard.refusal(authorization)) is not None:
                await self._refuse(send, refusal)
            else:
                await self._send(send, 200, self.metrics.render(),
                                 [(b"content-type", CONTENT_TYPE.encode())])
        elif path == "/healthz":
            # 200 even while the store is unreachable: the gateway keeps routing with what
            # it last read, and a load balancer pulling every gateway during a database
            # outage would turn it into a full one. Keyed requests are refused once the
            # keys are too stale to trust ("keys": "stale"; see _admit).
            listening = self.listener is not None and self.listener.connected.is_set()
            keys_current = not self._auth or time.monotonic() <= self._keys_trusted_until
            await self._send_json(send, 200, responses.dumps({
                "status": "ok", "store": "listening" if listening else "unreachable",
                "keys": "current" if keys_current else "stale",
                "models": len(self.table.models),
                "ready_replicas": sum(1 for _ in self.table.endpoints())}))
        else:
            await self._reply(send, ErrorReply(404, f"no route for {path}",
                                               "invalid_request_error", "not_found"))

    # -- auth ------------------------------------------------------------------------------

    def _keys_read(self, key_hashes: dict[str, str], read_at: float) -> None:
        """Take the key hashes the table listener read from the store, in a read that
        began at ``read_at``. An older read finishing after a newer one is ignored: its
        keys could bring back one the newer read no longer has."""
        if read_at < self._keys_read_at:
            return
        self._key_hashes = key_hashes
        self._keys_read_at = read_at
        self._keys_trusted_until = read_at + self._key_max_staleness_s

    def _admit(self, authorization: bytes | None) -> ErrorReply | None:
        """Why a request to /v1 with this ``Authorization`` header is refused: keys too
        stale to trust (503), no valid key (401), or its key over its rate (429); None to
        serve it. Costs a clock read, one SHA-256 and a dict lookup, and the rate
        limiter's arithmetic when one is set."""
        if not self._auth:
            return None
        now = time.monotonic()
        if now > self._keys_trusted_until:
            return self._stale_keys(now)
        key_id = self._key_id(authorization)
        if key_id is None:
            return responses.unauthorized(
                "Missing or invalid API key: send `Authorization: Bearer <key>` with a key "
                "from `modelkeeper keys create`.")
        if self._limiter is not None:
            return self._limiter.take(key_id, now)
        return None

    def _key_id(self, authorization: bytes | None) -> str | None:
        """The id of the key the request presents; None when it presents no valid one."""
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        # Keys are 256-bit random strings, so a plain hash is a safe stored form and a
        # dict of hashes is the whole check: one SHA-256, no database trip.
        return self._key_hashes.get(hashlib.sha256(token.strip()).hexdigest())

    def _stale_keys(self, now: float) -> ErrorReply:
        age = now - self._keys_read_at
        shown = "never read" if age == float("inf") else f"last read {age:.0f} s ago"
        return ErrorReply(
            503, f"The gateway cannot confirm API keys: they were {shown}, and it trusts "
            f"them for {self._key_max_staleness_s:g} s (the store is unreachable). Requests "
            "are refused until it reads them again, so that a revoked key cannot be used.",
            "service_unavailable", "keys_unconfirmed",
            headers=[(b"retry-after", str(STALE_KEYS_RETRY_AFTER_S).encode())])

    async def _refuse(self, send: Send, reply: ErrorReply) -> None:
        self.metrics.answered(UNKNOWN_MODEL, reply.status, 0.0)
        await self._reply(send, reply)

    # -- /v1/models ------------------------------------------------------------------------

    def _models(self) -> dict[str, Any]:
        data = []
        for model_id in sorted(self.table.models):
            entry = self.table.models[model_id]
            route = entry.route
            data.append({
                "id": model_id, "object": "model",
                "created": int(route.created_at.timestamp()), "owned_by": "modelkeeper",
                "status": route.status, "ready_replicas": len(entry.endpoints),
                "desired_replicas": route.desired_replicas,
            })
        return {"object": "list", "data": data}

    # -- completions -------------------------------------------------------------------------

    async def _completion(self, path: str, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        try:
            body = await self._read_body(receive)
        except _TooLarge:
            await self._reply(send, ErrorReply(413, f"body larger than {MAX_BODY_BYTES} bytes",
                                               "invalid_request_error", "body_too_large"))
            return
        except _ClientGone:
            return
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            await self._finish_error(send, UNKNOWN_MODEL, started, responses.bad_request(
                "the body is not valid JSON", "invalid_json"))
            return
        except RecursionError:
            # The parser recurses per level: a body nested a thousand deep is hostile,
            # and its failure must be the client's 400, not the server's 500.
            await self._finish_error(send, UNKNOWN_MODEL, started, responses.bad_request(
                "the body's JSON is nested too deeply", "json_too_deep"))
            return
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str):
            await self._finish_error(send, UNKNOWN_MODEL, started, responses.bad_request(
                "`model` is required: the name of a deployed model", "model_required",
                param="model"))
            return
        entry = self.table.models.get(model)
        # The request's own problems first, the model's availability after: a malformed
        # request is the client's to fix whichever model it names.
        route = None if entry is None else entry.route
        problem = request_problem(path, payload)
        if problem is not None:
            await self._finish_error(send, UNKNOWN_MODEL, started, problem)
            return
        bounded = bound_max_tokens(
            payload, body, self._max_tokens,
            model_default=None if route is None else route.default_max_tokens,
            model_limit=None if route is None else route.max_tokens_limit,
            max_choices=self._max_choices)
        if isinstance(bounded, ErrorReply):
            await self._finish_error(send, UNKNOWN_MODEL, started, bounded)
            return
        body = bounded
        if entry is None:
            await self._finish_error(send, UNKNOWN_MODEL, started,
                                     responses.unknown_model(model, self.table.models))
            return
        entry.last_request = time.time()
        watch = _Watch(receive)
        code = CLIENT_CLOSED
        try:
            code = await self._route(path, body, entry, send, started)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            # Our own watcher cancelled us: the client left. Not an error of ours.
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
        finally:
            watch.stop()
        self.metrics.answered(model, code, time.perf_counter() - started)

    async def _route(self, path: str, body: bytes, entry: ModelRoute, send: Send,
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
                    await self._reply(send, found)
                    return found.status
                endpoint = found
                if tried is not None:
                    self.metrics.retries.labels(model).inc()
            match await self._attempt(endpoint, path, body, send=send, started=started):
                case _Replied(status=status):
                    return status
                case _RetryElsewhere(error=error):
                    tried = record(tried, endpoint, why=_describe(error),
                                   refused=isinstance(error, REFUSED))
                    endpoint = None

    async def _next_endpoint(self, model: str, tried: Tried | None,
                             arrived: float) -> Endpoint | ErrorReply:
        """The replica to send the request to, once there is one it may go to; or the
        error to answer with. Holds the request meanwhile, woken by the store's
        notifications and by breakers changing or coming due, never by polling."""
        while True:
            now = time.monotonic()
            match next_step(self.table, model, tried, now, arrived=arrived,
                            policy=self._policy):
                case SendTo(endpoint=endpoint):
                    return endpoint
                case GiveUp(reply=reply):
                    return reply
                case Hold(entry=entry, until=until):
                    await self._hold(entry, until - now)

    async def _hold(self, entry: ModelRoute, timeout: float) -> None:
        """Wait until ``entry`` changes, ``timeout`` seconds at most; counted as waiting."""
        changed = entry.changed
        model = entry.route.model_id
        entry.waiting += 1
        self.metrics.waiting.labels(model).inc()
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            entry.waiting -= 1
            self.metrics.waiting.labels(model).dec()

    async def _attempt(self, endpoint: Endpoint, path: str, body: bytes, *, send: Send,
                       started: float) -> _Outcome:
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
                self._upstream_error(endpoint, exc)
                return _RetryElsewhere(exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Timed out or garbled before the first byte: the engine may be working on
                # it, so sending it again would double the load. Not retried.
                verdict = False
                self._upstream_error(endpoint, exc)
                status = 504 if isinstance(exc, TimeoutError) else 502
                reply = responses.upstream_failed(endpoint.model, _describe(exc), status)
                await self._reply(send, reply)
                return _Replied(reply.status)
            try:
                verdict, status = await self._relay(response, endpoint, send, started)
            finally:
                response.close()
            return _Replied(status)
        finally:
            self._finish_attempt(endpoint, verdict)

    def _session_post(self, url: str, body: bytes,
                      headers: dict[str, str]) -> Awaitable[aiohttp.ClientResponse]:
        assert self._session is not None
        return self._session.post(url, data=body, headers=headers)

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
        fallback = self._fallback_headers.pop(endpoint.replica_id, None)
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
            entry = self.table.models.get(endpoint.model)
            if entry is not None:
                entry.notify_changed()
        if endpoint.leaving and endpoint.in_flight == 0:
            self._left(endpoint)

    def _upstream_error(self, endpoint: Endpoint, exc: BaseException,
                        kind: str | None = None) -> None:
        kind = kind or _error_kind(exc)
        self.metrics.upstream_errors.labels(endpoint.replica_id, kind).inc()
        log.warning("replica %s of %s at %s failed (%s): %s", endpoint.replica_id,
                    endpoint.model, endpoint.url, kind, _describe(exc))

    async def _relay(self, response: aiohttp.ClientResponse, endpoint: Endpoint, send: Send,
                     started: float) -> tuple[bool, int]:
        """Pass the engine's answer to the client; return (engine healthy?, status)."""
        status = response.status
        content_type = response.headers.get("Content-Type", "application/json")
        if status == 200 and content_type.startswith("text/event-stream"):
            return await self._relay_stream(response, endpoint, send, started)
        try:
            data = await _read_reply(response)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._upstream_error(endpoint, exc)
            reply = responses.upstream_failed(endpoint.model, _describe(exc),
                                              504 if isinstance(exc, TimeoutError) else 502)
            await self._reply(send, reply)
            return False, reply.status
        if data is None:
            # Counted against the replica, as a garbled answer is: a healthy engine never
            # sends this much for a bounded request.
            why = f"its answer was over {MAX_REPLY_BYTES} bytes, the most the gateway holds"
            self.metrics.upstream_errors.labels(endpoint.replica_id, "reply_too_large").inc()
            log.warning("replica %s of %s: %s", endpoint.replica_id, endpoint.model, why)
            reply = responses.upstream_failed(endpoint.model, why)
            await self._reply(send, reply)
            return False, reply.status
        if status >= 500:
            self.metrics.upstream_errors.labels(endpoint.replica_id, "status_5xx").inc()
        if status >= 400:
            # Off the hot path: an engine's error in the one shape clients get from us.
            data = responses.engine_error(status, data).body()
            content_type = "application/json"
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type.encode("latin-1")),
            (b"content-length", str(len(data)).encode()),
            (b"x-modelkeeper-replica", endpoint.replica_id.encode()),
        ]})
        await send({"type": "http.response.body", "body": data})
        return status < 500, status

    async def _relay_stream(self, response: aiohttp.ClientResponse, endpoint: Endpoint,
                            send: Send, started: float) -> tuple[bool, int]:
        """Relay server-sent events as they come, whole events only, so that a stream cut
        midway can still end with a well-formed error event and ``[DONE]``."""
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-modelkeeper-replica", endpoint.replica_id.encode()),
        ]})
        content = response.content
        pending = b""
        done = False
        first = True
        failure: str | None = None
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                if first:
                    first = False
                    self.metrics.ttft.labels(endpoint.model).observe(
                        time.perf_counter() - started)
                if pending:
                    chunk = pending + chunk
                    pending = b""
                # Forward up to the end of the last complete event; keep the rest.
                end = _events_end(chunk)
                if end == 0:
                    pending = chunk
                else:
                    if end < len(chunk):
                        pending = chunk[end:]
                        chunk = chunk[:end]
                    if not done and b"[DONE]" in chunk:
                        done = True
                    chunk = responses.engine_error_events(chunk)
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
                if len(pending) > MAX_EVENT_BYTES:
                    # An event that never ends would otherwise be held without bound.
                    failure = (f"it sent an event over {MAX_EVENT_BYTES} bytes, the most the "
                               "gateway holds")
                    pending = b""
                    self.metrics.upstream_errors.labels(endpoint.replica_id,
                                                        "event_too_large").inc()
                    break
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = _describe(exc)
            self._upstream_error(endpoint, exc, "stream_cut")
        if not done:
            if failure is None:
                failure = "the engine ended the stream without [DONE]"
                self.metrics.upstream_errors.labels(endpoint.replica_id, "stream_cut").inc()
            log.warning("stream from replica %s of %s cut midway: %s", endpoint.replica_id,
                        endpoint.model, failure)
            await send({"type": "http.response.body", "more_body": True,
                        "body": responses.sse_error_event(
                            f"The stream from `{endpoint.model}` was cut midway: {failure}")})
        elif pending:
            await send({"type": "http.response.body", "body": pending, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return done, 200

    # -- small helpers -------------------------------------------------------------------------

    async def _read_body(self, receive: Receive) -> bytes:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body: bytes = message.get("body", b"")
        if not message.get("more_body"):
            return body
        parts = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise _TooLarge
            parts.append(part)
        return b"".join(parts)

    async def _finish_error(self, send: Send, model: str, started: float,
                            reply: ErrorReply) -> None:
        await self._reply(send, reply)
        self.metrics.answered(model, reply.status, time.perf_counter() - started)

    async def _reply(self, send: Send, reply: ErrorReply) -> None:
        await self._send(send, reply.status, reply.body(), [*JSON_HEADERS, *reply.headers])

    async def _send_json(self, send: Send, status: int, body: bytes) -> None:
        await self._send(send, status, body, JSON_HEADERS)

    @staticmethod
    async def _send(send: Send, status: int, body: bytes, headers: Headers) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def _read_reply(response: aiohttp.ClientResponse) -> bytes | None:
    """An engine's whole answer; None when it is over :data:`MAX_REPLY_BYTES`. An answer
    with a Content-Length (as engines send) is read in one go, as before the bound; one
    without (chunked, or ended by closing) is counted as it comes."""
    length = response.content_length
    if length is not None:
        return None if length > MAX_REPLY_BYTES else await response.read()
    parts: list[bytes] = []
    size = 0
    async for part in response.content.iter_any():
        size += len(part)
        if size > MAX_REPLY_BYTES:
            return None
        parts.append(part)
    return b"".join(parts)


def _engine_headers(key: str) -> dict[str, str]:
    """What the gateway sends an engine with each request: its key and a content type."""
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
