"""Which idle replica of another on-demand model to stop, so that a model somebody asked
for can be placed. Pure: the asking replica's placement request, the nodes with their
claims, the candidates with their usage, and the time come in as arguments;
:func:`choose_victim` answers one victim (:class:`EvictionChoice`) or why there is none
(:class:`NoVictim`, naming every candidate refused and why, as placement names every node).

It chooses and nothing more: the deployment that cannot be placed asks the victim's
deployment workflow to retire it (an ``evict`` update), and places again once the room is
freed, where placement's own locked re-check decides. The choice can be stale by then;
the victim's workflow refuses an eviction of a replica no longer idle.

Rules for each candidate, in order (the first that fails is its refusal; each has its test
in ``tests/unit/test_eviction.py``):

1. **Another deployment.** Never a replica of the deployment asking (it would evict itself
   to place itself).
2. **On demand only** (``min_replicas`` 0). A model at min 1 or more is a promise that it
   stays up: breaking it to serve another model's request would make every guarantee
   conditional on load. A deployment with no policy is fixed at its count: a promise too.
3. **Single-node only.** A replica spanning nodes frees several machines at once and costs
   every shard's load to rebuild.
4. **Serving or asleep.** Only ``ready`` replicas, or ``sleeping`` ones (which free what
   they keep, their weights). One starting, draining, stopping or unreachable is on its
   way in or out already.
5. **Unknown is not idle.** A replica with no usage reported (no fresh gateway row: a
   gateway that has just restarted knows nothing) is never a victim.
6. **Not in use.** Never one with requests in flight.
7. **Protection.** Never one that became ready less than ``protect_s`` ago
   (``eviction_protect_s``): two on-demand models with room for one would otherwise evict
   each other at a model load per request, worse for both than one of them waiting; the
   window bounds their turns to one per window.

Then, among the candidates left:

* **Order:** the most idle first; among equally idle ones, the smallest first (the memory
  it holds, what stopping it frees), then by replica id so the order never depends on how
  the candidates were listed. Idle time counts from the latest of its last use, when the
  gateways began reporting it, and when it became ready (as the scaling rules count it);
  "equally idle" means idle the same number of whole minutes (:data:`IDLE_BUCKET_S`): a
  flush's jitter of seconds must not outrank a replica half the size.
* **Tried on a copy.** Each candidate in that order has its claims removed from a copy of
  the nodes, and :func:`~.placement.place` runs for the asking replica on the copy; the
  first that makes the room alone is the victim. Nothing is ever stopped that does not
  make the room.
* **Only the replicas that make the room.** When no single candidate makes the room, they
  are added to the copy in the same order until the replica fits, and that set is pruned
  to the ones it needs (each is dropped, least preferred first, if the rest still make the
  room): freed room on the wrong node is not a reason to stop anything. The victim is the
  first of that set, and :attr:`EvictionChoice.also_needed` names the rest: still one
  eviction at a time. The next placement that finds no room asks again, and the rules
  apply afresh to what is left (a replica of the set that was used meanwhile is then
  refused, and the one stopped first was stopped for nothing: the price of never stopping
  two at once). If even every candidate together would not make the room, none is chosen:
  the model waits, as it would with nothing to evict.
* The asking replica already fits without stopping anything: no victim
  (:attr:`NoVictim.fits_now`), place it.

**Preemption** (issue 22; only when the caller describes the asker with an
:class:`Asker`). A candidate that passes rules 1, 3 and 4 is then judged by these, in
order; the first of 9-12 that holds says how it is stopped (each rule has its test in
``tests/unit/test_preemption.py``):

8. **Guarantees** (whatever the kind, with or without an asker): a candidate is never
   stopped for another scope if that takes its owner's scope below its guarantee. A
   scope's *spare* is what it holds beyond its guarantee, part by part (memory, GPUs,
   cores; :func:`~.capacity.held_by` over every replica's :class:`~.capacity.Holding`); a
   candidate may go only if, with the candidates let go before it (in the order below),
   what is taken from the scope fits in its spare in every part the candidate holds. Every
   scope on the candidate's path with a guarantee counts (a project's promise and its
   team's), except one the asker's owner is beneath too: moving room within a scope breaks
   no promise made to it. This is :func:`~.capacity.borrowed` made exact for a replica:
   one whose stopping leaves its scope holding its guarantee is borrowed room; one that
   straddles the line is within the guarantee. No quotas (the default): nobody is guarded.
9. **Idle on demand** (:attr:`VictimKind.EVICT`): rules 2 and 5-7 above, and its class
   does not outrank the asker's (an idle critical model is not evicted for a standard
   one). Its deployment's count is lowered, as in issue 21.
10. **Borrowed room taken back** (:attr:`VictimKind.PREEMPT`): the asker's owner is within
    its own guarantee even holding the new replica (:func:`~.capacity.within_guarantee`),
    and the candidate is another scope's (its owner is not beneath the asker's guarantee
    scope); rule 8 let it go, so it is borrowed. Whatever the classes: a guarantee is a
    promise, a class only an order of precedence.
11. **A lower class** (:attr:`VictimKind.PREEMPT`): the asker's class outranks the
    candidate's (:func:`~.capacity.outranks`). Its usage does not protect it (it is drained
    with a short grace, and its deployment keeps its count and holds back until room
    returns), nor does the protection window: the lower class cannot take the room back.
12. **Same class, grown under load** (:attr:`VictimKind.PREEMPT`): the asker is below its
    minimum, the candidate's class is the asker's, and it is room its deployment grew into
    (:attr:`Candidate.beyond_min`: more awake replicas than its minimum; a sleeper always,
    since a minimum promises replicas that serve). At most a deployment's surplus is taken
    (:attr:`RefusalReason.AT_MINIMUM` past it): never below its own minimum to bring
    another up to its.

A candidate none of 9-12 lets go keeps the refusal of the first of rules 2, 5-7 it failed,
its message saying why it may not be preempted either.

Order, for every kind together: the lowest class first, then the most idle (unknown or in
use counts as not idle), then the smallest, then replica id. Victims are tried on a copy
and pruned as above, class by class: first the lowest class's candidates (alone, then
together), then those of the next class up with them, and so on, so that a higher class
is stopped only when the lower ones cannot make the room. When any victim is preempted
(:attr:`EvictionChoice.together`), the whole pruned set is stopped together (each named
in :attr:`EvictionChoice.victims` with its kind), since a preemption is a step the
placement waits for, not a turn. Without an asker, classes still order the candidates
but nothing is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import Field

from .base import Frozen, Tolerant
from .capacity import (
    CLASS_RANK,
    CapacityClass,
    Holding,
    PreemptRequest,
    Quota,
    Resources,
    effective_class,
    guarantee_scope,
    held_by,
    outranks,
    scopes_of,
    within,
    within_guarantee,
)
from .demand import ReplicaUse, ScalingPolicy
from .ids import DeploymentId, NodeId, ReplicaId
from .placement import (
    SUMMARY_LIMIT_BYTES,
    NodeDecision,
    NodeView,
    Placement,
    PlacementRequest,
    explain,
    place,
)
from .status import ReplicaState
from .units import format_gib

#: Idle times are compared in whole minutes: usage is flushed every second or so and two
#: replicas left alone since about the same time differ by seconds of jitter, which must
#: not decide between a small one and one four times its size. A minute is also what the
#: reason shows ("idle 14 min"), so what reads as equally idle is equally idle.
IDLE_BUCKET_S = 60.0

#: Room kept at the end of :attr:`NoVictim.reason` for "; and 480 more" when the list of
#: refusals is cut to :data:`~.placement.SUMMARY_LIMIT_BYTES`.
_TAIL_BYTES = 64

#: The states a victim may be in (rule 4).
EVICTABLE_STATES = frozenset({ReplicaState.READY, ReplicaState.SLEEPING})


class VictimClaim(Frozen):
    """One claim of a candidate on a node (an allocation row), as stopping it frees it."""

    node_id: NodeId
    #: What the replica holds there now: all of its memory awake, its weights asleep.
    memory_bytes: int = Field(ge=0)
    cpu_cores: float = Field(default=0.0, ge=0)
    gpu_indices: list[int] = Field(default_factory=list)
    #: Set while asleep: what it held awake (and would take back on a wake).
    awake_memory_bytes: int | None = Field(default=None, ge=0)


class Candidate(Frozen):
    """A replica that might be stopped to make room, with what the rules read of it."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    #: Its deployment's scaling policy; None: fixed at its count (a promise, rule 2).
    policy: ScalingPolicy | None
    state: ReplicaState
    #: When it became ready; None while it never was.
    ready_at: datetime | None = None
    claims: list[VictimClaim] = Field(min_length=1)
    #: Its usage, summed over the gateways that report it; None: unknown (rule 5).
    use: ReplicaUse | None = None
    #: Its deployment's declared class; None: it follows the policy (:attr:`runs_as`).
    capacity_class: CapacityClass | None = None
    #: Its deployment's owner in the tenancy tree; None: nobody's (no quota counts it).
    owner: str | None = None
    #: How many awake replicas (ready or starting) its deployment runs, this one included
    #: when awake: what :attr:`beyond_min` compares with the policy's minimum.
    deployment_replicas: int = Field(default=0, ge=0)

    @property
    def freed_bytes(self) -> int:
        """The memory stopping it frees: what its claims hold now."""
        return sum(c.memory_bytes for c in self.claims)

    @property
    def runs_as(self) -> CapacityClass:
        """The class it runs as (:func:`~.capacity.effective_class`)."""
        return effective_class(self.capacity_class, self.policy)

    @property
    def holds(self) -> Resources:
        """What it holds, as quotas count it: its claims' memory, GPUs and cores."""
        return Resources(memory_bytes=self.freed_bytes,
                         gpus=sum(len(c.gpu_indices) for c in self.claims),
                         cpu_cores=sum(c.cpu_cores for c in self.claims))

    @property
    def beyond_min(self) -> bool:
        """Whether it is room its deployment grew into (rule 12): asleep (a minimum
        promises replicas that serve), or one of more awake replicas than the policy's
        minimum. A deployment with no policy is fixed at its count: never beyond."""
        if self.policy is None:
            return False
        if self.state is ReplicaState.SLEEPING:
            return True
        return self.deployment_replicas > self.policy.min_replicas

    @property
    def surplus(self) -> int:
        """How many of its deployment's awake replicas are beyond its minimum."""
        if self.policy is None:
            return 0
        return max(self.deployment_replicas - self.policy.min_replicas, 0)


