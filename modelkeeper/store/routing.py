"""The gateway's SQL: routes (deployments and their ready replicas), client API keys,
batched usage, and a LISTEN connection that survives the database going away.

Kept beside :mod:`modelkeeper.store.stores` so that all SQL stays in this package; the
gateway imports this module and no asyncpg query of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Self

import asyncpg
from pydantic import ValidationError

from ..domain.demand import ScalingPolicy
from ..domain.status import ROUTABLE_STATES, DeploymentStatus
from ..names import API_KEYS_CHANNEL, DEPLOYMENTS_CHANNEL, REPLICAS_CHANNEL
from .schema import apply_migrations

log = logging.getLogger(__name__)

#: Client API keys look like ``mkc-`` + 43 URL-safe characters (256 random bits).
CLIENT_KEY_PREFIX = "mkc-"
#: Characters of a key kept in clear as its ``prefix`` (``mkc-`` and 8 random ones):
#: 48 bits, enough to tell keys apart, far too few to guess the rest.
PREFIX_CHARS = len(CLIENT_KEY_PREFIX) + 8

#: Statuses only a deployment that follows demand shows, each one that a request brings
#: back: none running (idle), its first replica on the way (loading), or asleep.
ON_DEMAND_STATUSES = frozenset({DeploymentStatus.IDLE, DeploymentStatus.LOADING,
                                DeploymentStatus.SLEEPING})


@dataclass(frozen=True, slots=True)
class ReplicaRoute:
    """A ready replica: where its rank 0 serves the OpenAI API."""

    replica_id: str
    #: Base URL such as ``http://127.0.0.1:20001`` (the API is under ``/v1``).
    endpoint: str
    #: The node the endpoint was checked against (its rank 0's), whose key the engine's
    #: key derives from (:func:`modelkeeper.domain.engine_keys.replica_engine_key`).
    node_id: str = ""
    #: That node's key epoch when the endpoint was recorded (migration 0015); None: the
    #: first scheme, the node id alone.
    key_epoch: str | None = None


@dataclass(frozen=True, slots=True)
class DeploymentRoute:
    """What the gateway needs to know about one deployment."""

    deployment_id: str
    #: The name clients send as ``model``.
    model_id: str
    status: str
    desired_replicas: int
    placement_error: str | None
    last_failure: str | None
    consecutive_failures: int
    created_at: datetime
    #: Replicas in a routable state with an endpoint, in replica id order.
    ready: tuple[ReplicaRoute, ...]
    #: The catalog's bounds on tokens per request of the model the deployment runs (its
    #: ``runs_model_id`` after a switch): sent when a request names none, and the most
    #: one may ask for. None: the model sets none.
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    #: Its scaling policy (migration 0016); None: fixed at ``desired_replicas``, which
    #: never starts on demand.
    scaling: ScalingPolicy | None = None
    #: Loading on demand since when, and why ("asked for: 3 requests waiting"); None: it
    #: is not loading on demand.
    loading_since: datetime | None = None
    loading_reason: str | None = None
    #: The engine its replicas run (the catalog's ``engine`` of the model it runs):
    #: which queue gauge, if any, the gateway scrapes (:mod:`gateway.engine_queue`).
    engine: str | None = None

    @property
    def loads_on_demand(self) -> bool:
        """Whether a request brings it back by itself: its policy is on demand (min 0,
        max >= 1), or it shows a status only such a deployment has (idle, loading,
        sleeping). A request for it starts a load or a wake, and is held meanwhile."""
        scaling = self.scaling
        return ((scaling is not None and scaling.on_demand)
                or self.status in ON_DEMAND_STATUSES)

    @property
    def switched_off(self) -> bool:
        """Min 0, max 0: configured and deliberately not running; no request loads it."""
        return self.scaling is not None and self.scaling.off


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """A client API key as listed: never the key itself."""

    key_id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class ReplicaUsage:
    """One gateway worker's usage of one replica, as of one tick."""

    replica_id: str
    in_flight: int
    last_used_at: datetime | None
    #: Requests waiting in the engine's own queue as last scraped; None: unknown.
    engine_waiting: int | None = None


