"""The keeper: what a deployment should do next, as a pure function of its state, one
observation and the time.

``decide(state, observation, now, config, jitter) -> (state, actions)`` is the whole of a
deployment's behaviour. The workflow (``workflows/deployment.py``) only feeds it
observations (activity results, signals, timer ticks) and carries out the actions it
returns. Nothing here imports temporalio, httpx or asyncpg, and time is an argument, so the
tests step it through hours of failures in milliseconds.

The rules, each guarded by a test:

* One placement at a time per deployment: a new replica is only placed when no other
  placement of this deployment is in flight, so each one sees the previous one's claims.
* A replica lost before it was ready is a failed start: the next placement waits
  ``backoff_initial_s``, doubling to ``backoff_max_s``, with jitter. A replica lost after
  it was ready is replaced at once and the backoff resets.
* Relaunch in place (modelkeeper.domain.relaunch, patch ``relaunch-in-place``): the
  engine of a ready replica on one node that exits is first started again where it ran,
  in its claim (RelaunchReplica: the replica back in starting, out of routing), at most
  ``relaunch_tries`` times in ``relaunch_window_s``; an OOM kill, a replica over several
  nodes, or one more exit in the window is lost after ready, as above. A relaunch that
  does not become ready is lost after ready too, not a failed start.
* ``park_after`` failed starts in a row park the deployment until its spec changes or
  a retry is asked for.
* Nothing fits: the reason is kept (status cant_place) and placement is retried at once
  when the nodes change. Each placement in a row that finds no room is counted; a node
  change retries at once but keeps the count (it says nothing about whether room is
  likely); a placement that finds room, or an operator's retry, resets it.
* The backed-off retry lives outside the workflow's history: while the
  deployment waits for room (:func:`waiting_for_room`) a room watch runs, an activity
  that dry-runs placement on the same schedule (:func:`room_watch_wait_s`, 30 s doubling
  up to ``room_watch_max_s``, 10 min) and returns when the replica would fit, which the
  workflow observes as ``NodesChanged``. A new watch starts only once no placement is in
  flight (:func:`room_watch_start`), from the count of placements in a row that found no
  room, so a dry run that says "fits" where the placement then says no backs off too.
  The blind retry on the workflow's timer is only a backstop for a lost watch, every
  ``cant_place_backstop_s`` (1 h).
* Two-stage expiry: a replica whose watch goes silent is *unreachable* (routed around),
  and only *lost* after ``lost_after_s`` without its agent vouching for it. A blip must
  not tear down a replica that is still serving.
* Surge on unreachable: an unreachable replica does not count
  toward the desired number, so a replacement is placed beside it at once; there are never
  more than desired + unreachable replicas. Of the two, one is kept:

  - the replacement becomes ready: the unreachable original is stopped ("replaced while
    unreachable"), whether or not its agent ever vouches for it again; its node just
    proved flaky, and it serves nobody meanwhile;
  - the original's agent vouches for it before that: the original is kept (it serves
    now) and the replacement, not yet ready, is stopped ("not needed: <id> is back").

  The replacement avoids the unreachable replica's nodes: a node that is only slow (its
  agent restarting) gets its original vouched for, not replaced beside it.
  A replacement that finds no room (or whose placement crashes) is not a failure: no
  failed start, no park, no cant_place. It is retried on a node change or after
  ``cant_place_retry_s``; meanwhile the original is lost after ``lost_after_s`` and then
  replaced as an ordinary lost replica, at once.
* Status (``status()``), first match wins: deleting, parked, stopped (0 replicas
  wanted), serving (every desired replica ready), degraded (a replica unreachable;
  ``last_failure`` says which and why), starting, cant_place, placing.
* Moves (modelkeeper.domain.moves): a saga asks, the keeper acts; ``refuse_move`` is the
  update's validator (a replica not ours or not live, one leased to another move, more
  than ``max_surge`` surging at once, a deleting deployment).

  - surge: a new replica, leased to the move (``Replica.move_id``), so it does not count
    toward the desired number and is not scaled straight back down. The move succeeds when
    it is ready; the lease ends with a retire that ``balances`` it, or its cancel.
  - replace: surge; once the new replica is ready it is handed over (counts) and the old
    one is retired, drained first; the move succeeds when the old one has stopped. With
    ``stop_first`` the old one is retired first and its slot is held (``_reserved``) so
    the keeper does not fill it with the old generation; the new one is placed once the
    old has stopped, and handed over when ready.
  - retire: the replica is retired (drained first); the move succeeds once it has stopped.
  - A move's placement waits for no backoff (an operator asked) but for any other
    placement of the deployment in flight. Its failure (no room, a crash, a failed start)
    fails the move, not the deployment: no failed-start count, no park, no cant_place.
    When a stop-first replace fails, its held slot is freed and the keeper places a
    replica of the deployment's current generation at once: the old model comes back.
  - cancel: retires what the move surged and keeps what it would have retired; too late
    once the old replica's retire has begun.
  - A replica runs a ``Generation`` (model and engine arguments); ``set_generation``
    changes what new replicas run, and older ones show as outdated until replaced.
* Graceful stop: a ready replica retired by scale-down, a move or a
  delete is drained (out of routing, in-flight requests finished) before it stops; a
  lost or unreachable one is not (nothing reaches it).
* The keeper only ever touches replicas it placed (they are the only ones in its state).
* What the deployment shows outside the store (``overview()``: search attributes;
  ``details()``: the web UI's current details) is computed here too, from the state.
* Deleting stops every replica, including one whose placement is still on its way.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Literal, assert_never

from pydantic import Field

from .base import Frozen, Tolerant
from .capacity import CapacityClass
from .catalog import Generation
from .demand import (
    Add,
    DemandView,
    ReplicaStanding,
    Retire,
    ScalingPolicy,
    Sleep,
    Standing,
    Step,
    Wake,
    WindowBounds,
)
from .ids import DeploymentId, ModelId, MoveId, NodeId, ReplicaId
from .moves import (
    MOVE_ENDED,
    DeploymentBrief,
    MoveKind,
    MoveOutcome,
    MoveRequest,
    MoveState,
    ReplicaBrief,
)
from .relaunch import Relaunch, Replace, relaunch_verdict
from .shards import ExitKind
from .status import DeploymentStatus, ReplicaState
from .topology import Spread
from .tunables import Tunables

# -- state -------------------------------------------------------------------------------
#
# The state's models are Tolerant (unknown keys ignored): continue-as-new carries them, and
# a worker rolled back past a new field must still decode the state a newer one wrote, or
# the workflow task fails for ever. A new field needs a default that means the old
# behaviour. Observations and actions never leave one run: they stay strict (Frozen).


class Phase(StrEnum):
    """A replica's phase inside the keeper (finer than the stored ReplicaState)."""

    PLACING = "placing"  # place_replica in flight; no claim may exist yet
    STARTING = "starting"  # claims made, shards starting
    READY = "ready"
    UNREACHABLE = "unreachable"  # watch went silent; waiting for its agent to vouch
    STOPPING = "stopping"  # stop in flight; claims released when it completes
    SLEEPING = "sleeping"  # out of routing, asleep (or falling asleep): weights kept
    WAKING = "waking"  # a wake in flight: claims grown back, the engine waking


#: Phases whose replica counts toward the desired number.
LIVE_PHASES = frozenset({Phase.PLACING, Phase.STARTING, Phase.READY, Phase.UNREACHABLE,
                         Phase.SLEEPING, Phase.WAKING})


class Replica(Tolerant):
    """One replica the keeper placed."""

    replica_id: ReplicaId
    phase: Phase
    nodes: list[NodeId] = Field(default_factory=list)  # rank order
    endpoint: str | None = None
    ready_at: datetime | None = None
    unreachable_since: datetime | None = None
    probe_in_flight: bool = False
    next_probe_at: datetime | None = None
    #: Why it is stopping; for a retiring placement, why it will be stopped when it lands.
    stop_reason: str | None = None
    #: Scaled away while its placement was in flight: stopped as soon as it lands.
    retiring: bool = False
    #: What it runs; None: the spec's model as the catalog has it (before generations).
    generation: Generation | None = None
    #: Its placement goes on none of these (a move's avoid_nodes: a node being drained).
    avoid_nodes: list[NodeId] = Field(default_factory=list)
    #: Placed by this move and leased to it: it does not count toward the desired number
    #: (it is the move's surge) until the move hands it over (see "Moves" in the docstring).
    move_id: MoveId | None = None
    #: Why its placement had to share a node with another replica of the deployment.
    placement_note: str | None = None
    #: A warm standby: placed to be kept asleep beside the serving replicas, so that a
    #: lost one is answered by a wake (see "Demand" in the module docstring).
    standby: bool = False
    #: Sleeping: since when; ``asleep`` once the engine said it sleeps (a wake asked
    #: before then waits for it: ``wake_wanted``).
    asleep_since: datetime | None = None
    asleep: bool = False
    wake_wanted: bool = False
    #: Its engine can sleep (vLLM, SGLang, sim; not llama.cpp), from its placement.
    can_sleep: bool = False
    #: Relaunch in place (modelkeeper.domain.relaunch): when its engine was relaunched,
    #: those still in the window; whether a relaunch is starting now; and what the last
    #: one said ("engine exited (...); relaunched in place on n1, try 1 of 3 in 600 s"),
    #: written with its state to the store.
    relaunched_at: list[datetime] = Field(default_factory=list)
    relaunching: bool = False
    relaunch_note: str | None = None


class DeploymentSpec(Tolerant):
    """What the operator asked for."""

    deployment_id: DeploymentId
    model_id: ModelId
    replicas: int = Field(ge=0)
    min_nodes: int = Field(default=1, ge=1)
    node_ids: list[NodeId] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    #: What new replicas run (set_generation); None: model_id as the catalog has it.
    #: model_id stays the served name whatever the generation runs.
    generation: Generation | None = None
    #: How the replica count follows demand (modelkeeper.domain.demand); None: fixed at
    #: ``replicas`` (min = max), never started on demand. ``replicas`` is always the
    #: number wanted now, within the policy's bounds.
    scaling: ScalingPolicy | None = None
    #: What may be stopped to place it (modelkeeper.domain.capacity); None: it follows
    #: the scaling policy.
    capacity_class: CapacityClass | None = None
    #: Its owner in the tenancy tree; None: nobody's.
    owner: str | None = None
    #: Spread its replicas' shards over a topology key (modelkeeper.domain.topology);
    #: None: no spread.
    spread: Spread | None = None


#: The defaults of every tunable (modelkeeper.domain.tunables, where their reasons are).
_DEFAULTS = Tunables()


class KeeperConfig(Tolerant):
    """What ``decide`` needs of the tunables, under the keeper's own names (:meth:`of`).

    Its defaults are the tunables' (one home). Continue-as-new carries it, so a run keeps
    what it started with.
    """

    lost_after_s: float = _DEFAULTS.replica_lost_after_s
    probe_interval_s: float = _DEFAULTS.probe_interval_s
    backoff_initial_s: float = _DEFAULTS.start_backoff_initial_s
    backoff_max_s: float = _DEFAULTS.start_backoff_max_s
    backoff_jitter: float = _DEFAULTS.backoff_jitter
    park_after: int = _DEFAULTS.park_after_failures
    #: The room watch's first wait, and a failed surge placement's retry.
    cant_place_retry_s: float = _DEFAULTS.cant_place_retry_s
    room_watch_max_s: float = _DEFAULTS.room_watch_max_s
    cant_place_backstop_s: float = _DEFAULTS.cant_place_backstop_s
    max_surge: int = Field(default=_DEFAULTS.max_surge, ge=1)
    preempt_grace_s: float = _DEFAULTS.preempt_grace_s
    #: Patch ``capacity-preemption`` (0.3): a placement that finds no room seeks room
    #: from what it outranks (SeekRoom), not only one asked for on demand. False replays
    #: 0.2's histories; the workflow sets it from ``workflow.patched`` at each run's start.
    preemption: bool = False
    #: Relaunch in place (modelkeeper.domain.relaunch): at most this many in this window;
    #: 0 tries turns it off.
    relaunch_tries: int = Field(default=_DEFAULTS.relaunch_tries, ge=0)
    relaunch_window_s: float = Field(default=_DEFAULTS.relaunch_window_s, gt=0)
    #: Patch ``relaunch-in-place``: an engine that exits after ready is relaunched in
    #: place first. False replays the histories recorded before it (an exit after ready
    #: is replaced at once); the workflow sets it from ``workflow.patched`` at each run's
    #: start, as ``preemption``.
    relaunch: bool = False

    @classmethod
    def of(cls, tunables: Tunables) -> KeeperConfig:
        """The keeper's config from a deployment's tunables."""
        return cls(lost_after_s=tunables.replica_lost_after_s,
                   probe_interval_s=tunables.probe_interval_s,
                   backoff_initial_s=tunables.start_backoff_initial_s,
                   backoff_max_s=tunables.start_backoff_max_s,
                   backoff_jitter=tunables.backoff_jitter,
                   park_after=tunables.park_after_failures,
                   cant_place_retry_s=tunables.cant_place_retry_s,
                   room_watch_max_s=tunables.room_watch_max_s,
                   cant_place_backstop_s=tunables.cant_place_backstop_s,
                   max_surge=tunables.max_surge,
                   preempt_grace_s=tunables.preempt_grace_s,
                   relaunch_tries=tunables.relaunch_tries,
                   relaunch_window_s=tunables.relaunch_window_s)


