"""Nodes and engine keys as an attacker tries them (issue 11, "Nodes" and "Engine keys").

* A node that joined tries to speak for another: heartbeat, liveness stream and
  re-registration with its own credential, with none, with the join token. Each is
  refused and changes nothing; the victim's own credential keeps working.
* A node reports endpoints off its registered address, outside its engine ports, with a
  path or credentials: each is refused, recorded, and never routed.
* A remote agent registers while no join token is set: refused, with a sentence that
  says what to set; the API says so at start.
* Key derivation: a node key yields its own node's replica keys and no other's.
* An engine's environment holds its own key and no other secret; SGLang's command line
  holds no key; log tails are scrubbed before they leave the node.
* The gateway, during a secret rotation, reaches an engine started before it.
* An operator removes a node (409 while it holds replicas, unless forced).

Attempts are counted as tried, refused and lost (a refused attempt that changed anything
counts as lost); every test ends with none lost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import pytest
from fastapi import FastAPI
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.store import StoreActivities
from agent.engine_process import NODE_ENV, REPLICA_ENV, engine_environment, read_log_tail
from agent.engines.base import EngineAdapter
from agent.engines.llamacpp import LlamaCppAdapter
from agent.engines.sglang import ENTRY_SCRIPT, SglangAdapter
from agent.engines.sglang_main import API_KEY_ENV as SGLANG_KEY_ENV
from agent.engines.sglang_main import KEY_FLAG, key_on_command_line, take_key
from agent.engines.sim import SimAdapter
from agent.engines.sim_server import API_KEY_ENV as SIM_KEY_ENV
from agent.engines.vllm import VllmAdapter
from agent.identity import CREDENTIAL_FILE, load_credential, save_credential
from agent.shards import ShardManager
from api.agents import registration_warnings
from api.app import create_app
from cli.main import run as cli_run
from cli.operator_cli import OPERATOR_COMMANDS, Request, UsageError
from modelkeeper.domain.catalog import ReplicaStateUpdate
from modelkeeper.domain.engine_keys import (
    derive_engine_key,
    derive_node_key,
    replica_engine_key,
)
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.nodes import (
    NODE_CREDENTIAL_HEADER,
    AgentRegistration,
    AgentWelcome,
    HeartbeatRecorded,
    Inventory,
    PortRange,
    credential_digest,
    endpoint_refusal,
    node_address,
)
from modelkeeper.domain.redact import REDACTED, scrub_secrets
from modelkeeper.domain.shards import EngineKind, FetchProgress, ShardSpec
from modelkeeper.domain.status import ReplicaState
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.infra.secrets import new_node_credential, read_join_token
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.routing import RoutingStore
from tests.support.gateway_support import (
    HOST,
    NODE,
    SECRET,
    Sim,
    add_deployment,
    add_replica,
    running_gateway,
    until,
)

pytestmark = pytest.mark.timeout(120)

CLUSTER_SECRET = "cluster-secret-for-node-tests"
JOIN_TOKEN = "join-token-for-node-tests"
GIB = 1 << 30
PORTS = PortRange(low=20000, high=20010)
#: A documentation address (RFC 5737): a peer that is not loopback.
REMOTE_PEER = ("203.0.113.7", 40000)


@dataclass
class Tally:
    """Attempts as an attacker makes them: each tried, refused, or lost (got through, or
    changed something while refused)."""

    tried: int = 0
    refused: int = 0
    lost: list[str] = field(default_factory=list)

    def refusal(self, what: str, resp: httpx.Response, status: int) -> None:
        self.tried += 1
        if resp.status_code == status:
            self.refused += 1
        else:
            self.lost.append(f"{what}: {resp.status_code} {resp.text}")

    def report(self, name: str) -> None:
        print(f"\n{name}: {self.tried} tried, {self.refused} refused, "
              f"{len(self.lost)} lost")
        assert not self.lost, self.lost
        assert self.tried == self.refused


def registration(node_id: str, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "node_id": NodeId(node_id), "name": node_id,
        "inventory": Inventory(memory_total_bytes=8 * GIB, memory_available_bytes=8 * GIB,
                               cpu_count=4),
        "engine_host": "127.0.0.1", "engine_ports": PORTS}
    fields.update(overrides)
    return AgentRegistration(**fields).model_dump(mode="json")


def beat(memory: int) -> dict[str, Any]:
    return {"inventory": {"memory_total_bytes": memory, "memory_available_bytes": memory,
                          "cpu_count": 4}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class NodeApi:
    app: FastAPI
    http: httpx.AsyncClient
    store: Store

    async def join(self, node_id: str) -> dict[str, Any]:
        resp = await self.http.post("/nodes/register", json=registration(node_id),
                                    headers=bearer(JOIN_TOKEN))
        assert resp.status_code == 200, resp.text
        welcome: dict[str, Any] = resp.json()
        assert welcome["node_credential"]
        return welcome


@asynccontextmanager
async def node_api(env: WorkflowEnvironment, database_url: str, *,
                   client: tuple[str, int] = ("127.0.0.1", 123),
                   **overrides: Any) -> AsyncIterator[NodeApi]:
    """The API in process (operator tokens off: the agents' routes are what is tried)."""
    settings: dict[str, Any] = {
        "database_url": database_url,
        "temporal_address": env.client.service_client.config.target_host,
        "temporal_namespace": env.client.namespace, "api_auth": False,
        "engine_key_secret": CLUSTER_SECRET, "join_token": JOIN_TOKEN, **overrides}
    app = create_app(Settings(**settings))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=client),
            base_url="http://localhost") as http:
        yield NodeApi(app, http, app.state.store)