@dataclass(frozen=True, slots=True)
class DeploymentUsage:
    """One gateway worker's requests waiting for a deployment, as of one tick."""

    deployment_id: str
    waiting: int
    last_request_at: datetime | None


def hash_key(key: str) -> str:
    """The stored form of a client key: SHA-256, hex."""
    return hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).hexdigest()


def new_client_key() -> str:
    """A fresh random client key."""
    return CLIENT_KEY_PREFIX + secrets.token_urlsafe(32)


_ROUTE_SELECT = """
    SELECT d.deployment_id, d.model_id, d.status, d.replicas, d.placement_error,
           d.last_failure, d.consecutive_failures, d.created_at,
           d.scaling::text AS scaling, d.loading_since, d.loading_reason,
           -- The model the engines run: after a switch, not the served name's own entry.
           -- Subqueries, not a join, so the GROUP BY below stays one deployment's.
           (SELECT m.default_max_tokens FROM models m
            WHERE m.model_id = COALESCE(d.runs_model_id, d.model_id)) AS default_max_tokens,
           (SELECT m.max_tokens_limit FROM models m
            WHERE m.model_id = COALESCE(d.runs_model_id, d.model_id)) AS max_tokens_limit,
           (SELECT m.engine FROM models m
            WHERE m.model_id = COALESCE(d.runs_model_id, d.model_id)) AS engine,
           COALESCE(array_agg(r.replica_id ORDER BY r.replica_id)
                    FILTER (WHERE r.replica_id IS NOT NULL), '{}') AS replica_ids,
           COALESCE(array_agg(r.endpoint ORDER BY r.replica_id)
                    FILTER (WHERE r.replica_id IS NOT NULL), '{}') AS endpoints,
           COALESCE(array_agg(r.endpoint_node_id ORDER BY r.replica_id)
                    FILTER (WHERE r.replica_id IS NOT NULL), '{}') AS endpoint_nodes,
           COALESCE(array_agg(r.endpoint_node_epoch ORDER BY r.replica_id)
                    FILTER (WHERE r.replica_id IS NOT NULL), '{}') AS endpoint_epochs
    FROM deployments d
    LEFT JOIN replicas r
           ON r.deployment_id = d.deployment_id
          AND r.state = ANY($1::text[])
          AND r.endpoint IS NOT NULL
          -- Without it the gateway cannot derive the engine's key (migration 0011).
          AND r.endpoint_node_id IS NOT NULL
"""


def _route(row: asyncpg.Record) -> DeploymentRoute:
    return DeploymentRoute(
        deployment_id=row["deployment_id"],
        model_id=row["model_id"],
        status=row["status"],
        desired_replicas=row["replicas"],
        placement_error=row["placement_error"],
        last_failure=row["last_failure"],
        consecutive_failures=row["consecutive_failures"],
        created_at=row["created_at"],
        ready=tuple(ReplicaRoute(rid, url, node, epoch)
                    for rid, url, node, epoch in zip(row["replica_ids"], row["endpoints"],
                                                     row["endpoint_nodes"],
                                                     row["endpoint_epochs"], strict=True)),
        default_max_tokens=row["default_max_tokens"],
        max_tokens_limit=row["max_tokens_limit"],
        scaling=_scaling(row["deployment_id"], row["scaling"]),
        loading_since=row["loading_since"],
        loading_reason=row["loading_reason"],
        engine=row["engine"],
    )


def _scaling(deployment_id: str, text: str | None) -> ScalingPolicy | None:
    """A deployment's policy from its JSON; one that does not read (a newer writer's rule
    this version refuses) counts as none, which never loads on demand, rather than
    failing the read of every route."""
    if text is None:
        return None
    try:
        return ScalingPolicy.model_validate_json(text)
    except ValidationError as err:
        log.warning("deployment %s: its scaling policy does not read (%s); routing it as "
                    "fixed at its replicas", deployment_id, err.errors()[:1])
        return None


