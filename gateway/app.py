"""The gateway as a raw ASGI application: the composition of its parts.

No web framework: a framework's routing, request objects and middleware cost more per
request than everything the gateway itself does, and the gateway has five routes. The
upstream client is aiohttp, whose connection pool stays cheap under concurrency (httpx's
did not: see bench/results/gateway.md for the measured choice).

Per request, on the hot path, each part in turn:

* :mod:`gateway.admission`: check the key (a clock read for the keys' freshness, one
  SHA-256 and a dict lookup), read the body and parse it to find the model, and bound
  its output;
* :mod:`gateway.routing`: pick the ready replica with the fewest requests open;
* :mod:`gateway.forwarding`: send the body unchanged with the replica's own engine key;
* :mod:`gateway.streaming`: pass the answer back, whole or event by event;
* :mod:`gateway.usage`: the counters the usage reporter writes once per tick.

Off that path, the reporter's tick also reads each engine's own queue
(:mod:`gateway.engine_queue`), written with the usage rows.

Everything else (no replica to pick, a connection failing before the answer) is decided
off that path, in :mod:`gateway.dispatch`. This module only wires the parts together and
answers the routes that are not completions.
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg

from modelkeeper.infra.secrets import read_metrics_token
from modelkeeper.settings import Settings
from modelkeeper.store.routing import ChangeListener, RoutingStore

from . import responses
from .admission import (
    COMPLETION_PATHS,
    EMBEDDINGS_PATH,
    OUTPUT_LIMIT_HEADER,
    UNROUTED_PATHS,
    Admission,
    ClientGone,
    TooLarge,
    body_too_large,
    parse_completion,
    read_body,
)
from .asgi import (
    CLIENT_CLOSED,
    ClientWatch,
    Receive,
    Scope,
    Send,
    send_json,
    send_reply,
    send_response,
    with_header,
)
from .edge import HostCheck, MetricsGuard, json_body_refusal
from .engine_queue import EngineQueues
from .forwarding import EngineKeys, Forwarder
from .metrics import CONTENT_TYPE, UNKNOWN_MODEL, GatewayMetrics
from .responses import ErrorReply
from .routing import Router, model_list
from .table import RoutingTable
from .table_listener import KEY_REFRESH_S, TableListener
from .usage import UsageTracker

#: ``GET /v1/models/{id}``: one model.
MODEL_PATH_PREFIX = "/v1/models/"

log = logging.getLogger(__name__)


class Gateway:
    """The ASGI application: admission, routing, forwarding and usage, wired to the store
    and the engines."""

    def __init__(self, settings: Settings, *, database_url: str, engine_key_secret: bytes,
                 gateway_id: str) -> None:
        keys = EngineKeys(settings, engine_key_secret=engine_key_secret)
        self.settings = settings
        self.database_url = database_url
        self.gateway_id = gateway_id
        self.metrics = GatewayMetrics()
        self.table = RoutingTable(keys.make_endpoint)
        self.admission = Admission(settings)
        self.engine_queues = EngineQueues(self.table)
        self.usage = UsageTracker(self.table, self.metrics, gateway_id=gateway_id,
                                  interval_s=settings.usage_flush_interval_s,
                                  queues=self.engine_queues)
        self.forwarder = Forwarder(settings, keys=keys, table=self.table,
                                   metrics=self.metrics, on_left=self.usage.left)
        self.router = Router(settings, table=self.table, metrics=self.metrics,
                             forwarder=self.forwarder, on_demand=self.usage.demand)
        self._hosts = HostCheck(settings)
        self._metrics_guard = MetricsGuard(read_metrics_token(settings),
                                           auth=self.admission.auth)
        # Bound once: the hot path pays no lookup through the parts.
        self._admit = self.admission.refusal
        self._bounded = self.admission.bounded
        self._route = self.router.route
        self.routes: RoutingStore | None = None
        self._changes: TableListener | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        """Connect to the store (applying pending migrations unless it has a role of its
        own, which may not), load routes and keys, and start listening for changes."""
        if not self.admission.auth:
            for line in ("*" * 72,
                         "CLIENT AUTHENTICATION IS OFF (MODELKEEPER_GATEWAY_AUTH=false).",
                         "Anyone who can reach this port can use every model it serves.",
                         "For local use only; create keys with `modelkeeper keys create`.",
                         "*" * 72):
                log.warning("%s", line)
        self.routes = await RoutingStore.connect(self.database_url,
                                                 migrate=self.settings.gateway_migrates)
        self._changes = TableListener(
            self.database_url, self.routes, self.table, on_change=self.usage.applied,
            on_keys=self.admission.keys_read,
            key_refresh_s=min(KEY_REFRESH_S, self.admission.key_max_staleness_s / 3))
        await self._changes.start()
        self.forwarder.open()
        self.usage.start(self.routes)
        log.info("gateway %s ready: %d model(s), %d ready replica(s), auth %s",
                 self.gateway_id, len(self.table.models), sum(1 for _ in self.table.endpoints()),
                 "on" if self.admission.auth else "OFF")

    async def shutdown(self) -> None:
        """Stop background work and close every connection."""
        await self.usage.close()
        if self._changes is not None:
            await self._changes.close()
        await self.forwarder.close()
        if self.routes is not None:
            await self.routes.close()

    @property
    def listener(self) -> ChangeListener | None:
        """The LISTEN connection to the store (None before startup)."""
        return None if self._changes is None else self._changes.listener

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
                await send_reply(send, ErrorReply(405, "use POST", "invalid_request_error",
                                                  "method_not_allowed"))
            elif (refusal := (self._admit(authorization)
                              or json_body_refusal(content_type))) is not None:
                await self._refuse(send, refusal)
            else:
                await self._completion(path, receive, send)
        elif path == "/v1/models" or path.startswith(MODEL_PATH_PREFIX):
            if method != "GET":
                await send_reply(send, ErrorReply(405, "use GET", "invalid_request_error",
                                                  "method_not_allowed"))
            elif (refusal := self._admit(authorization)) is not None:
                await self._refuse(send, refusal)
            elif path == "/v1/models":
                await send_json(send, 200, responses.dumps(model_list(self.table)))
            else:
                await self._one_model(send, path[len(MODEL_PATH_PREFIX):])
        elif path == EMBEDDINGS_PATH:
            if method != "POST":
                await send_reply(send, ErrorReply(405, "use POST", "invalid_request_error",
                                                  "method_not_allowed"))
            elif (refusal := (self._admit(authorization)
                              or json_body_refusal(content_type))) is not None:
                await self._refuse(send, refusal)
            else:
                await self._completion(path, receive, send)
        elif path in UNROUTED_PATHS:
            await self._refuse(send, responses.unrouted(path, UNROUTED_PATHS[path]))
        elif path == "/metrics":
            if (refusal := self._metrics_guard.refusal(authorization)) is not None:
                await self._refuse(send, refusal)
            else:
                await send_response(send, 200, self.metrics.render(),
                                    [(b"content-type", CONTENT_TYPE.encode())])
        elif path == "/healthz":
            # 200 even while the store is unreachable: the gateway keeps routing with what
            # it last read, and a load balancer pulling every gateway during a database
            # outage would turn it into a full one. Keyed requests are refused once the
            # keys are too stale to trust ("keys": "stale"; see gateway.admission).
            listening = self.listener is not None and self.listener.connected.is_set()
            keys_current = self.admission.keys_current(time.monotonic())
            await send_json(send, 200, responses.dumps({
                "status": "ok", "store": "listening" if listening else "unreachable",
                "keys": "current" if keys_current else "stale",
                "models": len(self.table.models),
                "ready_replicas": sum(1 for _ in self.table.endpoints())}))
        else:
            await send_reply(send, ErrorReply(404, f"no route for {path}",
                                              "invalid_request_error", "not_found"))

    async def _one_model(self, send: Send, model_id: str) -> None:
        """``GET /v1/models/{id}``: the model as ``/v1/models`` lists it, or a 404 naming
        the known ones (OpenAI's SDK calls it for ``client.models.retrieve``)."""
        for model in model_list(self.table)["data"]:
            if model["id"] == model_id:
                await send_json(send, 200, responses.dumps(model))
                return
        await self._refuse(send, responses.unknown_model(model_id, self.table.models))

    async def _refuse(self, send: Send, reply: ErrorReply) -> None:
        self.metrics.answered(UNKNOWN_MODEL, reply.status, 0.0)
        await send_reply(send, reply)

    async def _completion(self, path: str, receive: Receive, send: Send) -> None:
        """Admit the request, route it, and count its answer."""
        started = time.perf_counter()
        try:
            body = await read_body(receive)
        except TooLarge:
            await send_reply(send, body_too_large())
            return
        except ClientGone:
            return
        payload = parse_completion(body)
        if isinstance(payload, ErrorReply):
            await self._finish_error(send, UNKNOWN_MODEL, started, payload)
            return
        model: str = payload["model"]
        entry = self.table.models.get(model)
        # The request's own problems first, the model's availability after: a malformed
        # request is the client's to fix whichever model it names.
        bounded = self._bounded(path, payload, body, None if entry is None else entry.route)
        if isinstance(bounded, ErrorReply):
            await self._finish_error(send, UNKNOWN_MODEL, started, bounded)
            return
        if bounded.output_limit is not None:
            send = with_header(send, OUTPUT_LIMIT_HEADER, bounded.output_limit)
        if entry is None:
            await self._finish_error(send, UNKNOWN_MODEL, started,
                                     responses.unknown_model(model, self.table.models))
            return
        entry.last_request = time.time()
        watch = ClientWatch(receive)
        code = CLIENT_CLOSED
        try:
            code = await self._route(path, bounded.body, entry, send, started)
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

    async def _finish_error(self, send: Send, model: str, started: float,
                            reply: ErrorReply) -> None:
        await send_reply(send, reply)
        self.metrics.answered(model, reply.status, time.perf_counter() - started)
