"""How restart.py and switch.py plan their moves, one replace per replica onto a new
generation: which replica to replace next, whether one still lives, and how a generation
and a replace's outage read to an operator.

The step machinery every saga shares (the record, asking for moves, how a cancel lands) is
:mod:`workflows.saga`. Pure: no commands, so nothing here changes a saga's replay.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from modelkeeper.domain.catalog import Generation
    from modelkeeper.domain.ids import ReplicaId
    from modelkeeper.domain.moves import DeploymentBrief, MoveOutcome, ReplicaBrief

#: A replica's phase once its stop is under way (modelkeeper.domain.keeper.Phase.STOPPING;
#: ReplicaBrief carries it as text): such a replica is not restarted, switched or restored.
STOPPING = "stopping"
#: ... and the phase of one that serves: those are replaced first.
READY = "ready"


def next_replica(brief: DeploymentBrief, generation: Generation, *,
                 tried: set[ReplicaId]) -> ReplicaBrief | None:
    """The next replica to move onto ``generation``: one not on it yet, not on its way out,
    not leased to a move in flight (the deployment would refuse it) and not tried already;
    ready ones first, then in the deployment's order.

    Asked of a fresh brief before each replica, so one the keeper placed meanwhile (on the
    deployment's generation, the old one) is moved too."""
    candidates = [r for r in brief.replicas
                  if r.phase != STOPPING and r.replica_id not in tried and r.move_id is None
                  and (r.generation is None or r.generation.number < generation.number)]
    candidates.sort(key=lambda r: r.phase != READY)  # stable: keeps the order otherwise
    return candidates[0] if candidates else None


def lives(brief: DeploymentBrief, replica_id: ReplicaId) -> bool:
    """Whether ``replica_id`` is among ``brief``'s replicas and not on its way out."""
    return any(r.replica_id == replica_id and r.phase != STOPPING for r in brief.replicas)


def outage(outcome: MoveOutcome | None) -> str:
    """A stop-first replace's outage window, from the retire to the new replica's
    readiness (MoveOutcome.started_at to ended_at), as a sentence."""
    if outcome is None or outcome.started_at is None or outcome.ended_at is None:
        return "outage window unknown"
    seconds = (outcome.ended_at - outcome.started_at).total_seconds()
    return (f"out of service {seconds:.0f} s, from {_clock(outcome.started_at)} "
            f"to {_clock(outcome.ended_at)}")


def _clock(at: datetime) -> str:
    return at.strftime("%H:%M:%S")


def generation_label(generation: Generation) -> str:
    """A generation as an operator reads it: the model, and its engine arguments if any."""
    if not generation.engine_args:
        return generation.model_id
    args = ", ".join(f"{k}={v}" for k, v in sorted(generation.engine_args.items()))
    return f"{generation.model_id} ({args})"
