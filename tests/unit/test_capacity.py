"""modelkeeper.domain.capacity: classes, owners' scopes, what a scope holds, its limit's
refusal with the numbers, what it borrows and whether it is within its guarantee."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from modelkeeper.domain.capacity import (
    CapacityClass,
    Holding,
    Limit,
    PreemptRequest,
    Quota,
    Resources,
    borrowed,
    effective_class,
    guarantee_scope,
    held_by,
    limit_refusal,
    outranks,
    scopes_of,
    within,
    within_guarantee,
)
from modelkeeper.domain.demand import ScalingPolicy
from modelkeeper.domain.ids import ReplicaId
from modelkeeper.domain.units import GIB

CRIT, STD, OPP = CapacityClass.CRITICAL, CapacityClass.STANDARD, CapacityClass.OPPORTUNISTIC


def gib(n: float, *, gpus: int = 0, cores: float = 0.0) -> Resources:
    return Resources(memory_bytes=int(n * GIB), gpus=gpus, cpu_cores=cores)


def held(owner: str | None, n: float, **kw: float) -> Holding:
    return Holding(owner=owner, resources=gib(n, **kw))  # type: ignore[arg-type]


def test_classes_rank_critical_over_standard_over_opportunistic() -> None:
    assert outranks(CRIT, STD) and outranks(STD, OPP) and outranks(CRIT, OPP)
    assert not any(outranks(c, c) for c in CapacityClass)
    assert not outranks(OPP, STD) and not outranks(STD, CRIT)


@pytest.mark.parametrize("declared, policy, runs_as", [
    (None, ScalingPolicy(min_replicas=0, max_replicas=2), OPP),
    (None, ScalingPolicy(min_replicas=1, max_replicas=2), STD),
    (None, None, STD),
    (CRIT, ScalingPolicy(min_replicas=0, max_replicas=2), CRIT),
    (OPP, None, OPP),
])
def test_an_unset_class_follows_the_policy(declared: CapacityClass | None,
                                           policy: ScalingPolicy | None,
                                           runs_as: CapacityClass) -> None:
    assert effective_class(declared, policy) is runs_as


def test_scopes_of_an_owner_outermost_first() -> None:
    assert scopes_of("org") == ["org"]
    assert scopes_of("org/team/proj") == ["org", "org/team", "org/team/proj"]
    assert within("org/team", "org") and within("org", "org")
    assert not within("org2", "org") and not within("org", "org/team")


@pytest.mark.parametrize("bad", ["Org", "a/b/c/d", "/a", "a//b", "a-", "-a", ""])
def test_an_owner_path_is_checked(bad: str) -> None:
    with pytest.raises(ValidationError):
        Quota(scope=bad)


def test_held_by_sums_a_scope_and_those_beneath_it_and_no_ownerless_holding() -> None:
    holdings = [held("org/a", 8, gpus=1), held("org/a/p1", 4, cores=2), held("org/b", 16),
                held(None, 32), held("org/ab", 2)]
    assert held_by("org/a", holdings) == gib(12, gpus=1, cores=2)
    assert held_by("org", holdings) == gib(30, gpus=1, cores=2)
    assert held_by("org/a/p1", holdings) == gib(4, cores=2)
    assert held_by("nobody", holdings) == Resources()


def test_resources_add_subtract_floored_and_fit() -> None:
    assert gib(4, gpus=1) + gib(2, cores=0.5) == gib(6, gpus=1, cores=0.5)
    assert gib(4) - gib(6, gpus=1) == Resources()
    assert Resources(cpu_cores=0.1 + 0.2).fits_in(Resources(cpu_cores=0.3))
    assert not gib(4, gpus=2).fits_in(gib(8, gpus=1))
    assert gib(16, gpus=2, cores=4).describe() == "16.0 GiB, 2 GPUs, 4 cores"
    assert Resources().describe() == "nothing" and Resources().empty


def test_limit_refusal_names_the_scope_what_it_holds_what_is_asked_and_the_limit() -> None:
    quotas = [Quota(scope="org/a", limit=Limit(memory_bytes=24 * GIB))]
    holdings = [held("org/a/p1", 16)]
    assert limit_refusal("org/a/p1", gib(8), quotas, holdings) is None  # 24 of 24: at it
    refusal = limit_refusal("org/a/p1", gib(12), quotas, holdings)
    assert refusal == ("scope 'org/a' would pass its memory limit: it holds 16.0 GiB, this "
                       "asks 12.0 GiB more, and its limit is 24.0 GiB")


def test_limit_refusal_counts_every_scope_on_the_path_outermost_first() -> None:
    quotas = [Quota(scope="org", limit=Limit(gpus=4)),
              Quota(scope="org/a", limit=Limit(gpus=2, cpu_cores=8))]
    holdings = [held("org/b", 0, gpus=3), held("org/a", 0, gpus=1, cores=6)]
    refusal = limit_refusal("org/a", gib(0, gpus=1), quotas, holdings)
    assert refusal is not None and refusal.startswith("scope 'org' would pass its gpus limit")
    assert "it holds 4, this asks 1 more, and its limit is 4" in refusal
    cores = limit_refusal("org/a", gib(0, cores=3), quotas, holdings)
    assert cores is not None and "'org/a' would pass its cpu_cores limit" in cores
    assert limit_refusal(None, gib(1000), quotas, holdings) is None
    assert limit_refusal("other", gib(1000), quotas, holdings) is None


def test_borrowed_is_what_a_scope_holds_beyond_its_guarantee() -> None:
    quotas = [Quota(scope="org/a", guarantee=gib(16, gpus=1))]
    holdings = [held("org/a", 20, gpus=1), held("org/b", 8)]
    assert borrowed("org/a", quotas, holdings) == gib(4)
    assert borrowed("org/b", quotas, holdings) == gib(8)  # no quota: all of it


def test_guarantee_scope_is_the_innermost_with_a_guarantee() -> None:
    quotas = [Quota(scope="org", guarantee=gib(64)),
              Quota(scope="org/a", limit=Limit(memory_bytes=GIB)),  # a limit only
              Quota(scope="org/a/p", guarantee=gib(8))]
    found = guarantee_scope("org/a/p", quotas)
    assert found is not None and found.scope == "org/a/p"
    found = guarantee_scope("org/a", quotas)
    assert found is not None and found.scope == "org"
    assert guarantee_scope(None, quotas) is None
    assert guarantee_scope("else", quotas) is None


def test_within_guarantee_counts_what_is_asked() -> None:
    quotas = [Quota(scope="org/a", guarantee=gib(16))]
    holdings = [held("org/a/p", 8)]
    assert within_guarantee("org/a/p", gib(8), quotas, holdings)
    assert not within_guarantee("org/a/p", gib(9), quotas, holdings)
    assert within_guarantee("org/a", Resources(), quotas, holdings)
    assert not within_guarantee("org/b", Resources(), quotas, holdings)  # promised nothing
    assert not within_guarantee(None, Resources(), quotas, holdings)


def test_a_preempt_request_needs_a_reason() -> None:
    assert PreemptRequest(replica_id=ReplicaId("r1"), reason="x").by is None
    with pytest.raises(ValidationError):
        PreemptRequest(replica_id=ReplicaId("r1"), reason="")
