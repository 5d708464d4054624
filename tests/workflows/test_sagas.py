"""The saga workflows on the time-skipping server, every activity faked by name.

A small scripted fake deployment answers the moves as the contract says
(modelkeeper.domain.moves): a replace places a new copy and retires the old one, a stop-first
one retires first, cancel_move retires what the move surged. Each test asserts the move requests
the fake saw and the OperationRecord's steps (names, states, order). The activities
themselves (activities/moves.py) are tested at the end against a tiny deployment workflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from activities.moves import MoveActivities
from modelkeeper.domain.catalog import Generation
from modelkeeper.domain.ids import DeploymentId, ModelId, MoveId, NodeId, ReplicaId
from modelkeeper.domain.moves import (
    AwaitMoveCall,
    AwaitMoveRequest,
    CancelMoveCall,
    CancelMoveRequest,
    DeploymentBrief,
    DescribeDeploymentInput,
    MoveCall,
    MoveKind,
    MoveOutcome,
    MoveRequest,
    MoveState,
    ReplicaBrief,
    SetGenerationCall,
    SetGenerationRequest,
)
from modelkeeper.domain.operations import (
    DrainInput,
    NodeDeploymentsInput,
    NodeReplica,
    OperationKind,
    OperationRecord,
    OperationState,
    RestartInput,
    SetCordonInput,
    StepState,
    SwitchInput,
)
from modelkeeper.names import (
    ACTIVITY_AWAIT_MOVE,
    ACTIVITY_BEGIN_OPERATION,
    ACTIVITY_CANCEL_MOVE,
    ACTIVITY_DESCRIBE_DEPLOYMENT,
    ACTIVITY_NODE_DEPLOYMENTS,
    ACTIVITY_RECORD_OPERATION,
    ACTIVITY_REQUEST_MOVE,
    ACTIVITY_SET_CORDON,
    ACTIVITY_SET_GENERATION,
    CONTROL_TASK_QUEUE,
    ERROR_MOVE_REFUSED,
    ERROR_NO_DEPLOYMENT,
    ERROR_OPERATION_CONFLICT,
    ERROR_OPERATION_FAILED,
    QUERY_BRIEF,
    UPDATE_AWAIT_MOVE,
    UPDATE_CANCEL_MOVE,
    UPDATE_MOVE,
    UPDATE_SET_GENERATION,
    deployment_workflow_id,
    operation_workflow_id,
)
from workflows.drain import DrainSaga
from workflows.restart import RestartSaga
from workflows.switch import SwitchSaga

pytestmark = pytest.mark.timeout(60)

D1 = DeploymentId("d1")
D2 = DeploymentId("d2")
N1 = NodeId("n1")
N2 = NodeId("n2")
A = Generation(number=3, model_id=ModelId("model-a"))
B = Generation(number=4, model_id=ModelId("model-b"))
#: When a fake stop-first replace retires its replica, and when its new one is ready.
STOP_FIRST_AT = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
STOP_FIRST_OUTAGE = timedelta(seconds=30)
NO_ROOM = "no room: every node is full (n2: needs 8 GiB, has 2 GiB free)"

SAGAS: list[type] = [RestartSaga, DrainSaga, SwitchSaga]
HISTORIES = Path(__file__).resolve().parents[1] / "histories"


# -- a scripted fake deployment ------------------------------------------------------------

@dataclass
class FakeReplica:
    phase: str
    node: NodeId
    generation: Generation


@dataclass
class FakeDeployment:
    """One deployment's workflow as the sagas see it, answering moves like the contract.

    Scripts, each keyed by a move id's step (what follows the saga's workflow id and ':'):
    ``no_room`` moves find no room for their new replica; ``crash`` moves start a new replica
    that fails (with that error), as does any move placing a model in ``crash_models``;
    ``hold`` moves stay running until cancelled; ``refuse_cancel`` moves refuse their cancel.
    """

    deployment_id: DeploymentId
    generation: Generation
    replicas: dict[ReplicaId, FakeReplica]
    desired: int = 2
    no_room: set[str] = field(default_factory=set)
    crash: dict[str, str] = field(default_factory=dict)
    crash_models: set[ModelId] = field(default_factory=set)
    hold: set[str] = field(default_factory=set)
    refuse_cancel: set[str] = field(default_factory=set)
    #: Move requests refused (by the move's step), with the refusal.
    refuse: dict[str, str] = field(default_factory=dict)
    #: Moves (by step) carried out only at :meth:`open_gate`; meanwhile their replica is
    #: leased to them, and another saga's move of it is refused, as the keeper does.
    gated: set[str] = field(default_factory=set)
    gated_requests: dict[MoveId, MoveRequest] = field(default_factory=dict)
    #: Moves (by step) whose new replica lands on this node, whatever the move avoids
    #: (another saga's placement that came before the cordon).
    place_on: dict[str, NodeId] = field(default_factory=dict)
    #: A failed stop-first frees its slot and the deployment places a replica of its
    #: current generation at once (the real keeper does; False tests the saga's surge).
    refills: bool = False
    #: Every move as it stands, and what it ends as once awaited.
    moves: dict[MoveId, MoveOutcome] = field(default_factory=dict)
    ends: dict[MoveId, MoveOutcome] = field(default_factory=dict)
    generations_set: list[Generation] = field(default_factory=list)
    next_id: int = 0

    def new_replica(self, generation: Generation, avoid: list[NodeId]) -> ReplicaId:
        self.next_id = max(self.next_id, len(self.replicas)) + 1
        while ReplicaId(f"{self.deployment_id}-r{self.next_id}") in self.replicas:
            self.next_id += 1
        replica_id = ReplicaId(f"{self.deployment_id}-r{self.next_id}")
        node = next(n for n in (N2, NodeId("n3"), N1) if n not in avoid)
        self.replicas[replica_id] = FakeReplica("ready", node, generation)
        return replica_id

    def brief(self) -> DeploymentBrief:
        return DeploymentBrief(
            deployment_id=self.deployment_id, desired=self.desired, status="serving",
            generation=self.generation,
            replicas=[ReplicaBrief(replica_id=rid, phase=r.phase, nodes=[r.node],
                                   generation=r.generation)
                      for rid, r in self.replicas.items()])

    def request(self, request: MoveRequest) -> MoveOutcome:
        if request.move_id in self.moves:
            return self.moves[request.move_id]  # a retried update is answered, not repeated
        if _step(request.move_id) in self.refuse:
            raise ApplicationError(self.refuse[_step(request.move_id)], type=ERROR_MOVE_REFUSED,
                                   non_retryable=True)
        if request.kind is not MoveKind.SURGE and request.replica_id not in self.replicas:
            raise ApplicationError(f"replica {request.replica_id!r} is not one of "
                                   f"{self.deployment_id}'s", type=ERROR_MOVE_REFUSED,
                                   non_retryable=True)
        lease = next((m for m in self.gated_requests.values()
                      if m.replica_id == request.replica_id and m.move_id not in self.ends),
                     None)
        if lease is not None:
            raise ApplicationError(f"replica_id: {request.replica_id} is leased to move "
                                   f"{lease.move_id}", type=ERROR_MOVE_REFUSED,
                                   non_retryable=True)
        running = MoveOutcome(move_id=request.move_id, kind=request.kind, state=MoveState.RUNNING,
                            retired=request.replica_id, started_at=STOP_FIRST_AT)
        self.moves[request.move_id] = running
        step = _step(request.move_id)
        if step in self.gated:
            self.gated_requests[request.move_id] = request  # carried out once the gate opens
            return running
        if step in self.hold:
            if request.stop_first and request.replica_id is not None:
                self.replicas.pop(request.replica_id)  # A stops first, B is still loading
            return running
        self.ends[request.move_id] = self._carry_out(request, running)
        return running

    def open_gate(self) -> None:
        """Carry out the gated moves: each ends as it would have at once."""
        for move_id, request in self.gated_requests.items():
            if move_id not in self.ends:
                self.ends[move_id] = self._carry_out(request, self.moves[move_id])

    def _carry_out(self, request: MoveRequest, running: MoveOutcome) -> MoveOutcome:
        step = _step(request.move_id)
        generation = request.generation or self.generation
        retired = request.replica_id
        if request.kind is MoveKind.RETIRE:
            assert retired is not None
            self.replicas.pop(retired)
            return running.model_copy(update={"state": MoveState.SUCCEEDED,
                                              "ended_at": STOP_FIRST_AT,
                                              "detail": f"{retired} stopped"})
        if request.stop_first and retired is not None:
            self.replicas.pop(retired)
        if step in self.no_room:
            self._refill(request)
            return running.model_copy(update={"state": MoveState.FAILED, "error": NO_ROOM})
        surged = self.new_replica(generation, request.avoid_nodes)
        if step in self.place_on:
            self.replicas[surged].node = self.place_on[step]
        crash = self.crash.get(step)
        if crash is None and generation.model_id in self.crash_models:
            crash = f"{surged} failed to start: {generation.model_id} exited with code 1"
        if crash is not None:
            self.replicas.pop(surged)  # the failed start is stopped and released
            self._refill(request)
            return running.model_copy(update={"state": MoveState.FAILED, "surged": surged,
                                              "error": crash})
        if retired is not None and not request.stop_first:
            self.replicas.pop(retired)
        return running.model_copy(update={
            "state": MoveState.SUCCEEDED, "surged": surged,
            "ended_at": STOP_FIRST_AT + STOP_FIRST_OUTAGE,
            "detail": f"placed on {self.replicas[surged].node}"})

    def _refill(self, request: MoveRequest) -> None:
        if self.refills and request.stop_first:
            self.new_replica(self.generation, [])

    def cancel(self, move_id: MoveId) -> MoveOutcome:
        if move_id not in self.moves:
            raise ApplicationError(f"no move {move_id!r}", type=ERROR_MOVE_REFUSED,
                                   non_retryable=True)
        if _step(move_id) in self.refuse_cancel:
            raise ApplicationError(f"move {move_id!r} cannot be cancelled: the deployment is "
                                   f"being deleted", type=ERROR_MOVE_REFUSED, non_retryable=True)
        if move_id not in self.ends:  # held: retire what it surged (nothing ready yet)
            self.ends[move_id] = self.moves[move_id].model_copy(update={
                "state": MoveState.CANCELLED, "detail": "cancelled before its replica was ready"})
        return self.ends[move_id]


def _step(move_id: str) -> str:
    """A move id's step: ``restart/d1/1:replace-d1-r1`` -> ``replace-d1-r1``."""
    return move_id.split(":", 1)[1]


