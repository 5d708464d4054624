"""A simulated cluster that carries out the actions of many deployments' keepers.

Each deployment has its own ``KeeperState``, stepped with ``keeper.decide`` exactly as the
workflow steps it: an observation in, actions out. The cluster carries the actions out the
way the real system does, with delays:

* ``PlaceReplica``: after a short delay, ``placement.place`` runs over the nodes and every
  claim in the cluster (a stopping replica's claims included, until its stop completes).
  A placement makes its claim at that instant, in one step, like the real one-transaction
  placement; the ``Placed`` (or ``Unplaceable``) reaches the keeper later.
* ``StartReplica``: the engine loads for a while, then ``Started``, or ``StartFailed``
  (sometimes at random; always when a node of the replica went away meanwhile).
* ``WatchReplica``: the watch reports ``Exited`` when the engine dies, ``Silent`` when a
  node of the replica stops heartbeating (crashed or cut off).
* ``ProbeReplica``: after a delay: ``None`` while a node is away, else whether the engine
  still runs.
* ``StopReplica``: the engine is stopped at once (its start or watch cancelled); after a
  delay the claims are released, every keeper hears ``NodesChanged`` (memory freed) and
  this one hears ``Stopped``.
* ``Finish``: the deployment is removed; later observations for it go nowhere.

A node that crashes loses its engines but not its claims: only the keeper's stop releases
them, as in reality. Every observation reaches its keeper after a random lag, so results
for different replicas may arrive out of order. Time is event-driven: nothing happens
between events, a keeper is ticked exactly when ``next_wake`` says, and the only source of
randomness is the ``random.Random`` passed in.

``check_step`` (one decide's state and actions) and ``Sim.check_cluster`` (the whole
cluster) are the invariants; the simulation runs them after every event. An unreachable replica does
not count toward the desired number, so there may be as many more replicas as there are
unreachable ones, and never more.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from modelkeeper.domain import keeper
from modelkeeper.domain.ids import DeploymentId, ModelId, NodeId, ReplicaId
from modelkeeper.domain.keeper import (
    LIVE_PHASES,
    Action,
    Delete,
    DeploymentSpec,
    Exited,
    Finish,
    KeeperConfig,
    KeeperState,
    NodesChanged,
    Observation,
    Phase,
    Placed,
    PlacementCrashed,
    PlaceReplica,
    ProbeReplica,
    ProbeResult,
    RelaunchReplica,
    Retry,
    Scale,
    Silent,
    Started,
    StartFailed,
    StartReplica,
    Stopped,
    StopReplica,
    Tick,
    Unplaceable,
    WatchReplica,
    decide,
    next_wake,
)
from modelkeeper.domain.placement import NodeState, NodeView, Placement, PlacementRequest, place
from modelkeeper.domain.status import DeploymentStatus
from modelkeeper.domain.units import GIB

T0 = datetime(2026, 1, 1, tzinfo=UTC)

#: Scale-down retires the least useful first: not yet serving, then unreachable, then ready.
RETIRE_ORDER = {Phase.PLACING: -1, Phase.STARTING: 0, Phase.UNREACHABLE: 1, Phase.READY: 2}


class InvariantError(AssertionError):
    """An invariant broke; the message says which, where and when."""


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def seq(replica_id: str) -> int:
    tail = replica_id.rsplit("-r", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def live(state: KeeperState) -> list[keeper.Replica]:
    # A replica scaled away while its placement was in flight is already on its way out
    # (it is stopped the moment it lands), like a STOPPING one.
    return [r for r in state.replicas if r.phase in LIVE_PHASES and not r.retiring]


def count(state: KeeperState, *phases: Phase) -> int:
    return sum(1 for r in state.replicas if r.phase in phases)


def allowed(state: KeeperState, config: KeeperConfig | None) -> int:
    """How many live replicas the spec allows: desired, plus (surging) the unreachable."""
    return state.spec.replicas + count(state, Phase.UNREACHABLE)


# -- invariants of one state and one decide -----------------------------------------------


def check_state(state: KeeperState, where: str = "",
                config: KeeperConfig | None = None) -> None:
    """What must hold of every state decide returns, whatever it was fed."""
    ids = [r.replica_id for r in state.replicas]
    if len(set(ids)) != len(ids):
        _fail(f"{where}: duplicate replica ids {ids}")
    placing = count(state, Phase.PLACING)
    if placing > 1:
        _fail(f"{where}: {placing} replicas placing at once")
    # Live replicas never exceed the spec (surging: the spec plus one replacement per
    # unreachable replica). A placement on its way when the spec shrank cannot be stopped
    # before it lands; it is marked retiring and no longer counts.
    n_live, desired = len(live(state)), state.spec.replicas
    if n_live > allowed(state, config):
        _fail(f"{where}: {n_live} live replicas, spec asks {desired} ({placing} placing, "
              f"{count(state, Phase.UNREACHABLE)} unreachable)")
    if count(state, Phase.UNREACHABLE) and count(state, Phase.READY) >= desired:
        _fail(f"{where}: an unreachable replica kept though {desired} are ready without it")
    if state.finished and state.replicas:
        _fail(f"{where}: finished with replicas {ids}")
    if state.finished and not state.deleting:
        _fail(f"{where}: finished without being deleted")
    if any(seq(i) >= state.next_replica_seq for i in ids):
        _fail(f"{where}: a replica id at or past next_replica_seq {state.next_replica_seq}")
    for r in state.replicas:
        if r.phase is Phase.UNREACHABLE and r.unreachable_since is None:
            _fail(f"{where}: {r.replica_id} unreachable without unreachable_since")
        if r.phase in (Phase.STARTING, Phase.READY, Phase.UNREACHABLE) and not r.nodes:
            _fail(f"{where}: {r.replica_id} {r.phase} without nodes")
        if r.retiring and r.phase is not Phase.PLACING:
            # Scaled away in flight: stopped the moment it lands (and then no longer
            # retiring), never left running uncounted.
            _fail(f"{where}: {r.replica_id} retiring in phase {r.phase}")


def check_step(before: KeeperState, obs: Observation, after: KeeperState,
               actions: list[Action], where: str = "",
               config: KeeperConfig | None = None) -> None:
    """What must hold of one decide: the state's invariants, and every action matching
    the state it leaves (so the cluster and the keeper never disagree about a replica)."""
    check_state(after, where, config)
    if before.finished:
        if actions or after.replicas or not after.finished:
            _fail(f"{where}: a finished keeper acted: {actions}")
        return
    old = {r.replica_id: r for r in before.replicas}
    new = {r.replica_id: r for r in after.replicas}
    touched = [a.replica_id for a in actions if not isinstance(a, Finish)]
    if len(set(touched)) != len(touched):
        _fail(f"{where}: two actions for one replica: {actions}")
    obs_rid = getattr(obs, "replica_id", None)
    for a in actions:
        if isinstance(a, Finish):
            if not after.finished or after.replicas or not after.deleting:
                _fail(f"{where}: Finish with replicas {list(new)}")
            continue
        r, was = new.get(a.replica_id), old.get(a.replica_id)
        if r is None:
            _fail(f"{where}: {a!r} for a replica not in the state")
            continue
        if isinstance(a, PlaceReplica):
            if was is not None or r.phase is not Phase.PLACING:
                _fail(f"{where}: placing {a.replica_id} twice or in phase {r.phase}")
            if any(p.phase is Phase.PLACING and p.replica_id != a.replica_id
                   for p in after.replicas):
                _fail(f"{where}: placing {a.replica_id} while another placement is out")
            if after.deleting or after.parked:
                _fail(f"{where}: placing while deleting or parked")
            if a.replica_id in old or seq(a.replica_id) < before.next_replica_seq:
                _fail(f"{where}: replica id {a.replica_id} reused")
        elif isinstance(a, StartReplica):
            if r.phase is not Phase.STARTING or was is None or was.phase is not Phase.PLACING:
                _fail(f"{where}: start of {a.replica_id} leaves it {r.phase}")
            if after.deleting:
                _fail(f"{where}: start of {a.replica_id} while deleting")
        elif isinstance(a, RelaunchReplica):
            # Only a ready replica's exit, on one node, back to starting in its claim.
            if r.phase is not Phase.STARTING or not r.relaunching or was is None \
                    or was.phase is not Phase.READY or not isinstance(obs, Exited) \
                    or obs_rid != a.replica_id or len(r.nodes) != 1:
                _fail(f"{where}: relaunch of {a.replica_id} from {was and was.phase} on "
                      f"{obs!r}")
            if after.deleting:
                _fail(f"{where}: relaunch of {a.replica_id} while deleting")
        elif isinstance(a, WatchReplica):
            if r.phase is not Phase.READY or was is None or was.phase not in (
                    Phase.STARTING, Phase.UNREACHABLE):
                _fail(f"{where}: watch of {a.replica_id} leaves it {r.phase}")
        elif isinstance(a, ProbeReplica):
            if r.phase is not Phase.UNREACHABLE or not r.probe_in_flight:
                _fail(f"{where}: probe of {a.replica_id} leaves it {r.phase}")
            if was is None or (was.phase is Phase.UNREACHABLE and was.probe_in_flight):
                _fail(f"{where}: a second probe of {a.replica_id} while one is out")
        elif isinstance(a, StopReplica):
            if r.phase is not Phase.STOPPING or was is None or was.phase is Phase.STOPPING:
                _fail(f"{where}: stop of {a.replica_id}: was {was and was.phase}, "
                      f"now {r.phase}")
            elif was.phase is Phase.PLACING and not (
                    isinstance(obs, Placed) and obs_rid == a.replica_id):
                # Only a placement that just answered may be stopped: before that there
                # is no claim to release, and the claim made meanwhile would leak.
                _fail(f"{where}: stop of {a.replica_id} before its placement answered")
            elif a.reason == "replaced while unreachable" and (
                    was.phase is not Phase.UNREACHABLE
                    or count(after, Phase.READY) < after.spec.replicas):
                _fail(f"{where}: {a.replica_id} ({was.phase}) retired as replaced, with "
                      f"{count(after, Phase.READY)} of {after.spec.replicas} ready")
            elif a.reason.startswith("not needed") and (
                    was.phase is Phase.READY
                    or not ((isinstance(obs, ProbeResult) and obs.running is True)
                            or (was.retiring and was.stop_reason == a.reason))):
                # Keep one of two: the original vouched for is kept over a replacement
                # that is not yet ready (one still placing is stopped when it lands).
                _fail(f"{where}: {a.replica_id} ({was.phase}) retired as not needed on "
                      f"{obs!r}")
    acted = {a.replica_id for a in actions if not isinstance(a, Finish)}
    for rid, was in old.items():
        r = new.get(rid)
        if r is None:
            # Only a stop that completed, or a placement that claimed nothing, may go.
            gone_ok = (was.phase is Phase.STOPPING and isinstance(obs, Stopped)) or (
                was.phase is Phase.PLACING and isinstance(obs, Unplaceable | PlacementCrashed))
            if not (gone_ok and obs_rid == rid):
                _fail(f"{where}: {rid} ({was.phase}) forgotten on {obs!r}")
        elif r.phase is Phase.STOPPING and was.phase is not Phase.STOPPING and rid not in acted:
            _fail(f"{where}: {rid} stopping without a StopReplica")
        elif was.phase is Phase.STOPPING and r.phase is not Phase.STOPPING:
            _fail(f"{where}: {rid} came back from stopping to {r.phase}")
    for rid in new:
        if rid not in old and not any(
                isinstance(a, PlaceReplica) and a.replica_id == rid for a in actions):
            _fail(f"{where}: {rid} appeared without a PlaceReplica")
    # Scale-down retires the least useful first; a replica kept is never less useful
    # than one retired.
    retired = [old[a.replica_id] for a in actions
               if isinstance(a, StopReplica) and a.reason == "scaled down"]
    kept = [r for r in after.replicas if r.phase in RETIRE_ORDER and not r.retiring]
    for gone in retired:
        for r in kept:
            if (RETIRE_ORDER[r.phase], -seq(r.replica_id)) < (
                    RETIRE_ORDER[gone.phase], -seq(gone.replica_id)):
                _fail(f"{where}: scale-down retired {gone.replica_id} ({gone.phase}) "
                      f"and kept {r.replica_id} ({r.phase})")


def check_wake(state: KeeperState, config: KeeperConfig, later: datetime,
               where: str = "") -> None:
    """``next_wake`` announces everything that comes due: a tick at ``later`` acts only if
    ``next_wake`` said to wake by then."""
    if state.finished:
        return
    wake = next_wake(state, config)
    _, actions = decide(state, Tick(), later, config, 0.5)
    if actions and (wake is None or wake > later):
        _fail(f"{where}: a tick at {later} acts ({actions}) but next_wake says {wake}")


def check_no_spin(state: KeeperState, now: datetime, config: KeeperConfig,
                  where: str = "") -> None:
    """After a decide at ``now`` everything due by ``now`` is done, so ``next_wake`` must
    lie in the future: the workflow sleeps ``max(wake - now, 1 ms)``, and a wake that has
    passed would wake it in a loop (as one did while a placement was out)."""
    wake = next_wake(state, config)
    if not state.finished and wake is not None and wake <= now:
        _fail(f"{where}: next_wake {wake} is not after now {now}: the workflow would spin")


# -- the cluster --------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A model's size and how many nodes one replica spans."""

    name: str
    memory_gib: float
    min_nodes: int = 1


