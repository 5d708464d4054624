"""Capacity measured, not guessed: what one replica of a model was measured to serve
within a latency objective, and what follows from it. Pure: the measurements, the time
and the nodes come in as arguments.

``modelkeeper bench MODEL`` (``cli/bench.py``) steps the concurrency per replica up
(:func:`concurrency_steps`), measures each level (:class:`LevelResult`) through the
gateway, and keeps the highest level that met the objective before the first that broke
it (:func:`sustained`): peak throughput comes long after latency has become unusable, so
throughput alone overstates what a replica can serve. The API stores it as a
:class:`MeasuredCapacity` of the model (and profile), per GPU or per core.

What reads it:

1. **The autoscaler** (:func:`modelkeeper.domain.demand.step`, rule 3 and rule 4): with a
   measured concurrency, requests per ready replica (in flight and waiting) beyond it add
   a replica; a replica is removed only if the rest would stay under
   :data:`SCALE_IN_FRACTION` of theirs (:func:`rest_would_stay_under`).
2. **Sizing** (:func:`size`): how many replicas a target rate needs, by Little's law on
   the measured mean request duration, against how many more fit now
   (:func:`modelkeeper.domain.sizing.room_for`: placement, which this module must not
   import, since the autoscaler's rules below it read this module).
3. **Profile order** (:func:`order_equal_priority`): among profiles of equal priority the
   one with the most measured tokens/s per GPU (or per core, on CPU) is tried first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import TypeVar

from pydantic import Field

from .base import Frozen, Tolerant
from .bounds import MAX_REPLICAS, STRICT, JsonInt
from .ids import ModelId
from .shards import EngineKind

#: Time to first token, p95, that ``bench`` holds a level to by default: two seconds is
#: about as long as a person at a chat waits for the first word before the answer feels
#: broken (and what interactive serving SLOs commonly promise).
DEFAULT_TTFT_P95_S = 2.0
#: Time between tokens, p95, by default: 100 ms is 10 tokens/s, ahead of a fast reader
#: (about 8 tokens/s); a slower stream makes a person wait on every line.
DEFAULT_ITL_P95_S = 0.1
#: The most concurrent requests per replica ``bench`` tries by default: 256 is beyond what
#: a single vLLM replica schedules at once (its default max_num_seqs), so the objective
#: breaks before the bound on every engine modelkeeper starts.
DEFAULT_MAX_CONCURRENCY = 256
#: The most concurrency per replica anyone may ask of ``bench``: a level is that many open
#: streams per replica from one process, and past a few thousand the client, not the
#: replica, is what is measured.
MAX_CONCURRENCY = 4096

#: The shortest mean request a report may give: no streamed completion through a gateway
#: ends within a millisecond, and a shorter one would make a replica's requests/s
#: (concurrency / mean) overflow.
MIN_REQUEST_S = 0.001

#: A replica is removed only if the rest would serve under 70 % of their measured
#: concurrency: room for a burst of 1/0.7 = 1.43x today's load before the next addition
#: is due, and a gap between adding (above 100 %) and removing (below 70 %) wide enough
#: that one removal never puts the rest straight back above the line (no flapping).
SCALE_IN_FRACTION = 0.7


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``, nearest rank (the smallest value with at
    least ``q`` of the values at or below it): a figure that was measured, never one
    interpolated. A ValueError for none. (The same definition as bench/stats.py.)"""
    if not values:
        raise ValueError("the percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q}: it runs from 0 to 1")
    ordered = sorted(values)
    # Rounded before the ceiling: 0.07 * 100 is 7.000000000000001 in floats.
    rank = math.ceil(round(q * len(ordered), 9))
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


def concurrency_steps(bound: int) -> list[int]:
    """1, 2, 4, ... doubling, up to ``bound``, which is always the last step."""
    if bound < 1:
        raise ValueError(f"bound {bound}: at least 1 concurrent request")
    steps = [1]
    while steps[-1] * 2 < bound:
        steps.append(steps[-1] * 2)
    if steps[-1] != bound:
        steps.append(bound)
    return steps


