"""How many more replicas of a model fit now: placement run on a copy of the nodes, one
replica after another. Pure. Apart from :mod:`.measured` because placement's imports
reach the scaling rules (:mod:`.demand`), which read that module.
"""

from __future__ import annotations

from collections.abc import Sequence

from .placement import CantPlace, NodeView, PlacementRequest, apply, place


def room_for(request: PlacementRequest, nodes: Sequence[NodeView], *, limit: int) -> int:
    """How many more replicas of ``request`` fit now, up to ``limit``: placed one after
    another on a copy of ``nodes``, each claim applied before the next (what placement
    would do if they were asked for one by one)."""
    count = 0
    current = list(nodes)
    while count < limit:
        placed = place(request, current)
        if isinstance(placed, CantPlace):
            break
        current = apply(current, placed)
        count += 1
    return count
