"""Inputs and results of the store activities the deployment workflow calls
(:mod:`activities.store`, run by the control worker).

They are the contract between a deployment workflow and the activities it calls, so they
live in the domain: the workflow names the activities (``modelkeeper.names``) and imports
these, and never imports the activities' module, which holds the store.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from .base import Tolerant
from .catalog import Generation
from .eviction import EvictionChoice, Refusal
from .ids import DeploymentId, NodeId, ReplicaId
from .keeper import DeploymentSpec, room_watch_wait_s
from .shards import ShardSpec


class PlaceReplicaInput(Tolerant):
    """Input of `place_replica`."""

    spec: DeploymentSpec
    replica_id: ReplicaId
    start_timeout_s: float = Field(gt=0)
    #: The new replica goes on none of these (a node being drained).
    avoid_nodes: list[NodeId] = Field(default_factory=list)
    #: What it runs: this catalog model with these engine arguments over the catalog's.
    #: None: ``spec.model_id`` as the catalog has it (and the recorded histories' inputs).
    generation: Generation | None = None


class PlaceReplicaResult(Tolerant):
    """The shards to start, or why nothing fits (``cant_place``, naming every node)."""

    shards: list[ShardSpec] = Field(default_factory=list)
    cant_place: str | None = None
    #: Placed, but on a node that already holds another replica of the deployment (no
    #: other node had room): which node, and each other node's reason.
    note: str | None = None


class WatchForRoomInput(Tolerant):
    """Input of `watch_for_room`: which replica to dry-run and on what schedule."""

    spec: DeploymentSpec
    #: What the next replica would run (the spec's generation; None: its model as the
    #: catalog has it), as PlaceReplicaInput.generation.
    generation: Generation | None = None
    #: Placements in a row that found no room before the watch began
    #: (KeeperState.unplaceable_in_a_row): the schedule carries on from there.
    unplaceable: int = Field(ge=0)
    #: The schedule's first wait and its cap (KeeperConfig.cant_place_retry_s and
    #: room_watch_max_s).
    first_wait_s: float = Field(gt=0)
    #: Not constrained: a cap below the first wait is the first wait (room_watch_wait_s),
    #: and a value the workflow could not send would fail its workflow task for ever.
    max_wait_s: float

    def wait_s(self, check: int) -> float:
        """The wait before dry run number ``check`` (0 first)."""
        return room_watch_wait_s(self.unplaceable, check, first_s=self.first_wait_s,
                                 max_s=self.max_wait_s)


class RoomFound(Tolerant):
    """What `watch_for_room` answers: the replica would fit now, on these nodes."""

    nodes: list[NodeId]
    #: Dry runs it took, the one that found room included.
    checks: int


class FindEvictionInput(Tolerant):
    """Input of `find_eviction`: the replica of ``spec`` that found no room, asked for as
    `place_replica` was (the same placement request is built from the same fields)."""

    spec: DeploymentSpec
    replica_id: ReplicaId
    avoid_nodes: list[NodeId] = Field(default_factory=list)
    generation: Generation | None = None


class PreemptTarget(Tolerant):
    """One replica to preempt, with the reason its deployment shows."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    reason: str


class EvictTarget(Tolerant):
    """An idle on-demand replica of a preemption's set: retired (``evict``), its
    deployment's count lowered, as issue 21's evictions are."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    reason: str


class EvictionFound(Tolerant):
    """What `find_eviction` answers: the replica to ask its deployment to retire, or None
    with why not (every candidate refused, named with its reason)."""

    choice: EvictionChoice | None = None
    #: The choice's reason ("evicted d-chat (replica r1, idle 14 min, ...) to place
    #: d-code"), or why nothing is to be evicted.
    reason: str
    #: The replica fits as the nodes stand now: place it, evict nothing.
    fits_now: bool = False
    #: With no choice: every candidate refused, with its reason (the events' data).
    refusals: list[Refusal] = Field(default_factory=list)
    #: With no choice: when a candidate's protection window ends (seek again then).
    retry_at: datetime | None = None
    #: Replicas of others to preempt together (their deployments keep their counts and
    #: wait for room); their room is held for the asking deployment.
    preempt: list[PreemptTarget] = Field(default_factory=list)
    #: Idle on-demand replicas of the same set, evicted with them.
    also_evict: list[EvictTarget] = Field(default_factory=list)


class ReleaseReplicaInput(Tolerant):
    """Input of `release_replica`."""

    replica_id: ReplicaId


class DeleteDeploymentInput(Tolerant):
    """Input of `delete_deployment`."""

    deployment_id: DeploymentId


class ShrinkClaimsInput(Tolerant):
    """Input of `shrink_claims`: the replica has been put to sleep; its claims shrink to
    the weights of the model it runs (the catalog's ``weights_bytes``)."""

    replica_id: ReplicaId


class RegrowClaimsInput(Tolerant):
    """Input of `regrow_claims`: the replica is about to wake; its claims grow back first."""

    replica_id: ReplicaId


class RegrowClaimsResult(Tolerant):
    """What `regrow_claims` answers: grown back (``ok``), or why not, naming the node, the
    bytes waking takes back and the bytes free there (nothing changed)."""

    ok: bool
    reason: str | None = None
