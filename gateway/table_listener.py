"""Keeping the routing table up to date: LISTEN for the store's notifications and re-read
what they name.

One LISTEN connection carries every channel the gateway needs (:data:`GATEWAY_CHANNELS`):
replicas and deployments, which name a deployment to re-read into the
:class:`~gateway.table.RoutingTable`, and API keys, which mark the key cache stale. The
key cache itself stays with the gateway (it is read on every request); this module only
hands it a fresh copy. Keys ride on the same connection rather than one of their own
because a reconnection loses both kinds of notification alike, and the full reload after
it must cover both.

Hazard: a notification sent while the connection is down is lost, so every
(re)connection re-reads everything, and does so only after LISTEN is in place.

Keys are also re-read every ``key_refresh_s`` whatever is notified, and each read is
handed over with the time it began: a connection that drops silently takes up to its ping
interval and timeout to notice, and the notifications lost meanwhile may be revocations.
The gateway trusts the keys for a bounded time after the read that gave them (see
``gateway.admission.Admission.refusal``), and refuses every keyed request once that time has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import asyncpg

from modelkeeper.names import API_KEYS_CHANNEL
from modelkeeper.store.routing import GATEWAY_CHANNELS, ChangeListener, RoutingStore

from .table import RoutingTable, TableChange

log = logging.getLogger(__name__)

#: Errors of a re-read that mean "the store is unreachable right now", not a bug: keep
#: what the table has and try again.
STORE_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)
#: Pause before re-reading again after a failed re-read: short, since requests are routed
#: on stale state meanwhile, but long enough not to spin while the store is down.
REREAD_RETRY_S = 0.5

#: How often the keys are re-read with nothing notified, by default: a third of the
#: gateway's default staleness bound (15 s), so that one failed read still leaves a
#: healthy gateway within it.
KEY_REFRESH_S = 5.0

#: Told what each update of the table did (for metrics and logs).
ChangeHandler = Callable[[TableChange], None]
#: Given the current key hashes (SHA-256 of every unrevoked key -> its key id) and when
#: (``time.monotonic()``) the read that found them began.
KeysHandler = Callable[[dict[str, str], float], None]


class TableListener:
    """Feeds the store's changes into a :class:`RoutingTable` (and the key cache).

    A burst of notifications for one deployment costs one query: notifications only mark
    what is pending, and one background task re-reads it.
    """

    def __init__(self, database_url: str, routes: RoutingStore, table: RoutingTable, *,
                 on_change: ChangeHandler, on_keys: KeysHandler,
                 key_refresh_s: float = KEY_REFRESH_S) -> None:
        self._routes = routes
        self._key_refresh_s = key_refresh_s
        self._key_refresher: asyncio.Task[None] | None = None
        self._table = table
        self._on_change = on_change
        self._on_keys = on_keys
        #: The LISTEN connection; its ``connected`` event is what /healthz reports.
        self.listener = ChangeListener(database_url, GATEWAY_CHANNELS, self._on_notify,
                                       self._reload_everything)
        self._pending: set[str] = set()  # deployment ids to re-read
        self._keys_stale = False
        self._wake = asyncio.Event()
        self._reloader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, read every route and key, then follow the notifications."""
        await self.listener.start()
        self._reloader = asyncio.create_task(self._reload_loop(), name="route-reloader")
        self._key_refresher = asyncio.create_task(self._refresh_keys_loop(),
                                                  name="key-refresher")

    async def close(self) -> None:
        """Stop re-reading and close the LISTEN connection."""
        for task in (self._reloader, self._key_refresher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.listener.close()

    async def _read_keys(self) -> None:
        """Read the keys and hand them over with the time the read began (a revocation
        committed before then is in them)."""
        began = time.monotonic()
        self._on_keys(await self._routes.active_key_hashes(), began)

    async def _refresh_keys_loop(self) -> None:
        """Re-read the keys every ``key_refresh_s``, each read bounded by that long, so
        that the gateway's trust in them is renewed while the store answers, and lapses
        when it does not."""
        while True:
            await asyncio.sleep(self._key_refresh_s)
            try:
                await asyncio.wait_for(self._read_keys(), self._key_refresh_s)
            except STORE_ERRORS as exc:
                log.warning("re-reading API keys failed (%s); the gateway refuses keyed "
                            "requests once its last read is too old", exc)

    async def _reload_everything(self) -> None:
        """Read every route and key (at start and after each reconnection of the listener,
        since notifications sent while it was away are lost)."""
        # Notifications that arrived before this full read are covered by it.
        self._pending.clear()
        self._keys_stale = False
        routes = await self._routes.load_routes()
        self._on_change(self._table.replace_all(routes))
        await self._read_keys()

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == API_KEYS_CHANNEL:
            self._keys_stale = True
        else:
            self._pending.add(payload)
        self._wake.set()

    async def _reload_loop(self) -> None:
        """Re-read each deployment named by a notification, and the keys when they
        changed."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, set()
            keys_stale, self._keys_stale = self._keys_stale, False
            try:
                if pending:
                    found = await self._routes.load_routes_for(pending)
                    for deployment_id in pending:
                        route = found.get(deployment_id)
                        if route is None:
                            self._on_change(self._table.remove(deployment_id))
                        else:
                            self._on_change(self._table.apply(route))
                if keys_stale:
                    await self._read_keys()
            except STORE_ERRORS as exc:
                # Keep what we had and try again; the listener reloads everything anyway
                # if its own connection was lost too.
                log.warning("re-reading routes failed (%s); retrying", exc)
                self._pending |= pending
                self._keys_stale |= keys_stale
                self._wake.set()
                await asyncio.sleep(REREAD_RETRY_S)
