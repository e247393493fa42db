"""The figures a `SimResult` reports from its schedule -- busy fraction per compute stream, task
seconds per category, exposed communication -- against a plain interval-by-interval reference
on random schedules (the vectorised `plait.sim.api` functions sort, merge and subtract with
NumPy)."""

import numpy as np
import pytest

from plait.sim.api import _exposed_comm, busy_and_breakdown
from plait.sim.engine import Schedule, TaskGraph

CATEGORIES = ["forward", "backward", "recompute", "optimizer", "comm_dp", "comm_pp", "data", "h2d"]


def _union(spans):
    out = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _reference(tg, sched, folded):
    """Busy fractions, per-category seconds and exposed communication, one interval at a time."""
    T = sched.makespan
    spans, by_cat, comp, comm, blocked = {}, {}, {}, {}, {}
    for i, (res, cat, dev, a, b) in enumerate(zip(tg.resource, tg.category, tg.device, sched.start, sched.end)):
        if res.endswith("/compute"):
            spans.setdefault(res, []).append((a, b))
        by_cat[cat] = by_cat.get(cat, 0.0) + (b - a)
        if dev is None:
            continue
        if cat in ("forward", "backward", "recompute", "optimizer"):
            comp.setdefault(dev, []).append((a, b))
            blocked[dev] = blocked.get(dev, 0.0) + folded.get(i, 0.0)
        elif cat.startswith("comm"):
            comm.setdefault(dev, []).append((a, b))
    busy = {r: sum(b - a for a, b in _union(v)) / T for r, v in sorted(spans.items())}
    worst = 0.0
    for dev in set(comp) | set(comm) | set(blocked):
        cu = _union(comp.get(dev, []))
        total = 0.0
        for a, b in _union(comm.get(dev, [])):
            overlap = sum(max(0.0, min(b, e) - max(a, s)) for s, e in cu)
            total += max(0.0, (b - a) - overlap)
        worst = max(worst, total + blocked.get(dev, 0.0))
    return busy, by_cat, worst


def _random_schedule(rng):
    tg = TaskGraph()
    n = int(rng.integers(1, 300))
    devices = int(rng.integers(1, 6))
    start, end = [], []
    grid = float(rng.choice([0.25, 1e-3]))  # coarse times make touching and equal intervals common
    for _ in range(n):
        cat = str(rng.choice(CATEGORIES))
        dev = None if rng.random() < 0.1 else int(rng.integers(devices))
        res = f"dev{dev}/compute" if cat in CATEGORIES[:4] else f"dev{dev}/{cat}"
        tg.add("t", cat, res, device=dev)
        a = float(rng.integers(0, 200)) * grid
        start.append(a)
        end.append(a + float(rng.integers(0, 20)) * grid)
    folded = {i: float(rng.random()) * grid for i in range(n) if rng.random() < 0.3}
    return tg, Schedule(start, end, [-1] * n, max(end), n), folded


@pytest.mark.parametrize("seed", range(40))
def test_figures_equal_the_interval_by_interval_reference(seed):
    tg, sched, folded = _random_schedule(np.random.default_rng(seed))
    busy, by_cat, worst = _reference(tg, sched, folded)
    got_busy, got_cat = busy_and_breakdown(tg, sched)
    assert list(got_busy) == list(busy) and list(got_cat) == list(by_cat)
    for k in busy:
        assert got_busy[k] == pytest.approx(busy[k], rel=1e-12, abs=1e-15)
    for k in by_cat:
        assert got_cat[k] == pytest.approx(by_cat[k], rel=1e-12, abs=1e-15)
    assert _exposed_comm(tg, sched, folded) == pytest.approx(worst, rel=1e-12, abs=1e-15)


def test_exposed_communication_of_a_hand_made_schedule():
    """Device 0 computes [0, 2) and [3, 4); its communication [1, 5) is exposed over [2, 3) and
    [4, 5): 2 s; device 1 has 0.5 s of folded tensor-parallel time and no communication."""
    tg = TaskGraph()
    for cat, dev in [("forward", 0), ("backward", 0), ("comm_dp", 0), ("forward", 1)]:
        tg.add("t", cat, f"dev{dev}/{'compute' if cat != 'comm_dp' else 'dp'}", device=dev)
    sched = Schedule([0.0, 3.0, 1.0, 0.0], [2.0, 4.0, 5.0, 1.0], [-1] * 4, 5.0, 4)
    assert _exposed_comm(tg, sched, {}) == 2.0
    assert _exposed_comm(tg, sched, {3: 2.5}) == 2.5
    busy, by_cat = busy_and_breakdown(tg, sched)
    assert busy == {"dev0/compute": 3.0 / 5.0, "dev1/compute": 1.0 / 5.0}
    assert by_cat == {"forward": 3.0, "backward": 1.0, "comm_dp": 4.0}
