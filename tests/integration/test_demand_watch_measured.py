"""The measured concurrency reaches the scaling rules through the usage watch: a
measurement stored for the model (what bench's PUT stores) is read with the gateways'
rows by the real :class:`DemandFeed`, and ``watch_demand`` returns the measured rule's
Add for a load that issue 21's rules would leave alone (nothing waits)."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg
import pytest

from modelkeeper.domain.demand import (
    Add,
    DemandView,
    Pressure,
    ReplicaStanding,
    ScalingPolicy,
    Standing,
    step,
)
from modelkeeper.domain.ids import DeploymentId, ModelId, ReplicaId
from modelkeeper.domain.measured import CapacityReport, Objective, measured_of
from modelkeeper.domain.shards import EngineKind
from modelkeeper.store import Store
from modelkeeper.store.routing import ReplicaUsage, RoutingStore
from tests.integration.test_demand_watch import (
    ENDPOINT,
    FAST_TICK_S,
    running_feed,
    watch,
)
from tests.support.gateway_support import add_deployment, add_replica

pytestmark = pytest.mark.timeout(60)

MODEL = "m-measured"



async def test_the_watch_adds_a_replica_beyond_the_measured_concurrency(
        db: asyncpg.Connection, store: Store, database_url: str) -> None:
    dep = DeploymentId(await add_deployment(db, MODEL, replicas=1))
    await add_replica(db, dep, "r-1", ENDPOINT)
    await store.measured.put_measured(measured_of(
        CapacityReport(concurrency=2, tokens_per_s=40.0, mean_request_s=1.0, ttft_p95_s=0.2,
                       objective=Objective(), replicas=1, max_tokens=16),
        model_id=ModelId(MODEL), engine=EngineKind.SIM, gpus=None, cpu_cores=None,
        at=datetime.now(UTC)))
    routing = await RoutingStore.connect(database_url, migrate=False)
    try:
        # Three in flight on the one ready replica, nothing waiting at the gateway.
        await routing.write_usage("gw-1", [ReplicaUsage("r-1", 3, None)], [])
    finally:
        await routing.close()
    view = DemandView(
        deployment_id=dep, desired=1,
        policy=ScalingPolicy(min_replicas=1, max_replicas=2, scale_up_after_s=0),
        replicas=[ReplicaStanding(replica_id=ReplicaId("r-1"), standing=Standing.READY,
                                  ready_at=datetime.now(UTC))])
    async with running_feed(store.usage, database_url, interval_s=FAST_TICK_S) as feed:
        found = await watch(feed, view)
    assert found.sample.measured_concurrency == 2
    assert isinstance(found.step, Add)
    assert found.step.reason.startswith("3 request(s) on 1 ready"), found.step.reason
    # Unmeasured, issue 21's rule reads waiting requests: none wait, nothing is due.
    unmeasured = found.sample.model_copy(update={"measured_concurrency": None})
    assert step(view, unmeasured, Pressure(), now=unmeasured.at)[1] is None