class Asker(Frozen):
    """The deployment a replica is placed for, as the preemption rules read it."""

    deployment_id: DeploymentId
    #: The class it runs as (already :func:`~.capacity.effective_class`).
    capacity_class: CapacityClass
    owner: str | None = None
    #: Its awake replicas (ready or on their way), and its minimum: below it, rule 12
    #: lets it take what another deployment of its class grew into.
    replicas: int = Field(default=0, ge=0)
    min_replicas: int = Field(default=0, ge=0)
    #: What the new replica would hold (memory, GPUs and cores over all its shards).
    holds: Resources = Field(default_factory=Resources)

    @property
    def below_min(self) -> bool:
        return self.replicas < self.min_replicas


class VictimKind(StrEnum):
    """How a victim is stopped."""

    #: Issue 21's eviction: an idle on-demand replica, retired (its count lowered).
    EVICT = "evict"
    #: Drained with a short grace; its deployment keeps its count and holds back until
    #: room returns (a ``preempt`` signal, :class:`~.capacity.PreemptRequest`).
    PREEMPT = "preempt"


class Victim(Frozen):
    """One replica of a victim set, with how it is stopped and why."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    node_id: NodeId
    kind: VictimKind
    runs_as: CapacityClass
    freed_bytes: int = Field(ge=0)
    #: What stopping it frees, as quotas count it.
    frees: Resources = Field(default_factory=Resources)
    #: Why it may be stopped ("a lower class (opportunistic) than critical"), the words of
    #: a preempt signal's reason.
    why: str

    def preempt_request(self, by: DeploymentId) -> PreemptRequest:
        """The ``preempt`` signal that stops this victim for ``by`` (a PREEMPT victim;
        an EVICT one is retired by an ``evict`` update instead)."""
        return PreemptRequest(replica_id=self.replica_id, by=by,
                              reason=f"preempted by {by}: {self.why}"[:PREEMPT_REASON_CHARS])


#: The longest preempt reason :class:`~.capacity.PreemptRequest` takes.
PREEMPT_REASON_CHARS = 1024


class RefusalReason(StrEnum):
    """Why a candidate is not the victim. Stable strings: callers may match on them."""

    SAME_DEPLOYMENT = "same_deployment"
    NOT_ON_DEMAND = "not_on_demand"
    MULTI_NODE = "multi_node"
    NOT_SERVING = "not_serving"
    USAGE_UNKNOWN = "usage_unknown"
    IN_USE = "in_use"
    PROTECTED = "protected"
    #: Idle on demand, but its class outranks the asker's (rule 9).
    OUTRANKS = "outranks"
    #: Stopping it would take its owner's scope below its guarantee (rule 8).
    GUARANTEED = "guaranteed"
    #: Same class and grown under load, but its deployment's surplus is already taken
    #: (rule 12): one more would take it below its own minimum.
    AT_MINIMUM = "at_minimum"
    #: It passed every rule, but stopping it (alone, or with the others) makes no room.
    NO_ROOM = "no_room"


class Refusal(Frozen):
    """One candidate that is not the victim, with a message an operator can act on."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    reason_code: RefusalReason
    #: e.g. "min 1: a promise", "2 requests in flight", "ready 2 min ago, protected 5 min".
    message: str


