"""The model catalog and deployments as the API and store exchange them. Pure."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from .base import Frozen
from .ids import DeploymentId, ModelId, NodeId, ReplicaId
from .shards import EngineKind
from .status import DeploymentStatus, ReplicaState

#: Model ids appear in URLs, workflow ids and OpenAI requests: keep them plain.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
#: A generous cap on one deployment's replicas; a typo of 1000 should not try to run.
MAX_REPLICAS = 64

#: The packaged SmolLM2 GGUF, by name, so catalogs need no machine-specific path.
PACKAGED_SMOLLM2 = "smollm2"


class ModelSpec(Frozen):
    """A model as an operator declares it (POST /models)."""

    model_id: ModelId = Field(pattern=MODEL_ID_PATTERN)
    engine: EngineKind
    source: str = Field(min_length=1, max_length=1000,
                        description="a .gguf path, 'smollm2' for the packaged SmolLM2, "
                                    "a Hugging Face repo id, or an http(s) URL")
    memory_bytes: int | None = Field(
        default=None, gt=0,
        description="declared working set per replica; estimated from the file size when "
                    "absent (llama.cpp with a local file only)")
    cpu_cores: float | None = Field(default=None, gt=0)
    gpus: int | None = Field(default=None, ge=0)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    min_nodes: int = Field(default=1, ge=1, le=64)


class CatalogModel(ModelSpec):
    """A model in the catalog: memory is always known, and says if it was estimated."""

    memory_bytes: int = Field(gt=0)
    memory_estimated: bool = False
    created_at: datetime | None = None


class DeploymentRequest(Frozen):
    """POST /deployments."""

    model_id: ModelId = Field(pattern=MODEL_ID_PATTERN)
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    min_nodes: int = Field(default=1, ge=1, le=64)
    node_ids: list[NodeId] | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class ScaleRequest(Frozen):
    """PATCH /deployments/{id}."""

    replicas: int = Field(ge=0, le=MAX_REPLICAS)


class ReplicaView(Frozen):
    """One replica as the API shows it."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    model_id: ModelId
    nodes: list[NodeId]
    state: ReplicaState
    endpoint: str | None
    started_at: datetime | None
    ready_at: datetime | None
    #: The deployment's generation it was placed on (0: before generations existed).
    generation: int = 0
    #: The catalog model it runs; None: the deployment's ``model_id``.
    runs_model_id: ModelId | None = None
    #: Placed on an older generation than its deployment's: due to be replaced.
    outdated: bool = False


class DeploymentView(Frozen):
    """One deployment as the API shows it."""

    deployment_id: DeploymentId
    model_id: ModelId
    status: DeploymentStatus
    placement_error: str | None
    desired_replicas: int
    ready_replicas: int
    consecutive_failures: int
    last_failure: str | None
    min_nodes: int
    node_ids: list[NodeId] | None
    labels: dict[str, str]
    replicas: list[ReplicaView]
    workflow_id: str
    created_at: datetime
    updated_at: datetime
    #: What the deployment runs now (see modelkeeper.domain.ops.Generation).
    generation: int = 0
    #: The catalog model behind the served name; None: ``model_id`` itself.
    runs_model_id: ModelId | None = None
    #: Why the last replica placed shares a node with another (no other had room).
    placement_note: str | None = None


class DeploymentStatusUpdate(Frozen):
    """What the keeper writes to the store when its status changes."""

    deployment_id: DeploymentId
    status: DeploymentStatus
    placement_error: str | None
    consecutive_failures: int
    last_failure: str | None
    desired_replicas: int
    #: The deployment's generation, the model behind its served name (None: ``model_id``
    #: itself) and the last placement's sharing note, written as they stand.
    generation: int = 0
    runs_model_id: ModelId | None = None
    placement_note: str | None = None


class ReplicaStateUpdate(Frozen):
    """What the keeper writes when a replica changes state."""

    replica_id: ReplicaId
    state: ReplicaState
    endpoint: str | None = None


#: llama.cpp maps the whole file and adds its KV cache and compute buffers. Measured here
#: with SmolLM2 (98 MB file): 194 MiB RSS at 4 slots of 1024 tokens. 1.2 x file + 96 MiB
#: gives 214 MiB for it: a little above the measurement, as an estimate should be.
ESTIMATE_FACTOR = 1.2
ESTIMATE_OVERHEAD_BYTES = 96 << 20


def estimate_memory_bytes(file_size: int) -> int:
    """Working set of a GGUF model of ``file_size`` bytes under llama.cpp (an estimate)."""
    return int(file_size * ESTIMATE_FACTOR) + ESTIMATE_OVERHEAD_BYTES
