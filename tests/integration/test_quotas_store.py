"""Quotas and holdings on a real PostgreSQL (migration 0021, modelkeeper.store.quotas):

* a quota is set whole (a part left out is no longer guaranteed or limited), read, listed
  parent first, and removed;
* the scope column refuses what no owner could be;
* ``holdings()`` sums each owner's claims (memory, one GPU per claimed index, cores) over
  its replicas and their shards, leaves out deployments with no owner, and leaves out the
  one deployment a caller replaces;
* a token bound to a scope keeps it.
"""

from __future__ import annotations

import asyncpg
import pytest

from modelkeeper.domain.capacity import Holding, Limit, Quota, Resources, held_by
from modelkeeper.domain.catalog import CatalogModel, DeploymentRequest
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId
from modelkeeper.domain.nodes import AgentRegistration, Inventory
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.domain.shards import EngineKind
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30



async def _deployment(store: Store, deployment_id: str, owner: str | None) -> None:
    model = CatalogModel(model_id=ModelId(f"m-{deployment_id}"), engine=EngineKind.SIM,
                         source="sim", memory_bytes=GIB)
    await store.catalog.create_model(model)
    await store.deployments.create_deployment(
        DeploymentId(deployment_id),
        DeploymentRequest(model_id=model.model_id, replicas=1, owner=owner),
        f"deployment/{deployment_id}")


async def _replica(db: asyncpg.Connection, deployment_id: str, replica_id: str,
                   shards: list[tuple[str, int, float, list[int]]]) -> None:
    """A replica with a claim on each node of ``shards`` (node, bytes, cores, GPUs)."""
    await db.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                     "VALUES ($1, $2, 'ready')", replica_id, deployment_id)
    for rank, (node, memory, cores, gpus) in enumerate(shards):
        await db.execute(
            "INSERT INTO allocations (replica_id, node_id, rank, memory_bytes, cpu_cores, "
            "gpu_indices) VALUES ($1, $2, $3, $4, $5, $6)",
            replica_id, node, rank, memory, cores, gpus)


async def test_a_quota_is_set_whole_listed_and_removed(store: Store) -> None:
    team = Quota(scope="acme/a", guarantee=Resources(memory_bytes=16 * GIB, gpus=2),
                 limit=Limit(memory_bytes=24 * GIB, cpu_cores=8))
    assert await store.quotas.set_quota(team) == team
    org = Quota(scope="acme", limit=Limit(gpus=8))
    await store.quotas.set_quota(org)
    assert await store.quotas.list_quotas() == [org, team]
    # Set again, whole: the guarantee left out is 0, the limit left out is unlimited.
    narrowed = Quota(scope="acme/a", limit=Limit(gpus=1))
    assert await store.quotas.set_quota(narrowed) == narrowed
    assert await store.quotas.get_quota("acme/a") == narrowed
    assert await store.quotas.delete_quota("acme/a") is True
    assert await store.quotas.delete_quota("acme/a") is False
    assert await store.quotas.get_quota("acme/a") is None
    assert await store.quotas.list_quotas() == [org]


async def test_the_scope_column_refuses_what_no_owner_could_be(db: asyncpg.Connection,
                                                               store: Store) -> None:
    for bad in ("Acme", "acme/", "a/b/c/d", "-acme"):
        with pytest.raises(asyncpg.CheckViolationError):
            await db.execute("INSERT INTO quotas (scope) VALUES ($1)", bad)
    with pytest.raises(asyncpg.CheckViolationError):
        await db.execute("INSERT INTO quotas (scope, limit_gpus) VALUES ('acme', -1)")


async def test_holdings_sum_each_owners_claims(db: asyncpg.Connection, store: Store) -> None:
    for node in ("n1", "n2"):
        await store.nodes.register_node(AgentRegistration(
            node_id=NodeId(node), name=node,
            inventory=Inventory(memory_total_bytes=64 * GIB,
                                memory_available_bytes=64 * GIB, cpu_count=16)))
    await _deployment(store, "d-a", "acme/a")
    await _deployment(store, "d-a2", "acme/a")
    await _deployment(store, "d-b", "acme/b/x")
    await _deployment(store, "d-none", None)
    # d-a: one replica over two nodes (two shards), one GPU each; and a second replica.
    await _replica(db, "d-a", "d-a-r1", [("n1", 4 * GIB, 2.0, [0]), ("n2", 4 * GIB, 2.0, [1])])
    await _replica(db, "d-a", "d-a-r2", [("n1", 8 * GIB, 0.5, [])])
    await _replica(db, "d-a2", "d-a2-r1", [("n2", 1 * GIB, 0.0, [2, 3])])
    await _replica(db, "d-b", "d-b-r1", [("n1", 2 * GIB, 1.0, [])])
    await _replica(db, "d-none", "d-none-r1", [("n2", 30 * GIB, 4.0, [4])])

    holdings = await store.quotas.holdings()
    assert holdings == [
        Holding(owner="acme/a",
                resources=Resources(memory_bytes=17 * GIB, gpus=4, cpu_cores=4.5)),
        Holding(owner="acme/b/x",
                resources=Resources(memory_bytes=2 * GIB, gpus=0, cpu_cores=1.0)),
    ]
    assert held_by("acme", holdings) == Resources(memory_bytes=19 * GIB, gpus=4,
                                                  cpu_cores=5.5)
    # The deployment a scale or a new owner replaces is left out.
    without = await store.quotas.holdings(excluding="d-a")
    assert without[0] == Holding(owner="acme/a",
                                 resources=Resources(memory_bytes=GIB, gpus=2, cpu_cores=0))
    # A replica gone takes its claims with it.
    await db.execute("DELETE FROM replicas WHERE deployment_id = 'd-a'")
    assert await store.quotas.holdings() == [*without]


async def test_a_token_keeps_its_scope(store: Store) -> None:
    bound, token = await store.tokens.create_token("team-a", OperatorRole.ADMIN,
                                                   scope="acme/a")
    unbound, _ = await store.tokens.create_token("root", OperatorRole.ADMIN)
    assert (bound.scope, unbound.scope) == ("acme/a", None)
    found = await store.tokens.authenticate(token)
    assert found is not None and found.scope == "acme/a"
    assert [t.scope for t in await store.tokens.list_tokens()] == ["acme/a", None]
