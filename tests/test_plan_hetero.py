"""Heterogeneous splits: exact layer DP and micro-batch shares against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planners.hetero import HeteroError, split_layers, split_micro_batches


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield [b[i + 1] - b[i] for i in range(k)]


def _stage_times(times: np.ndarray, split: list[int]) -> list[float]:
    b = np.cumsum([0, *split])
    return [float(times[p, b[p]:b[p + 1]].sum()) for p in range(len(split))]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(1, 4), st.integers(0, 2**31 - 1), st.booleans())
def test_layer_split_is_the_exact_bottleneck_then_sum_optimum(n, k, seed, capped):
    k = min(k, n)
    rng = np.random.default_rng(seed)
    times = rng.uniform(0.5, 2.0, (k, n))
    caps = [int(rng.integers(1, n + 1)) for _ in range(k)] if capped else None
    split = split_layers(times, caps)
    feasible = [c for c in _compositions(n, k) if caps is None or all(x <= y for x, y in zip(c, caps))]
    if not feasible:
        assert split is None
        return
    assert split is not None and sum(split) == n and min(split) >= 1
    if caps:
        assert all(x <= y for x, y in zip(split, caps))
    best = min(feasible, key=lambda c: (round(max(_stage_times(times, c)), 9), sum(_stage_times(times, c))))
    got, want = _stage_times(times, split), _stage_times(times, best)
    assert max(got) == pytest.approx(max(want), rel=1e-9)
    assert sum(got) == pytest.approx(sum(want), rel=1e-9)


def test_layer_split_gives_the_faster_stage_more_layers():
    # 12 equal layers, stage 0 twice as fast as stage 1: 8 + 4 balances them
    times = np.stack([np.full(12, 1.0), np.full(12, 2.0)])
    assert split_layers(times) == [8, 4]
    # memory caps stage 0 at 6 layers
    assert split_layers(times, caps=[6, 12]) == [6, 6]
    assert split_layers(times, caps=[5, 5]) is None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(0, 9), st.integers(0, 2**31 - 1))
def test_micro_batch_shares_are_min_max_optimal(dp, extra, seed):
    rng = np.random.default_rng(seed)
    m = dp + extra
    b = rng.uniform(1, 3, dp).tolist()
    s = [x * rng.uniform(1, 4) for x in b]
    counts = split_micro_batches(b, s, m)
    assert sum(counts) == m and min(counts) >= 1

    def finish(c):
        return max((x - 1) * bb + ss for x, bb, ss in zip(c, b, s))

    best = min(finish(c) for c in itertools.product(range(1, m + 1), repeat=dp) if sum(c) == m)
    assert finish(counts) == pytest.approx(best)


def test_faster_replica_gets_more_micro_batches():
    # replica 0 is 2x faster per micro-batch
    counts = split_micro_batches([1.0, 2.0], [2.0, 4.0], 12)
    assert counts[0] > counts[1] and sum(counts) == 12
    with pytest.raises(HeteroError):
        split_micro_batches([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 2)
