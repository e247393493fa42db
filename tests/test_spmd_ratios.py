"""The ratio LP with memory: against brute force on 2 and 3 devices, alternation with the search,
integer rounding that keeps shapes valid, and clear errors for what cannot be done."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch

from plait.cluster.loader import parse_cluster
from plait.cost.memory import memory_model
from plait.cost.program import Problem, evaluate, round_shards, segments
from plait.cost.spmd import Devices
from plait.graph.aten_capture import capture_aten
from plait.ir.program import ShardingError
from plait.spmd.ratios import segmented_cost, solve_ratios, synthesize
from plait.spmd.search import search
from tests.test_spmd_search import Block  # the one test block of the SPMD tests

GIB = 2.0**30


@functools.cache
def graph(batch: int):
    return capture_aten(Block(), (torch.randn(batch, 256),), name="block")


def devices(n: int, memory_gib: tuple[float, ...] | None = None, inter: str = "100 Gb/s") -> Devices:
    """n devices: one V100, then P100s on a second node (HAP's kinds); memory optionally replaced."""
    nodes = [{"name": "v", "gpus": {"kind": "v100-16gb", "count": 1},
              "nic": {"type": "infiniband", "bandwidth": inter}},
             {"name": "p", "gpus": {"kind": "p100-16gb", "count": n - 1},
              "intra": {"type": "nvlink", "bandwidth": "80 GB/s"},
              "nic": {"type": "infiniband", "bandwidth": inter}}]
    d = Devices.from_cluster(parse_cluster({"name": "mix", "nodes": nodes}))
    if memory_gib is not None:
        d = dataclasses.replace(d, memory=np.array(memory_gib) * GIB)
    return d


def simplex(n: int, step: float):
    k = round(1 / step)
    for parts in itertools.product(range(k + 1), repeat=n - 1):
        if sum(parts) <= k:
            yield np.array([*parts, k - sum(parts)]) / k


def choice_of(problem: Problem, program) -> list[int]:
    return [problem.options[k].index(program.strategies[op.name]) for k, op in enumerate(problem.graph.ops)]


@pytest.mark.parametrize("n, batch, step", [(2, 8192, 0.001), (3, 8192, 0.01), (3, 256, 0.01)])
def test_lp_matches_brute_force(n, batch, step) -> None:
    """The LP's ratios are optimal for the program: no point of a fine grid of the simplex is
    cheaper, and its predicted cost is what the program costs when replayed at them."""
    problem = Problem.build(graph(batch), devices(n))
    program = search(problem, problem.devices.flops / problem.devices.flops.sum())
    choice = choice_of(problem, program)
    lp = solve_ratios(problem, program)
    assert lp is not None
    replayed = evaluate(problem, choice, lp.ratios).cost
    assert lp.cost == pytest.approx(replayed, rel=1e-9)
    grid = min(evaluate(problem, choice, r).cost for r in simplex(n, step))
    assert lp.cost <= grid * (1 + 1e-9)
    assert grid <= lp.cost * (1 + 5 * step)  # the grid gets close


def test_lp_with_memory_matches_brute_force_and_respects_capacity() -> None:
    """Make the V100 small: the best ratios under memory differ from the unconstrained ones."""
    problem = Problem.build(graph(8192), devices(3, (1.0, 16.0, 16.0)))
    program = search(problem, problem.devices.flops / problem.devices.flops.sum())
    mem = memory_model(problem, program, overhead=0.0)
    free = problem.devices.memory - mem.replicated
    # room for only 25% of the sharded bytes on the V100
    tight = dataclasses.replace(mem, replicated=mem.replicated, sharded=mem.sharded)
    cap_v100 = mem.replicated + 0.25 * mem.sharded
    problem.devices = dataclasses.replace(problem.devices, memory=np.array([cap_v100, free[1] + 1e12, free[2] + 1e12]))
    unconstrained = solve_ratios(problem, program)
    constrained = solve_ratios(problem, program, tight)
    assert unconstrained.ratios[0] > 0.3 and constrained.ratios[0] == pytest.approx(0.25, abs=1e-6)
    assert np.all(constrained.memory <= problem.devices.memory * (1 + 1e-9))
    choice = choice_of(problem, program)
    feasible = [r for r in simplex(3, 0.01) if np.all(tight.on(r) <= problem.devices.memory)]
    grid = min(evaluate(problem, choice, r).cost for r in feasible)
    assert constrained.cost <= grid * (1 + 1e-9) and constrained.cost > unconstrained.cost


def test_synthesis_alternates_until_the_cost_stops_falling() -> None:
    problem = Problem.build(graph(8192), devices(3))
    result = synthesize(problem)
    assert result.cost == min(result.rounds)
    assert all(b < a for a, b in zip(result.rounds[:-2], result.rounds[1:-1]))  # fell until the last
    even = search(problem, np.full(3, 1 / 3))
    assert result.cost <= even.cost  # never worse than even sharding
    assert result.ratios[0] > 1 / 3  # the V100 takes more than its even share
    assert np.all(result.memory <= problem.devices.memory)
    assert result.program.optimal
    # past its state budget the exact search hands over to the beam search
    quick = synthesize(problem, max_states=3)
    assert not quick.program.optimal and quick.cost >= result.cost * (1 - 1e-9)


def two_segment_program(problem: Problem):
    """fc1 and relu data parallel (segment A), fc2 and the residual add redundant (an all-gather
    between), the layer norm sharded again from a free slice (segment B)."""
    want = {"linear": (("S0", "R", "R"), ("S0",)), "relu": (("S0",), ("S0",)),
            "linear_1": (("R", "R", "R"), ("R",)), "add": (("R", "R"), ("R",)),
            "layer_norm": (("S0", "R", "R"), ("S0",))}
    choice = [next(i for i, s in enumerate(opts) if (s.inputs, s.outputs) == want[op.name])
              for op, opts in zip(problem.graph.ops, problem.options)]
    return choice, evaluate(problem, choice, problem.devices.flops / problem.devices.flops.sum())


@pytest.mark.parametrize("n, step", [(2, 0.01), (3, 0.1)])
def test_segmented_lp_matches_brute_force(n, step) -> None:
    """HAP's LP: one ratio vector per segment, against a grid over every segment's simplex."""
    problem = Problem.build(graph(8192), devices(n))
    choice, program = two_segment_program(problem)
    segs = segments(problem, program)
    assert segs.count == 2 and segs.of_op["linear"] != segs.of_op["layer_norm"]
    r = problem.devices.flops / problem.devices.flops.sum()
    # with every segment at r, the segmented cost is the search's cost of the program
    assert segmented_cost(problem, program, segs, np.tile(r, (2, 1))) == pytest.approx(
        evaluate(problem, choice, r).cost, rel=1e-12)
    lp = solve_ratios(problem, program, segs=segs)
    assert lp.by_segment.shape == (2, n)
    assert lp.cost == pytest.approx(segmented_cost(problem, program, segs, lp.by_segment), rel=1e-9)
    grid = min(segmented_cost(problem, program, segs, np.array([a, b]))
               for a in simplex(n, step) for b in simplex(n, step))
    assert lp.cost <= grid * (1 + 1e-9) and grid <= lp.cost * (1 + 5 * step)
    assert lp.cost <= solve_ratios(problem, program).cost * (1 + 1e-12)  # never worse than one vector
    sizes = round_shards(problem, program, lp.by_segment, segs)
    assert sum(sizes[("relu", 0)]) == 8192 and sum(sizes[("layer_norm", 0)]) == 8192


def test_memory_forces_parameters_to_shards() -> None:
    """On a slow network a small batch runs redundantly: every weight (with its Adam state)
    whole on each device. With less memory than that, synthesis shards the weights instead."""
    problem = Problem.build(graph(64), devices(3, inter="10.4 Gb/s"))
    free = synthesize(problem, overhead=0.0)
    assert not any(s.sharded for s in free.program.strategies.values())
    need = free.memory.max()
    small = Problem.build(graph(64), devices(3, tuple([need * 0.6 / GIB] * 3), inter="10.4 Gb/s"))
    fitted = synthesize(small, overhead=0.0)
    assert fitted.cost > free.cost  # fitting costs time
    assert np.all(fitted.memory <= small.devices.memory * (1 + 1e-9))
    stored = {t for op in small.graph.ops for t, q in zip(op.inputs, fitted.program.strategies[op.name].inputs)
              if small.graph.tensors[t].role == "param" and q.startswith("S")}
    assert "p_fc1_weight" in stored


def test_without_the_memory_row_hap_proposes_programs_that_do_not_fit() -> None:
    """HAP's LP has no memory constraint: the same setting gives a program that overflows."""
    problem = Problem.build(graph(64), devices(3, inter="10.4 Gb/s"))
    free = synthesize(problem, overhead=0.0)
    small = Problem.build(graph(64), devices(3, tuple([free.memory.max() * 0.6 / GIB] * 3), inter="10.4 Gb/s"))
    hap = synthesize(small, overhead=0.0, memory=False, heuristic=False)
    ours = synthesize(small, overhead=0.0)
    assert not hap.fits and ours.fits and hap.memory.max() > small.devices.memory.max()


def test_model_larger_than_the_cluster_names_the_device() -> None:
    problem = Problem.build(graph(8192), devices(3, (16.0, 16.0, 0.5)))
    with pytest.raises(ShardingError, match=r"does not fit: gpu 2 \(p100-16gb, node 1\) has 512.0 MiB but needs"):
        synthesize(problem)


def test_rounding_keeps_every_shape_valid() -> None:
    from plait.graph.zoo import load_model

    spec = load_model("vit:layers=1,hidden=256,heads=4,patch=8,image=32,classes=10")
    g = capture_aten(spec.build("meta"), spec.sample_batch(250, device="meta")[0], name="vit")
    problem = Problem.build(g, devices(3))
    ratios = np.array([0.45, 0.3, 0.25])
    program = search(problem, ratios)
    sizes = round_shards(problem, program, ratios)
    assert len(sizes) > 20
    for (t, d), parts in sizes.items():
        assert sum(parts) == g.tensors[t].shape[d] and min(parts) > 0
    # dimensions an op links split in proportion (a view merging the batch with the heads
    # gives each device `heads` times its rows of the batch)
    scaled = 0
    for op in g.ops:
        s = program.strategies[op.name]
        if not s.sharded or len(op.inputs) != 1 or len(op.outputs) != 1:
            continue
        (i,), (o,) = s.inputs, s.outputs
        if i[0] == "S" and o[0] == "S":
            a, b = sizes[(op.inputs[0], int(i[1:]))], sizes[(op.outputs[0], int(o[1:]))]
            k = g.tensors[op.outputs[0]].shape[int(o[1:])] / g.tensors[op.inputs[0]].shape[int(i[1:])]
            assert [x * k for x in a] == b
            scaled += k != 1
    assert scaled >= 1
    with pytest.raises(ShardingError, match=r"leave gpu 2 \(p100-16gb, node 1\) with zero rows"):
        round_shards(problem, program, [0.6, 0.399, 0.001])


def test_stored_homes_shard_only_the_large_whole_parameters() -> None:
    """`stored_homes`: the data-parallel program's large weights go to even shards along their
    largest dimension; biases and norms stay whole; a tensor-parallel program's weights are already
    sharded (nothing to store elsewhere). `synthesize_stored` keeps the op strategies and holds the
    storage segments even, within each device's memory."""
    from plait.spmd.ratios import stored_homes, synthesize_stored

    p = Problem.build(graph(8192), devices(4))
    base = synthesize(p)
    homes = stored_homes(p, base.program)
    assert homes == {"p_fc1_weight": "S0", "p_fc2_weight": "S1"}
    stored = synthesize_stored(p, base)
    assert stored is not None and stored.program.strategies == base.program.strategies
    for t in homes:
        assert np.allclose(stored.segment_ratios[stored.segments.of_dim[(t, int(homes[t][1:]))]], 0.25)
    # each weight's 16 bytes of state per element in quarters, its gathered copy and gradient whole
    w = sum(p.graph.tensors[t].numel for t in homes)
    assert stored.fits
    assert stored.memory.max() - base.memory.max() == pytest.approx(w * (16 / 4 + 8 - 16), rel=1e-6)
    small = Problem.build(graph(256), devices(2))
    tp = search(small, small.devices.flops / small.devices.flops.sum())
    assert not {"p_fc1_weight", "p_fc2_weight"} & set(stored_homes(small, tp))