@dataclass
class FakeFleet:
    """Every faked activity's state, and what they saw."""

    deployments: dict[DeploymentId, FakeDeployment] = field(default_factory=dict)
    conflict: str | None = None
    #: record_operation answers with this conflict (another saga took the subject after
    #: the API judged this one's start failed).
    record_conflict: str | None = None
    begun: list[OperationRecord] = field(default_factory=list)
    records: list[OperationRecord] = field(default_factory=list)
    cordons: list[tuple[NodeId, bool, str | None]] = field(default_factory=list)
    requests: list[MoveRequest] = field(default_factory=list)
    cancels: list[MoveId] = field(default_factory=list)
    #: When each move request arrived (the test server's clock).
    requested_at: dict[MoveId, datetime] = field(default_factory=dict)
    #: Deployments deleted meanwhile: their workflow answers no more.
    deleted: set[DeploymentId] = field(default_factory=set)
    #: Set when a held move has been requested.
    held: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when a drain's record shows it waiting for its deadline.
    waiting: asyncio.Event = field(default_factory=asyncio.Event)

    def activities(self) -> list[Any]:
        @activity.defn(name=ACTIVITY_BEGIN_OPERATION)
        async def begin_operation(record: OperationRecord) -> None:
            if self.conflict is not None:
                raise ApplicationError(self.conflict, type=ERROR_OPERATION_CONFLICT,
                                       non_retryable=True)
            self.begun.append(record)

        @activity.defn(name=ACTIVITY_RECORD_OPERATION)
        async def record_operation(record: OperationRecord) -> None:
            if self.record_conflict is not None:
                raise ApplicationError(self.record_conflict, type=ERROR_OPERATION_CONFLICT,
                                       non_retryable=True)
            self.records.append(record)
            if any(s.name.startswith("wait until") for s in record.steps):
                self.waiting.set()

        @activity.defn(name=ACTIVITY_SET_CORDON)
        async def set_cordon(request: SetCordonInput) -> bool:
            self.cordons.append((request.node_id, request.cordoned, request.reason))
            return request.node_id in (N1, N2)  # False: the store knows no such node

        @activity.defn(name=ACTIVITY_NODE_DEPLOYMENTS)
        async def node_deployments(request: NodeDeploymentsInput) -> list[NodeReplica]:
            return [NodeReplica(deployment_id=d.deployment_id, replica_id=rid)
                    for d in self.deployments.values()
                    for rid, r in d.replicas.items() if r.node == request.node_id]

        @activity.defn(name=ACTIVITY_DESCRIBE_DEPLOYMENT)
        async def describe_deployment(request: DescribeDeploymentInput) -> DeploymentBrief:
            return self.deployments[request.deployment_id].brief()

        @activity.defn(name=ACTIVITY_REQUEST_MOVE)
        async def request_move(call: MoveCall) -> MoveOutcome:
            self.requests.append(call.request)
            self.requested_at[call.request.move_id] = activity.info().current_attempt_scheduled_time
            if call.deployment_id in self.deleted:
                raise ApplicationError(f"deployment {call.deployment_id!r} has no running "
                                       f"workflow", type=ERROR_NO_DEPLOYMENT, non_retryable=True)
            outcome = self.deployments[call.deployment_id].request(call.request)
            deployment = self.deployments[call.deployment_id]
            if _step(call.request.move_id) in deployment.hold | deployment.gated:
                self.held.set()
            return outcome

        @activity.defn(name=ACTIVITY_AWAIT_MOVE)
        async def await_move(call: AwaitMoveCall) -> MoveOutcome:
            deployment = self.deployments[call.deployment_id]
            while call.request.move_id not in deployment.ends:
                activity.heartbeat()
                await asyncio.sleep(0.05)
            return deployment.ends[call.request.move_id]

        @activity.defn(name=ACTIVITY_CANCEL_MOVE)
        async def cancel_move(call: CancelMoveCall) -> MoveOutcome:
            self.cancels.append(call.request.move_id)
            return self.deployments[call.deployment_id].cancel(call.request.move_id)

        @activity.defn(name=ACTIVITY_SET_GENERATION)
        async def set_generation(call: SetGenerationCall) -> None:
            deployment = self.deployments[call.deployment_id]
            deployment.generation = call.request.generation
            deployment.generations_set.append(call.request.generation)

        return [begin_operation, record_operation, set_cordon, node_deployments,
                describe_deployment, request_move, await_move, cancel_move, set_generation]

    @property
    def record(self) -> OperationRecord:
        """The record as the store last had it."""
        return self.records[-1]

    def steps(self) -> list[tuple[str, StepState]]:
        return [(s.name, s.state) for s in self.record.steps]

    def asked(self) -> list[str]:
        """Each move request, as ``kind step`` (``replace replace-d1-r1``)."""
        return [f"{r.kind.value} {_step(r.move_id)}" for r in self.requests]


