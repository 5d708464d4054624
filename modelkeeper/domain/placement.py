"""Where a replica's shards go, and, when they can go nowhere, exactly why.

A pure function of a request and a snapshot of the nodes: no I/O, no clock, no
randomness, so the same inputs always give the same answer (workflow code can call it
and replay it). Imports stdlib and pydantic only.

Rules, in the order each node is checked (the first that fails is that node's reason):

1. ``avoid_node_ids``: never a node the request avoids (one being drained), whatever its
   state. First, so the drain's own cordon does not hide why: the reason reads
   "avoided (being drained)".
2. state: only ``ready`` nodes take new shards. A cordoned node is cordoned for a reason;
   an unreachable one may come back, but a shard sent there now would not start.
3. ``node_ids``: when the request names nodes, only those.
4. ``labels``: the node must carry every requested label with the requested value.
   Labels say things capacity cannot ("this node is for coding models").
5. hold: a node held for a capacity class takes only replicas running as that class; one
   held for an owner scope takes only replicas whose owner is within that scope
   (:func:`~.capacity.within`); a node held for both needs both. A hold reserves room
   the way a label cannot: a label only attracts what asks for it, a hold refuses what
   does not. The reason names the hold and what the replica is.
6. memory: the node's free memory must hold one shard, ``ceil(memory_bytes / min_nodes)``
   (rounded up so the shards together never understate the model).
7. CPU: when both the request and the node declare cores, the shard's cores must fit in
   the node's unclaimed cores.
8. GPUs: the node must have enough healthy, unclaimed GPUs; the lowest indices are taken.
9. power: when the shard declares ``watts``, the draw of the node's PDU (its
   ``topology.pdu`` label: every node on it, whatever its state, since a cordoned node
   still draws) plus the shard must stay within that PDU's cap, and the facility's draw
   within the facility's cap. A PDU without a cap, or a node without a PDU, is not capped
   by it.
10. spread: when the request spreads over a topology key (:class:`~.topology.Spread`),
    the node must carry that key's label, and its domain's shards of the deployment
    (``sibling_shards``) plus this one may exceed those of the emptiest eligible domain by
    at most ``max_skew``. Eligible domains are those of the nodes that pass rules 1 to 5
    (what could ever take the replica), full or not, as Kubernetes counts them: a full
    domain holds the others back rather than letting them pile up.
11. engine: a node whose agent says which engines it can run must run the replica's
    (``engine``), at a version meeting ``engine_version`` when one is required
    (:mod:`~.versions`). A node whose agent says nothing (older than the report) is taken
    as able, as unknown memory is. Last because it is what an operator fixes last: the
    reason "vllm 0.5.4, needs >=0.6.0" is worth reading only on a node that has the room.

Rules 9 and 10 depend on other nodes (a PDU's draw, the domains' counts): both are summed
once per call, in one pass, so a placement stays linear in the nodes. For a replica of
several shards they are applied again as its nodes are picked one by one: two shards on
one PDU draw twice, and two in one domain count twice.

Then, among the nodes that fit:

* topology: with a spread, a node in a domain holding fewer of the deployment's shards is
  preferred first;
* spread: a node holding no replica of the deployment (``sibling_node_ids``) is preferred
  over one that does, before the packing below: two replicas on one node are one crash
  from both gone. Where the replica must share (fewer such nodes fit than it needs), the
  placement's ``note`` names the node it shares and why no other would do;
* one-node replicas (``min_nodes == 1``) are bin-packed onto the node left with the least
  free memory, so partly used nodes fill up and whole nodes stay free for models too big
  to go anywhere else;
* multi-node replicas take the ``min_nodes`` emptiest nodes (most free memory), one shard
  each, rank 0 on the emptiest: they are the least movable thing in the cluster
  (rebuilding one costs every shard's load time), so they get the most headroom.

A node that does not report its memory (an agent older than the field) is usable and
counts as fitting any memory requirement: refusing it would let a control-plane upgrade
silently empty half a fleet, a worse failure than the occasional tight fit. It is sorted
after every node that does report memory, though, so it is only chosen when no node that
is known to fit does. Ties are broken by node id, so the answer never depends on the order
the nodes were listed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from packaging.specifiers import SpecifierSet
from pydantic import Field, field_validator, model_validator

from .base import Frozen
from .capacity import CapacityClass, within
from .ids import DeploymentId, ModelId, NodeId
from .nodes import NodeState
from .shards import EngineKind
from .topology import PDU_LABEL, Spread
from .units import format_gib
from .versions import meets, parse_requirement

#: Slack for comparing summed fractional CPU claims: 0.1 + 0.2 must fit in 0.3 free.
_CPU_EPSILON = 1e-9


class GpuView(Frozen):
    """One GPU on a node, as its agent reported it."""

    index: int = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    #: False for a GPU with an ECC fault or another process on it: not free in any
    #: useful sense, whatever the claims say.
    healthy: bool = True


class NodeView(Frozen):
    """A snapshot of one node: what it has, and what allocations already claim."""

    node_id: NodeId
    name: str = Field(min_length=1)
    state: NodeState
    labels: dict[str, str] = Field(default_factory=dict)
    #: None when the agent does not report memory (older agents): capacity unknown, not
    #: zero. Placement treats such a node as fitting, but prefers nodes that report.
    memory_total_bytes: int | None = Field(default=None, ge=0)
    #: Sum of the memory of the shards allocated here. May exceed the total (a node that
    #: came back reporting less memory): then nothing that needs memory fits.
    memory_claimed_bytes: int = Field(default=0, ge=0)
    #: None when the agent does not report CPUs: no CPU limit is applied.
    cpu_count: int | None = Field(default=None, ge=0)
    cpu_claimed: float = Field(default=0.0, ge=0)
    gpus: list[GpuView] = Field(default_factory=list)
    #: Indices of GPUs held by allocations, sorted and unique.
    gpu_claimed: list[int] = Field(default_factory=list)
    #: Held (reserved) for replicas running as this class only; None: not held for one.
    hold_class: CapacityClass | None = None
    #: Held for replicas whose owner is within this scope only; None: not held for one.
    hold_owner: str | None = None
    #: Sum of the declared watts of the shards allocated here (rule 9 counts it on the
    #: node's PDU).
    watts_claimed: int = Field(default=0, ge=0)
    #: The engines its agent can run, by name, with their versions (rule 11); None: its
    #: agent did not say.
    engines: dict[str, str] | None = None

    @field_validator("gpus")
    @classmethod
    def _unique_gpu_indices(cls, gpus: list[GpuView]) -> list[GpuView]:
        seen: set[int] = set()
        for gpu in gpus:
            if gpu.index in seen:
                raise ValueError(f"gpu index {gpu.index} reported twice")
            seen.add(gpu.index)
        return sorted(gpus, key=lambda g: g.index)

    @field_validator("gpu_claimed")
    @classmethod
    def _normalise_claims(cls, claimed: list[int]) -> list[int]:
        # Sorted and unique so two views of the same claims compare equal.
        return sorted(set(claimed))

    @property
    def memory_free_bytes(self) -> int | None:
        """Total minus claimed; None when the node does not report memory."""
        if self.memory_total_bytes is None:
            return None
        return self.memory_total_bytes - self.memory_claimed_bytes

    @property
    def cpu_free(self) -> float | None:
        """Cores not claimed; None when the node does not report CPUs."""
        if self.cpu_count is None:
            return None
        return self.cpu_count - self.cpu_claimed

    @property
    def free_gpu_indices(self) -> list[int]:
        """Healthy, unclaimed GPU indices, lowest first."""
        claimed = set(self.gpu_claimed)
        return [g.index for g in self.gpus if g.healthy and g.index not in claimed]


class PlacementRequest(Frozen):
    """What one replica needs. Memory is per replica; CPU and GPUs are per shard."""

    model_id: ModelId
    #: The replica's memory; each of its ``min_nodes`` shards needs an even share,
    #: rounded up. 0 means no requirement: fits anywhere.
    memory_bytes: int = Field(ge=0)
    #: Cores per shard; None means no CPU requirement.
    cpu_cores: float | None = Field(default=None, gt=0)
    #: GPUs per shard; None or 0 means none.
    gpus: int | None = Field(default=None, ge=0)
    #: Nodes the replica spans: exactly this many distinct nodes, one shard each.
    min_nodes: int = Field(default=1, ge=1)
    #: When set, only these nodes are considered.
    node_ids: list[NodeId] | None = None
    #: Labels a node must carry, each with this exact value.
    labels: dict[str, str] = Field(default_factory=dict)
    #: Never these nodes (a node being drained): each is rejected as avoided.
    avoid_node_ids: list[NodeId] = Field(default_factory=list)
    #: The deployment the replica belongs to; names it in the sharing note.
    deployment_id: DeploymentId | None = None
    #: Nodes already holding a replica of that deployment: a node not among them is
    #: preferred, so one node's crash takes one replica, not two. A preference, not a rule.
    sibling_node_ids: list[NodeId] = Field(default_factory=list)
    #: How many shards of that deployment's replicas each node holds, which a spread
    #: counts per domain. Empty: each node of ``sibling_node_ids`` holds one.
    sibling_shards: dict[NodeId, int] = Field(default_factory=dict)
    #: The class the replica runs as and its owner: a held node takes only its own.
    capacity_class: CapacityClass | None = None
    owner: str | None = None
    #: Declared watts per shard; None or 0: no draw counted, no power cap applies.
    watts: int | None = Field(default=None, ge=0)
    #: Spread the deployment's shards over a topology key (rule 10).
    spread: Spread | None = None
    #: The power caps in force, by PDU name (a ``topology.pdu`` value), and the
    #: facility's (None: uncapped). Facts of the facility, not of the replica: the store
    #: fills them in, as it fills in the siblings.
    pdu_caps_watts: dict[str, int] = Field(default_factory=dict)
    facility_cap_watts: int | None = Field(default=None, ge=0)
    #: The engine the replica runs, and the versions of it that will do (rule 11); None:
    #: no engine asked for (a dry run of memory alone).
    engine: EngineKind | None = None
    engine_version: str | None = None

    @property
    def sibling_counts(self) -> dict[NodeId, int]:
        """Shards of the deployment per node: ``sibling_shards``, else one per sibling node."""
        if self.sibling_shards:
            return self.sibling_shards
        return {n: 1 for n in self.sibling_node_ids}

    @property
    def shard_memory_bytes(self) -> int:
        """Memory one shard needs: ``ceil(memory_bytes / min_nodes)``."""
        return -(-self.memory_bytes // self.min_nodes)

    @property
    def shard_gpus(self) -> int:
        """GPUs one shard needs (0 when none were asked for)."""
        return self.gpus or 0


class ShardAssignment(Frozen):
    """One shard of the replica: where it runs and what it claims there."""

    node_id: NodeId
    rank: int = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    #: 0.0 when the request declared no CPU requirement: nothing is claimed.
    cpu_cores: float = Field(ge=0)
    gpu_indices: list[int] = Field(default_factory=list)
    #: Total memory of ``gpu_indices`` (for an engine's utilisation fraction); None
    #: when the shard holds no GPU.
    gpu_memory_bytes: int | None = Field(default=None, ge=0)
    #: Declared watts the shard draws (0: none declared).
    watts: int = Field(default=0, ge=0)


class Placement(Frozen):
    """A successful placement: one assignment per shard, rank 0 first."""

    assignments: list[ShardAssignment] = Field(min_length=1)
    #: Set when a shard shares a node with another replica of the deployment, saying which
    #: node and why no other would do (bounded like ``CantPlace.summary``).
    note: str | None = None

    @model_validator(mode="after")
    def _ranks_and_nodes(self) -> Placement:
        # Structural, so a placement that breaks these cannot exist to be acted on.
        ranks = [a.rank for a in self.assignments]
        if ranks != list(range(len(ranks))):
            raise ValueError(f"ranks must be 0..{len(ranks) - 1} in order, got {ranks}")
        node_ids = [a.node_id for a in self.assignments]
        if len(set(node_ids)) != len(node_ids):
            raise ValueError(f"one shard per node, got nodes {node_ids}")
        return self

    @property
    def node_ids(self) -> list[NodeId]:
        """The nodes used, in rank order."""
        return [a.node_id for a in self.assignments]


class RejectionReason(StrEnum):
    """Why a node cannot take a shard. Stable strings: callers may match on them."""

    #: A state that is not ready and has no more specific code below. Every current
    #: NodeState has one; this is what a state added later reports until it gets its own.
    NOT_READY = "not_ready"
    #: The request avoids the node (it is being drained).
    AVOIDED = "avoided"
    UNREACHABLE = "unreachable"
    LOST = "lost"
    CORDONED = "cordoned"
    NOT_IN_NODE_IDS = "not_in_node_ids"
    MISSING_LABELS = "missing_labels"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    INSUFFICIENT_CPU = "insufficient_cpu"
    INSUFFICIENT_GPUS = "insufficient_gpus"
    #: Held for another class or owner (rule 5).
    HELD = "held"
    #: Its PDU, or the facility, would pass its power cap (rule 9).
    POWER_CAP = "power_cap"
    #: The request spreads over a key the node has no label for (rule 10).
    NO_TOPOLOGY_DOMAIN = "no_topology_domain"
    #: Its domain would hold more than ``max_skew`` shards over the emptiest (rule 10).
    SPREAD_SKEW = "spread_skew"
    #: Its agent cannot run the replica's engine (rule 11).
    NO_ENGINE = "no_engine"
    #: Its agent runs the engine at a version the replica does not accept (rule 11).
    ENGINE_VERSION = "engine_version"
    #: Rank 0 of a multi-node replica cannot rendezvous there: its agent registered no
    #: address, or every engine port is another replica's rendezvous (the store's check,
    #: after place(): modelkeeper.store.placement).
    NO_RENDEZVOUS = "no_rendezvous"


_STATE_REASONS: dict[NodeState, RejectionReason] = {
    NodeState.UNREACHABLE: RejectionReason.UNREACHABLE,
    NodeState.LOST: RejectionReason.LOST,
    NodeState.CORDONED: RejectionReason.CORDONED,
}


class Rejection(Frozen):
    """One node that cannot take a shard, with a message an operator can act on."""

    node_id: NodeId
    node_name: str
    reason_code: RejectionReason
    #: e.g. "8.0 GiB free, needs 24.0 GiB", "cordoned", "missing label gpu=a100".
    message: str


class CantPlace(Frozen):
    """No placement exists. Every rejected node is listed once, with its reason."""

    rejections: list[Rejection]
    #: Nodes that could each take a shard, when there were fewer than ``needed_nodes``.
    fitting_node_ids: list[NodeId] = Field(default_factory=list)
    needed_nodes: int = Field(ge=1)
    #: Ids in the request's ``node_ids`` that no registered node has: usually a typo.
    unknown_node_ids: list[NodeId] = Field(default_factory=list)
    #: One line naming each node with its reason and numbers, e.g.
    #: "node b: 8.0 GiB free, needs 24.0 GiB; node c: cordoned".
    summary: str


class NodeDecision(Frozen):
    """The dry-run verdict on one node: it fits (with the numbers), or its rejection."""

    node_id: NodeId
    node_name: str
    rejection: Rejection | None = None
    #: Free memory before and after taking the shard; None when the node does not say.
    memory_free_bytes: int | None = None
    memory_free_after_bytes: int | None = None
    #: Free cores before taking the shard; None when the node does not say.
    cpu_free: float | None = None
    #: GPUs the shard would get here (empty when rejected or none were asked for).
    gpu_indices: list[int] = Field(default_factory=list)

    @property
    def fits(self) -> bool:
        """True when this node could take one shard."""
        return self.rejection is None

    @property
    def message(self) -> str:
        """The rejection's message, or how the node fits."""
        if self.rejection is not None:
            return self.rejection.message
        if self.memory_free_bytes is None or self.memory_free_after_bytes is None:
            return "fits (memory not reported)"
        return (
            f"fits: {format_gib(self.memory_free_bytes)} free, "
            f"{format_gib(self.memory_free_after_bytes)} left after"
        )


