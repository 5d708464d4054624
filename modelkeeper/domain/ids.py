"""Typed identifiers. Distinct types keep a node id from being passed where a replica id goes."""

from typing import NewType

NodeId = NewType("NodeId", str)
ModelId = NewType("ModelId", str)
DeploymentId = NewType("DeploymentId", str)
ReplicaId = NewType("ReplicaId", str)
#: An operation a saga asks a deployment workflow for: the saga's workflow id and its step
#: (``restart/d1/3:replace-d1-r2``), so a retried update is recognised and answered again.
MoveId = NewType("MoveId", str)
#: A saga's workflow id (``restart/d1/3``): readable in the web UI and the CLI.
OperationId = NewType("OperationId", str)
