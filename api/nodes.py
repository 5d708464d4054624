"""Routes for nodes as operators see them: the list, one node, and the operator's settings
(labels, cordon, hold), and the facility's power caps. What agents send (registration,
heartbeats) is in ``agents``; their liveness stream in ``liveness``."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel

from modelkeeper.domain.capacity import CapacityClass
from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import (
    GpuInfo,
    NodeRecord,
    NodeRemoval,
    NodeState,
    NodeUpdate,
    node_state,
)
from modelkeeper.domain.topology import FACILITY_CAP_KEY, PduName, PowerCap
from modelkeeper.domain.watchdog import MemoryLevel
from modelkeeper.settings import Settings
from modelkeeper.store import Store

from .auth import OperatorDep, change
from .deps import SettingsDep, StoreDep, TemporalDep
from .liveness import signal_node_silent
from .problems import problems
from .signals import signal_waiting_deployments

router = APIRouter()

#: Known nodes a refusal lists by name and id; past this many it counts the rest, so a
#: fleet's refusal stays a sentence (`modelkeeper nodes` lists them all).
KNOWN_NODES_LISTED = 20


async def resolve_node_ids(store: Store, refs: Sequence[str], *,
                           loc: tuple[str, str]) -> list[NodeId]:
    """The ids of the nodes ``refs`` name, each by id or by name, in order and without
    repeats: the one place the API takes a node's name wherever it takes an id. An id
    wins over a name (names are chosen freely, ids are unique).

    A ref that names no registered node raises a 422 at ``loc`` (e.g. ``("body",
    "node_ids")``) naming it and listing the known nodes by name and id; a name that two
    nodes share raises one naming both, since pinning to either would be a guess.
    """
    nodes = await store.nodes.list_nodes()
    by_id = {n.node_id: n for n in nodes}
    by_name: dict[str, list[NodeRecord]] = {}
    for node in nodes:
        by_name.setdefault(node.name, []).append(node)
    resolved: list[NodeId] = []
    for ref in refs:
        if ref in by_id:
            node_id = NodeId(ref)
        else:
            named = by_name.get(ref, [])
            if len(named) != 1:
                raise _node_ref_error(ref, named, nodes, loc=loc)
            node_id = named[0].node_id
        if node_id not in resolved:
            resolved.append(node_id)
    return resolved


def _node_ref_error(ref: str, named: Sequence[NodeRecord], nodes: Sequence[NodeRecord], *,
                    loc: tuple[str, str]) -> RequestValidationError:
    if named:
        ids = ", ".join(n.node_id for n in named)
        message = (f"{ref!r} is the name of {len(named)} nodes ({ids}): give the id of "
                   "the one you mean")
    else:
        listed = ", ".join(f"{n.name} ({n.node_id})" for n in nodes[:KNOWN_NODES_LISTED])
        if len(nodes) > KNOWN_NODES_LISTED:
            listed += (f" and {len(nodes) - KNOWN_NODES_LISTED} more (`modelkeeper "
                       "nodes` lists them)")
        message = (f"{ref!r} is neither the id nor the name of a registered node; known "
                   f"nodes: {listed or 'none'}")
    return RequestValidationError([{"type": "value_error", "loc": loc, "msg": message,
                                    "input": ref}])


class NodeInfo(BaseModel):
    """A node as `GET /nodes` shows it. Null memory means the agent does not report it."""

    node_id: str
    name: str
    state: NodeState
    memory_total_bytes: int | None
    memory_claimed_bytes: int
    memory_free_bytes: int | None
    memory_available_bytes: int | None
    cpu_count: int | None
    cpu_claimed: float
    gpus: list[GpuInfo]
    gpus_claimed: list[int]
    labels: dict[str, str]
    agent_labels: dict[str, str]
    operator_labels: dict[str, str]
    cordoned: bool
    cordon_reason: str | None
    last_seen: datetime
    #: Since when the liveness channel finds the node silent (its state is unreachable).
    silent_since: datetime | None = None
    #: The memory watchdog's level as the node's agent last reported it, since when and
    #: why (docs/capacity.md, "The memory watchdog").
    memory_level: MemoryLevel = MemoryLevel.OK
    memory_level_since: datetime | None = None
    memory_level_reason: str | None = None
    #: Kept for this class, or this owner scope and those beneath it (placement rule 5;
    #: ``PATCH`` with ``hold_class``/``hold_owner``, ``release_hold``).
    hold_class: CapacityClass | None = None
    hold_owner: str | None = None
    #: The engines its agent can run, with their versions (placement rule 11); null: its
    #: agent did not say (older than the report), and placement takes it as able to run
    #: any.
    engines: dict[str, str] | None = None


def node_info(record: NodeRecord, settings: Settings) -> NodeInfo:
    """The API's view of a stored node; its state is judged now, by the settings' timeouts."""
    total = record.memory_total_bytes
    return NodeInfo(
        node_id=record.node_id, name=record.name,
        state=node_state(record, datetime.now(UTC),
                         unreachable_after_s=settings.node_unreachable_after_s,
                         lost_after_s=settings.node_lost_after_s),
        memory_total_bytes=total, memory_claimed_bytes=record.memory_claimed_bytes,
        memory_free_bytes=None if total is None else total - record.memory_claimed_bytes,
        memory_available_bytes=record.memory_available_bytes,
        cpu_count=record.cpu_count, cpu_claimed=record.cpu_claimed, gpus=record.gpus,
        gpus_claimed=record.gpus_claimed, labels=record.labels,
        agent_labels=record.agent_labels, operator_labels=record.operator_labels,
        cordoned=record.cordoned, cordon_reason=record.cordon_reason,
        last_seen=record.last_seen, silent_since=record.silent_since,
        memory_level=record.memory_level, memory_level_since=record.memory_level_since,
        memory_level_reason=record.memory_level_reason, hold_class=record.hold_class,
        hold_owner=record.hold_owner, engines=record.engines)


@router.get("/nodes", response_model=list[NodeInfo])
async def list_nodes(store: StoreDep, settings: SettingsDep) -> list[NodeInfo]:
    """Every node: state, memory total/claimed/free, CPUs, labels, last seen."""
    return [node_info(n, settings) for n in await store.nodes.list_nodes()]


@router.get("/nodes/{node_id}", response_model=NodeInfo, responses=problems(404))
async def get_node(node_id: str, store: StoreDep, settings: SettingsDep) -> NodeInfo:
    """One node; 404 when unknown."""
    record = await store.nodes.get_node(node_id)
    if record is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    return node_info(record, settings)


@router.patch("/nodes/{node_id}", response_model=NodeInfo, responses=problems(404))
async def update_node(node_id: str, update: NodeUpdate, store: StoreDep, *,
                      temporal: TemporalDep, settings: SettingsDep,
                      operator: OperatorDep) -> NodeInfo:
    """Operator settings: labels, cordon and hold. Labels outrank the agent's own; a hold
    reserves the node for a class or an owner scope (placement rule 5)."""
    record = await store.nodes.update_node(node_id, update)
    if record is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    changed = update.model_dump(exclude_none=True)
    await store.events.record_event(change(
        operator, "node.updated", f"node {record.name} ({record.node_id}): "
        + (", ".join(f"{k}={v}" for k, v in changed.items()) or "nothing changed"),
        node_id=record.node_id, data=changed))
    if update.cordoned is False or update.labels is not None or update.release_hold \
            or update.hold_class is not None or update.hold_owner is not None:
        # Uncordoned, relabelled or re-held: a node a waiting deployment was refused may
        # take it now.
        await signal_waiting_deployments(store, temporal)
    return node_info(record, settings)


@router.delete("/nodes/{node_id}", response_model=NodeRemoval,
               responses={404: {"description": "No such node."},
                          409: {"description": "Replicas hold claims on the node; "
                                               "`?force=true` removes it anyway."}})
async def remove_node(node_id: str, store: StoreDep, *, temporal: TemporalDep,
                      operator: OperatorDep, force: bool = False) -> NodeRemoval:
    """Remove a node and its credential. 409 while replicas hold claims on it (drain it
    first), unless ``force``: then their claims go with it and their deployments are told
    the node is gone (as when it goes silent), so they place those replicas again.

    An agent still running on the node joins again with the join token at its next
    heartbeat, as a new node: stop the agent first to keep it out.
    """
    removal = await store.nodes.delete_node(node_id, force=force)
    if removal is None:
        raise HTTPException(404, f"node {node_id!r} is not registered")
    held = sum(len(ids) for ids in removal.replicas.values())
    if not removal.removed:
        named = ", ".join(r for ids in removal.replicas.values() for r in ids)
        raise HTTPException(409, f"node {removal.name!r} ({node_id}) holds {held} "
                                 f"replica(s) ({named}): move them first (`modelkeeper "
                                 f"drain {removal.name}`), or remove it anyway with "
                                 f"force=true (`modelkeeper nodes rm {removal.name} --force`)")
    told = await signal_node_silent(temporal, NodeId(node_id), removal.replicas)
    await store.events.record_event(change(
        operator, "node.removed",
        f"node {removal.name} ({node_id}) removed"
        + (f", with {held} replica(s) on it; told {told} deployment(s)" if held else ""),
        node_id=NodeId(node_id), data=removal.model_dump(mode="json")))
    return removal


@router.get("/power-caps", response_model=dict[str, int])
async def list_power_caps(store: StoreDep) -> dict[str, int]:
    """Every power cap in force, in watts, by PDU name (a node's ``topology.pdu`` label);
    the whole facility's under ``_facility``."""
    return await store.nodes.power_caps()


@router.put("/power-caps/{pdu}", response_model=dict[str, int])
async def set_power_cap(pdu: PduName, cap: PowerCap, store: StoreDep, *,
                        temporal: TemporalDep, operator: OperatorDep) -> dict[str, int]:
    """Cap what the nodes of PDU ``pdu`` (``_facility``: every node) may draw together, in
    watts, counted from the declared ``watts`` of the shards placed on them. A placement
    that would pass it is refused with the numbers; what already runs is not stopped."""
    await store.nodes.set_power_cap(pdu, cap.watts)
    what = "the facility" if pdu == FACILITY_CAP_KEY else f"pdu {pdu}"
    await store.events.record_event(change(
        operator, "power_cap.set", f"{what}: power cap {cap.watts} W",
        data={"pdu": pdu, "watts": cap.watts}))
    # A raised cap may make room for a deployment waiting for it.
    await signal_waiting_deployments(store, temporal)
    return await store.nodes.power_caps()


@router.delete("/power-caps/{pdu}", response_model=dict[str, int], responses=problems(404))
async def remove_power_cap(pdu: PduName, store: StoreDep, *, temporal: TemporalDep,
                           operator: OperatorDep) -> dict[str, int]:
    """Remove a power cap: the PDU (or the facility) is no longer capped."""
    caps = await store.nodes.power_caps()
    if pdu not in caps:
        raise HTTPException(404, f"pdu {pdu!r} has no power cap")
    await store.nodes.set_power_cap(pdu, None)
    await store.events.record_event(change(
        operator, "power_cap.removed", f"pdu {pdu}: power cap removed", data={"pdu": pdu}))
    await signal_waiting_deployments(store, temporal)
    return await store.nodes.power_caps()