class EvictionChoice(Tolerant):
    """The victim: stopping it makes the room (with :attr:`also_needed`, when it takes
    more than one)."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    node_id: NodeId
    #: The memory its claims hold, which stopping it frees.
    freed_bytes: int = Field(ge=0)
    #: How long it has been unused, in seconds (0 for a preempted one: its usage is not
    #: what let it go).
    idle_s: float = Field(ge=0)
    #: It is asleep (holding only its weights).
    asleep: bool = False
    #: The other replicas that must go too before the room is made, in the order they
    #: will be asked for; empty when this one makes the room alone.
    also_needed: list[ReplicaId] = Field(default_factory=list)
    #: How this one is stopped (evict: retire it; preempt: drain it, count kept).
    kind: VictimKind = VictimKind.EVICT
    #: Every replica of the set, this one first, each with its kind.
    victims: list[Victim] = Field(default_factory=list)
    #: Some victim is preempted: stop the whole set together (a preemption is a step the
    #: placement waits for). False: evictions only, one at a time as before.
    together: bool = False
    #: Where the asking replica would go once the room is made (on the copy).
    place_on: list[NodeId] = Field(default_factory=list)
    #: "evicted d-chat (replica r1, idle 14 min, 8.0 GiB on n1) to place d-code".
    reason: str


class NoVictim(Tolerant):
    """Nothing is to be stopped: why, and every candidate refused with its reason."""

    reason: str
    #: The asking replica fits as the nodes stand: place it, evict nothing.
    fits_now: bool = False
    refusals: list[Refusal] = Field(default_factory=list)
    #: When the first candidate refused only for its protection window leaves it: the
    #: asking deployment seeks again then (None: none is merely protected).
    retry_at: datetime | None = None


def _minutes(seconds: float) -> str:
    """Whole minutes, rounded down as :data:`IDLE_BUCKET_S` counts them ("14 min" for
    14 min 50 s); seconds below two minutes."""
    return f"{int(seconds // 60)} min" if seconds >= 120 else f"{int(seconds)} s"


def idle_s(candidate: Candidate, now: datetime) -> float | None:
    """Seconds ``candidate`` has been unused at ``now``; None when its usage is unknown.
    Counted from the latest of its last use, when the gateways began reporting it, and
    when it became ready (what ``demand.step`` counts for idle stop)."""
    if candidate.use is None:
        return None
    since = candidate.use.idle_since
    if candidate.ready_at is not None:
        since = max(since, candidate.ready_at)
    return max((now - since).total_seconds(), 0.0)


def _refusal(candidate: Candidate, for_deployment: DeploymentId, now: datetime,
             protect_s: float) -> Refusal | None:
    """The first rule (the module docstring's 1-7, in order) ``candidate`` fails; None
    when it may be tried on the copy."""

    def refused(code: RefusalReason, message: str) -> Refusal:
        return Refusal(replica_id=candidate.replica_id, deployment_id=candidate.deployment_id,
                       reason_code=code, message=message)

    if candidate.deployment_id == for_deployment:
        return refused(RefusalReason.SAME_DEPLOYMENT, "a replica of the deployment asking")
    policy = candidate.policy
    if policy is None:
        return refused(RefusalReason.NOT_ON_DEMAND,
                       "no scaling policy: fixed at its replica count, a promise")
    if policy.min_replicas > 0:
        return refused(RefusalReason.NOT_ON_DEMAND,
                       f"min {policy.min_replicas}: a promise, not on demand")
    nodes = sorted({c.node_id for c in candidate.claims})
    if len(nodes) > 1:
        return refused(RefusalReason.MULTI_NODE, f"spans {len(nodes)} nodes")
    if candidate.state not in EVICTABLE_STATES:
        return refused(RefusalReason.NOT_SERVING, f"{candidate.state.value}, not serving")
    if candidate.use is None:
        return refused(RefusalReason.USAGE_UNKNOWN,
                       "usage unknown: no gateway has reported it (unknown is not idle)")
    if candidate.use.in_flight > 0:
        return refused(RefusalReason.IN_USE, f"{candidate.use.in_flight} request(s) in flight")
    if candidate.ready_at is None:
        return refused(RefusalReason.PROTECTED, "never became ready")
    served_s = (now - candidate.ready_at).total_seconds()
    if served_s < protect_s:
        return refused(RefusalReason.PROTECTED,
                       f"ready {_minutes(max(served_s, 0.0))} ago, protected for "
                       f"{_minutes(protect_s)} after it starts serving")
    return None


def _preference(candidate: Candidate, now: datetime) -> tuple[int, float, int, str]:
    """The lowest class first, then the most idle (in whole minutes; unknown or in use
    is not idle), then the smallest, then by replica id."""
    idle = idle_s(candidate, now)
    if idle is None or (candidate.use is not None and candidate.use.in_flight > 0):
        idle = 0.0
    return (CLASS_RANK[candidate.runs_as], -(idle // IDLE_BUCKET_S), candidate.freed_bytes,
            candidate.replica_id)


@dataclass(frozen=True, slots=True)
class _Judged:
    """A candidate rules 1-12 let go (before rule 8's and 12's running totals). A plain
    dataclass: one is made per candidate, and validating a thousand of them was a fifth
    of a choice's time at 1,000 candidates."""

    candidate: Candidate
    kind: VictimKind
    why: str
    #: Rule 12's: counts against its deployment's surplus.
    grown: bool = False


def _common_refusal(candidate: Candidate, for_deployment: DeploymentId) -> Refusal | None:
    """Rules 1, 3 and 4, which hold for every kind of victim."""
    if candidate.deployment_id == for_deployment:
        return _refused(candidate, RefusalReason.SAME_DEPLOYMENT,
                        "a replica of the deployment asking")
    nodes = sorted({c.node_id for c in candidate.claims})
    if len(nodes) > 1:
        return _refused(candidate, RefusalReason.MULTI_NODE, f"spans {len(nodes)} nodes")
    if candidate.state not in EVICTABLE_STATES:
        return _refused(candidate, RefusalReason.NOT_SERVING,
                        f"{candidate.state.value}, not serving")
    return None


def _refused(candidate: Candidate, code: RefusalReason, message: str) -> Refusal:
    return Refusal(replica_id=candidate.replica_id, deployment_id=candidate.deployment_id,
                   reason_code=code, message=message)


class _Judge:
    """Rules 9-12 for one asker (the module docstring's), and rule 8's guarded scopes."""

    def __init__(self, *, asker: Asker, now: datetime, protect_s: float,
                 quotas: Sequence[Quota], holdings: Sequence[Holding]) -> None:
        self.asker = asker
        self.now = now
        self.protect_s = protect_s
        guarantee = guarantee_scope(asker.owner, quotas)
        #: Rule 10: the asker's guarantee scope, when the new replica keeps it within.
        self.reclaim_scope = (
            guarantee.scope if guarantee is not None
            and within_guarantee(asker.owner, asker.holds, quotas, holdings) else None)

    def judge(self, candidate: Candidate) -> _Judged | Refusal:
        asker = self.asker
        idle = _refusal(candidate, asker.deployment_id, self.now, self.protect_s)
        mine, theirs = asker.capacity_class, candidate.runs_as
        if idle is None and outranks(theirs, mine):
            idle = _refused(candidate, RefusalReason.OUTRANKS,
                            f"{theirs.value} outranks {mine.value}")
        if idle is None:
            idle_for = idle_s(candidate, self.now) or 0.0
            return _Judged(candidate=candidate, kind=VictimKind.EVICT,
                           why=f"idle {_minutes(idle_for)}, on demand")
        if self.reclaim_scope is not None and (
                candidate.owner is None or not within(candidate.owner, self.reclaim_scope)):
            return _Judged(candidate=candidate, kind=VictimKind.PREEMPT,
                           why=f"borrowed room taken back for scope {self.reclaim_scope!r}, "
                               "within its guarantee")
        if outranks(mine, theirs):
            return _Judged(candidate=candidate, kind=VictimKind.PREEMPT,
                           why=f"a lower class ({theirs.value}) than {mine.value}")
        if mine == theirs and asker.below_min and candidate.beyond_min:
            return _Judged(candidate=candidate, kind=VictimKind.PREEMPT, grown=True,
                           why=f"grown beyond its minimum, for {asker.deployment_id} below "
                               f"its minimum of {asker.min_replicas}")
        return idle.model_copy(update={
            "message": f"{idle.message}; not preempted: {self._why_not(candidate)}"})

    def _why_not(self, candidate: Candidate) -> str:
        asker = self.asker
        mine, theirs = asker.capacity_class, candidate.runs_as
        if mine != theirs:
            return f"{theirs.value} is not below {mine.value}"
        if not asker.below_min:
            return (f"same class ({mine.value}), and {asker.deployment_id} is not below "
                    f"its minimum")
        return f"same class ({mine.value}), and its deployment is at its minimum"


def _part_over(holds: Resources, taken: Resources, spare: Resources) -> str | None:
    """The first part ``holds`` has (memory, GPUs, cores) that would take ``taken``
    past ``spare``, described; None when every part it holds fits."""
    if holds.memory_bytes and taken.memory_bytes + holds.memory_bytes > spare.memory_bytes:
        return f"memory (spare {format_gib(spare.memory_bytes - taken.memory_bytes)})"
    if holds.gpus and taken.gpus + holds.gpus > spare.gpus:
        return f"gpus (spare {spare.gpus - taken.gpus})"
    if (holds.cpu_cores > _CPU_EPSILON
            and taken.cpu_cores + holds.cpu_cores > spare.cpu_cores + _CPU_EPSILON):
        return f"cpu_cores (spare {max(spare.cpu_cores - taken.cpu_cores, 0.0):g})"
    return None


#: Slack for comparing summed fractional cores, as :mod:`.capacity` compares them.
_CPU_EPSILON = 1e-9


class _Guarantees:
    """Rule 8: what may still be taken from each guaranteed scope, as victims are let go
    in order (a running total per scope, so that two replicas that each fit a scope's
    spare alone are not both taken from it)."""

    def __init__(self, *, asker_owner: str | None, quotas: Sequence[Quota],
                 holdings: Sequence[Holding]) -> None:
        self.asker_owner = asker_owner
        self.quotas = {q.scope: q for q in quotas if not q.guarantee.empty}
        self.holdings = holdings
        self.taken: dict[str, Resources] = {}
        self._spare: dict[str, Resources] = {}

    def scopes(self, candidate: Candidate) -> list[str]:
        """The guaranteed scopes on the candidate's path the asker is not beneath."""
        if candidate.owner is None:
            return []
        return [s for s in scopes_of(candidate.owner) if s in self.quotas
                and (self.asker_owner is None or not within(self.asker_owner, s))]

    def spare(self, scope: str) -> Resources:
        if scope not in self._spare:
            self._spare[scope] = (held_by(scope, self.holdings)
                                  - self.quotas[scope].guarantee)
        return self._spare[scope]

    def refusal(self, candidate: Candidate) -> Refusal | None:
        for scope in self.scopes(candidate):
            over = _part_over(candidate.holds, self.taken.get(scope, Resources()),
                              self.spare(scope))
            if over is not None:
                guarantee = self.quotas[scope].guarantee
                return _refused(
                    candidate, RefusalReason.GUARANTEED,
                    f"within scope {scope!r}'s guarantee ({guarantee.describe()}; it holds "
                    f"{held_by(scope, self.holdings).describe()}): stopping it takes "
                    f"{candidate.holds.describe()} past its {over}")
        return None

    def take(self, candidate: Candidate) -> None:
        for scope in self.scopes(candidate):
            self.taken[scope] = self.taken.get(scope, Resources()) + candidate.holds


def without(nodes: Sequence[NodeView], victims: Sequence[Candidate]) -> list[NodeView]:
    """A copy of ``nodes`` (in their order) with every claim of ``victims`` removed. A
    claim on a node not listed frees nothing (the node is gone)."""
    freed: dict[NodeId, list[VictimClaim]] = {}
    for victim in victims:
        for claim in victim.claims:
            freed.setdefault(claim.node_id, []).append(claim)
    result = []
    for node in nodes:
        claims = freed.get(node.node_id)
        if not claims:
            result.append(node)
            continue
        gone = {i for c in claims for i in c.gpu_indices}
        result.append(node.model_copy(update={
            # Floored at 0: the claims were read with the nodes' sums in one snapshot, but
            # a copy must never hold less than nothing.
            "memory_claimed_bytes": max(
                node.memory_claimed_bytes - sum(c.memory_bytes for c in claims), 0),
            "cpu_claimed": max(node.cpu_claimed - sum(c.cpu_cores for c in claims), 0.0),
            "gpu_claimed": [i for i in node.gpu_claimed if i not in gone],
        }))
    return result


def _no_room_message(candidate: Candidate, after: NodeDecision | None) -> str:
    node = candidate.claims[0].node_id
    freed = format_gib(candidate.freed_bytes)
    if after is None:
        return f"its node {node} is not registered"
    if after.fits:
        # Its node would take a shard, but the replica needs more nodes than fit.
        return f"stopping it frees {freed} on {node}, but fewer nodes than needed fit"
    return f"stopping it frees {freed} on {node}, not enough: {after.message}"


def _reason(victim: Candidate, idle: float, for_deployment: DeploymentId,
            also_needed: Sequence[Candidate]) -> str:
    asleep = ", asleep" if victim.state is ReplicaState.SLEEPING else ""
    text = (f"evicted {victim.deployment_id} (replica {victim.replica_id}, idle "
            f"{_minutes(idle)}{asleep}, {format_gib(victim.freed_bytes)} on "
            f"{victim.claims[0].node_id}) to place {for_deployment}")
    if also_needed:
        text += (f" (1 of {len(also_needed) + 1} needed; next "
                 f"{', '.join(c.replica_id for c in also_needed)})")
    return text


def _together_reason(victims: Sequence[Victim], for_deployment: DeploymentId) -> str:
    """"stopping 2 replicas to place d-code: preempt d-exp (replica r1, opportunistic,
    8.0 GiB on n1: a lower class (opportunistic) than critical); evict ..."."""
    parts = [f"{v.kind.value} {v.deployment_id} (replica {v.replica_id}, {v.runs_as.value}, "
             f"{format_gib(v.freed_bytes)} on {v.node_id}: {v.why})" for v in victims]
    head = f"stopping {len(victims)} replica{'s' if len(victims) != 1 else ''} to place "
    return _cut(head + f"{for_deployment}: " + "; ".join(parts))


def _cut(text: str) -> str:
    """Bounded like placement's summary: it travels in activity results and events."""
    raw = text.encode()
    if len(raw) <= SUMMARY_LIMIT_BYTES:
        return text
    return raw[:SUMMARY_LIMIT_BYTES - _TAIL_BYTES].decode(errors="ignore") + "; ..."


def _chosen(victims: Sequence[_Judged], placement: Placement, *,
            for_deployment: DeploymentId, now: datetime) -> EvictionChoice:
    first, *also = [j.candidate for j in victims]
    idle = idle_s(first, now)
    listed = [Victim(replica_id=j.candidate.replica_id, deployment_id=j.candidate.deployment_id,
                     node_id=j.candidate.claims[0].node_id, kind=j.kind,
                     runs_as=j.candidate.runs_as, freed_bytes=j.candidate.freed_bytes,
                     frees=j.candidate.holds, why=j.why)
              for j in victims]
    together = any(v.kind is VictimKind.PREEMPT for v in listed)
    if together or idle is None:
        reason = _together_reason(listed, for_deployment)
    else:
        reason = _reason(first, idle, for_deployment, also)
    return EvictionChoice(
        replica_id=first.replica_id, deployment_id=first.deployment_id,
        node_id=first.claims[0].node_id, freed_bytes=first.freed_bytes,
        idle_s=idle if idle is not None and victims[0].kind is VictimKind.EVICT else 0.0,
        asleep=first.state is ReplicaState.SLEEPING,
        also_needed=[c.replica_id for c in also], place_on=placement.node_ids,
        kind=victims[0].kind, victims=listed, together=together, reason=reason)


def _summary(head: str, refusals: Sequence[Refusal]) -> str:
    """``head``, then each refusal ("r1 (d-chat): min 1: a promise"), bounded like
    placement's summary: it travels in activity results and events."""
    text = head
    for i, r in enumerate(refusals):
        part = f"{'; ' if i else ': '}{r.replica_id} ({r.deployment_id}): {r.message}"
        if len((text + part).encode()) > SUMMARY_LIMIT_BYTES - _TAIL_BYTES:
            return text + f"; and {len(refusals) - i} more"
        text += part
    return text


class _Room:
    """Whether stopping some victims makes the room, node by node.

    A victim frees claims on its one node only, and whether a node takes a shard depends
    on that node alone; :func:`~.placement.place` fails only when fewer nodes take a shard
    than the replica needs. So the room a set of victims makes is the nodes that fit
    before, plus each node of theirs that fits once their claims there are gone: each try
    re-checks the nodes it changed, not the whole fleet (at 1,000 nodes and 1,000
    candidates, a full placement per try took two minutes for a choice that found none).
    """

    def __init__(self, request: PlacementRequest, nodes: Sequence[NodeView]) -> None:
        self.request = request
        self.by_id = {n.node_id: n for n in nodes}
        self.fitting = {d.node_id for d in explain(request, nodes) if d.fits}

    @property
    def fits_now(self) -> bool:
        return len(self.fitting) >= self.request.min_nodes

    def after(self, victims: Sequence[Candidate]) -> dict[NodeId, NodeDecision]:
        """Each node ``victims`` hold claims on (and that is registered), once those
        claims are gone."""
        held = sorted({c.claims[0].node_id for c in victims} & self.by_id.keys())
        changed = without([self.by_id[i] for i in held], victims)
        return {d.node_id: d for d in explain(self.request, changed)}

    def made(self, newly: int) -> bool:
        """Whether ``newly`` more fitting nodes make the room."""
        return len(self.fitting) + newly >= self.request.min_nodes

    def newly(self, decisions: dict[NodeId, NodeDecision]) -> set[NodeId]:
        return {i for i, d in decisions.items() if d.fits and i not in self.fitting}


def _fewest_together(room: _Room, eligible: Sequence[Candidate]) -> list[Candidate] | None:
    """The candidates that together make the room, in order, pruned to those needed; None
    when even all of them do not.

    Added in order, one node re-checked per candidate, until enough nodes fit. Each added
    candidate changes one node, so at that moment every node that came to fit is needed;
    the candidates on nodes that did not come to fit freed room on the wrong node and go.
    Then on each node that came to fit, its candidates are dropped least preferred first
    while the node still fits without them."""
    current: dict[NodeId, NodeView] = {}
    newly: set[NodeId] = set()
    added: list[Candidate] = []
    for candidate in eligible:
        node_id = candidate.claims[0].node_id
        node = current.get(node_id, room.by_id.get(node_id))
        if node is None:
            continue  # its node is gone: stopping it frees nothing
        [current[node_id]] = without([node], [candidate])
        added.append(candidate)
        [decision] = explain(room.request, [current[node_id]])
        if decision.fits and node_id not in room.fitting:
            newly.add(node_id)
        if room.made(len(newly)):
            break
    else:
        return None
    needed = [c for c in added if c.claims[0].node_id in newly]
    for node_id in sorted(newly):
        on_node = [c for c in needed if c.claims[0].node_id == node_id]
        for candidate in reversed(on_node):
            rest = [c for c in on_node if c is not candidate]
            if rest and room.after(rest)[node_id].fits:
                on_node = rest
                needed.remove(candidate)
    return needed


def choose_victim(request: PlacementRequest, nodes: Sequence[NodeView],
                  candidates: Sequence[Candidate], *, for_deployment: DeploymentId,
                  now: datetime, protect_s: float, asker: Asker | None = None,
                  quotas: Sequence[Quota] = (), holdings: Sequence[Holding] = (),
                  ) -> EvictionChoice | NoVictim:
    """The replica to stop so that ``request`` (a replica of ``for_deployment``) can be
    placed on ``nodes``, or why none is. See the module docstring for the rules.

    ``asker`` (its ``deployment_id`` must be ``for_deployment``) turns on preemption,
    rules 10-12; without it only idle on-demand replicas are evicted, as in issue 21.
    ``quotas`` and ``holdings`` (what every replica holds, by owner, the asker's own
    included) feed rules 8 and 10; empty, no guarantee guards anything.

    ``nodes`` must include every candidate's claims in their sums (read in one snapshot).
    Deterministic: the order of ``nodes`` and ``candidates`` does not matter.
    """
    if asker is not None and asker.deployment_id != for_deployment:
        raise ValueError(f"asker {asker.deployment_id} is not {for_deployment}")
    room = _Room(request, nodes)
    if room.fits_now:
        already = place(request, nodes)
        assert isinstance(already, Placement)  # as many nodes fit as it needs
        return NoVictim(fits_now=True,
                        reason=f"fits without evicting anything, on {', '.join(already.node_ids)}")
    refusals, eligible = _eligible(candidates, for_deployment=for_deployment, now=now,
                                   protect_s=protect_s, asker=asker, quotas=quotas,
                                   holdings=holdings)
    by_id = {j.candidate.replica_id: j for j in eligible}

    def chosen(victims: list[Candidate]) -> EvictionChoice:
        placement = place(request, without(nodes, victims))
        assert isinstance(placement, Placement)  # _Room said enough nodes fit on the copy
        return _chosen([by_id[c.replica_id] for c in victims], placement,
                       for_deployment=for_deployment, now=now)

    # Class by class, the lowest first: a higher class is stopped only when the lower
    # ones, alone or together, cannot make the room.
    no_room: dict[ReplicaId, Refusal] = {}
    for rank in sorted({CLASS_RANK[j.candidate.runs_as] for j in eligible}):
        tier = [j.candidate for j in eligible if CLASS_RANK[j.candidate.runs_as] <= rank]
        # One victim that makes the room alone, in order of preference.
        for candidate in tier:
            if candidate.replica_id in no_room:
                continue  # tried alone in a lower tier
            after = room.after([candidate])
            if room.made(len(room.newly(after))):
                return chosen([candidate])
            no_room[candidate.replica_id] = Refusal(
                replica_id=candidate.replica_id, deployment_id=candidate.deployment_id,
                reason_code=RefusalReason.NO_ROOM,
                message=_no_room_message(candidate, after.get(candidate.claims[0].node_id)))
        # None alone: the fewest, in order, that make it together.
        together = _fewest_together(room, tier)
        if together is not None:
            return chosen(together)

    refusals.extend(no_room[j.candidate.replica_id] for j in eligible)
    refusals.sort(key=lambda r: r.replica_id)
    verb = "evicted" if asker is None else "stopped"
    if not candidates:
        head = "no replica of another deployment is serving or asleep"
    elif eligible:
        head = (f"stopping every replica that may be {verb} ({len(eligible)}, "
                f"{format_gib(sum(j.candidate.freed_bytes for j in eligible))}) would not "
                "make room")
    else:
        head = f"none of {len(candidates)} replica(s) may be {verb}"
    return NoVictim(reason=_summary(head, refusals), refusals=refusals,
                    retry_at=_retry_at(candidates, refusals, now=now, protect_s=protect_s))


def _eligible(candidates: Sequence[Candidate], *, for_deployment: DeploymentId,
              now: datetime, protect_s: float, asker: Asker | None,
              quotas: Sequence[Quota], holdings: Sequence[Holding],
              ) -> tuple[list[Refusal], list[_Judged]]:
    """The candidates that may be stopped, in order of preference, and the refusals of
    the rest: rules 1-7 (without an asker) or 1, 3, 4 and 9-12 (with one), then rule 8
    and rule 12's surplus as running totals in that order."""
    judge = (_Judge(asker=asker, now=now, protect_s=protect_s, quotas=quotas,
                    holdings=holdings) if asker is not None else None)
    refusals: list[Refusal] = []
    judged: list[_Judged] = []
    for candidate in sorted(candidates, key=lambda c: c.replica_id):
        verdict: _Judged | Refusal | None
        if judge is None:
            verdict = _refusal(candidate, for_deployment, now, protect_s)
            if verdict is None:
                verdict = _Judged(candidate=candidate, kind=VictimKind.EVICT,
                                  why=f"idle {_minutes(idle_s(candidate, now) or 0.0)}")
        else:
            verdict = _common_refusal(candidate, for_deployment) or judge.judge(candidate)
        if isinstance(verdict, Refusal):
            refusals.append(verdict)
        else:
            judged.append(verdict)
    judged.sort(key=lambda j: _preference(j.candidate, now))

    guarantees = _Guarantees(asker_owner=asker.owner if asker is not None else None,
                             quotas=quotas, holdings=holdings)
    surplus_taken: dict[DeploymentId, int] = {}
    eligible: list[_Judged] = []
    for j in judged:
        candidate = j.candidate
        guarded = guarantees.refusal(candidate)
        if guarded is not None:
            refusals.append(guarded)
            continue
        # A sleeper is beyond the minimum whatever the count: it takes no surplus.
        counts = j.grown and candidate.state is not ReplicaState.SLEEPING
        if counts:
            used = surplus_taken.get(candidate.deployment_id, 0)
            if used >= candidate.surplus:
                refusals.append(_refused(
                    candidate, RefusalReason.AT_MINIMUM,
                    f"its deployment's {candidate.surplus} replica(s) beyond its minimum are "
                    "already taken"))
                continue
            surplus_taken[candidate.deployment_id] = used + 1
        guarantees.take(candidate)
        eligible.append(j)
    return refusals, eligible


#: A candidate refused for a while only (in use, its usage not reported yet, or still
#: starting) may be a victim soon: the asking deployment seeks again this much later. A
#: gateway reports usage every second and a request is seconds long; 15 s is a few of
#: each, and costs one find_eviction (a few history events) per 15 s while it waits.
RESEEK_S = 15.0
#: Refusals that pass with time; the rest (a promise, several nodes, the asking
#: deployment's own, too small) do not, and leave the model cant_place.
PASSING = frozenset({RefusalReason.PROTECTED, RefusalReason.IN_USE,
                     RefusalReason.USAGE_UNKNOWN, RefusalReason.NOT_SERVING})


def _retry_at(candidates: Sequence[Candidate], refusals: Sequence[Refusal], *,
              now: datetime, protect_s: float) -> datetime | None:
    """When to seek again: the first protection window to end, or RESEEK_S from now for
    a candidate refused for a moment (in use, unreported, starting: once ready it is
    protected, and seeking then learns until when); None if no refusal passes with
    time."""
    by_id = {c.replica_id: c for c in candidates}
    times: list[datetime] = []
    for refusal in refusals:
        if refusal.reason_code not in PASSING:
            continue
        candidate = by_id.get(refusal.replica_id)
        if (refusal.reason_code is RefusalReason.PROTECTED and candidate is not None
                and candidate.ready_at is not None):
            times.append(candidate.ready_at + timedelta(seconds=protect_s))
        else:
            times.append(now + timedelta(seconds=RESEEK_S))
    return min(times) if times else None
