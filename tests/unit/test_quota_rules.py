"""The pure parts of quotas: a limit's breach as numbers (and its sentence, which
``limit_refusal`` answers), the parts a scope has reached, and what a token bound to a
scope may change."""

from __future__ import annotations

import pytest

from modelkeeper.domain.capacity import (
    Holding,
    Limit,
    LimitBreach,
    Quota,
    Resources,
    at_limit,
    limit_breach,
    limit_refusal,
)
from modelkeeper.domain.operators import scope_refusal, unscoped_refusal

GIB = 1 << 30

QUOTAS = [Quota(scope="acme", limit=Limit(gpus=4)),
          Quota(scope="acme/a", guarantee=Resources(memory_bytes=16 * GIB),
                limit=Limit(memory_bytes=24 * GIB))]
HOLDINGS = [Holding(owner="acme/a", resources=Resources(memory_bytes=16 * GIB, gpus=1)),
            Holding(owner="acme/b", resources=Resources(gpus=2)),
            Holding(owner=None, resources=Resources(memory_bytes=100 * GIB, gpus=9))]


def test_the_outermost_limit_passed_is_named_with_its_numbers() -> None:
    # acme's GPU limit (1 + 2 held, 2 asked, 4 allowed) is met before acme/a's memory.
    breach = limit_breach("acme/a/p", Resources(memory_bytes=16 * GIB, gpus=2), QUOTAS,
                          HOLDINGS)
    assert breach == LimitBreach(scope="acme", part="gpus", held=3, asked=2, limit=4)
    assert breach.message == ("scope 'acme' would pass its gpus limit: it holds 3, this "
                              "asks 2 more, and its limit is 4")
    memory = limit_breach("acme/a", Resources(memory_bytes=9 * GIB), QUOTAS, HOLDINGS)
    assert memory == LimitBreach(scope="acme/a", part="memory", held=16 * GIB,
                                 asked=9 * GIB, limit=24 * GIB)
    assert limit_refusal("acme/a", Resources(memory_bytes=9 * GIB), QUOTAS, HOLDINGS) \
        == memory.message
    # Up to the limit exactly is allowed; no owner, or another tree, is never limited.
    assert limit_breach("acme/a", Resources(memory_bytes=8 * GIB), QUOTAS, HOLDINGS) is None
    assert limit_breach(None, Resources(gpus=99), QUOTAS, HOLDINGS) is None
    assert limit_breach("other", Resources(gpus=99), QUOTAS, HOLDINGS) is None


def test_at_limit_names_the_parts_reached_and_never_an_unset_one() -> None:
    held = Resources(memory_bytes=24 * GIB, gpus=1, cpu_cores=2.0)
    assert at_limit(held, Limit(memory_bytes=24 * GIB, gpus=2)) == ["memory"]
    assert at_limit(held, Limit(gpus=1, cpu_cores=1.5)) == ["gpus", "cpu_cores"]
    assert at_limit(held, Limit()) == []
    assert at_limit(Resources(), Limit(gpus=0)) == ["gpus"]


@pytest.mark.parametrize(("scope", "owner", "allowed"), [
    (None, None, True), (None, "x", True), ("acme/a", "acme/a", True),
    ("acme/a", "acme/a/p", True), ("acme/a", "acme", False), ("acme/a", "acme/ab", False),
    ("acme/a", None, False)])
def test_a_scoped_token_changes_only_its_scopes_deployments(
        scope: str | None, owner: str | None, allowed: bool) -> None:
    why = scope_refusal(scope, owner, "deployment d-1")
    assert (why is None) is allowed
    if why is not None:
        assert f"bound to scope {scope!r}" in why and "deployment d-1" in why


def test_a_scoped_token_changes_nothing_but_deployments() -> None:
    assert unscoped_refusal(None, "PUT /quotas/acme") is None
    why = unscoped_refusal("acme/a", "PUT /quotas/acme")
    assert why is not None and "'acme/a'" in why and "PUT /quotas/acme is not one" in why