class RoutingStore:
    """The gateway's queries over an asyncpg pool (which the caller owns and closes)."""

    def __init__(self, pool: asyncpg.Pool, *, owns_pool: bool = False) -> None:
        self._pool = pool
        self._owns_pool = owns_pool
        self._routable = sorted(ROUTABLE_STATES)

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 3, migrate: bool = True) -> Self:
        """Open a small pool of its own and, unless told not to, apply pending migrations
        (every component does at start; see :func:`.schema.apply_migrations`).

        A gateway on a role of its own passes ``migrate=False``: that role has no DDL
        rights (migration 0013), so the migrating processes must have run first."""
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size)
        try:
            if migrate:
                await apply_migrations(pool)
        except BaseException:
            await pool.close()
            raise
        return cls(pool, owns_pool=True)

    async def close(self) -> None:
        """Close the pool if :meth:`connect` opened it."""
        if self._owns_pool:
            await self._pool.close()

    # -- routes ----------------------------------------------------------------------------

    async def load_routes(self) -> list[DeploymentRoute]:
        """Every deployment with its ready replicas."""
        rows = await self._pool.fetch(
            _ROUTE_SELECT + " GROUP BY d.deployment_id ORDER BY d.model_id", self._routable)
        return [_route(row) for row in rows]

    async def load_routes_for(self, deployment_ids: Iterable[str]) -> dict[str, DeploymentRoute]:
        """The named deployments that still exist, by id; a missing id was deleted."""
        rows = await self._pool.fetch(
            _ROUTE_SELECT + " WHERE d.deployment_id = ANY($2::text[]) GROUP BY d.deployment_id",
            self._routable, list(deployment_ids))
        return {row["deployment_id"]: _route(row) for row in rows}

    # -- client API keys ---------------------------------------------------------------------

    async def create_api_key(self, name: str) -> tuple[ApiKeyRecord, str]:
        """Store a new key's hash; return its record and the key, which exists nowhere else."""
        key = new_client_key()
        row = await self._pool.fetchrow(
            """
            INSERT INTO api_keys (key_id, name, prefix, key_sha256)
            VALUES ($1, $2, $3, $4)
            RETURNING key_id, name, prefix, created_at, revoked_at
            """,
            "key-" + secrets.token_hex(6), name, key[:PREFIX_CHARS], hash_key(key))
        assert row is not None
        return ApiKeyRecord(**dict(row)), key

    async def list_api_keys(self) -> list[ApiKeyRecord]:
        """Every key, revoked ones included, oldest first."""
        rows = await self._pool.fetch(
            "SELECT key_id, name, prefix, created_at, revoked_at FROM api_keys "
            "ORDER BY created_at, key_id")
        return [ApiKeyRecord(**dict(row)) for row in rows]

    async def revoke_api_keys(self, id_or_prefix: str) -> list[ApiKeyRecord]:
        """Revoke the active keys whose id or prefix is ``id_or_prefix``; return them."""
        rows = await self._pool.fetch(
            """
            UPDATE api_keys SET revoked_at = now()
            WHERE (key_id = $1 OR prefix = $1) AND revoked_at IS NULL
            RETURNING key_id, name, prefix, created_at, revoked_at
            """,
            id_or_prefix)
        return [ApiKeyRecord(**dict(row)) for row in rows]

    async def active_key_hashes(self) -> dict[str, str]:
        """SHA-256 of every unrevoked key -> its key id."""
        rows = await self._pool.fetch(
            "SELECT key_sha256, key_id FROM api_keys WHERE revoked_at IS NULL")
        return {row["key_sha256"]: row["key_id"] for row in rows}

    # -- usage -------------------------------------------------------------------------------

    async def write_usage(self, gateway_id: str, replicas: Sequence[ReplicaUsage],
                          deployments: Sequence[DeploymentUsage], *,
                          leaving: Sequence[ReplicaUsage] = ()) -> None:
        """Upsert one worker's usage rows in one transaction (one round trip per table).

        ``replicas`` are those the worker routes to; ``leaving``, those it took out of
        routing and still reports until their count is 0. Each replica appears once in
        the two together. Rows of replicas or deployments deleted meanwhile are skipped
        by the joins, so a replica that vanished does not fail the whole batch.

        A row of a replica the worker still routes but the store no longer does is
        skipped as well, and its older row stays: the worker has not yet heard the
        notification, so its count could still grow. Hence a row stamped after a drain's
        mark (``updated_at`` is the transaction's start, and this statement reads the
        replica's state later) comes from a worker that had already dropped the replica,
        and its count can only fall: the drain relies on that.
        """
        rows = [*((u, True) for u in replicas), *((u, False) for u in leaving)]
        async with self._pool.acquire() as conn, conn.transaction():
            if rows:
                await conn.execute(
                    """
                    INSERT INTO replica_usage (gateway_id, replica_id, in_flight,
                                               last_used_at, engine_waiting, updated_at)
                    SELECT $1, u.replica_id, u.in_flight, u.last_used_at, u.engine_waiting,
                           now()
                    FROM unnest($2::text[], $3::int[], $4::timestamptz[], $5::bool[],
                                $7::int[])
                         AS u (replica_id, in_flight, last_used_at, routed, engine_waiting)
                    JOIN replicas r USING (replica_id)
                    WHERE NOT u.routed OR r.state = ANY($6::text[])
                    ON CONFLICT (gateway_id, replica_id) DO UPDATE
                    SET in_flight = EXCLUDED.in_flight,
                        last_used_at = COALESCE(EXCLUDED.last_used_at,
                                                replica_usage.last_used_at),
                        -- Not kept when unknown now: an old queue is no queue.
                        engine_waiting = EXCLUDED.engine_waiting,
                        updated_at = now()
                    """,
                    gateway_id, [u.replica_id for u, _ in rows],
                    [u.in_flight for u, _ in rows], [u.last_used_at for u, _ in rows],
                    [routed for _, routed in rows], self._routable,
                    [u.engine_waiting for u, _ in rows])
            if deployments:
                await conn.execute(
                    """
                    INSERT INTO deployment_usage (gateway_id, deployment_id, waiting,
                                                  last_request_at, updated_at)
                    SELECT $1, u.deployment_id, u.waiting, u.last_request_at, now()
                    FROM unnest($2::text[], $3::int[], $4::timestamptz[])
                         AS u (deployment_id, waiting, last_request_at)
                    JOIN deployments USING (deployment_id)
                    ON CONFLICT (gateway_id, deployment_id) DO UPDATE
                    SET waiting = EXCLUDED.waiting,
                        last_request_at = COALESCE(EXCLUDED.last_request_at,
                                                   deployment_usage.last_request_at),
                        updated_at = now()
                    """,
                    gateway_id, [u.deployment_id for u in deployments],
                    [u.waiting for u in deployments], [u.last_request_at for u in deployments])

    async def clear_usage(self, gateway_id: str) -> None:
        """Delete one worker's usage rows (it is stopping: it holds no requests any more)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("DELETE FROM replica_usage WHERE gateway_id = $1", gateway_id)
            await conn.execute("DELETE FROM deployment_usage WHERE gateway_id = $1", gateway_id)

    async def replica_usage(self, replica_id: str) -> list[ReplicaUsage]:
        """Each gateway worker's row for ``replica_id`` (for readers and tests)."""
        rows = await self._pool.fetch(
            "SELECT replica_id, in_flight, last_used_at, engine_waiting FROM replica_usage "
            "WHERE replica_id = $1 ORDER BY gateway_id", replica_id)
        return [ReplicaUsage(**dict(row)) for row in rows]

    async def deployment_usage(self, deployment_id: str) -> list[DeploymentUsage]:
        """Each gateway worker's row for ``deployment_id`` (for readers and tests)."""
        rows = await self._pool.fetch(
            "SELECT deployment_id, waiting, last_request_at FROM deployment_usage "
            "WHERE deployment_id = $1 ORDER BY gateway_id", deployment_id)
        return [DeploymentUsage(**dict(row)) for row in rows]


