"""bench/soak's demand faults, their pure parts: the quick soak draws them first, an
on-demand deployment idle or asleep counts as settled, and the eviction pair's claim
leaves room for one of them on a lightly used node and never for two."""

from __future__ import annotations

import random

from bench.soak.demand import pair_claim
from bench.soak.faults import DEMAND_KINDS, Deck, FaultKind
from bench.soak.observe import deployment_steady

GiB = 1 << 30


def test_the_deck_draws_the_first_kinds_in_order_then_every_kind_once_a_round() -> None:
    kinds = list(FaultKind)
    deck = Deck(kinds, random.Random(7), DEMAND_KINDS)
    assert [deck.draw() for _ in DEMAND_KINDS] == list(DEMAND_KINDS)
    assert sorted(deck.draw() for _ in kinds) == sorted(kinds)
    plain = Deck(kinds, random.Random(7))
    assert sorted(plain.draw() for _ in kinds) == sorted(kinds)


def test_idle_with_none_or_asleep_is_settled_and_loading_is_not() -> None:
    assert deployment_steady("serving", ["ready", "ready"], 2)
    assert not deployment_steady("serving", ["ready", "starting"], 2)
    assert deployment_steady("idle", [], 0)
    assert not deployment_steady("idle", ["stopping"], 0)
    assert deployment_steady("sleeping", ["sleeping"], 1)
    assert not deployment_steady("sleeping", [], 1)
    assert not deployment_steady("loading", ["starting"], 1)
    assert not deployment_steady("degraded", ["ready", "unreachable"], 2)


def test_one_of_the_pair_fits_a_lightly_used_node_and_two_never_do() -> None:
    pair = pair_claim(claim=1 * GiB, node_memory=4 * GiB)
    assert pair == int(2.5 * GiB)
    for used in (0, GiB // 2, GiB, 3 * GiB // 2):
        assert used + pair <= 4 * GiB < used + 2 * pair
