"""The usage watch against the real store: ``UsageStore.demand_samples`` over rows as the
gateways write them (``RoutingStore.write_usage``), and ``watch_demand`` run as a function
(``ActivityEnvironment``, no Temporal) on a real :class:`DemandFeed`: its LISTEN
connection, its ticks and the demand trigger of migration 0016."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from datetime import timedelta

import asyncpg
import pytest
from temporalio import workflow
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from activities import stubs
from activities.demand import DemandActivities, DemandFeed
from modelkeeper.domain.demand import (
    Add,
    DemandFound,
    DemandSample,
    DemandView,
    Pressure,
    ReplicaStanding,
    Retire,
    ScalingPolicy,
    Standing,
    WatchDemandInput,
)
from modelkeeper.domain.ids import DeploymentId, ReplicaId
from modelkeeper.names import ROOM_WATCH_TASK_QUEUE
from modelkeeper.settings import Settings
from modelkeeper.store import Store, UsageStore
from modelkeeper.store.routing import DeploymentUsage, ReplicaUsage, RoutingStore
from tests.support.gateway_support import add_deployment, add_replica
from worker.main import run_worker

pytestmark = pytest.mark.timeout(60)

log = logging.getLogger(__name__)

#: The gateways' usage flush interval the reads assume: rows older than 5 of these are
#: workers gone (modelkeeper.domain.draining.STALE_AFTER_INTERVALS).
FLUSH_S = 1.0
#: A tick far longer than any wait here: only the notification (or a reconnect's full
#: read) can end such a watch in time.
SLOW_TICK_S = 30.0
#: A tick short enough for the time rules to be seen in a test.
FAST_TICK_S = 0.05
#: Generous bounds, for a busy 2-core machine; what is seen is logged.
NOTIFY_TO_RETURN_BOUND_S = 1.0
ENDPOINT = "http://127.0.0.1:1"
#: The application name of the feed's pool in these tests (a test cuts its connections).
USAGE_POOL = "demand-feed-test"


class CountingUsage(UsageStore):
    """The real store's reads, each one's deployment ids kept (how many queries a feed
    makes, and for how many deployments)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        super().__init__(pool)
        self.calls: list[frozenset[str]] = []

    async def demand_samples(self, deployment_ids: Collection[DeploymentId], *,
                             flush_interval_s: float) -> dict[DeploymentId, DemandSample]:
        samples = await super().demand_samples(deployment_ids,
                                               flush_interval_s=flush_interval_s)
        # Kept once answered: a test that waits for a read waits for what it read.
        self.calls.append(frozenset(deployment_ids))
        return samples



@pytest.fixture
async def gateway(database_url: str) -> AsyncIterator[RoutingStore]:
    routing = await RoutingStore.connect(database_url, migrate=False)
    try:
        yield routing
    finally:
        await routing.close()


@pytest.fixture
async def usage(database_url: str) -> AsyncIterator[CountingUsage]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=3,
                                     server_settings={"application_name": USAGE_POOL})
    try:
        yield CountingUsage(pool)
    finally:
        await pool.close()


@asynccontextmanager
async def running_feed(usage: UsageStore, database_url: str, *,
                       interval_s: float) -> AsyncIterator[DemandFeed]:
    feed = DemandFeed(usage, database_url, interval_s=interval_s, flush_interval_s=FLUSH_S)
    await feed.start()
    try:
        yield feed
    finally:
        await feed.close()


def watch(feed: DemandFeed, view: DemandView) -> asyncio.Task[DemandFound]:
    activities = DemandActivities(feed)
    return asyncio.create_task(ActivityEnvironment().run(
        activities.watch_demand, WatchDemandInput(view=view)))


async def until(condition: object, what: str, timeout_s: float = 30.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


def on_demand_view(deployment_id: str, *, desired: int = 0, idle_timeout_s: float | None = None,
                   replicas: list[ReplicaStanding] | None = None) -> DemandView:
    return DemandView(
        deployment_id=DeploymentId(deployment_id),
        policy=ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=idle_timeout_s),
        desired=desired, replicas=replicas or [])


# -- the store's read ---------------------------------------------------------------------------