#: What a listener hands each notification to: (channel, payload).
NotifyHandler = Callable[[str, str], None]
#: Called after every (re)connection, once LISTEN is in place: the caller reloads
#: everything, since notifications sent while it was disconnected are lost.
ConnectedHandler = Callable[[], Awaitable[None]]

#: Channels the gateway listens on.
GATEWAY_CHANNELS = (REPLICAS_CHANNEL, DEPLOYMENTS_CHANNEL, API_KEYS_CHANNEL)


class ChangeListener:
    """LISTEN on a dedicated connection, reconnecting with backoff when it drops.

    A pooled connection would not do: LISTEN belongs to the session, and a pool hands
    connections back and forth. After each (re)connection ``on_connected`` runs *after*
    LISTEN is in place, so a change made while it reloads is still notified.
    """

    def __init__(self, dsn: str, channels: Sequence[str], on_notify: NotifyHandler,
                 on_connected: ConnectedHandler, *, max_backoff_s: float = 5.0,
                 ping_interval_s: float = 10.0, ping_timeout_s: float = 5.0) -> None:
        self._dsn = dsn
        self._channels = tuple(channels)
        self._on_notify = on_notify
        self._on_connected = on_connected
        self._max_backoff_s = max_backoff_s
        self._ping_interval_s = ping_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Set while a connection is up and listening; for health checks and tests.
        self.connected = asyncio.Event()
        #: How many times a connection was (re)established.
        self.connections = 0

    async def start(self, timeout_s: float = 30.0) -> None:
        """Connect and run ``on_connected`` once, then keep the connection up in the
        background. Raises if the first connection does not succeed within ``timeout_s``."""
        await asyncio.wait_for(self._connect_with_retry(), timeout_s)
        self._task = asyncio.create_task(self._keep_connected(), name="change-listener")

    @property
    def backend_pid(self) -> int | None:
        """The server process id of the listening session (tests terminate it)."""
        return None if self._conn is None else self._conn.get_server_pid()

    async def close(self) -> None:
        """Stop listening and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._close_conn()

    async def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        self.connected.clear()
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(OSError, asyncpg.PostgresError, TimeoutError):
                await conn.close(timeout=2)

    def _notified(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        self._on_notify(channel, payload)

    def _terminated(self, _conn: object) -> None:
        self._lost.set()

    async def _connect_once(self) -> None:
        conn = await asyncpg.connect(self._dsn, timeout=10)
        try:
            conn.add_termination_listener(self._terminated)
            for channel in self._channels:
                await conn.add_listener(channel, self._notified)
            self._conn = conn
            self._lost.clear()
            await self._on_connected()
        except BaseException:
            self._conn = None
            conn.terminate()
            raise
        self.connections += 1
        self.connected.set()

    async def _connect_with_retry(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._connect_once()
                return
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("cannot listen for changes (%s); retrying in %.1fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_backoff_s)

    async def _alive(self) -> bool:
        """Whether the connection still answers; a silent network drop sends no FIN, so
        only a query finds it."""
        if self._conn is None or self._conn.is_closed():
            return False
        try:
            await self._conn.execute("SELECT 1", timeout=self._ping_timeout_s)
        except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return False
        return True

    async def _keep_connected(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self._ping_interval_s)
            if not self._lost.is_set() and await self._alive():
                continue
            log.warning("lost the change-listening connection; reconnecting and reloading")
            await self._close_conn()
            await self._connect_with_retry()