class Move(Tolerant):
    """A move a saga asked for, in the registry continue-as-new carries."""

    move_id: MoveId
    kind: MoveKind
    state: MoveState = MoveState.RUNNING
    replica_id: ReplicaId | None = None  # the one to retire
    surged: ReplicaId | None = None  # the one it placed
    avoid_nodes: list[NodeId] = Field(default_factory=list)
    generation: Generation | None = None
    stop_first: bool = False
    balances: MoveId | None = None
    reason: str = ""
    #: The retire of replica_id has been asked (a stop, or retiring while it places).
    retire_issued: bool = False
    started_at: datetime | None = None
    ended_at: datetime | None = None
    error: str | None = None
    detail: str = ""
    #: Its replica found no room and room was sought for it (a restart may borrow a lower
    #: class's room): once per move. Until ``room_wait_until`` (or a node change, the
    #: victims' release) the move waits instead of placing again.
    sought_room: bool = False
    room_wait_until: datetime | None = None


#: Ended moves kept in the registry (a retried update finds its answer); older ones go, so
#: the state continue-as-new carries stays small. A saga's retry comes within minutes.
MOVES_KEPT = 50


class KeeperState(Tolerant):
    """The whole state of one deployment's keeper; continue-as-new carries it as is."""

    spec: DeploymentSpec
    replicas: list[Replica] = Field(default_factory=list)
    next_replica_seq: int = 1
    consecutive_failures: int = 0
    last_failure: str | None = None
    #: Failed-start backoff: no placement before this. Node changes do not shorten it.
    next_attempt_at: datetime | None = None
    #: After cant_place or a crashed placement: retry at this time, or sooner when the
    #: nodes change.
    placement_retry_at: datetime | None = None
    placement_error: str | None = None
    #: Placements in a row that found no room: a room watch's schedule starts from it. A
    #: node change keeps it; room found resets it.
    unplaceable_in_a_row: int = 0
    #: After a surge (a replacement for an unreachable replica) found no room or crashed:
    #: no surge before this, or sooner when the nodes change. Ordinary placements ignore it.
    surge_retry_at: datetime | None = None
    parked: bool = False
    deleting: bool = False
    finished: bool = False
    #: The moves registry, oldest first.
    moves: list[Move] = Field(default_factory=list)
    #: Demand (modelkeeper.domain.demand). The schedule window open now, whose bounds
    #: replace the policy's; None: the policy's own.
    window: WindowBounds | None = None
    #: Loading on demand: since when and why (a request asked); None once a replica
    #: serves, or nothing is wanted.
    loading_since: datetime | None = None
    loading_reason: str | None = None
    #: When the replica count last changed (a step, a scale, a policy), and the last
    #: demand step's reason (shown in ``ls`` and the web UI).
    last_change_at: datetime | None = None
    demand_note: str | None = None
    #: An eviction is being sought for this deployment's placement (find_eviction in
    #: flight): one at a time.
    seeking_room: bool = False
    #: The replica another deployment was asked to give up for this one, until this
    #: deployment places (its room is on its way: the status stays loading).
    evicting: ReplicaId | None = None
    #: Seek an eviction again then: a candidate's protection window ends, or an eviction
    #: asked has not made the room by then (its deployment refused it: used meanwhile).
    seek_again_at: datetime | None = None
    #: Preempted ("preempted by d-1 (critical) for ..."): shown as the reason while the
    #: replica it lost waits for room; cleared when one is placed again.
    preempted: str | None = None


# -- observations ------------------------------------------------------------------------


class Tick(Frozen):
    """Time passed (a timer fired, or the workflow (re)started)."""

    kind: Literal["tick"] = "tick"


class Placed(Frozen):
    """place_replica claimed room for the replica on these nodes."""

    kind: Literal["placed"] = "placed"
    replica_id: ReplicaId
    nodes: list[NodeId]
    #: It shares a node with another replica of the deployment, and why.
    note: str | None = None
    #: Its engine can sleep (modelkeeper.domain.shards.can_sleep).
    can_sleep: bool = False


class Unplaceable(Frozen):
    """place_replica found no room; ``reason`` names every node and its numbers."""

    kind: Literal["cant_place"] = "cant_place"
    replica_id: ReplicaId
    reason: str


class PlacementCrashed(Frozen):
    """place_replica failed unexpectedly; recorded, retried later, others unaffected."""

    kind: Literal["placement_crashed"] = "placement_crashed"
    replica_id: ReplicaId
    error: str


class Started(Frozen):
    """Every shard is ready; rank 0 serves at ``endpoint``."""

    kind: Literal["started"] = "started"
    replica_id: ReplicaId
    endpoint: str


class StartFailed(Frozen):
    """A shard failed to start (or missed its start timeout)."""

    kind: Literal["start_failed"] = "start_failed"
    replica_id: ReplicaId
    error: str


class Exited(Frozen):
    """A watched engine ended."""

    kind: Literal["exited"] = "exited"
    replica_id: ReplicaId
    detail: str
    #: How it ended, as its agent classified it; None: not known.
    exit_kind: ExitKind | None = None


class Silent(Frozen):
    """A watch missed its heartbeats: the node or its agent went quiet."""

    kind: Literal["silent"] = "silent"
    replica_id: ReplicaId


class ProbeResult(Frozen):
    """The agents of an unreachable replica answered (or not) whether it still runs."""

    kind: Literal["probe"] = "probe"
    replica_id: ReplicaId
    #: True: every shard runs; False: an agent answered and a shard is gone;
    #: None: some agent did not answer.
    running: bool | None


class Stopped(Frozen):
    """A replica's shards are stopped and its claims released."""

    kind: Literal["stopped"] = "stopped"
    replica_id: ReplicaId


class NodesChanged(Frozen):
    """A node joined, reported memory, freed memory or was uncordoned."""

    kind: Literal["nodes_changed"] = "nodes_changed"


class Scale(Frozen):
    """The operator changed the replica count."""

    kind: Literal["scale"] = "scale"
    replicas: int = Field(ge=0)


class Retry(Frozen):
    """The operator asked to un-park (POST /deployments/{id}/retry)."""

    kind: Literal["retry"] = "retry"


class Delete(Frozen):
    """The operator deleted the deployment."""

    kind: Literal["delete"] = "delete"


class MoveAsked(Frozen):
    """A saga asked for a move (the ``move`` update, its validator passed)."""

    kind: Literal["move_asked"] = "move_asked"
    request: MoveRequest


class MoveCancelled(Frozen):
    """A saga compensates a move (``cancel_move``)."""

    kind: Literal["move_cancelled"] = "move_cancelled"
    move_id: MoveId


class GenerationSet(Frozen):
    """New replicas run this from now on (``set_generation``)."""

    kind: Literal["generation_set"] = "generation_set"
    move_id: MoveId
    generation: Generation


class DemandStepDue(Frozen):
    """The usage watch found a step due (modelkeeper.domain.demand.step) on ``view``; the
    keeper takes it only if its own view is still ``view``."""

    kind: Literal["demand_step"] = "demand_step"
    view: DemandView
    step: Step


class PolicySet(Frozen):
    """The operator set a new scaling policy."""

    kind: Literal["policy_set"] = "policy_set"
    policy: ScalingPolicy
    actor: str = ""


class TenancySet(Frozen):
    """The operator moved the deployment to another owner and/or class."""

    kind: Literal["tenancy_set"] = "tenancy_set"
    owner: str | None = None
    capacity_class: CapacityClass | None = None


class WindowSet(Frozen):
    """A schedule window opened (``window``) or closed (``closing``)."""

    kind: Literal["window_set"] = "window_set"
    window: WindowBounds | None = None
    closing: str | None = None


class SleepAsked(Frozen):
    """The operator asked a ready replica (None: each above the minimum) to sleep."""

    kind: Literal["sleep_asked"] = "sleep_asked"
    replica_id: ReplicaId | None = None
    actor: str = ""


class WakeAsked(Frozen):
    """The operator asked a sleeping replica (None: each) to wake."""

    kind: Literal["wake_asked"] = "wake_asked"
    replica_id: ReplicaId | None = None
    actor: str = ""


class EvictAsked(Frozen):
    """Another deployment asked for this replica's room (the ``evict`` update)."""

    kind: Literal["evict_asked"] = "evict_asked"
    replica_id: ReplicaId
    for_deployment: DeploymentId
    reason: str


class PreemptAsked(Frozen):
    """Something that outranks this replica needs its room (the ``preempt`` signal): a
    higher class's placement, a scope taking back its guarantee, or the memory watchdog.
    The replica is drained with a short grace and the count kept."""

    kind: Literal["preempt_asked"] = "preempt_asked"
    replica_id: ReplicaId
    by: DeploymentId | None = None
    reason: str


class Slept(Frozen):
    """The replica's engines sleep and its claims keep only what sleep keeps."""

    kind: Literal["slept"] = "slept"
    replica_id: ReplicaId


class SleepFailed(Frozen):
    """A sleep failed (an engine refused, or an agent did not answer)."""

    kind: Literal["sleep_failed"] = "sleep_failed"
    replica_id: ReplicaId
    error: str


class Woke(Frozen):
    """The replica's engines are awake and its claims whole again."""

    kind: Literal["woke"] = "woke"
    replica_id: ReplicaId


class WakeFailed(Frozen):
    """A wake failed: no room to take its memory back, or an engine failed to wake."""

    kind: Literal["wake_failed"] = "wake_failed"
    replica_id: ReplicaId
    error: str
    #: No room on its node (not the engine's fault): the replica is stopped, not lost.
    no_room: bool = False


class EvictionSought(Frozen):
    """find_eviction answered: a victim was asked to make room (``victim``), or none
    could (``reason``; ``retry_at``: when a candidate's protection window ends)."""

    kind: Literal["eviction_sought"] = "eviction_sought"
    victim: ReplicaId | None = None
    reason: str = ""
    retry_at: datetime | None = None
    #: Replicas of lower classes asked to make room together (the ``preempt`` signal);
    #: their room is held for this deployment until it places.
    preempting: list[ReplicaId] = Field(default_factory=list)


#: An eviction asked that has not made the room this long after is sought again: the
#: victim's deployment refused it (the replica was used meanwhile), or its drain is slow.
#: A drain's grace is 30 s by default; twice that leaves room for the stop and release.
EVICTION_RECHECK_S = 60.0


Observation = Annotated[
    Tick | Placed | Unplaceable | PlacementCrashed | Started | StartFailed | Exited | Silent
    | ProbeResult | Stopped | NodesChanged | Scale | Retry | Delete | MoveAsked | MoveCancelled
    | GenerationSet | DemandStepDue | PolicySet | WindowSet | SleepAsked | WakeAsked
    | EvictAsked | Slept | SleepFailed | Woke | WakeFailed | EvictionSought | PreemptAsked
    | TenancySet,
    Field(discriminator="kind"),
]

