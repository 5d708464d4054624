"""Node identity as issue 19's fuzzer found it, each finding tried again:

* **Finding 5, the unconfirmed window.** A second registration with no credential, between
  a node's join and its first authenticated call, was given a new credential and the node
  key, and the real node was then refused. Now a credential, once issued, is required.
* **Finding 6, node keys that never changed.** A node key depended on the node id alone,
  so `nodes rm` and a new join handed out the same key. Now each join draws a key epoch;
  an agent restart keeps it, and the gateway derives each engine's key from the epoch
  recorded with its endpoint.
* **Finding 10, duplicate names.** A second node with the real node's name (and an id that
  sorted first) captured `modelkeeper cordon NAME`. Now ids and names each name one node
  (409 otherwise), and a name two older rows share is an error listing both.
* **Low: ids unvalidated** (a newline, U+202E, ``node/../x``, whitespace): refused, 422.
* **Low: registrations unlimited**: a token bucket per peer address, 429 with Retry-After.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from temporalio.testing import WorkflowEnvironment

from agent.engines.sim_server import API_KEY_ENV as SIM_KEY_ENV
from api import agents
from api.nodes import resolve_node_ids
from cli.operator_cli import OPERATOR_COMMANDS, Request, UsageError
from modelkeeper.domain.catalog import ReplicaStateUpdate
from modelkeeper.domain.engine_keys import (
    derive_engine_key,
    derive_node_key,
    replica_engine_key,
    verify_engine_key,
)
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.nodes import (
    NODE_CREDENTIAL_HEADER,
    NODE_ID_PATTERN,
    PortRange,
    RegistrationLimit,
    TokenBucket,
    take_registration,
)
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.text import printable
from modelkeeper.infra.processes import ManagedProcess, free_port
from tests.security.test_nodes_and_keys import (
    CLUSTER_SECRET,
    GIB,
    JOIN_TOKEN,
    bearer,
    beat,
    node_api,
    node_row,
    registration,
)
from tests.support.gateway_support import (
    HOST,
    SECRET,
    Sim,
    add_deployment,
    running_gateway,
    until,
)

pytestmark = pytest.mark.timeout(120)



# -- finding 5: a credential, once issued, is required ---------------------------------


async def test_a_second_registration_cannot_take_over_a_node_before_its_first_call(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url) as api:
        real = await api.join("n-victim")  # its first heartbeat is still on its way
        before = await node_row(db, "n-victim")
        events = len(await api.store.events.list_events())
        # The fuzzer's attempt: the join token alone (every node has it), no credential.
        taken = await api.http.post("/nodes/register", json=registration("n-victim"),
                                    headers=bearer(JOIN_TOKEN))
        assert taken.status_code == 403, taken.text
        detail = taken.json()["detail"]
        assert "none was presented" in detail
        assert "modelkeeper nodes rm n-victim" in detail  # what the operator does
        assert await node_row(db, "n-victim") == before  # nothing written
        assert len(await api.store.events.list_events()) == events
        # The real node is not locked out: its credential and key are still its own.
        ok = await api.http.post("/nodes/n-victim/heartbeat", json=beat(GIB),
                                 headers=bearer(real["node_credential"]))
        assert ok.status_code == 200, ok.text
        again = await api.http.post("/nodes/register", json=registration("n-victim"),
                                    headers={NODE_CREDENTIAL_HEADER: real["node_credential"]})
        assert again.status_code == 200 and again.json()["node_key"] == real["node_key"]
        # An agent whose first answer was lost is refused the same way; the operator's
        # remedy lets it join again, as a new node with a new credential.
        assert (await api.http.delete("/nodes/n-victim")).status_code == 200
        back = await api.join("n-victim")
        assert back["node_credential"] != real["node_credential"]


# -- finding 6: a new join, a new node key ----------------------------------------------


async def test_rm_and_rejoin_changes_the_node_key_and_a_restart_keeps_it(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url) as api:
        first = await api.join("n-stolen")
        row = await node_row(db, "n-stolen")
        assert row is not None and row["key_epoch"]
        # An agent restart re-registers with its credential: same epoch, same key.
        restart = await api.http.post(
            "/nodes/register", json=registration("n-stolen"),
            headers={**bearer(JOIN_TOKEN), NODE_CREDENTIAL_HEADER: first["node_credential"]})
        assert restart.status_code == 200, restart.text
        assert restart.json()["node_key"] == first["node_key"]
        assert (await node_row(db, "n-stolen") or {})["key_epoch"] == row["key_epoch"]
        # The remedy for a stolen credential: remove the node, join again.
        assert (await api.http.delete("/nodes/n-stolen")).status_code == 200
        second = await api.join("n-stolen")
        assert second["node_key"] != first["node_key"]
        new_row = await node_row(db, "n-stolen")
        assert new_row is not None and new_row["key_epoch"] != row["key_epoch"]
        assert second["node_key"] == derive_node_key(CLUSTER_SECRET.encode(),
                                                     "n-stolen", key_epoch=new_row["key_epoch"])
        # What the thief kept (the old node key, and any engine key made from it) opens
        # none of the new node's engines.
        for replica in ("r-1", "d-x-r2"):
            old_engine_key = derive_engine_key(first["node_key"].encode(), replica)
            assert not verify_engine_key(second["node_key"].encode(), replica, old_engine_key)


def test_node_keys_by_epoch() -> None:
    secret = b"s"
    legacy = derive_node_key(secret, "n-1")
    assert derive_node_key(secret, "n-1", key_epoch=None) == legacy
    a, b = (derive_node_key(secret, "n-1", key_epoch=e) for e in ("e1", "e2"))
    assert len({legacy, a, b}) == 3
    assert replica_engine_key(secret, node_id="n-1", replica_id="r", key_epoch="e1") == \
        derive_engine_key(a.encode(), "r")
    # The separator cannot be forged into the id: ids and epochs hold no NUL.
    with pytest.raises(ValueError, match="NUL"):
        derive_node_key(secret, "n-1", key_epoch="e\x00x")
    with pytest.raises(ValueError, match="NUL"):
        derive_node_key(secret, "n-1", key_epoch="")


def _start_sim(tmp_path: Path, name: str, port: int, key: str) -> Sim:
    proc = ManagedProcess(
        f"sim-{name}", [sys.executable, "-m", "agent.engines.sim_server", "--host", HOST,
                        "--port", str(port), "--model", "epoch"],
        tmp_path / f"{name}.log",
        env={**os.environ, SIM_KEY_ENV: key, "MODELKEEPER_DATA_DIR": str(tmp_path)})
    proc.start()
    return Sim(proc, name, port)


async def test_the_gateway_routes_by_the_epoch_recorded_with_the_endpoint(
        local_temporal_env: WorkflowEnvironment, database_url: str, tmp_path: Path,
        db: asyncpg.Connection) -> None:
    port = free_port()
    reg = registration("n-gw", engine_ports=PortRange(low=port, high=port))
    body = {"model": "epoch", "messages": [{"role": "user", "content": "hi"}]}
    async with node_api(local_temporal_env, database_url,
                        engine_key_secret=SECRET.decode()) as api:
        joined = await api.http.post("/nodes/register", json=reg, headers=bearer(JOIN_TOKEN))
        assert joined.status_code == 200, joined.text
        welcome = joined.json()
        # The agent starts the engine with the key it derives from its node key.
        sim = _start_sim(tmp_path, "r-gw", port,
                         derive_engine_key(welcome["node_key"].encode(), "r-gw"))
        try:
            await sim.wait_healthy()
            deployment = await add_deployment(db, "epoch")
            await db.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                             "VALUES ('r-gw', $1, 'starting')", deployment)
            await db.execute("INSERT INTO allocations (replica_id, node_id, rank, "
                             "memory_bytes) VALUES ('r-gw', 'n-gw', 0, 1)")
            assert await api.store.deployments.record_replica_state(ReplicaStateUpdate(
                replica_id=ReplicaId("r-gw"), state=ReplicaState.READY,
                endpoint=sim.url)) is None
            epoch = await db.fetchval("SELECT endpoint_node_epoch FROM replicas")
            assert epoch == (await node_row(db, "n-gw") or {})["key_epoch"]
            # The agent restarts: it registers again with its credential.
            restarted = await api.http.post(
                "/nodes/register", json=reg,
                headers={NODE_CREDENTIAL_HEADER: welcome["node_credential"]})
            assert restarted.json()["node_key"] == welcome["node_key"]
            async with running_gateway(database_url) as server, httpx.AsyncClient(
                    base_url=server.url, timeout=30) as http:
                await until(lambda: "epoch" in server.gateway.table.models, what="route")
                resp = await http.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
            # The engine refuses a key of another epoch of the same node.
            other = derive_engine_key(
                derive_node_key(SECRET, "n-gw", key_epoch="another").encode(), "r-gw")
            async with httpx.AsyncClient(timeout=30) as http:
                refused = await http.post(sim.url + "/v1/chat/completions", json=body,
                                          headers=bearer(other))
                assert refused.status_code == 401
        finally:
            sim.stop()


# -- finding 10: an id or name names one node -------------------------------------------


async def test_a_taken_name_is_refused_naming_its_holder(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url) as api:
        real = await api.http.post("/nodes/register", json=registration("n-zz", name="vm"),
                                   headers=bearer(JOIN_TOKEN))
        assert real.status_code == 200
        # The fuzzer's impostor: the real node's name, an id that sorts first.
        for node_id, name, field in (("n-aa", "vm", "name"), ("vm", "other", "node_id"),
                                     ("n-ab", "n-zz", "name")):
            resp = await api.http.post("/nodes/register",
                                       json=registration(node_id, name=name),
                                       headers=bearer(JOIN_TOKEN))
            assert resp.status_code == 409, resp.text
            detail = resp.json()["detail"]
            assert f"{field} = " in detail and "'n-zz'" in detail, detail
            assert "modelkeeper nodes rm n-zz" in detail
            assert await node_row(db, node_id) is None
        # The holder itself re-registers under its name; once it is removed, the name is
        # free for a node that joins again.
        again = await api.http.post(
            "/nodes/register", json=registration("n-zz", name="vm"),
            headers={NODE_CREDENTIAL_HEADER: real.json()["node_credential"]})
        assert again.status_code == 200, again.text
        assert (await api.http.delete("/nodes/n-zz")).status_code == 200
        assert (await api.http.post("/nodes/register", json=registration("n-aa", name="vm"),
                                    headers=bearer(JOIN_TOKEN))).status_code == 200
        # Names two rows share from before the rule: the API refuses to guess.
        # (Written directly: the API refuses it.)
        await db.execute(
            "INSERT INTO nodes (node_id, name, agent_labels) VALUES ('n-00', 'vm', '{}')")
        with pytest.raises(RequestValidationError, match=r"n-00, n-aa|n-aa, n-00"):
            await resolve_node_ids(api.store, ["vm"], loc=("body", "node_ids"))
        # ... nor does either register under it until one is removed.
        clash = await api.http.post("/nodes/register", json=registration("n-00", name="vm"),
                                    headers=bearer(JOIN_TOKEN))
        assert clash.status_code == 409


def _parse(*argv: str) -> Any:
    from cli.main import build_parser

    return build_parser().parse_args(list(argv))


def test_the_cli_refuses_a_name_two_nodes_share() -> None:
    nodes = [{"node_id": "n-zz", "name": "vm"}, {"node_id": "n-aa", "name": "vm"},
             {"node_id": "n-1", "name": "small"}]
    for argv in (("cordon", "vm"), ("drain", "vm"), ("nodes", "rm", "vm")):
        lookup = OPERATOR_COMMANDS[argv[0]].request(_parse(*argv))
        assert lookup.then is not None
        with pytest.raises(UsageError, match=r"2 nodes have that name \(n-aa, n-zz\); "
                                             r"give the id"):
            lookup.then(nodes)
    # An id still names its node; a unique name too.
    cordon = OPERATOR_COMMANDS["cordon"].request(_parse("cordon", "n-aa"))
    assert cordon.then is not None and cordon.then(nodes).path == "/nodes/n-aa"
    rm = OPERATOR_COMMANDS["nodes"].request(_parse("nodes", "rm", "small"))
    assert rm.then is not None and rm.then(nodes) == Request("DELETE", "/nodes/n-1")


# -- low: node ids are validated -------------------------------------------------------


#: What the fuzzer registered: a newline, a right-to-left override, a path (never
#: removable: DELETE /nodes/node/../x is another path), whitespace; and their kin.
BAD_IDS = ["n-1\n", "n-\u202e1", "node/../x", "   ", "", "a b", "-n", "n" * 129, "n\x00"]


async def test_a_malformed_node_id_is_refused(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url) as api:
        for node_id in BAD_IDS:
            body = {**registration("n-ok"), "node_id": node_id}
            resp = await api.http.post("/nodes/register", json=body,
                                       headers=bearer(JOIN_TOKEN))
            assert resp.status_code == 422, (node_id, resp.text)
            [error] = resp.json()["detail"]
            assert error["loc"] == ["body", "node_id"]
            if "\x00" in node_id:
                # Refused at the edge, before the id's own rule: a NUL can reach no table,
                # and the answer echoes it escaped (modelkeeper.domain.text.printable).
                assert error["input"] == printable(node_id)
                assert "NUL" in error["msg"], error
            else:
                assert error["input"] == node_id
                assert NODE_ID_PATTERN in error["msg"]
        assert await db.fetchval("SELECT count(*) FROM nodes") == 0


async def test_an_inventory_listing_a_gpu_twice_is_refused_and_placement_reads_on(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    # The live fuzz registered such a node: stored, it broke every read of the nodes as
    # placement sees them, and GET /placement/explain answered 500 from then on.
    gpu = {"index": 3, "name": "g", "memory_bytes": GIB, "healthy": True}
    body = registration("n-gpus")
    body["inventory"]["gpus"] = [gpu, {**gpu, "memory_bytes": 2 * GIB}]
    async with node_api(local_temporal_env, database_url) as api:
        resp = await api.http.post("/nodes/register", json=body, headers=bearer(JOIN_TOKEN))
        assert resp.status_code == 422, resp.text
        [error] = resp.json()["detail"]
        assert error["loc"][:3] == ["body", "inventory", "gpus"], error
        assert "index 3 is listed twice" in error["msg"], error
        assert await db.fetchval("SELECT count(*) FROM nodes") == 0
        body["inventory"]["gpus"] = [gpu]
        resp = await api.http.post("/nodes/register", json=body, headers=bearer(JOIN_TOKEN))
        assert resp.status_code == 200, resp.text


# -- low: registrations are rate-limited per peer ---------------------------------------


def test_the_registration_bucket() -> None:
    limit = RegistrationLimit(per_s=2.0, burst=3)
    bucket: TokenBucket | None = None
    for _ in range(3):
        bucket, wait = take_registration(bucket, 100.0, limit)
        assert wait is None
    bucket, wait = take_registration(bucket, 100.0, limit)
    assert wait == pytest.approx(0.5)
    bucket, wait = take_registration(bucket, 100.25, limit)  # half a token: not yet
    assert wait == pytest.approx(0.25)
    bucket, wait = take_registration(bucket, 100.5, limit)
    assert wait is None
    # Never more than the burst, however long the peer was away.
    bucket, _ = take_registration(bucket, 10_000.0, limit)
    assert bucket.tokens == pytest.approx(2.0)


async def test_a_peer_that_registers_too_often_gets_429(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url, registration_burst=3,
                        registration_per_s=0.01) as api:
        for i in range(3):
            await api.join(f"n-{i}")
        flood = await api.http.post("/nodes/register", json=registration("n-3"),
                                    headers=bearer(JOIN_TOKEN))
        assert flood.status_code == 429, flood.text
        assert flood.headers["retry-after"] == "100"
        assert "3 at once, then 0.01 a second" in flood.json()["detail"]
        assert await node_row(db, "n-3") is None
        # Another address has its own bucket.
        async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api.app, client=("127.0.0.2", 1)),
                base_url="http://localhost") as other:
            resp = await other.post("/nodes/register", json=registration("n-3"),
                                    headers=bearer(JOIN_TOKEN))
            assert resp.status_code == 200, resp.text


def test_the_api_forgets_full_buckets_first_and_stays_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agents, "MAX_TRACKED_PEERS", 3)
    buckets = agents.RegistrationBuckets(RegistrationLimit(per_s=1.0, burst=2))
    for peer in ("a", "b", "b", "c"):
        assert buckets.take(peer, 0.0) is None
    assert buckets.take("b", 0.0) is not None  # b spent its burst
    # At 1 s, "a" and "c" are full again, so forgotten; "b" holds one token, so kept.
    assert buckets.take("d", 1.0) is None
    assert set(buckets._buckets) == {"b", "d"}
    assert buckets.take("b", 1.0) is None and buckets.take("b", 1.0) is not None
    # None full: the oldest goes, and the count stays at the bound.
    for peer in ("e", "f"):
        assert buckets.take(peer, 1.0) is None
    assert len(buckets._buckets) == 3 and "b" not in buckets._buckets
