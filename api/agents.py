"""Routes agents call: registration and heartbeats (their liveness stream is in
``liveness``). Kept apart from the operators' routes: agents authenticate as nodes, not as
operators.

How a node authenticates (docs/security.md, "Nodes and engine keys"):

* **Joining.** A new node presents the join token (``Authorization: Bearer``) and gets, in
  the answer, its own credential (shown once, stored hashed) and its node key. With no join
  token set, only registrations from loopback are accepted, and the API says so at start.
* **After that** the node id and its credential authenticate every call: heartbeats and
  the liveness stream carry ``Authorization: Bearer <credential>``, a re-registration
  carries it in ``X-Node-Credential``. A node speaks only for itself: another node's
  credential is a 403 and changes nothing.
* **A lost credential.** The join token alone never takes over a node that holds a
  credential, from the moment it is issued (it would let any node that joined speak for
  any other): an operator removes the node (``modelkeeper nodes rm``) and the agent joins
  again, as a new node with a new key epoch, so a new node key.
* **Ids and names each name one node**: a registration whose name is another node's name
  or id (or whose id is another's name) is a 409 naming that node.
* **Each peer address** may register ``registration_burst`` times at once, then
  ``registration_per_s`` a second: a 429 with Retry-After past that.

Where an agent's worker polls: :func:`agent_temporal_address` (the answer's
``temporal_address``), so that an agent on another machine is never sent a wildcard or
this machine's loopback.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, FastAPI, Header, HTTPException, Request

from modelkeeper.domain.engine_keys import derive_node_key
from modelkeeper.domain.events import NewEvent
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import (
    NODE_CREDENTIAL_HEADER,
    Admitted,
    AgentHeartbeat,
    AgentRegistration,
    AgentWelcome,
    HeartbeatAnswer,
    HeartbeatRecorded,
    NameTaken,
    NodeAuth,
    Refused,
    RegistrationLimit,
    TokenBucket,
    admit_registration,
    bucket_tokens,
    credential_digest,
    credential_matches,
    is_loopback,
    name_taken_reason,
    node_address,
    registration_rate_refusal,
    take_registration,
)
from modelkeeper.infra.network import WILDCARD_BINDS
from modelkeeper.infra.secrets import (
    new_key_epoch,
    new_node_credential,
    read_engine_key_secret,
    read_join_token,
)
from modelkeeper.names import node_task_queue
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from .auth import host_name
from .deps import SettingsDep, StoreDep, TemporalDep
from .signals import signal_waiting_deployments
from .watchdog import watch_memory

log = logging.getLogger(__name__)

#: Sent with a 401, as HTTP asks.
_BEARER_CHALLENGE = {"WWW-Authenticate": "Bearer"}

#: What refusing a node's call answers, documented on each route that authenticates one.
NODE_AUTH_RESPONSES: dict[int | str, dict[str, str]] = {
    401: {"description": "No node credential (Authorization: Bearer)."},
    403: {"description": "The credential is not this node's."},
    404: {"description": "The node is not registered: register again."},
}
#: ... and refusing a registration.
REGISTRATION_RESPONSES: dict[int | str, dict[str, str]] = {
    401: {"description": "Joining needs the join token, and it is missing or wrong."},
    403: {"description": "The node is registered and this is not its credential (or none "
                         "was sent: `modelkeeper nodes rm NODE` lets a node that lost it "
                         "join again); or no join token is set and the agent is not on "
                         "loopback; or it advertises an engine address that is not its "
                         "own."},
    409: {"description": "Another node has this name."},
    429: {"description": "Too many registrations from this address; Retry-After says when "
                         "to send it again."},
    503: {"description": "The API holds no engine key secret, or cannot read its join "
                         "token."},
}
#: Peers whose buckets the API keeps before it forgets the full ones (a full bucket is
#: what a peer never seen gets, so forgetting it changes nothing), and then, should a
#: flood from that many addresses leave none full, the oldest: bounds the memory at a few
#: hundred bytes a peer, at the price of a fresh burst for a peer forgotten that way.
MAX_TRACKED_PEERS = 10_000


class RegistrationBuckets:
    """Each peer address's registration bucket (:func:`take_registration`): the state the
    rule keeps, in this API process. Behind several API processes each has its own, so
    the limit is per process."""

    def __init__(self, limit: RegistrationLimit) -> None:
        self.limit = limit
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, peer: str, now: float) -> float | None:
        """One registration from ``peer`` at ``now``: None when it may, else the seconds
        until it may."""
        if len(self._buckets) >= MAX_TRACKED_PEERS and peer not in self._buckets:
            self._buckets = {p: b for p, b in self._buckets.items()
                             if bucket_tokens(b, now, self.limit) < self.limit.burst}
            while len(self._buckets) >= MAX_TRACKED_PEERS:
                # Dicts keep insertion order: the first is the longest tracked.
                del self._buckets[next(iter(self._buckets))]
        bucket, wait_s = take_registration(self._buckets.get(peer), now, self.limit)
        self._buckets[peer] = bucket
        return wait_s


@asynccontextmanager
async def _announce_registration_policy(app: FastAPI) -> AsyncIterator[None]:
    """Say once, at start, who may register (merged into the app's lifespan by
    ``include_router``)."""
    settings: Settings = app.state.settings
    for line in registration_warnings(settings):
        log.warning("%s", line)
    app.state.registration_buckets = RegistrationBuckets(RegistrationLimit(
        per_s=settings.registration_per_s, burst=settings.registration_burst))
    yield


router = APIRouter(lifespan=_announce_registration_policy)


def registration_warnings(settings: Settings) -> list[str]:
    """What the API warns about at start: registration limited to loopback, or impossible."""
    warnings = []
    try:
        token = read_join_token(settings)
    except ValueError as err:
        warnings.append(f"agent registration will fail: {err}")
        token = ""
    if token is None:
        warnings.append(
            "no join token is set (MODELKEEPER_JOIN_TOKEN or MODELKEEPER_JOIN_TOKEN_FILE): "
            "only agents on this machine (loopback) can register. Set one to add other "
            "machines.")
    if read_engine_key_secret(settings) is None:
        warnings.append(
            "no engine key secret (MODELKEEPER_ENGINE_KEY_SECRET): agent registrations "
            "will be refused, since each node's key is derived from it.")
    return warnings


def _split_address(address: str) -> tuple[str, str]:
    """``host:port`` (IPv6 hosts in brackets) into its host, without brackets, and port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def agent_temporal_address(settings: Settings, *, peer_loopback: bool,
                           api_host: str | None) -> str:
    """The Temporal address to hand an agent that registers, in order:

    1. ``agent_temporal_address`` when set: the operator knows the way (a load balancer,
       a name on Temporal's certificate).
    2. The API's own ``temporal_address`` when the agent can use it as it is: its host
       names a machine (not a wildcard such as ``0.0.0.0``) and is not this machine's
       loopback, unless the agent is on this machine too.
    3. Otherwise Temporal's port on ``api_host``, the host the agent reached the API by:
       Temporal runs beside the API, as under `up` (whose API reaches it on loopback).
       An agent that reached the API can resolve and route to that host. The port is
       ``agent_temporal_port`` when set (under `up`, its mTLS front's, the one door to
       Temporal that other machines have), else the API's own.

    ``api_host`` is the request's Host (which the allowlist admitted), else the address
    of the API's socket it arrived on; None leaves the address as it is.
    """
    if settings.agent_temporal_address:
        return settings.agent_temporal_address
    address = settings.temporal_address
    host, port = _split_address(address)
    usable = host not in WILDCARD_BINDS and (peer_loopback or not is_loopback(host))
    if usable or api_host is None or api_host in WILDCARD_BINDS or not port:
        return address
    if settings.agent_temporal_port is not None:
        port = str(settings.agent_temporal_port)
    return f"[{api_host}]:{port}" if ":" in api_host else f"{api_host}:{port}"


