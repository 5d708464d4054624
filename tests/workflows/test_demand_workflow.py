"""DeploymentWorkflow following demand on the time-skipping server, every activity faked:
the usage watch's steps carried out (load, sleep, wake, idle stop), what each step costs
in history events, and that an idle or sleeping deployment adds none while its watches
heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelkeeper.domain.demand import (
    Add,
    DemandFound,
    DemandSample,
    DemandView,
    Retire,
    ScalingPolicy,
    Sleep,
    Standing,
    Wake,
    WatchDemandInput,
)
from modelkeeper.domain.ids import DeploymentId, ModelId
from modelkeeper.domain.keeper import DeploymentSpec
from modelkeeper.domain.shards import SleepShardInput, WakeShardInput
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.store_activities import (
    RegrowClaimsInput,
    RegrowClaimsResult,
    ShrinkClaimsInput,
)
from modelkeeper.names import CONTROL_TASK_QUEUE, ROOM_WATCH_TASK_QUEUE, node_task_queue
from tests.workflows.test_deployment_workflow import (
    NODE,
    FakeCluster,
    Running,
    _open_timers,
    _quiet_history,
    _tunables,
    record_history,
)
from workflows.deployment import DeploymentInput, DeploymentWorkflow

pytestmark = pytest.mark.timeout(90)

Stepper = Callable[[DemandView], Add | Retire | Sleep | Wake]


@dataclass
class DemandFakes:
    """The demand activities, faked: the test hands the usage watch its next step."""

    steps: asyncio.Queue[Stepper] = field(default_factory=asyncio.Queue)
    watches: list[DemandView] = field(default_factory=list)
    slept: list[str] = field(default_factory=list)
    woken: list[str] = field(default_factory=list)
    shrunk: list[str] = field(default_factory=list)
    regrown: list[str] = field(default_factory=list)

    def control(self) -> list[object]:
        @activity.defn(name="shrink_claims")
        async def shrink_claims(req: ShrinkClaimsInput) -> None:
            self.shrunk.append(req.replica_id)

        @activity.defn(name="regrow_claims")
        async def regrow_claims(req: RegrowClaimsInput) -> RegrowClaimsResult:
            self.regrown.append(req.replica_id)
            return RegrowClaimsResult(ok=True)

        return [shrink_claims, regrow_claims]

    def node(self) -> list[object]:
        @activity.defn(name="sleep_shard")
        async def sleep_shard(req: SleepShardInput) -> None:
            self.slept.append(req.replica_id)

        @activity.defn(name="wake_shard")
        async def wake_shard(req: WakeShardInput) -> None:
            self.woken.append(req.replica_id)

        return [sleep_shard, wake_shard]

    def watch(self) -> object:
        @activity.defn(name="watch_demand")
        async def watch_demand(req: WatchDemandInput) -> DemandFound:
            # As the real one (activities/demand.py): heartbeats while it waits, and
            # returns the first step due on the view it was given.
            self.watches.append(req.view)
            while True:
                activity.heartbeat()
                try:
                    make = await asyncio.wait_for(self.steps.get(), 0.2)
                except TimeoutError:
                    continue
                return DemandFound(view=req.view, step=make(req.view),
                                   sample=DemandSample(at=datetime.now(UTC)))

        return watch_demand


def _ready(view: DemandView) -> str:
    return next(r.replica_id for r in view.replicas if r.standing is Standing.READY)


def _asleep(view: DemandView) -> str:
    return next(r.replica_id for r in view.replicas if r.standing is Standing.SLEEPING)


@contextlib.asynccontextmanager
async def _on_demand(env: WorkflowEnvironment, cluster: FakeCluster, fakes: DemandFakes,
                     policy: ScalingPolicy) -> AsyncIterator[Running]:
    control, node = cluster.activities()
    spec = DeploymentSpec(deployment_id=DeploymentId("d1"), model_id=ModelId("m"),
                          replicas=policy.min_replicas, scaling=policy)
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE,
                      workflows=[DeploymentWorkflow], activities=[*control, *fakes.control()]), \
            Worker(env.client, task_queue=node_task_queue(NODE),
                   activities=[*node, *fakes.node()],
                   # A cancelled engine watch hears of it at its next heartbeat: sent at
                   # once, its ActivityTaskCanceled lands before the history goes quiet.
                   max_heartbeat_throttle_interval=timedelta(seconds=0.1)), \
            Worker(env.client, task_queue=ROOM_WATCH_TASK_QUEUE,
                   activities=[cluster.room_watch(), fakes.watch()],
                   max_heartbeat_throttle_interval=timedelta(seconds=0.1)):
        handle = await env.client.start_workflow(
            DeploymentWorkflow.run,
            DeploymentInput(spec=spec, tunables=_tunables(watch_heartbeat_timeout_s=2.0),
                            search_attributes=False),
            id=f"deployment/{uuid.uuid4()}", task_queue=CONTROL_TASK_QUEUE)
        yield Running(env, cluster, handle)


async def _settled(run: Running, status: DeploymentStatus) -> WorkflowHistory:
    """Once the keeper shows ``status`` and the store has been told, the quiet history."""
    await run.until(status)
    while not (run.cluster.statuses and run.cluster.statuses[-1].status is status):
        await asyncio.sleep(0.05)
    return await _quiet_history(run.handle)


async def _adds_nothing_while_watches_beat(run: Running, before: WorkflowHistory) -> None:
    """0 events an hour, shown in its two parts (see the serving deployment's test in
    test_deployment_workflow.py): no timer is open, so only an activity's result, a
    signal or an update can add an event, none of which time brings; and over seconds in
    which the watches' heartbeats reach the server, no event is added."""
    assert _open_timers(before) == set()
    await asyncio.sleep(3)
    after = await run.handle.fetch_history()
    added = [EventType.Name(e.event_type) for e in after.events[len(before.events):]]
    assert added == []


