"""Placement: Pipette's path model by hand, annealing vs brute force, determinism, never worse."""

from __future__ import annotations

import numpy as np
import pytest

from plait.planners.placement import (
    MOVES,
    PathModel,
    PlacementError,
    Traffic,
    anneal,
    apply_move,
    brute_force,
)
from plait.planners.types import Candidate

GB = 1e9


def test_moves_are_permutations_and_do_what_they_say():
    seq = np.arange(6)
    assert apply_move(seq, "swap", 1, 4).tolist() == [0, 4, 2, 3, 1, 5]
    assert apply_move(seq, "insert", 1, 4).tolist() == [0, 2, 3, 4, 1, 5]
    assert apply_move(seq, "2opt", 1, 4).tolist() == [0, 4, 3, 2, 1, 5]
    # cut [1..2] = (1, 2), reverse -> (2, 1), insert at position 2 of [0, 3, 4, 5]
    assert apply_move(seq, "reversed_insert", 1, 2, 2).tolist() == [0, 3, 2, 1, 4, 5]
    rng = np.random.default_rng(0)
    for move in MOVES:
        for _ in range(20):
            i, j = sorted(rng.choice(6, 2, replace=False).tolist())
            out = apply_move(seq, move, i, j, int(rng.integers(0, 6 - (j - i))))
            assert sorted(out.tolist()) == list(range(6))
    with pytest.raises(PlacementError):
        apply_move(seq, "shuffle", 0, 1)


def test_path_model_matches_the_formulas_by_hand():
    # 4 devices: 0-1 fast (100 GB/s), everything else 10 GB/s, 2-3 at 1 GB/s
    bw = np.full((4, 4), 10 * GB)
    bw[0, 1] = bw[1, 0] = 100 * GB
    bw[2, 3] = bw[3, 2] = 1 * GB
    traffic = Traffic(tp_bytes=1e6, tp_count=3, pp_bytes=2e6, pp_count=5, dp_bytes=4e6)
    # dp=2, tp=2, pp=1: tp groups (0,1) and (2,3); dp rings (0,2) and (1,3)
    m = PathModel(bw, traffic, dp=2, tp=2, pp=1)
    parts = m.breakdown([0, 1, 2, 3])
    ring2 = 2 * (2 - 1) / 2
    assert parts["tp"] == pytest.approx(3 * ring2 * 1e6 / (1 * GB))  # slowest group: 2-3
    assert parts["dp"] == pytest.approx(ring2 * 4e6 / (10 * GB))
    assert parts["pp"] == 0
    # dp=1, tp=1, pp=4: one pipeline 0->1->2->3, sum of 2*msg/BW per hop
    m = PathModel(bw, traffic, dp=1, tp=1, pp=4)
    expect = 5 * (2 * 2e6 / (100 * GB) + 2 * 2e6 / (10 * GB) + 2 * 2e6 / (1 * GB))
    assert m.breakdown([0, 1, 2, 3])["pp"] == pytest.approx(expect)
    # dp=4 ring: 2(d-1)/d * msg * max 1/BW over the ring's links
    m = PathModel(bw, traffic, dp=4, tp=1, pp=1)
    assert m.breakdown([0, 1, 2, 3])["dp"] == pytest.approx(2 * 3 / 4 * 4e6 / (1 * GB))
    # latency adds 2(k-1) alpha per ring and 2 alpha per pipeline hop
    lat = np.full((4, 4), 1e-5)
    m = PathModel(bw, Traffic(dp_bytes=4e6), dp=4, tp=1, pp=1, latency=lat)
    assert m.breakdown([0, 1, 2, 3])["dp"] == pytest.approx(2 * 3 / 4 * 4e6 / GB + 6e-5)


def _random_bw(n: int, rng: np.random.Generator) -> np.ndarray:
    bw = rng.uniform(1 * GB, 100 * GB, (n, n))
    return (bw + bw.T) / 2


@pytest.mark.parametrize("n,shape", [(6, (3, 1, 2)), (6, (1, 2, 3)), (6, (2, 3, 1)),
                                     (8, (2, 2, 2)), (8, (2, 1, 4))])
