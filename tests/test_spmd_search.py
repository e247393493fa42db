"""Program search: A* with an admissible heuristic, uniform-cost search and exhaustive enumeration
agree on the optimum; A* expands fewer states."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from plait.cluster.loader import parse_cluster
from plait.cost.program import Problem, evaluate
from plait.cost.spmd import Devices, balanced_time, compute_time
from plait.graph.aten_capture import capture_aten
from plait.graph.zoo import load_model
from plait.ir.program import Comm, ShardingError
from plait.spmd.search import SearchBudgetExceeded, _lower_bounds, beam_search, exhaustive, search


def mixed_cluster(inter: str = "100 Gb/s"):
    """One V100 node and one node of two P100s (HAP's GPU kinds), `inter` between them."""
    return parse_cluster({"name": "v100-p100", "nodes": [
        {"name": "v", "gpus": {"kind": "v100-16gb", "count": 1},
         "nic": {"type": "infiniband", "bandwidth": inter}},
        {"name": "p", "gpus": {"kind": "p100-16gb", "count": 2},
         "intra": {"type": "nvlink", "bandwidth": "80 GB/s"}, "nic": {"type": "infiniband", "bandwidth": inter}},
    ]})


class Block(nn.Module):
    def __init__(self, h: int = 256, f: int = 1024) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(h, f), nn.Linear(f, h), nn.LayerNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x + self.fc2(torch.relu(self.fc1(x))))


@functools.cache
def problem(batch: int, inter: str = "100 Gb/s") -> Problem:
    graph = capture_aten(Block(), (torch.randn(batch, 256),), name="block")
    return Problem.build(graph, Devices.from_cluster(mixed_cluster(inter)))


def flops_ratios(p: Problem) -> np.ndarray:
    return p.devices.flops / p.devices.flops.sum()


@pytest.mark.parametrize("batch, inter", [(8192, "100 Gb/s"), (256, "100 Gb/s"), (64, "10.4 Gb/s")])
def test_astar_ucs_and_exhaustive_find_the_same_optimum(batch, inter) -> None:
    p = problem(batch, inter)
    r = flops_ratios(p)
    astar, ucs, every = search(p, r), search(p, r, heuristic=False), exhaustive(p, r)
    assert astar.cost == pytest.approx(every.cost, rel=1e-12)
    assert ucs.cost == pytest.approx(every.cost, rel=1e-12)
    assert astar.expanded <= ucs.expanded
    # the reported cost is what replaying the chosen strategies costs
    choice = [p.options[k].index(astar.strategies[op.name]) for k, op in enumerate(p.graph.ops)]
    assert evaluate(p, choice, r).cost == pytest.approx(astar.cost, rel=1e-12)


def test_stored_parameters_are_priced_from_their_home_and_the_search_stays_exact() -> None:
    """`Problem.homes` (ZeRO-3 storage): a parameter stored in shards is all-gathered for a whole
    read and its gradient reduce-scattered home (not all-reduced); A*, uniform-cost search and
    exhaustive enumeration still agree, and replaying the data-parallel program costs exactly
    the all-gather and reduce-scatter in place of the all-reduce."""
    import dataclasses

    from plait.cost.spmd import choose

    p = problem(8192)
    homes = {"p_fc1_weight": "S0", "p_fc2_weight": "S1"}
    ph = dataclasses.replace(p, homes=homes)
    r = flops_ratios(p)
    astar, ucs, every = search(ph, r), search(ph, r, heuristic=False), exhaustive(ph, r)
    assert astar.cost == pytest.approx(every.cost, rel=1e-12) and ucs.cost == pytest.approx(every.cost, rel=1e-12)
    assert astar.homes == homes
    base = search(p, r)  # data parallel at this batch
    choice = [p.options[k].index(base.strategies[op.name]) for k, op in enumerate(p.graph.ops)]
    stored = evaluate(ph, choice, r)
    moved = {(c.op, c.tensor, c.phase, c.dim) for _, c in stored.comms if c.tensor in homes}
    assert moved == {("all_gather", "p_fc1_weight", "fwd", 0), ("reduce_scatter", "p_fc1_weight", "bwd", 0),
                     ("all_gather", "p_fc2_weight", "fwd", 1), ("reduce_scatter", "p_fc2_weight", "bwd", 1)}
    nbytes = {t: p.graph.tensors[t].nbytes for t in homes}
    delta = sum(choose(Comm(op, t, nbytes[t], ph_, d), p.devices, r)[1] for op, t, ph_, d in moved) \
        - sum(choose(Comm("all_reduce", t, nbytes[t], "bwd"), p.devices, r)[1] for t in homes)
    assert stored.cost == pytest.approx(base.cost + delta, rel=1e-12)