# -- actions -----------------------------------------------------------------------------


class PlaceReplica(Frozen):
    """Claim room for a new replica (one transaction)."""

    kind: Literal["place"] = "place"
    replica_id: ReplicaId


class StartReplica(Frozen):
    """Start every shard of a placed replica."""

    kind: Literal["start"] = "start"
    replica_id: ReplicaId


class WatchReplica(Frozen):
    """Watch every shard of a ready replica."""

    kind: Literal["watch"] = "watch"
    replica_id: ReplicaId


class RelaunchReplica(Frozen):
    """Start a ready replica's exited engine again where it ran, in its claim
    (modelkeeper.domain.relaunch), and say so in the audit log."""

    kind: Literal["relaunch"] = "relaunch"
    replica_id: ReplicaId
    #: "engine exited (signalled: killed by SIGKILL); relaunched in place on n1, try 1
    #: of 3 in 600 s"
    reason: str
    attempt: int
    tries: int
    window_s: float


class ProbeReplica(Frozen):
    """Ask an unreachable replica's agents whether it still runs."""

    kind: Literal["probe"] = "probe"
    replica_id: ReplicaId


class StopReplica(Frozen):
    """Stop a replica's shards (cancelling its start or watch) and release its claims."""

    kind: Literal["stop"] = "stop"
    replica_id: ReplicaId
    reason: str
    #: It serves: leave routing and let its in-flight requests finish first (graceful).
    drain: bool = False
    #: How long the drain waits for them; None: the tunables' ``drain_grace_s``.
    grace_s: float | None = Field(default=None, ge=0)


class Finish(Frozen):
    """Deleted and nothing left running: remove the deployment and end."""

    kind: Literal["finish"] = "finish"


class SleepReplica(Frozen):
    """Out of routing (drained), the engines asleep, the claims shrunk to what they keep."""

    kind: Literal["sleep"] = "sleep"
    replica_id: ReplicaId
    reason: str


class WakeReplica(Frozen):
    """Claims grown back (if the room is still free), then the engines woken."""

    kind: Literal["wake"] = "wake"
    replica_id: ReplicaId
    reason: str


class SeekRoom(Frozen):
    """Asked for and fits nowhere: find an idle replica of another on-demand deployment
    whose room would let this one place (modelkeeper.domain.eviction), and ask for it."""

    kind: Literal["seek_room"] = "seek_room"


Action = (PlaceReplica | StartReplica | WatchReplica | ProbeReplica | StopReplica | Finish
          | SleepReplica | WakeReplica | SeekRoom | RelaunchReplica)

# -- the decision ------------------------------------------------------------------------


def backoff_s(failures: int, config: KeeperConfig, jitter: float) -> float:
    """Wait after ``failures`` failed starts in a row: 10, 20, 40, 60, 60... with jitter.

    ``jitter`` is a random number in [0, 1) supplied by the caller (the workflow's
    deterministic random), keeping this function pure.
    """
    base = min(config.backoff_initial_s * 2.0 ** max(failures - 1, 0), config.backoff_max_s)
    return base * (1 - config.backoff_jitter / 2 + config.backoff_jitter * jitter)


#: Doublings past which the can't-place wait is at its cap whatever the settings (keeps
#: 2.0 ** n finite: a deployment may stay unplaceable for months).
_MAX_DOUBLINGS = 32


def _doubled(first_s: float, doublings: int, cap_s: float) -> float:
    """``first_s`` doubled ``doublings`` times, at most ``cap_s`` (and never under
    ``first_s``, should the cap be set below it)."""
    return max(min(first_s * 2.0 ** min(max(doublings, 0), _MAX_DOUBLINGS), cap_s), first_s)


def cant_place_wait_s(config: KeeperConfig) -> float:
    """Wait before the blind retry after a placement found no room: the backstop,
    ``cant_place_backstop_s`` (the room watch does the backing off). No jitter:
    deployments that cannot be placed started waiting at different times, and a node
    change retries them all at once anyway.
    """
    return max(config.cant_place_backstop_s, config.cant_place_retry_s)


def room_watch_wait_s(unplaceable: int, check: int, *, first_s: float, max_s: float) -> float:
    """The room watch's wait before its dry run number ``check`` (0 first), for a watch
    started after ``unplaceable`` placements in a row found no room: the can't-place
    backoff carried on, each dry run that finds no room counting as one more placement.
    30 s after the first answer, doubling to ``max_s``: after 3 in a row 120, 240, 480,
    600, 600 ... s (with the defaults). Never shorter than ``first_s``, so a watch that
    is restarted at once (its dry run said "fits", the placement said no) cannot spin.
    """
    return _doubled(first_s, unplaceable - 1 + check, max_s)


def _replace(state: KeeperState, replica: Replica) -> KeeperState:
    return state.model_copy(update={"replicas": [
        replica if r.replica_id == replica.replica_id else r for r in state.replicas]})


def _drop(state: KeeperState, replica_id: ReplicaId) -> KeeperState:
    return state.model_copy(update={"replicas": [
        r for r in state.replicas if r.replica_id != replica_id]})


def _find(state: KeeperState, replica_id: ReplicaId) -> Replica | None:
    return next((r for r in state.replicas if r.replica_id == replica_id), None)


def _stop(state: KeeperState, replica: Replica, reason: str,
          actions: list[Action], *, drain: bool = False,
          grace_s: float | None = None) -> KeeperState:
    actions.append(StopReplica(replica_id=replica.replica_id, reason=reason, drain=drain,
                               grace_s=grace_s if drain else None))
    return _replace(state, replica.model_copy(update={
        "phase": Phase.STOPPING, "stop_reason": reason, "probe_in_flight": False,
        "retiring": False}))


def _retire_one(state: KeeperState, replica: Replica, reason: str,
                actions: list[Action]) -> KeeperState:
    """Retire a replica we no longer want: one still placing is stopped when it lands
    (see _on_placed); one that serves is drained first."""
    if replica.phase is Phase.PLACING:
        return _replace(state, replica.model_copy(update={"retiring": True,
                                                          "stop_reason": reason}))
    if replica.phase is Phase.STOPPING:
        return state
    return _stop(state, replica, reason, actions,
                 drain=replica.phase is Phase.READY)


def _lost_after_ready(state: KeeperState, replica: Replica, why: str,
                      actions: list[Action]) -> KeeperState:
    """A replica that had served is gone: replace it at once, and reset the backoff."""
    state = _stop(state, replica, f"lost: {why}", actions)
    return state.model_copy(update={"consecutive_failures": 0, "next_attempt_at": None,
                                    "last_failure": why})


def _observe(state: KeeperState, obs: Observation, *, now: datetime, config: KeeperConfig,
             jitter: float, actions: list[Action]) -> KeeperState:
    """Apply one observation: one handler per type, each with its own rule."""
    match obs:
        case Tick():
            return _on_tick(state)
        case NodesChanged():
            return _on_nodes_changed(state)
        case Scale():
            return _on_scale(state, obs, now=now)
        case Retry():
            return _on_retry(state)
        case Delete():
            return _on_delete(state)
        case Placed():
            return _on_placed(state, obs, actions=actions)
        case Unplaceable():
            return _on_unplaceable(state, obs, now=now, config=config, actions=actions)
        case PlacementCrashed():
            return _on_placement_crashed(state, obs, now=now, config=config)
        case Started():
            return _on_started(state, obs, now=now, actions=actions)
        case StartFailed():
            return _on_start_failed(state, obs, now=now, config=config, jitter=jitter,
                                    actions=actions)
        case Exited():
            return _on_exited(state, obs, now=now, config=config, actions=actions)
        case Silent():
            return _on_silent(state, obs, now=now, config=config, actions=actions)
        case ProbeResult():
            return _on_probe_result(state, obs, now=now, config=config, actions=actions)
        case Stopped():
            return _on_stopped(state, obs)
        case MoveAsked():
            return _on_move_asked(state, obs, now=now, config=config)
        case MoveCancelled():
            return _on_move_cancelled(state, obs, now=now, config=config, actions=actions)
        case GenerationSet():
            return _on_generation_set(state, obs)
        case DemandStepDue():
            return _on_demand_step(state, obs, now=now, actions=actions)
        case PolicySet():
            return _on_policy_set(state, obs, now=now)
        case WindowSet():
            return _on_window_set(state, obs, now=now)
        case SleepAsked():
            return _on_sleep_asked(state, obs, now=now, actions=actions)
        case WakeAsked():
            return _on_wake_asked(state, obs, actions=actions)
        case EvictAsked():
            return _on_evict_asked(state, obs, now=now, actions=actions)
        case Slept():
            return _on_slept(state, obs, actions=actions)
        case SleepFailed():
            return _on_sleep_failed(state, obs, actions=actions)
        case Woke():
            return _on_woke(state, obs, now=now)
        case WakeFailed():
            return _on_wake_failed(state, obs, actions=actions)
        case EvictionSought():
            return _on_eviction_sought(state, obs, now=now)
        case PreemptAsked():
            return _on_preempt_asked(state, obs, config=config, actions=actions)
        case TenancySet():
            # What later placements and preemptions ask as; nothing running changes.
            update = {k: v for k, v in (("owner", obs.owner),
                                        ("capacity_class", obs.capacity_class))
                      if v is not None}
            return state.model_copy(update={"spec": state.spec.model_copy(update=update)})
        case _:
            # mypy proves this unreachable; a new observation type fails the type check.
            assert_never(obs)


# -- deployment observations -------------------------------------------------------------


def _on_tick(state: KeeperState) -> KeeperState:
    # Time alone changes no fact; _reconcile acts on the new ``now``.
    return state


def _on_nodes_changed(state: KeeperState) -> KeeperState:
    # Retry an unplaceable deployment (or surge) now; a failed-start backoff still holds.
    # The can't-place count is kept: a node change (memory freed somewhere, a node back)
    # says nothing of whether this model fits; only a placement that finds room resets it.
    # A move waiting for the room its victims free places again now.
    moves = [m.model_copy(update={"room_wait_until": None})
             if m.state is MoveState.RUNNING and m.room_wait_until is not None else m
             for m in state.moves]
    return state.model_copy(update={"placement_retry_at": None, "surge_retry_at": None,
                                    "moves": moves})


def _on_scale(state: KeeperState, obs: Scale, *, now: datetime) -> KeeperState:
    # A spec change un-parks: the operator has acted on the deployment. A count alone is
    # min = max = that count: the scaling policy goes (an open window still bounds it).
    state = state.model_copy(update={
        "spec": state.spec.model_copy(update={"replicas": obs.replicas, "scaling": None}),
        "parked": False, "consecutive_failures": 0 if state.parked else
        state.consecutive_failures})
    return _set_count(state, obs.replicas, now=now, note=None)


def _on_retry(state: KeeperState) -> KeeperState:
    # The operator asked: every wait starts over.
    return state.model_copy(update={"parked": False, "consecutive_failures": 0,
                                    "next_attempt_at": None, "placement_retry_at": None,
                                    "surge_retry_at": None, "unplaceable_in_a_row": 0})


def _on_delete(state: KeeperState) -> KeeperState:
    # Only marks it: _reconcile stops the replicas and finishes once none is left.
    return state.model_copy(update={"deleting": True})


# -- replica observations ----------------------------------------------------------------


def _replica_in(state: KeeperState, replica_id: ReplicaId, *phases: Phase) -> Replica | None:
    """The replica, if it is ours and in one of ``phases``; else None, and the observation
    is ignored: a late result for a replica already stopped (or never ours), or one from a
    phase it has left, must change nothing."""
    replica = _find(state, replica_id)
    return replica if replica is not None and replica.phase in phases else None


