"""Stages of one stage DAG with different data-parallel degrees (issue 13): the stage graph deals a
DAG stage's micro-batches to its replicas in turn (one rule for runtime, simulator and memory),
graph 1F1B keeps each replica's warm-up in flight, and the simulator shows the degree's speed-up."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cluster import load_cluster
from plait.ir.plan import Plan, StageSpec
from plait.ir.stage_graph import deal_micro_batches, replica_loads, stage_graph
from plait.schedule import PipelineGraph, execute, graph_1f1b

sys.path.insert(0, str(Path(__file__).parent))
from test_graph_nesting import _graph  # noqa: E402


def _plan(dps: list[int], mbs: list[int], batch: int, shares=None) -> Plan:
    devs, stages = 0, []
    for i, (d, b) in enumerate(zip(dps, mbs)):
        stages.append(StageSpec(f"s{i}", [f"l{i}"], list(range(devs, devs + d)), dp=d, micro_batch=b,
                                dp_shares=shares if i == 0 else None))
        devs += d
    return Plan(global_batch=batch, dtype="fp32", stages=stages,
                stage_edges=[(i, i + 1) for i in range(len(dps) - 1)])


def test_a_dag_stage_deals_micro_batches_in_turn_and_dp1_keeps_the_chain_rule():
    # 10 samples at micro-batch 4: [4, 3, 3] (the rule's sizes), replica 0 gets #0 and #2.
    two = deal_micro_batches(10, 4, None, 2)
    assert [[(u.first, u.size) for u in r] for r in two] == [[(0, 4), (7, 3)], [(4, 3)]]
    one = deal_micro_batches(10, 4, None, 1)
    assert [u.size for u in one[0]] == [4, 3, 3]
    # shares 3:1 over 8 micro-batches: each to the replica furthest below its share
    uneven = deal_micro_batches(32, 4, [0.75, 0.25], 2)
    assert [len(r) for r in uneven] == [6, 2]
    # a chain plan keeps consecutive shares: 10 samples as 6 + 4 (shares 3:2) at micro-batch 4
    chain = Plan(global_batch=10, dtype="fp32", dp=2, micro_batch=4, dp_shares=[0.6, 0.4])
    assert replica_loads(chain, [0.6, 0.4], 2, 4) == [(2, 3), (1, 4)]


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 70), b=st.integers(1, 9), d=st.integers(1, 5),
       shares=st.one_of(st.none(), st.lists(st.integers(1, 4), min_size=5, max_size=5)))
def test_dealt_units_cover_the_batch_once_and_match_the_loads(batch, b, d, shares):
    sh = [x / sum(shares[:d]) for x in shares[:d]] if shares else None
    plan = _plan([d, 1], [b, b], batch, sh)
    sg = stage_graph(plan, _graph(["l0", "l1"], [("l0", "l1")], {}))
    reps = sg.stages[0].replicas
    samples = sorted(i for r in reps for u in r.micro_batches for i in range(u.first, u.first + u.size))
    assert samples == list(range(batch))
    assert all(u.size <= b for r in reps for u in r.micro_batches)
    loads = replica_loads(plan, sh, d, b)
    assert loads == [(r.count, max((u.size for u in r.micro_batches), default=0)) for r in reps]
    # the busiest replica runs ceil(ceil(B / dp) / b) micro-batches, as the planner counts, when even
    if sh is None:
        assert max(c for c, _ in loads) == math.ceil(math.ceil(batch / d) / b)


def test_graph_1f1b_keeps_each_replicas_warm_up_in_flight():
    # stage 0 (2 replicas) -> stage 1 -> stage 2; 8 micro-batches of one size.
    g = PipelineGraph.dag([[1] * 8] * 3, [(0, 1), (1, 2)], [2, 1, 1])
    s = graph_1f1b(g)
    execute(s)
    for rep in range(2):  # stage 0 has depth 2: each replica keeps 3 in flight
        live = peak = 0
        for a in s.compute(0):
            if a.micro_batch % 2 == rep:
                live += 1 if a.op == "fwd" else -1
                peak = max(peak, live)
        assert peak == 3


@pytest.mark.parametrize("dps,speedup", [((2, 1), 1.8), ((3, 1), 2.4), ((2, 2), 1.8)])
def test_simulator_gives_a_stage_of_more_replicas_its_speed_up(dps, speedup):
    from plait.sim.api import simulate

    g = _graph(["l0", "l1"], [("l0", "l1")], {"l0": 40.0, "l1": 10.0})
    cl = load_cluster("a100-80g:nodes=1,gpus_per_node=4")
    base = simulate(g, cl, _plan([1, 1], [4, 4], 64), memory=False).iteration_time_s
    wide = simulate(g, cl, _plan(list(dps), [4, 4], 64), memory=False).iteration_time_s
    # the heavy stage's replicas run side by side from the first micro-batches on
    assert base / wide >= speedup
