"""Where a request goes when its first pick found no replica, or a replica failed it
before the first byte: a replica now, a hold until something changes, or an error.

Pure: the table, what the request has been through and the time come in as arguments,
and the gateway only carries out the answer (``gateway.routing.Router.route``). It is
never consulted while the first pick succeeds and that attempt answers, so the hot path
does not pay for it. The rules, in order:

1. **Only what the engine cannot have acted on comes here.** The gateway records a
   failure only when the connection was refused or dropped before any byte came back. A
   timeout after sending, or an error after the first byte, is answered at once and never
   sent again: the engine may have done the work.
2. **Every send after the first counts against** ``gateway_retries``, whether or not the
   request was held before it. The limit bounds the harm one request can do: if it is
   what crashes engines, it reaches at most 1 + retries of them, a replacement included.
   Once it is spent the request fails at once, without being held.
3. **A replica that refused the connection is out for the request**, and so is one that
   failed it twice: nothing listens there, and sending again at once would only spend a
   retry. A replica that dropped the connection once may be sent to again at once: a
   kept-alive connection the engine had closed is the usual cause, and a fresh one works.
4. **A replica not tried yet comes first**, picked as a first attempt is: fewest in
   flight, round robin among equals, breaker permitting.
5. **A replica that is out comes back once its breaker has let a trial through** since it
   went out (the gateway's own sign that it may have recovered), or lets one through now.
6. **Nothing to send to: hold the request**, woken by any change to the model's routes
   (a replacement becoming ready) and by a breaker's trial coming due, until the deadline:
   ``gateway_wait_for_replica_s`` after the request arrived. It is one budget per request,
   however it is spent: waiting for a first replica, or for one to retry on.
7. **A model that will not come back by itself** (parked, unplaceable, being deleted,
   scaled to zero, switched off at max 0) is answered at once, and so is one deleted
   meanwhile. An unknown model is a 404 and never loads anything: a typo is not "loading".
8. **A model that loads on demand is held for its load** (its policy is min 0, max >= 1,
   or it is idle, loading or asleep): its budget is the policy's ``load_wait_s``, else
   ``gateway_load_wait_s``, since a load or a wake takes longer than a replacement. The
   hold says so (:attr:`Hold.loading`) while no replica of it is ready: the router then
   writes this worker's waiting count at once, which is what asks the control plane for
   the load (the store's demand trigger), and counts the request as held for a load. A
   load wait of 0 answers at once (rule 9), and that answer asks for the load as well.
9. **At the deadline the request fails**: 502 naming the last upstream error when a
   replica failed it; 503 with Retry-After when it was never sent, saying "is loading"
   (with since when and why) for a model that loads on demand and has no ready replica,
   and why no replica is ready otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelkeeper.store.routing import DeploymentRoute

from . import responses
from .breaker import BreakerState
from .responses import ErrorReply
from .table import Endpoint, ModelRoute, RoutingTable

#: How long after a breaker's trial time a held request wakes: past it, never just before.
TRIAL_WAKE_SLACK_S = 0.001


@dataclass(frozen=True, slots=True)
class HoldPolicy:
    """The settings this module decides by, read once at start."""

    #: The wait budget of one request, counted from its arrival.
    wait_s: float
    #: Sends allowed after the first (rule 2).
    retries: int
    #: Retry-After of the 503 for a request that was never sent.
    retry_after_s: int
    #: The wait budget of a request for a model that loads on demand whose policy names
    #: none (rule 8).
    load_wait_s: float


@dataclass(frozen=True, slots=True)
class Tried:
    """What one request has been through: the replicas that failed it, in order."""

    #: One entry per failed attempt (a replica may appear twice, rule 3).
    failed: tuple[Endpoint, ...]
    #: Replicas out for this request, each with its breaker's trial count when it went
    #: out: it comes back once that count has moved (rule 5).
    out: tuple[tuple[Endpoint, int], ...]
    #: The last failure, as the client will read it if nothing works out.
    why: str


@dataclass(frozen=True, slots=True)
class SendTo:
    """Send the request to this replica now."""

    endpoint: Endpoint


@dataclass(frozen=True, slots=True)
class Hold:
    """Nothing to send to yet: wait for a change to ``entry``, until ``until`` at most."""

    entry: ModelRoute
    until: float
    #: Held for a load or a wake: the model loads on demand and none of it is ready (rule 8).
    loading: bool = False


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Answer the client with this error."""

    reply: ErrorReply
    #: "Is loading": the model loads on demand and none of it is ready (rule 9).
    loading: bool = False