def _memory_message(free: int, need: int, per_shard: bool) -> str:
    free_s, need_s = format_gib(free), format_gib(need)
    if free_s == need_s:
        # "1.5 GiB free, needs 1.5 GiB" reads as a bug; show the bytes that differ.
        free_s, need_s = f"{free_s} ({free} bytes)", f"{need_s} ({need} bytes)"
    return f"{free_s} free, needs {need_s}{' per shard' if per_shard else ''}"


def _reject(node: NodeView, reason: RejectionReason, message: str) -> NodeDecision:
    return NodeDecision(
        node_id=node.node_id,
        node_name=node.name,
        rejection=Rejection(
            node_id=node.node_id, node_name=node.name, reason_code=reason, message=message
        ),
        memory_free_bytes=node.memory_free_bytes,
        cpu_free=node.cpu_free,
    )


#: What an avoided node's rejection says. Avoiding is how a drain moves replicas off a
#: node, its only use so far; a new use would bring its own words.
AVOIDED_MESSAGE = "avoided (being drained)"


@dataclass(frozen=True, slots=True)
class _Topology:
    """What rules 9 and 10 count across nodes, summed once per call (the module docstring
    says why): the draw per capped PDU and of the facility, and the deployment's shards
    per domain of the spread key with the fewest in any eligible domain."""

    pdu_draw: dict[str, int] = field(default_factory=dict)
    facility_draw: int = 0
    domain_counts: dict[str, int] = field(default_factory=dict)
    #: Each eligible domain with its shards (none included).
    eligible: dict[str, int] = field(default_factory=dict)
    #: The eligible domain holding the fewest shards, and how many; None: no domain.
    emptiest: tuple[int, str] | None = None