@dataclass
class Knobs:
    """Delays and failure rates of the simulated cluster (seconds, probabilities)."""

    lag_s: tuple[float, float] = (0.0, 1.0)  # an observation reaches its keeper
    place_s: tuple[float, float] = (0.0, 2.0)  # placement runs after
    #: Sometimes placement is slow (a database blip, the settling window): meanwhile
    #: other replicas fail, get scaled away or the deployment is deleted.
    slow_place_p: float = 0.05
    slow_place_s: tuple[float, float] = (10.0, 120.0)
    placement_crash_p: float = 0.02
    start_s: tuple[float, float] = (5.0, 60.0)
    start_fail_p: float = 0.1
    stop_s: tuple[float, float] = (0.5, 5.0)
    probe_s: tuple[float, float] = (0.2, 2.0)
    heartbeat_s: tuple[float, float] = (2.0, 4.0)  # a silent node is noticed after
    #: A cancelled start still reports its (now stale) result with this probability.
    late_result_p: float = 0.3


@dataclass
class SimNode:
    node_id: NodeId
    total: int
    state: NodeState = NodeState.READY
    claimed: int = 0


@dataclass
class Claim:
    deployment_id: DeploymentId
    shards: list[tuple[NodeId, int]]

    @property
    def node_ids(self) -> list[NodeId]:
        return [n for n, _ in self.shards]