class Objective(Frozen):
    """The latency a level must keep to count as served: p95 of the time to the first
    token and p95 of the time between tokens, each over every request of the level."""

    ttft_p95_s: float = Field(default=DEFAULT_TTFT_P95_S, gt=0, le=600, allow_inf_nan=False,
                              strict=STRICT)
    itl_p95_s: float = Field(default=DEFAULT_ITL_P95_S, gt=0, le=60, allow_inf_nan=False,
                             strict=STRICT)


class LevelResult(Frozen):
    """What one level of ``bench`` measured: ``concurrency`` requests at once per replica,
    kept up for the level's duration."""

    concurrency: int = Field(ge=1)
    requests: int = Field(ge=0)
    errors: int = Field(ge=0)
    #: p95 over the level's requests; None when no request streamed a token.
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    #: Tokens streamed per second per replica, over the level's wall time.
    tokens_per_s: float = Field(ge=0)
    #: Mean seconds from sending a request to its last token (Little's law's W).
    mean_request_s: float | None = None

    def miss(self, objective: Objective) -> str | None:
        """Why this level did not meet ``objective``; None when it did."""
        if self.errors:
            return f"{self.errors} of {self.requests} request(s) failed"
        if self.ttft_p95_s is None or self.requests == 0:
            return "no request streamed a token"
        if self.ttft_p95_s > objective.ttft_p95_s:
            return (f"TTFT p95 {self.ttft_p95_s * 1000:.0f} ms is above the objective "
                    f"{objective.ttft_p95_s * 1000:.0f} ms")
        if self.itl_p95_s is not None and self.itl_p95_s > objective.itl_p95_s:
            return (f"inter-token p95 {self.itl_p95_s * 1000:.0f} ms is above the objective "
                    f"{objective.itl_p95_s * 1000:.0f} ms")
        return None


def sustained(levels: Sequence[LevelResult], objective: Objective) -> LevelResult | None:
    """The highest level that met ``objective`` before the first that did not (levels in
    the order they ran, rising); None when the first already missed it. A level past a
    miss that meets it again is noise, not capacity: it is not counted."""
    best = None
    for level in levels:
        if level.miss(objective) is not None:
            break
        best = level
    return best


class Unit(StrEnum):
    """What a replica's throughput is divided by to compare profiles."""

    GPU = "gpu"
    CORE = "core"


def per_unit(tokens_per_s: float, *, gpus: int | None,
             cpu_cores: float | None) -> tuple[Unit | None, float | None]:
    """Tokens/s per GPU for a replica that holds GPUs, else per core where it declares
    cores; (None, None) when it declares neither (nothing to divide by)."""
    if gpus:
        return Unit.GPU, tokens_per_s / gpus
    if cpu_cores:
        value = tokens_per_s / cpu_cores
        # A catalog may declare a sliver of a core: a figure past a float is no figure.
        return (Unit.CORE, value) if math.isfinite(value) else (None, None)
    return None, None


class CapacityReport(Frozen):
    """What ``bench`` sends (PUT /models/{id}/capacity): the level it found, the objective
    it held the levels to, and where it ran. The API adds the rest from the catalog."""

    # The catalog's profile names (PROFILE_NAME_PATTERN on main, once merged), or empty.
    profile: str = Field(default="", max_length=63,
                         pattern=r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$",
                         description="the hardware profile measured; empty: the model's "
                                     "own resources (no named profile)")
    concurrency: JsonInt = Field(ge=1, le=MAX_CONCURRENCY,
                                 description="concurrent requests one replica sustains "
                                             "within the objective")
    tokens_per_s: float = Field(ge=0, le=1e9, allow_inf_nan=False, strict=STRICT,
                                description="tokens/s one replica streamed at that level")
    mean_request_s: float = Field(ge=MIN_REQUEST_S, le=86_400, allow_inf_nan=False,
                                  strict=STRICT,
                                  description="mean request duration at that level")
    ttft_p95_s: float = Field(ge=0, le=86_400, allow_inf_nan=False, strict=STRICT)
    itl_p95_s: float | None = Field(default=None, ge=0, le=86_400, allow_inf_nan=False,
                                    strict=STRICT)
    objective: Objective
    replicas: JsonInt = Field(ge=1, le=MAX_REPLICAS,
                              description="ready replicas the load was spread over")
    max_tokens: JsonInt = Field(ge=1, le=65_536,
                                description="tokens each request asked for")