@dataclass(frozen=True, slots=True)
class _Rules:
    """One request's rules, read out once per call: every node is checked against them, and
    at 1,000 nodes re-reading the request's fields (and searching its lists) per node was a
    large part of a placement."""

    avoid: frozenset[NodeId]
    only: frozenset[NodeId] | None
    labels: tuple[tuple[str, str], ...]
    memory_bytes: int
    cpu_cores: float | None
    gpus: int
    capacity_class: CapacityClass | None
    owner: str | None
    #: Watts per shard when a cap can apply (rule 9), else 0: the rule is skipped.
    watts: int
    pdu_caps: dict[str, int]
    facility_cap: int | None
    #: The spread key's label and skew (rule 10); None: no spread.
    spread_label: str | None
    max_skew: int
    topology: _Topology
    #: The engine and the versions of it that will do, parsed once (rule 11); None: not
    #: checked, or any version.
    engine: EngineKind | None = None
    engine_spec: SpecifierSet | None = None

    @classmethod
    def of(cls, request: PlacementRequest, nodes: Sequence[NodeView]) -> _Rules:
        watts = request.watts or 0
        capped = bool(request.pdu_caps_watts) or request.facility_cap_watts is not None
        spread = request.spread
        rules = cls(avoid=frozenset(request.avoid_node_ids),
                    only=None if request.node_ids is None else frozenset(request.node_ids),
                    labels=tuple(sorted(request.labels.items())),
                    memory_bytes=request.shard_memory_bytes, cpu_cores=request.cpu_cores,
                    gpus=request.shard_gpus, capacity_class=request.capacity_class,
                    owner=request.owner, watts=watts if capped else 0,
                    pdu_caps=dict(request.pdu_caps_watts),
                    facility_cap=request.facility_cap_watts,
                    spread_label=None if spread is None else spread.key.label,
                    max_skew=1 if spread is None else spread.max_skew, topology=_Topology(),
                    engine=request.engine,
                    engine_spec=None if request.engine_version is None
                    else parse_requirement(request.engine_version))
        if rules.watts or rules.spread_label is not None:
            rules = replace(rules, topology=rules._count(request, nodes))
        return rules

    def _count(self, request: PlacementRequest, nodes: Sequence[NodeView]) -> _Topology:
        """Rules 9 and 10's sums over ``nodes``, in one pass."""
        pdu_draw: dict[str, int] = {}
        facility_draw = 0
        domain_counts: dict[str, int] = {}
        eligible: set[str] = set()
        siblings = request.sibling_counts
        label = self.spread_label
        for node in nodes:
            if self.watts:
                facility_draw += node.watts_claimed
                pdu = node.labels.get(PDU_LABEL)
                if pdu is not None and pdu in self.pdu_caps:
                    pdu_draw[pdu] = pdu_draw.get(pdu, 0) + node.watts_claimed
            if label is None:
                continue
            domain = node.labels.get(label)
            if domain is None:
                continue
            shards = siblings.get(node.node_id)
            if shards:
                domain_counts[domain] = domain_counts.get(domain, 0) + shards
            if domain not in eligible and self._static_failed(node) is None:
                eligible.add(domain)
        counted = {d: domain_counts.get(d, 0) for d in eligible}
        emptiest = min(((n, d) for d, n in counted.items()), default=None)
        return _Topology(pdu_draw=pdu_draw, facility_draw=facility_draw,
                         domain_counts=domain_counts, eligible=counted, emptiest=emptiest)

    def _static_failed(self, node: NodeView) -> RejectionReason | None:
        """Rules 1 to 5: what the node is, whatever it holds."""
        if node.node_id in self.avoid:
            return RejectionReason.AVOIDED
        if node.state is not NodeState.READY:
            return _STATE_REASONS.get(node.state, RejectionReason.NOT_READY)
        if self.only is not None and node.node_id not in self.only:
            return RejectionReason.NOT_IN_NODE_IDS
        if self.labels:
            have = node.labels
            if any(have.get(key) != want for key, want in self.labels):
                return RejectionReason.MISSING_LABELS
        if (node.hold_class is not None or node.hold_owner is not None) and \
                self._hold_refuses(node):
            return RejectionReason.HELD
        return None

    def _hold_refuses(self, node: NodeView) -> bool:
        if node.hold_class is not None and node.hold_class is not self.capacity_class:
            return True
        return node.hold_owner is not None and (
            self.owner is None or not within(self.owner, node.hold_owner))

    def failed(self, node: NodeView) -> RejectionReason | None:
        """The first rule (the module docstring's, in its order) that ``node`` fails for
        one shard; None when the shard fits there. Only the verdict: :func:`place` asks it
        of every node, and a rejection's words (:func:`_rejection_message`) are written
        only where they are shown."""
        static = self._static_failed(node)
        if static is not None:
            return static
        # No requirement fits anywhere, even on an over-claimed node; unknown memory fits.
        if self.memory_bytes > 0:
            free_mem = node.memory_free_bytes
            if free_mem is not None and free_mem < self.memory_bytes:
                return RejectionReason.INSUFFICIENT_MEMORY
        if self.cpu_cores is not None:
            cpu_free = node.cpu_free
            if cpu_free is not None and cpu_free + _CPU_EPSILON < self.cpu_cores:
                return RejectionReason.INSUFFICIENT_CPU
        if self.gpus and len(node.free_gpu_indices) < self.gpus:
            return RejectionReason.INSUFFICIENT_GPUS
        if self.watts or self.spread_label is not None:
            topology = self.topology_failed(node, self.nothing_picked())
            if topology is not None:
                return topology
        if self.engine is not None and node.engines is not None:
            return self.engine_failed(node.engines)
        return None

    def engine_failed(self, engines: dict[str, str]) -> RejectionReason | None:
        """Rule 11 on a node whose agent said what it runs."""
        assert self.engine is not None
        version = engines.get(self.engine.value)
        if version is None:
            return RejectionReason.NO_ENGINE
        if self.engine_spec is not None and not meets(version, self.engine_spec):
            return RejectionReason.ENGINE_VERSION
        return None

    @property
    def topological(self) -> bool:
        """Whether rules 9 or 10 apply: then a replica's shards are picked one by one."""
        return bool(self.watts) or self.spread_label is not None

    def topology_failed(self, node: NodeView, picked: _Picked) -> RejectionReason | None:
        """Rules 9 and 10 for one more shard on ``node``, with ``picked`` (this replica's
        shards picked so far) counted too."""
        if self.watts and self.power_over(node, picked) is not None:
            return RejectionReason.POWER_CAP
        if self.spread_label is not None:
            domain = node.labels.get(self.spread_label)
            if domain is None:
                return RejectionReason.NO_TOPOLOGY_DOMAIN
            if (picked.fewest is not None
                    and self.domain_count(domain, picked) + 1 - picked.fewest[0]
                    > self.max_skew):
                return RejectionReason.SPREAD_SKEW
        return None

    def power_over(self, node: NodeView, picked: _Picked) -> tuple[str, int, int] | None:
        """The cap one more shard on ``node`` would pass: (what is capped, "pdu p1" or "the
        facility", its draw before the shard, its cap); None when none would be."""
        pdu = node.labels.get(PDU_LABEL)
        if pdu is not None:
            cap = self.pdu_caps.get(pdu)
            if cap is not None:
                draw = self.topology.pdu_draw.get(pdu, 0) + picked.pdu_watts.get(pdu, 0)
                if draw + self.watts > cap:
                    return (f"pdu {pdu}", draw, cap)
        if self.facility_cap is not None:
            draw = self.topology.facility_draw + picked.watts
            if draw + self.watts > self.facility_cap:
                return ("the facility", draw, self.facility_cap)
        return None

    def domain_count(self, domain: str, picked: _Picked) -> int:
        """The deployment's shards in ``domain``, this replica's picks counted."""
        return self.topology.domain_counts.get(domain, 0) + picked.domains.get(domain, 0)

    def pick(self, picked: _Picked, node: NodeView) -> _Picked:
        """``picked`` with one more shard on ``node``: its PDU's and the facility's draw,
        its domain's count, and the emptiest eligible domain after it (once per pick, not
        per candidate: the eligible domains are counted over again)."""
        pdu_watts = dict(picked.pdu_watts)
        pdu = node.labels.get(PDU_LABEL)
        if pdu is not None:
            pdu_watts[pdu] = pdu_watts.get(pdu, 0) + self.watts
        domains = dict(picked.domains)
        if self.spread_label is not None:
            domain = node.labels.get(self.spread_label)
            if domain is not None:
                domains[domain] = domains.get(domain, 0) + 1
        fewest = min(((n + domains.get(d, 0), d) for d, n in self.topology.eligible.items()),
                     default=None)
        return _Picked(watts=picked.watts + self.watts, pdu_watts=pdu_watts, domains=domains,
                       fewest=fewest)

    def nothing_picked(self) -> _Picked:
        return _Picked(fewest=self.topology.emptiest)


