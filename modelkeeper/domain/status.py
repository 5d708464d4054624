"""The states a deployment and its replicas show to operators, the API and the gateway."""

from __future__ import annotations

from enum import StrEnum


class DeploymentStatus(StrEnum):
    """A deployment's status, as `GET /deployments` shows it."""

    SERVING = "serving"  # every desired replica is ready
    DEGRADED = "degraded"  # a replica is unreachable (routed around); fewer ready than desired
    STARTING = "starting"  # replicas placed, some not ready yet
    PLACING = "placing"  # looking for room (or waiting out a backoff)
    CANT_PLACE = "cant_place"  # nothing fits; placement_error says why per node
    PARKED = "parked"  # too many failed starts in a row; needs a spec change or /retry
    DELETING = "deleting"  # stopping its replicas; the row goes when they are gone
    STOPPED = "stopped"  # scaled to 0 replicas (max 0: deliberately off)
    IDLE = "idle"  # on demand (min 0), none running: loaded when a request asks for it
    LOADING = "loading"  # on demand, asked for: its first replica is on its way
    SLEEPING = "sleeping"  # every replica it keeps is asleep: woken when asked for


class ReplicaState(StrEnum):
    """A replica's state in the store. Only READY replicas receive traffic."""

    STARTING = "starting"
    READY = "ready"
    UNREACHABLE = "unreachable"  # its node went silent; routed around, not yet lost
    DRAINING = "draining"  # finishing in-flight requests before a stop (or a sleep)
    SLEEPING = "sleeping"  # asleep: weights kept, KV cache freed; woken by demand
    STOPPING = "stopping"


#: Replica states the gateway may route to.
ROUTABLE_STATES = frozenset({ReplicaState.READY})

#: Statuses of a deployment waiting for room on the nodes, to be told when room may have
#: grown: cant_place (no replica fits anywhere) and degraded (a replica is unreachable and
#: its surge replacement found no room).
#: Loading too: an on-demand deployment asked for and waiting while room is made for it
#: (an eviction) shows loading, and must hear when the victim's room is freed.
WAITING_FOR_ROOM = frozenset({DeploymentStatus.CANT_PLACE, DeploymentStatus.DEGRADED,
                              DeploymentStatus.LOADING})


def failure_is_current(failure_generation: int | None, generation: int) -> bool:
    """Whether a deployment's last failure belongs to what it runs now: it happened on
    its current generation. One from before a restart, switch or reconfigure (each takes
    the next generation) is over, and is not shown as its history. None (a failure
    recorded before the store kept its generation): current, as it was always shown."""
    return failure_generation is None or failure_generation >= generation
