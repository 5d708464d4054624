"""What a deploy or a scale-up does when it does not fit on the ready nodes now: the
request's choice (``if_no_room``, ``plan``), apart from the planning itself
(:mod:`.fit_plans`) so that the request's model (:mod:`.catalog`) need not import
placement. Pure."""

from __future__ import annotations

from enum import StrEnum


class IfNoRoom(StrEnum):
    """What a deploy or a scale-up that does not fit on the ready nodes does."""

    #: Accepted, and waits for room (cant_place) as it always has. The default: a
    #: deployment made before any node joined is accepted and placed when one does, and
    #: a script that deploys keeps working.
    QUEUE = "queue"
    #: Refused with 409 and the plans that would make it fit.
    PLAN = "plan"


#: The most a request's ``plan`` may name: far above :data:`.fit_plans.MAX_PLANS`, so a
#: number past the plans there are is answered with them (a 409), not a 422.
MAX_PLAN_NUMBER = 64
IF_NO_ROOM_HELP = ("without room on the ready nodes: 'queue' (accepted, waits for room: "
                   "the default) or 'plan' (409 with the plans that would make it fit)")
PLAN_HELP = ("apply this plan (its number in a 409's plans) first: its actions under a "
             "lock, undone in reverse if the room is not made (docs/capacity.md)")