async def test_demand_samples_sum_fresh_rows_ignore_stale_ones_and_leave_unknown_out(
        db: asyncpg.Connection, store: Store, gateway: RoutingStore) -> None:
    dep = DeploymentId(await add_deployment(db, "m-samples", replicas=3))
    quiet = DeploymentId(await add_deployment(db, "m-quiet", replicas=1))
    for replica_id in ("r-a", "r-b", "r-c"):
        await add_replica(db, dep, replica_id, ENDPOINT)
    now = await db.fetchval("SELECT now()")
    used_1, used_2 = now - timedelta(seconds=30), now - timedelta(seconds=10)
    await gateway.write_usage("gw-1", [ReplicaUsage("r-a", 2, used_1)],
                              [DeploymentUsage(dep, 1, used_1)])
    await gateway.write_usage("gw-2", [ReplicaUsage("r-a", 1, used_2)],
                              [DeploymentUsage(dep, 2, used_2)])
    # gw-3 died an hour ago: its rows (r-a's and the only one of r-b) are stale.
    await gateway.write_usage("gw-3", [ReplicaUsage("r-a", 5, now), ReplicaUsage("r-b", 4, now)],
                              [DeploymentUsage(dep, 7, now)])
    for table in ("replica_usage", "deployment_usage"):
        await db.execute(f"UPDATE {table} SET updated_at = now() - interval '1 hour' "
                         "WHERE gateway_id = 'gw-3'")
    # gw-2 began reporting r-a later than gw-1: the idle clock starts at the later.
    began_1, began_2 = now - timedelta(minutes=5), now - timedelta(minutes=2)
    await db.execute("UPDATE replica_usage SET reporting_since = $1 WHERE gateway_id = 'gw-1'",
                     began_1)
    await db.execute("UPDATE replica_usage SET reporting_since = $1 WHERE gateway_id = 'gw-2'",
                     began_2)

    samples = await store.usage.demand_samples([dep, quiet], flush_interval_s=FLUSH_S)

    sample = samples[dep]
    assert sample.waiting == 3
    assert sample.last_request_at == used_2
    assert [u.replica_id for u in sample.replicas] == ["r-a"], "r-b stale, r-c unreported"
    (a,) = sample.replicas
    assert (a.in_flight, a.last_used_at, a.reporting_since) == (3, used_2, began_2)
    assert sample.engine_waiting == 0
    assert timedelta(0) <= sample.at - now < timedelta(seconds=5)
    assert samples[quiet] == DemandSample(at=sample.at)
    assert await store.usage.demand_samples([], flush_interval_s=FLUSH_S) == {}


async def test_a_row_fresher_than_five_flush_intervals_counts_and_an_older_one_does_not(
        db: asyncpg.Connection, store: Store, gateway: RoutingStore) -> None:
    dep = DeploymentId(await add_deployment(db, "m-fresh"))
    await add_replica(db, dep, "r-a", ENDPOINT)
    await gateway.write_usage("gw-1", [ReplicaUsage("r-a", 1, None)], [])
    await db.execute("UPDATE replica_usage SET updated_at = now() - interval '4 seconds'")
    fresh = await store.usage.demand_samples([dep], flush_interval_s=FLUSH_S)
    assert [u.in_flight for u in fresh[dep].replicas] == [1]
    # The same row, read assuming a flush every half second: 2.5 s is the bound.
    stale = await store.usage.demand_samples([dep], flush_interval_s=0.5)
    assert stale[dep].replicas == []


async def test_engine_queues_count_once_per_replica_summed_per_deployment(
        db: asyncpg.Connection, store: Store, gateway: RoutingStore) -> None:
    """Every gateway worker scrapes the same engine: its queue counts once (the largest a
    worker saw, so a worker whose scrape failed hides nothing), and the deployment's is
    the sum over its replicas. Unknown counts as none, and a stale row not at all."""
    dep = DeploymentId(await add_deployment(db, "m-queues", replicas=3))
    for replica_id in ("q-a", "q-b", "q-c"):
        await add_replica(db, dep, replica_id, ENDPOINT)
    await gateway.write_usage("gw-1", [ReplicaUsage("q-a", 1, None, 2),
                                       ReplicaUsage("q-b", 1, None, None),
                                       ReplicaUsage("q-c", 1, None, 4)], [])
    await gateway.write_usage("gw-2", [ReplicaUsage("q-a", 1, None, 3),
                                       ReplicaUsage("q-b", 1, None, 1)], [])
    await gateway.write_usage("gw-3", [ReplicaUsage("q-c", 1, None, 40)], [])
    await db.execute("UPDATE replica_usage SET updated_at = now() - interval '1 hour' "
                     "WHERE gateway_id = 'gw-3'")
    assert [u.engine_waiting for u in await gateway.replica_usage("q-b")] == [None, 1]

    sample = (await store.usage.demand_samples([dep], flush_interval_s=FLUSH_S))[dep]
    assert sample.engine_waiting == 3 + 1 + 4
    assert sample.waiting == 0, "the engines' queues are not the gateways' own waiting"

    # A worker that no longer knows (its scrape failed) writes NULL over its old value.
    await gateway.write_usage("gw-1", [ReplicaUsage("q-c", 1, None, None)], [])
    sample = (await store.usage.demand_samples([dep], flush_interval_s=FLUSH_S))[dep]
    assert sample.engine_waiting == 3 + 1


