"""The control plane's store: one pool, and a store per aggregate on it.

Nothing outside the store writes a query; the API and the store activities call the
stores here (``store.nodes.heartbeat_node(...)``), so a schema change touches the store
and its migration only. Each aggregate's queries live in a module of its own:

- :mod:`.nodes`: nodes and their liveness;
- :mod:`.placement`: placement and its claims (the lock protocol is documented there,
  once, at :meth:`.placement.PlacementStore.place_replica`);
- :mod:`.catalog`: the model catalog;
- :mod:`.deployments`: deployments and their replicas;
- :mod:`.usage`: the gateways' usage rows, as a drain reads them;
- :mod:`.measured`: what a replica of each model was measured to serve;
- :mod:`.events`: the audit log;
- :mod:`.operations`: the sagas' records;
- :mod:`.tokens`: operator tokens;
- :mod:`.room`: the fit-plan lock (and what the room surfaces read).
- :mod:`.quotas`: quotas per scope, and what each owner holds.
- :mod:`.watchdog`: node memory levels, watchdog actions and OOM calibrations.

The migration runner is :mod:`.schema`; the gateway's reads are :mod:`.routing`, on a
pool of its own.
"""

from __future__ import annotations

from datetime import datetime
from types import TracebackType
from typing import Self

import asyncpg

from .catalog import CatalogStore
from .deployments import DeploymentStore
from .events import EventStore
from .measured import MeasuredStore
from .nodes import NodeStore
from .operations import OperationsStore
from .placement import PlacementStore
from .pool import open_pool
from .quotas import QuotasStore
from .room import RoomStore
from .schema import Migration, apply_migrations
from .tokens import TokensStore
from .usage import UsageStore
from .watchdog import WatchdogStore


class Store:
    """A pool of connections to modelkeeper's database, and the store of each aggregate
    on it (all closed with it)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self.nodes = NodeStore(pool)
        self.placement = PlacementStore(pool)
        self.catalog = CatalogStore(pool)
        self.deployments = DeploymentStore(pool)
        self.usage = UsageStore(pool)
        self.measured = MeasuredStore(pool)
        self.events = EventStore(pool)
        self.operations = OperationsStore(pool)
        self.tokens = TokensStore(pool)
        self.room = RoomStore(pool)
        self.quotas = QuotasStore(pool)
        self.watchdog = WatchdogStore(pool)

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 10,
                      migrate: bool = True) -> Self:
        """Open a pool to ``dsn`` and, unless told not to, bring the schema up to date."""
        return cls(await open_pool(dsn, min_size=min_size, max_size=max_size,
                                   migrate=migrate))

    async def close(self) -> None:
        """Close every connection."""
        await self._pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- schema ---------------------------------------------------------------------------

    async def migrate(self, migrations: list[Migration] | None = None) -> list[int]:
        """Apply the migrations not yet applied; return the versions this call applied.

        Safe to run from several processes at once (see :func:`.schema.apply_migrations`).
        """
        return await apply_migrations(self._pool, migrations)

    async def schema_versions(self) -> list[int]:
        """The migration versions recorded as applied."""
        rows = await self._pool.fetch("SELECT version FROM schema_version ORDER BY version")
        return [row["version"] for row in rows]

    async def ping(self) -> bool:
        """True when the database answers a trivial query."""
        return bool(await self._pool.fetchval("SELECT true"))

    async def now(self) -> datetime:
        """The database's clock, which stamps every ``created_at``: an age measured against
        it does not depend on the caller's clock agreeing with the database's."""
        now: datetime = await self._pool.fetchval("SELECT now()")
        return now
