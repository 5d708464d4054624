"""The store's advisory-lock keys for placement and registration, in one place so that
they stay apart (the migration lock, of another form, is :mod:`.schema`'s).

The protocol that takes them (which lock, in which order, held how long, and why a
heartbeat never waits for a placement) is documented once, at
:meth:`.placement.PlacementStore.place_replica`. The statements that take a row lock
instead (a heartbeat, a node's removal, a deployment's sweep) say beside them how that
lock meets placement's.
"""

from __future__ import annotations

import hashlib

#: Advisory-lock namespaces for placement (the first key of the two-int form; the second is
#: :func:`lock_key` of an id). Four ASCII bytes read as a big-endian int32, so they stay
#: apart from each other and from the migration lock, which uses the one-bigint form.
NODE_LOCK_SPACE = int.from_bytes(b"mkNd", "big", signed=True)
REPLICA_LOCK_SPACE = int.from_bytes(b"mkRp", "big", signed=True)
#: ... and for registration: a name's (or id's) holder is checked and written under its
#: lock, so two nodes registering one name at once cannot both find it free.
NODE_NAME_LOCK_SPACE = int.from_bytes(b"mkNn", "big", signed=True)
#: The placement lock: every optimistic attempt holds it shared, the serialized last
#: attempt exclusively, which is what makes that attempt's snapshot exact.
PLACEMENT_LOCK = (int.from_bytes(b"mkPl", "big", signed=True), 0)
#: The fit-plan lock: one plan is applied at a time, in every API process, from its first
#: action to its deployment's creation (or its undo), so two plans never count the same
#: freed room (:meth:`.room.RoomStore.plan_lock`).
FIT_PLAN_LOCK = (int.from_bytes(b"mkFp", "big", signed=True), 0)


def lock_key(entity_id: str) -> int:
    """The second key of an id's advisory lock. Stable across processes (unlike hash()); two
    ids that collide only share a lock, which costs waiting, never correctness."""
    return int.from_bytes(hashlib.blake2b(entity_id.encode(), digest_size=4).digest(),
                          "big", signed=True)
