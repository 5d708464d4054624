"""How many more replicas of a deployment fit: now, and by stopping what the eviction and
preemption rules (:mod:`.eviction`) would let go, naming exactly the replicas each extra
replica would stop. Pure: the request, the nodes, the candidates, quotas, holdings and
the time come in as arguments; :func:`headroom` answers a :class:`Headroom`.

How it counts, on a copy of the nodes:

1. **Now.** :func:`~.placement.place` and :func:`~.placement.apply` again and again,
   each new replica a sibling of the last (placement spreads them as it would), until one
   does not fit.
2. **By stopping.** Then, for each further replica, :func:`~.eviction.choose_victim` on
   the copy as it stands, with the candidates not yet stopped: its whole pruned set is
   one :class:`HeadroomStep`. Only the replicas that make the room are named (candidates
   tried and not needed are not): the set is the one the choice would stop. The victims
   are removed from the copy and the replica placed there; when the room freed by earlier
   steps holds another replica, that step names no victims.
3. **Limits.** With an asker that has an owner, each replica is first checked against the
   owner's quotas (:func:`~.capacity.limit_refusal`): a limit stops the count, with its
   numbers, as it would refuse the scale-up.
4. **Cap.** The count stops at ``cap`` (:data:`HEADROOM_CAP`), said in
   :attr:`Headroom.capped`.

Each extra replica is added to the asker's count and to its owner's holdings before the
next is counted, so the asker's minimum (rule 12) and its guarantee (rule 10) are read as
they would stand then.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import Field

from .base import Frozen
from .capacity import Holding, Quota, Resources, limit_refusal
from .eviction import Asker, Candidate, NoVictim, Victim, choose_victim, without
from .ids import DeploymentId, NodeId, ReplicaId
from .placement import NodeView, Placement, PlacementRequest, apply, place

#: The most replicas :func:`headroom` counts: "64 or more" answers every question an
#: operator asks of one model (a cluster with room for more is not short of room), and it
#: bounds the work to 64 placements and 64 victim choices on the copy, a few milliseconds
#: each at 1,000 nodes.
HEADROOM_CAP = 64


class HeadroomStep(Frozen):
    """One more replica by stopping others: exactly the replicas that make its room."""

    #: The victims, in the order they would be stopped, each with its kind; empty when
    #: room freed by an earlier step holds this replica too.
    victims: list[Victim] = Field(default_factory=list)
    #: What stopping them frees, summed (memory, GPUs, cores).
    frees: Resources = Field(default_factory=Resources)
    #: Where the replica would go.
    place_on: list[NodeId] = Field(default_factory=list)

    @property
    def victim_ids(self) -> list[ReplicaId]:
        return [v.replica_id for v in self.victims]


class Headroom(Frozen):
    """How many more replicas fit now, and how many more by stopping others."""

    #: More replicas that fit without stopping anything.
    now: int = Field(ge=0)
    #: Each further replica that stopping others would make room for.
    by_stopping: list[HeadroomStep] = Field(default_factory=list)
    #: The count reached the cap: there may be more.
    capped: bool = False
    #: Why no more were counted: the placement's summary, why nothing more may be
    #: stopped, a quota limit, or the cap.
    reason: str

    @property
    def total(self) -> int:
        return self.now + len(self.by_stopping)


def _released(holdings: Sequence[Holding], victims: Sequence[Candidate]) -> list[Holding]:
    """``holdings`` less what ``victims`` held, taken from their owners' holdings in order
    (holdings may be one per replica or summed per owner; either way the owner's total
    drops by the victim's)."""
    result = list(holdings)
    for victim in victims:
        left = victim.holds
        for i, holding in enumerate(result):
            if left.empty:
                break
            if holding.owner != victim.owner or victim.owner is None:
                continue
            after = holding.resources - left
            left = left - holding.resources
            result[i] = holding.model_copy(update={"resources": after})
    return result


def headroom(request: PlacementRequest, nodes: Sequence[NodeView],
             candidates: Sequence[Candidate] = (), *, for_deployment: DeploymentId,
             now: datetime, protect_s: float, asker: Asker | None = None,
             quotas: Sequence[Quota] = (), holdings: Sequence[Holding] = (),
             cap: int = HEADROOM_CAP) -> Headroom:
    """How many more replicas like ``request`` (of ``for_deployment``) fit on ``nodes``,
    and which of ``candidates`` each further one would stop. See the module docstring.

    The arguments are :func:`~.eviction.choose_victim`'s; ``asker`` (preemption) and
    ``quotas`` (limits, guarantees) are optional as there. Deterministic."""
    copy = list(nodes)
    left = list(candidates)
    held = list(holdings)
    current = asker
    siblings = list(request.sibling_node_ids)
    fitting = 0
    steps: list[HeadroomStep] = []
    reason = ""
    while fitting + len(steps) < cap:
        if current is not None:
            refused = limit_refusal(current.owner, current.holds, quotas, held)
            if refused is not None:
                reason = refused
                break
        asking = request.model_copy(update={"sibling_node_ids": sorted(set(siblings))})
        placed = place(asking, copy)
        victims: list[Candidate] = []
        if not isinstance(placed, Placement):
            choice = choose_victim(asking, copy, left, for_deployment=for_deployment,
                                   now=now, protect_s=protect_s, asker=current,
                                   quotas=quotas, holdings=held)
            if isinstance(choice, NoVictim):
                reason = (f"no more fit: {placed.summary}" if not left
                          else f"no more by stopping others: {choice.reason}")
                break
            named = {v.replica_id for v in choice.victims}
            victims = [c for c in left if c.replica_id in named]
            left = [c for c in left if c.replica_id not in named]
            copy = without(copy, victims)
            held = _released(held, victims)
            placed = place(asking, copy)
            assert isinstance(placed, Placement)  # the choice placed it on this copy
            steps.append(HeadroomStep(victims=choice.victims, place_on=placed.node_ids,
                                      frees=sum((c.holds for c in victims), Resources())))
        elif steps:
            steps.append(HeadroomStep(place_on=placed.node_ids))
        else:
            fitting += 1
        copy = apply(copy, placed)
        siblings.extend(placed.node_ids)
        if current is not None:
            held.append(Holding(owner=current.owner, resources=current.holds))
            current = current.model_copy(update={"replicas": current.replicas + 1})
    capped = fitting + len(steps) >= cap
    if capped:
        reason = f"counted up to the cap of {cap}"
    return Headroom(now=fitting, by_stopping=steps, capped=capped, reason=reason)
