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
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import Field

from .base import Frozen, Tolerant
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

    @property
    def freed_bytes(self) -> int:
        """The memory stopping it frees: what its claims hold now."""
        return sum(c.memory_bytes for c in self.claims)


class RefusalReason(StrEnum):
    """Why a candidate is not the victim. Stable strings: callers may match on them."""

    SAME_DEPLOYMENT = "same_deployment"
    NOT_ON_DEMAND = "not_on_demand"
    MULTI_NODE = "multi_node"
    NOT_SERVING = "not_serving"
    USAGE_UNKNOWN = "usage_unknown"
    IN_USE = "in_use"
    PROTECTED = "protected"
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
    #: How long it has been unused, in seconds.
    idle_s: float = Field(ge=0)
    #: It is asleep (holding only its weights).
    asleep: bool = False
    #: The other replicas that must go too before the room is made, in the order they
    #: will be asked for; empty when this one makes the room alone.
    also_needed: list[ReplicaId] = Field(default_factory=list)
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


def _preference(candidate: Candidate, now: datetime) -> tuple[float, int, str]:
    """Most idle first (in whole minutes), then the smallest, then by replica id."""
    idle = idle_s(candidate, now)
    assert idle is not None  # rule 5 refused the unknown ones
    return (-(idle // IDLE_BUCKET_S), candidate.freed_bytes, candidate.replica_id)


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


def _chosen(victim: Candidate, placement: Placement, *, for_deployment: DeploymentId,
            now: datetime, also_needed: Sequence[Candidate] = ()) -> EvictionChoice:
    idle = idle_s(victim, now)
    assert idle is not None
    return EvictionChoice(
        replica_id=victim.replica_id, deployment_id=victim.deployment_id,
        node_id=victim.claims[0].node_id, freed_bytes=victim.freed_bytes, idle_s=idle,
        asleep=victim.state is ReplicaState.SLEEPING,
        also_needed=[c.replica_id for c in also_needed], place_on=placement.node_ids,
        reason=_reason(victim, idle, for_deployment, also_needed))


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
                  now: datetime, protect_s: float) -> EvictionChoice | NoVictim:
    """The replica to stop so that ``request`` (a replica of ``for_deployment``) can be
    placed on ``nodes``, or why none is. See the module docstring for the rules.

    ``nodes`` must include every candidate's claims in their sums (read in one snapshot).
    Deterministic: the order of ``nodes`` and ``candidates`` does not matter.
    """
    room = _Room(request, nodes)
    if room.fits_now:
        already = place(request, nodes)
        assert isinstance(already, Placement)  # as many nodes fit as it needs
        return NoVictim(fits_now=True,
                        reason=f"fits without evicting anything, on {', '.join(already.node_ids)}")
    refusals: list[Refusal] = []
    eligible: list[Candidate] = []
    for candidate in sorted(candidates, key=lambda c: c.replica_id):
        refusal = _refusal(candidate, for_deployment, now, protect_s)
        if refusal is None:
            eligible.append(candidate)
        else:
            refusals.append(refusal)
    eligible.sort(key=lambda c: _preference(c, now))

    def chosen(victims: list[Candidate]) -> EvictionChoice:
        placement = place(request, without(nodes, victims))
        assert isinstance(placement, Placement)  # _Room said enough nodes fit on the copy
        first, *also = victims
        return _chosen(first, placement, for_deployment=for_deployment, now=now,
                       also_needed=also)

    # One victim that makes the room alone, in order of preference.
    no_room: dict[ReplicaId, Refusal] = {}
    for candidate in eligible:
        after = room.after([candidate])
        if room.made(len(room.newly(after))):
            return chosen([candidate])
        no_room[candidate.replica_id] = Refusal(
            replica_id=candidate.replica_id, deployment_id=candidate.deployment_id,
            reason_code=RefusalReason.NO_ROOM,
            message=_no_room_message(candidate, after.get(candidate.claims[0].node_id)))

    # None alone: the fewest, in order, that make it together.
    together = _fewest_together(room, eligible)
    if together is not None:
        return chosen(together)

    refusals.extend(no_room[c.replica_id] for c in eligible)
    refusals.sort(key=lambda r: r.replica_id)
    if not candidates:
        head = "no replica of another deployment is serving or asleep"
    elif eligible:
        head = (f"stopping every replica that may be evicted ({len(eligible)}, "
                f"{format_gib(sum(c.freed_bytes for c in eligible))}) would not make room")
    else:
        head = f"none of {len(candidates)} replica(s) may be evicted"
    return NoVictim(reason=_summary(head, refusals), refusals=refusals,
                    retry_at=_retry_at(candidates, refusals, now=now, protect_s=protect_s))


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