def test_annealing_finds_the_brute_force_optimum(n, shape):
    rng = np.random.default_rng(n * 100 + sum(shape))
    dp, tp, pp = shape
    traffic = Traffic(tp_bytes=1e6, tp_count=8, pp_bytes=2e6, pp_count=4, dp_bytes=5e7)
    for trial in range(2):
        m = PathModel(_random_bw(n, rng), traffic, dp=dp, tp=tp, pp=pp)
        _, best = brute_force(m)
        res = anneal(m, ["A100"] * n, list(range(n)), seed=trial)
        assert res.cost == pytest.approx(best, rel=1e-9)
        assert float(m.cost(np.asarray(res.order))) == pytest.approx(res.cost)
        assert res.cost <= res.default_cost


def test_annealing_is_deterministic_and_keeps_kinds():
    rng = np.random.default_rng(3)
    n = 8
    bw = _random_bw(n, rng)
    m = PathModel(bw, Traffic(tp_bytes=1e6, tp_count=8, pp_bytes=2e6, pp_count=4, dp_bytes=5e7), dp=2, tp=2, pp=2)
    kinds = ["A100"] * 4 + ["V100"] * 4
    nodes = [0, 0, 1, 1, 2, 2, 3, 3]
    a = anneal(m, kinds, nodes, seed=7, iterations=500)
    b = anneal(m, kinds, nodes, seed=7, iterations=500)
    assert a.order == b.order and a.cost == b.cost
    # every rank keeps the GPU kind it had in the start order
    assert [kinds[d] for d in a.order] == kinds
    assert a.cost <= a.default_cost


def test_node_level_moves_fix_a_slow_pair_of_nodes():
    # 4 nodes x 2 GPUs; nodes 0-1 and 2-3 are joined by slow links, 0-2 and 1-3 fast.
    # pp=2 over nodes: Megatron order puts stage 0 on nodes 0,1 and stage 1 on nodes 2,3.
    nodes = [0, 0, 1, 1, 2, 2, 3, 3]
    bw = np.empty((8, 8))
    for a in range(8):
        for b in range(8):
            na, nb = nodes[a], nodes[b]
            if na == nb:
                bw[a, b] = 300 * GB
            elif {na, nb} in ({0, 1}, {2, 3}):
                bw[a, b] = 2.5 * GB
            else:
                bw[a, b] = 25 * GB
    m = PathModel(bw, Traffic(tp_bytes=1e6, tp_count=128, pp_bytes=4e6, pp_count=8, dp_bytes=2e7), dp=2, tp=2, pp=2)
    res = anneal(m, ["A100"] * 8, nodes, seed=0)
    _, best = brute_force(m)
    assert res.cost == pytest.approx(best)
    assert res.gain > 1.5
    # tensor groups stay inside a node
    assert all(nodes[res.order[2 * g]] == nodes[res.order[2 * g + 1]] for g in range(4))


def test_bad_inputs_raise_placement_errors():
    with pytest.raises(PlacementError, match="square"):
        PathModel(np.ones((2, 3)), Traffic(), dp=1, tp=1, pp=1)
    with pytest.raises(PlacementError, match="needs 8 devices"):
        PathModel(np.ones((4, 4)), Traffic(), dp=2, tp=2, pp=2)
    m = PathModel(np.ones((4, 4)), Traffic(dp_bytes=1.0), dp=4, tp=1, pp=1)
    with pytest.raises(PlacementError, match="permutation"):
        anneal(m, ["a"] * 4, [0, 0, 1, 1], start=[0, 0, 1, 2])


@pytest.mark.parametrize("n,dp,tp,pp", [(16, 16, 1, 1), (16, 2, 2, 4), (32, 8, 2, 2), (48, 3, 4, 4), (40, 10, 2, 2),
                                        (16, 1, 2, 8), (200, 100, 1, 2), (512, 16, 8, 4)])