def _on_placed(state: KeeperState, obs: Placed, *, actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.PLACING)
    if replica is None:
        return state
    placed = replica.model_copy(update={"phase": Phase.STARTING, "nodes": obs.nodes,
                                        "placement_note": obs.note,
                                        "can_sleep": obs.can_sleep})
    state = _replace(state, placed).model_copy(update={"placement_error": None,
                                                       "placement_retry_at": None,
                                                       "unplaceable_in_a_row": 0,
                                                       "evicting": None,
                                                       "seek_again_at": None,
                                                       "preempted": None})
    if state.deleting:
        # The deletion arrived while this placement was on its way: undo it now.
        return _stop(state, placed, "deployment deleted", actions)
    if replica.retiring:
        return _stop(state, placed, replica.stop_reason or "scaled down", actions)
    actions.append(StartReplica(replica_id=replica.replica_id))
    return state


def _on_unplaceable(state: KeeperState, obs: Unplaceable, *, now: datetime,
                    config: KeeperConfig, actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.PLACING)
    if replica is None:
        return state
    state = _drop(state, replica.replica_id)
    if replica.move_id is not None:
        return _on_move_unplaceable(state, replica.move_id, obs.reason, now=now,
                                    config=config, actions=actions)
    if replica.standby:
        # Not the deployment's failure: it serves. Kept as its placement error (shown
        # beside "serving"; the store's waiting-for-room list includes it, so a node that
        # joins or frees room tells it at once), and tried blind after the backstop.
        return state.model_copy(update={
            "placement_error": f"no room for a warm standby: {obs.reason}",
            "placement_retry_at": now + timedelta(seconds=cant_place_wait_s(config))})
    if replica.retiring or _is_surge(state):
        return _surge_failed(state, replica, "no room for a replacement", obs.reason,
                             now=now, config=config)
    state = state.model_copy(update={
        "placement_error": (obs.reason if state.preempted is None
                            else f"{state.preempted}; waiting for room: {obs.reason}"),
        "unplaceable_in_a_row": state.unplaceable_in_a_row + 1,
        "placement_retry_at": now + timedelta(seconds=cant_place_wait_s(config))})
    loading = state.loading_since is not None and policy_of(state).on_demand
    if not state.seeking_room and (loading or (config.preemption
                                               and state.unplaceable_in_a_row == 1
                                               and state.preempted is None)):
        # Fits nowhere: another deployment's replicas may make the room, as the capacity
        # rules allow (modelkeeper.domain.eviction): an idle on-demand one for a model
        # asked for, a lower class for a higher. Sought once per run of failures (the
        # first; an operator's retry starts a new run), not at each of the room watch's
        # retries: a deployment nothing can make room for would otherwise pay an activity
        # per retry for the same answer. Asked for on demand, at each failure, as issue
        # 21 did. A preempted deployment waits for its room to return: it seeks nothing,
        # or two deployments could take a room from each other in turn.
        actions.append(SeekRoom())
        state = state.model_copy(update={"seeking_room": True})
    return state


def _on_move_unplaceable(state: KeeperState, move_id: MoveId, reason: str, *,
                         now: datetime, config: KeeperConfig,
                         actions: list[Action]) -> KeeperState:
    """A move's new replica found no room. A restart or a switch may borrow a lower
    class's room (the seed's "a restart borrows a lower class's room and returns it"):
    room is sought once for the move, which waits for the victims' release (a node
    change) and places again; the old replica's retire then frees room, and the victims,
    waiting for it, are placed again by themselves. Nothing may be stopped, or room
    already sought: the move fails, as in 0.2."""
    move = _find_move(state, move_id)
    if (config.preemption and move is not None and move.state is MoveState.RUNNING
            and not move.sought_room and not state.seeking_room):
        actions.append(SeekRoom())
        move = move.model_copy(update={
            "surged": None, "sought_room": True,
            "room_wait_until": now + timedelta(seconds=EVICTION_RECHECK_S),
            "detail": _note(move, f"no room ({reason}); seeking room", now)})
        return _put_move(state, move).model_copy(update={"seeking_room": True})
    return _move_failed(state, move_id, f"no room: {reason}", now=now)


def _on_placement_crashed(state: KeeperState, obs: PlacementCrashed, *, now: datetime,
                          config: KeeperConfig) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.PLACING)
    if replica is None:
        return state
    state = _drop(state, replica.replica_id)
    if replica.move_id is not None:
        return _move_failed(state, replica.move_id, f"placement failed: {obs.error}", now=now)
    if replica.retiring or _is_surge(state):
        return _surge_failed(state, replica, "placing a replacement failed", obs.error,
                             now=now, config=config)
    return state.model_copy(update={
        "last_failure": f"placement failed: {obs.error}",
        "placement_retry_at": now + timedelta(seconds=config.cant_place_retry_s)})


def _surge_failed(state: KeeperState, replica: Replica, what: str, why: str, *,
                  now: datetime, config: KeeperConfig) -> KeeperState:
    """A placement beyond the desired number (a surge for an unreachable replica, or one
    no longer wanted) found no room or crashed. Not a failed start and not cant_place: the
    original may still come back, and if it does not, it is lost after ``lost_after_s``
    and replaced as an ordinary placement, which this timer does not hold up."""
    if replica.retiring:
        return state  # no longer wanted: nothing to retry, nothing to report
    unreachable = ", ".join(r.replica_id for r in state.replicas
                            if r.phase is Phase.UNREACHABLE)
    return state.model_copy(update={
        "last_failure": f"{what} of unreachable {unreachable}: {why}",
        "surge_retry_at": now + timedelta(seconds=config.cant_place_retry_s)})


def _on_started(state: KeeperState, obs: Started, *, now: datetime,
                actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.STARTING)
    if replica is None:
        return state
    # A relaunch keeps its note (what happened to it, for its stored state) and the
    # window's relaunches (the next verdict counts them).
    ready = replica.model_copy(update={"phase": Phase.READY, "endpoint": obs.endpoint,
                                       "ready_at": now, "relaunching": False})
    actions.append(WatchReplica(replica_id=replica.replica_id))
    state = _replace(state, ready).model_copy(update={
        "consecutive_failures": 0, "next_attempt_at": None})
    if replica.standby:
        # A warm standby is started only to be kept asleep, ready to wake.
        return _sleep(state, ready, "warm standby", now=now, actions=actions)
    return state.model_copy(update={"loading_since": None, "loading_reason": None})


def _on_start_failed(state: KeeperState, obs: StartFailed, *, now: datetime,
                     config: KeeperConfig, jitter: float,
                     actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.STARTING)
    if replica is None:
        return state
    if replica.relaunching:
        # A relaunch that does not become ready is not a failed start of the deployment
        # (it served on this node until just now): the replica is lost after ready,
        # replaced at once, as an exit with no try left.
        return _lost_after_ready(state, replica, f"relaunch in place failed: {obs.error}",
                                 actions)
    if replica.move_id is not None:
        # The move's new replica failed to start: the move fails (its saga decides what next),
        # not the deployment: no failed-start count, no backoff, no park.
        state = _stop(state, replica, "start failed", actions)
        return _move_failed(state, replica.move_id, f"start failed: {obs.error}", now=now)
    failures = state.consecutive_failures + 1
    state = _stop(state, replica, "start failed", actions)
    parked = failures >= config.park_after
    return state.model_copy(update={
        "consecutive_failures": failures, "last_failure": obs.error, "parked": parked,
        "next_attempt_at": None if parked else
        now + timedelta(seconds=backoff_s(failures, config, jitter))})


def _on_exited(state: KeeperState, obs: Exited, *, now: datetime, config: KeeperConfig,
               actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.READY, Phase.UNREACHABLE,
                          Phase.SLEEPING, Phase.WAKING)
    if replica is None:
        return state
    if (not config.relaunch or config.relaunch_tries == 0 or state.deleting
            or replica.phase is not Phase.READY):
        # Only a ready engine's exit is relaunched: an unreachable replica's node went
        # quiet, a sleeping or waking one's claim is shrunk, a deleted one is not wanted.
        return _lost_after_ready(state, replica, obs.detail, actions)
    verdict = relaunch_verdict(nodes=replica.nodes, exit_kind=obs.exit_kind,
                               relaunched_at=replica.relaunched_at, now=now,
                               tries=config.relaunch_tries,
                               window_s=config.relaunch_window_s)
    match verdict:
        case Relaunch():
            return _relaunch(state, replica, obs, verdict, actions)
        case Replace():
            why = obs.detail if verdict.reason is None else f"{obs.detail}; {verdict.reason}"
            return _lost_after_ready(state, replica, why, actions)
        case _:
            assert_never(verdict)


def _relaunch(state: KeeperState, replica: Replica, obs: Exited, verdict: Relaunch,
              actions: list[Action]) -> KeeperState:
    """Back to starting on its node, in its claim: its stored state (starting) takes its
    endpoint out of routing until the engine is ready again."""
    note = f"engine exited ({obs.detail}); {verdict.note}"
    actions.append(RelaunchReplica(replica_id=replica.replica_id, reason=note,
                                   attempt=verdict.attempt, tries=verdict.tries,
                                   window_s=verdict.window_s))
    state = _replace(state, replica.model_copy(update={
        "phase": Phase.STARTING, "relaunching": True, "relaunch_note": note,
        "relaunched_at": verdict.relaunched_at}))
    return state.model_copy(update={"last_failure": f"{replica.replica_id}: {note}"})


def _on_silent(state: KeeperState, obs: Silent, *, now: datetime, config: KeeperConfig,
               actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.READY)
    if replica is None:
        return state
    # Only unreachable, not lost: a blip must not tear down a replica still serving.
    # (_reconcile places its replacement meanwhile.)
    actions.append(ProbeReplica(replica_id=replica.replica_id))
    state = _replace(state, replica.model_copy(update={
        "phase": Phase.UNREACHABLE, "unreachable_since": now, "probe_in_flight": True}))
    # The reason a degraded status gives.
    return state.model_copy(update={"last_failure": (
        f"{replica.replica_id} unreachable: no heartbeat from {', '.join(replica.nodes)}")})


def _on_probe_result(state: KeeperState, obs: ProbeResult, *, now: datetime,
                     config: KeeperConfig, actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.UNREACHABLE)
    if replica is None:
        return state
    if obs.running is True:
        # Its agent is back and the engine never stopped: adopt it, keep serving.
        actions.append(WatchReplica(replica_id=replica.replica_id))
        back = replica.model_copy(update={
            "phase": Phase.READY, "unreachable_since": None, "probe_in_flight": False,
            "next_probe_at": None})
        state = _replace(state, back)
        # It serves now; its replacement, not yet ready (a ready one would have retired it
        # already), is one too many: keep the original, retire the replacement.
        others = [r for r in _counted(state) if r.replica_id != back.replica_id]
        surplus = len(others) + 1 - state.spec.replicas
        if surplus > 0:
            state = _retire(state, others, surplus, f"not needed: {back.replica_id} is back",
                            actions)
        return state
    if obs.running is False:
        return _lost_after_ready(state, replica, "its agent no longer runs it", actions)
    # No answer either way: ask again later; _reconcile declares it lost at lost_after_s.
    return _replace(state, replica.model_copy(update={
        "probe_in_flight": False,
        "next_probe_at": now + timedelta(seconds=config.probe_interval_s)}))


def _on_stopped(state: KeeperState, obs: Stopped) -> KeeperState:
    # Only a stop we asked for ends a replica: forgetting a placed or running one would
    # leak its claim or its engine.
    replica = _replica_in(state, obs.replica_id, Phase.STOPPING)
    if replica is None:
        return state
    state = _drop(state, replica.replica_id)
    if state.placement_error is not None and state.loading_since is not None:
        # Asked for, and its own claims are released: room it was waiting for (an idle
        # stop just done, and asked for again at once) may be there now. As a node change.
        state = _on_nodes_changed(state)
    return state