def _deployment(deployment_id: DeploymentId = D1, *, generation: Generation = A,
                replicas: dict[str, tuple[str, NodeId]] | None = None,
                **script: Any) -> FakeDeployment:
    shape = replicas or {"r1": ("ready", N1), "r2": ("ready", N2)}
    return FakeDeployment(
        deployment_id=deployment_id, generation=generation, desired=len(shape),
        replicas={ReplicaId(f"{deployment_id}-{k}"): FakeReplica(phase, node, generation)
                  for k, (phase, node) in shape.items()}, **script)


@dataclass
class Run:
    env: WorkflowEnvironment
    fleet: FakeFleet
    handle: WorkflowHandle[Any, OperationRecord]

    async def failure(self) -> BaseException:
        """The cause the workflow failed (or was cancelled) with."""
        with pytest.raises(WorkflowFailureError) as caught:
            await self.handle.result()
        return caught.value.cause

    async def record_history(self, name: str) -> None:
        """With MODELKEEPER_RECORD_HISTORIES=1, save this run's history for
        tests/workflows/test_saga_replay.py. Re-record only after an intended change
        versioned with workflow.patched, never to make a replay failure go away."""
        if os.environ.get("MODELKEEPER_RECORD_HISTORIES") != "1":
            return
        history = await self.handle.fetch_history()
        (HISTORIES / f"saga_{name}.json").write_text(history.to_json())


@contextlib.asynccontextmanager
async def _start(env: WorkflowEnvironment, fleet: FakeFleet, *, run: Any, request: Any,
                 workflow_id: str) -> AsyncIterator[Run]:
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE, workflows=SAGAS,
                      activities=fleet.activities()):
        handle = await env.client.start_workflow(run, request, id=workflow_id,
                                                 task_queue=CONTROL_TASK_QUEUE)
        yield Run(env, fleet, handle)


def _restart(env: WorkflowEnvironment, fleet: FakeFleet) -> Any:
    return _start(env, fleet, run=RestartSaga.run,
                  request=RestartInput(deployment_id=D1, requested_by="alice"),
                  workflow_id=operation_workflow_id("restart", D1, 1))


def _switch(env: WorkflowEnvironment, fleet: FakeFleet, **request: Any) -> Any:
    kind = "switch" if "model_id" in request else "reconfigure"
    return _start(env, fleet, run=SwitchSaga.run,
                  request=SwitchInput(deployment_id=D1, **request),
                  workflow_id=operation_workflow_id(kind, D1, 1))


def _drain(env: WorkflowEnvironment, fleet: FakeFleet, node: NodeId = N1,
           **request: Any) -> Any:
    return _start(env, fleet, run=DrainSaga.run,
                  request=DrainInput(node_id=node, grace_s=60, **request),
                  workflow_id=operation_workflow_id("drain", node, 1))


def _operation_failed(cause: BaseException) -> ApplicationError:
    assert isinstance(cause, ApplicationError) and cause.type == ERROR_OPERATION_FAILED
    return cause


