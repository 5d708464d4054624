"""Typed identifiers. Distinct types keep a node id from being passed where a replica id goes."""

from typing import NewType

NodeId = NewType("NodeId", str)
ModelId = NewType("ModelId", str)
DeploymentId = NewType("DeploymentId", str)
ReplicaId = NewType("ReplicaId", str)