@dataclass(frozen=True, slots=True)
class _Picked:
    """The shards of this replica picked so far, as rules 9 and 10 count them."""

    watts: int = 0
    pdu_watts: dict[str, int] = field(default_factory=dict)
    domains: dict[str, int] = field(default_factory=dict)
    #: The emptiest eligible domain, with these picks counted: (shards, domain).
    fewest: tuple[int, str] | None = None


def _rejection_message(request: PlacementRequest, rules: _Rules, node: NodeView,
                       reason: RejectionReason) -> str:
    """What a node rejected for ``reason`` reads, with the numbers that make it so."""
    match reason:
        case RejectionReason.HELD:
            return _hold_message(request, node)
        case RejectionReason.POWER_CAP:
            over = rules.power_over(node, rules.nothing_picked())
            assert over is not None  # the rule failed on it
            what, draw, cap = over
            return (f"{what} draws {draw} W of its {cap} W cap, a shard adds "
                    f"{rules.watts} W")
        case RejectionReason.NO_TOPOLOGY_DOMAIN:
            assert request.spread is not None
            return (f"no {request.spread.key.label} label: the replicas spread over "
                    f"{request.spread.key}")
        case RejectionReason.SPREAD_SKEW:
            assert request.spread is not None and rules.spread_label is not None
            domain = node.labels[rules.spread_label]
            fewest = rules.topology.emptiest
            assert fewest is not None
            spread_key = request.spread.key
            deployment = request.deployment_id or "this deployment"
            after = rules.domain_count(domain, rules.nothing_picked()) + 1
            return (f"{spread_key} {domain} would hold {after} shards of {deployment}, "
                    f"{spread_key} {fewest[1]} holds {fewest[0]}: "
                    f"max skew {request.spread.max_skew}")
        case RejectionReason.NO_ENGINE:
            assert request.engine is not None and node.engines is not None
            found = ", ".join(f"{k} {v}" for k, v in sorted(node.engines.items()))
            return f"cannot run {request.engine.value} (its agent found: {found or 'none'})"
        case RejectionReason.ENGINE_VERSION:
            assert request.engine is not None and node.engines is not None
            return (f"{request.engine.value} {node.engines[request.engine.value]}, "
                    f"needs {request.engine_version}")
        case RejectionReason.AVOIDED:
            return AVOIDED_MESSAGE
        case RejectionReason.NOT_IN_NODE_IDS:
            return "not in node_ids"
        case RejectionReason.MISSING_LABELS:
            parts = []
            for key, want in sorted(request.labels.items()):
                have = node.labels.get(key)
                if have == want:
                    continue
                # Say what the node has instead: "gpu=h100" beside "gpu=a100" is the fix.
                parts.append(f"{key}={want}" + (f" (has {key}={have})" if have is not None
                                                else ""))
            noun = "label" if len(parts) == 1 else "labels"
            return f"missing {noun} {', '.join(parts)}"
        case RejectionReason.INSUFFICIENT_MEMORY:
            free_mem = node.memory_free_bytes
            assert free_mem is not None  # unknown memory fits
            return _memory_message(free_mem, request.shard_memory_bytes,
                                   per_shard=request.min_nodes > 1)
        case RejectionReason.INSUFFICIENT_CPU:
            cpu_free = node.cpu_free
            assert cpu_free is not None  # unknown CPUs fit
            # :g, not a fixed decimal: 0.25 cores must not read as "0.2".
            return (f"{max(cpu_free, 0.0):g} of {node.cpu_count} CPU cores free, "
                    f"needs {request.cpu_cores:g}")
        case RejectionReason.INSUFFICIENT_GPUS:
            free_gpus = node.free_gpu_indices
            unhealthy = sum(1 for g in node.gpus if not g.healthy)
            detail = f"{len(free_gpus)} of {len(node.gpus)} GPUs free"
            if node.gpus:
                claimed = len(node.gpus) - unhealthy - len(free_gpus)
                detail += f" ({claimed} claimed, {unhealthy} unhealthy)"
            return f"{detail}, needs {request.shard_gpus}"
        case _:
            # A state's rejection reads as the state: "cordoned", "unreachable".
            return str(node.state)