def _reconcile(state: KeeperState, now: datetime, config: KeeperConfig,
               actions: list[Action]) -> KeeperState:
    """Bring live replicas toward the spec, after every observation."""
    if state.finished:
        return state
    if state.deleting:
        for move in state.moves:
            if move.state is MoveState.RUNNING:
                state = _end_move(state, move, MoveState.FAILED, now=now,
                                  error="deployment deleted")
        for replica in state.replicas:
            if replica.phase in (Phase.STARTING, Phase.READY, Phase.UNREACHABLE,
                                 Phase.SLEEPING, Phase.WAKING):
                state = _stop(state, replica, "deployment deleted", actions,
                              drain=replica.phase is Phase.READY)
            elif replica.phase is Phase.PLACING and not replica.retiring:
                # Its placement is in flight: it is stopped when it lands (see
                # _on_placed), and no longer counts as wanted meanwhile.
                state = _replace(state, replica.model_copy(update={"retiring": True}))
        if not state.replicas:
            actions.append(Finish())
            return state.model_copy(update={"finished": True})
        return state

    # Two-stage expiry: unreachable for too long is lost; meanwhile keep probing.
    for replica in list(state.replicas):
        if replica.phase is not Phase.UNREACHABLE:
            continue
        assert replica.unreachable_since is not None
        silent_for = (now - replica.unreachable_since).total_seconds()
        if silent_for >= config.lost_after_s:
            state = _lost_after_ready(
                state, replica, f"no word from its node for {silent_for:.0f}s", actions)
        elif (not replica.probe_in_flight and replica.next_probe_at is not None
              and now >= replica.next_probe_at):
            actions.append(ProbeReplica(replica_id=replica.replica_id))
            state = _replace(state, replica.model_copy(update={"probe_in_flight": True}))

    state = _advance_moves(state, now, config, actions)

    if (state.seek_again_at is not None and now >= state.seek_again_at
            and not state.seeking_room and state.loading_since is not None
            and state.placement_error is not None):
        # A protection window ended, or an eviction asked did not make the room.
        actions.append(SeekRoom())
        state = state.model_copy(update={"seeking_room": True, "seek_again_at": None,
                                         "evicting": None})

    desired = state.spec.replicas
    if _ready(state) >= desired:
        # Enough replicas serve without the unreachable ones (a replacement became ready,
        # or the spec shrank): stop them rather than wait for them to be lost.
        for replica in state.replicas:
            if replica.phase is Phase.UNREACHABLE:
                state = _stop(state, replica, "scaled down" if desired == 0
                              else "replaced while unreachable", actions)

    counted = _counted(state)
    # A stop-first replace holds the slot of the replica it retired until its new one is
    # ready: the keeper must not fill that slot with a replica of the old generation.
    held = len(counted) + _reserved(state)
    if held < desired and not state.parked:
        # A replica short (lost, or asked for): a warm standby wakes in its place, a wake
        # rather than a load. A new standby is placed once the count is whole again.
        for standby in [r for r in _standbys(state) if r.phase is Phase.SLEEPING]:
            if held >= desired:
                break
            state = _wake(state, standby.model_copy(update={"standby": False}),
                          "a serving replica is short: the warm standby takes its place",
                          actions)
            held += 1
    if held > desired:
        state = _retire(state, counted, min(held - desired, len(counted)), "scaled down",
                        actions)
    elif held < desired and not state.parked:
        retiring = [r for r in state.replicas if r.retiring and r.phase is Phase.PLACING]
        if retiring:
            # Wanted again (a scale-up, or a replica lost) while its placement is still in
            # flight: keep it rather than stop it on landing and place another.
            return _replace(state, retiring[0].model_copy(update={"retiring": False,
                                                                  "stop_reason": None}))
        placing = any(r.phase is Phase.PLACING for r in state.replicas)
        if not placing and _placement_due(state, now):
            replica_id = _next_id(state)
            actions.append(PlaceReplica(replica_id=replica_id))
            # A surge for an unreachable replica goes elsewhere: if that node is only
            # slow (an agent restarting), its agent vouches for the original soon, and a
            # replacement beside it would retire a healthy engine for nothing.
            avoid = sorted({n for r in state.replicas if r.phase is Phase.UNREACHABLE
                            for n in r.nodes}) if _is_surge(state) else []
            state = state.model_copy(update={
                "replicas": [*state.replicas, Replica(
                    replica_id=replica_id, phase=Phase.PLACING,
                    generation=state.spec.generation, avoid_nodes=avoid)],
                "next_replica_seq": state.next_replica_seq + 1,
                "next_attempt_at": None, "placement_retry_at": None,
                "surge_retry_at": None})
    elif held == desired and not state.parked:
        state = _keep_standbys(state, now, actions)
    return state


def _next_id(state: KeeperState) -> ReplicaId:
    return ReplicaId(f"{state.spec.deployment_id}-r{state.next_replica_seq}")


def _keep_standbys(state: KeeperState, now: datetime, actions: list[Action]) -> KeeperState:
    """Warm standbys: as many as the policy keeps, placed once the serving count is whole,
    each away from the nodes the deployment's other replicas use."""
    standbys = _standbys(state)
    wanted = _standby_wanted(state)
    if len(standbys) > wanted:
        return _retire(state, standbys, len(standbys) - wanted, "standby not needed",
                       actions)
    placing = any(r.phase is Phase.PLACING for r in state.replicas)
    if len(standbys) == wanted or placing or not _placement_due(state, now):
        return state
    replica_id = _next_id(state)
    actions.append(PlaceReplica(replica_id=replica_id))
    avoid = sorted({n for r in state.replicas if r.phase is not Phase.STOPPING
                    for n in r.nodes})
    return state.model_copy(update={
        "replicas": [*state.replicas, Replica(
            replica_id=replica_id, phase=Phase.PLACING, generation=state.spec.generation,
            avoid_nodes=avoid, standby=True)],
        "next_replica_seq": state.next_replica_seq + 1})


def _retire(state: KeeperState, candidates: list[Replica], n: int, reason: str,
            actions: list[Action]) -> KeeperState:
    """Retire the ``n`` least useful of ``candidates``: not yet placed, not yet serving,
    unreachable, then the newest ready one. A replica a running move means to retire goes
    first among equals: it is on its way out anyway."""
    order = {Phase.PLACING: 0, Phase.STARTING: 1, Phase.WAKING: 1, Phase.UNREACHABLE: 2,
             Phase.SLEEPING: 2, Phase.READY: 3}
    targets = {move.replica_id for move in state.moves if move.state is MoveState.RUNNING}
    ranked = sorted(candidates, key=lambda r: (order[r.phase], r.replica_id not in targets,
                                               -_seq(r.replica_id)))
    for replica in ranked[:n]:
        state = _retire_one(state, replica, reason, actions)
    return state


def _live(state: KeeperState) -> list[Replica]:
    """Replicas placed and wanted: neither stopping nor retiring, nor leased to a move (an
    move's surge counts toward desired + surge, not desired), nor a warm standby (kept
    beside the desired number)."""
    return [r for r in state.replicas if r.phase in LIVE_PHASES and not r.retiring
            and r.move_id is None and not r.standby]


def _standbys(state: KeeperState) -> list[Replica]:
    """Warm standbys placed and wanted."""
    return [r for r in state.replicas if r.phase in LIVE_PHASES and not r.retiring
            and r.move_id is None and r.standby]


def _standby_wanted(state: KeeperState) -> int:
    policy = policy_of(state)
    return policy.warm_standby if policy.max_replicas >= 1 else 0


def _reserved(state: KeeperState) -> int:
    """Slots held by running stop-first replaces whose old replica is retired (or being
    retired): each counts as one replica until its new one is handed over."""
    return sum(1 for move in state.moves
               if move.state is MoveState.RUNNING and move.kind is MoveKind.REPLACE
               and move.stop_first and move.retire_issued)


def _counted(state: KeeperState) -> list[Replica]:
    """Replicas that count toward the desired number. An unreachable one does not: it
    serves nobody (routed around), so a replacement is placed beside it."""
    return [r for r in _live(state) if r.phase is not Phase.UNREACHABLE]


def _ready(state: KeeperState) -> int:
    return sum(1 for r in state.replicas if r.phase is Phase.READY)


def _is_surge(state: KeeperState) -> bool:
    """Whether a placement now would be beyond the desired number: a replacement for an
    unreachable replica."""
    return (any(r.phase is Phase.UNREACHABLE for r in state.replicas)
            and len(_live(state)) >= state.spec.replicas)


def _next_attempt(state: KeeperState) -> datetime | None:
    """The earliest time a new placement may start (every timer must have passed; a
    failed surge's timer holds only further surges)."""
    timers = [state.next_attempt_at, state.placement_retry_at]
    if _is_surge(state):
        timers.append(state.surge_retry_at)
    times = [t for t in timers if t is not None]
    return max(times) if times else None


def _placement_due(state: KeeperState, now: datetime) -> bool:
    due = _next_attempt(state)
    return due is None or now >= due


def _seq(replica_id: ReplicaId) -> int:
    tail = replica_id.rsplit("-r", 1)[-1]
    return int(tail) if tail.isdigit() else 0


# -- demand: the replica count follows use (modelkeeper.domain.demand) -----------------------


def policy_of(state: KeeperState) -> ScalingPolicy:
    """The policy in force: the deployment's (min = max = ``replicas`` when it has none),
    with an open schedule window's bounds over it."""
    policy = state.spec.scaling or ScalingPolicy.fixed(state.spec.replicas)
    if state.window is not None:
        policy = policy.model_copy(update={"min_replicas": state.window.min_replicas,
                                           "max_replicas": state.window.max_replicas})
    return policy


def _set_count(state: KeeperState, replicas: int, *, now: datetime,
               note: str | None) -> KeeperState:
    """The number wanted, brought within the policy's bounds; nothing wanted ends a load."""
    wanted = policy_of(state).within(replicas)
    update: dict[str, object] = {"spec": state.spec.model_copy(update={"replicas": wanted})}
    if wanted != state.spec.replicas:
        update["last_change_at"] = now
    if note is not None:
        update["demand_note"] = f"{now:%Y-%m-%d %H:%M:%S}: {note}"
    if wanted == 0:
        update.update(loading_since=None, loading_reason=None)
    return state.model_copy(update=update)


def _standing(replica: Replica) -> Standing:
    if replica.retiring or replica.move_id is not None:
        return Standing.OTHER
    match replica.phase:
        case Phase.PLACING | Phase.STARTING | Phase.WAKING:
            return Standing.ON_ITS_WAY
        case Phase.READY:
            return Standing.READY
        case Phase.SLEEPING:
            return Standing.SLEEPING
        case _:
            return Standing.OTHER


def demand_view(state: KeeperState) -> DemandView:
    """What the demand rules read of the keeper (a usage watch's input)."""
    ready = [r for r in state.replicas if r.phase is Phase.READY and not r.standby]
    return DemandView(
        deployment_id=state.spec.deployment_id, policy=policy_of(state),
        desired=state.spec.replicas,
        replicas=[ReplicaStanding(replica_id=r.replica_id, standing=_standing(r),
                                  ready_at=r.ready_at, asleep_since=r.asleep_since,
                                  standby=r.standby)
                  for r in state.replicas],
        last_change_at=state.last_change_at,
        can_sleep=bool(ready) and all(r.can_sleep for r in ready))


def follows_demand(state: KeeperState) -> bool:
    """Whether a usage watch should run: the policy lets use change the count, or a
    replica sleeps (a request wakes it), and the deployment is neither deleting nor
    parked."""
    if state.deleting or state.parked or state.finished:
        return False
    if any(r.phase in _IN_PASSING or (r.phase is Phase.SLEEPING and not r.asleep)
           for r in state.replicas):
        # A replica is on its way, or falling asleep: no rule acts until it lands (one
        # step at a time), and a watch opened on each phase it passes would cost history
        # events for nothing. The watch opens again on the view it lands on. A replica
        # stopping is not waited for: a request that comes meanwhile (an idle stop just
        # done) must load the model again at once, not after the stop.
        return False
    return policy_of(state).follows_demand or any(
        r.phase is Phase.SLEEPING for r in state.replicas)


#: Phases a replica only passes through on its way in: placing, starting, waking.
_IN_PASSING = frozenset({Phase.PLACING, Phase.STARTING, Phase.WAKING})


