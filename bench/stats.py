"""The statistics every benchmark reports, in one place, so that a p99 in one result file
means what it means in another.

* :func:`percentile`: nearest rank, the smallest value with at least ``q`` of the values at
  or below it. Not interpolated: every figure reported is one that was measured.
* :func:`summary`: count, p50, p99, max and mean, as the scale benchmark's JSON holds them.
* :func:`spread`: min, median and max, for the few repeats (crashes, faults) a run makes,
  where a p99 would only be the max again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

#: ``q * len(values)`` is rounded to this many digits before its ceiling is taken, so that
#: float error (0.07 * 100 is 7.000000000000001) does not move the rank up by one.
RANK_DIGITS = 9


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``, nearest rank; a ValueError for none."""
    if not values:
        raise ValueError("the percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q}: it runs from 0 to 1")
    ordered = sorted(values)
    rank = math.ceil(round(q * len(ordered), RANK_DIGITS))
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]


def summary(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """Count (``n``), p50, p99, max and mean of ``values``, each rounded to ``digits``;
    ``{"n": 0}`` alone for none."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 0.50), digits),
            "p99": round(percentile(values, 0.99), digits), "max": round(max(values), digits),
            "mean": round(statistics.fmean(values), digits)}


class Spread(NamedTuple):
    """The least, the median and the most of a few values."""

    min: float
    median: float
    max: float


def spread(values: Sequence[float]) -> Spread:
    """Min, median (the mean of the middle two for an even count) and max of ``values``; a
    ValueError for none."""
    if not values:
        raise ValueError("the spread of no values")
    return Spread(min(values), statistics.median(values), max(values))
