"""`plait.schedule.in_flight`: the micro-batches each rank holds, read off a schedule's action lists.

Issue 27: the memory models derived these counts from schedule names (`cost.memory._in_flight` for
3D and graph plans, the composed plan's formula); the schedules exist once, as data. These tests
hold the action lists against the formulas over every schedule kind and many pp / m / v -- equal
wherever the formulas model the schedule the simulator runs -- and hold the graph plans whose
count the estimator now reads off the action lists, where the old formula counted fewer.
"""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cost.memory import _in_flight, _Stage, composed_in_flight
from plait.ir.plan import Plan, StageSpec
from plait.ir.stage_graph import micro_batch_sizes
from plait.schedule import PipelineGraph, build, chain_in_flight, in_flight


# ----------------------------------------------------------------------------- helpers
def _stages(plan: Plan) -> list[_Stage]:
    """The estimator's stages of `plan` (only what `_in_flight` reads: micro-batch and replicas)."""
    one = np.arange(1)
    if plan.stages:
        return [_Stage(s.name, one, np.asarray(s.devices), s.dp, s.tp, s.micro_batch, s.dp_shares, s.tp_ratios)
                for s in plan.stages]
    return [_Stage(f"stage{p}", one, np.array([p]), plan.dp, plan.tp, plan.micro_batch, plan.dp_shares,
                   plan.tp_ratios) for p in range(plan.pp)]


def _graph_plan(n: int, edges: list[tuple[int, int]], global_batch: int, micro_batches: list[int] | None = None,
                dps: list[int] | None = None, schedule: str = "1f1b") -> Plan:
    mbs = micro_batches or [1] * n
    dps = dps or [1] * n
    specs, dev = [], 0
    for s in range(n):
        specs.append(StageSpec(name=f"s{s}", layers=[f"l{s}"], devices=list(range(dev, dev + dps[s])), dp=dps[s],
                               micro_batch=mbs[s]))
        dev += dps[s]
    return Plan(stages=specs, stage_edges=edges, micro_batch=1, global_batch=global_batch, schedule=schedule)


def _simulated_schedule_in_flight(plan: Plan) -> list[float]:
    """`in_flight` of the schedule the simulator builds for `plan` (`plait.sim.lowering.tensor_parallel`): a chain per
    replica's micro-batches (the busiest), a graph pipeline's stage DAG over all its replicas'."""
    if not plan.stages:
        m = max(len(micro_batch_sizes(n, plan.micro_batch)) for n in plan.samples_per_replica())
        return in_flight(build(plan.schedule, PipelineGraph.chain(plan.pp, m, plan.virtual_stages)))
    sizes = [micro_batch_sizes(plan.global_batch, s.micro_batch or plan.micro_batch) for s in plan.stages]
    graph = PipelineGraph.dag(sizes, list(plan.stage_edges), [s.dp for s in plan.stages])
    return in_flight(build("gpipe" if plan.schedule == "gpipe" else "graph_1f1b", graph))


# ----------------------------------------------------------------------------- what it reads
def test_counts_forwards_without_their_backward_per_rank():
    assert in_flight(build("1f1b", PipelineGraph.chain(4, 8))) == [4.0, 3.0, 2.0, 1.0]
    assert in_flight(build("1f1b", PipelineGraph.chain(4, 3))) == [3.0, 3.0, 2.0, 1.0]
    assert in_flight(build("eager_1f1b", PipelineGraph.chain(4, 8))) == [7.0, 5.0, 3.0, 1.0]
    assert in_flight(build("gpipe", PipelineGraph.chain(3, 5))) == [5.0, 5.0, 5.0]


def test_interleaved_counts_chunk_forwards_in_whole_stage_units():
    # Megatron's warm-up 2 (pp - p - 1) + (v - 1) pp chunk-forwards, + 1 running, over v chunks
    pp, m, v = 4, 8, 3
    want = [(2 * (pp - p - 1) + (v - 1) * pp + 1) / v for p in range(pp)]
    assert in_flight(build("interleaved", PipelineGraph.chain(pp, m, v))) == want


def test_replicas_count_their_own_micro_batches():
    # 6 micro-batches dealt to 2 replicas in turn: GPipe holds 3 on each replica, not 6
    graph = PipelineGraph.dag([[1] * 6, [1] * 6], [(0, 1)], [2, 1])
    assert in_flight(build("gpipe", graph)) == [3.0, 6.0]


def test_chain_in_flight_is_remembered():
    assert chain_in_flight("1f1b", 3, 5) == (3.0, 2.0, 1.0)
    assert chain_in_flight("1f1b", 3, 5) is chain_in_flight("1f1b", 3, 5)


# ----------------------------------------------------------------------------- against the formulas
def _old_composed(schedule: str, pp: int, s: int, m: int) -> int:
    """compose_family.in_flight before issue 27 (the schedule read by name)."""
    if schedule == "gpipe":
        return m
    if schedule == "eager_1f1b":
        return min(m, 2 * (pp - s - 1) + 1)
    return min(m, pp - s)