def _hold_message(request: PlacementRequest, node: NodeView) -> str:
    """ "held for class critical; this replica runs as standard, owner acme/web" """
    held = []
    if node.hold_class is not None:
        held.append(f"class {node.hold_class}")
    if node.hold_owner is not None:
        held.append(f"owner {node.hold_owner}")
    runs = (f"runs as {request.capacity_class}" if request.capacity_class is not None
            else "has no class")
    owner = f"owner {request.owner}" if request.owner is not None else "no owner"
    return f"held for {' and '.join(held)}; this replica {runs}, {owner}"


def _decide(request: PlacementRequest, rules: _Rules, node: NodeView) -> NodeDecision:
    reason = rules.failed(node)
    if reason is not None:
        return _reject(node, reason, _rejection_message(request, rules, node, reason))
    free_mem = node.memory_free_bytes
    return NodeDecision(
        node_id=node.node_id,
        node_name=node.name,
        memory_free_bytes=free_mem,
        memory_free_after_bytes=None if free_mem is None else free_mem - rules.memory_bytes,
        cpu_free=node.cpu_free,
        gpu_indices=node.free_gpu_indices[:rules.gpus],
    )


def _check_unique(nodes: Sequence[NodeView]) -> None:
    seen: set[NodeId] = set()
    for node in nodes:
        if node.node_id in seen:
            raise ValueError(f"node {node.node_id!r} listed twice")
        seen.add(node.node_id)


