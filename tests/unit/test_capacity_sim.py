"""A seeded simulation of the capacity rules (modelkeeper.domain.eviction's rules 8-12,
and headroom), with mutation checks.

Each scenario is built from one seed: a few nodes filled with replicas of a few
deployments (each with a policy, a declared class or none, an owner or none), quotas that
guarantee some scopes memory, and an asker of a random class, owner and minimum. On every
scenario the choice must keep these properties:

* never a higher class stopped for a lower, except borrowed room taken back for a scope
  within its guarantee (rule 10);
* never a replica taken for another scope below its owner's guarantee (rule 8);
* the victims make the room (the asker places once they are gone), and every victim is
  needed (removing any one, the asker does not place);
* a same-class victim never takes its deployment below its minimum (rule 12);
* only idle on-demand replicas are evicted (count lowered); a set with a preemption is
  stopped together;
* headroom's steps each name victims that make the room for that one replica.

The mutation checks break one rule at a time (monkeypatching the function that carries
it) and assert that the matching property then fails on some seeded scenario: a property
that cannot fail proves nothing.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelkeeper.domain import eviction
from modelkeeper.domain.capacity import (
    CapacityClass,
    Holding,
    Quota,
    Resources,
    within_guarantee,
)
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.eviction import (
    Asker,
    Candidate,
    EvictionChoice,
    NoVictim,
    VictimKind,
    choose_victim,
    without,
)
from modelkeeper.domain.headroom import headroom
from modelkeeper.domain.ids import DeploymentId
from modelkeeper.domain.placement import NodeView, Placement, PlacementRequest, apply, place
from modelkeeper.domain.status import ReplicaState
from modelkeeper.domain.units import GIB
from tests.support.capacity_sim import (
    ASKER,
    NOW,
    PROTECT_S,
    asking,
    candidate,
    class_violations,
    guarantee_violations,
    kind_violations,
    node,
    room_violations,
    victims_of,
)

pytestmark = pytest.mark.timeout(120)

OWNERS = [None, "org/a", "org/a/p1", "org/a/p2", "org/b", "org/c"]
GUARANTEED = ["org/a", "org/a/p1", "org/b", "org/c", "org"]
POLICIES = [ScalingPolicy(min_replicas=0, max_replicas=4, idle_timeout_s=3600),
            ScalingPolicy(min_replicas=1, max_replicas=4),
            ScalingPolicy(min_replicas=2, max_replicas=4), None]
#: How many seeds a mutation check tries before it says the property cannot catch it.
MUTATION_SEEDS = 400


@dataclass(frozen=True)
class Scenario:
    request: PlacementRequest
    nodes: list[NodeView]
    candidates: list[Candidate]
    asker: Asker
    quotas: list[Quota]
    holdings: list[Holding]


def scenario(seed: int) -> Scenario:
    """A cluster full of replicas, and an asker, from ``seed``."""
    rng = random.Random(seed)
    deployments = []
    for d in range(rng.randint(2, 6)):
        deployments.append((DeploymentId(f"d{d}"), rng.choice(POLICIES),
                            rng.choice([None, *CapacityClass]), rng.choice(OWNERS)))
    placed: list[tuple[int, str, int, ReplicaState]] = []  # deployment, node, GiB, state
    nodes = []
    for n in range(rng.randint(2, 4)):
        total = rng.choice([16, 24, 32])
        used = 0
        while used < total - 2:
            gib = rng.randint(2, min(16, total - used))
            state = rng.choice([ReplicaState.READY] * 4 + [ReplicaState.SLEEPING,
                                                           ReplicaState.STARTING])
            placed.append((rng.randrange(len(deployments)), f"n{n}", gib, state))
            used += gib
        nodes.append(node(f"n{n}", mem_gib=total, claimed_gib=used))
    awake = {i: sum(1 for d, _, _, s in placed if d == i and s is not ReplicaState.SLEEPING)
             for i in range(len(deployments))}
    candidates = []
    for k, (d, on, gib, state) in enumerate(placed):
        dep, policy, cls, owner = deployments[d]
        candidates.append(candidate(
            f"r{k:02}", deployment=dep, on=on, gib=gib, state=state, policy=policy, cls=cls,
            owner=owner, running=awake[d], idle_min=rng.choice([0, 3, 30, 90]),
            in_flight=rng.choice([0, 0, 1]), known=rng.random() > 0.1,
            ready_min_ago=rng.choice([1, 60])))
    if rng.random() < 0.2:  # a replica of the asker's own: never a victim
        candidates[0] = candidates[0].model_copy(update={"deployment_id": ASKER})
    quotas = [Quota(scope=s, guarantee=Resources(memory_bytes=rng.choice([8, 16, 32]) * GIB))
              for s in GUARANTEED if rng.random() < 0.4]
    mem = rng.randint(4, 24)
    owner = rng.choice(OWNERS)
    replicas = rng.randint(0, 2)
    who = Asker(deployment_id=ASKER, capacity_class=rng.choice(list(CapacityClass)),
                owner=owner, replicas=replicas, min_replicas=rng.randint(0, 3),
                holds=Resources(memory_bytes=mem * GIB))
    holdings = [Holding(owner=c.owner, resources=c.holds) for c in candidates]
    holdings += [Holding(owner=owner, resources=who.holds)] * replicas
    request = asking(mem, min_nodes=rng.choice([1, 1, 1, 2]))
    return Scenario(request, nodes, candidates, who, quotas, holdings)


def run(s: Scenario) -> EvictionChoice | NoVictim:
    return choose_victim(s.request, s.nodes, s.candidates, for_deployment=ASKER, now=NOW,
                         protect_s=PROTECT_S, asker=s.asker, quotas=s.quotas,
                         holdings=s.holdings)


def minimum_violations(result: EvictionChoice | NoVictim, s: Scenario) -> list[str]:
    """Same-class preemptions (not rule 10's) that take a deployment below its minimum."""
    if isinstance(result, NoVictim):
        return []
    reclaiming = within_guarantee(s.asker.owner, s.asker.holds, s.quotas, s.holdings)
    taken: dict[str, int] = {}
    for v, c in zip(result.victims, victims_of(result, s.candidates), strict=True):
        if (v.kind is VictimKind.PREEMPT and c.runs_as == s.asker.capacity_class
                and not reclaiming and c.state is not ReplicaState.SLEEPING):
            taken[c.deployment_id] = taken.get(c.deployment_id, 0) + 1
            assert c.policy is not None, f"{c.replica_id}: a fixed deployment preempted"
            if taken[c.deployment_id] > c.deployment_replicas - c.policy.min_replicas:
                return [f"{c.deployment_id} taken below its minimum"]
    return []


def violations(s: Scenario) -> dict[str, list[str]]:
    """Every property's violations on one scenario (empty lists: it holds)."""
    result = run(s)
    return {
        "class": class_violations(result, s.candidates, who=s.asker, quotas=s.quotas,
                                  holdings=s.holdings),
        "guarantee": guarantee_violations(result, s.candidates, who=s.asker, quotas=s.quotas,
                                          holdings=s.holdings),
        "room": room_violations(result, s.candidates, s.request, s.nodes),
        "minimum": minimum_violations(result, s),
        "kind": kind_violations(result, s.candidates),
        "own": ([] if isinstance(result, NoVictim) else
                [v.replica_id for v in result.victims if v.deployment_id == ASKER]),
    }


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_the_capacity_rules_hold_on_random_clusters(seed: int) -> None:
    found = {k: v for k, v in violations(scenario(seed)).items() if v}
    assert not found, f"seed {seed}: {found}"


def test_the_simulation_reaches_every_kind_of_victim() -> None:
    """The properties are checked where they matter: the seeds reach preemptions of each
    reason, evictions, sets of several, guarded refusals and no room at all."""
    seen: set[str] = set()
    for seed in range(300):
        result = run(scenario(seed))
        if isinstance(result, NoVictim):
            seen.add("none")
            seen.update(r.reason_code.value for r in result.refusals)
            continue
        seen.update(v.kind.value for v in result.victims)
        seen.update(v.why.split(" ")[0] for v in result.victims)
        if len(result.victims) > 1:
            seen.add("set")
    assert {"evict", "preempt", "borrowed", "a", "grown", "set", "none", "guaranteed",
            "at_minimum"} <= seen, seen


def headroom_violations(s: Scenario) -> list[str]:
    """Each headroom step's victims make the room for its replica, and only they: the
    copy is replayed step by step."""
    result = headroom(s.request, s.nodes, s.candidates, for_deployment=ASKER, now=NOW,
                      protect_s=PROTECT_S, asker=s.asker, quotas=s.quotas,
                      holdings=s.holdings, cap=8)
    by_id = {c.replica_id: c for c in s.candidates}
    copy = list(s.nodes)
    for _ in range(result.now):
        placed = place(s.request, copy)
        if not isinstance(placed, Placement):
            return ["'now' counts a replica that does not fit"]
        copy = apply(copy, placed)
    found = []
    for i, step in enumerate(result.by_stopping):
        victims = [by_id[r] for r in step.victim_ids]
        if step.victims and isinstance(place(s.request, copy), Placement):
            found.append(f"step {i}: stops replicas for a replica that fits")
        for v in victims:
            rest = [x for x in victims if x is not v]
            if isinstance(place(s.request, without(copy, rest)), Placement):
                found.append(f"step {i}: names {v.replica_id}, not needed")
        copy = without(copy, victims)
        placed = place(s.request, copy)
        if not isinstance(placed, Placement):
            return [*found, f"step {i}: its victims do not make the room"]
        copy = apply(copy, placed)
    return found


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_headroom_names_victims_that_make_the_room_and_only_those(seed: int) -> None:
    found = headroom_violations(scenario(seed))
    assert not found, f"seed {seed}: {found}"


# -- mutation checks: break a rule, and a property must fail -----------------------------------

def _first_failing(prop: str, seeds: Iterator[int] | range = range(MUTATION_SEEDS),
                   ) -> int | None:
    for seed in seeds:
        try:
            if violations(scenario(seed))[prop]:
                return seed
        except AssertionError:  # the choice's own checks caught the broken rule
            return seed
    return None


def _no_pruning(room: eviction._Room, eligible: Sequence[Candidate]) -> list[Candidate] | None:
    """The choice before "Stop only the replicas that make the room": every candidate
    added until the replica fits is stopped."""
    added: list[Candidate] = []
    for c in eligible:
        added.append(c)
        if isinstance(place(room.request, without(list(room.by_id.values()), added)),
                      Placement):
            return added
    return None


MUTATIONS: dict[str, tuple[str, Callable[[pytest.MonkeyPatch], None]]] = {
    "a class outranks every class": (
        "class", lambda mp: mp.setattr(eviction, "outranks", lambda a, b: True)),
    "no class outranks any (rule 9 evicts an idle critical replica for anyone)": (
        "class", lambda mp: mp.setattr(eviction, "outranks", lambda a, b: False)),
    "guarantees guard nothing": (
        "guarantee", lambda mp: mp.setattr(eviction._Guarantees, "refusal",
                                           lambda self, c: None)),
    "guarantees guard each candidate alone, not the running total": (
        "guarantee", lambda mp: mp.setattr(eviction._Guarantees, "take",
                                           lambda self, c: None)),
    "sets are not pruned": (
        "room", lambda mp: mp.setattr(eviction, "_fewest_together", _no_pruning)),
    "a deployment's surplus is unbounded": (
        "minimum", lambda mp: mp.setattr(Candidate, "surplus", property(lambda self: 99))),
    "preemptions are marked evictions": (
        "kind", lambda mp: mp.setattr(eviction._Judge, "judge",
                                      _as_evictions(eviction._Judge.judge))),
}


def _as_evictions(judge: Callable[[eviction._Judge, Candidate], object],
                  ) -> Callable[[eviction._Judge, Candidate], object]:
    """Every victim judged an eviction (its count lowered), preempted or not."""
    def judged(self: eviction._Judge, c: Candidate) -> object:
        verdict = judge(self, c)
        if isinstance(verdict, eviction._Judged):
            return dataclasses.replace(verdict, kind=VictimKind.EVICT)
        return verdict
    return judged


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_breaking_a_rule_fails_its_property(mutation: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    prop, breaks = MUTATIONS[mutation]
    assert _first_failing(prop) is None, "the property fails before the rule is broken"
    breaks(monkeypatch)
    assert _first_failing(prop) is not None, (
        f"{mutation}: no seed of {MUTATION_SEEDS} breaks the {prop!r} property")


def test_breaking_headrooms_naming_fails_its_property(monkeypatch: pytest.MonkeyPatch) -> None:
    """Headroom naming every candidate tried, not only those needed (the seed's bug)."""
    import modelkeeper.domain.headroom as module

    real = choose_victim

    def naming_all_tried(*args: object, **kwargs: object) -> EvictionChoice | NoVictim:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        if isinstance(result, NoVictim):
            return result
        candidates: Sequence[Candidate] = args[2]  # type: ignore[assignment]
        named = {v.replica_id for v in result.victims}
        extra = [c for c in candidates if c.replica_id not in named
                 and c.deployment_id != ASKER and len(c.claims) == 1][:1]
        return result.model_copy(update={"victims": [*result.victims, *(
            v.model_copy(update={"replica_id": c.replica_id, "node_id": c.claims[0].node_id})
            for v, c in zip(result.victims[:1], extra, strict=False))]})

    monkeypatch.setattr(module, "choose_victim", naming_all_tried)
    assert any(headroom_violations(scenario(seed)) for seed in range(MUTATION_SEEDS))


def test_a_scenario_is_the_same_for_the_same_seed() -> None:
    assert scenario(7) == scenario(7) and run(scenario(7)) == run(scenario(7))