def _sleep(state: KeeperState, replica: Replica, reason: str, *, now: datetime,
           actions: list[Action]) -> KeeperState:
    actions.append(SleepReplica(replica_id=replica.replica_id, reason=reason))
    return _replace(state, replica.model_copy(update={
        "phase": Phase.SLEEPING, "asleep_since": now, "asleep": False, "wake_wanted": False,
        "stop_reason": reason}))


def _wake(state: KeeperState, replica: Replica, reason: str,
          actions: list[Action]) -> KeeperState:
    if not replica.asleep:
        # Still falling asleep: woken as soon as the sleep is done (_on_slept).
        return _replace(state, replica.model_copy(update={"wake_wanted": True}))
    actions.append(WakeReplica(replica_id=replica.replica_id, reason=reason))
    return _replace(state, replica.model_copy(update={"phase": Phase.WAKING,
                                                      "wake_wanted": False}))


def _on_demand_step(state: KeeperState, obs: DemandStepDue, *, now: datetime,
                    actions: list[Action]) -> KeeperState:
    """Take the usage watch's step, if the keeper still stands where the watch saw it.

    A step on a view that has moved on (a replica became ready, the operator scaled)
    is dropped: the workflow starts a new watch on the new view, which decides again.
    """
    if state.deleting or state.parked or demand_view(state) != obs.view:
        return state
    step = obs.step
    match step:
        case Add():
            sleeper = next((r for r in state.replicas if r.phase is Phase.SLEEPING
                            and not r.standby and not r.retiring), None)
            if sleeper is not None:
                # A sleeping replica already counts: waking it is the addition, and far
                # cheaper than a load.
                state = state.model_copy(update={
                    "demand_note": f"{now:%Y-%m-%d %H:%M:%S}: wake {sleeper.replica_id}: "
                                   f"{step.reason}"})
                return _wake(state, sleeper, step.reason, actions)
            was = state.spec.replicas
            state = _set_count(state, was + 1, now=now, note=f"+1: {step.reason}")
            if was == 0 and state.spec.replicas > 0:
                state = state.model_copy(update={"loading_since": now,
                                                 "loading_reason": step.reason})
            return state
        case Retire():
            replica = _replica_in(state, step.replica_id, Phase.READY, Phase.SLEEPING)
            if replica is None:
                return state
            state = _set_count(state, state.spec.replicas - 1, now=now,
                               note=f"-1 ({replica.replica_id}): {step.reason}")
            return _retire_one(state, replica, step.reason, actions)
        case Sleep():
            replica = _replica_in(state, step.replica_id, Phase.READY)
            if replica is None:
                return state
            state = state.model_copy(update={
                "demand_note": f"{now:%Y-%m-%d %H:%M:%S}: sleep {replica.replica_id}: "
                               f"{step.reason}"})
            return _sleep(state, replica, step.reason, now=now, actions=actions)
        case Wake():
            replica = _replica_in(state, step.replica_id, Phase.SLEEPING)
            if replica is None:
                return state
            state = state.model_copy(update={
                "loading_since": state.loading_since or now,
                "loading_reason": f"waking {replica.replica_id}: {step.reason}",
                "demand_note": f"{now:%Y-%m-%d %H:%M:%S}: wake {replica.replica_id}: "
                               f"{step.reason}"})
            return _wake(state, replica.model_copy(update={"standby": False}), step.reason,
                         actions)
        case _:
            assert_never(step)


def _on_policy_set(state: KeeperState, obs: PolicySet, *, now: datetime) -> KeeperState:
    # A spec change un-parks, as a scale does.
    state = state.model_copy(update={
        "spec": state.spec.model_copy(update={"scaling": obs.policy}), "parked": False,
        "consecutive_failures": 0 if state.parked else state.consecutive_failures})
    who = f" by {obs.actor}" if obs.actor else ""
    return _set_count(state, state.spec.replicas, now=now,
                      note=f"policy set{who}: min {obs.policy.min_replicas}, "
                           f"max {obs.policy.max_replicas}")


def _on_window_set(state: KeeperState, obs: WindowSet, *, now: datetime) -> KeeperState:
    if obs.window is not None:
        if state.spec.scaling is None:
            # ``replicas: N`` is min = max = N: kept as that policy, so the close comes
            # back to N and not to the window's count.
            state = state.model_copy(update={"spec": state.spec.model_copy(update={
                "scaling": ScalingPolicy.fixed(state.spec.replicas)})})
        state = state.model_copy(update={"window": obs.window})
        note = (f"window {obs.window.name} open: min {obs.window.min_replicas}, "
                f"max {obs.window.max_replicas}")
        # Opening raises the count to the window's minimum (its prewarm is the schedule's
        # lead time: the window opens early so replicas are ready when it starts).
        return _set_count(state, max(state.spec.replicas, obs.window.min_replicas),
                          now=now, note=note)
    if state.window is None or state.window.name != obs.closing:
        return state  # a close for a window not open (one that opened since wins)
    state = state.model_copy(update={"window": None})
    return _set_count(state, state.spec.replicas, now=now,
                      note=f"window {obs.closing} closed")


def _on_sleep_asked(state: KeeperState, obs: SleepAsked, *, now: datetime,
                    actions: list[Action]) -> KeeperState:
    who = f"asked by {obs.actor}" if obs.actor else "asked"
    for replica in list(state.replicas):
        if (replica.phase is Phase.READY and replica.move_id is None and not replica.retiring
                and obs.replica_id in (None, replica.replica_id)):
            state = _sleep(state, replica, who, now=now, actions=actions)
    return state


def _on_wake_asked(state: KeeperState, obs: WakeAsked, *,
                   actions: list[Action]) -> KeeperState:
    who = f"asked by {obs.actor}" if obs.actor else "asked"
    for replica in list(state.replicas):
        if replica.phase is Phase.SLEEPING and obs.replica_id in (None, replica.replica_id):
            state = _wake(state, replica.model_copy(update={"standby": False}), who, actions)
    return state


def refuse_eviction(state: KeeperState, replica_id: ReplicaId) -> str | None:
    """Why this deployment will not give up ``replica_id`` for another (the ``evict``
    update's validator), or None: only a ready or sleeping replica of an on-demand
    deployment, not leased to a move, may go (min >= 1 is a promise)."""
    if not state.deleting and not policy_of(state).on_demand:
        return (f"{state.spec.deployment_id} is not on demand (min_replicas = "
                f"{policy_of(state).min_replicas}): its replicas are a promise")
    return refuse_preemption(state, replica_id)


def _on_evict_asked(state: KeeperState, obs: EvictAsked, *, now: datetime,
                    actions: list[Action]) -> KeeperState:
    if refuse_eviction(state, obs.replica_id) is not None:
        return state
    replica = _find(state, obs.replica_id)
    assert replica is not None  # refuse_eviction found it
    state = _set_count(state, state.spec.replicas - 1, now=now, note=obs.reason)
    return _retire_one(state, replica, obs.reason, actions)


def refuse_preemption(state: KeeperState, replica_id: ReplicaId) -> str | None:
    """Why this deployment will not give up ``replica_id`` to a preemption, or None: only
    a ready or sleeping replica, not being retired and not leased to a move (a saga in
    flight owns it; the rules already chose it as outranked)."""
    if state.deleting:
        return f"{state.spec.deployment_id} is being deleted"
    replica = _find(state, replica_id)
    if (replica is None or replica.phase not in (Phase.READY, Phase.SLEEPING)
            or replica.retiring or replica.move_id is not None):
        return f"{replica_id} is not a ready or sleeping replica of {state.spec.deployment_id}"
    return None


def _on_preempt_asked(state: KeeperState, obs: PreemptAsked, *, config: KeeperConfig,
                      actions: list[Action]) -> KeeperState:
    if refuse_preemption(state, obs.replica_id) is not None:
        return state
    replica = _find(state, obs.replica_id)
    assert replica is not None  # refuse_preemption found it
    # The count is kept: the replica is owed, and placed again by itself when room
    # returns. Until then the deployment says why it lost it.
    state = state.model_copy(update={"preempted": obs.reason,
                                     "demand_note": obs.reason})
    return _stop(state, replica, obs.reason, actions, drain=replica.phase is Phase.READY,
                 grace_s=config.preempt_grace_s)


def _on_slept(state: KeeperState, obs: Slept, *, actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.SLEEPING)
    if replica is None:
        return state
    asleep = replica.model_copy(update={"asleep": True})
    state = _replace(state, asleep)
    if replica.wake_wanted:
        return _wake(state, asleep, "asked while falling asleep", actions)
    return state


def _on_sleep_failed(state: KeeperState, obs: SleepFailed, *,
                     actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.SLEEPING)
    if replica is None:
        return state
    # Out of routing and in an unknown state: stopped, and replaced if still wanted.
    state = _stop(state, replica, f"sleep failed: {obs.error}", actions)
    return state.model_copy(update={"last_failure": f"{replica.replica_id}: sleep failed: "
                                                    f"{obs.error}"})


def _on_woke(state: KeeperState, obs: Woke, *, now: datetime) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.WAKING)
    if replica is None:
        return state
    awake = replica.model_copy(update={"phase": Phase.READY, "ready_at": now,
                                       "asleep": False, "asleep_since": None,
                                       "stop_reason": None})
    return _replace(state, awake).model_copy(update={"loading_since": None,
                                                     "loading_reason": None})


def _on_wake_failed(state: KeeperState, obs: WakeFailed, *,
                    actions: list[Action]) -> KeeperState:
    replica = _replica_in(state, obs.replica_id, Phase.WAKING)
    if replica is None:
        return state
    # Stopped either way; still wanted, it is placed again (where there is room, or an
    # eviction is sought for it).
    why = f"wake failed: {obs.error}"
    state = _stop(state, replica, why, actions)
    return state.model_copy(update={"last_failure": f"{replica.replica_id}: {why}"})


def _on_eviction_sought(state: KeeperState, obs: EvictionSought, *,
                        now: datetime) -> KeeperState:
    state = state.model_copy(update={"seeking_room": False})
    waiting = [m for m in state.moves
               if m.state is MoveState.RUNNING and m.room_wait_until is not None]
    if waiting:
        if obs.victim is None and not obs.preempting:
            for move in waiting:  # nothing may be stopped for it: as in 0.2, no room
                state = _move_failed(state, move.move_id, f"no room: {obs.reason}", now=now)
            return state
        # Room is being made: shown beside "serving" (the old replica still serves), and
        # so the store lists this deployment as waiting: the victims' release signals it.
        return state.model_copy(update={
            "placement_error": f"{waiting[0].kind.value} {waiting[0].move_id}: making room: "
                               f"{obs.reason}",
            "demand_note": f"{now:%Y-%m-%d %H:%M:%S}: {obs.reason}"})
    if obs.preempting and state.loading_since is None and not state.deleting:
        # Not loading on demand: a deployment that outranks what it preempted. It waits
        # in cant_place, saying why, and places when the victims' release signals it
        # (their room is held for it meanwhile).
        return state.model_copy(update={
            "placement_error": f"making room: {obs.reason}",
            "demand_note": f"{now:%Y-%m-%d %H:%M:%S}: {obs.reason}"})
    if state.loading_since is None or state.deleting:
        return state  # served (or no longer wanted) meanwhile
    victim = obs.victim or (obs.preempting[0] if obs.preempting else None)
    if victim is None:
        return state.model_copy(update={
            "evicting": None, "seek_again_at": obs.retry_at,
            "loading_reason": (f"waiting for room until {obs.retry_at:%H:%M:%S}: "
                               f"{obs.reason}" if obs.retry_at else state.loading_reason)})
    return state.model_copy(update={
        "evicting": victim, "loading_reason": f"making room: {obs.reason}",
        "seek_again_at": now + timedelta(seconds=EVICTION_RECHECK_S),
        "demand_note": f"{now:%Y-%m-%d %H:%M:%S}: {obs.reason}"})


def _room_on_its_way(state: KeeperState) -> bool:
    """Asked for, and room is being made (an eviction sought or asked) or will be sought
    again: the deployment is loading, not hopeless."""
    return state.loading_since is not None and (
        state.seeking_room or state.evicting is not None or state.seek_again_at is not None
        or any(r.phase is Phase.STOPPING for r in state.replicas))