#: What to do next with a request.
Step = SendTo | Hold | GiveUp


def record(tried: Tried | None, endpoint: Endpoint, *, why: str, refused: bool) -> Tried:
    """``tried`` after ``endpoint`` failed the request before the first byte (``refused``:
    the connection was refused, rather than dropped). Call it after the attempt's breaker
    verdict is in, so a trial that attempt took does not count as one since (rule 5)."""
    if tried is None:
        tried = Tried((), (), why)
    out = tried.out
    if (refused or endpoint in tried.failed) and all(e is not endpoint for e, _ in out):
        out = (*out, (endpoint, endpoint.breaker.trials))
    return Tried((*tried.failed, endpoint), out, why)


def next_step(table: RoutingTable, model: str, tried: Tried | None, now: float, *,
              arrived: float, policy: HoldPolicy) -> Step:
    """What to do with a request for ``model`` that arrived at ``arrived`` (monotonic
    seconds, like ``now``) and has been through ``tried`` (None: never sent)."""
    entry = table.models.get(model)
    if entry is None:
        return GiveUp(responses.unknown_model(model, table.models))
    if tried is not None and len(tried.failed) > policy.retries:
        return GiveUp(responses.upstream_failed(model, tried.why))
    endpoint = entry.pick(now) if tried is None else _pick_again(entry, tried, now)
    if endpoint is not None:
        return SendTo(endpoint)
    route = entry.route
    hopeless = responses.hopeless(route)
    if hopeless is not None:
        return GiveUp(hopeless)
    on_demand = route.loads_on_demand
    deadline = arrived + (load_wait_s(route, policy) if on_demand else policy.wait_s)
    loading = on_demand and not entry.endpoints
    if now >= deadline:
        waited_s = now - arrived
        if tried is not None:
            return GiveUp(responses.upstream_failed(model, tried.why, waited_s=waited_s))
        if loading:
            return GiveUp(responses.loading(route, waited_s=waited_s,
                                            retry_after_s=policy.retry_after_s), True)
        return GiveUp(responses.not_ready(route, waited_s=waited_s,
                                          retry_after_s=policy.retry_after_s,
                                          open_breakers=entry.open_breakers()))
    trial_at = entry.next_trial_at()
    if trial_at is not None:
        deadline = min(deadline, max(trial_at, now) + TRIAL_WAKE_SLACK_S)
    return Hold(entry, deadline, loading)


def load_wait_s(route: DeploymentRoute, policy: HoldPolicy) -> float:
    """How long a request for ``route``, which loads on demand, may be held (rule 8)."""
    scaling = route.scaling
    if scaling is not None and scaling.load_wait_s is not None:
        return scaling.load_wait_s
    return policy.load_wait_s


def _pick_again(entry: ModelRoute, tried: Tried, now: float) -> Endpoint | None:
    """The replica to send a failed request to now, if any (rules 3 to 5)."""
    fresh = entry.pick(now, tried.failed)
    if fresh is not None:
        return fresh
    # A closed breaker that has let no trial through since: the replica has shown no sign
    # of recovery. An open one lets a request through only as its trial, when due.
    barred = [e for e, trials in tried.out
              if e.breaker.state is BreakerState.CLOSED and e.breaker.trials == trials]
    return entry.pick(now, barred)
