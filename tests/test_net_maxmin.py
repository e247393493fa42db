"""Max-min fairness (progressive filling) against hand-computed cases and an LP; the engine's
sharing; expected maximum load of random hashing against enumeration and Monte Carlo."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from scipy.optimize import linprog

from plait.net.ecmp import expected_max_load, prob_max_at_most
from plait.net.maxmin import link_loads, max_min_rates
from plait.sim.engine import TaskGraph, simulate


def test_single_link_equal_shares() -> None:
    assert max_min_rates([12.0], [[(0, 1)]] * 3) == [4.0, 4.0, 4.0]


def test_classic_parking_lot() -> None:
    # Bertsekas & Gallager's example: a long flow over links 0 and 1, a short flow on each.
    # Link 0 (cap 1) is shared by two flows: 0.5 each; the short flow on link 1 (cap 2) gets
    # what the long flow leaves: 1.5.
    rates = max_min_rates([1.0, 2.0], [[(0, 1), (1, 1)], [(0, 1)], [(1, 1)]])
    assert rates == pytest.approx([0.5, 0.5, 1.5])


def test_bottleneck_elsewhere_frees_bandwidth() -> None:
    # Flow 0 is held to 1 by link 1; flow 1 gets the rest of link 0 (not an equal split).
    rates = max_min_rates([10.0, 1.0], [[(0, 1), (1, 1)], [(0, 1)]])
    assert rates == pytest.approx([1.0, 9.0])


def test_weights_count_as_copies() -> None:
    # A flow standing for 3 copies gets 3/4 of the link: each copy as much as the lone flow.
    rates = max_min_rates([8.0], [[(0, 3)], [(0, 1)]])
    assert [rates[0] * 3, rates[1]] == pytest.approx([6.0, 2.0])


def _lexmax_by_lp(cap: list[float], flows: list[list[int]]) -> list[float]:
    """Max-min fair rates by repeated LPs: maximise the smallest unfrozen rate, freeze the flows
    that cannot grow beyond it, repeat (the definition, independent of progressive filling)."""
    n = len(flows)
    fixed: dict[int, float] = {}
    while len(fixed) < n:
        free = [f for f in range(n) if f not in fixed]
        # variables: rates (n) and t; maximise t with r_f >= t for free flows
        c = np.zeros(n + 1)
        c[-1] = -1
        a_ub, b_ub = [], []
        for link, capacity in enumerate(cap):
            row = np.zeros(n + 1)
            for f in range(n):
                if link in flows[f]:
                    row[f] = 1
            a_ub.append(row)
            b_ub.append(capacity)
        for f in free:
            row = np.zeros(n + 1)
            row[f], row[-1] = -1, 1
            a_ub.append(row)
            b_ub.append(0)
        bounds = [(fixed[f], fixed[f]) if f in fixed else (0, None) for f in range(n)] + [(0, None)]
        t = -linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs").fun
        # a free flow is frozen at t when it cannot exceed t while the others keep >= t
        for f in free:
            c2 = np.zeros(n + 1)
            c2[f] = -1
            b2 = [(fixed[g], fixed[g]) if g in fixed else (t - 1e-9, None) for g in range(n)] + [(0, None)]
            best = -linprog(c2, A_ub=a_ub[: len(cap)], b_ub=b_ub[: len(cap)], bounds=b2, method="highs").fun
            if best <= t + 1e-7:
                fixed[f] = t
    return [fixed[f] for f in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_progressive_filling_matches_the_lp_definition(seed: int) -> None:
    rng = random.Random(seed)
    cap = [rng.choice([1.0, 2.0, 3.0, 5.0]) for _ in range(5)]
    flows = [sorted(rng.sample(range(5), rng.randint(1, 3))) for _ in range(7)]
    got = max_min_rates(cap, [[(link, 1.0) for link in f] for f in flows])
    assert got == pytest.approx(_lexmax_by_lp(cap, flows), abs=1e-6)
    loads = link_loads(5, [[(link, 1.0) for link in f] for f in flows], got)
    assert all(x <= c + 1e-9 for x, c in zip(loads, cap))


def test_engine_shares_max_min_fairly() -> None:
    # Two links: A (cap 10) carries flows 0 and 1, B (cap 1) also carries flow 0. Min of
    # capacity over load would give flow 1 only 5; max-min gives it 9 while flow 0 is held to 1.
    g = TaskGraph()
    a, b = g.add_resource(("A",), 10.0), g.add_resource(("B",), 1.0)
    g.add("long", "comm", "x", flow=[(a, 1.0, 1.0), (b, 1.0, 1.0)])
    g.add("short", "comm", "y", flow=[(a, 9.0, 1.0)])
    s = simulate(g)
    assert s.end[1] == pytest.approx(1.0)
    assert s.end[0] == pytest.approx(1.0)


def test_engine_rates_recomputed_when_a_flow_ends() -> None:
    # Two equal flows share a link of 2 B/s; flow 0 has 1 byte, flow 1 has 3: flow 0 ends at 1 s,
    # flow 1 then gets the whole link: 2 bytes left at 2 B/s -> ends at 2 s.
    g = TaskGraph()
    r = g.add_resource(("L",), 2.0)
    g.add("a", "comm", "x", flow=[(r, 1.0, 1.0)])
    g.add("b", "comm", "y", flow=[(r, 3.0, 1.0)])
    s = simulate(g)
    assert (s.end[0], s.end[1]) == pytest.approx((1.0, 2.0))


@pytest.mark.parametrize("n,k", [(4, 8), (5, 3), (3, 4), (6, 4)])
def test_expected_max_load_by_enumeration(n: int, k: int) -> None:
    total = sum(max(np.bincount(a, minlength=k)) for a in itertools.product(range(k), repeat=n))
    assert expected_max_load(n, k) == pytest.approx(total / k**n, rel=1e-12)


def test_expected_max_load_issue_figures() -> None:
    assert round(expected_max_load(8, 8), 3) == 2.597
    assert round(expected_max_load(4, 8), 3) == 1.648
    assert round(expected_max_load(16, 16), 3) == 3.078
    assert prob_max_at_most(8, 8, 8) == 1 and prob_max_at_most(9, 2, 4) == 0


def test_monte_carlo_of_the_flow_model_agrees() -> None:
    # 8 unit flows hashed by ECMP onto 8 unit links: the slowest flow's max-min rate is
    # 1 / (flows on its link); the mean of 1/rate over hash seeds is E[max load].
    from plait.net.ecmp import FiveTuple, choose, source_port

    n, k, trials = 8, 8, 3000
    acc = 0.0
    for seed in range(trials):
        links = [choose(FiveTuple(1, 2, source_port(f)), k, seed, "leaf") for f in range(n)]
        rates = max_min_rates([1.0] * k, [[(link, 1.0)] for link in links])
        acc += 1 / min(rates)
    assert acc / trials == pytest.approx(expected_max_load(n, k), rel=0.03)


@pytest.mark.parametrize("seed", range(20))
def test_numpy_filling_equals_the_dictionary_one(seed: int) -> None:
    from plait.net.maxmin import _max_min_dict, max_min_rates_np

    rng = random.Random(seed)
    links = rng.randint(1, 30)
    cap = [rng.choice([1.0, 2.0, 3.5, 1e10]) for _ in range(links)]
    flows = [[(r, rng.choice([0.0, 0.5, 1.0, 2.0])) for r in rng.sample(range(links), rng.randint(0, min(5, links)))]
             for _ in range(rng.randint(1, 80))]
    assert max_min_rates_np(cap, flows) == pytest.approx(_max_min_dict(cap, flows), rel=1e-9)
