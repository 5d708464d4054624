"""The fleet at a glance (``GET /fleet``, ``modelkeeper status``): how full the cluster is,
what is broken, and what holds memory nobody uses. Pure: the nodes, the deployments, the
replicas' usage and the time come in as arguments; :func:`summarise` answers one
:class:`FleetSummary`.

A per-node listing (``modelkeeper nodes``) is right for four nodes and a chore at two
hundred; these are the aggregates read off the same state, so they cannot disagree with
the tables. Rules, each with its test in ``tests/unit/test_fleet_summary.py``:

1. **Capacity is what placement could use.** Memory and GPUs are summed over ``ready``
   nodes only: a cordoned, unreachable or lost node's free memory is not room for
   anything new. The other nodes are counted by state.
2. **Memory:** used is what claims hold (a sleeping replica's claim counts as what it
   keeps); free is each node's total minus its used, floored at zero per node (one
   over-claimed node's deficit is not taken off another's room). A node that does not
   report its memory adds to neither and is counted apart (``nodes_memory_unknown``).
3. **GPUs per class:** grouped by the name the agents report (``NVIDIA H100 80GB HBM3``),
   else :data:`UNNAMED_GPU_CLASS`. A GPU is ``unhealthy`` (counted as neither used nor
   free: counting it free is how a cluster looks as if it had room it has not), else
   ``used`` when a claim holds it, else ``free``.
4. **Free whole nodes:** ready nodes with no claim at all, what a replica spanning nodes
   needs (free memory spread over busy nodes is no room for it).
5. **Counts:** deployments, replicas by state, models in the catalog and models deployed
   (the model each deployment runs).
6. **Cannot be placed:** deployments showing ``cant_place``, and any other with a
   placement error (a warm standby or a replacement that found no room), each with its
   reason.
7. **Asked for by nobody lately:** ready or sleeping replicas whose usage shows no request
   for :data:`UNASKED_AFTER_S` or more, most idle first. Unknown is not idle: a replica no
   gateway reports (one just restarted knows nothing) is listed apart, as unknown, never
   as idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import Field

from .base import Frozen, Tolerant
from .catalog import DeploymentView
from .eviction import Candidate, idle_s
from .ids import DeploymentId, ModelId, NodeId, ReplicaId
from .nodes import NodeRecord, NodeState
from .status import DeploymentStatus, ReplicaState

#: A replica unused this long is "asked for by nobody lately" (rule 7): an hour is past
#: any on-demand idle timeout worth having (they are minutes), so what is listed is held
#: on purpose or forgotten, which is the question an operator asks first.
UNASKED_AFTER_S = 3600.0

#: The class of a GPU whose agent reports no name.
UNNAMED_GPU_CLASS = "gpu"

#: The replica states whose use is listed (rule 7): the others hold no room for long.
_LISTED_USE = frozenset({ReplicaState.READY, ReplicaState.SLEEPING})


class FleetNode(Frozen):
    """One node as the summary reads it: its record (inventory and summed claims) and its
    state at the summary's time."""

    record: NodeRecord
    state: NodeState


class MemoryUse(Tolerant):
    """Memory over the ready nodes that report it (rules 1 and 2)."""

    total_bytes: int = 0
    used_bytes: int = 0
    free_bytes: int = 0


class GpuClassUse(Tolerant):
    """The GPUs of one class on the ready nodes (rule 3): used + free + unhealthy =
    total."""

    gpu_class: str
    total: int = 0
    used: int = 0
    free: int = 0
    unhealthy: int = 0


class WaitingForRoom(Tolerant):
    """A deployment that cannot be placed now, and why (rule 6)."""

    deployment_id: DeploymentId
    model_id: ModelId
    status: DeploymentStatus
    reason: str


class Unasked(Tolerant):
    """A replica nobody has asked for lately (rule 7), or whose use is unknown."""

    replica_id: ReplicaId
    deployment_id: DeploymentId
    state: ReplicaState
    #: Unused for this long; None: unknown (no gateway reports it).
    idle_s: float | None
    #: What it holds, which stopping it would free.
    memory_bytes: int = Field(ge=0)
    nodes: list[NodeId]


