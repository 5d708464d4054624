"""bench/stats.py: the one percentile every benchmark reports (nearest rank), its summary
and its spread."""

from __future__ import annotations

import pytest

from bench.stats import Spread, percentile, spread, summary


def test_the_percentile_is_a_measured_value_by_nearest_rank() -> None:
    hundred = [float(v) for v in range(1, 101)]
    assert percentile(hundred, 0.50) == 50.0
    assert percentile(hundred, 0.99) == 99.0
    assert percentile(hundred, 1.0) == 100.0
    assert percentile(hundred, 0.0) == 1.0
    # Float error does not move the rank: 0.07 * 100 is 7.000000000000001.
    assert percentile(hundred, 0.07) == 7.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([5.0], 0.99) == 5.0


def test_no_values_or_a_quantile_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match="from 0 to 1"):
        percentile([1.0], 99)
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_summary_and_spread() -> None:
    assert summary([]) == {"n": 0}
    assert summary([0.1, 0.2, 0.3, 0.4], digits=2) == {
        "n": 4, "p50": 0.2, "p99": 0.4, "max": 0.4, "mean": 0.25}
    assert spread([4.0, 1.0, 2.0, 3.0]) == Spread(min=1.0, median=2.5, max=4.0)