# -- moves: changes a saga asks for --------------------------------------------------------


def current_generation(state: KeeperState) -> Generation:
    """What new replicas of the deployment run."""
    return state.spec.generation or Generation(model_id=state.spec.model_id)


def _generation_of(state: KeeperState, replica: Replica) -> Generation:
    return replica.generation or Generation(model_id=state.spec.model_id)


def _find_move(state: KeeperState, move_id: MoveId) -> Move | None:
    return next((move for move in state.moves if move.move_id == move_id), None)


def _put_move(state: KeeperState, move: Move) -> KeeperState:
    return state.model_copy(update={"moves": [move if o.move_id == move.move_id else o
                                            for o in state.moves]})


def _note(move: Move, text: str, now: datetime) -> str:
    return f"{move.detail}; {text} at {now:%H:%M:%S}" if move.detail else (
        f"{text} at {now:%H:%M:%S}")


def _end_move(state: KeeperState, move: Move, outcome: MoveState, *, now: datetime,
            error: str | None = None, note: str | None = None) -> KeeperState:
    """End ``move`` and forget the oldest ended moves past MOVES_KEPT."""
    ended = move.model_copy(update={
        "state": outcome, "ended_at": now, "error": error or move.error,
        "detail": _note(move, note, now) if note else move.detail})
    moves = [ended if o.move_id == move.move_id else o for o in state.moves]
    done = [o for o in moves if o.state in MOVE_ENDED]
    if len(done) > MOVES_KEPT:
        gone = {o.move_id for o in done[:len(done) - MOVES_KEPT]}
        moves = [o for o in moves if o.move_id not in gone]
    return state.model_copy(update={"moves": moves})


def _move_failed(state: KeeperState, move_id: MoveId, error: str, *, now: datetime) -> KeeperState:
    move = _find_move(state, move_id)
    if move is None or move.state is not MoveState.RUNNING:
        return state
    return _end_move(state, move, MoveState.FAILED, now=now, error=error)


def _on_move_asked(state: KeeperState, obs: MoveAsked, *, now: datetime,
                 config: KeeperConfig) -> KeeperState:
    # A retried update finds its move and changes nothing; _reconcile advances a new one.
    request = obs.request
    if _find_move(state, request.move_id) is not None:
        return state
    move = Move(move_id=request.move_id, kind=request.kind, replica_id=request.replica_id,
            avoid_nodes=request.avoid_nodes, generation=request.generation,
            stop_first=request.stop_first, balances=request.balances,
            reason=request.reason, started_at=now)
    # The validator saw the state before observations still queued with this one (two
    # surges asked at once both pass it): checked again here, and refused as a failed move.
    refusal = refuse_move(state, request, config)
    if refusal is not None:
        move = move.model_copy(update={"state": MoveState.FAILED, "ended_at": now,
                                   "error": refusal})
    return state.model_copy(update={"moves": [*state.moves, move]})


def _on_move_cancelled(state: KeeperState, obs: MoveCancelled, *, now: datetime,
                     config: KeeperConfig, actions: list[Action]) -> KeeperState:
    """The compensation: retire what the move surged, keep what it would have retired.

    Too late once the old replica's retire is under way (a replace whose new replica is
    ready, a retire): the move then runs to its end, and the answer says so.
    """
    move = _find_move(state, obs.move_id)
    if move is None:
        return state
    surged = _find(state, move.surged) if move.surged else None
    holding = (move.kind is MoveKind.SURGE and move.state is MoveState.SUCCEEDED
               and surged is not None and surged.move_id == move.move_id)
    if not (move.state is MoveState.RUNNING or holding):
        return state
    if move.retire_issued and not move.stop_first:
        return _put_move(state, move.model_copy(update={
            "detail": _note(move, "cancel asked too late: the old replica is retiring", now)}))
    note = "cancelled"
    if surged is not None and surged.phase is not Phase.STOPPING:
        state = _retire_one(state, surged, f"cancelled: {move.move_id}", actions)
        note = f"cancelled: {surged.replica_id} retired"
    return _end_move(state, move, MoveState.CANCELLED, now=now, note=note)


def _on_generation_set(state: KeeperState, obs: GenerationSet) -> KeeperState:
    # Replicas already running keep theirs until replaced: they show as outdated.
    return state.model_copy(update={
        "spec": state.spec.model_copy(update={"generation": obs.generation})})


def _advance_moves(state: KeeperState, now: datetime, config: KeeperConfig,
                 actions: list[Action]) -> KeeperState:
    """Advance each running move one step, oldest first."""
    for move in state.moves:
        if move.state is MoveState.RUNNING:
            current = _find_move(state, move.move_id)
            assert current is not None  # moves leave the registry only once ended
            state = _advance_move(state, current, now=now, config=config, actions=actions)
    return state


def _advance_move(state: KeeperState, move: Move, *, now: datetime, config: KeeperConfig,
                actions: list[Action]) -> KeeperState:
    """One step of a running move; see the module docstring ("Moves") for the whole story."""
    target = _find(state, move.replica_id) if move.replica_id else None
    if move.kind is MoveKind.RETIRE or move.stop_first:
        if not move.retire_issued:
            state, move = _retire_target(state, move, target, now=now, config=config,
                                       actions=actions)
        if _find(state, move.replica_id or ReplicaId("")) is not None:
            return state  # the old replica is still stopping (and there is no room for both)
        if move.kind is MoveKind.RETIRE:
            return _end_move(state, move, MoveState.SUCCEEDED, now=now,
                           note=f"{move.replica_id} stopped")
    if move.surged is None:
        if move.room_wait_until is not None:
            if now < move.room_wait_until:
                return state  # room is being made for it (_on_move_unplaceable)
            return _end_move(state, move, MoveState.FAILED, now=now,
                             error="no room: the replicas asked to make room did not free "
                                   f"it within {EVICTION_RECHECK_S:g} s")
        return _place_for_move(state, move, actions)
    surged = _find(state, move.surged)
    if surged is None or surged.phase is not Phase.READY:
        return state  # placing or starting; a failure ends the move (_move_failed)
    if move.kind is MoveKind.SURGE:
        return _end_move(state, move, MoveState.SUCCEEDED,
                       note=f"{surged.replica_id} ready on {', '.join(surged.nodes)}",
                       now=now)
    handed = surged.model_copy(update={"move_id": None})
    if move.stop_first:
        state = _replace(state, handed)
        return _end_move(state, move, MoveState.SUCCEEDED, now=now,
                       note=f"{surged.replica_id} ready on {', '.join(surged.nodes)}")
    if not move.retire_issued:
        # Ready: it counts from now on, and the old one leaves (drained first).
        state = _replace(state, handed)
        move = move.model_copy(update={"detail": _note(
            move, f"{surged.replica_id} ready on {', '.join(surged.nodes)}", now)})
        state, move = _retire_target(state, move, target, now=now, config=config,
                                   actions=actions, why=f"replaced by {surged.replica_id}")
    if _find(state, move.replica_id or ReplicaId("")) is None:
        return _end_move(state, move, MoveState.SUCCEEDED, now=now,
                         note=f"{move.replica_id} stopped")
    return state


def _retire_target(state: KeeperState, move: Move, target: Replica | None, *, now: datetime,
                   config: KeeperConfig, actions: list[Action],
                   why: str | None = None) -> tuple[KeeperState, Move]:
    """Retire the move's replica (unless it is gone already) and note that it was asked; a
    retire that ``balances`` a surge hands that surge's replica over at the same moment,
    so the count the keeper sees does not dip."""
    reason = why or move.move_id
    if move.reason:
        reason = f"{reason} ({move.reason})"
    if target is not None and target.phase is not Phase.STOPPING:
        state = _retire_one(state, target, reason, actions)
    if move.balances is not None:
        state = state.model_copy(update={"replicas": [
            r.model_copy(update={"move_id": None}) if r.move_id == move.balances else r
            for r in state.replicas]})
    move = move.model_copy(update={"retire_issued": True,
                               "detail": _note(move, f"retiring {move.replica_id}", now)})
    return _put_move(state, move), move


def _place_for_move(state: KeeperState, move: Move, actions: list[Action]) -> KeeperState:
    """Place the move's new replica, once no other placement of this deployment is in
    flight (one at a time: each sees the previous one's claims). Move placements skip the
    deployment's backoff and can't-place timers: an operator asked for this one."""
    if any(r.phase is Phase.PLACING for r in state.replicas):
        return state
    replica_id = ReplicaId(f"{state.spec.deployment_id}-r{state.next_replica_seq}")
    actions.append(PlaceReplica(replica_id=replica_id))
    replica = Replica(replica_id=replica_id, phase=Phase.PLACING, move_id=move.move_id,
                      generation=move.generation or state.spec.generation,
                      avoid_nodes=move.avoid_nodes)
    state = state.model_copy(update={"replicas": [*state.replicas, replica],
                                     "next_replica_seq": state.next_replica_seq + 1})
    return _put_move(state, move.model_copy(update={"surged": replica_id}))


def _lease_of(state: KeeperState, replica_id: ReplicaId) -> MoveId | None:
    """The move a replica is leased to: a running move retires or surged it, or a surge
    still holds it."""
    for move in state.moves:
        if move.state is MoveState.RUNNING and replica_id in (move.replica_id, move.surged):
            return move.move_id
    replica = _find(state, replica_id)
    return replica.move_id if replica is not None else None


def _surging(state: KeeperState) -> list[MoveId]:
    """Moves that place (or hold) a replica beyond the desired number."""
    running = [move.move_id for move in state.moves if move.state is MoveState.RUNNING
               and move.kind in (MoveKind.SURGE, MoveKind.REPLACE)]
    holding = {r.move_id for r in state.replicas if r.move_id is not None} - set(running)
    return running + sorted(holding)


def refuse_move(state: KeeperState, request: MoveRequest, config: KeeperConfig) -> str | None:
    """Why the deployment refuses ``request`` (the ``move`` update's validator), or None.

    A retried request (its move id is in the registry with the same kind) is accepted: it
    is answered with the move as it stands, and changes nothing.
    """
    dep = state.spec.deployment_id
    existing = _find_move(state, request.move_id)
    if existing is not None:
        return None if existing.kind is request.kind else (
            f"move_id: {request.move_id} is already a {existing.kind.value} on {dep}")
    if state.deleting:
        return f"deployment {dep} is being deleted; it takes no moves"
    if request.kind in (MoveKind.REPLACE, MoveKind.RETIRE):
        if request.replica_id is None:
            return f"replica_id: required for a {request.kind.value}"
        replica = _find(state, request.replica_id)
        live = [r.replica_id for r in state.replicas
                if r.phase is not Phase.STOPPING and not r.retiring]
        if replica is None or replica.replica_id not in live:
            return (f"replica_id: {request.replica_id} is not a live replica of {dep} "
                    f"(live: {', '.join(live) or 'none'})")
        lease = _lease_of(state, request.replica_id)
        if lease is not None:
            return f"replica_id: {request.replica_id} is leased to move {lease}"
    if request.kind in (MoveKind.SURGE, MoveKind.REPLACE):
        surging = _surging(state)
        if len(surging) >= config.max_surge:
            return (f"{dep} already surges {len(surging)} replica(s) ({', '.join(surging)}); "
                    f"max_surge is {config.max_surge}")
    if request.balances is not None:
        balanced = _find_move(state, request.balances)
        if balanced is None or balanced.kind is not MoveKind.SURGE:
            return f"balances: {request.balances} is not a surge move of {dep}"
    if request.generation is not None and request.generation.number < (
            current_generation(state).number):
        return (f"generation: {request.generation.number} is older than {dep}'s current "
                f"generation {current_generation(state).number}")
    return None


def move_outcome(state: KeeperState, move_id: MoveId) -> MoveOutcome | None:
    """The move as it stands, or None if it is not (or no longer) in the registry."""
    move = _find_move(state, move_id)
    if move is None:
        return None
    return MoveOutcome(move_id=move.move_id, kind=move.kind, state=move.state, surged=move.surged,
                     retired=move.replica_id, error=move.error, started_at=move.started_at,
                     ended_at=move.ended_at, detail=move.detail)


