"""Nodes: what agents report, what operators set, the node state, and what a node may
claim (its credential, its address, its engine ports). Pure."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from http import HTTPStatus
from typing import Annotated, Self
from urllib.parse import urlsplit

from pydantic import Field, StringConstraints, field_validator, model_validator

from .base import Frozen, Tolerant
from .bounds import STRICT, JsonInt
from .capacity import CapacityClass, OwnerPath
from .catalog import MAX_CPU_CORES, MAX_MEMORY_BYTES, Labels
from .ids import DeploymentId, NodeId, ReplicaId
from .shards import EngineKind, ShardReport
from .start_progress import StartProgress
from .versions import MAX_VERSION_CHARS
from .watchdog import MemoryLevel, MemoryReport, OomKill

#: GPUs in one node: the largest servers hold 16; a report of more is not a machine.
MAX_GPUS_PER_NODE = 64
#: Shards one agent reports: far more engines than one node could hold in memory.
MAX_SHARDS_PER_NODE = 1024
#: The highest TCP port.
MAX_PORT = 65535
#: The header a re-registering agent presents its node credential in (``Authorization``
#: carries the join token on registration, so that one request serves a first join and a
#: return). Here, not in the API, because the agent must not import the API.
NODE_CREDENTIAL_HEADER = "X-Node-Credential"
#: What a node's name may be: a host name as ``hostname`` prints it (letters, digits,
#: ``.``, ``-``, and ``_``, which some hosts have), starting with a letter or digit, at most
#: 64 characters: Linux's HOST_NAME_MAX, so the agent's default name, the machine's host
#: name, always passes. Names are printed in tables, events and `cant_place` reasons, so
#: no spaces, control characters or shell metacharacters. Rust regex (pydantic's):
#: ``$`` is the end of the text, so a trailing newline does not pass.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NODE_NAME_RULE = ("a host name: letters, digits, '.', '-' and '_', starting with a letter "
                  "or digit, at most 64 characters")
#: What a node's id may be: the name's characters, at most 128 of them (the agent makes
#: ``n-`` and 12 hex digits). An id is a path segment (``/nodes/{id}``: one holding ``/``
#: could never be removed), part of its Temporal task queue (``node/<id>``,
#: ``names.node_task_queue``) and printed in tables and events, so no ``/``, whitespace,
#: control or bidirectional characters.
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
NODE_ID_RULE = ("letters, digits, '.', '-' and '_', starting with a letter or digit, at "
                "most 128 characters")
#: Schemes an engine endpoint may have: engines serve plain HTTP (TLS terminates nowhere
#: between the gateway and an engine today), https for one that does.
ENDPOINT_SCHEMES = frozenset({"http", "https"})


class NodeState(StrEnum):
    """A node's state as placement and the API see it."""

    READY = "ready"
    UNREACHABLE = "unreachable"
    LOST = "lost"
    CORDONED = "cordoned"


class GpuInfo(Frozen):
    """One GPU as the agent reports it."""

    index: JsonInt = Field(ge=0, le=MAX_GPUS_PER_NODE)
    name: str = Field(max_length=256)
    memory_bytes: JsonInt = Field(ge=0, le=MAX_MEMORY_BYTES)
    healthy: bool = Field(default=True, strict=STRICT)


class Inventory(Frozen):
    """A node's capacity. ``None`` memory means unknown (an older agent), shown as "-"."""

    # Bounded so that a huge number from a broken or hostile agent is a 422 naming the
    # field, not a 500 from the store's bigint and integer columns.
    memory_total_bytes: JsonInt | None = Field(default=None, ge=0, le=MAX_MEMORY_BYTES)
    memory_available_bytes: JsonInt | None = Field(default=None, ge=0, le=MAX_MEMORY_BYTES)
    cpu_count: JsonInt | None = Field(default=None, ge=0, le=MAX_CPU_CORES)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=MAX_GPUS_PER_NODE)

    @field_validator("gpus")
    @classmethod
    def _one_gpu_per_index(cls, gpus: list[GpuInfo]) -> list[GpuInfo]:
        # Placement refuses a node view that lists an index twice (placement.NodeView), so
        # an inventory that did was stored, then failed every read of the nodes: a 500 on
        # each placement dry run, found by the live fuzz (bench/results/fuzz.md).
        seen: set[int] = set()
        for gpu in gpus:
            if gpu.index in seen:
                raise ValueError(f"gpus: index {gpu.index} is listed twice; each GPU has "
                                 "one entry, by its own index")
            seen.add(gpu.index)
        return gpus