DONE, FAILED, UNDONE = StepState.DONE, StepState.FAILED, StepState.UNDONE


# -- restart -------------------------------------------------------------------------------

async def test_restart_replaces_ready_replicas_first_then_sets_the_generation(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(replicas={
        "r1": ("starting", N1), "r2": ("ready", N2)})})
    async with _restart(time_skipping_env, fleet) as run:
        result = await run.handle.result()
        assert await run.handle.query(RestartSaga.operation) == result
        await run.record_history("restart")
    assert fleet.asked() == ["replace replace-d1-r2", "replace replace-d1-r1"]
    assert all(r.generation == A.model_copy(update={"number": 4}) and
               r.reason == "restart/d1/1" for r in fleet.requests)
    assert fleet.deployments[D1].generations_set == [A.model_copy(update={"number": 4})]
    assert fleet.steps() == [("replace d1-r2", DONE), ("replace d1-r1", DONE),
                             ("set generation 4", DONE)]
    assert result == fleet.record
    assert result.state is OperationState.SUCCEEDED and result.error is None
    assert result.kind is OperationKind.RESTART and result.requested_by == "alice"
    assert fleet.begun[0].operation_id == "restart/d1/1"
    assert "2 replica(s) restarted" in result.summary
    assert {r.generation.number for r in fleet.deployments[D1].replicas.values()} == {4}


async def test_restart_in_place_when_there_is_no_room_for_a_second_copy(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(no_room={"replace-d1-r1"})})
    async with _restart(time_skipping_env, fleet) as run:
        result = await run.handle.result()
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r1:stop-first",
                             "replace replace-d1-r2"]
    assert [r.stop_first for r in fleet.requests] == [False, True, False]
    assert fleet.steps() == [
        ("replace d1-r1", FAILED),
        ("replace d1-r1 in place (no room for a second copy)", DONE),
        ("replace d1-r2", DONE), ("set generation 4", DONE)]
    assert result.steps[0].detail.startswith("failed: no room")
    assert "out of service 30 s, from 12:00:00 to 12:00:30" in result.steps[1].detail
    assert "d1-r1 restarted in place, out of service 30 s" in result.summary
    assert result.state is OperationState.SUCCEEDED


