"""The usage watch (room-watch worker): follow a deployment's demand outside its
workflow's history, and return only when a scaling step is due.

Who decides what is :func:`modelkeeper.domain.demand.step`, a pure function of the
keeper's view, the gateways' usage and the time; this module only reads the store and
waits. One :class:`DemandFeed` per worker process serves every watch in it: one LISTEN
connection on :data:`~modelkeeper.names.DEMAND_CHANNEL`, and one query per tick for all
the deployments watched (:meth:`UsageStore.demand_samples`), so a thousand idle
deployments cost one query a second, not a thousand. A notification (a request waiting
for a deployment that had none waiting) reads that deployment at once, so a cold start
does not wait for the tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

import asyncpg
from pydantic import ValidationError
from temporalio import activity

from modelkeeper.domain.demand import (
    DemandFound,
    DemandSample,
    Pressure,
    WatchDemandInput,
    step,
)
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.names import ACTIVITY_WATCH_DEMAND, DEMAND_CHANNEL
from modelkeeper.store import UsageStore
from modelkeeper.store.routing import ChangeListener

log = logging.getLogger(__name__)

#: watch_demand records a heartbeat this often (or a quarter of its heartbeat timeout, if
#: less): a local call; the SDK sends at most one per throttle interval (0.8 x the
#: timeout, at most 60 s), and the workflow's cancel comes back with one that was sent.
DEMAND_WATCH_BEAT_S = 5.0
#: What a failed read of the usage rows is (the database restarting, a connection lost):
#: the tick after it reads again. Meanwhile no sample comes, so no step is due (unknown
#: is not idle).
READ_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
#: A read takes milliseconds (about 50 ms for a thousand deployments on a loaded 2-core
#: machine); one that has not answered in 10 s is a database gone silent (a network cut
#: sends no reset), and waiting on it would hold up every watch of the process: it is
#: given up and the next tick tries again.
READ_TIMEOUT_S = 10.0


class DemandFeedStopped(RuntimeError):
    """The feed's loop ended (the worker is stopping, or a bug): a watch fails and its
    retry starts on a worker whose feed runs."""


class Subscription:
    """The samples of one deployment for one watch: only the latest is kept (a watch that
    falls behind skips to now, as the rules read time from each sample)."""

    def __init__(self, deployment_id: DeploymentId) -> None:
        self.deployment_id = deployment_id
        self._latest: DemandSample | None = None
        self._fresh = asyncio.Event()
        self._stopped: BaseException | None = None

    def offer(self, sample: DemandSample) -> None:
        if self._latest is None or sample.at >= self._latest.at:
            self._latest = sample
            self._fresh.set()

    def stop(self, cause: BaseException) -> None:
        self._stopped = cause
        self._fresh.set()

    async def next(self) -> DemandSample:
        """The next sample newer than the last one returned (waits for it)."""
        await self._fresh.wait()
        if self._stopped is not None:
            raise DemandFeedStopped("the demand feed stopped") from self._stopped
        self._fresh.clear()
        assert self._latest is not None  # set with the event
        return self._latest


class DemandFeed:
    """Samples of every deployment watched in this process: one listener, one query a
    tick, and an immediate read of a deployment its notification names."""

    def __init__(self, usage: UsageStore, dsn: str, *, interval_s: float,
                 flush_interval_s: float) -> None:
        self._usage = usage
        self._interval_s = interval_s
        self._flush_interval_s = flush_interval_s
        self._listener = ChangeListener(dsn, (DEMAND_CHANNEL,), self._notified,
                                        self._reconnected)
        self._subscriptions: dict[DeploymentId, set[Subscription]] = {}
        #: Deployments to read before the next tick (notified, or newly watched).
        self._urgent: set[DeploymentId] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Why the loop ended, once it has: every watch then fails (and is retried).
        self._stopped: BaseException | None = None
        #: How many reads have answered (for tests).
        self.reads = 0
        self._failing = False

    @property
    def listener(self) -> ChangeListener:
        return self._listener

    async def start(self) -> None:
        """Listen, then read every tick until :meth:`close`."""
        await self._listener.start()
        self._task = asyncio.create_task(self._run(), name="demand-feed")
        self._task.add_done_callback(self._ended)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._listener.close()

    @contextlib.asynccontextmanager
    async def subscribe(self, deployment_id: DeploymentId) -> AsyncIterator[Subscription]:
        """The samples of ``deployment_id`` while the context is open; the first comes at
        once (a watch started while requests already wait has no notification coming)."""
        subscription = Subscription(deployment_id)
        if self._stopped is not None:
            subscription.stop(self._stopped)
        self._subscriptions.setdefault(deployment_id, set()).add(subscription)
        self._mark_urgent([deployment_id])
        try:
            yield subscription
        finally:
            watchers = self._subscriptions.get(deployment_id, set())
            watchers.discard(subscription)
            if not watchers:
                self._subscriptions.pop(deployment_id, None)

    def _notified(self, _channel: str, payload: str) -> None:
        deployment_id = DeploymentId(payload)
        if deployment_id in self._subscriptions:
            self._mark_urgent([deployment_id])

    async def _reconnected(self) -> None:
        # Notifications sent while the listener was down are lost: read everything.
        self._mark_urgent(list(self._subscriptions))

    def _mark_urgent(self, deployment_ids: Collection[DeploymentId]) -> None:
        self._urgent.update(deployment_ids)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_tick - loop.time()))
            self._wake.clear()
            if loop.time() >= next_tick:
                # The tick reads every deployment watched, the urgent ones among them.
                next_tick = loop.time() + self._interval_s
                self._urgent.clear()
                wanted = set(self._subscriptions)
            else:
                wanted, self._urgent = self._urgent & set(self._subscriptions), set()
            if wanted:
                await self._read(wanted)

    async def _read(self, deployment_ids: set[DeploymentId]) -> None:
        try:
            samples = await asyncio.wait_for(self._usage.demand_samples(
                deployment_ids, flush_interval_s=self._flush_interval_s), READ_TIMEOUT_S)
        except READ_ERRORS as exc:
            # Once per outage, not once a tick.
            (log.debug if self._failing else log.warning)(
                "cannot read the gateways' usage rows (%s); trying again every %gs; no "
                "scaling step is taken meanwhile", exc, self._interval_s)
            self._failing = True
            return
        if self._failing:
            log.info("reading the gateways' usage rows again")
            self._failing = False
        self.reads += 1
        for deployment_id, sample in samples.items():
            for subscription in self._subscriptions.get(deployment_id, ()):
                subscription.offer(sample)

    def _ended(self, task: asyncio.Task[None]) -> None:
        cause = None if task.cancelled() else task.exception()
        if cause is not None:
            log.error("the demand feed stopped", exc_info=cause)
        self._stopped = cause or asyncio.CancelledError()
        for subscriptions in self._subscriptions.values():
            for subscription in subscriptions:
                subscription.stop(self._stopped)


class DemandActivities:
    """The usage watch, bound to this process's feed."""

    def __init__(self, feed: DemandFeed, clock: Callable[[], float] = time.monotonic) -> None:
        self._feed = feed
        self._clock = clock

    @activity.defn(name=ACTIVITY_WATCH_DEMAND)
    async def watch_demand(self, request: WatchDemandInput) -> DemandFound:
        """Run the scaling rules on each sample of the deployment's usage, on the view
        the keeper had when it started the watch, and return the first step due.

        Runs until a step is due or it is cancelled (the keeper's view changed): a
        deployment whose demand calls for nothing costs no history events, however long.
        It heartbeats every :data:`DEMAND_WATCH_BEAT_S` with what it remembers of the
        rules' periods (:class:`Pressure`), so a retry after a lost worker or a database
        error goes on with them rather than starting each period again.
        """
        info = activity.info()
        beat_s = DEMAND_WATCH_BEAT_S if info.heartbeat_timeout is None else min(
            DEMAND_WATCH_BEAT_S, info.heartbeat_timeout.total_seconds() / 4)
        view = request.view
        pressure = _remembered(info.heartbeat_details) or request.pressure
        async with self._feed.subscribe(view.deployment_id) as samples:
            activity.heartbeat(pressure.model_dump(mode="json"))
            last_beat = self._clock()
            while True:
                left = last_beat + beat_s - self._clock()
                sample: DemandSample | None = None
                if left > 0:
                    with contextlib.suppress(TimeoutError):
                        sample = await asyncio.wait_for(samples.next(), left)
                if sample is not None:
                    pressure, found = step(view, sample, pressure, now=sample.at)
                    if found is not None:
                        log.info("%s: %s due: %s", view.deployment_id, found.kind,
                                 found.reason)
                        return DemandFound(view=view, step=found, sample=sample,
                                           pressure=pressure)
                if self._clock() - last_beat >= beat_s:
                    activity.heartbeat(pressure.model_dump(mode="json"))
                    last_beat = self._clock()

    def all(self) -> list[Callable[..., Any]]:
        """Every activity this class defines, for the room-watch worker to register."""
        return [self.watch_demand]


def _remembered(details: Sequence[Any]) -> Pressure | None:
    """The pressure an earlier attempt heartbeated; None on a first attempt (or one whose
    details this version cannot read: the periods then start again, which only delays)."""
    if not details:
        return None
    try:
        return Pressure.model_validate(details[0])
    except ValidationError:
        return None