class PortRange(Frozen):
    """The ports an agent hands to engines, both ends included: low <= high."""

    low: int = Field(ge=1, le=MAX_PORT)
    high: int = Field(ge=1, le=MAX_PORT)

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.low > self.high:
            raise ValueError(f"engine_ports.low = {self.low} is above engine_ports.high = "
                             f"{self.high}: the range must run low to high")
        return self

    def holds(self, port: int) -> bool:
        """Whether ``port`` lies in the range."""
        return self.low <= port <= self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


#: An engine's name (an :class:`~.shards.EngineKind`) and the version its agent found,
#: bounded: a hostile agent must not store a document per node.
EngineVersions = dict[EngineKind, Annotated[str, StringConstraints(
    min_length=1, max_length=MAX_VERSION_CHARS, pattern=r"^[\x21-\x7e]+$")]]


class AgentRegistration(Frozen):
    """What an agent sends when it (re)registers.

    ``engine_host`` is the address its engines' endpoints will carry and ``engine_ports``
    the ports it hands them: the API accepts an endpoint from this node only on that host
    (which must be the address the registration came from, see :func:`node_address`) and
    in that range. Both optional for agents older than the check, whose endpoints are then
    refused.
    """

    node_id: NodeId = Field(pattern=NODE_ID_PATTERN, description=NODE_ID_RULE)
    name: str = Field(pattern=NODE_NAME_PATTERN, description=NODE_NAME_RULE)
    labels: Labels = Field(default_factory=dict)
    inventory: Inventory
    shards: list[ShardReport] = Field(default_factory=list, max_length=MAX_SHARDS_PER_NODE)
    agent_version: str = Field(default="", max_length=64)
    engine_host: str | None = Field(default=None, min_length=1, max_length=253)
    engine_ports: PortRange | None = None
    #: The engines the agent can run and their versions (llama.cpp's xllamacpp wheel or
    #: native build, vLLM, SGLang, the sim); None from an agent older than the field,
    #: which placement takes as able to run anything (rule 11).
    engines: EngineVersions | None = None


class AgentHeartbeat(Frozen):
    """An agent's periodic report: with the memory watchdog's (``memory``, None from an
    older agent) and the engines killed for memory not yet reported (``oom_kills``)."""

    inventory: Inventory
    shards: list[ShardReport] = Field(default_factory=list, max_length=MAX_SHARDS_PER_NODE)
    memory: MemoryReport | None = None
    oom_kills: list[OomKill] = Field(default_factory=list, max_length=MAX_SHARDS_PER_NODE)
    #: The progress of each start under way on the node (fetching, queued, loading);
    #: absent when none, so an agent with nothing starting speaks to an older API.
    starts: list[StartProgress] = Field(default_factory=list,
                                        max_length=MAX_SHARDS_PER_NODE)


class HeartbeatAnswer(Tolerant):
    """The API's answer to a heartbeat: the replicas that hold a claim on this node now.

    An engine the agent runs whose replica is not among them was released by the control
    plane (typically while the node was unreachable, and replaced elsewhere): the agent
    stops it at once rather than after its orphan grace, so no engine runs without a claim
    and no new replica lands on memory an old one still holds. Tolerant: an agent one
    version behind the API ignores what it does not know.
    """

    claimed_replica_ids: list[ReplicaId] = Field(default_factory=list)


class AgentWelcome(Frozen):
    """The API's answer to a registration: where the agent's worker must poll, the node's
    key, and (once) its credential.

    The one place a secret crosses the wire: the node key (from which the agent derives
    its engines' keys) on every registration, and the node credential on the registration
    that issued it. Both are left out of repr(), so a logged welcome shows neither; never
    log its JSON.
    """

    node_id: NodeId
    temporal_address: str
    temporal_namespace: str
    task_queue: str
    heartbeat_interval_s: float
    node_key: str = Field(repr=False)
    #: Set when this registration issued a credential: the agent must keep it (mode 0600)
    #: and present it on every later call. None: keep the one you have.
    node_credential: str | None = Field(default=None, repr=False)