async def test_a_failed_replacement_is_cancelled_and_the_restart_fails(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    crash = "d1-r4 failed to start: model-a exited with code 1"
    fleet = FakeFleet(deployments={D1: _deployment(crash={"replace-d1-r2": crash})})
    async with _restart(time_skipping_env, fleet) as run:
        # Compensated as designed: the workflow completes with the failed record.
        result = await run.handle.result()
        await run.record_history("restart_failed_completes")
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r2"]
    assert fleet.cancels == ["restart/d1/1:replace-d1-r2"]
    assert fleet.deployments[D1].generations_set == []
    assert fleet.steps() == [("replace d1-r1", DONE), ("replace d1-r2", UNDONE),
                             ("undo: cancel replace d1-r2", DONE)]
    record = fleet.record
    assert record.state is OperationState.FAILED
    assert record.error == f"replacing d1-r2 failed: {crash}"
    assert result == record
    # The old replica keeps serving; the one restarted stays restarted.
    assert "d1-r2" in fleet.deployments[D1].replicas


async def test_a_restart_whose_undo_fails_fails_its_workflow(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """A compensation that failed leaves something half-done: the workflow fails (the web
    UI shows it red), where a compensated failure completes with its record."""
    crash = "d1-r4 failed to start: model-a exited with code 1"
    fleet = FakeFleet(deployments={D1: _deployment(crash={"replace-d1-r2": crash},
                                                   refuse_cancel={"replace-d1-r2"})})
    async with _restart(time_skipping_env, fleet) as run:
        error = _operation_failed(await run.failure())
    record = fleet.record
    assert record.state is OperationState.FAILED
    assert fleet.steps()[1] == ("replace d1-r2", StepState.UNDO_FAILED)
    assert "could not undo" in (record.error or "") and error.message == record.error


async def test_a_second_saga_on_the_deployment_fails_naming_the_first(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    conflict = "deployment d1 already has a running operation: switch/d1/4"
    fleet = FakeFleet(deployments={D1: _deployment()}, conflict=conflict)
    async with _restart(time_skipping_env, fleet) as run:
        cause = await run.failure()
    assert isinstance(cause, ApplicationError)
    assert cause.type == ERROR_OPERATION_CONFLICT and cause.message == conflict
    assert fleet.requests == [] and fleet.records == []


async def test_a_saga_whose_subject_was_taken_meanwhile_stops_asking(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    conflict = "deployment d1 already has a running operation: restart/d1/2"
    fleet = FakeFleet(deployments={D1: _deployment()}, record_conflict=conflict)
    async with _restart(time_skipping_env, fleet) as run:
        cause = await run.failure()
    assert isinstance(cause, ApplicationError)
    assert cause.type == ERROR_OPERATION_CONFLICT and cause.message == conflict
    assert fleet.deployments[D1].generations_set == []


async def test_cancelling_a_restart_cancels_the_move_in_flight(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(hold={"replace-d1-r2"})})
    async with _restart(time_skipping_env, fleet) as run:
        await asyncio.wait_for(fleet.held.wait(), 20)
        await run.handle.cancel()
        assert isinstance(await run.failure(), CancelledError)
    assert fleet.cancels == ["restart/d1/1:replace-d1-r2"]
    assert fleet.steps() == [("replace d1-r1", DONE), ("replace d1-r2", UNDONE),
                             ("undo: cancel replace d1-r2", DONE)]
    assert fleet.record.state is OperationState.CANCELLED
    assert fleet.deployments[D1].generations_set == []


# -- drain ---------------------------------------------------------------------------------

def _two_deployments(**script: Any) -> FakeFleet:
    """d1-r1 and d2-r1 on n1, d1-r2 on n2."""
    return FakeFleet(deployments={
        D1: _deployment(D1, replicas={"r1": ("ready", N1), "r2": ("ready", N2)}),
        D2: _deployment(D2, replicas={"r1": ("ready", N1)}, **script)})


async def test_drain_cordons_and_moves_every_replica_off_the_node(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = _two_deployments()
    async with _drain(time_skipping_env, fleet) as run:
        result = await run.handle.result()
        await run.record_history("drain")
    assert fleet.cordons == [(N1, True, "draining: drain/n1/1")]  # and it stays cordoned
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d2-r1"]
    assert all(r.avoid_nodes == [N1] for r in fleet.requests)
    assert fleet.steps() == [("cordon n1", DONE), ("replace d1-r1 (d1) off n1", DONE),
                             ("replace d2-r1 (d2) off n1", DONE)]
    assert result.state is OperationState.SUCCEEDED and result.node_id == N1
    assert result.kind is OperationKind.DRAIN and result.deployment_id is None
    assert not any(r.node == N1 for d in fleet.deployments.values()
                   for r in d.replicas.values())


async def test_a_replica_with_no_room_elsewhere_is_retired_at_the_deadline(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = _two_deployments(no_room={"replace-d2-r1", "replace-d2-r1:retry"})
    async with _drain(time_skipping_env, fleet) as run:
        started = await time_skipping_env.get_current_time()
        result = await run.handle.result()
        await run.record_history("drain_no_room_retire")
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d2-r1",
                             "replace replace-d2-r1:retry", "retire retire-d2-r1"]
    # Tried again once the grace period (60 s) had passed, not before.
    assert fleet.requested_at[MoveId("drain/n1/1:replace-d2-r1:retry")] >= started + timedelta(
        seconds=60)
    reason = f"drain of n1: no room elsewhere: {NO_ROOM}"
    assert fleet.requests[-1].reason == reason
    assert fleet.steps() == [
        ("cordon n1", DONE), ("replace d1-r1 (d1) off n1", DONE),
        ("replace d2-r1 (d2) off n1", FAILED),
        (next(s.name for s in result.steps if s.name.startswith("wait until")), DONE),
        ("check what n1 holds now", DONE),
        ("replace d2-r1 (d2) off n1 at the deadline", FAILED),
        ("retire d2-r1 (d2)", DONE)]
    assert result.steps[-1].detail == reason
    assert result.state is OperationState.SUCCEEDED
    assert f"1 stopped with nowhere to go (d2-r1: {reason})" in result.summary
    assert fleet.cordons == [(N1, True, "draining: drain/n1/1")]


async def test_a_replacement_that_fails_is_cancelled_then_retired_at_the_deadline(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    crash = "d2-r2 failed to start: exit 1"
    fleet = _two_deployments(crash={"replace-d2-r1": crash, "replace-d2-r1:retry": crash})
    async with _drain(time_skipping_env, fleet) as run:
        result = await run.handle.result()
    assert fleet.cancels == ["drain/n1/1:replace-d2-r1", "drain/n1/1:replace-d2-r1:retry"]
    assert fleet.requests[-1].kind is MoveKind.RETIRE
    assert fleet.requests[-1].reason == f"drain of n1: its replacement failed: {crash}"
    assert [name for name, _ in fleet.steps()][-3:] == [
        "replace d2-r1 (d2) off n1 at the deadline",
        "undo: cancel replace d2-r1 (d2) off n1 at the deadline", "retire d2-r1 (d2)"]
    assert result.state is OperationState.SUCCEEDED


async def test_a_refused_replica_is_tried_at_the_deadline_then_named_as_left(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    leased = "replica_id: d2-r1 is leased to move switch/d2/1:replace-d2-r1"
    fleet = _two_deployments(refuse={"replace-d2-r1": leased, "replace-d2-r1:retry": leased})
    fleet.deleted.add(D1)  # deleted meanwhile: its replica goes with it
    async with _drain(time_skipping_env, fleet) as run:
        result = await run.handle.result()
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d2-r1",
                             "replace replace-d2-r1:retry"]
    steps = fleet.steps()
    assert steps[1] == ("replace d1-r1 (d1) off n1", DONE)
    assert fleet.record.steps[1].detail.startswith("nothing to move: deployment 'd1'")
    assert steps[2] == ("replace d2-r1 (d2) off n1", FAILED)
    assert steps[-2] == ("replace d2-r1 (d2) off n1 at the deadline", FAILED)
    # Judged by the node before it ends failed: d2-r1 is still there.
    assert steps[-1] == ("check what n1 still holds", DONE)
    assert fleet.record.state is OperationState.FAILED
    assert result.error == fleet.record.error == f"still on n1: d2-r1: {leased}"
    assert "1 deleted with their deployment, 1 still there" in fleet.record.summary


@pytest.mark.parametrize("lands_on_the_node", [False, True], ids=["elsewhere", "on-the-node"])
async def test_a_drain_beside_a_restart_of_the_same_replicas_judges_by_the_node(
    time_skipping_env: WorkflowEnvironment, lands_on_the_node: bool,
) -> None:
    """Issue 24: a drain refused a replica that a restart was replacing (leased to its
    move), tried it again at the deadline, when the restart had replaced it elsewhere and
    the replica id was gone, and ended failed "still there". What counts is whether the
    node still holds the deployment's replicas."""
    # on-the-node: the restart's new copy of d1-r1 lands on n1 (placed before the cordon
    # took hold): the drain finds it there at the deadline and moves it too.
    fleet = FakeFleet(deployments={D1: _deployment(
        replicas={"r1": ("ready", N1), "r2": ("ready", N1)}, gated={"replace-d1-r1"},
        place_on={"replace-d1-r1": N1} if lands_on_the_node else {})})
    env = time_skipping_env
    async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE, workflows=SAGAS,
                      activities=fleet.activities()):
        restart = await env.client.start_workflow(
            RestartSaga.run, RestartInput(deployment_id=D1, requested_by="alice"),
            id=operation_workflow_id("restart", D1, 1), task_queue=CONTROL_TASK_QUEUE)
        await asyncio.wait_for(fleet.held.wait(), 20)  # the restart holds d1-r1
        drain = await env.client.start_workflow(
            DrainSaga.run, DrainInput(node_id=N1, grace_s=60),
            id=operation_workflow_id("drain", N1, 1), task_queue=CONTROL_TASK_QUEUE)
        await asyncio.wait_for(fleet.waiting.wait(), 20)  # its first pass is over
        fleet.deployments[D1].open_gate()
        restarted = await restart.result()
        result = await drain.result()
        if not lands_on_the_node:
            await Run(env, fleet, drain).record_history("drain_beside_restart")
    assert restarted.state is OperationState.SUCCEEDED
    drained = [r for r in fleet.asked() if "replace-d1-r" in r]
    assert "replace replace-d1-r2" in drained
    assert not any(r.node == N1 for r in fleet.deployments[D1].replicas.values())
    assert result.state is OperationState.SUCCEEDED, result.error
    assert result.error is None
    assert "still there" not in result.summary
    if lands_on_the_node:
        newcomer = next(s for s in result.steps if s.name == "check what n1 holds now")
        assert "moved off by another operation: d1-r1" in newcomer.detail
        assert "placed there meanwhile, to be replaced too: d1-r4 (d1)" in newcomer.detail
        assert ("replace d1-r4 (d1) off n1 at the deadline", DONE) in [
            (s.name, s.state) for s in result.steps]
        assert "2 replica(s) moved, 1 moved off by another operation" in result.summary
    else:
        assert "1 replica(s) moved, 1 moved off by another operation" in result.summary


async def test_draining_an_unknown_node_fails_saying_so(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = _two_deployments()
    async with _drain(time_skipping_env, fleet, NodeId("n9")) as run:
        result = await run.handle.result()
    assert result.state is OperationState.FAILED
    assert result.error == "node_id: n9 is not a known node"
    assert fleet.steps() == [("cordon n9", FAILED)] and fleet.requests == []


@pytest.mark.parametrize("uncordon", [True, False], ids=["uncordon", "stay-cordoned"])
async def test_cancelling_a_drain_cancels_replacements_in_flight(
    time_skipping_env: WorkflowEnvironment, uncordon: bool,
) -> None:
    fleet = _two_deployments(hold={"replace-d2-r1"})
    async with _drain(time_skipping_env, fleet, uncordon_on_cancel=uncordon) as run:
        await asyncio.wait_for(fleet.held.wait(), 20)
        await run.handle.cancel()
        assert isinstance(await run.failure(), CancelledError)
        if uncordon:
            await run.record_history("drain_cancelled")
    assert fleet.cancels == ["drain/n1/1:replace-d2-r1"]
    expected = [("cordon n1", UNDONE if uncordon else DONE),
                ("replace d1-r1 (d1) off n1", DONE), ("replace d2-r1 (d2) off n1", UNDONE),
                ("undo: cancel replace d2-r1 (d2) off n1", DONE)]
    cordons: list[tuple[NodeId, bool, str | None]] = [(N1, True, "draining: drain/n1/1")]
    if uncordon:
        expected.append(("undo: uncordon n1", DONE))
        cordons.append((N1, False, None))
    assert fleet.steps() == expected
    assert fleet.cordons == cordons
    assert fleet.record.state is OperationState.CANCELLED
    assert "d2-r1" in fleet.deployments[D2].replicas  # the old replica kept


# -- switch and reconfigure ----------------------------------------------------------------

async def test_switch_moves_every_replica_to_the_new_model_then_commits(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment()})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        result = await run.handle.result()
        await run.record_history("switch")
        # The web UI's current details: what the saga is for, how it stands, each step.
        meta = await run.handle.query("__temporal_workflow_metadata",
                                      result_type=WorkflowMetadata)
        details = str(meta.current_details)
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r2"]
    assert all(r.generation == B for r in fleet.requests)
    assert fleet.deployments[D1].generations_set == [B]
    assert fleet.steps() == [("replace d1-r1 with model-b", DONE),
                             ("replace d1-r2 with model-b", DONE),
                             ("commit: generation 4 (model-b)", DONE)]
    assert result.state is OperationState.SUCCEEDED and result.kind is OperationKind.SWITCH
    assert details.splitlines() == [
        "**Switch** of deployment `d1`: `model-a` (generation 3) → `model-b` (generation 4)",
        "", "State: **succeeded**", "Switch of d1 to model-b done: 2 replica(s) on it", "",
        "- done: replace d1-r1 with model-b: d1-r3 ready; d1-r1 retired; placed on n2",
        "- done: replace d1-r2 with model-b: d1-r4 ready; d1-r2 retired; placed on n2",
        "- done: commit: generation 4 (model-b): the deployment runs generation 4 from now on"]


async def test_reconfigure_keeps_the_model_and_changes_its_arguments(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment()})
    args = {"ctx_size": 8192}
    async with _switch(time_skipping_env, fleet, engine_args=args) as run:
        result = await run.handle.result()
    new = Generation(number=4, model_id=A.model_id, engine_args=args)
    assert all(r.generation == new for r in fleet.requests)
    assert fleet.deployments[D1].generations_set == [new]
    assert result.kind is OperationKind.RECONFIGURE
    assert result.operation_id == "reconfigure/d1/1"
    assert fleet.steps()[-1] == ("commit: generation 4 (model-a (ctx_size=8192))", DONE)


async def test_switch_stops_a_first_when_both_do_not_fit_and_states_the_outage(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(no_room={"replace-d1-r1"})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        result = await run.handle.result()
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r1:stop-first",
                             "replace replace-d1-r2"]
    stop_first = "replace d1-r1 with model-b, stopping it first (no room for both)"
    assert fleet.steps() == [("replace d1-r1 with model-b", FAILED), (stop_first, DONE),
                             ("replace d1-r2 with model-b", DONE),
                             ("commit: generation 4 (model-b)", DONE)]
    assert "out of service 30 s, from 12:00:00 to 12:00:30" in result.steps[1].detail
    assert "stopped first: d1-r1: out of service 30 s" in result.summary


async def test_b_crashing_at_start_is_cancelled_and_a_keeps_serving(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(crash_models={B.model_id})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        # Rolled back as designed: the workflow completes with the record.
        result = await run.handle.result()
        await run.record_history("switch_rolled_back_completes")
    assert fleet.asked() == ["replace replace-d1-r1"]
    assert fleet.cancels == ["switch/d1/1:replace-d1-r1"]
    assert fleet.steps() == [("replace d1-r1 with model-b", UNDONE),
                             ("undo: cancel replace d1-r1 with model-b", DONE)]
    record = fleet.record
    assert record.state is OperationState.ROLLED_BACK
    assert record.error == ("model-b failed: d1-r3 failed to start: model-b exited with "
                            "code 1")
    assert result == record
    assert fleet.deployments[D1].generations_set == []
    assert sorted(fleet.deployments[D1].replicas) == ["d1-r1", "d1-r2"]


async def test_b_crashing_after_a_stopped_first_surges_a_back(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(no_room={"replace-d1-r1"},
                                                   crash_models={B.model_id})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        await run.handle.result()  # rolled back as designed: it completes
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r1:stop-first",
                             "surge undo-surge-d1-r1"]
    assert fleet.requests[-1].generation == A
    stop_first = "replace d1-r1 with model-b, stopping it first (no room for both)"
    assert fleet.steps() == [("replace d1-r1 with model-b", FAILED), (stop_first, UNDONE),
                             (f"undo: cancel {stop_first}", DONE),
                             ("undo: surge model-a for d1-r1", DONE)]
    assert fleet.record.state is OperationState.ROLLED_BACK
    replicas = fleet.deployments[D1].replicas
    assert len(replicas) == 2 and all(r.generation == A for r in replicas.values())


async def test_a_after_a_failed_stop_first_comes_back_from_the_deployment_itself(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    # The real keeper frees the held slot and places a replica of its current generation
    # (A: uncommitted) at once; a surge would be one too many.
    fleet = FakeFleet(deployments={D1: _deployment(no_room={"replace-d1-r1"},
                                                   crash_models={B.model_id}, refills=True)})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        await run.handle.result()  # rolled back as designed: it completes
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r1:stop-first"]
    assert [name for name, _ in fleet.steps()][-1] == "undo: restore d1-r1 on model-a"
    assert fleet.steps()[-1][1] is DONE
    assert "placed one on model-a itself: 2/2 replicas" in fleet.record.steps[-1].detail
    assert fleet.record.state is OperationState.ROLLED_BACK
    replicas = fleet.deployments[D1].replicas
    assert len(replicas) == 2 and all(r.generation == A for r in replicas.values())


async def test_a_second_replica_crashing_undoes_the_first(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    crash = "d1-r4 failed to start: CUDA out of memory"
    fleet = FakeFleet(deployments={D1: _deployment(crash={"replace-d1-r2": crash})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        await run.handle.result()  # rolled back as designed: it completes
    assert fleet.asked() == ["replace replace-d1-r1", "replace replace-d1-r2",
                             "replace undo-replace-d1-r3"]
    undo = fleet.requests[-1]
    assert undo.replica_id == "d1-r3" and undo.generation == A
    assert fleet.steps() == [("replace d1-r1 with model-b", UNDONE),
                             ("replace d1-r2 with model-b", UNDONE),
                             ("undo: cancel replace d1-r2 with model-b", DONE),
                             ("undo: replace d1-r3 with model-a", DONE)]
    assert fleet.record.state is OperationState.ROLLED_BACK
    assert fleet.record.error == f"model-b failed: {crash}"
    replicas = fleet.deployments[D1].replicas
    assert len(replicas) == 2 and all(r.generation == A for r in replicas.values())


async def test_an_undo_that_fails_ends_rollback_incomplete_naming_it(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(
        crash={"replace-d1-r2": "d1-r4 failed to start: exit 1",
               "undo-replace-d1-r3": "d1-r5 failed to start: disk full"},
        refuse_cancel={"replace-d1-r2"})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        error = _operation_failed(await run.failure())
    assert fleet.steps() == [("replace d1-r1 with model-b", StepState.UNDO_FAILED),
                             ("replace d1-r2 with model-b", StepState.UNDO_FAILED),
                             ("undo: cancel replace d1-r2 with model-b", FAILED),
                             ("undo: replace d1-r3 with model-a", FAILED)]
    record = fleet.record
    assert record.state is OperationState.ROLLBACK_INCOMPLETE
    assert record.error == (
        "model-b failed: d1-r4 failed to start: exit 1; could not restore: "
        "switch/d1/1:replace-d1-r2 not cancelled: move 'switch/d1/1:replace-d1-r2' cannot be "
        "cancelled: the deployment is being deleted; "
        "d1-r3 (model-b) not replaced by model-a: d1-r5 failed to start: disk full")
    assert error.message == record.error


async def test_cancelling_a_switch_rolls_it_back(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(hold={"replace-d1-r2"})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        await asyncio.wait_for(fleet.held.wait(), 20)
        await run.handle.cancel()
        assert isinstance(await run.failure(), CancelledError)
        await run.record_history("switch_cancelled")
    assert fleet.cancels == ["switch/d1/1:replace-d1-r2"]
    assert fleet.asked()[-1] == "replace undo-replace-d1-r3"
    assert fleet.steps() == [("replace d1-r1 with model-b", UNDONE),
                             ("replace d1-r2 with model-b", UNDONE),
                             ("undo: cancel replace d1-r2 with model-b", DONE),
                             ("undo: replace d1-r3 with model-a", DONE)]
    assert fleet.record.state is OperationState.CANCELLED
    assert fleet.deployments[D1].generations_set == []
    replicas = fleet.deployments[D1].replicas
    assert len(replicas) == 2 and all(r.generation == A for r in replicas.values())


async def test_cancelling_a_stop_first_switch_in_flight_surges_a_back(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fleet = FakeFleet(deployments={D1: _deployment(no_room={"replace-d1-r1"},
                                                   hold={"replace-d1-r1:stop-first"})})
    async with _switch(time_skipping_env, fleet, model_id=B.model_id) as run:
        await asyncio.wait_for(fleet.held.wait(), 20)
        await run.handle.cancel()
        assert isinstance(await run.failure(), CancelledError)
    assert fleet.cancels == ["switch/d1/1:replace-d1-r1:stop-first"]
    assert fleet.asked()[-1] == "surge undo-surge-d1-r1"
    assert fleet.record.state is OperationState.CANCELLED
    replicas = fleet.deployments[D1].replicas
    assert len(replicas) == 2 and all(r.generation == A for r in replicas.values())


# -- the activities: activities/moves.py against a tiny deployment workflow -----------------

@workflow.defn(name="FakeDeploymentWorkflow", sandboxed=False)
class FakeDeploymentWorkflow:
    """Answers the moves updates like a deployment would, enough to test the activities."""

    def __init__(self) -> None:
        self._polls = 0
        self._done = False
        self._generation = A

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self._done)

    @workflow.signal
    def finish(self) -> None:
        self._done = True

    @workflow.update(name=UPDATE_MOVE)
    def move(self, request: MoveRequest) -> MoveOutcome:
        return MoveOutcome(move_id=request.move_id, kind=request.kind, state=MoveState.RUNNING)

    @move.validator
    def _validate_move(self, request: MoveRequest) -> None:
        if request.replica_id == "d1-r9":
            raise ApplicationError("replica 'd1-r9' is not one of d1's (d1-r1, d1-r2)",
                                   type=ERROR_MOVE_REFUSED)

    @workflow.update(name=UPDATE_AWAIT_MOVE)
    def await_move(self, request: AwaitMoveRequest) -> MoveOutcome:
        # Two polls answer "still running" (as after wait_s), the third the end.
        self._polls += 1
        state = MoveState.SUCCEEDED if self._polls >= 3 else MoveState.RUNNING
        return MoveOutcome(move_id=request.move_id, kind=MoveKind.REPLACE, state=state)

    @workflow.update(name=UPDATE_CANCEL_MOVE)
    def cancel_move(self, request: CancelMoveRequest) -> MoveOutcome:
        return MoveOutcome(move_id=request.move_id, kind=MoveKind.REPLACE,
                           state=MoveState.CANCELLED)

    @workflow.update(name=UPDATE_SET_GENERATION)
    def set_generation(self, request: SetGenerationRequest) -> None:
        self._generation = request.generation

    @workflow.query(name=QUERY_BRIEF)
    def brief(self) -> DeploymentBrief:
        return DeploymentBrief(deployment_id=D1, desired=2, status="serving",
                               generation=self._generation)


@contextlib.asynccontextmanager
async def _fake_deployment(env: WorkflowEnvironment) -> AsyncIterator[WorkflowHandle[Any, Any]]:
    queue = f"deployment-{uuid.uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[FakeDeploymentWorkflow]):
        handle = await env.client.start_workflow(
            FakeDeploymentWorkflow.run, id=deployment_workflow_id(D1), task_queue=queue)
        yield handle


def _replace(replica: str = "d1-r1") -> MoveRequest:
    return MoveRequest(move_id=MoveId("restart/d1/1:replace-" + replica), kind=MoveKind.REPLACE,
                     replica_id=ReplicaId(replica))


async def test_the_activities_ask_the_deployment_workflow(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    moves = MoveActivities(time_skipping_env.client)
    heartbeats: list[Any] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: heartbeats.append(details)
    async with _fake_deployment(time_skipping_env) as handle:
        outcome = await env.run(moves.request_move, MoveCall(deployment_id=D1, request=_replace()))
        assert outcome.state is MoveState.RUNNING and outcome.move_id.endswith("replace-d1-r1")
        ended = await env.run(moves.await_move, AwaitMoveCall(
            deployment_id=D1, request=AwaitMoveRequest(move_id=outcome.move_id, wait_s=1)))
        assert ended.state is MoveState.SUCCEEDED
        # One as each poll begins (and every 2 s while it waits), one between two polls.
        between = [h for h in heartbeats if h != ("polling",)]
        assert between == [("running",), ("running",)]
        assert heartbeats[0] == ("polling",) and len(heartbeats) >= 5
        cancelled = await env.run(moves.cancel_move, CancelMoveCall(
            deployment_id=D1, request=CancelMoveRequest(move_id=outcome.move_id)))
        assert cancelled.state is MoveState.CANCELLED
        await env.run(moves.set_generation, SetGenerationCall(
            deployment_id=D1, request=SetGenerationRequest(move_id=MoveId("x"), generation=B)))
        brief = await env.run(moves.describe_deployment,
                              DescribeDeploymentInput(deployment_id=D1))
        assert brief.generation == B
        await handle.signal(FakeDeploymentWorkflow.finish)


async def test_a_refused_move_is_not_retried_and_keeps_the_workflows_words(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    moves = MoveActivities(time_skipping_env.client)
    async with _fake_deployment(time_skipping_env) as handle:
        with pytest.raises(ApplicationError) as caught:
            await ActivityEnvironment().run(
                moves.request_move, MoveCall(deployment_id=D1, request=_replace("d1-r9")))
        await handle.signal(FakeDeploymentWorkflow.finish)
    assert caught.value.type == ERROR_MOVE_REFUSED and caught.value.non_retryable
    assert caught.value.message == "replica 'd1-r9' is not one of d1's (d1-r1, d1-r2)"


async def test_a_deployment_that_is_not_running_is_not_retried(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    moves = MoveActivities(time_skipping_env.client)
    env = ActivityEnvironment()
    # Never started:
    with pytest.raises(ApplicationError) as caught:
        await env.run(moves.request_move, MoveCall(deployment_id=D1, request=_replace()))
    assert caught.value.type == ERROR_NO_DEPLOYMENT and caught.value.non_retryable
    assert "'d1'" in caught.value.message
    with pytest.raises(ApplicationError) as caught:
        await env.run(moves.describe_deployment, DescribeDeploymentInput(deployment_id=D2))
    assert caught.value.type == ERROR_NO_DEPLOYMENT
    # Ended (deleted):
    async with _fake_deployment(time_skipping_env) as handle:
        await handle.signal(FakeDeploymentWorkflow.finish)
        await handle.result()
        with pytest.raises(ApplicationError) as caught:
            await env.run(moves.request_move, MoveCall(deployment_id=D1, request=_replace()))
    assert caught.value.type == ERROR_NO_DEPLOYMENT and caught.value.non_retryable
