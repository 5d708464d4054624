"""`modelkeeper worker`: the control-plane Temporal worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

from temporalio.worker import Worker

from activities.demand import DemandActivities, DemandFeed
from activities.moves import MoveActivities
from activities.notify import NotifyActivities
from activities.operations import OperationsActivities
from activities.routing import RoutingActivities
from activities.store import StoreActivities
from activities.windows import WindowActivities
from modelkeeper.infra import temporal as temporal_client
from modelkeeper.infra.notify import NotifyConfigError, read_notify_secret
from modelkeeper.names import CONTROL_TASK_QUEUE, ROOM_WATCH_TASK_QUEUE
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from workflows import ALL_WORKFLOWS

from . import sweep

log = logging.getLogger(__name__)

#: Room watches one worker runs at once: each is a coroutine asleep between dry runs
#: (minutes apart), so thousands cost little. Past it a watch waits in its queue, and the
#: deployment's hourly backstop still retries.
ROOM_WATCHES_PER_WORKER = 10_000
#: Usage watches one worker runs at once, beside them on the same queue: one per
#: deployment that follows demand, each a coroutine waiting on the process's one feed (one
#: query a tick for all of them), so ten thousand cost little. Past it a watch waits in
#: its queue and its deployment does not scale until a slot frees.
DEMAND_WATCHES_PER_WORKER = 10_000


async def run_worker(settings: Settings, stop: asyncio.Event) -> None:
    """Run the worker until ``stop`` is set, then drain it gracefully."""
    if settings.database_url is None:
        raise SystemExit("modelkeeper worker: set MODELKEEPER_DATABASE_URL")
    # Before the store: a missing certificate is a one-line error, not a half-started worker.
    security = temporal_client.security_from_settings(settings)
    try:
        read_notify_secret(settings)
    except NotifyConfigError as err:
        raise SystemExit(f"modelkeeper worker: {err}") from None
    store = await Store.connect(settings.database_url)
    try:
        client = await temporal_client.connect(
            settings.temporal_address, settings.temporal_namespace, security=security,
            wait=30)
        store_activities = StoreActivities(store, settings, client)
        routing_activities = RoutingActivities(
            store, usage_flush_interval_s=settings.usage_flush_interval_s)
        demand_feed = DemandFeed(
            store.usage, settings.database_url,
            interval_s=settings.demand_sample_interval_s,
            flush_interval_s=settings.usage_flush_interval_s)
        await demand_feed.start()
        await store_activities.start_settling_sampler()
        with ThreadPoolExecutor(max_workers=4) as executor:
            worker = Worker(
                client,
                task_queue=CONTROL_TASK_QUEUE,
                workflows=ALL_WORKFLOWS,
                activities=[*store_activities.all(), *routing_activities.all(),
                            *OperationsActivities(store, client, settings).all(),
                            *MoveActivities(client).all(),
                            *NotifyActivities(settings, store, client).all(),
                            *WindowActivities(client).all()],
                activity_executor=executor,
            )
            room_watcher = Worker(
                client, task_queue=ROOM_WATCH_TASK_QUEUE,
                activities=[*store_activities.room_watches(),
                            *DemandActivities(demand_feed).all()],
                max_concurrent_activities=ROOM_WATCHES_PER_WORKER + DEMAND_WATCHES_PER_WORKER)
            # Removes what a terminated deployment left in the store (see worker/sweep.py).
            sweeper = asyncio.create_task(
                sweep.run(store, client, interval_s=settings.sweep_interval_s))
            try:
                async with worker, room_watcher:
                    log.info("worker polling %s and %s on %s", CONTROL_TASK_QUEUE,
                             ROOM_WATCH_TASK_QUEUE, settings.temporal_address)
                    await stop.wait()
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
                await store_activities.stop_settling_sampler()
                await demand_feed.close()
    finally:
        await store.close()
