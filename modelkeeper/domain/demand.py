"""Following demand: how many replicas a deployment should run, from what its users do.
Pure: the policy, what the keeper has, what the gateways saw, and the time come in as
arguments; :func:`step` answers the one change due now, if any.

A deployment's :class:`ScalingPolicy` bounds its replicas between ``min_replicas`` and
``max_replicas``. ``replicas: N`` alone is min = max = N (what it always meant); min 0
with max >= 1 is *on demand*; min 0, max 0 is configured and deliberately off. A
deployment with no policy (min = max) never starts on demand: a typo in a client's
``model`` must not load a 70B.

Who decides: a usage watch (an activity, outside the workflow's history) samples the
gateways' usage rows every tick and runs :func:`step` on the keeper's :class:`DemandView`
it was started with. Only when a step is due does it return, and the keeper applies that
step if its view is still the one the watch had (``DemandView`` equal): an idle or
sleeping deployment costs no history events, and a step costs one watch's worth.

The rules, in order; the first that applies is the step (each has its test in
``tests/unit/test_demand.py``):

1. **Unknown is not idle.** A replica with no fresh usage row (a gateway that has just
   restarted knows nothing) is never idle, never slept, never a victim. Its idle clock
   starts no earlier than when every gateway began reporting it
   (:attr:`ReplicaUse.idle_since`).
2. **Asked for, none ready** (requests wait and no replica is ready): wake a sleeping
   replica if one sleeps and none is waking; else, when nothing is on its way and the
   deployment wants none, add one ("loading"). One step, however many requests wait.
3. **Grow:** requests waiting per ready replica at or above ``scale_up_waiting``,
   continuously for ``scale_up_after_s``, adds one replica, up to max. Never while a
   replica is placing, starting or waking (the last addition is still on its way).
   *Measured* (the sample carries the model's measured concurrency,
   :mod:`modelkeeper.domain.measured`): requests per ready replica, in flight and
   waiting, beyond the measured concurrency is the condition instead.
4. **Shrink:** nothing waiting for ``scale_down_after_s`` (and as long since the last
   change) removes one replica above ``min_replicas``: the one idle longest, unused now.
   Never the last one awake: nothing waiting is also what light use looks like, and a
   model in use stays loaded (zero is rule 6's, which asks for no use at all).
   *Measured*: the condition is instead that the ready replicas but one would each
   serve under ``SCALE_IN_FRACTION`` (70 %) of the measured concurrency, and the
   replica removed is the least loaded (then the one idle longest): it is drained
   first, so a replica still serving a few requests may go.
5. **Sleep:** a ready replica above the minimum, unused for ``sleep_after_s``, sleeps
   (engines that can; llama.cpp cannot, and is stopped by rule 6 instead).
6. **Idle stop:** a replica above the minimum unused for ``idle_timeout_s`` (a sleeping
   one: asleep for ``idle_timeout_s - sleep_after_s``) is stopped, drained first.

"Above the minimum", for an awake replica, counts the replicas awake (ready or on their
way): ``min_replicas`` promises replicas that serve, and a sleeper beside them does not
keep it. For a sleeping one it counts every live replica.

Steps move one replica at a time; the keeper logs each with the load behind it.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal, Self

from pydantic import Field, model_validator

from .base import Frozen, Tolerant
from .bounds import MAX_REPLICAS, STRICT, JsonInt
from .ids import DeploymentId, ReplicaId
from .measured import SCALE_IN_FRACTION, beyond_measured, rest_would_stay_under

#: A timeout or period longer than 30 days is a typo (seconds for minutes), not a policy.
MAX_PERIOD_S = 30 * 86_400.0
#: The most a gateway holds one request for a loading model: ten minutes is far beyond
#: any load a client would wait for, and bounds what one request may tie up.
MAX_LOAD_WAIT_S = 600.0

#: Defaults of the scale rules, from the seed (llmgw "Add replicas under load"): one or
#: more requests waiting per ready replica, held for a minute, adds one; ten minutes with
#: nothing waiting removes one. A replica is minutes of weights and gigabytes of memory,
#: and a spike must not leave a pile of replicas behind it.
DEFAULT_SCALE_UP_WAITING = 1.0
DEFAULT_SCALE_UP_AFTER_S = 60.0
DEFAULT_SCALE_DOWN_AFTER_S = 600.0


class ScalingPolicy(Tolerant):
    """How many replicas a deployment runs, and when that changes.

    Tolerant: the keeper's state carries it through continue-as-new. The API validates
    what a client sends with :class:`ScalingRequest` (strict), which builds one of these.
    """

    min_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    #: Replicas above the minimum unused this long are stopped; None: never.
    idle_timeout_s: float | None = Field(default=None, gt=0, le=MAX_PERIOD_S)
    #: ... and slept this long unused, where the engine can sleep; None: never.
    sleep_after_s: float | None = Field(default=None, gt=0, le=MAX_PERIOD_S)
    #: How long the gateway holds a request for this model while it loads or wakes;
    #: None: the gateway's ``gateway_load_wait_s``.
    load_wait_s: float | None = Field(default=None, ge=0, le=MAX_LOAD_WAIT_S)
    scale_up_waiting: float = Field(default=DEFAULT_SCALE_UP_WAITING, gt=0, le=10_000)
    scale_up_after_s: float = Field(default=DEFAULT_SCALE_UP_AFTER_S, ge=0, le=MAX_PERIOD_S)
    scale_down_after_s: float = Field(default=DEFAULT_SCALE_DOWN_AFTER_S, ge=0,
                                      le=MAX_PERIOD_S)
    #: Slept replicas kept on other nodes beside those serving, so that losing a serving
    #: replica is answered by a wake, not a load.
    warm_standby: int = Field(default=0, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas = {self.min_replicas} is above max_replicas = "
                             f"{self.max_replicas}")
        if (self.sleep_after_s is not None and self.idle_timeout_s is not None
                and self.sleep_after_s >= self.idle_timeout_s):
            raise ValueError(f"sleep_after_s = {self.sleep_after_s:g} must be below "
                             f"idle_timeout_s = {self.idle_timeout_s:g}: a replica sleeps "
                             "first and is stopped later")
        return self

    @classmethod
    def fixed(cls, replicas: int) -> ScalingPolicy:
        """``replicas: N``: min = max = N, never started on demand, never stopped idle."""
        return cls(min_replicas=replicas, max_replicas=replicas)

    @property
    def on_demand(self) -> bool:
        """Min 0, max >= 1: loaded when asked for."""
        return self.min_replicas == 0 and self.max_replicas >= 1

    @property
    def off(self) -> bool:
        """Min 0, max 0: configured and deliberately not running."""
        return self.max_replicas == 0

    @property
    def follows_demand(self) -> bool:
        """Whether usage can change its replica count (a usage watch is worth running)."""
        return (self.min_replicas < self.max_replicas or self.idle_timeout_s is not None
                or self.sleep_after_s is not None)

    def within(self, replicas: int) -> int:
        """``replicas`` brought within the bounds."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