async def node_row(db: asyncpg.Connection, node_id: str) -> dict[str, Any] | None:
    row = await db.fetchrow("SELECT * FROM nodes WHERE node_id = $1", node_id)
    return None if row is None else dict(row)



# -- a node speaks only for itself ------------------------------------------------------


async def test_a_node_cannot_speak_for_another(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    tally = Tally()
    async with node_api(local_temporal_env, database_url) as api:
        a = await api.join("n-a")
        b = await api.join("n-b")
        cred_a, cred_b = a["node_credential"], b["node_credential"]
        # B authenticates once: its credential is confirmed from then on.
        assert (await api.http.post("/nodes/n-b/heartbeat", json=beat(8 * GIB),
                                    headers=bearer(cred_b))).status_code == 200
        before = await node_row(db, "n-b")
        events_before = len(await api.store.events.list_events())

        tally.refusal("heartbeat as B with A's credential", await api.http.post(
            "/nodes/n-b/heartbeat", json=beat(0), headers=bearer(cred_a)), 403)
        tally.refusal("heartbeat as B with no credential", await api.http.post(
            "/nodes/n-b/heartbeat", json=beat(0)), 401)
        tally.refusal("heartbeat as B with the join token", await api.http.post(
            "/nodes/n-b/heartbeat", json=beat(0), headers=bearer(JOIN_TOKEN)), 403)
        tally.refusal("liveness as B with A's credential", await api.http.post(
            "/nodes/n-b/liveness", content=b"ping\n", headers=bearer(cred_a)), 403)
        tally.refusal("liveness as B with no credential", await api.http.post(
            "/nodes/n-b/liveness", content=b"ping\n"), 401)
        hostile = registration("n-b", name="evil", inventory=Inventory(memory_total_bytes=0),
                               engine_ports=PortRange(low=1, high=65535))
        tally.refusal("re-register as B with A's credential and the join token",
                      await api.http.post("/nodes/register", json=hostile, headers={
                          **bearer(JOIN_TOKEN), NODE_CREDENTIAL_HEADER: cred_a}), 403)
        tally.refusal("re-register as B with the join token alone", await api.http.post(
            "/nodes/register", json=hostile, headers=bearer(JOIN_TOKEN)), 403)
        tally.refusal("re-register as B with nothing", await api.http.post(
            "/nodes/register", json=hostile), 403)

        after = await node_row(db, "n-b")
        if after != before:
            tally.lost.append(f"B's row changed: {before} -> {after}")
        if api.app.state.liveness.state(NodeId("n-b")) is not None:
            tally.lost.append("a liveness stream was opened for B")
        if len(await api.store.events.list_events()) != events_before:
            tally.lost.append("a refused attempt recorded an event")
        # B itself still gets through, and keeps its credential and its key.
        assert (await api.http.post("/nodes/n-b/heartbeat", json=beat(8 * GIB),
                                    headers=bearer(cred_b))).status_code == 200
        again = await api.http.post("/nodes/register", json=registration("n-b"),
                                    headers={NODE_CREDENTIAL_HEADER: cred_b})
        assert again.status_code == 200, again.text
        assert again.json()["node_credential"] is None
        assert again.json()["node_key"] == b["node_key"] != a["node_key"]
    tally.report("a node speaking for another")


async def test_joining_gives_a_credential_once_stored_hashed_and_never_logged(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    tally = Tally()
    caplog.set_level(logging.DEBUG)
    async with node_api(local_temporal_env, database_url) as api:
        tally.refusal("join without the join token", await api.http.post(
            "/nodes/register", json=registration("n-new")), 401)
        tally.refusal("join with a wrong join token", await api.http.post(
            "/nodes/register", json=registration("n-new"), headers=bearer("guess")), 401)
        tally.refusal("join with a forged credential", await api.http.post(
            "/nodes/register", json=registration("n-new"),
            headers={NODE_CREDENTIAL_HEADER: new_node_credential()}), 401)
        if await node_row(db, "n-new") is not None:
            tally.lost.append("a refused join stored the node")
        welcome = await api.join("n-new")
        credential = welcome["node_credential"]
        row = await node_row(db, "n-new")
        assert row is not None and row["key_epoch"]
        assert welcome["node_key"] == derive_node_key(CLUSTER_SECRET.encode(), "n-new",
                                                      key_epoch=row["key_epoch"])
        assert row["credential_sha256"] == hashlib.sha256(credential.encode()).hexdigest()
        assert row["address"] == "127.0.0.1"
        assert (row["engine_port_low"], row["engine_port_high"]) == (PORTS.low, PORTS.high)
        # Neither secret in the store (but for the hash), the events or the logs.
        dump = str(await db.fetch("SELECT * FROM nodes")) + str(
            await db.fetch("SELECT * FROM events"))
        for secret in (credential, welcome["node_key"], CLUSTER_SECRET, JOIN_TOKEN):
            assert secret not in dump
            assert secret not in caplog.text
        # A welcome that ends up in a log shows neither secret.
        shown = repr(AgentWelcome.model_validate(welcome))
        assert credential not in shown and welcome["node_key"] not in shown
    tally.report("joining")


async def test_a_heartbeat_whose_node_authenticates_at_the_second_look_is_recorded(
        local_temporal_env: WorkflowEnvironment, database_url: str, db: asyncpg.Connection,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The one-statement heartbeat wrote nothing (the node's registration, or this
    # credential, landed just after the statement read the row), and the look that tells
    # 404 from 403 then finds the node with this credential: the heartbeat is recorded the
    # second time, not refused. Should the statement miss again, the agent is told to
    # send it again (503), not that it is unknown.
    async with node_api(local_temporal_env, database_url) as api:
        credential = (await api.join("n-late"))["node_credential"]
        real = api.store.nodes.authenticated_heartbeat
        calls: list[tuple[Any, ...]] = []

        async def missed_once(*args: Any, **kwargs: Any) -> HeartbeatRecorded | None:
            calls.append(args)
            if len(calls) == 1:
                return None
            return await real(*args, **kwargs)

        monkeypatch.setattr(api.store.nodes, "authenticated_heartbeat", missed_once)
        resp = await api.http.post("/nodes/n-late/heartbeat", json=beat(16 * GIB),
                                   headers=bearer(credential))
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"claimed_replica_ids": []}
        assert len(calls) == 2  # the first look missed, the second recorded it
        row = await node_row(db, "n-late")
        assert row is not None and row["memory_total_bytes"] == 16 * GIB
        assert row["credential_confirmed_at"] is not None

        async def missed(*args: Any, **kwargs: Any) -> None:
            return None

        monkeypatch.setattr(api.store.nodes, "authenticated_heartbeat", missed)
        resp = await api.http.post("/nodes/n-late/heartbeat", json=beat(8 * GIB),
                                   headers=bearer(credential))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
        assert "send it again" in resp.text
        row = await node_row(db, "n-late")
        assert row is not None and row["memory_total_bytes"] == 16 * GIB  # nothing written


async def test_without_a_join_token_only_loopback_registers(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    tally = Tally()
    caplog.set_level(logging.WARNING, logger="api.agents")
    async with node_api(local_temporal_env, database_url, client=REMOTE_PEER,
                        join_token=None) as remote:
        # Said once, at start.
        warned = [r.getMessage() for r in caplog.records if r.name == "api.agents"]
        assert len([w for w in warned if "no join token is set" in w]) == 1, warned
        resp = await remote.http.post("/nodes/register",
                                      json=registration("n-far", engine_host=REMOTE_PEER[0]))
        tally.refusal("remote registration, no join token set", resp, 403)
        assert "MODELKEEPER_JOIN_TOKEN" in resp.json()["detail"]
        tally.refusal("remote registration with a made-up token", await remote.http.post(
            "/nodes/register", json=registration("n-far", engine_host=REMOTE_PEER[0]),
            headers=bearer("anything")), 403)
        if await node_row(db, "n-far") is not None:
            tally.lost.append("a refused remote registration stored the node")
    async with node_api(local_temporal_env, database_url, join_token=None) as local:
        resp = await local.http.post("/nodes/register", json=registration("n-here"))
        assert resp.status_code == 200 and resp.json()["node_credential"]
    tally.report("remote registration without a join token")
    assert registration_warnings(Settings(engine_key_secret="s")) and not \
        registration_warnings(Settings(engine_key_secret="s", join_token="t"))


async def test_an_advertised_address_that_is_not_the_peer_is_refused(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url, client=REMOTE_PEER) as api:
        resp = await api.http.post("/nodes/register",
                                   json=registration("n-nat", engine_host="10.9.9.9"),
                                   headers=bearer(JOIN_TOKEN))
        assert resp.status_code == 403
        assert "engine_host = '10.9.9.9'" in resp.json()["detail"]
        assert REMOTE_PEER[0] in resp.json()["detail"]
        assert await node_row(db, "n-nat") is None
        ok = await api.http.post("/nodes/register", json=registration("n-nat", engine_host=None),
                                 headers=bearer(JOIN_TOKEN))
        assert ok.status_code == 200
        row = await node_row(db, "n-nat")
        assert row is not None and row["address"] == REMOTE_PEER[0]


@pytest.mark.parametrize(("peer", "advertised", "address"), [
    ("127.0.0.1", None, "127.0.0.1"),
    ("127.0.0.1", "localhost", "localhost"),
    ("::1", "127.0.0.1", "127.0.0.1"),
    ("::ffff:10.0.0.5", "10.0.0.5", "10.0.0.5"),
    ("10.0.0.5", None, "10.0.0.5"),
    ("fe80::0001", "fe80::1", "fe80::1"),
])
def test_node_address_is_the_peer_in_the_agents_spelling(
        peer: str, advertised: str | None, address: str) -> None:
    assert node_address(peer, advertised) == address


@pytest.mark.parametrize(("peer", "advertised"), [
    ("10.0.0.5", "10.0.0.6"), ("10.0.0.5", "127.0.0.1"), ("127.0.0.1", "10.0.0.5"),
    ("10.0.0.5", "gpu1.example"), (None, "10.0.0.5"),
])
def test_node_address_refuses_another_machine(peer: str | None, advertised: str) -> None:
    with pytest.raises(ValueError, match=r"engine_host|peer"):
        node_address(peer, advertised)


# -- endpoints --------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "reason"), [
    ("http://10.0.0.5:20001", None),
    ("http://10.0.0.5:20001/", None),
    ("https://10.0.0.5:20010", None),
    ("http://10.0.0.6:20001", "not the node's registered address"),
    ("http://127.0.0.1:20001", "not the node's registered address"),
    ("http://10.0.0.5:30000", "outside the node's engine port range 20000-20010"),
    ("http://10.0.0.5:19999", "outside the node's engine port range"),
    ("http://10.0.0.5:20001/v1/evil", "path or query"),
    ("http://10.0.0.5:20001?x=1", "path or query"),
    ("http://user:pw@10.0.0.5:20001", "carries credentials"),
    ("ftp://10.0.0.5:20001", "scheme 'ftp'"),
    ("http://10.0.0.5", "no host and port"),
    ("http://10.0.0.5:99999", "not a URL"),
])
def test_endpoint_rule(endpoint: str, reason: str | None) -> None:
    found = endpoint_refusal(endpoint, address="10.0.0.5", engine_ports=PORTS)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_an_endpoint_of_a_node_that_declared_nothing_is_refused() -> None:
    assert "registered no address" in str(
        endpoint_refusal("http://10.0.0.5:20001", address=None, engine_ports=PORTS))
    assert "no engine port range" in str(
        endpoint_refusal("http://10.0.0.5:20001", address="10.0.0.5", engine_ports=None))


async def _replica_on(db: asyncpg.Connection, node_id: str, replica_id: str) -> None:
    await db.execute("INSERT INTO models (model_id, engine, source, memory_bytes) "
                     "VALUES ('m-ep', 'sim', 'sim', 1) ON CONFLICT DO NOTHING")
    await db.execute(
        "INSERT INTO deployments (deployment_id, model_id, replicas, status, workflow_id) "
        "VALUES ('d-ep', 'm-ep', 1, 'serving', 'deployment/d-ep') ON CONFLICT DO NOTHING")
    await db.execute("INSERT INTO replicas (replica_id, deployment_id, state) "
                     "VALUES ($1, 'd-ep', 'starting')", replica_id)
    await db.execute("INSERT INTO allocations (replica_id, node_id, rank, memory_bytes) "
                     "VALUES ($1, $2, 0, 1)", replica_id, node_id)


async def test_an_endpoint_off_the_nodes_address_or_ports_is_refused_recorded_and_not_routed(
        store: Store, database_url: str, db: asyncpg.Connection) -> None:
    tally = Tally()
    await store.nodes.register_node(AgentRegistration(**{
        **registration("n-ep"), "engine_ports": PORTS}), address="10.0.0.5")
    await _replica_on(db, "n-ep", "r-ep")
    acts = StoreActivities(store, Settings(database_url=database_url))
    routes = await RoutingStore.connect(database_url, migrate=False)
    try:
        async def attempt(endpoint: str) -> tuple[str | None, str | None, list[str]]:
            # One activity per attempt, as the workflow schedules them: an activity's own
            # retries record its refusal once.
            env = ActivityEnvironment()
            env.info = dataclasses.replace(env.info, activity_id=endpoint)
            await env.run(acts.record_replica_state, ReplicaStateUpdate(
                replica_id=ReplicaId("r-ep"), state=ReplicaState.READY, endpoint=endpoint))
            row = await db.fetchrow("SELECT endpoint, endpoint_node_id FROM replicas "
                                    "WHERE replica_id = 'r-ep'")
            routed = [r.endpoint for d in await routes.load_routes() for r in d.ready]
            return row["endpoint"], row["endpoint_node_id"], routed

        assert await attempt("http://10.0.0.5:20003") == (
            "http://10.0.0.5:20003", "n-ep", ["http://10.0.0.5:20003"])
        for hostile in ("http://10.0.0.6:20003", "http://10.0.0.5:8400",
                        "http://169.254.169.254:20003", "http://10.0.0.5:20003/admin",
                        "http://evil.example:20003"):
            tally.tried += 1
            endpoint, node, routed = await attempt(hostile)
            if endpoint is None and node is None and routed == []:
                tally.refused += 1
            else:
                tally.lost.append(f"{hostile}: stored {endpoint} ({node}), routed {routed}")
        refusals = [e for e in await store.events.list_events()
                    if e.kind == "replica.endpoint_refused"]
        assert len(refusals) == tally.tried
        assert all(e.replica_id == "r-ep" and e.node_id == "n-ep" and e.deployment_id == "d-ep"
                   for e in refusals)
        assert "not the node's registered address '10.0.0.5'" in refusals[0].message
        assert "outside the node's engine port range 20000-20010" in refusals[1].message
        # A state change without an endpoint keeps what was accepted.
        assert await attempt("http://10.0.0.5:20004") == (
            "http://10.0.0.5:20004", "n-ep", ["http://10.0.0.5:20004"])
        await store.deployments.record_replica_state(ReplicaStateUpdate(
            replica_id=ReplicaId("r-ep"), state=ReplicaState.READY))
        row = await db.fetchrow("SELECT endpoint, endpoint_node_id FROM replicas")
        assert (row["endpoint"], row["endpoint_node_id"]) == ("http://10.0.0.5:20004", "n-ep")
    finally:
        await routes.close()
    tally.report("endpoints off the node")


# -- keys --------------------------------------------------------------------------------


def test_a_node_key_opens_only_its_own_nodes_replica_keys() -> None:
    secret = CLUSTER_SECRET.encode()
    nodes = ["n-a", "n-b", "n-c"]
    replicas = ["r-1", "r-2", "d-x-r3"]
    node_keys = {n: derive_node_key(secret, n) for n in nodes}
    assert len(set(node_keys.values())) == len(nodes)
    for node, key in node_keys.items():
        for replica in replicas:
            mine = derive_engine_key(key.encode(), replica)
            # The agent's derivation (from its node key) is the gateway's (from the secret).
            assert mine == replica_engine_key(secret, node_id=node, replica_id=replica)
            for other in nodes:
                if other != node:
                    # The same replica on another node has a key this node cannot make.
                    assert mine != replica_engine_key(secret, node_id=other,
                                                      replica_id=replica)
                    assert mine != derive_engine_key(node_keys[other].encode(), replica)
            # Nor is any of them the old scheme's key (HMAC of the secret directly).
            assert mine != derive_engine_key(secret, replica)
        assert key.startswith("mkn-") and CLUSTER_SECRET not in key
    # A rotated secret gives every node and engine a new key.
    rotated = b"the-next-cluster-secret"
    assert all(derive_node_key(rotated, n) != node_keys[n] for n in nodes)


def test_keys_are_scrubbed_from_log_tails(tmp_path: Path) -> None:
    node_key = derive_node_key(CLUSTER_SECRET.encode(), "n-a")
    engine_key = derive_engine_key(node_key.encode(), "r-1")
    credential = new_node_credential()
    log = tmp_path / "engine.log"
    log.write_text(
        "starting\n"
        f"server_args=ServerArgs(model_path='m', api_key='{engine_key}', port=20001)\n"
        f"Authorization: Bearer {engine_key}\n"
        f"node key {node_key} credential {credential}\n"
        "mk-short stays\n")
    tail = read_log_tail(log)
    text = "\n".join(tail)
    for secret in (engine_key, node_key, credential):
        assert secret not in text
    assert text.count(REDACTED) == 4
    assert tail[0] == "starting" and tail[-1] == "mk-short stays"
    assert scrub_secrets(f"key='{engine_key}'.") == f"key='{REDACTED}'."


PARENT_ENV = {
    "PATH": "/usr/bin", "HOME": "/home/agent", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
    "CUDA_HOME": "/usr/local/cuda", "HF_HOME": "/cache/hf",
    "MODELKEEPER_ENGINE_KEY_SECRET": "the-cluster-secret",
    "MODELKEEPER_ENGINE_KEY_SECRET_PREVIOUS": "the-old-secret",
    "MODELKEEPER_JOIN_TOKEN": "the-join-token",
    "MODELKEEPER_DATABASE_URL": "postgresql://u:pw@db/mk",
    "HF_TOKEN": "hf_the-users-token", "VLLM_API_KEY": "mk-someone-elses-key",
    "AWS_SECRET_ACCESS_KEY": "aws-secret", "TORCH_SECRET_THING": "torch-secret",
    "RANDOM_OTHER": "x",
}


@pytest.mark.parametrize("kind", list(EngineKind))
def test_an_engines_environment_holds_its_own_key_and_no_other_secret(
        kind: EngineKind, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    spec = ShardSpec(replica_id=ReplicaId("r-1"), model_id=ModelId("m"),
                     node_id=NodeId("n-a"), engine=kind, source=str(model),
                     memory_bytes=GIB, **({"gpu_indices": [0], "gpu_memory_bytes": 2 * GIB}
                                          if kind in (EngineKind.VLLM, EngineKind.SGLANG)
                                          else {}))
    adapters: dict[EngineKind, EngineAdapter] = {
        EngineKind.LLAMACPP: LlamaCppAdapter(), EngineKind.VLLM: VllmAdapter(),
        EngineKind.SGLANG: SglangAdapter(), EngineKind.SIM: SimAdapter()}
    adapter = adapters[kind]
    key = replica_engine_key(CLUSTER_SECRET.encode(), node_id="n-a", replica_id="r-1")
    plan = adapter.launch_plan(spec, host="127.0.0.1", port=20001, api_key=key)
    env = engine_environment(PARENT_ENV, plan.env, node_id=NodeId("n-a"),
                             replica_id=ReplicaId("r-1"))
    secrets = {v for k, v in PARENT_ENV.items()
               if any(w in k for w in ("KEY", "SECRET", "TOKEN", "DATABASE"))}
    assert not secrets & set(env.values()), env
    assert not any(name.startswith("MODELKEEPER_") and name not in (
        NODE_ENV, REPLICA_ENV, SIM_KEY_ENV) for name in env), env
    # Exactly one key, its own, and never on its command line.
    assert [v for v in env.values() if v.startswith("mk-")] == [key]
    assert not any(key in arg for arg in plan.argv)
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/home/agent"
    assert "RANDOM_OTHER" not in env


async def test_a_running_engine_has_its_key_only(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in PARENT_ENV.items():
        if name not in ("PATH", "HOME"):
            monkeypatch.setenv(name, value)
    node_key = derive_node_key(CLUSTER_SECRET.encode(), "n-env")
    low = free_port()
    manager = ShardManager(node_id=NodeId("n-env"), agent_dir=tmp_path / "agent",
                           engine_host="127.0.0.1", port_range=(low, low + 20),
                           node_key=node_key)
    spec = ShardSpec(replica_id=ReplicaId("r-env"), model_id=ModelId("sim-model"),
                     node_id=NodeId("n-env"), engine=EngineKind.SIM, source="sim",
                     memory_bytes=0, start_timeout_s=30)

    def progress(_: FetchProgress) -> None:
        pass

    try:
        endpoint = await manager.start(spec, progress)
        engine = psutil.Process(endpoint.pid)
        environ = engine.environ()
        cmdline = " ".join(engine.cmdline())
        key = derive_engine_key(node_key.encode(), "r-env")
        assert key in environ.values()
        for leaked in (node_key, *(PARENT_ENV[n] for n in PARENT_ENV
                                   if n.startswith(("MODELKEEPER_", "HF_TOKEN", "AWS_")))):
            assert leaked not in environ.values() and leaked not in cmdline
        assert key not in cmdline
    finally:
        await manager.stop(ReplicaId("r-env"), grace_s=5)
        await manager.close()


def test_sglang_gets_its_key_from_the_environment_never_argv() -> None:
    spec = ShardSpec(replica_id=ReplicaId("r-1"), model_id=ModelId("m"),
                     node_id=NodeId("n-a"), engine=EngineKind.SGLANG, source="org/model",
                     memory_bytes=GIB, gpu_memory_bytes=GIB, gpu_indices=[0, 1],
                     world_size=2, rank=1, leader_address="10.0.0.1:5000")
    key = "mk-" + "a" * 64
    plan = SglangAdapter(python="/opt/py").launch_plan(spec, host="h", port=1, api_key=key)
    assert plan.argv[:2] == ["/opt/py", str(ENTRY_SCRIPT)]
    assert KEY_FLAG not in plan.argv and not any(key in a for a in plan.argv)
    assert plan.env[SGLANG_KEY_ENV] == key and key not in repr(plan)
    # The entry script refuses a key on its command line, and takes the one in the
    # environment out of it before SGLang (and its children) start.
    assert key_on_command_line(["--port", "1", "--api-key=x"])
    assert key_on_command_line(["--api-key", "x"]) and not key_on_command_line(["--port", "1"])
    environ = {SGLANG_KEY_ENV: key, "PATH": "/bin"}
    assert take_key(environ) == key and environ == {"PATH": "/bin"}
    assert take_key({SGLANG_KEY_ENV: ""}) is None
    # Run for real (no SGLang needed): each refusal exits 2 before it imports SGLang.
    for argv, env in ((["--api-key", key], {SGLANG_KEY_ENV: key}), ([], {})):
        done = subprocess.run([sys.executable, str(ENTRY_SCRIPT), *argv], env=env,
                              capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 2, done.stderr
        assert key not in done.stderr


# -- the gateway during a rotation ------------------------------------------------------


async def test_the_gateway_reaches_engines_started_before_a_rotation(
        tmp_path: Path, database_url: str, db: asyncpg.Connection) -> None:
    old = b"the-secret-before-the-rotation"
    port = free_port()
    key = replica_engine_key(old, node_id=NODE, replica_id="r-old")
    proc = ManagedProcess(
        "sim-r-old", [sys.executable, "-m", "agent.engines.sim_server", "--host", HOST,
                      "--port", str(port), "--model", "rot"],
        tmp_path / "sim.log",
        env={**os.environ, SIM_KEY_ENV: key,
             "MODELKEEPER_DATA_DIR": str(tmp_path)})
    proc.start()
    sim = Sim(proc, "r-old", port)
    try:
        await sim.wait_healthy()
        deployment = await add_deployment(db, "rot")
        await add_replica(db, deployment, "r-old", sim.url)
        body = {"model": "rot", "messages": [{"role": "user", "content": "hi"}]}
        # Without the previous secret the engine refuses the gateway's key.
        async with running_gateway(database_url) as server:
            await until(lambda: "rot" in server.gateway.table.models, what="route")
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 401
        # During the grace period it falls back to the old key, once, and keeps it.
        async with running_gateway(database_url,
                                   engine_key_secret_previous=old.decode()) as server:
            await until(lambda: "rot" in server.gateway.table.models, what="route")
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                for _ in range(3):
                    resp = await http.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
            [endpoint] = server.gateway.table.models["rot"].endpoints
            assert endpoint.requests == 3
            assert endpoint.headers["Authorization"] == f"Bearer {key}"
        assert old != SECRET
    finally:
        sim.stop()


# -- operators remove nodes -------------------------------------------------------------


async def test_an_operator_removes_a_node(
        local_temporal_env: WorkflowEnvironment, database_url: str,
        db: asyncpg.Connection) -> None:
    async with node_api(local_temporal_env, database_url) as api:
        await api.join("n-idle")
        busy = await api.join("n-busy")
        await _replica_on(db, "n-busy", "r-busy")
        assert (await api.http.delete("/nodes/n-none")).status_code == 404
        gone = await api.http.delete("/nodes/n-idle")
        assert gone.status_code == 200 and gone.json()["removed"] is True
        assert await node_row(db, "n-idle") is None
        held = await api.http.delete("/nodes/n-busy")
        assert held.status_code == 409 and "r-busy" in held.json()["detail"]
        assert "--force" in held.json()["detail"]
        assert await node_row(db, "n-busy") is not None
        forced = await api.http.delete("/nodes/n-busy", params={"force": "true"})
        assert forced.status_code == 200, forced.text
        assert forced.json()["replicas"] == {"d-ep": ["r-busy"]}
        assert await node_row(db, "n-busy") is None
        assert await db.fetchval("SELECT count(*) FROM allocations") == 0
        kinds = [e.kind for e in await api.store.events.list_events()]
        assert kinds.count("node.removed") == 2
        # Its credential died with it; its agent joins again as a new node.
        assert (await api.http.post("/nodes/n-busy/heartbeat", json=beat(GIB), headers=bearer(
            busy["node_credential"]))).status_code == 404
        back = await api.join("n-busy")
        assert back["node_credential"] != busy["node_credential"]


def _parse(*argv: str) -> Any:
    from cli.main import build_parser

    return build_parser().parse_args(list(argv))


def test_nodes_rm_looks_the_node_up_then_deletes() -> None:
    nodes = [{"node_id": "n-1", "name": "small"}]
    for argv, expected in (
            (["nodes", "rm", "small"], Request("DELETE", "/nodes/n-1")),
            (["nodes", "rm", "n-1", "--force"],
             Request("DELETE", "/nodes/n-1", params={"force": "true"}))):
        lookup = OPERATOR_COMMANDS["nodes"].request(_parse(*argv))
        assert (lookup.method, lookup.path) == ("GET", "/nodes") and lookup.then
        assert lookup.then(nodes) == expected
    assert OPERATOR_COMMANDS["nodes"].request(_parse("nodes")) == Request("GET", "/nodes")
    with pytest.raises(UsageError, match="NODE is missing"):
        OPERATOR_COMMANDS["nodes"].request(_parse("nodes", "rm"))
    args = _parse("nodes", "rm", "small")
    assert OPERATOR_COMMANDS["nodes"].text(args, {
        "node_id": "n-1", "name": "small", "removed": True,
        "replicas": {"d": ["r1", "r2"]}}) == (
        "node small (n-1): removed; its 2 replica(s) will be placed elsewhere")


# -- no secret on a command line, credentials kept private -------------------------------


def test_the_join_token_is_refused_on_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_run(["agent", "--data-dir", str(tmp_path), "--join-token", "s3cret"]) == 2
    err = capsys.readouterr().err
    assert "--join-token-file" in err and "s3cret" not in err
    token_file = tmp_path / "join-token"
    token_file.write_text("from-a-file\n")
    assert read_join_token(Settings(join_token_file=token_file)) == "from-a-file"
    assert read_join_token(Settings(join_token="env", join_token_file=token_file)) == "env"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"join_token_file .* empty"):
        read_join_token(Settings(join_token_file=tmp_path / "empty"))


def test_the_agent_keeps_its_credential_private(tmp_path: Path) -> None:
    assert load_credential(tmp_path) is None
    credential = new_node_credential()
    save_credential(tmp_path / "agent", credential)
    path = tmp_path / "agent" / CREDENTIAL_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credential(tmp_path / "agent") == credential
    save_credential(tmp_path / "agent", "mkc-replaced")
    assert load_credential(tmp_path / "agent") == "mkc-replaced"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert credential_digest(credential) != credential