@dataclass
class Engine:
    deployment_id: DeploymentId
    nodes: list[NodeId]
    status: str = "starting"  # starting | running | dead | stopped
    watched: bool = False


@dataclass
class Dep:
    deployment_id: DeploymentId
    model: Model
    state: KeeperState
    wake: datetime | None = None
    places: int = 0
    cant_places: int = 0
    node_changes: int = 0
    actions: int = 0


@dataclass
class Stats:
    events: int = 0
    steps: int = 0
    dropped: int = 0
    placed: int = 0
    cant_place: int = 0
    started: int = 0
    start_failed: int = 0
    exited: int = 0
    silent: int = 0
    lost: int = 0  # replicas given up on after they had served
    relaunched: int = 0  # engines relaunched in place (modelkeeper.domain.relaunch)
    adopted: int = 0  # unreachable replicas taken back when their agent vouched
    ignored: int = 0  # observations that changed nothing (late, stale or not ours)
    placed_while_deleting: int = 0
    #: Replacements placed beside an unreachable replica.
    surged: int = 0
    #: Keep one of two: the unreachable original retired for a ready replacement, or a
    #: replacement not yet ready retired because the original was vouched for.
    kept_replacement: int = 0
    kept_original: int = 0
    stopped: int = 0
    finished: int = 0
    parked: int = 0
    faults: dict[str, int] = field(default_factory=dict)