class FleetSummary(Tolerant):
    """The fleet at :attr:`at`. See the module docstring for each rule."""

    at: datetime
    #: Nodes by state (every node, ready or not).
    nodes: dict[str, int]
    nodes_memory_unknown: int = 0
    memory: MemoryUse
    gpus: list[GpuClassUse]
    #: Names of the ready nodes with no claim at all, by name.
    free_whole_nodes: list[str]
    deployments: int
    replicas: dict[str, int]
    models_in_catalog: int
    models_deployed: int
    cant_place: list[WaitingForRoom]
    #: Ready or sleeping replicas unused for :attr:`unasked_after_s` or more, most idle
    #: first.
    unasked: list[Unasked]
    #: Ready or sleeping replicas whose use no gateway reports: unknown, not idle.
    usage_unknown: list[Unasked]
    unasked_after_s: float

    @property
    def replica_total(self) -> int:
        return sum(self.replicas.values())


def _gpu_classes(ready: Sequence[NodeRecord]) -> list[GpuClassUse]:
    counts: dict[str, dict[str, int]] = {}
    for record in ready:
        claimed = set(record.gpus_claimed)
        for gpu in record.gpus:
            name = gpu.name.strip() or UNNAMED_GPU_CLASS
            tally = counts.setdefault(name, {"used": 0, "free": 0, "unhealthy": 0})
            if not gpu.healthy:
                tally["unhealthy"] += 1
            elif gpu.index in claimed:
                tally["used"] += 1
            else:
                tally["free"] += 1
    return [GpuClassUse(gpu_class=name, total=sum(t.values()), **t)
            for name, t in sorted(counts.items())]


def _holds_nothing(record: NodeRecord) -> bool:
    return (record.memory_claimed_bytes == 0 and record.cpu_claimed == 0
            and not record.gpus_claimed)


def _cant_place(deployments: Sequence[DeploymentView]) -> list[WaitingForRoom]:
    found = []
    for d in deployments:
        if d.status is DeploymentStatus.CANT_PLACE or d.placement_error is not None:
            found.append(WaitingForRoom(deployment_id=d.deployment_id, model_id=d.model_id,
                                     status=d.status,
                                     reason=d.placement_error or "no node has room"))
    return found


def _use_of(candidate: Candidate, now: datetime) -> Unasked:
    return Unasked(replica_id=candidate.replica_id, deployment_id=candidate.deployment_id,
                   state=candidate.state, idle_s=idle_s(candidate, now),
                   memory_bytes=candidate.freed_bytes,
                   nodes=sorted({c.node_id for c in candidate.claims}))


def summarise(*, nodes: Sequence[FleetNode], deployments: Sequence[DeploymentView],
              usage: Sequence[Candidate], models_in_catalog: int, now: datetime,
              unasked_after_s: float = UNASKED_AFTER_S) -> FleetSummary:
    """The fleet at ``now`` (see the module docstring). ``usage`` is the replicas with
    their claims and usage as eviction reads them (``use`` None: unknown)."""
    by_state: dict[str, int] = {}
    for node in nodes:
        by_state[node.state.value] = by_state.get(node.state.value, 0) + 1
    ready = [n.record for n in nodes if n.state is NodeState.READY]
    reporting = [r for r in ready if r.memory_total_bytes is not None]
    total = sum(r.memory_total_bytes or 0 for r in reporting)
    used = sum(r.memory_claimed_bytes for r in reporting)
    free = sum(max((r.memory_total_bytes or 0) - r.memory_claimed_bytes, 0) for r in reporting)
    replicas: dict[str, int] = {}
    for d in deployments:
        for r in d.replicas:
            replicas[r.state.value] = replicas.get(r.state.value, 0) + 1
    unasked, unknown = [], []
    for candidate in usage:
        if candidate.state not in _LISTED_USE:
            continue
        use = _use_of(candidate, now)
        if use.idle_s is None:
            unknown.append(use)
        elif use.idle_s >= unasked_after_s:
            unasked.append(use)
    unasked.sort(key=lambda u: (-(u.idle_s or 0.0), u.replica_id))
    unknown.sort(key=lambda u: u.replica_id)
    return FleetSummary(
        at=now, nodes=dict(sorted(by_state.items())),
        nodes_memory_unknown=len(ready) - len(reporting),
        memory=MemoryUse(total_bytes=total, used_bytes=used, free_bytes=free),
        gpus=_gpu_classes(ready),
        free_whole_nodes=sorted(r.name for r in ready if _holds_nothing(r)),
        deployments=len(deployments), replicas=dict(sorted(replicas.items())),
        models_in_catalog=models_in_catalog,
        models_deployed=len({d.runs_model_id or d.model_id for d in deployments}),
        cant_place=_cant_place(deployments), unasked=unasked, usage_unknown=unknown,
        unasked_after_s=unasked_after_s)