# -- the watch ----------------------------------------------------------------------------------


async def test_a_request_for_an_on_demand_model_at_zero_returns_an_add_at_once(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str) -> None:
    dep = await add_deployment(db, "m-cold", replicas=0)
    await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 0, None)])
    async with running_feed(usage, database_url, interval_s=SLOW_TICK_S) as feed:
        task = watch(feed, on_demand_view(dep))
        # The watch's first read (at once, on subscribing) found nothing waiting.
        await until(lambda: len(usage.calls) >= 1, "the watch's first read")
        assert not task.done()

        await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 2, None)])
        written = time.monotonic()
        found = await asyncio.wait_for(task, NOTIFY_TO_RETURN_BOUND_S)
        took_s = time.monotonic() - written
    log.info("waiting 0 -> 2 to watch_demand returning: %.1f ms", took_s * 1000)
    print(f"\nwaiting 0 -> 2 to watch_demand returning: {took_s * 1000:.1f} ms")
    assert found.step == Add(reason="loading: 2 request(s) waiting")
    assert found.sample.waiting == 2
    assert found.view == on_demand_view(dep)
    assert len(usage.calls) == 2, "the notification read once; no tick came"


async def test_a_watch_started_while_requests_already_wait_returns_without_a_notice(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str) -> None:
    """The trigger notifies a rise from 0 only: a watch started (or retried) after it
    must still see the requests waiting, without waiting for the tick."""
    dep = await add_deployment(db, "m-already", replicas=0)
    await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 3, None)])
    async with running_feed(usage, database_url, interval_s=SLOW_TICK_S) as feed:
        found = await asyncio.wait_for(watch(feed, on_demand_view(dep)),
                                       NOTIFY_TO_RETURN_BOUND_S)
    assert isinstance(found.step, Add)


async def test_a_notification_lost_with_the_listener_is_made_up_by_the_reconnect(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str) -> None:
    dep = await add_deployment(db, "m-reconnect", replicas=0)
    async with running_feed(usage, database_url, interval_s=SLOW_TICK_S) as feed:
        task = watch(feed, on_demand_view(dep))
        await until(lambda: len(usage.calls) >= 1, "the watch's first read")
        pid = feed.listener.backend_pid
        await db.execute("SELECT pg_terminate_backend($1)", pid)
        await until(lambda: not feed.listener.connected.is_set()
                    or feed.listener.backend_pid != pid, "the listener to notice")
        await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 1, None)])
        found = await asyncio.wait_for(task, 15)
    assert isinstance(found.step, Add)
    assert feed.listener.connections == 2


async def test_an_idle_replica_past_its_idle_timeout_is_retired(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str) -> None:
    dep = await add_deployment(db, "m-idle", replicas=1)
    await add_replica(db, dep, "r-a", ENDPOINT)
    now = await db.fetchval("SELECT now()")
    await gateway.write_usage("gw-1", [ReplicaUsage("r-a", 0, now)], [])
    view = on_demand_view(dep, desired=1, idle_timeout_s=0.3, replicas=[ReplicaStanding(
        replica_id=ReplicaId("r-a"), standing=Standing.READY,
        ready_at=now - timedelta(minutes=1))])
    async with running_feed(usage, database_url, interval_s=FAST_TICK_S) as feed:
        found = await asyncio.wait_for(watch(feed, view), 5)
    assert isinstance(found.step, Retire) and found.step.replica_id == "r-a"
    (use,) = found.sample.replicas
    assert use.in_flight == 0
    assert (found.sample.at - use.idle_since).total_seconds() >= 0.3


