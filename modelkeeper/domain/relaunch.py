"""Relaunch in place: an engine that exits after it was ready is started again where it
ran, before its replica is given up and placed again.

:func:`relaunch_verdict` is pure: time is an argument. The keeper
(:mod:`modelkeeper.domain.keeper`) asks it about each exit of a ready replica's engine and
carries out the answer. A :class:`Relaunch` puts the replica back in ``starting`` on the
same node, in the same claim (its allocations untouched), and the agent launches the
engine again from the weights it has (no fetch), on the port it had if that is still
free; its endpoint is out of routing until it is ready again. A :class:`Replace` is what
an exit after ready always was: the replica is stopped and released, and placed again at
once.

The rules, in order, each guarded by a test (``tests/unit/test_relaunch.py``):

1. **A replica over several nodes is replaced whole.** Its ranks meet at start (rank 0's
   rendezvous), and one rank started again alone would not rejoin the others.
2. **An engine killed for memory is replaced.** An OOM kill (claimed only with evidence)
   says its claim was too small; a placement claims the next one from the peak the
   agents measured (docs/capacity.md, "OOM calibration"), where a relaunch in the same
   claim would be killed again.
3. **At most ``tries`` relaunches in any ``window_s`` seconds.** A relaunch counts while
   it is younger than the window (a sliding window), so an engine that crashes once a
   day is relaunched every time, and one that crashes ``tries`` times in the window is
   given up on its node the next time: it may do better elsewhere, and a fresh placement
   is what a deployment always did.

Otherwise it is relaunched, and says so: "relaunched in place on n1, try 1 of 3 in 600 s".

What the keeper never asks about: an engine that never became ready (a failed start stays
a failed start: backoff, then park), a replica unreachable, asleep or waking (its node
went quiet, or its claim is shrunk), a deployment being deleted, and any replica while
``tries`` is 0 (relaunching is off). A relaunch that does not become ready is the replica
lost after ready: replaced at once, like an exit with no try left.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from .base import Frozen
from .ids import NodeId
from .shards import ExitKind


class Relaunch(Frozen):
    """Start the engine again where it ran."""

    #: This relaunch's number among those in the window (1 is the first).
    attempt: int
    tries: int
    window_s: float
    #: When each relaunch still in the window happened, oldest first, this one last: what
    #: the replica keeps for the next verdict.
    relaunched_at: list[datetime]
    #: "relaunched in place on n1, try 1 of 3 in 600 s"
    note: str


class Replace(Frozen):
    """Give the replica up: stop and release it, and place it again."""

    #: Why it is not relaunched, for its last failure; None when the rule does not apply
    #: to it at all (a replica over several nodes), which needs no word.
    reason: str | None = None


def recent(relaunched_at: Sequence[datetime], now: datetime,
           window_s: float) -> list[datetime]:
    """The relaunches younger than ``window_s`` at ``now``, oldest first."""
    since = now - timedelta(seconds=window_s)
    return sorted(t for t in relaunched_at if t > since)


def relaunch_verdict(*, nodes: Sequence[NodeId], exit_kind: ExitKind | None,
                     relaunched_at: Sequence[datetime], now: datetime, tries: int,
                     window_s: float) -> Relaunch | Replace:
    """Whether the engine of a ready replica on ``nodes`` that ended as ``exit_kind``
    (None: not known) is relaunched in place at ``now``, given its earlier relaunches
    ``relaunched_at``, at most ``tries`` in any ``window_s`` seconds."""
    if len(nodes) != 1:
        return Replace()
    if exit_kind is ExitKind.OOM_KILLED:
        return Replace(reason="not relaunched in place: killed for memory, it is placed "
                              "again with the memory it was measured to need")
    window = recent(relaunched_at, now, window_s)
    if len(window) >= tries:
        return Replace(reason=f"not relaunched in place: {len(window)} relaunch(es) in the "
                              f"last {window_s:g} s already (at most {tries}), so it is "
                              "placed again")
    attempt = len(window) + 1
    return Relaunch(attempt=attempt, tries=tries, window_s=window_s,
                    relaunched_at=[*window, now],
                    note=f"relaunched in place on {nodes[0]}, try {attempt} of {tries} in "
                         f"{window_s:g} s")