class NodeRecord(Frozen):
    """A node as stored, with what its replicas claim on it."""

    node_id: NodeId
    name: str
    agent_labels: dict[str, str]
    operator_labels: dict[str, str]
    cordoned: bool
    cordon_reason: str | None
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    cpu_count: int | None
    gpus: list[GpuInfo]
    last_seen: datetime
    registered_at: datetime
    #: When the API's liveness channel found the node silent; None while it is not.
    silent_since: datetime | None = None
    #: The memory watchdog's level as the agent last reported it, since when and why,
    #: and how many times it changed (modelkeeper.domain.watchdog).
    memory_level: MemoryLevel = MemoryLevel.OK
    memory_level_since: datetime | None = None
    memory_level_reason: str | None = None
    memory_level_changes: int = 0
    #: The operator's hold (placement rule 5): the node is kept for this class, or this
    #: owner scope and those beneath it; None when it is not held for one.
    hold_class: CapacityClass | None = None
    hold_owner: str | None = None
    #: The engines its agent can run, with their versions; None: it did not say.
    engines: dict[str, str] | None = None
    memory_claimed_bytes: int = 0
    cpu_claimed: float = 0.0
    gpus_claimed: list[int] = Field(default_factory=list)

    @property
    def labels(self) -> dict[str, str]:
        """Effective labels: the operator's outrank the agent's."""
        return effective_labels(self.agent_labels, self.operator_labels)


def effective_labels(agent: dict[str, str], operator: dict[str, str]) -> dict[str, str]:
    """A node's labels as placement matches them: the operator's outrank the agent's."""
    return {**agent, **operator}


class NodeUpdate(Frozen):
    """Operator settings for a node (PATCH /nodes/{id}); both survive re-registration."""

    labels: Labels | None = None
    cordoned: bool | None = Field(default=None, strict=STRICT)
    cordon_reason: str | None = Field(default=None, max_length=500)
    #: Hold (reserve) the node for replicas running as this class, or owned within this
    #: scope (placement rule 5); ``release_hold`` clears both.
    hold_class: CapacityClass | None = None
    hold_owner: OwnerPath | None = None
    release_hold: bool | None = Field(default=None, strict=STRICT)

    @model_validator(mode="after")
    def _hold_or_release(self) -> Self:
        if self.release_hold and (self.hold_class is not None or self.hold_owner is not None):
            raise ValueError("give release_hold or a hold (hold_class, hold_owner), not both")
        return self


@dataclass(frozen=True, slots=True)
class HeartbeatRecorded:
    """A heartbeat the store authenticated and wrote (``NodeStore.authenticated_heartbeat``).

    A dataclass, not a model: the store builds one per heartbeat of every node, from its
    own row, so there is nothing to validate.
    """

    #: Something placement uses changed (see ``NodeStore.authenticated_heartbeat``).
    changed: bool
    #: The replicas holding a claim on the node, read after the heartbeat arrived.
    claimed_replica_ids: list[ReplicaId]
    #: The memory level stored for the node (the watchdog writes it only when the
    #: agent's differs: most heartbeats then cost no second statement).
    memory_level: MemoryLevel = MemoryLevel.OK


class NodeAuth(Frozen):
    """What the store holds to authenticate a node and check what it reports."""

    node_id: NodeId
    name: str
    #: SHA-256 (hex) of the node's credential; None for a node that never got one.
    credential_sha256: str | None
    #: Whether the node has authenticated with that credential since it was issued.
    credential_confirmed: bool
    address: str | None
    engine_ports: PortRange | None


class NodeRegistered(Frozen):
    """A registration the store wrote: the node's key epoch (kept from its join; None for a
    node that joined before epochs, whose key is the first scheme's)."""

    key_epoch: str | None


class NameTaken(Frozen):
    """A registration the store refused: ``field`` (``name`` or ``node_id``) is ``value``,
    which already names another node, ``holder``, as its id or its name."""

    field: str
    value: str
    holder: NodeId


