"""Discrete-event engine: precedence, bandwidth sharing on links, slowest-link pacing, critical path."""

from __future__ import annotations

import pytest

from plait.sim.engine import EngineError, TaskGraph, simulate


def test_chain_and_join() -> None:
    g = TaskGraph()
    a = g.add("a", "forward", "dev0/compute", 1.0)
    b = g.add("b", "forward", "dev0/compute", 2.0, [a])
    c = g.add("c", "forward", "dev1/compute", 5.0)
    d = g.add("d", "backward", "dev0/compute", 1.0, [b, c])
    s = simulate(g)
    assert (s.start[b], s.end[b], s.start[d], s.makespan) == (1.0, 3.0, 5.0, 6.0)
    assert s.critical_path() == [c, d]  # d waited for c, not for b


def test_two_transfers_on_one_link_take_twice_as_long() -> None:
    g = TaskGraph()
    link = g.add_resource(("link", 0, 1), 1e9)
    alone = TaskGraph()
    r = alone.add_resource(("link", 0, 1), 1e9)
    alone.add("x", "comm_pp", "link", 0.0, flow=[(r, 1e9, 1.0)])
    assert simulate(alone).makespan == pytest.approx(1.0)
    x = g.add("x", "comm_pp", "link", 0.0, flow=[(link, 1e9, 1.0)])
    y = g.add("y", "comm_pp", "link", 0.0, flow=[(link, 1e9, 1.0)])
    s = simulate(g)
    assert s.end[x] == pytest.approx(2.0) and s.end[y] == pytest.approx(2.0)


def test_late_joiner_and_rate_recovery() -> None:
    """x starts alone, y joins at t=0.5 on the same link: fair sharing until x ends, then y alone."""
    g = TaskGraph()
    link = g.add_resource(("link",), 1e9)
    x = g.add("x", "comm", "l", 0.0, flow=[(link, 1e9, 1.0)])
    w = g.add("wait", "forward", "dev0/compute", 0.5)
    y = g.add("y", "comm", "l", 0.0, [w], flow=[(link, 1e9, 1.0)])
    s = simulate(g)
    # x: 0.5 GB alone, then 0.5 GB at half rate -> ends at 1.5; y: 0.5 GB shared, 0.5 GB alone -> 2.0
    assert s.end[x] == pytest.approx(1.5)
    assert s.end[y] == pytest.approx(2.0)


def test_copies_count_on_shared_resources() -> None:
    """A representative flow standing for 4 identical flows gets a quarter of a shared NIC."""
    g = TaskGraph()
    nic = g.add_resource(("nic",), 4e9)
    t = g.add("rep", "comm_dp", "l", 1e-3, flow=[(nic, 1e9, 4.0)])
    s = simulate(g)
    assert s.end[t] == pytest.approx(1e-3 + 1.0)


def test_collective_runs_at_pace_of_slowest_link() -> None:
    g = TaskGraph()
    fast = g.add_resource(("pair", 0, 1), 100e9)
    slow = g.add_resource(("pair", 1, 0), 10e9)
    nbytes = 1e9
    t = g.add("allreduce", "comm_dp", "dev0/comm", 2e-6, flow=[(fast, nbytes, 1.0), (slow, nbytes, 1.0)])
    assert simulate(g).end[t] == pytest.approx(2e-6 + nbytes / 10e9)


def test_cycle_is_reported() -> None:
    g = TaskGraph()
    a = g.add("a", "forward", "x", 1.0)
    b = g.add("b", "forward", "x", 1.0, [a])
    g.add_dep(b, a)
    with pytest.raises(EngineError, match="cycle"):
        simulate(g)


def test_recurring_flow_sets_share_rates_exactly() -> None:
    """Rounds of the same three flows (two over a shared 1 GB/s link, one alone over a 4 GB/s
    one): the engine computes each set's max-min levels once and reuses them, and every round
    still takes its hand-computed time (the shared pair 2 s at 0.5 GB/s each, the lone flow
    1 GB at 4 GB/s = 0.25 s)."""
    g = TaskGraph()
    link = g.add_resource(("link",), 1e9)
    other = g.add_resource(("other",), 4e9)
    prev: list[int] = []
    rounds = []
    for _ in range(4):
        x = g.add("x", "comm", "l", 0.0, prev, flow=[(link, 1e9, 1.0), (other, 1e9, 1.0)])
        y = g.add("y", "comm", "l", 0.0, prev, flow=[(link, 1e9, 1.0)])
        z = g.add("z", "comm", "m", 0.0, prev, flow=[(other, 1e9, 1.0)])
        prev = [x, y, z]
        rounds.append((x, y, z))
    s = simulate(g)
    for k, (x, y, z) in enumerate(rounds):
        # z shares `other` with x (x runs at 0.5 GB/s there): z gets 3.5 GB/s, then 4 after x ends
        assert s.end[x] == pytest.approx(2.0 * (k + 1)) and s.end[y] == pytest.approx(2.0 * (k + 1))
        assert s.end[z] == pytest.approx(2.0 * k + 1e9 / 3.5e9)
    assert s.makespan == pytest.approx(8.0)