class ScalingRequest(Frozen):
    """A scaling policy as an operator sends it (POST /deployments' ``scaling``, PATCH):
    strict JSON types and unknown keys refused, then :meth:`policy`."""

    min_replicas: JsonInt = Field(ge=0, le=MAX_REPLICAS)
    max_replicas: JsonInt = Field(ge=0, le=MAX_REPLICAS)
    idle_timeout_s: float | None = Field(default=None, gt=0, le=MAX_PERIOD_S,
                                         allow_inf_nan=False, strict=STRICT)
    sleep_after_s: float | None = Field(default=None, gt=0, le=MAX_PERIOD_S,
                                        allow_inf_nan=False, strict=STRICT)
    load_wait_s: float | None = Field(default=None, ge=0, le=MAX_LOAD_WAIT_S,
                                      allow_inf_nan=False, strict=STRICT)
    scale_up_waiting: float = Field(default=DEFAULT_SCALE_UP_WAITING, gt=0, le=10_000,
                                    allow_inf_nan=False, strict=STRICT)
    scale_up_after_s: float = Field(default=DEFAULT_SCALE_UP_AFTER_S, ge=0,
                                    le=MAX_PERIOD_S, allow_inf_nan=False, strict=STRICT)
    scale_down_after_s: float = Field(default=DEFAULT_SCALE_DOWN_AFTER_S, ge=0,
                                      le=MAX_PERIOD_S, allow_inf_nan=False, strict=STRICT)
    warm_standby: JsonInt = Field(default=0, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        self.policy()  # the same checks, with the same messages
        return self

    def policy(self) -> ScalingPolicy:
        return ScalingPolicy(**self.model_dump())


# -- what the keeper has, as the rules read it ---------------------------------------------


class Standing(StrEnum):
    """Where a replica stands, as the rules read it (coarser than the keeper's phases)."""

    ON_ITS_WAY = "on_its_way"  # placing, starting or waking: an addition still coming
    READY = "ready"
    SLEEPING = "sleeping"
    OTHER = "other"  # unreachable or stopping: neither serving nor coming


class ReplicaStanding(Tolerant):
    replica_id: ReplicaId
    standing: Standing
    #: When it last became ready (or woke); None while it never was.
    ready_at: datetime | None = None
    #: When it went to sleep; None unless sleeping.
    asleep_since: datetime | None = None
    #: A warm standby (kept asleep on purpose): never stopped idle, never woken by rule 2
    #: before the others.
    standby: bool = False


class DemandView(Tolerant):
    """What the rules read of the keeper: equal views mean the same decision, so the
    keeper applies a watch's step only if its view is still the watch's."""

    deployment_id: DeploymentId
    policy: ScalingPolicy
    #: The number of replicas the keeper wants now (within the policy's bounds).
    desired: int
    replicas: list[ReplicaStanding] = Field(default_factory=list)
    #: When the count last changed (by a step, a scale or a policy change).
    last_change_at: datetime | None = None
    #: The engine can sleep (vLLM, SGLang, the sim engine); llama.cpp cannot.
    can_sleep: bool = False


# -- what the gateways saw ----------------------------------------------------------------


class ReplicaUse(Tolerant):
    """One replica's usage, summed over every gateway worker with a fresh row."""

    replica_id: ReplicaId
    in_flight: int = Field(ge=0)
    #: The latest request to end there; None: none since reporting began.
    last_used_at: datetime | None = None
    #: The latest time a gateway worker began reporting it: it knows nothing from before.
    reporting_since: datetime

    @property
    def idle_since(self) -> datetime:
        """From when it has been unused, as far as anyone knows (rule 1)."""
        if self.last_used_at is None:
            return self.reporting_since
        return max(self.last_used_at, self.reporting_since)


class DemandSample(Tolerant):
    """The gateways' usage rows of one deployment at one moment (fresh rows only)."""

    at: datetime
    #: Requests held at the gateways for lack of a ready replica.
    waiting: int = Field(default=0, ge=0)
    last_request_at: datetime | None = None
    #: Reported replicas; one absent is *unknown* (rule 1).
    replicas: list[ReplicaUse] = Field(default_factory=list)
    #: The engines' own queues (vLLM ``vllm:num_requests_waiting``), where they say.
    engine_waiting: int = Field(default=0, ge=0)
    #: Concurrent requests one replica of the model was measured to serve within its
    #: latency objective (``modelkeeper bench``), read with the rows; None: never
    #: measured, and rules 3 and 4 read waiting requests as they always did.
    measured_concurrency: int | None = Field(default=None, ge=1)

    def use_of(self, replica_id: ReplicaId) -> ReplicaUse | None:
        return next((u for u in self.replicas if u.replica_id == replica_id), None)


class Pressure(Frozen):
    """What a usage watch remembers between samples: since when each rule's condition has
    held without a break (None: it does not hold now)."""

    busy_since: datetime | None = None
    quiet_since: datetime | None = None


# -- steps --------------------------------------------------------------------------------


class Add(Tolerant):
    """One more replica (from 0: a load)."""

    kind: Literal["add"] = "add"
    reason: str


class Retire(Tolerant):
    """One replica fewer: this one, drained first."""

    kind: Literal["retire"] = "retire"
    replica_id: ReplicaId
    reason: str


class Sleep(Tolerant):
    """Put this replica to sleep (it keeps its weights, frees its KV cache)."""

    kind: Literal["sleep"] = "sleep"
    replica_id: ReplicaId
    reason: str


class Wake(Tolerant):
    """Wake this sleeping replica."""

    kind: Literal["wake"] = "wake"
    replica_id: ReplicaId
    reason: str


Step = Annotated[Add | Retire | Sleep | Wake, Field(discriminator="kind")]


def _count(view: DemandView, *standings: Standing) -> int:
    return sum(1 for r in view.replicas if r.standing in standings)


def _fmt(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def _since(start: datetime | None, now: datetime) -> float:
    return (now - start).total_seconds() if start is not None else 0.0


def _least_loaded(view: DemandView, sample: DemandSample) -> ReplicaStanding | None:
    """Rule 4's replica when measured: the ready one with the fewest requests in flight,
    then the one unused longest; only one the gateways report (unknown is not idle, rule
    1)."""
    known = [(use, r) for r in view.replicas if r.standing is Standing.READY
             and (use := sample.use_of(r.replica_id)) is not None]
    if not known:
        return None
    return min(known, key=lambda pair: (pair[0].in_flight, pair[0].idle_since,
                                        pair[1].replica_id))[1]


def step(view: DemandView, sample: DemandSample, pressure: Pressure,
         now: datetime) -> tuple[Pressure, Add | Retire | Sleep | Wake | None]:
    """The change due now, if any, and what to remember for the next sample."""
    policy = view.policy
    ready = _count(view, Standing.READY)
    coming = _count(view, Standing.ON_ITS_WAY)
    waiting = sample.waiting + sample.engine_waiting

    # Rule 2: asked for, none ready. While one is on its way, nothing else is due: no
    # replica is stopped or slept while requests wait for the model.
    if sample.waiting > 0 and ready == 0:
        if coming > 0:
            return pressure, None
        sleeping = [r for r in view.replicas if r.standing is Standing.SLEEPING]
        if sleeping:
            # A standby last: a woken standby leaves none, an ordinary sleeper costs nothing.
            chosen = min(sleeping, key=lambda r: (r.standby, r.replica_id))
            return pressure, Wake(replica_id=chosen.replica_id,
                                  reason=f"{sample.waiting} request(s) waiting")
        if view.desired == 0 and policy.max_replicas >= 1 and policy.on_demand:
            return pressure, Add(reason=f"loading: {sample.waiting} request(s) waiting")
        return pressure, None

    # Rule 3: grow. Measured, the load is every request the gateways hold for it: in
    # flight (an engine's own queue is in there already) and waiting for a replica.
    measured = sample.measured_concurrency
    load = sum(u.in_flight for u in sample.replicas) + sample.waiting
    if measured is None:
        busy = ready > 0 and waiting / ready >= policy.scale_up_waiting
        quiet = waiting == 0
    else:
        busy = beyond_measured(load, ready, measured)
        quiet = rest_would_stay_under(load, ready, measured)
    busy_since = (pressure.busy_since or now) if busy else None
    quiet_since = (pressure.quiet_since or now) if quiet else None
    pressure = Pressure(busy_since=busy_since, quiet_since=quiet_since)
    if busy and coming == 0 and view.desired < policy.max_replicas:
        held = _since(busy_since, now)
        if held >= policy.scale_up_after_s:
            if measured is not None:
                return Pressure(quiet_since=quiet_since), Add(reason=(
                    f"{load} request(s) on {ready} ready for {_fmt(held)} (> {measured} "
                    f"per replica, as measured, for {_fmt(policy.scale_up_after_s)})"))
            return Pressure(quiet_since=quiet_since), Add(reason=(
                f"{waiting} waiting on {ready} ready for {_fmt(held)} "
                f"(>= {policy.scale_up_waiting:g} per replica for "
                f"{_fmt(policy.scale_up_after_s)})"))

    awake = ready + coming
    live = awake + _count(view, Standing.SLEEPING)
    # Min is a promise of replicas awake: stopping or sleeping an awake one needs more
    # awake than the minimum (a sleeper beside them does not keep the promise); stopping
    # a sleeper needs more live ones than the minimum.
    above_min = live > policy.min_replicas and view.desired > policy.min_replicas
    awake_above_min = awake > policy.min_replicas and view.desired > policy.min_replicas
    # Rule 4 takes back what load added, down to the minimum but never the last replica
    # awake: quiet means nothing waits, which is also true of a model in light use. Going
    # to zero is rule 6's, which asks for no use at all for idle_timeout_s.
    shrink_base = max(policy.min_replicas, 1)

    def unused(replica: ReplicaStanding) -> float | None:
        """Seconds unused, or None when unknown or in use (rule 1)."""
        use = sample.use_of(replica.replica_id)
        if use is None or use.in_flight > 0:
            return None
        since = use.idle_since
        if replica.ready_at is not None:
            since = max(since, replica.ready_at)
        return max((now - since).total_seconds(), 0.0)

    idle = sorted(((s, r) for r in view.replicas if r.standing is Standing.READY
                   and (s := unused(r)) is not None), key=lambda pair: -pair[0])

    # Rule 4: shrink after a quiet period.
    if measured is not None:
        retire = _least_loaded(view, sample)
        # Quiet checked itself, not only its period: with scale_down_after_s 0 a period
        # that never began has held for 0 s too.
        if (quiet and awake > shrink_base and view.desired > shrink_base
                and policy.min_replicas < policy.max_replicas and retire is not None):
            held = _since(quiet_since, now)
            since_change = _since(view.last_change_at, now) if view.last_change_at else held
            if (held >= policy.scale_down_after_s
                    and since_change >= policy.scale_down_after_s):
                return Pressure(busy_since=busy_since), Retire(
                    replica_id=retire.replica_id,
                    reason=f"{load} request(s) would leave the {ready - 1} other ready "
                           f"replica(s) under {SCALE_IN_FRACTION:.0%} of the measured "
                           f"{measured} each, for {_fmt(held)}; {retire.replica_id} is "
                           "the least loaded")
    elif (quiet and awake > shrink_base and view.desired > shrink_base
            and policy.min_replicas < policy.max_replicas and idle):
        held = _since(quiet_since, now)
        since_change = _since(view.last_change_at, now) if view.last_change_at else held
        if held >= policy.scale_down_after_s and since_change >= policy.scale_down_after_s:
            unused_s, victim = idle[0]
            return Pressure(busy_since=busy_since), Retire(
                replica_id=victim.replica_id,
                reason=f"quiet: nothing waiting for {_fmt(held)}; "
                       f"{victim.replica_id} unused for {_fmt(unused_s)}")

    if not above_min:
        return pressure, None
    # Rule 5: sleep.
    if awake_above_min and view.can_sleep and policy.sleep_after_s is not None:
        for unused_s, replica in idle:
            if unused_s >= policy.sleep_after_s:
                return pressure, Sleep(replica_id=replica.replica_id,
                                       reason=f"unused for {_fmt(unused_s)}")
    # Rule 6: idle stop.
    if policy.idle_timeout_s is not None:
        for unused_s, replica in idle:
            if awake_above_min and unused_s >= policy.idle_timeout_s:
                return pressure, Retire(replica_id=replica.replica_id,
                                        reason=f"idle: unused for {_fmt(unused_s)}")
        if view.can_sleep and policy.sleep_after_s is not None:
            asleep_for = policy.idle_timeout_s - policy.sleep_after_s
            for replica in view.replicas:
                if (replica.standing is Standing.SLEEPING and not replica.standby
                        and replica.asleep_since is not None
                        and _since(replica.asleep_since, now) >= asleep_for):
                    return pressure, Retire(
                        replica_id=replica.replica_id,
                        reason=f"idle: asleep for {_fmt(_since(replica.asleep_since, now))}")
    return pressure, None


# -- the usage watch (activities/demand.py) -----------------------------------------------


class WatchDemandInput(Tolerant):
    """Input of ``watch_demand``: the keeper's view, which the watch runs :func:`step` on
    until a step is due."""

    view: DemandView
    #: What the last watch remembered (:attr:`DemandFound.pressure`), so that a rule's
    #: period is not started again by every step the keeper applies.
    pressure: Pressure = Field(default_factory=Pressure)


class DemandFound(Tolerant):
    """What ``watch_demand`` returns: the step due, the view it was decided on (the keeper
    applies it only if its own view is still equal) and the sample behind it (the load the
    keeper logs with the step)."""

    view: DemandView
    step: Step
    sample: DemandSample
    #: What to remember after this step: the next watch's :attr:`WatchDemandInput.pressure`.
    pressure: Pressure = Field(default_factory=Pressure)


# -- what the deployment workflow's demand updates take -----------------------------------


class WindowBounds(Tolerant):
    """A schedule window's bounds, while it is open (they replace the policy's)."""

    name: str = Field(min_length=1, max_length=64)
    min_replicas: int = Field(ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(ge=0, le=MAX_REPLICAS)


class SetPolicyRequest(Tolerant):
    """``set_policy``: the deployment's scaling policy from now on (PATCH, the CLI)."""

    policy: ScalingPolicy
    #: Who asked, for the audit event.
    actor: str = ""


class SetWindowRequest(Tolerant):
    """``set_window``: a schedule window opens (``window`` set) or closes (``closing``
    names it; a close for a window that is not the open one changes nothing)."""

    window: WindowBounds | None = None
    closing: str | None = None


class SleepRequest(Tolerant):
    """``sleep``: put a ready replica to sleep (None: every ready one; an operator is not
    held to the minimum, and a request wakes it)."""

    replica_id: ReplicaId | None = None
    actor: str = ""


class WakeRequest(Tolerant):
    """``wake``: wake a sleeping replica (None: every sleeping one)."""

    replica_id: ReplicaId | None = None
    actor: str = ""


class EvictRequest(Tolerant):
    """``evict``: another deployment asks this one to stop an idle replica to make room
    (modelkeeper.domain.eviction chose it); refused if it is no longer idle or evictable."""

    replica_id: ReplicaId
    for_deployment: DeploymentId
    reason: str
