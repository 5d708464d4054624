"""What an operator could sleep or scale down to make a deploy or a scale-up fit (fit
plans). Pure: the request, the nodes with their claims, the replicas that could make room
and the time come in as arguments. How many more replicas fit, now and by stopping others
(headroom), is :mod:`.headroom`'s, on the capacity rules of :mod:`.eviction`.

Everything here is tried on copies of the nodes with :func:`~.placement.place`,
:func:`~.placement.apply` and :func:`~.eviction.without`; nothing is stopped or claimed.
The answers can be stale by the time they are read: only a placement's locked re-check
counts, and applying a plan checks again under a lock (``api/room.py``).

**Fit plans** (:func:`fit_plans`): when ``count`` more replicas do not fit, the ways an
operator could make them fit, each a list of actions on other deployments' replicas:

1. **Actions.** ``sleep`` a ready replica whose engine can sleep and whose model keeps
   less than it claims (it frees the difference: its KV cache), or ``scale_down`` a
   deployment with a fixed count by one (it frees the replica its keeper retires first:
   a sleeping or starting one, else the newest ready one). An operator applies a plan
   knowingly, so the eviction's promises (on demand only, idle only) do not bind it; but
   only single-node replicas are offered (a replica across nodes costs every shard's
   load), and a deployment whose replicas are not all listed (one placing, unreachable
   or draining) is not scaled down: which replica its keeper would retire is not known.
2. **Each plan makes the room,** tried on the copy, and **only with what it needs:**
   actions are added in a preferred order until ``count`` replicas fit, then each is
   dropped, least preferred first, if the rest still make it.
3. **Smallest disruption first:** plans are ranked by how many replicas they stop
   (``scale_down``), then by how many actions they take, then by the memory they free
   (less is less disruption); a replica is in one action of a plan at most. At most
   :data:`MAX_PLANS` are listed, numbered from 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

from pydantic import Field

from .base import Frozen, Tolerant
from .eviction import Candidate, VictimClaim, without
from .ids import DeploymentId, NodeId, ReplicaId
from .placement import CantPlace, NodeView, PlacementRequest, apply, place
from .status import ReplicaState
from .units import format_gib

#: A 409 lists at most this many plans (rule 3): an operator reads them and picks one.
MAX_PLANS = 3
#: The deployment id headroom asks for when the model is not deployed yet: no
#: deployment has it, so no replica is excluded as the asker's own.
NOT_DEPLOYED = DeploymentId("")


# -- fit plans --------------------------------------------------------------------------


class ActionKind(StrEnum):
    """What a plan does to a replica. Stable strings: clients match on them."""

    #: Sleep the replica (the sleep route): it keeps its weights, frees its KV cache.
    SLEEP = "sleep"
    #: Scale its deployment down by one (the scale route): its keeper retires it.
    SCALE_DOWN = "scale_down"


#: Disruption of each kind (rule 3): a sleeping replica wakes on the next request; a
#: stopped one is gone until scaled up again.
_DISRUPTION = {ActionKind.SLEEP: 0, ActionKind.SCALE_DOWN: 1}


class Holder(Frozen):
    """A deployment whose replicas a plan may act on, with what the actions read of it."""

    deployment_id: DeploymentId
    desired_replicas: int = Field(ge=0)
    #: Fixed at its count (no scaling policy): it may be scaled down by one. One with a
    #: policy is not (the policy would bring it back; its idle replicas are eviction's).
    fixed_count: bool = True
    #: What one of its replicas keeps asleep (its model's ``weights_bytes``); None: it
    #: cannot sleep (llama.cpp) or a sleep frees nothing in the accounting.
    sleep_keeps_bytes: int | None = None


class PlanAction(Tolerant):
    """One step of a plan: what it does to which replica, and the memory it frees."""

    kind: ActionKind
    deployment_id: DeploymentId
    replica_id: ReplicaId
    node_id: NodeId
    frees_bytes: int = Field(ge=0)
    #: scale_down: the deployment's count before and after.
    replicas_from: int | None = None
    replicas_to: int | None = None
    #: "sleep d-chat's replica d-chat-r2 (frees 6.0 GiB on n1)".
    text: str


class FitPlan(Tolerant):
    """A way to make the room: its actions, in the order they are applied."""

    number: int = Field(ge=1)
    actions: list[PlanAction] = Field(min_length=1)
    frees_bytes: int = Field(ge=0)
    #: "sleep ...; then scale d-x down from 2 to 1 (frees ...)".
    text: str


def _seq(replica_id: ReplicaId) -> int:
    """The replica's number in its deployment ("d-x-r12": 12), as the keeper numbers and
    orders them (``keeper._retire``: the newest ready one goes first)."""
    tail = replica_id.rsplit("-r", 1)[-1]
    return int(tail) if tail.isdigit() else 0


#: The order in which a keeper retires its replicas on a scale-down (``keeper._retire``):
#: starting, then sleeping, then ready (the newest first within each).
_RETIRE_ORDER = {ReplicaState.STARTING: 0, ReplicaState.SLEEPING: 1, ReplicaState.READY: 2}


def _retired_first(replicas: Sequence[Candidate]) -> Candidate | None:
    ranked = [r for r in replicas if r.state in _RETIRE_ORDER]
    if len(ranked) != len(replicas):
        return None  # one in a state the keeper ranks otherwise: its choice is unknown
    return min(ranked, key=lambda r: (_RETIRE_ORDER[r.state], -_seq(r.replica_id)),
               default=None)


class _Option(Frozen):
    """An action with the part of its replica's claim it frees (a :class:`Candidate`
    whose claims are only that part, for :func:`without`)."""

    action: PlanAction
    freed: Candidate

    def key(self) -> tuple[int, int, str]:
        return (_DISRUPTION[self.action.kind], self.action.frees_bytes, self.action.replica_id)


def _part(replica: Candidate, memory_bytes: int, *, whole: bool) -> Candidate:
    claim = replica.claims[0]
    freed = claim if whole else VictimClaim(node_id=claim.node_id, memory_bytes=memory_bytes)
    return replica.model_copy(update={"claims": [freed]})


def _options(candidates: Sequence[Candidate], holders: Sequence[Holder], *,
             for_deployment: DeploymentId) -> list[_Option]:
    """Every action a plan may take (rule 1)."""
    by_holder: dict[DeploymentId, list[Candidate]] = {}
    for c in candidates:
        by_holder.setdefault(c.deployment_id, []).append(c)
    options: list[_Option] = []
    for holder in sorted(holders, key=lambda h: h.deployment_id):
        if holder.deployment_id == for_deployment:
            continue
        replicas = sorted(by_holder.get(holder.deployment_id, []), key=lambda c: c.replica_id)
        keeps = holder.sleep_keeps_bytes
        for r in replicas:
            if (keeps is None or r.state is not ReplicaState.READY or len(r.claims) != 1
                    or r.freed_bytes <= keeps):
                continue
            frees = r.freed_bytes - keeps
            node = r.claims[0].node_id
            options.append(_Option(freed=_part(r, frees, whole=False), action=PlanAction(
                kind=ActionKind.SLEEP, deployment_id=r.deployment_id, replica_id=r.replica_id,
                node_id=node, frees_bytes=frees,
                text=f"sleep {r.deployment_id}'s replica {r.replica_id} (frees "
                     f"{format_gib(frees)} on {node})")))
        retired = _retired_first(replicas)
        if (holder.fixed_count and retired is not None and len(retired.claims) == 1
                and len(replicas) == holder.desired_replicas):
            node = retired.claims[0].node_id
            n = holder.desired_replicas
            options.append(_Option(freed=_part(retired, 0, whole=True), action=PlanAction(
                kind=ActionKind.SCALE_DOWN, deployment_id=holder.deployment_id,
                replica_id=retired.replica_id, node_id=node, frees_bytes=retired.freed_bytes,
                replicas_from=n, replicas_to=n - 1,
                text=f"scale {holder.deployment_id} down from {n} to {n - 1}: its keeper "
                     f"retires {retired.replica_id} (frees {format_gib(retired.freed_bytes)} "
                     f"on {node})")))
    return options


def _placed(request: PlacementRequest, nodes: list[NodeView]
            ) -> tuple[PlacementRequest, list[NodeView]] | CantPlace:
    """One more replica on the copy: the request with its nodes added as siblings (the
    next one prefers other nodes, as the keeper's would), and the nodes with its claims."""
    result = place(request, nodes)
    if isinstance(result, CantPlace):
        return result
    siblings = sorted({*request.sibling_node_ids, *result.node_ids})
    return request.model_copy(update={"sibling_node_ids": siblings}), apply(nodes, result)


def fits(request: PlacementRequest, nodes: Sequence[NodeView], count: int) -> bool:
    """Whether ``count`` replicas like ``request`` fit on ``nodes``, one after another."""
    current = list(nodes)
    for _ in range(count):
        step = _placed(request, current)
        if isinstance(step, CantPlace):
            return False
        request, current = step
    return True


def _made(request: PlacementRequest, nodes: Sequence[NodeView], count: int,
          chosen: Sequence[_Option]) -> bool:
    return fits(request, without(nodes, [o.freed for o in chosen]), count)


def _greedy(request: PlacementRequest, nodes: Sequence[NodeView], count: int,
            ordered: Sequence[_Option]) -> list[_Option] | None:
    """Rule 5: add in order (a replica once) until it fits, then drop what is not needed,
    least preferred first."""
    chosen: list[_Option] = []
    for option in ordered:
        if any(o.action.replica_id == option.action.replica_id for o in chosen):
            continue
        chosen.append(option)
        if _made(request, nodes, count, chosen):
            break
    else:
        return None
    for option in reversed(list(chosen)):
        rest = [o for o in chosen if o is not option]
        if rest and _made(request, nodes, count, rest):
            chosen = rest
    return sorted(chosen, key=_Option.key)


def _rank(chosen: Sequence[_Option]) -> tuple[int, int, int]:
    stops = sum(1 for o in chosen if o.action.kind is ActionKind.SCALE_DOWN)
    return (stops, len(chosen), sum(o.action.frees_bytes for o in chosen))


def fit_plans(request: PlacementRequest, nodes: Sequence[NodeView],
              candidates: Sequence[Candidate], holders: Sequence[Holder], *, count: int,
              for_deployment: DeploymentId = NOT_DEPLOYED) -> list[FitPlan]:
    """The plans that make room for ``count`` more replicas like ``request`` (rules 4-6);
    empty when they fit already or nothing an operator may do makes the room.
    ``candidates`` are the replicas with their claims (as eviction reads them), ``nodes``
    include their claims in their sums."""
    if count < 1 or fits(request, nodes, count):
        return []
    options = _options(candidates, holders, for_deployment=for_deployment)
    found: dict[frozenset[tuple[str, str]], list[_Option]] = {}

    def keep(chosen: list[_Option] | None) -> None:
        if chosen is not None:
            found.setdefault(frozenset((o.action.kind, o.action.replica_id) for o in chosen),
                             chosen)

    ordered = sorted(options, key=_Option.key)
    for option in ordered:
        if _made(request, nodes, count, [option]):
            keep([option])
    orders: list[Callable[[_Option], tuple[int | str, ...]]] = [
        _Option.key,  # least disruption first
        lambda o: (-o.action.frees_bytes, o.action.replica_id),  # fewest actions
    ]
    for order in orders:
        keep(_greedy(request, nodes, count, sorted(options, key=order)))
    ranked = sorted(found.values(), key=lambda c: (*_rank(c), [o.key() for o in c]))
    return [_plan(i, chosen) for i, chosen in enumerate(ranked[:MAX_PLANS], start=1)]


def _plan(number: int, chosen: Sequence[_Option]) -> FitPlan:
    actions = [o.action for o in chosen]
    return FitPlan(number=number, actions=actions,
                   frees_bytes=sum(a.frees_bytes for a in actions),
                   text="; then ".join(a.text for a in actions))


class Held(Frozen):
    """A replica holding claims, in any state (one draining or stopping still holds
    them): what :func:`room_after` reads to see how far an action has got."""

    replica_id: ReplicaId
    state: ReplicaState
    claims: list[VictimClaim] = Field(min_length=1)


def room_after(plan: FitPlan, request: PlacementRequest, nodes: Sequence[NodeView],
               held: Sequence[Held], *, count: int) -> bool:
    """Whether ``count`` replicas fit once ``plan``'s actions have taken effect, on a
    snapshot read after they were asked for. The actions' workflows carry them out in
    their own time (a drain, then a stop or a sleep), so what an action frees is counted
    as freed while its replica still holds it: a scaled-down replica's claims while it
    has any, a sleep's part while its replica is not asleep yet. A replica with no claims
    left has freed them already (they are gone from the nodes' sums too)."""
    by_id = {h.replica_id: h for h in held}
    freed: list[Candidate] = []
    for action in plan.actions:
        replica = by_id.get(action.replica_id)
        if replica is None:
            continue
        claim = replica.claims[0]
        if action.kind is ActionKind.SCALE_DOWN:
            parts = replica.claims
        elif replica.state is ReplicaState.SLEEPING:
            continue  # asleep: its claim holds only what it keeps already
        else:
            parts = [VictimClaim(node_id=claim.node_id,
                                 memory_bytes=min(action.frees_bytes, claim.memory_bytes))]
        freed.append(Candidate(replica_id=replica.replica_id,
                               deployment_id=action.deployment_id, policy=None,
                               state=replica.state, claims=parts))
    return fits(request, without(nodes, freed), count)