def explain(request: PlacementRequest, nodes: Sequence[NodeView]) -> list[NodeDecision]:
    """Dry-run: every node, sorted by node id, with whether one shard fits there and why.

    A node either fits (with its free memory before and after, its free cores and the
    GPUs it would give) or carries exactly one rejection: the first rule it fails, in the
    order avoid, state, node_ids, labels, hold, memory, CPU, GPUs, power, spread, engine
    (rules 9 and 10 counted over ``nodes``, so pass every node, not one). Raises
    ``ValueError`` if a node id is listed twice, which means the snapshot itself is wrong.
    """
    _check_unique(nodes)
    rules = _Rules.of(request, nodes)
    return [_decide(request, rules, node) for node in sorted(nodes, key=lambda n: n.node_id)]


# Nodes that report memory are known to fit, so they come first (0); one that does not
# only might (1). Then the packing order, then the node id, so ties never depend on order.

def _bin_pack_key(node: NodeView, shard_memory_bytes: int) -> tuple[int, int, NodeId]:
    free = node.memory_free_bytes
    if free is None:
        return (1, 0, node.node_id)
    return (0, free - shard_memory_bytes, node.node_id)


def _emptiest_key(node: NodeView) -> tuple[int, int, NodeId]:
    free = node.memory_free_bytes
    if free is None:
        return (1, 0, node.node_id)
    return (0, -free, node.node_id)


#: The stored reason of a deployment that cannot be placed stays under this many bytes
#: (UTF-8), whatever the fleet size: it travels in every activity result, status write and
#: history event, and listing 1,000 nodes took about 50 KB. `explain` gives the full list.
SUMMARY_LIMIT_BYTES = 4096
#: Room kept for the tail ("; and 997 more: ..."), so the listed nodes stop early enough.
_TAIL_BYTES = 512

#: Which rejections are "closest" to fitting, listed first when the summary is cut short:
#: a node short of memory or CPU may fit after a scale-down; a lost one will not.
_CLOSENESS: dict[RejectionReason, int] = {
    RejectionReason.INSUFFICIENT_MEMORY: 0,
    RejectionReason.INSUFFICIENT_CPU: 1,
    RejectionReason.INSUFFICIENT_GPUS: 2,
    # A skew or a power cap moves as other replicas come and go.
    RejectionReason.SPREAD_SKEW: 3,
    RejectionReason.POWER_CAP: 4,
    # An upgrade away: after the room, before what an operator set on purpose.
    RejectionReason.ENGINE_VERSION: 5,
    RejectionReason.NO_ENGINE: 5,
    RejectionReason.MISSING_LABELS: 5,
    RejectionReason.NO_TOPOLOGY_DOMAIN: 6,
    RejectionReason.HELD: 7,
    RejectionReason.NOT_IN_NODE_IDS: 8,
    RejectionReason.CORDONED: 9,
    RejectionReason.UNREACHABLE: 10,
    RejectionReason.NOT_READY: 11,
    RejectionReason.LOST: 12,
    # Last: an avoided node will not take this replica whatever happens to it.
    RejectionReason.AVOIDED: 13,
    # Never place()'s: the store's, after it (modelkeeper.store.placement).
    RejectionReason.NO_RENDEZVOUS: 14,
}