def _api_host(request: Request) -> str | None:
    """The host the client reached the API by: its Host header, else the local address
    of the connection (the server's socket, as the ASGI scope gives it)."""
    named = host_name(request.headers.get("host"))
    if named:
        return named
    server = request.scope.get("server")
    return str(server[0]).strip("[]") if server else None


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for anything else."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _join_token(settings: Settings) -> str | None:
    try:
        return read_join_token(settings)
    except ValueError as err:
        raise HTTPException(503, f"the API cannot read its join token: {err}") from None


def presented_credential(node_id: str, authorization: str | None) -> str:
    """The credential ``authorization`` carries; 401 without one."""
    presented = bearer(authorization)
    if presented is None:
        raise HTTPException(401, f"node {node_id!r}: this call needs the node's credential "
                                 "(Authorization: Bearer <credential from registration>)",
                            headers=_BEARER_CHALLENGE)
    return presented


async def authenticate_node(node_id: str, authorization: str | None, store: Store) -> NodeAuth:
    """The node, once ``authorization`` carries its own credential.

    401 without a credential, 404 for a node that is not registered (the agent registers
    again), 403 for a credential that is not this node's: nothing is written before this
    returns.
    """
    presented = presented_credential(node_id, authorization)
    auth = await store.nodes.node_auth(node_id)
    if auth is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    if not credential_matches(presented, auth.credential_sha256):
        log.warning("refused a call for node %s: the credential presented is not its own",
                    node_id)
        raise HTTPException(403, f"node {node_id!r}: the credential presented is not this "
                                 "node's; a node may speak only for itself")
    return auth


