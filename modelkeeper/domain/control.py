"""Inputs and results of the control worker's store activities.

They are the contract between a deployment workflow and the activities it calls, so they
live in the domain: the workflow names the activities (``modelkeeper.names``) and imports
these, and never imports the activities' module, which holds the store.
"""

from __future__ import annotations

from pydantic import Field

from .base import Tolerant
from .ids import DeploymentId, NodeId, ReplicaId
from .keeper import DeploymentSpec
from .ops import Generation
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


class ReleaseReplicaInput(Tolerant):
    """Input of `release_replica`."""

    replica_id: ReplicaId


class DeleteDeploymentInput(Tolerant):
    """Input of `delete_deployment`."""

    deployment_id: DeploymentId