def test_fast_energy_is_the_baseline_to_the_last_bit(n, dp, tp, pp):
    """The annealing's fast paths (one order's rings gathered by precomputed positions; one order
    in plain Python floats, `_OneOrder`; energies remembered per order) give the baseline's
    seconds bit for bit, so the same walk and result."""
    from plait.planners.placement import _OneOrder

    rng = np.random.default_rng(n + dp)
    bw = rng.uniform(1 * GB, 100 * GB, (n, n))
    model = PathModel((bw + bw.T) / 2, Traffic(tp_bytes=1e6, tp_count=3.0, pp_bytes=2e5, pp_count=5.0,
                                               dp_bytes=3e7), dp=dp, tp=tp, pp=pp,
                      latency=rng.uniform(1e-6, 1e-5, (n, n)))
    one = _OneOrder(model)
    for _ in range(20):
        order = rng.permutation(n)
        fast, slow = model.cost_and_mean(order), model.cost_and_mean(order, fast=False)
        assert (float(fast[0]), float(fast[1])) == (float(slow[0]), float(slow[1])) == one.cost_and_mean(order)
        batch = model.cost_and_mean(order[None, :])
        assert (float(batch[0][0]), float(batch[1][0])) == (float(fast[0]), float(fast[1]))
    kinds = ["a" if d < n // 2 else "b" for d in range(n)]
    nodes = [d // 8 for d in range(n)]
    a = anneal(model, kinds, nodes, iterations=400, fast=True)
    b = anneal(model, kinds, nodes, iterations=400, fast=False)
    assert (a.order, a.cost, a.accepted, a.breakdown) == (b.order, b.cost, b.accepted, b.breakdown)


def test_path_model_reductions_are_numpy_max_and_mean_bit_for_bit():
    from plait.planners.placement import _max, _mean

    rng = np.random.default_rng(3)
    for shape in [(3, 5), (2, 3, 17), (4, 2, 9, 8), (1, 1, 1)]:
        x = rng.uniform(1e-9, 1e-3, shape) * rng.uniform(1, 1e6)
        for axis in (-1, (-1, -2)) if len(shape) > 1 else (-1,):
            assert np.array_equal(_max(x, axis), x.max(axis=axis))
            assert np.array_equal(_mean(x, axis), x.mean(axis=axis))  # exact, not approximate
        sw = np.swapaxes(x, -1, -2)  # a strided view, as the data-parallel rings are
        assert np.array_equal(_mean(sw, -1), sw.mean(axis=-1))


def test_pairwise_sum_is_numpy_add_reduce_bit_for_bit():
    """`_pairwise_sum` (the plain-Python energy's sums) is NumPy's pairwise summation exactly,
    below 8 elements, up to its 128-element blocks and above."""
    from plait.planners.placement import _pairwise_sum

    rng = np.random.default_rng(5)
    for n in [*range(1, 40), 127, 128, 129, 300, 1000]:
        x = rng.uniform(0, 1, n) * 10.0 ** rng.integers(-9, 3, n)
        assert _pairwise_sum(x.tolist()) == float(np.add.reduce(x))


def test_the_start_order_is_kept_where_it_simulates_faster(monkeypatch):
    """Placement anneals a path model of communication, not the simulated time: where the
    simulator times the layout's start order faster (and it fits), that order is the pick and the
    annealed order's time is recorded; where the annealed order is faster it stays."""
    from plait.cluster import load_cluster
    from plait.graph.resolve import resolve_model
    from plait.ir.plan import Plan
    from plait.planners import threed
    from plait.planners.placement import PlacementResult

    cluster = load_cluster("a100-80g:nodes=1,gpus_per_node=4")
    placed = Plan.parse("dp=2,pp=2,micro_batch=1,global_batch=8,device_order=3:2:1:0")
    graph = resolve_model("gpt:layers=4,hidden=128,heads=4,seq=64,vocab=256", placed)
    mem = threed._MemoryFilter(graph, cluster, {})
    monkeypatch.setattr(threed, "_start_order", lambda groups, c: [0, 1, 2, 3])
    for start_s, kept in ((0.9, True), (1.1, False)):
        cand = Candidate(placed, iteration_time_s=1.0, placement=PlacementResult([3, 2, 1, 0], 1.0, 2.0))
        times = {None: start_s, (3, 2, 1, 0): 1.0}

        def evaluate(g, p, times=times):
            return {"iteration_time_s": times[tuple(p.device_order) if p.device_order else None]}

        threed._default_order_baseline([cand], [], graph, evaluate, mem)
        assert cand.default_order_time_s == start_s
        if kept:
            assert cand.plan.device_order is None and cand.iteration_time_s == 0.9 and cand.placed_time_s == 1.0
        else:
            assert cand.plan.device_order == [3, 2, 1, 0] and cand.iteration_time_s == 1.0
            assert cand.placed_time_s is None