def _admit_rate(request: Request, peer: str | None) -> None:
    """429 (with Retry-After) when ``peer`` has registered too often: before any other
    work, so a flood costs a dictionary look-up a request."""
    buckets: RegistrationBuckets = request.app.state.registration_buckets
    wait_s = buckets.take(peer or "", time.monotonic())
    if wait_s is None:
        return
    retry_after = max(1, math.ceil(wait_s))
    log.warning("refused a registration from %s: over the limit of %s", peer,
                buckets.limit)
    raise HTTPException(HTTPStatus.TOO_MANY_REQUESTS,
                        registration_rate_refusal(peer, buckets.limit, retry_after),
                        headers={"Retry-After": str(retry_after)})


@router.post("/nodes/register", response_model=AgentWelcome,
             responses=REGISTRATION_RESPONSES)
async def register_node(reg: AgentRegistration, request: Request, store: StoreDep, *,
                        temporal: TemporalDep, settings: SettingsDep,
                        authorization: Annotated[str | None, Header()] = None,
                        credential: Annotated[str | None,
                                              Header(alias=NODE_CREDENTIAL_HEADER)] = None,
                        ) -> AgentWelcome:
    """An agent (re)registers; the answer says where its worker must poll, and carries
    its node key (and, when this call issued one, its credential). 401: the join token is
    missing or wrong; 403: the node is another's, a remote agent with no join token set, or
    an agent that advertises an engine address that is not its own; 409: another node has
    the name; 429: this address registered too often."""
    peer = request.client.host if request.client is not None else None
    _admit_rate(request, peer)
    secret = read_engine_key_secret(settings)
    if secret is None:
        raise HTTPException(503, "the API holds no engine key secret "
                                 "(MODELKEEPER_ENGINE_KEY_SECRET): it cannot give the node "
                                 "its key")
    match admit_registration(
            reg.node_id, known=await store.nodes.node_auth(reg.node_id),
            credential=credential, token_presented=bearer(authorization),
            join_token=_join_token(settings), peer_loopback=is_loopback(peer)):
        case Refused(status=status, reason=reason):
            log.warning("refused the registration of node %s from %s: %s", reg.node_id,
                        peer, reason)
            raise HTTPException(status, reason, headers=_BEARER_CHALLENGE
                                if status == HTTPStatus.UNAUTHORIZED else None)
        case Admitted() as verdict:
            pass
    try:
        address = node_address(peer, reg.engine_host)
    except ValueError as err:
        raise HTTPException(HTTPStatus.FORBIDDEN, str(err)) from None
    issued = new_node_credential() if verdict.issue_credential else None
    # A fresh epoch each time, used only if this inserts the node (a join): a node
    # re-registering keeps its own, which its running engines' keys derive from.
    registered = await store.nodes.register_node(
        reg, address=address,
        credential_sha256=None if issued is None else credential_digest(issued),
        key_epoch=new_key_epoch())
    if isinstance(registered, NameTaken):
        reason = name_taken_reason(registered, node_id=reg.node_id)
        log.warning("refused the registration of node %s from %s: %s", reg.node_id, peer,
                    reason)
        raise HTTPException(HTTPStatus.CONFLICT, reason)
    # What it already runs is adopted by each owning deployment's probe, and stopped by
    # the agent itself if nobody watches it within its orphan grace; logged here so an
    # operator can see what came back with the node. No key or credential in it.
    await store.events.record_event(NewEvent(
        kind="node.registered", node_id=reg.node_id,
        message=f"node {reg.name} registered from {address} ({verdict.admitted_by}), "
                f"running {len(reg.shards)} shard(s)",
        data={"shards": [r.model_dump(mode="json") for r in reg.shards],
              "address": address, "peer": peer, "engine_host": reg.engine_host,
              "admitted_by": verdict.admitted_by,
              "engine_ports": None if reg.engine_ports is None else str(reg.engine_ports),
              "credential_issued": issued is not None}))
    # A node joining is exactly when an unplaceable deployment may now fit.
    await signal_waiting_deployments(store, temporal)
    return AgentWelcome(
        node_id=reg.node_id,
        temporal_address=agent_temporal_address(settings, peer_loopback=is_loopback(peer),
                                                api_host=_api_host(request)),
        temporal_namespace=settings.temporal_namespace,
        task_queue=node_task_queue(reg.node_id),
        heartbeat_interval_s=settings.heartbeat_interval_s,
        node_key=derive_node_key(secret.encode(), reg.node_id,
                                 key_epoch=registered.key_epoch),
        node_credential=issued)