async def test_a_replica_nobody_reports_is_never_retired(
        db: asyncpg.Connection, usage: CountingUsage, database_url: str) -> None:
    dep = await add_deployment(db, "m-unknown", replicas=1)
    await add_replica(db, dep, "r-a", ENDPOINT)
    now = await db.fetchval("SELECT now()")
    view = on_demand_view(dep, desired=1, idle_timeout_s=0.1, replicas=[ReplicaStanding(
        replica_id=ReplicaId("r-a"), standing=Standing.READY,
        ready_at=now - timedelta(hours=1))])
    async with running_feed(usage, database_url, interval_s=FAST_TICK_S) as feed:
        task = watch(feed, view)
        # Ten samples, each far past the idle timeout: unknown is not idle. (A generous
        # wait: ten ticks of 50 ms take half a second on a quiet machine.)
        await until(lambda: len(usage.calls) >= 10, "ten reads")
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_many_watches_share_one_listener_and_one_query_a_tick(
        db: asyncpg.Connection, usage: CountingUsage, database_url: str) -> None:
    deployments = [await add_deployment(db, f"m-many-{i}", replicas=0) for i in range(25)]
    async with running_feed(usage, database_url, interval_s=0.1) as feed:
        tasks = [watch(feed, on_demand_view(dep)) for dep in deployments]
        everyone = frozenset(deployments)
        await until(lambda: everyone in usage.calls, "a tick that reads them all")
        first = usage.calls.index(everyone)
        await until(lambda: len(usage.calls) >= first + 5, "five ticks")
        ticks = usage.calls[first:first + 5]
        listeners = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query LIKE 'LISTEN%modelkeeper_demand%'")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert ticks == [everyone] * 5, "each tick is one query for every watched deployment"
    # Before the first full tick, at most one read per watch as it subscribed (batched
    # when they subscribe together).
    assert first <= len(deployments)
    assert listeners == 1
    assert feed.listener.connections == 1
    assert not any(task.done() and not task.cancelled() for task in tasks)


async def test_the_feed_outlives_its_connections_being_cut(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str) -> None:
    dep = await add_deployment(db, "m-cut", replicas=0)
    async with running_feed(usage, database_url, interval_s=FAST_TICK_S) as feed:
        task = watch(feed, on_demand_view(dep))
        await until(lambda: len(usage.calls) >= 1, "the watch's first read")
        # The feed's pool loses its connections (a database restart, as far as it knows).
        cut = await db.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = $1", USAGE_POOL)
        assert cut >= 1
        await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 1, None)])
        found = await asyncio.wait_for(task, 5)
    assert isinstance(found.step, Add)


async def test_a_failed_read_is_said_once_and_the_next_tick_reads_again(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="activities.demand")
    dep = await add_deployment(db, "m-outage", replicas=0)
    failed = "cannot read the gateways' usage rows"
    async with running_feed(usage, database_url, interval_s=FAST_TICK_S) as feed:
        task = watch(feed, on_demand_view(dep))
        await until(lambda: len(usage.calls) >= 1, "the watch's first read")
        # Every read fails while the table is away (an error of the store, not a bug).
        await db.execute("ALTER TABLE deployment_usage RENAME TO deployment_usage_away")
        await until(lambda: sum(failed in r.message for r in caplog.records) >= 1,
                    "a failed read")
        failures_before = feed.reads
        await until(lambda: sum("cannot read" in r.message and r.levelno == logging.DEBUG
                                for r in caplog.records) >= 3, "three more failed ticks")
        assert feed.reads == failures_before, "a failed read is not a read"
        await db.execute("ALTER TABLE deployment_usage_away RENAME TO deployment_usage")
        await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 1, None)])
        found = await asyncio.wait_for(task, 5)
    assert isinstance(found.step, Add)
    warnings = [r for r in caplog.records
                if failed in r.message and r.levelno == logging.WARNING]
    assert len(warnings) == 1, "once per outage, not once a tick"
    assert any("reading the gateways' usage rows again" in r.message for r in caplog.records)


