"""bench/recorder_overhead.py's verdict rule (the protocol in its docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from recorder_overhead import median_ci, verdict  # noqa: E402


def test_verdicts() -> None:
    assert verdict(-0.005, 0.01, 0.02) == "PASS"
    assert verdict(0.044, 0.243, 0.02) == "FAIL"  # wholly above the goal, however wide
    assert verdict(-0.2, 0.2, 0.02) == "INCONCLUSIVE"  # wider than the goal
    assert verdict(0.01, 0.025, 0.02) == "INCONCLUSIVE"  # straddles it


def test_median_interval_of_ten_pairs_is_the_2nd_and_9th() -> None:
    low, high, coverage = median_ci([float(i) for i in range(10, 0, -1)])
    assert (low, high) == (2.0, 9.0) and abs(coverage - 0.978515625) < 1e-12