class EndpointRefused(Frozen):
    """An endpoint a node reported that the store would not record: not on the node's
    registered address, or outside its declared engine ports."""

    replica_id: ReplicaId
    deployment_id: DeploymentId | None = None
    node_id: NodeId | None
    endpoint: str
    reason: str


class NodeRemoval(Frozen):
    """What ``DELETE /nodes/{id}`` did: ``removed`` False when the node still holds
    replicas and removal was not forced (the replicas are named either way)."""

    node_id: NodeId
    name: str
    removed: bool
    #: Replicas that held a claim on the node, by deployment.
    replicas: dict[DeploymentId, list[ReplicaId]] = Field(default_factory=dict)


class NodeSilentInput(Tolerant):
    """Payload of the ``node_silent`` signal (``names.SIGNAL_NODE_SILENT``): the API found
    ``node_id`` silent, and these replicas of the signalled deployment hold a claim there.

    Tolerant: the API and the workflow's worker may run different versions.
    """

    node_id: NodeId
    replica_ids: list[ReplicaId]


def node_state(record: NodeRecord, now: datetime, *, unreachable_after_s: float,
               lost_after_s: float) -> NodeState:
    """The node's state at ``now`` from its last heartbeat, its liveness and its cordon.

    1. Lost: no heartbeat for ``lost_after_s``. Lost outranks cordoned: an operator looking
       at a cordoned node that stopped reporting must see that it is gone, not just fenced
       off.
    2. Cordoned.
    3. Unreachable: no heartbeat for ``unreachable_after_s``, or found silent by the
       liveness channel (``silent_since``), which notices a dead agent in about a second
       rather than after several missed heartbeats.
    4. Ready.
    """
    return state_at(now, last_seen=record.last_seen, cordoned=record.cordoned,
                    silent_since=record.silent_since,
                    unreachable_after_s=unreachable_after_s, lost_after_s=lost_after_s)


def state_at(now: datetime, *, last_seen: datetime, cordoned: bool,
             silent_since: datetime | None, unreachable_after_s: float,
             lost_after_s: float) -> NodeState:
    """:func:`node_state` from the three fields it reads, for a caller that has them
    without a :class:`NodeRecord` (placement reads them straight from the row)."""
    quiet = (now - last_seen).total_seconds()
    if quiet >= lost_after_s:
        return NodeState.LOST
    if cordoned:
        return NodeState.CORDONED
    if quiet >= unreachable_after_s or silent_since is not None:
        return NodeState.UNREACHABLE
    return NodeState.READY


# -- credentials ------------------------------------------------------------------------


def credential_digest(credential: str) -> str:
    """The stored form of a node credential: SHA-256 in hex. The credential is 256 random
    bits, so a plain (unsalted, fast) hash cannot be searched."""
    return hashlib.sha256(credential.encode("utf-8", errors="surrogatepass")).hexdigest()


def credential_matches(presented: str | None, digest: str | None) -> bool:
    """Whether ``presented`` is the credential stored as ``digest``, in constant time (a
    wrong guess must not tell how close it was). False when either is missing."""
    if presented is None or digest is None:
        return False
    return hmac.compare_digest(credential_digest(presented).encode(), digest.encode())


def secret_matches(presented: str | None, expected: str) -> bool:
    """Whether ``presented`` equals ``expected`` (a shared token), in constant time."""
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8", errors="surrogatepass"),
                               expected.encode("utf-8", errors="surrogatepass"))


# -- addresses and endpoints ------------------------------------------------------------