def _closest_first(request: PlacementRequest, decision: NodeDecision) -> tuple[int, int, str]:
    assert decision.rejection is not None
    shortfall = 0
    if (decision.rejection.reason_code is RejectionReason.INSUFFICIENT_MEMORY
            and decision.memory_free_bytes is not None):
        shortfall = request.shard_memory_bytes - decision.memory_free_bytes
    return (_CLOSENESS[decision.rejection.reason_code], shortfall, decision.node_id)


def _summary(
    request: PlacementRequest,
    decisions: Sequence[NodeDecision],
    fitting: Sequence[NodeDecision],
    unknown_ids: Sequence[NodeId],
) -> str:
    if not decisions:
        return "no nodes registered"
    rejected = [d for d in decisions if not d.fits]
    text = _summary_of(request, rejected, fitting, unknown_ids, omitted=[])
    if len(text.encode()) <= SUMMARY_LIMIT_BYTES:
        return text
    # Too long to store: the closest nodes with their numbers, then counts by cause.
    listed, omitted = _closest_within(request, rejected, SUMMARY_LIMIT_BYTES - _TAIL_BYTES)
    text = _summary_of(request, listed, fitting, unknown_ids, omitted=omitted)
    return _cut(text)


def _cut(text: str) -> str:
    # Names and unknown ids are bounded by the API, but be certain: cut at a character.
    return text.encode()[:SUMMARY_LIMIT_BYTES].decode(errors="ignore")


def _closest_within(
    request: PlacementRequest, rejected: Sequence[NodeDecision], budget: int
) -> tuple[list[NodeDecision], list[NodeDecision]]:
    """The rejections closest to fitting whose parts fit in ``budget`` bytes, and the
    rest (to be counted by cause instead)."""
    listed: list[NodeDecision] = []
    used = 0
    ranked = sorted(rejected, key=lambda d: _closest_first(request, d))
    for decision in ranked:
        part = len(f"node {decision.node_name}: {decision.message}; ".encode())
        if used + part > budget:
            break
        listed.append(decision)
        used += part
    return listed, ranked[len(listed):]


def _reasons(listed: Sequence[NodeDecision], omitted: Sequence[NodeDecision]) -> str:
    """The listed nodes with their reasons ("node b: 8.0 GiB free, needs 24.0 GiB; node c:
    cordoned"), then the omitted ones counted by cause."""
    reasons = "; ".join(f"node {d.node_name}: {d.message}" for d in listed)
    if omitted:
        counts: dict[str, int] = {}
        for d in omitted:
            assert d.rejection is not None
            code = d.rejection.reason_code.value
            counts[code] = counts.get(code, 0) + 1
        by_cause = ", ".join(f"{n} {code}" for code, n in
                             sorted(counts.items(), key=lambda item: (-item[1], item[0])))
        reasons += (f"; and {len(omitted)} more ({by_cause}): "
                    "`modelkeeper explain` lists every node")
    return reasons


def _summary_of(
    request: PlacementRequest,
    rejected: Sequence[NodeDecision],
    fitting: Sequence[NodeDecision],
    unknown_ids: Sequence[NodeId],
    *,
    omitted: Sequence[NodeDecision],
) -> str:
    reasons = _reasons(rejected, omitted)
    if request.min_nodes > 1:
        head = f"needs {request.min_nodes} nodes, {len(fitting)} fit"
        if fitting:
            names = [d.node_name for d in fitting]
            head += f" ({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})"
        text = f"{head}: {reasons}" if reasons else head
    else:
        text = reasons
    if unknown_ids:
        shown = ", ".join(unknown_ids[:10])
        more = f" and {len(unknown_ids) - 10} more" if len(unknown_ids) > 10 else ""
        text += f"; node_ids not registered: {shown}{more}"
    return text


def _sharing_note(
    request: PlacementRequest,
    decisions: Sequence[NodeDecision],
    chosen: Sequence[NodeDecision],
) -> str | None:
    """None when no chosen node holds a replica of the deployment; else which ones do,
    and why no other node would do: "shares node n1 with another replica of d1: no other
    node has room (node n2: 1.0 GiB free, needs 2.0 GiB)"."""
    siblings = set(request.sibling_node_ids)
    shared = [d.node_name for d in chosen if d.node_id in siblings]
    if not shared:
        return None
    deployment = request.deployment_id or "this deployment"
    if len(shared) == 1:
        head = f"shares node {shared[0]} with another replica of {deployment}"
    else:
        head = f"shares nodes {', '.join(shared)} with other replicas of {deployment}"
    others = [d for d in decisions if d.node_id not in siblings]
    if request.min_nodes == 1:
        why = "no other node has room" if others else "every node holds one already"
    else:
        room = sum(1 for d in others if d.fits)
        nodes = "other node has" if room == 1 else "other nodes have"
        why = f"needs {request.min_nodes} nodes, {room} {nodes} room"
    rejected = [d for d in others if not d.fits]
    reasons = _reasons(rejected, [])
    if len(reasons.encode()) > SUMMARY_LIMIT_BYTES - _TAIL_BYTES:
        reasons = _reasons(*_closest_within(request, rejected,
                                            SUMMARY_LIMIT_BYTES - 2 * _TAIL_BYTES))
    return _cut(f"{head}: {why} ({reasons})" if reasons else f"{head}: {why}")