def test_the_optimum_moves_from_data_to_tensor_parallel_as_the_batch_shrinks() -> None:
    big = search(problem(8192), flops_ratios(problem(8192)))
    assert all(s.inputs[0] == "S0" for name, s in big.strategies.items() if name.startswith("linear"))
    grads = {c.tensor for _, c in big.comms if c.op == "all_reduce" and c.phase == "bwd"}
    assert {"p_fc1_weight", "p_fc2_weight"} <= grads  # data parallel: gradients all-reduced
    small = search(problem(256), flops_ratios(problem(256)))
    fc1, fc2 = small.strategies["linear"], small.strategies["linear_1"]
    assert (fc1.inputs, fc1.outputs) == (("R", "S0", "S0"), ("S1",))  # column parallel
    assert (fc2.inputs, fc2.outputs) == (("S1", "S1", "P"), ("P",))  # row parallel
    assert [(c.op, c.phase) for _, c in small.comms] == [("all_reduce", "fwd")]  # Megatron's g only


def test_heuristic_is_a_lower_bound_of_every_strategy() -> None:
    p = problem(1024)
    rng = np.random.default_rng(0)
    for _ in range(5):
        r = rng.dirichlet(np.ones(3))
        for k, options in enumerate(p.options):
            bound = balanced_time(p.work[k])
            assert all(compute_time(p.work[k], s.splits_work, r) >= bound * (1 - 1e-12) for s in options)
    # the search's h (cheapest strategy of each op at the ratios) is between the perfect-balance
    # bound and the cost of every complete program
    r = flops_ratios(p)
    h = _lower_bounds(p, r)
    assert h[0] >= p.lower[0] * (1 - 1e-12)
    for choice in itertools.islice(itertools.product(*(range(len(o)) for o in p.options)), 200):
        try:
            assert evaluate(p, choice, r).cost >= h[0] * (1 - 1e-12)
        except ShardingError:
            pass


def test_astar_expands_fewer_states_than_ucs_on_a_transformer() -> None:
    spec = load_model("vit:layers=1,hidden=64,heads=4,patch=8,image=32,classes=10")
    graph = capture_aten(spec.build("meta"), spec.sample_batch(64, device="meta")[0], name="vit")
    p = Problem.build(graph, Devices.from_cluster(mixed_cluster()))
    r = flops_ratios(p)
    astar, ucs = search(p, r), search(p, r, heuristic=False)
    assert astar.cost == pytest.approx(ucs.cost, rel=1e-12)
    assert astar.expanded < ucs.expanded
    print(f"vit 1 layer, {len(graph.ops)} ops: A* expanded {astar.expanded}, uniform-cost {ucs.expanded}")
    beam = beam_search(p, r, width=16)
    assert not beam.optimal and beam.cost >= astar.cost * (1 - 1e-12)
    assert beam.cost == pytest.approx(astar.cost, rel=1e-9)  # here the beam finds the optimum too
    with pytest.raises(SearchBudgetExceeded, match="stopped after 10 states"):
        search(p, r, max_states=10)


def test_bad_ratios_are_refused() -> None:
    p = problem(64)
    with pytest.raises(ShardingError, match="one per device \\(3\\)"):
        search(p, [0.5, 0.5])
    with pytest.raises(ShardingError, match="sum to 1"):
        search(p, [0.5, 0.5, 0.5])