@router.post("/nodes/{node_id}/heartbeat", response_model=HeartbeatAnswer,
             responses=NODE_AUTH_RESPONSES)
async def heartbeat_node(node_id: str, beat: AgentHeartbeat, store: StoreDep, *,
                         temporal: TemporalDep, settings: SettingsDep,
                         authorization: Annotated[str | None, Header()] = None,
                         ) -> HeartbeatAnswer:
    """An agent's periodic report, with its node's credential; 404 tells it to register
    again, 403 that the credential is another node's (nothing is written). It also clears
    a liveness silence that began before it arrived (see ``NodeStore.authenticated_heartbeat``)."""
    received_at = datetime.now(UTC)
    presented = presented_credential(node_id, authorization)

    async def record() -> HeartbeatRecorded | None:
        # Authenticated, written, confirmed and answered in one statement, which writes
        # nothing unless the credential is the node's own (see the store).
        return await store.nodes.authenticated_heartbeat(
            node_id, credential_digest(presented), beat.inventory,
            settings.node_unreachable_after_s, received_at=received_at)

    recorded = await record()
    if recorded is None:
        # Nothing written: say why, as every node call does (404 unknown, 403 another's
        # credential). Should the credential be the node's after all (it registered, or
        # was issued this one, between the two reads), record the heartbeat now.
        await authenticate_node(node_id, authorization, store)
        recorded = await record()
        if recorded is None:
            raise HTTPException(503, f"node {node_id!r} changed while its heartbeat was "
                                     "recorded; send it again", headers={"Retry-After": "1"})
    if recorded.changed:
        # Memory reported (nodes join in pieces), or the node is back: retry now.
        await signal_waiting_deployments(store, temporal)
    if beat.starts:
        # Where people look (ls, GET /deployments): bounded in the store, see
        # modelkeeper.domain.start_progress.
        await store.deployments.record_start_progress(node_id, beat.starts)
    if beat.memory is not None or beat.oom_kills:
        await watch_memory(NodeId(node_id), beat, store=store, temporal=temporal,
                           settings=settings, now=received_at, stored=recorded.memory_level)
    # Read after this heartbeat arrived: the agent stops what it ran before sending it and
    # is not here (HeartbeatAnswer says why).
    return HeartbeatAnswer(claimed_replica_ids=sorted(recorded.claimed_replica_ids))

