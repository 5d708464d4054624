"""``GET /replicas/{replica_id}/logs``: an engine's log, read on its node by its agent.

The API asks the agent through Temporal (workflows/engine_log.py): agents listen on no
port of their own (docs/security.md). Admins only, though it is a read: an engine's log
may hold prompts (vLLM's request logging, llama.cpp's verbose output), which a viewer
token (a dashboard's) must not read. Bounded and scrubbed on the node
(modelkeeper.domain.log_reads).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType
from temporalio.service import RPCError

from modelkeeper.domain.ids import NodeId, ReplicaId
from modelkeeper.domain.log_reads import (
    DEFAULT_TAIL_LINES,
    MAX_TAIL_LINES,
    EngineLogChunk,
    EngineLogInput,
    EngineLogRequest,
    valid_replica_id,
)
from modelkeeper.domain.operators import OperatorRole, scope_refusal
from modelkeeper.names import CONTROL_TASK_QUEUE, ERROR_NO_ENGINE_LOG, engine_log_workflow_id
from workflows.engine_log import AGENT_PICKUP, RUN_TIMEOUT, EngineLogWorkflow

from .auth import OperatorDep
from .deps import StoreDep, TemporalDep
from .nodes import resolve_node_ids
from .problems import problems

router = APIRouter(tags=["logs"])


@router.get("/replicas/{replica_id}/logs", response_model=EngineLogChunk,
            responses=problems(404, 502, 503, 504))
async def replica_logs(
    replica_id: str, store: StoreDep, temporal: TemporalDep, operator: OperatorDep, *,
    tail: Annotated[int, Query(ge=0, le=MAX_TAIL_LINES, description=(
        "the last this many lines (without `after`)"))] = DEFAULT_TAIL_LINES,
    after: Annotated[int | None, Query(ge=0, description=(
        "the lines written after this byte offset (an earlier answer's end_offset): a "
        "follow"))] = None,
    rank: Annotated[int, Query(ge=0, description="the shard of a multi-node replica")] = 0,
    node: Annotated[str | None, Query(description=(
        "the node (name or id) whose log to read, for a replica the API no longer "
        "knows"))] = None,
) -> EngineLogChunk:
    """The last ``tail`` lines of the replica's engine log (or those after ``after``),
    scrubbed of keys. 403 for a viewer token (a log may hold prompts); 404 when the
    replica's node is unknown or it has no log there; 504 when its agent does not answer."""
    if operator.role is not OperatorRole.ADMIN:
        raise HTTPException(403, f"token {operator.name!r} is a {operator.role.value} token: "
                                 "reading an engine's log needs an admin token, since a log "
                                 "may hold prompts")
    if not valid_replica_id(replica_id):
        # The shape of FastAPI's own 422s, which the OpenAPI document promises.
        raise HTTPException(422, [{
            "loc": ["path", "replica_id"], "type": "value_error", "input": replica_id[:200],
            "msg": f"replica_id {replica_id[:200]!r} is not a replica id (letters, digits, "
                   "'.', '_' and '-', at most 128)"}])
    home = await store.deployments.replica_home(replica_id)
    if operator.scope is not None:
        owner = None
        if home is not None and home[0] is not None:
            view = await store.deployments.get_deployment(home[0])
            owner = None if view is None else view.owner
        why = scope_refusal(operator.scope, owner, f"replica {replica_id}")
        if why is not None:
            raise HTTPException(403, f"token {operator.name!r} cannot read the log of "
                                     f"{replica_id}: {why}")
    if node is not None:
        [node_id] = await resolve_node_ids(store, [node], loc=("query", "node"))
    elif home is None:
        raise HTTPException(404, f"replica {replica_id!r} is unknown: no claim and no "
                                 "placement event names it; give its node with ?node= "
                                 "(`modelkeeper logs REPLICA --node NODE`)")
    elif rank >= len(home[1]):
        raise HTTPException(422, [{
            "loc": ["query", "rank"], "type": "value_error", "input": rank,
            "msg": f"rank {rank}: replica {replica_id} has {len(home[1])} shard(s), "
                   f"ranks 0-{len(home[1]) - 1}"}])
    else:
        node_id = home[1][rank]
    request = EngineLogInput(node_id=NodeId(node_id), read=EngineLogRequest(
        replica_id=ReplicaId(replica_id), tail=tail, after=after))
    try:
        return await temporal.execute_workflow(
            EngineLogWorkflow.run, request,
            id=engine_log_workflow_id(replica_id, secrets.token_hex(6)),
            task_queue=CONTROL_TASK_QUEUE, execution_timeout=RUN_TIMEOUT)
    except WorkflowFailureError as exc:
        raise _read_failed(exc, replica_id, node_id) from exc
    except RPCError as exc:
        raise HTTPException(503, f"Temporal did not take the read of {replica_id}'s log: "
                                 f"{exc.message}; try again") from exc


def _read_failed(exc: WorkflowFailureError, replica_id: str, node_id: str) -> HTTPException:
    """The failed read as the answer that says why."""
    cause = exc.cause.cause if isinstance(exc.cause, ActivityError) else exc.cause
    if isinstance(cause, ApplicationError) and cause.type == ERROR_NO_ENGINE_LOG:
        return HTTPException(404, cause.message)
    if isinstance(cause, TimeoutError) and cause.type is TimeoutType.SCHEDULE_TO_START:
        pickup = AGENT_PICKUP.total_seconds()
        return HTTPException(504, f"the agent of node {node_id} did not pick up the read of "
                                  f"{replica_id}'s log within {pickup:.0f} s: it is down or "
                                  "cut off (`modelkeeper nodes` shows its liveness)")
    return HTTPException(502, f"reading {replica_id}'s log on node {node_id} failed: "
                              f"{cause or exc}")