def canonical_host(host: str) -> str:
    """``host`` in one spelling per address: IPv6 compressed and without brackets, an
    IPv4-mapped IPv6 address as the IPv4 one, a name lower-cased."""
    bare = host.strip("[]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return bare.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host is None:
        return False
    bare = canonical_host(host)
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def same_host(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same machine for the endpoint rule: the same
    address, or both loopback (this machine, however spelt)."""
    return canonical_host(a) == canonical_host(b) or (is_loopback(a) and is_loopback(b))


def node_address(peer: str | None, advertised: str | None) -> str:
    """The address to record for a node: where its registration came from, in the
    spelling its agent advertises when the two are the same machine.

    The rule (docs/security.md, "Nodes and engine keys"): endpoints must be on the
    machine the node's own requests come from, so that an agent can point the gateway at
    itself and nowhere else. Raises ``ValueError`` (a sentence naming the field, the value
    and the limit) when the agent advertises another address: a node behind NAT, or a
    name, is refused rather than trusted.
    """
    if peer is None:
        raise ValueError("the registration's peer address is unknown: the node's address "
                         "cannot be checked")
    if advertised is None:
        return canonical_host(peer)
    if same_host(peer, advertised):
        return canonical_host(advertised)
    raise ValueError(
        f"engine_host = {advertised!r} is not the address this agent's registration came "
        f"from ({canonical_host(peer)}): a node's endpoints must be on its own address. "
        f"Leave engine_host unset (the agent then finds it) or set it to "
        f"{canonical_host(peer)}; a node behind NAT is not supported yet")


def endpoint_refusal(endpoint: str, *, address: str | None,
                     engine_ports: PortRange | None) -> str | None:
    """Why ``endpoint`` may not be recorded for a node registered at ``address`` with
    ``engine_ports``; None when it may.

    It must be ``http(s)://HOST:PORT`` with nothing else (no credentials, no path beyond
    ``/``, no query), HOST the node's address and PORT in its range: the gateway sends
    prompts and the replica's key to it.
    """
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as err:
        return f"endpoint {endpoint!r} is not a URL: {err}"
    if parts.scheme not in ENDPOINT_SCHEMES:
        return (f"endpoint {endpoint!r}: scheme {parts.scheme!r} is not one of "
                f"{', '.join(sorted(ENDPOINT_SCHEMES))}")
    if parts.username is not None or parts.password is not None:
        return f"endpoint {endpoint!r} carries credentials; an endpoint is host:port only"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"endpoint {endpoint!r} has a path or query; an endpoint is host:port only"
    host = parts.hostname
    if not host or port is None:
        return f"endpoint {endpoint!r} names no host and port"
    if address is None:
        return (f"endpoint {endpoint!r}: the node registered no address (an agent older "
                f"than the check); it must register again")
    if not same_host(host, address):
        return (f"endpoint host {host!r} is not the node's registered address "
                f"{address!r}")
    if engine_ports is None:
        return (f"endpoint {endpoint!r}: the node declared no engine port range (an agent "
                f"older than the check); it must register again")
    if not engine_ports.holds(port):
        return (f"endpoint port {port} is outside the node's engine port range "
                f"{engine_ports}")
    return None


# -- who may register -------------------------------------------------------------------


class Admitted(Frozen):
    """A registration the API accepts."""

    #: How: ``credential`` (the node's own), ``join token``, or ``loopback`` (no join token
    #: is set and the agent runs on the API's machine).
    admitted_by: str
    #: Issue the node a credential in the answer: it joins (or, registered before
    #: credentials existed, gets its first).
    issue_credential: bool


class Refused(Frozen):
    """A registration the API refuses, and the HTTP status that says so."""

    status: HTTPStatus
    reason: str


def lost_credential_remedy(node_id: str) -> str:
    """What an agent refused for want of its credential is told: the one way back."""
    return (f"an agent that lost its credential (its data dir's node_credential file, or "
            f"the answer of the registration that issued it) joins again as a new node once "
            f"an operator has removed this one: `modelkeeper nodes rm {node_id}`")


def admit_registration(node_id: str, *, known: NodeAuth | None, credential: str | None,
                       token_presented: str | None, join_token: str | None,
                       peer_loopback: bool) -> Admitted | Refused:
    """Whether an agent may register as ``node_id``, in order:

    1. A node that holds a credential is re-registered by that credential only, from the
       moment it was issued. Another credential, or none, is refused (403): the join token
       is shared by every node, so accepting it here would let any node speak for any
       other, and a node whose first answer is still on its way is no exception (a second
       registration then took the node over, issue 19). An agent whose answer was lost
       has no credential and is refused too: an operator removes the node, and it joins
       again as new (:func:`lost_credential_remedy`).
    2. A new node (or one registered before credentials existed) joins with the join
       token when one is set (401 without it), and gets a credential.
    3. With no join token set, only an agent on loopback may join (403 otherwise).
    """
    if known is not None and known.credential_sha256 is not None:
        if credential_matches(credential, known.credential_sha256):
            return Admitted(admitted_by="credential", issue_credential=False)
        why = "the credential presented is not its own" if credential else "none was presented"
        return Refused(status=HTTPStatus.FORBIDDEN, reason=(
            f"node {node_id!r} is registered and holds a credential, and {why}: a node may "
            f"speak only for itself. {lost_credential_remedy(node_id)}"))
    if join_token is not None:
        if secret_matches(token_presented, join_token):
            return Admitted(admitted_by="join token", issue_credential=True)
        return Refused(status=HTTPStatus.UNAUTHORIZED, reason=(
            f"node {node_id!r}: joining needs the join token (Authorization: Bearer "
            f"<MODELKEEPER_JOIN_TOKEN>); "
            f"{'the one presented is wrong' if token_presented else 'none was presented'}"))
    if peer_loopback:
        return Admitted(admitted_by="loopback", issue_credential=True)
    return Refused(status=HTTPStatus.FORBIDDEN, reason=(
        f"node {node_id!r}: no join token is set on the API, so it accepts registrations "
        f"from loopback only; set MODELKEEPER_JOIN_TOKEN (or MODELKEEPER_JOIN_TOKEN_FILE) "
        f"on the API and give the agent the same token (--join-token-file)"))


def name_taken_reason(taken: NameTaken, *, node_id: str) -> str:
    """Why ``node_id`` may not register: what it would be called already names another
    node. Ids and names are unique together, so what an operator types (`modelkeeper
    cordon NODE`) is never a guess."""
    if taken.field == "node_id":
        fix = "remove that node or give this agent another data dir (a new id)"
    else:
        fix = "give this agent another name (--name)"
    return (f"{taken.field} = {taken.value!r} already names node {taken.holder!r} (as its "
            f"id or its name), so node {node_id!r} may not register with it: a node's id "
            f"and name each name one node. If {taken.holder!r} is this machine's earlier "
            f"self (its data dir was lost), remove it (`modelkeeper nodes rm "
            f"{taken.holder}`); otherwise {fix}")


# -- how often a peer may register ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenBucket:
    """One peer's registrations: ``tokens`` left at ``at`` (seconds on a monotonic clock).

    A dataclass, not a model: the API keeps one per peer and replaces it on every
    registration, from numbers it made itself."""

    tokens: float
    at: float


class RegistrationLimit(Frozen):
    """How many registrations one peer address may make: ``burst`` at once, then
    ``per_s`` a second (settings ``registration_burst`` and ``registration_per_s``)."""

    per_s: float = Field(gt=0)
    burst: int = Field(ge=1)

    def __str__(self) -> str:
        return f"{self.burst} at once, then {self.per_s:g} a second"


def bucket_tokens(bucket: TokenBucket | None, now: float, limit: RegistrationLimit) -> float:
    """The tokens ``bucket`` holds at ``now``: refilled at ``per_s``, never above
    ``burst``. A peer never seen holds a full bucket."""
    if bucket is None:
        return float(limit.burst)
    return min(float(limit.burst), bucket.tokens + max(0.0, now - bucket.at) * limit.per_s)


def take_registration(bucket: TokenBucket | None, now: float, limit: RegistrationLimit
                      ) -> tuple[TokenBucket, float | None]:
    """One registration from a peer at ``now``: its bucket afterwards, and None when it
    may register, else the seconds until it may (a refused attempt takes nothing)."""
    tokens = bucket_tokens(bucket, now, limit)
    if tokens >= 1.0:
        return TokenBucket(tokens=tokens - 1.0, at=now), None
    return TokenBucket(tokens=tokens, at=now), (1.0 - tokens) / limit.per_s


def registration_rate_refusal(peer: str | None, limit: RegistrationLimit,
                              retry_after_s: int) -> str:
    """The 429's sentence: the peer, the limit, and when to try again."""
    return (f"too many registrations from {peer or 'this address'}: the limit is {limit} "
            f"per peer address (registration_burst, registration_per_s); try again in "
            f"{retry_after_s} s")
