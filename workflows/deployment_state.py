"""The deployment workflow's state, input and published numbers: plain values, and pure
functions of them (what the store should be told next, which search attributes to set).

The workflow (workflows/deployment.py) carries :class:`DeploymentWorkflowState` whole
through continue-as-new; its shape is part of what running workflows must decode.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey, SearchAttributeUpdate

with workflow.unsafe.imports_passed_through():
    from pydantic import Field, field_validator

    from modelkeeper.domain.base import Tolerant
    from modelkeeper.domain.catalog import DeploymentStatusUpdate, ReplicaStateUpdate
    from modelkeeper.domain.keeper import (
        DeploymentSpec,
        KeeperConfig,
        KeeperState,
        current_generation,
        overview,
        placement_note,
        policy_of,
        status,
        stored_state,
    )
    from modelkeeper.domain.shards import ShardSpec
    from modelkeeper.domain.status import DeploymentStatus
    from modelkeeper.domain.tunables import Tunables

# Search attributes (registered on the server: modelkeeper.names.SEARCH_ATTRIBUTES).
MODEL_ID_KEY = SearchAttributeKey.for_keyword("ModelId")
STATUS_KEY = SearchAttributeKey.for_keyword("DeploymentStatus")
READY_KEY = SearchAttributeKey.for_int("ReadyReplicas")
DESIRED_KEY = SearchAttributeKey.for_int("DesiredReplicas")
NODES_KEY = SearchAttributeKey.for_keyword_list("NodeIds")

#: The DeploymentStatus search attribute of a deployment that is gone (not a
#: DeploymentStatus: nothing in the store or the API ever shows it).
FINAL_STATUS = "deleted"


class DeleteRequest(Tolerant):
    """Signal payload of `delete`: who asked. An API of an older version sends none."""

    requested_by: str = ""


class Deletion(Tolerant):
    """The delete as the workflow received it: who asked, when, and how many replicas held
    a place then (each is stopped before the run ends)."""

    requested_by: str = ""
    at: datetime
    replicas: int = 0


class DeploymentWorkflowState(Tolerant):
    """Everything the workflow knows; continue-as-new passes exactly this.

    Tolerant of unknown keys, as is everything in it (modelkeeper.domain.base.Tolerant):
    a worker rolled back past a new field must still decode the state a newer one carried
    over, or the workflow task fails for ever.
    """

    keeper: KeeperState
    config: KeeperConfig = Field(default_factory=KeeperConfig)
    tunables: Tunables = Field(default_factory=Tunables)
    #: Shard specs of each placed replica (from place_replica), by replica id.
    shards: dict[str, list[ShardSpec]] = Field(default_factory=dict)
    #: What was last written to the store, so only changes are written.
    written_status: DeploymentStatusUpdate | None = None
    written_replicas: dict[str, str] = Field(default_factory=dict)
    #: When false, no search attributes are upserted (the time-skipping test server
    #: has none registered).
    search_attributes: bool = True
    #: The delete, once asked: the run's result is made of it (:func:`deleted_result`).
    deletion: Deletion | None = None

    @field_validator("written_status", mode="before")
    @classmethod
    def _drop_unknown_status_keys(cls, value: Any) -> Any:
        # DeploymentStatusUpdate is also the store activity's input, which stays strict;
        # as carried state it must tolerate a field a newer worker added.
        if isinstance(value, dict):
            known = DeploymentStatusUpdate.model_fields
            return {k: v for k, v in value.items() if k in known}
        return value


class DeploymentInput(Tolerant):
    """The workflow's input: a new deployment's spec and tunables, from which the workflow
    builds its state; or, after continue-as-new, the state the run before carried."""

    spec: DeploymentSpec
    tunables: Tunables = Field(default_factory=Tunables)
    #: When false, no search attributes are upserted (the time-skipping test server
    #: has none registered).
    search_attributes: bool = True
    #: Continue-as-new's: the whole state of the run before (its spec and tunables are
    #: the ones above).
    carried: DeploymentWorkflowState | None = None


class WorkflowStatus(Tolerant):
    """What the `status` query answers (to an API that may run another version)."""

    status: DeploymentStatus
    keeper: KeeperState


class NodesChangedInput(Tolerant):
    """Signal payload of `nodes_changed` (none needed yet; a model keeps it extensible,
    and a sender one version ahead may add a field)."""

    reason: str = ""


def status_update(keeper: KeeperState) -> DeploymentStatusUpdate:
    """The deployment's row as the keeper's state has it."""
    runs = current_generation(keeper)
    return DeploymentStatusUpdate(
        deployment_id=keeper.spec.deployment_id,
        status=status(keeper),
        placement_error=keeper.placement_error,
        consecutive_failures=keeper.consecutive_failures,
        last_failure=keeper.last_failure, desired_replicas=keeper.spec.replicas,
        # Defaults (0, None) until a generation is set or a replica shares a node.
        generation=runs.number,
        runs_model_id=runs.model_id if keeper.spec.generation is not None else None,
        placement_note=placement_note(keeper),
        scaling=(policy_of(keeper).model_dump(mode="json")
                 if keeper.spec.scaling is not None or keeper.window is not None else None),
        loading_since=keeper.loading_since, loading_reason=keeper.loading_reason,
        demand_note=keeper.demand_note)


def unwritten(state: DeploymentWorkflowState) -> ReplicaStateUpdate | DeploymentStatusUpdate | None:
    """What the store has not been told yet: a replica whose stored state differs from
    its phase (in the keeper's order), then the status if it differs from the one last
    written; None when the store is up to date."""
    written = state.written_replicas
    for replica in state.keeper.replicas:
        stored = stored_state(replica)
        if stored is not None and written.get(replica.replica_id) != stored.value:
            return ReplicaStateUpdate(replica_id=replica.replica_id, state=stored,
                                      endpoint=replica.endpoint,
                                      relaunch_note=replica.relaunch_note)
    current = status_update(state.keeper)
    return current if current != state.written_status else None


def search_attributes(keeper: KeeperState) -> list[SearchAttributeUpdate[Any]]:
    """The published numbers as search attribute updates. An empty NodeIds is unset
    rather than set to [], so "none" reads the same before and after a restart."""
    view = overview(keeper)
    return [STATUS_KEY.value_set(view.status.value), READY_KEY.value_set(view.ready),
            DESIRED_KEY.value_set(view.desired),
            NODES_KEY.value_set(view.node_ids) if view.node_ids else NODES_KEY.value_unset()]


def normalised(value: Any) -> Any:
    """A search attribute's value for comparison: a keyword list as a plain list."""
    return list(value) if isinstance(value, list | tuple) else value


def deletion(keeper: KeeperState, *, requested_by: str, now: datetime) -> Deletion:
    """The delete asked now: the replicas that hold a place are the ones it stops."""
    return Deletion(requested_by=requested_by, at=now,
                    replicas=sum(1 for r in keeper.replicas if r.nodes))


def deleted_result(keeper: KeeperState, asked: Deletion | None) -> str:
    """The run's result once it has deleted the deployment, for the web UI and
    ``temporal workflow result``: what was deleted, by whom, when, and what it stopped."""
    spec = keeper.spec
    text = f"Deployment {spec.deployment_id} ({spec.model_id}) deleted"
    if asked is None:
        return text
    if asked.requested_by:
        text += f" by {asked.requested_by}"
    n = asked.replicas
    return (f"{text} at {asked.at:%Y-%m-%d %H:%M:%S} UTC: "
            f"{n} {'replica' if n == 1 else 'replicas'} stopped")