def place(request: PlacementRequest, nodes: Sequence[NodeView]) -> Placement | CantPlace:
    """Place one replica on ``nodes``, or say why it cannot be placed.

    Returns a ``Placement`` with exactly ``request.min_nodes`` shards on distinct nodes,
    rank 0 first (with a ``note`` when it must share a node with another replica of the
    deployment), or a ``CantPlace`` listing every node that was rejected with its reason,
    plus the shortfall when fewer nodes fit than the replica needs. See the module
    docstring for the rules. Deterministic: the order of ``nodes`` does not matter.
    Raises ``ValueError`` if a node id is listed twice.
    """
    _check_unique(nodes)
    rules = _Rules.of(request, nodes)
    # Only the verdict for every node; the decisions, with their words, for the nodes
    # chosen, or for every node when the answer must explain itself (a CantPlace, or a
    # note on sharing a node). At 1,000 nodes, a decision and its message for each was
    # half of a placement's time.
    fitting = [n for n in nodes if rules.failed(n) is None]
    if len(fitting) < request.min_nodes:
        return _cant_place(request, explain(request, nodes))

    siblings = set(request.sibling_node_ids)
    if rules.topological:
        together = _pick_by_topology(request, rules, fitting, siblings)
        if together is None:
            return _cant_together(request, rules, nodes)
        picked = together
    elif request.min_nodes == 1:
        need = rules.memory_bytes
        picked = [min(fitting, key=lambda n: (n.node_id in siblings, *_bin_pack_key(n, need)))]
    else:
        picked = sorted(fitting, key=lambda n: (n.node_id in siblings, *_emptiest_key(n)))[
            : request.min_nodes
        ]
    chosen = [_decide(request, rules, n) for n in picked]

    assignments = []
    for rank, (node, decision) in enumerate(zip(picked, chosen, strict=True)):
        indices = decision.gpu_indices
        gpu_memory = {g.index: g.memory_bytes for g in node.gpus}
        assignments.append(
            ShardAssignment(
                node_id=decision.node_id,
                rank=rank,
                memory_bytes=request.shard_memory_bytes,
                cpu_cores=request.cpu_cores or 0.0,
                gpu_indices=indices,
                gpu_memory_bytes=sum(gpu_memory[i] for i in indices) if indices else None,
                watts=request.watts or 0,
            )
        )
    note = None
    if any(n.node_id in siblings for n in picked):
        note = _sharing_note(request, explain(request, nodes), chosen)
    return Placement(assignments=assignments, note=note)


def _pick_by_topology(request: PlacementRequest, rules: _Rules, fitting: Sequence[NodeView],
                      siblings: set[NodeId]) -> list[NodeView] | None:
    """The replica's nodes when rules 9 or 10 apply, picked one shard at a time so that
    each pick counts the draw and the domain of the picks before it; None when fewer than
    ``min_nodes`` of ``fitting`` stay within the caps and the skew together. Among the
    nodes that still fit, the emptiest domain first (a spread), then the usual order."""
    label = rules.spread_label
    one = request.min_nodes == 1
    need = rules.memory_bytes
    state = rules.nothing_picked()

    def preference(node: NodeView) -> tuple[int, bool, int, int, NodeId]:
        in_domain = 0 if label is None else rules.domain_count(node.labels.get(label, ""),
                                                                state)
        pack = _bin_pack_key(node, need) if one else _emptiest_key(node)
        return (in_domain, node.node_id in siblings, *pack)

    picked: list[NodeView] = []
    left = list(fitting)
    for _ in range(request.min_nodes):
        # Every node of ``fitting`` passed with nothing picked yet.
        fit = left if not picked else [
            n for n in left if rules.topology_failed(n, state) is None]
        if not fit:
            return None
        best = min(fit, key=preference)
        picked.append(best)
        left.remove(best)
        state = rules.pick(state, best)
    return picked


def _cant_together(request: PlacementRequest, rules: _Rules,
                   nodes: Sequence[NodeView]) -> CantPlace:
    """Enough nodes take a shard each, but no ``min_nodes`` of them together stay within
    the power caps or the spread's skew: say so after the usual account."""
    result = _cant_place(request, explain(request, nodes))
    limits = []
    if rules.watts:
        limits.append(f"within the power caps at {rules.watts} W a shard")
    if request.spread is not None:
        limits.append(f"within max skew {request.spread.max_skew} over {request.spread.key}")
    summary = (f"{result.summary}; no {request.min_nodes} of the nodes that fit stay "
               f"{' and '.join(limits)} together")
    return result.model_copy(update={"summary": _cut(summary)})


def _cant_place(request: PlacementRequest, decisions: Sequence[NodeDecision]) -> CantPlace:
    """Why ``request`` fits nowhere, from every node's decision."""
    fitting = [d for d in decisions if d.fits]
    registered = {d.node_id for d in decisions}
    unknown = sorted({i for i in request.node_ids or [] if i not in registered})
    return CantPlace(
        rejections=[d.rejection for d in decisions if d.rejection is not None],
        fitting_node_ids=[d.node_id for d in fitting],
        needed_nodes=request.min_nodes,
        unknown_node_ids=unknown,
        summary=_summary(request, decisions, fitting, unknown),
    )


def apply(nodes: Sequence[NodeView], placement: Placement) -> list[NodeView]:
    """The nodes, in the given order, with ``placement``'s claims added.

    Memory and CPU claims are added as they are, even past a node's capacity: checking
    capacity is ``place``'s job, and a simulation wants to see an over-claim, not have it
    hidden. A GPU claim cannot be "added past capacity", so claiming a GPU that is already
    claimed or not on the node raises ``ValueError``, as does a shard on an unknown node.
    """
    by_node = {a.node_id: a for a in placement.assignments}
    known = {n.node_id for n in nodes}
    missing = [i for i in by_node if i not in known]
    if missing:
        raise ValueError(f"placement uses unknown nodes: {', '.join(missing)}")
    result = []
    for node in nodes:
        shard = by_node.get(node.node_id)
        if shard is None:
            result.append(node)
            continue
        present = {g.index for g in node.gpus}
        for index in shard.gpu_indices:
            if index in node.gpu_claimed:
                raise ValueError(f"node {node.node_id}: gpu {index} is already claimed")
            if index not in present:
                raise ValueError(f"node {node.node_id}: has no gpu {index}")
        result.append(
            node.model_copy(
                update={
                    "memory_claimed_bytes": node.memory_claimed_bytes + shard.memory_bytes,
                    "cpu_claimed": node.cpu_claimed + shard.cpu_cores,
                    "gpu_claimed": sorted({*node.gpu_claimed, *shard.gpu_indices}),
                    "watts_claimed": node.watts_claimed + shard.watts,
                }
            )
        )
    return result