class MeasuredCapacity(Tolerant):
    """A stored measurement: one replica of ``model_id`` (as ``profile``) serves
    ``concurrency`` requests at once within ``objective``, at ``tokens_per_s``."""

    model_id: ModelId
    profile: str = ""
    engine: EngineKind | None = None
    concurrency: int = Field(ge=1)
    tokens_per_s: float = Field(ge=0)
    unit: Unit | None = None
    #: ``tokens_per_s`` per GPU or per core (``unit``); None with no unit.
    tokens_per_s_per_unit: float | None = None
    mean_request_s: float = Field(gt=0)
    ttft_p95_s: float = Field(ge=0)
    itl_p95_s: float | None = None
    objective: Objective
    replicas: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    measured_at: datetime

    @property
    def requests_per_s(self) -> float:
        """What one replica answers per second at its measured concurrency, by Little's
        law (L = lambda W): ``concurrency / mean_request_s``."""
        return self.concurrency / self.mean_request_s


def measured_of(report: CapacityReport, *, model_id: ModelId, engine: EngineKind,
                gpus: int | None, cpu_cores: float | None,
                at: datetime) -> MeasuredCapacity:
    """The stored form of ``report`` for a model with these resources, measured ``at``."""
    unit, value = per_unit(report.tokens_per_s, gpus=gpus, cpu_cores=cpu_cores)
    return MeasuredCapacity(
        model_id=model_id, profile=report.profile, engine=engine,
        concurrency=report.concurrency, tokens_per_s=report.tokens_per_s, unit=unit,
        tokens_per_s_per_unit=value, mean_request_s=report.mean_request_s,
        ttft_p95_s=report.ttft_p95_s, itl_p95_s=report.itl_p95_s,
        objective=report.objective, replicas=report.replicas,
        max_tokens=report.max_tokens, measured_at=at)


# -- the autoscaler's two thresholds (modelkeeper.domain.demand, rules 3 and 4) -----------


def beyond_measured(load: int, ready: int, concurrency: int) -> bool:
    """Rule 3 with a measurement: more requests per ready replica than it was measured to
    serve within its objective."""
    return ready > 0 and load > concurrency * ready


def rest_would_stay_under(load: int, ready: int, concurrency: int) -> bool:
    """Rule 4 with a measurement: with one ready replica fewer, the rest would each serve
    under :data:`SCALE_IN_FRACTION` of their measured concurrency."""
    rest = ready - 1
    return rest >= 1 and load < SCALE_IN_FRACTION * concurrency * rest


# -- sizing -------------------------------------------------------------------------------


class SizeAnswer(Frozen):
    """``modelkeeper size MODEL --rps R``: the replicas a target rate needs, and whether
    the room is there."""

    model_id: ModelId
    profile: str
    rps: float
    #: Concurrent requests the rate keeps open (Little's law: rps x mean request duration).
    concurrency_needed: float
    #: Requests/s one replica answers within its objective (concurrency / mean duration).
    per_replica_rps: float
    replicas_needed: int
    #: Replicas of the model there are now (ready or on their way), which already serve.
    replicas_now: int
    #: More replicas needed beyond ``replicas_now``.
    more_needed: int
    #: More replicas that fit now (placement on a copy of the nodes), up to ``more_needed``.
    fit_now: int
    enough_room: bool
    #: How requests/s became replicas, in one sentence.
    assumption: str
    measured_at: datetime


