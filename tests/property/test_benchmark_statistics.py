"""Property tests: the statistics the benchmark report judges its targets with
(benchmarks/common.py: the confidence interval of a median, the per-repetition ratios)."""

from __future__ import annotations

import random
import statistics
import sys
from math import comb
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import common  # benchmarks/ is a folder of scripts, not a package

samples = st.lists(st.floats(0.01, 100.0), min_size=1, max_size=80)


def _tail(n: int, k: int) -> float:
    """P(B <= k), B ~ Binomial(n, 1/2)."""
    return sum(comb(n, i) for i in range(k + 1)) / 2**n


@settings(max_examples=200, deadline=None)
@given(samples)
def test_the_median_interval_holds_the_median_and_lies_within_the_data(values: list[float]) -> None:
    low, high = common.median_ci(values)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 120), st.sampled_from([0.9, 0.95, 0.99]), st.randoms())
def test_the_median_interval_is_the_narrowest_order_statistic_pair_with_the_coverage(
    n: int, level: float, rng: random.Random
) -> None:
    values = [float(i) for i in range(n)]
    rng.shuffle(values)
    low, high = common.median_ci(values, level)
    k = int(low) + 1  # distinct values 0..n-1: x(k) is k - 1
    assert high == n - k, "symmetric ranks k and n + 1 - k"
    if k > 1:  # coverage 1 - 2 P(B <= k - 1) reaches the level ...
        assert 1 - 2 * _tail(n, k - 1) >= level - 1e-12
    if k < (n + 1) // 2:  # ... and one rank further in it would not
        assert 1 - 2 * _tail(n, k) < level


@pytest.mark.parametrize(("n", "ranks"), [(5, (1, 5)), (6, (1, 6)), (21, (6, 16)), (31, (10, 22))])
def test_the_median_interval_uses_the_tabulated_ranks(n: int, ranks: tuple[int, int]) -> None:
    low, high = common.median_ci([float(i + 1) for i in range(n)])
    assert (low, high) == ranks


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 100.0), st.floats(0.01, 100.0)), min_size=1))
def test_ratio_summary_pairs_each_repetition_with_its_own_baseline(
    pairs: list[tuple[float, float]],
) -> None:
    values, baseline = [v for v, _ in pairs], [b for _, b in pairs]
    summary = common.ratio_summary(values, baseline)
    ratios = [v / b for v, b in pairs]
    assert summary["ratio_median"] == statistics.median(ratios)
    assert summary["ratio_spread"] == [min(ratios), max(ratios)]
    low, high = summary["ratio_ci95"]
    assert min(ratios) <= low <= summary["ratio_median"] <= high <= max(ratios)


def test_ratio_summary_refuses_unpaired_lists() -> None:
    with pytest.raises(ValueError):
        common.ratio_summary([1.0, 2.0], [1.0])