def brief(state: KeeperState) -> DeploymentBrief:
    """The deployment as a saga sees it (the ``brief`` query)."""
    return DeploymentBrief(
        deployment_id=state.spec.deployment_id, desired=state.spec.replicas,
        status=status(state).value, deleting=state.deleting,
        generation=current_generation(state),
        replicas=[ReplicaBrief(replica_id=r.replica_id, phase=r.phase.value, nodes=r.nodes,
                               generation=_generation_of(state, r),
                               move_id=_lease_of(state, r.replica_id))
                  for r in state.replicas])


def placement_note(state: KeeperState) -> str | None:
    """Why replicas of the deployment share a node, if any do (from their placements)."""
    notes = [f"{r.replica_id} {r.placement_note}" for r in state.replicas
             if r.placement_note and r.phase is not Phase.STOPPING]
    return "; ".join(notes) or None


def outdated(state: KeeperState) -> list[ReplicaId]:
    """Replicas running an older generation than the deployment's current one."""
    number = current_generation(state).number
    return [r.replica_id for r in state.replicas
            if r.phase is not Phase.STOPPING and _generation_of(state, r).number < number]


def decide(state: KeeperState, observation: Observation, now: datetime,
           config: KeeperConfig, jitter: float = 0.5) -> tuple[KeeperState, list[Action]]:
    """The keeper's next state and the actions to carry out, after ``observation``."""
    actions: list[Action] = []
    state = _observe(state, observation, now=now, config=config, jitter=jitter,
                     actions=actions)
    state = _reconcile(state, now, config, actions)
    return state, actions


def resume(state: KeeperState) -> list[Action]:
    """Actions that re-establish in-flight work after continue-as-new or a code restart:
    watches are re-opened, probes and stops re-issued, placements and starts asked again
    (both are idempotent per replica id)."""
    actions: list[Action] = []
    for r in state.replicas:
        if r.phase is Phase.PLACING:
            actions.append(PlaceReplica(replica_id=r.replica_id))
        elif r.phase is Phase.STARTING:
            actions.append(StartReplica(replica_id=r.replica_id))
        elif r.phase is Phase.READY:
            actions.append(WatchReplica(replica_id=r.replica_id))
        elif r.phase is Phase.UNREACHABLE:
            actions.append(ProbeReplica(replica_id=r.replica_id))
        elif r.phase is Phase.SLEEPING:
            # Sleep and wake are idempotent on the agent: one in flight is asked again.
            actions.append(WatchReplica(replica_id=r.replica_id))
            if not r.asleep:
                actions.append(SleepReplica(replica_id=r.replica_id,
                                            reason=r.stop_reason or "sleeping"))
        elif r.phase is Phase.WAKING:
            actions.append(WatchReplica(replica_id=r.replica_id))
            actions.append(WakeReplica(replica_id=r.replica_id, reason="waking"))
        elif r.phase is Phase.STOPPING:
            actions.append(StopReplica(replica_id=r.replica_id,
                                       reason=r.stop_reason or "stopping"))
    return actions


def next_wake(state: KeeperState, config: KeeperConfig) -> datetime | None:
    """When the keeper must be stepped again with a Tick if nothing else happens."""
    times: list[datetime] = []
    attempt = _next_attempt(state)
    placing = any(r.phase is Phase.PLACING for r in state.replicas)
    # While a placement is out, its answer (not a timer) is what wakes the keeper; a timer
    # already past would otherwise wake the workflow in a loop until it lands.
    short = (len(_counted(state)) < state.spec.replicas
             or len(_standbys(state)) < _standby_wanted(state))
    if attempt is not None and not placing and short and not state.parked \
            and not state.deleting:
        times.append(attempt)
    if state.seek_again_at is not None and not state.seeking_room:
        times.append(state.seek_again_at)
    times.extend(m.room_wait_until for m in state.moves
                 if m.state is MoveState.RUNNING and m.room_wait_until is not None)
    for r in state.replicas:
        if r.phase is Phase.UNREACHABLE and r.unreachable_since is not None:
            times.append(r.unreachable_since + timedelta(seconds=config.lost_after_s))
            if r.next_probe_at is not None and not r.probe_in_flight:
                times.append(r.next_probe_at)
    return min(times) if times else None


def waiting_for_room(state: KeeperState) -> bool:
    """Whether a room watch should be running: a placement found no room
    and nothing since has placed one, the deployment still wants more replicas than it
    has, and neither a delete nor parking stopped it from placing. A placement in flight
    (a node change's, the backstop's) does not end the wait: if it finds no room the watch
    goes on as it was, and a watch cancelled and started again costs history events.
    """
    if state.placement_error is None:
        return False
    if state.deleting or state.parked or state.finished:
        return False
    settled = [r for r in _counted(state) if r.phase is not Phase.PLACING]
    return len(settled) < state.spec.replicas


def room_watch_start(state: KeeperState) -> int | None:
    """Whether to start a room watch now, where none runs: the count of placements in a
    row that found no room, which its schedule starts from (:func:`room_watch_wait_s`);
    None when the deployment is not waiting for room, or while a placement is in flight:
    its answer may place the replica, or add one to the count the watch starts from.
    """
    if not waiting_for_room(state):
        return None
    if any(r.phase is Phase.PLACING for r in state.replicas):
        return None
    return state.unplaceable_in_a_row


def room_watch_goes_on(state: KeeperState, started_from: int) -> bool:
    """Whether a room watch started from the count ``started_from`` should keep running:
    the deployment still waits for room, and no operator's retry has reset the count
    since (every wait starts over then, the watch's too: it is started again from 0)."""
    return waiting_for_room(state) and state.unplaceable_in_a_row >= started_from


def status(state: KeeperState) -> DeploymentStatus:
    """The deployment's status for operators; the first that applies of deleting, parked,
    stopped, serving, degraded, starting, cant_place, placing.
    """
    if state.deleting:
        return DeploymentStatus.DELETING
    if state.parked:
        return DeploymentStatus.PARKED
    if state.spec.replicas == 0:
        # Nothing wanted; a replica still stopping shows as stopping in the replica list.
        # On demand, that is idle: a request loads it. Otherwise deliberately off.
        return (DeploymentStatus.IDLE if policy_of(state).on_demand
                else DeploymentStatus.STOPPED)
    ready = _ready(state)
    live = _live(state)
    asleep = sum(1 for r in live if r.phase is Phase.SLEEPING)
    if ready >= state.spec.replicas or (ready >= 1
                                        and ready + asleep >= state.spec.replicas):
        # Slept replicas count: they are kept on purpose, and a request wakes them.
        return DeploymentStatus.SERVING
    if ready == 0 and asleep and asleep == len(live):
        return DeploymentStatus.SLEEPING
    if state.loading_since is not None and ready == 0:
        # Asked for: loading, or waking; while room is being made for it (an eviction),
        # still loading; with no way to room, cant_place and the reason.
        return (DeploymentStatus.CANT_PLACE
                if state.placement_error is not None and not _room_on_its_way(state)
                else DeploymentStatus.LOADING)
    if any(r.phase is Phase.UNREACHABLE for r in state.replicas):
        # Routed around, and placing or starting a replacement, or waiting for it to be
        # vouched for or lost: the replicas that were serving are not all serving.
        return DeploymentStatus.DEGRADED
    if any(r.phase is Phase.STARTING for r in state.replicas):
        return DeploymentStatus.STARTING
    if state.placement_error is not None:
        return DeploymentStatus.CANT_PLACE
    return DeploymentStatus.PLACING


def stored_state(replica: Replica) -> ReplicaState | None:
    """How a replica's phase is written to the store; None for PLACING (no row yet). A
    replica falling asleep is draining (out of routing, its requests finishing, then its
    engine put to sleep) until it sleeps: ``sleeping`` says the engine is asleep."""
    if replica.phase is Phase.SLEEPING and not replica.asleep:
        return ReplicaState.DRAINING
    return {
        Phase.PLACING: None,
        Phase.STARTING: ReplicaState.STARTING,
        Phase.READY: ReplicaState.READY,
        Phase.UNREACHABLE: ReplicaState.UNREACHABLE,
        Phase.STOPPING: ReplicaState.STOPPING,
        Phase.SLEEPING: ReplicaState.SLEEPING,
        Phase.WAKING: ReplicaState.SLEEPING,
    }[replica.phase]


# -- what the deployment shows outside the store -------------------------------------------


class Overview(Frozen):
    """The numbers a deployment publishes as search attributes, so an operator can list
    deployments by them (``temporal workflow list --query "NodeIds='n1'"``)."""

    status: DeploymentStatus
    ready: int
    desired: int
    #: Every node holding a claim of this deployment (a replica placed, starting, ready,
    #: unreachable or stopping), sorted: the deployments a node's drain or loss touches.
    node_ids: list[NodeId]


def overview(state: KeeperState) -> Overview:
    """The deployment's published numbers."""
    return Overview(status=status(state), ready=_ready(state),
                    desired=state.spec.replicas,
                    node_ids=sorted({n for r in state.replicas for n in r.nodes}))


#: A placement error names the closest nodes with their numbers (up to 4 KB); the web UI's
#: details show the start of it, and the store and `explain` keep the whole.
DETAILS_REASON_CHARS = 300


def details(state: KeeperState) -> str:
    """A short markdown summary of the deployment for the Temporal web UI's current
    details: status, ready/desired, each replica with its phase and nodes, and the last
    failure and placement error (each cut to ``DETAILS_REASON_CHARS``)."""
    view = overview(state)
    runs = current_generation(state)
    lines = [f"**{view.status.value}**: {view.ready}/{view.desired} ready, "
             f"model `{state.spec.model_id}`"
             + (f" running `{runs.model_id}` (generation {runs.number})"
                if state.spec.generation is not None else "")]
    if state.replicas:
        stale = set(outdated(state))
        lines += ["", "| replica | phase | nodes |", "|---|---|---|"]
        lines += [f"| {r.replica_id} | {r.phase.value}{' (retiring)' if r.retiring else ''}"
                  f"{' (standby)' if r.standby else ''}"
                  f"{' (relaunching in place)' if r.relaunching else ''}"
                  f"{' (outdated)' if r.replica_id in stale else ''}"
                  f"{f' (move {r.move_id})' if r.move_id else ''}"
                  f" | {', '.join(r.nodes) or '-'} |" for r in state.replicas]
    if any(r.phase in (Phase.STARTING, Phase.WAKING) for r in state.replicas):
        # The workflow does not hear a start's progress (its agent reports it to the API):
        # say where it shows rather than let "starting" stand alone.
        lines += ["", "Start progress (download, place in the node's start-up queue): "
                  "`modelkeeper ls`, GET /deployments/{id} (replicas[].progress), and the "
                  "pending start_shard activity's heartbeat details below."]
    running = [move for move in state.moves if move.state is MoveState.RUNNING]
    if running:
        lines += ["", "Moves: " + "; ".join(
            f"{move.kind.value} {move.replica_id or ''} ({move.move_id})".replace("  ", " ")
            for move in running)]
    policy = policy_of(state)
    if state.spec.scaling is not None or state.window is not None:
        lines += ["", f"Scaling: min {policy.min_replicas}, max {policy.max_replicas}"
                  + (f", idle stop after {policy.idle_timeout_s:g} s"
                     if policy.idle_timeout_s else "")
                  + (f", sleep after {policy.sleep_after_s:g} s"
                     if policy.sleep_after_s else "")
                  + (f", {policy.warm_standby} warm standby" if policy.warm_standby else "")
                  + (f" (window {state.window.name})" if state.window else "")]
    for label, text in (("Loading", state.loading_reason), ("Demand", state.demand_note),
                        ("Can't place", state.placement_error),
                        ("Last failure", state.last_failure)):
        if text:
            cut = text if len(text) <= DETAILS_REASON_CHARS else (
                text[:DETAILS_REASON_CHARS] + "...")
            lines += ["", f"{label}: {cut}"]
    return "\n".join(lines)