@pytest.mark.parametrize("carried_by", ["heartbeat", "input"])
async def test_a_rules_period_goes_on_across_a_retry_and_from_one_watch_to_the_next(
        db: asyncpg.Connection, usage: CountingUsage, gateway: RoutingStore,
        database_url: str, carried_by: str) -> None:
    """Busy for 2 minutes already (a minute is the rule's period): a retried attempt
    (from its heartbeat) or the next watch (from its input) adds at the first sample,
    where one starting the period again would wait a minute."""
    dep = await add_deployment(db, f"m-busy-{carried_by}", replicas=1)
    await add_replica(db, dep, "r-a", ENDPOINT)
    await gateway.write_usage("gw-1", [ReplicaUsage("r-a", 1, None)],
                              [DeploymentUsage(dep, 2, None)])
    now = await db.fetchval("SELECT now()")
    busy = Pressure(busy_since=now - timedelta(minutes=2))
    view = DemandView(
        deployment_id=DeploymentId(dep), desired=1,
        policy=ScalingPolicy(min_replicas=1, max_replicas=2, scale_up_after_s=60),
        replicas=[ReplicaStanding(replica_id=ReplicaId("r-a"), standing=Standing.READY,
                                  ready_at=now)])
    env = ActivityEnvironment()
    beats: list[object] = []
    env.on_heartbeat = lambda *details: beats.append(details[0])
    request = WatchDemandInput(view=view)
    if carried_by == "heartbeat":
        env.info = dataclasses.replace(env.info, attempt=2,
                                       heartbeat_details=[busy.model_dump(mode="json")])
    else:
        request = WatchDemandInput(view=view, pressure=busy)
    async with running_feed(usage, database_url, interval_s=SLOW_TICK_S) as feed:
        found = await asyncio.wait_for(
            env.run(DemandActivities(feed).watch_demand, request), 5)
    assert isinstance(found.step, Add) and "2 waiting on 1 ready for 2 min" in found.step.reason
    assert found.pressure == Pressure(), "the next addition needs a period of its own"
    assert beats[0] == busy.model_dump(mode="json"), "it heartbeats what it remembers"


# -- through Temporal ---------------------------------------------------------------------------


@workflow.defn(sandboxed=False)  # test-only
class WatchDemandOnce:
    """Calls watch_demand by its stub on the room-watch queue, as the keeper will."""

    @workflow.run
    async def run(self, request: WatchDemandInput) -> DemandFound:
        return await workflow.execute_activity(
            stubs.watch_demand, request, task_queue=ROOM_WATCH_TASK_QUEUE,
            start_to_close_timeout=timedelta(minutes=1),
            heartbeat_timeout=timedelta(seconds=10))


@pytest.mark.slow
async def test_the_control_worker_runs_the_watch_on_the_room_watch_queue(
        local_temporal_env: WorkflowEnvironment, db: asyncpg.Connection,
        gateway: RoutingStore, database_url: str) -> None:
    dep = await add_deployment(db, "m-worker", replicas=0)

    async def hold_four_requests() -> None:
        """A gateway worker holding 4 requests writes its row every flush interval, so
        that it stays fresh however long the worker takes to start."""
        while True:
            await gateway.write_usage("gw-1", [], [DeploymentUsage(dep, 4, None)])
            await asyncio.sleep(FLUSH_S)

    gateway_ticks = asyncio.create_task(hold_four_requests())
    client = local_temporal_env.client
    settings = Settings(database_url=database_url,
                        temporal_address=client.service_client.config.target_host,
                        temporal_namespace=client.namespace, api_auth=False)
    stop = asyncio.Event()
    worker_task = asyncio.create_task(run_worker(settings, stop))
    test_queue = f"test-{uuid.uuid4()}"
    try:
        async with Worker(client, task_queue=test_queue, workflows=[WatchDemandOnce]):
            found = await asyncio.wait_for(client.execute_workflow(
                WatchDemandOnce.run, WatchDemandInput(view=on_demand_view(dep)),
                id=f"watch-{uuid.uuid4()}", task_queue=test_queue), 30)
    finally:
        gateway_ticks.cancel()
        stop.set()
        await asyncio.wait_for(worker_task, 30)
    # The step came back whole through the pydantic converter (a discriminated union).
    assert found.step == Add(reason="loading: 4 request(s) waiting")
    assert found.sample.waiting == 4 and found.view == on_demand_view(dep)