def size(capacity: MeasuredCapacity, *, rps: float, replicas_now: int,
         fit_now: int) -> SizeAnswer:
    """The replicas ``rps`` needs at ``capacity``, against ``replicas_now`` and the
    ``fit_now`` more that placement finds room for.

    Little's law: a rate of ``rps`` requests each lasting W seconds keeps ``rps x W``
    requests open at once, where W is the mean request duration measured at the sustained
    level (so the same prompt and ``max_tokens`` mix as the bench). Each replica serves
    ``concurrency`` of them within the objective: ``ceil(rps x W / concurrency)`` replicas.
    """
    needed_concurrency = rps * capacity.mean_request_s
    replicas = math.ceil(round(needed_concurrency / capacity.concurrency, 9)) if rps > 0 else 0
    more = max(0, replicas - replicas_now)
    return SizeAnswer(
        model_id=capacity.model_id, profile=capacity.profile, rps=rps,
        concurrency_needed=round(needed_concurrency, 3),
        per_replica_rps=round(capacity.requests_per_s, 3), replicas_needed=replicas,
        replicas_now=replicas_now, more_needed=more, fit_now=min(fit_now, more),
        enough_room=fit_now >= more,
        assumption=(f"Little's law: {rps:g} req/s x {capacity.mean_request_s:.3g} s mean "
                    f"request (measured at {capacity.max_tokens} max_tokens) = "
                    f"{needed_concurrency:.3g} requests open at once; one replica serves "
                    f"{capacity.concurrency} within TTFT p95 "
                    f"{capacity.objective.ttft_p95_s:g} s and inter-token p95 "
                    f"{capacity.objective.itl_p95_s:g} s"),
        measured_at=capacity.measured_at)


def most_cautious(measurements: Sequence[MeasuredCapacity]) -> MeasuredCapacity | None:
    """The measurement the autoscaler and sizing read when a model has several (one per
    profile) and the replicas' profile is not told: the least concurrency, so that it
    adds replicas early and removes them late rather than the other way round."""
    return min(measurements, key=lambda m: (m.concurrency, m.profile), default=None)


# -- profile order ------------------------------------------------------------------------


def rank(measurements: Sequence[MeasuredCapacity]) -> list[MeasuredCapacity]:
    """Most tokens/s per GPU (GPU profiles) or per core (CPU profiles) first; one with no
    unit to divide by after them, by tokens/s per replica; ties by profile name."""
    return sorted(measurements, key=lambda m: (
        m.tokens_per_s_per_unit is None, -(m.tokens_per_s_per_unit or 0.0),
        -m.tokens_per_s, m.profile))


def scores(measurements: Sequence[MeasuredCapacity]) -> dict[str, float]:
    """Tokens/s per GPU or per core by profile name, for those with a unit: what a
    profile-order hook taking ``measured: Mapping[str, float]`` reads."""
    return {m.profile: m.tokens_per_s_per_unit for m in measurements
            if m.tokens_per_s_per_unit is not None}


T = TypeVar("T")


def order_equal_priority(candidates: Sequence[T], *, priority: Callable[[T], object],
                         profile: Callable[[T], str],
                         measured: Mapping[str, MeasuredCapacity]) -> list[T]:
    """``candidates`` (in priority order) with each run of equal ``priority`` reordered by
    :func:`rank` of their measurements (``measured`` by profile name). A candidate never
    measured comes after the measured ones of its run, in its own order: a measured
    profile is known to serve, an unmeasured one only declared. Runs never move, so a
    measurement never lifts a profile above a higher priority."""
    ordered: list[T] = []
    start = 0
    while start < len(candidates):
        end = start + 1
        while end < len(candidates) and priority(candidates[end]) == priority(
                candidates[start]):
            end += 1
        run = candidates[start:end]
        known = [c for c in run if profile(c) in measured]
        ranked = rank([measured[profile(c)] for c in known])
        position = {id(m): i for i, m in enumerate(ranked)}
        ordered += sorted(known, key=lambda c: position[id(measured[profile(c)])])
        ordered += [c for c in run if profile(c) not in measured]
        start = end
    return ordered