#: Most history events one scaling step costs, from the watch's answer to the store told
#: and the next watch open. Measured here over two runs: load 46, sleep 51-57, wake 45-48,
#: stop 53 (each: the step's activities, the store writes of every phase it passes, the
#: audit event, and the usage watch closed while a replica is on its way in and opened
#: again on the view it lands on). The runs differ by a workflow task or two (this
#: server adds one when a heartbeat lands during another): the bound leaves room.
EVENTS_PER_STEP = 70


async def test_an_on_demand_deployment_loads_sleeps_wakes_and_stops_at_a_bounded_cost(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    cluster, fakes = FakeCluster(), DemandFakes()
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, idle_timeout_s=600,
                           sleep_after_s=60)
    async with _on_demand(time_skipping_env, cluster, fakes, policy) as run:
        idle = await _settled(run, DeploymentStatus.IDLE)
        assert cluster.placements == []  # on demand: nothing loads until asked
        await _adds_nothing_while_watches_beat(run, idle)
        costs: dict[str, int] = {}

        # Asked for: one load, one replica serving.
        await fakes.steps.put(lambda v: Add(reason="loading: 2 request(s) waiting"))
        serving = await _settled(run, DeploymentStatus.SERVING)
        costs["load"] = len(serving.events) - len(idle.events)
        assert cluster.placements == ["d1-r1"] and cluster.started == ["d1-r1"]

        # Unused: asleep (drained first, engine asleep, claims shrunk), counted, no load.
        await fakes.steps.put(lambda v: Sleep(replica_id=_ready(v), reason="unused 60 s"))
        sleeping = await _settled(run, DeploymentStatus.SLEEPING)
        costs["sleep"] = len(sleeping.events) - len(serving.events)
        assert fakes.slept == ["d1-r1"] and fakes.shrunk == ["d1-r1"]
        assert cluster.drained == ["d1-r1"]
        # The store says draining while it falls asleep, and sleeping once it sleeps.
        states = [s for r, s in cluster.replica_states if r == "d1-r1"]
        assert states[-2:] == ["draining", "sleeping"]
        await _adds_nothing_while_watches_beat(run, sleeping)

        # Asked again: woken (claims grown back first), not loaded.
        await fakes.steps.put(lambda v: Wake(replica_id=_asleep(v), reason="1 waiting"))
        woken = await _settled(run, DeploymentStatus.SERVING)
        costs["wake"] = len(woken.events) - len(sleeping.events)
        assert fakes.regrown == ["d1-r1"] and fakes.woken == ["d1-r1"]
        assert cluster.placements == ["d1-r1"]

        # Idle for its timeout: stopped, drained first; idle again, and quiet.
        await fakes.steps.put(lambda v: Retire(replica_id=_ready(v), reason="idle 10 min"))
        stopped = await _settled(run, DeploymentStatus.IDLE)
        costs["stop"] = len(stopped.events) - len(woken.events)
        assert cluster.stopped == ["d1-r1"] and cluster.released == ["d1-r1"]
        await _adds_nothing_while_watches_beat(run, stopped)

        assert all(cost <= EVENTS_PER_STEP for cost in costs.values()), costs
        notes = [e.message for e in cluster.events if e.kind == "deployment.demand"]
        assert len(notes) == 4 and "loading: 2 request(s) waiting" in notes[0]
        await run.handle.signal(DeploymentWorkflow.delete)
        await asyncio.wait_for(run.handle.result(), 30)
        await record_history(run.handle, "demand_load_sleep_wake_stop")