class Sim:
    """Nodes, claims, engines and keepers, stepped event by event."""

    #: A livelock guard: this many events at one instant means something spins.
    MAX_AT_ONE_INSTANT = 5_000

    def __init__(self, rng: random.Random, nodes: dict[str, float],
                 config: KeeperConfig | None = None, knobs: Knobs | None = None) -> None:
        self.rng = rng
        self.config = config or KeeperConfig()
        self.knobs = knobs or Knobs()
        self.now = T0
        self.nodes = {NodeId(n): SimNode(NodeId(n), int(gib * GIB)) for n, gib in nodes.items()}
        self.claims: dict[ReplicaId, Claim] = {}
        self.engines: dict[ReplicaId, Engine] = {}
        self.deps: dict[DeploymentId, Dep] = {}
        self.done: dict[DeploymentId, Dep] = {}  # finished and removed
        self.stats = Stats()
        self._queue: list[tuple[datetime, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._names = itertools.count(1)
        self._same_instant = 0

    # -- time ---------------------------------------------------------------------------

    def at(self, when: datetime, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn, args))

    def after(self, span: tuple[float, float], fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + timedelta(seconds=self.rng.uniform(*span)), fn, *args)

    def run_until(self, until: datetime) -> None:
        while self._queue and self._queue[0][0] <= until:
            when, _, fn, args = heapq.heappop(self._queue)
            self._same_instant = self._same_instant + 1 if when == self.now else 0
            if self._same_instant > self.MAX_AT_ONE_INSTANT:
                _fail(f"{when}: {self._same_instant} events at one instant (livelock)")
            self.now = when
            self.stats.events += 1
            fn(*args)
            self.check_cluster()
        self.now = max(self.now, until)

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + timedelta(seconds=seconds))

    def elapsed(self) -> float:
        return (self.now - T0).total_seconds()

    # -- operators ----------------------------------------------------------------------

    def deploy(self, model: Model, replicas: int) -> DeploymentId:
        dep_id = DeploymentId(f"{model.name}-{next(self._names)}")
        spec = DeploymentSpec(deployment_id=dep_id, model_id=ModelId(model.name),
                              replicas=replicas, min_nodes=model.min_nodes)
        self.deps[dep_id] = Dep(dep_id, model, KeeperState(spec=spec))
        self.step(dep_id, Tick())  # the workflow's first run
        return dep_id

    def delete(self, dep_id: DeploymentId) -> None:
        self.step(dep_id, Delete())  # signals reach the workflow at once

    def scale(self, dep_id: DeploymentId, replicas: int) -> None:
        self.step(dep_id, Scale(replicas=replicas))

    def retry(self, dep_id: DeploymentId) -> None:
        self.step(dep_id, Retry())

    # -- the keeper ---------------------------------------------------------------------

    def deliver(self, dep_id: DeploymentId, obs: Observation) -> None:
        """The observation reaches the keeper after the cluster's lag."""
        self.after(self.knobs.lag_s, self.step, dep_id, obs)

    def step(self, dep_id: DeploymentId, obs: Observation) -> None:
        dep = self.deps.get(dep_id)
        if dep is None:
            self.stats.dropped += 1  # the workflow has ended
            return
        before = dep.state
        after, actions = decide(before, obs, self.now, self.config, self.rng.random())
        self.stats.steps += 1
        where = f"t={self.elapsed():.1f}s {dep_id} on {obs!r}"
        check_step(before, obs, after, actions, where, self.config)
        dep.state = after
        dep.actions += len(actions)
        if isinstance(obs, NodesChanged):
            dep.node_changes += 1
        self._count(before, obs, after, actions)
        for action in actions:
            self._carry_out(dep, action)
        if dep_id in self.deps:
            self._schedule_wake(dep)

    def _count(self, before: KeeperState, obs: Observation, after: KeeperState,
               actions: list[Action]) -> None:
        s = self.stats
        if after.parked and not before.parked:
            s.parked += 1
        if after == before and not actions and not isinstance(obs, Tick | NodesChanged):
            s.ignored += 1
        was = {r.replica_id: r.phase for r in before.replicas}
        for a in actions:
            if isinstance(a, PlaceReplica) and len(live(after)) > after.spec.replicas:
                s.surged += 1
            if isinstance(a, StopReplica) and a.reason == "replaced while unreachable":
                s.kept_replacement += 1
            elif isinstance(a, StopReplica) and a.reason.startswith("not needed"):
                s.kept_original += 1
            elif isinstance(a, StopReplica) and a.reason.startswith("lost"):
                s.lost += 1
            elif isinstance(a, StopReplica) and was.get(a.replica_id) is Phase.PLACING:
                s.placed_while_deleting += 1
            elif isinstance(a, WatchReplica) and was.get(a.replica_id) is Phase.UNREACHABLE:
                s.adopted += 1

    def _schedule_wake(self, dep: Dep) -> None:
        wake = next_wake(dep.state, self.config)
        check_no_spin(dep.state, self.now, self.config,
                      f"t={self.elapsed():.1f}s {dep.deployment_id}")
        if wake is not None and wake != dep.wake:
            dep.wake = wake
            self.at(wake, self._tick, dep.deployment_id, wake)
        elif wake is None:
            dep.wake = None

    def _tick(self, dep_id: DeploymentId, wake: datetime) -> None:
        dep = self.deps.get(dep_id)
        if dep is None or dep.wake != wake:
            return  # superseded
        dep.wake = None
        self.step(dep_id, Tick())

    def _carry_out(self, dep: Dep, action: Action) -> None:
        if isinstance(action, PlaceReplica):
            dep.places += 1
            slow = self.rng.random() < self.knobs.slow_place_p
            self.after(self.knobs.slow_place_s if slow else self.knobs.place_s, self._place,
                       dep.deployment_id, action.replica_id)
        elif isinstance(action, StartReplica):
            self._start(dep.deployment_id, action.replica_id)
        elif isinstance(action, RelaunchReplica):
            # A start in the claim the replica holds: a new engine there.
            self.stats.relaunched += 1
            self._start(dep.deployment_id, action.replica_id)
        elif isinstance(action, WatchReplica):
            self._watch(dep.deployment_id, action.replica_id)
        elif isinstance(action, ProbeReplica):
            self.after(self.knobs.probe_s, self._probe, dep.deployment_id, action.replica_id)
        elif isinstance(action, StopReplica):
            self._stop(dep.deployment_id, action.replica_id)
        elif isinstance(action, Finish):
            self._finish(dep)
        else:  # pragma: no cover
            _fail(f"unknown action {action!r}")

    # -- the cluster carrying out actions ------------------------------------------------

    def node_views(self) -> list[NodeView]:
        return [NodeView(node_id=n.node_id, name=n.node_id, state=n.state,
                         memory_total_bytes=n.total, memory_claimed_bytes=n.claimed)
                for n in self.nodes.values()]

    def request(self, dep: Dep) -> PlacementRequest:
        return PlacementRequest(model_id=dep.state.spec.model_id,
                                memory_bytes=int(dep.model.memory_gib * GIB),
                                min_nodes=dep.model.min_nodes)

    def _place(self, dep_id: DeploymentId, rid: ReplicaId) -> None:
        dep = self.deps.get(dep_id)
        if dep is None:
            _fail(f"placement of {rid} ran after {dep_id} finished")
            return
        if rid in self.claims:
            _fail(f"{rid} placed twice")
        if self.rng.random() < self.knobs.placement_crash_p:
            self.deliver(dep_id, PlacementCrashed(replica_id=rid, error="database down"))
            return
        result = place(self.request(dep), self.node_views())
        if isinstance(result, Placement):
            # One transaction: the claim exists from this instant.
            shards = [(a.node_id, a.memory_bytes) for a in result.assignments]
            self.claims[rid] = Claim(dep_id, shards)
            for node_id, size in shards:
                self.nodes[node_id].claimed += size
            self.stats.placed += 1
            self.deliver(dep_id, Placed(replica_id=rid, nodes=result.node_ids))
        else:
            dep.cant_places += 1
            self.stats.cant_place += 1
            self.deliver(dep_id, Unplaceable(replica_id=rid, reason=result.summary))

    def _reachable(self, nodes: Iterable[NodeId]) -> bool:
        return all(self.nodes[n].state is NodeState.READY for n in nodes)

    def _start(self, dep_id: DeploymentId, rid: ReplicaId) -> None:
        claim = self.claims.get(rid)
        if claim is None:
            _fail(f"start of {rid}, which holds no claim")
            return
        engine = Engine(dep_id, claim.node_ids)
        if not self._reachable(engine.nodes):
            engine.status = "dead"  # the start cannot reach the node
        self.engines[rid] = engine
        fails = self.rng.random() < self.knobs.start_fail_p
        self.after(self.knobs.start_s, self._started, dep_id, rid, engine, fails)

    def _started(self, dep_id: DeploymentId, rid: ReplicaId, engine: Engine,
                 fails: bool) -> None:
        if self.engines.get(rid) is not engine:
            return
        if engine.status == "stopped":
            # Cancelled by a stop; the activity's stale result may still come through.
            if self.rng.random() < self.knobs.late_result_p:
                self.deliver(dep_id, Started(replica_id=rid, endpoint=f"http://{rid}")
                             if not fails else StartFailed(replica_id=rid, error="cancelled"))
            return
        if engine.status == "dead" or not self._reachable(engine.nodes):
            engine.status = "dead"
            self.stats.start_failed += 1
            self.deliver(dep_id, StartFailed(replica_id=rid, error="start timed out"))
        elif fails:
            engine.status = "dead"
            self.stats.start_failed += 1
            self.deliver(dep_id, StartFailed(replica_id=rid, error="engine exited 1"))
        else:
            engine.status = "running"
            self.stats.started += 1
            self.deliver(dep_id, Started(replica_id=rid, endpoint=f"http://{rid}"))

    def _watch(self, dep_id: DeploymentId, rid: ReplicaId) -> None:
        engine = self.engines.get(rid)
        if engine is None or engine.status in ("starting", "stopped"):
            _fail(f"watch of {rid}, whose engine is {engine and engine.status}")
            return
        engine.watched = True
        if not self._reachable(engine.nodes):
            self._silence(dep_id, rid, engine)
        elif engine.status == "dead":
            engine.watched = False
            self.stats.exited += 1
            self.deliver(dep_id, Exited(replica_id=rid, detail="exited before the watch"))

    def _silence(self, dep_id: DeploymentId, rid: ReplicaId, engine: Engine) -> None:
        engine.watched = False
        self.stats.silent += 1
        self.after(self.knobs.heartbeat_s, self.deliver, dep_id, Silent(replica_id=rid))

    def _probe(self, dep_id: DeploymentId, rid: ReplicaId) -> None:
        engine = self.engines.get(rid)
        running: bool | None
        if engine is None:
            running = False
        elif not self._reachable(engine.nodes):
            running = None
        else:
            running = engine.status == "running"
        self.deliver(dep_id, ProbeResult(replica_id=rid, running=running))

    def _stop(self, dep_id: DeploymentId, rid: ReplicaId) -> None:
        engine = self.engines.get(rid)
        if engine is not None and engine.status != "dead":
            engine.status = "stopped"  # a start or watch in progress is cancelled
        if engine is not None:
            engine.watched = False
        self.after(self.knobs.stop_s, self._stop_done, dep_id, rid)

    def _stop_done(self, dep_id: DeploymentId, rid: ReplicaId) -> None:
        claim = self.claims.pop(rid, None)
        self.engines.pop(rid, None)
        self.stats.stopped += 1
        if claim is not None:
            for node_id, size in claim.shards:
                self.nodes[node_id].claimed -= size
            self.broadcast_nodes_changed()  # memory freed
        self.deliver(dep_id, Stopped(replica_id=rid))

    def _finish(self, dep: Dep) -> None:
        held = [r for r, c in self.claims.items() if c.deployment_id == dep.deployment_id]
        if held:
            _fail(f"{dep.deployment_id} finished holding claims {held}")
        self.stats.finished += 1
        del self.deps[dep.deployment_id]
        self.done[dep.deployment_id] = dep

    def broadcast_nodes_changed(self) -> None:
        for dep_id in self.deps:
            self.deliver(dep_id, NodesChanged())

    # -- faults -------------------------------------------------------------------------

    def _fault(self, kind: str) -> None:
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1

    def kill_engine(self, rid: ReplicaId) -> None:
        engine = self.engines[rid]
        if engine.status != "running":
            return
        self._fault("engine_killed")
        engine.status = "dead"
        if engine.watched:
            engine.watched = False
            self.stats.exited += 1
            self.deliver(engine.deployment_id, Exited(replica_id=rid, detail="SIGKILL"))

    def crash_node(self, node_id: NodeId) -> None:
        """The node dies with its engines; its claims stay until the keeper stops them."""
        self._fault("node_crashed")
        self.nodes[node_id].state = NodeState.LOST
        for rid, engine in self.engines.items():
            if node_id in engine.nodes and engine.status in ("starting", "running"):
                engine.status = "dead"
                if engine.watched:
                    self._silence(engine.deployment_id, rid, engine)

    def cut_off_node(self, node_id: NodeId) -> None:
        """The node is cut off: its engines keep running, its heartbeats stop."""
        self._fault("node_cut_off")
        self.nodes[node_id].state = NodeState.UNREACHABLE
        for rid, engine in self.engines.items():
            if node_id in engine.nodes and engine.watched:
                self._silence(engine.deployment_id, rid, engine)

    def restore_node(self, node_id: NodeId) -> None:
        node = self.nodes[node_id]
        if node.state is NodeState.READY:
            return
        node.state = NodeState.READY
        self.broadcast_nodes_changed()

    def running_engines(self) -> list[ReplicaId]:
        return [rid for rid, e in self.engines.items() if e.status == "running"]

    # -- whole-cluster invariants -------------------------------------------------------

    def check_cluster(self) -> None:
        where = f"t={self.elapsed():.1f}s"
        per_node = dict.fromkeys(self.nodes, 0)
        holders: dict[DeploymentId, list[ReplicaId]] = {}
        for rid, claim in self.claims.items():
            for node_id, size in claim.shards:
                per_node[node_id] += size
            dep = self.deps.get(claim.deployment_id)
            if dep is None:
                _fail(f"{where}: {rid} holds claims for a finished deployment")
                continue
            holders.setdefault(claim.deployment_id, []).append(rid)
        for node in self.nodes.values():
            if per_node[node.node_id] != node.claimed:
                _fail(f"{where}: node {node.node_id} claim bookkeeping off")
            if node.claimed > node.total:
                _fail(f"{where}: node {node.node_id} over-claimed: "
                      f"{node.claimed / GIB:.1f} of {node.total / GIB:.1f} GiB")
        for dep_id, dep in self.deps.items():
            state = dep.state
            replicas = {r.replica_id: r for r in state.replicas}
            held = holders.get(dep_id, [])
            for rid in held:
                r = replicas.get(rid)
                if r is None:
                    _fail(f"{where}: {rid} holds claims but no keeper knows it (leak)")
                elif r.phase is not Phase.PLACING and r.nodes != self.claims[rid].node_ids:
                    _fail(f"{where}: {rid} keeper says {r.nodes}, claims "
                          f"{self.claims[rid].node_ids}")
            stopping = count(state, Phase.STOPPING)
            # A placement still in flight when scaled away may land (and claim) before it
            # is stopped: it counts like a stopping one.
            retiring = sum(1 for r in state.replicas if r.retiring)
            if len(held) > allowed(state, self.config) + stopping + retiring:
                _fail(f"{where}: {dep_id} holds {len(held)} claims, spec "
                      f"{state.spec.replicas}, {stopping} stopping, "
                      f"{count(state, Phase.UNREACHABLE)} unreachable")
            if count(state, Phase.READY) > state.spec.replicas:
                _fail(f"{where}: {dep_id} has more ready replicas than asked")
        for rid, engine in self.engines.items():
            if engine.status in ("starting", "running") and rid not in self.claims:
                _fail(f"{where}: engine {rid} runs without a claim")

    def check_settled(self, fits: Callable[[Dep], bool]) -> None:
        """Once faults have stopped and things had time to settle: every deployment that
        fits serves exactly its replicas, the rest say why, and nothing is left over."""
        for dep_id, dep in self.deps.items():
            state = dep.state
            shown = keeper.status(state)
            where = f"settled {dep_id} ({shown}, {state.replicas})"
            if state.deleting:
                _fail(f"{where}: deleted but not finished")
            held = sorted(r for r, c in self.claims.items() if c.deployment_id == dep_id)
            if fits(dep):
                ready = sorted(r.replica_id for r in state.replicas if r.phase is Phase.READY)
                if len(ready) != state.spec.replicas or len(state.replicas) != len(ready):
                    _fail(f"{where}: wants {state.spec.replicas} ready replicas")
                if held != ready:
                    _fail(f"{where}: claims {held} != ready {ready}")
                for rid in ready:
                    engine = self.engines.get(rid)
                    if engine is None or engine.status != "running" or not engine.watched:
                        _fail(f"{where}: {rid} ready but its engine is "
                              f"{engine and engine.status} (watched: "
                              f"{engine and engine.watched})")
                want = DeploymentStatus.SERVING
            else:
                if held or count(state, Phase.STARTING, Phase.READY):
                    _fail(f"{where}: does not fit, yet holds {held}")
                want = DeploymentStatus.CANT_PLACE
            if state.spec.replicas == 0:
                want = DeploymentStatus.STOPPED
            if shown is not want:
                _fail(f"{where}: status {shown}, expected {want}")
        for dep_id, dep in self.done.items():
            if not dep.state.finished or dep.state.replicas:
                _fail(f"{dep_id} removed but not finished")
        live_engines = {r for r, e in self.engines.items() if e.status in ("starting",
                                                                          "running")}
        if live_engines - set(self.claims):
            _fail(f"engines without claims: {live_engines - set(self.claims)}")
        for node in self.nodes.values():
            if node.claimed != sum(s for c in self.claims.values() for n, s in c.shards
                                   if n == node.node_id):
                _fail(f"node {node.node_id}: claims do not add up")