@pytest.mark.parametrize("pp", range(1, 9))
def test_chain_schedules_hold_what_the_formulas_say(pp):
    for m in range(1, 25):
        for name in ("gpipe", "1f1b", "eager_1f1b"):
            got = list(composed_in_flight(name, pp, m))
            assert got == [_old_composed(name, pp, s, m) for s in range(pp)], (name, pp, m)
            assert got == in_flight(build(name, PipelineGraph.chain(pp, m)))
            plan = Plan(pp=pp, micro_batch=1, global_batch=m, schedule=name)
            assert _in_flight(plan, _stages(plan)) == got, (name, pp, m)
        for v in range(1, 5):
            if m % pp:
                continue
            plan = Plan(pp=pp, micro_batch=1, global_batch=m, schedule="interleaved", virtual_stages=v)
            got = in_flight(build("interleaved", PipelineGraph.chain(pp, m, v)))
            assert _in_flight(plan, _stages(plan)) == got, (pp, m, v)


@st.composite
def _dags(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    n = draw(st.integers(1, 7))
    edges = set()
    for b in range(1, n):
        for a in draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=2, unique=True)):
            edges.add((a, b))
    return n, sorted(edges)


@settings(max_examples=80, deadline=None)
@given(dag=_dags(), m=st.integers(1, 12), micro_batch=st.sampled_from([1, 2, 3]))
def test_graph_1f1b_holds_one_plus_the_longest_path_to_a_sink(dag, m, micro_batch):
    n, edges = dag
    plan = _graph_plan(n, edges, m, [micro_batch] * n)
    got = _simulated_schedule_in_flight(plan)
    assert _in_flight(plan, _stages(plan)) == got
    g = nx.DiGraph(edges)
    g.add_nodes_from(range(n))
    longest = {s: max((len(p) - 1 for t in range(n) for p in nx.all_simple_paths(g, s, t)), default=0)
               for s in range(n)}
    m_stage = len(micro_batch_sizes(m, micro_batch))
    assert got == [float(min(longest[s] + 1, m_stage)) for s in range(n)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@settings(max_examples=60, deadline=None)
@given(dag=_dags(), m=st.integers(1, 12), data=st.data())
def test_graph_estimator_equals_the_action_lists(schedule, dag, m, data):
    # GPipe holds every micro-batch of the busiest replica; graph 1F1B what its action lists hold,
    # more than depth + 1 where stages' micro-batch sizes or replicas differ (below)
    n, edges = dag
    dps = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    mbs = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    plan = _graph_plan(n, edges, m, mbs, dps, schedule=schedule)
    assert _in_flight(plan, _stages(plan)) == _simulated_schedule_in_flight(plan)


# ----------------------------------------------------------------------------- fixed undercounts
# Fixed (issue 27, the estimator's chain formula; before -> after, both what the action lists hold):
# interleaved with m == pp, where Megatron runs every chunk forward first (all warm-up), counted
# 2 (pp - p - 1) + (v - 1) pp + 1 chunk-forwards: pp=2 v=2 m=2 [2.0, 1.5] -> [2.0, 2.0], pp=4 v=2 m=4
# [4, 4, 3.5, 2.5] -> [4, 4, 4, 4]; a chain under eager 1F1B counted as 1F1B: pp=4 m=8 [4, 3, 2, 1] ->
# [7, 5, 3, 1] (the sweep above holds every such case).
# Fixed (issue 27, graph plans): the estimator counted GraphPipe's depth + 1 per stage, fewer than
# graph 1F1B holds where stages' micro-batch sizes or replicas differ; it now reads the built action
# lists (`plait.schedule.graph_in_flight`). Before -> after:
_UNDERCOUNTS = [
    # graph stages of different micro-batch sizes: stage 1's one forward of 4 samples needs all 4 of
    # stage 0's micro-batches of 1 before stage 0's first backward
    pytest.param(_graph_plan(2, [(0, 1)], 4, [1, 4]), [2.0, 1.0], [4.0, 1.0], id="graph-micro-batch-sizes"),
    # a graph stage of 3 replicas keeps 3 * depth + 1 forwards before its first backward, so its
    # producer runs 4 forwards before its own
    pytest.param(_graph_plan(3, [(0, 1), (1, 2)], 4, None, [1, 3, 1]), [3.0, 2.0, 1.0], [4.0, 2.0, 1.0],
                 id="graph-replicas"),
]


@pytest.mark.parametrize(("plan", "before", "after"), _UNDERCOUNTS)
def test_estimator_counts_what_the_schedule_holds(plan, before, after):
    assert _simulated_schedule_in_flight(plan) == after
    assert _in_flight(plan, _stages(plan)) == after != before

