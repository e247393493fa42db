"""Planner and simulator carry exactly the same bytes per traffic class; one rounding rule everywhere.

For every zoo model (small configurations) x a 3D plan, an uneven heterogeneous plan
(layer_split + dp_shares on a mixed A100/V100 preset) and a ZeRO-3 plan, the messages the
planner's analytic model times (`AnalyticModel.traffic`) and the communication tasks of the
simulator's lowered graph sum to the same wire bytes per class (integers: exact)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from plait.cluster import load_cluster
from plait.cost import traffic
from plait.cost.memory import estimate_memory
from plait.graph.inspect import inspect_model
from plait.ir.plan import Plan
from plait.net.view import ClusterView
from plait.planners.threed import AnalyticModel
from plait.runtime.partition import replica_micro_batches
from plait.sim.lowering import SimOptions, lower

# The cases are the bench's (bench/traffic_agreement.py prints them as a table): one list of them.
_BENCH = Path(__file__).resolve().parents[1] / "bench" / "traffic_agreement.py"
_spec = importlib.util.spec_from_file_location("traffic_agreement_bench", _BENCH)
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)  # type: ignore[union-attr]
CLUSTER, MODELS, plans_for = _bench.CLUSTER, _bench.MODELS, _bench.plans_for


@pytest.fixture(scope="module")
def cluster():
    c = load_cluster(CLUSTER)
    return c, ClusterView.from_cluster(c)


@pytest.mark.parametrize("model", list(MODELS))
def test_planner_and_simulator_carry_the_same_bytes_per_class(model, cluster):
    c, view = cluster
    graph = inspect_model(MODELS[model], 2)
    planner = AnalyticModel(graph, c)
    for name, plan in plans_for(len(graph.layers)).items():
        expected = planner.traffic(plan).totals()
        assert planner.estimate(plan) > 0
        for symmetry in (True, False):
            lw = lower(graph, plan, view, SimOptions(granularity="layer", symmetry=symmetry))
            got = traffic.task_class_bytes(lw.graph.args)
            assert got == expected, (model, name, symmetry)
        # every class the plan implies is really there (the test cannot pass on empty graphs)
        assert expected["pp" if plan.pp > 1 else "zero"] > 0
        assert (expected["dp"] > 0) == (plan.zero != 3)


def test_ten_samples_at_micro_batch_four_split_the_same_everywhere(cluster):
    c, view = cluster
    graph = inspect_model(MODELS["gpt"], 2)
    plan = Plan(dp=2, micro_batch=4, global_batch=16, dp_shares=[10 / 16, 6 / 16])
    runtime = [[m.size for m in replica_micro_batches(plan, 0, d)] for d in range(2)]
    assert runtime == [[4, 3, 3], [3, 3]]
    lw = lower(graph, plan, view, SimOptions(symmetry=False))
    assert [[n for _, n in w.units] for w in lw.workers] == runtime
    # the memory estimator sizes each replica's activations by its largest micro-batch: 4 and 3
    est = estimate_memory(graph, plan, c, overhead_bytes=0)
    even4 = estimate_memory(graph, Plan(dp=2, micro_batch=4, global_batch=16), c, overhead_bytes=0)
    even3 = estimate_memory(graph, Plan(dp=2, micro_batch=3, global_batch=12), c, overhead_bytes=0)
    assert est.breakdown(0).activations == even4.breakdown(0).activations
    assert est.breakdown(1).activations == even3.breakdown(1).activations


def test_stage_dag_with_different_micro_batches_agrees():
    """A GraphPipe-style diamond whose stages differ in dp, micro-batch and shares: messages
    cover every overlapping pair of producer and consumer micro-batches in both rooms."""
    from plait.cluster.catalog import GPU_KINDS
    from plait.ir.opgraph import Layer, OpGraph
    from plait.ir.plan import StageSpec

    layers = [Layer(name=n, kind="Linear", output_bytes=100.0 * (i + 1)) for i, n in enumerate("abcd")]
    g = OpGraph(model="diamond", layers=layers, layer_edges=[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    stages = [StageSpec("s0", ["a"], [0, 1], dp=2, micro_batch=2), StageSpec("s1", ["b"], [2], micro_batch=4),
              StageSpec("s2", ["c"], [3], micro_batch=1),
              StageSpec("s3", ["d"], [4, 5], dp=2, dp_shares=[0.75, 0.25])]
    plan = Plan(stages=stages, stage_edges=[(0, 1), (0, 2), (1, 3), (2, 3)], micro_batch=2, global_batch=8)
    view = ClusterView.uniform(8, GPU_KINDS["a100-80gb"], 8, 100e9, 5e-6)
    expected = traffic.iteration_traffic(g, plan).totals()
    # a's output (100 B/sample) to b and c, b's (200) and c's (300) to d; 8 samples, both directions, bf16
    assert expected["pp"] == 2 * 8 * (100 + 100 + 200 + 300)
    for symmetry in (True, False):
        lw = lower(g, plan, view, SimOptions(granularity="layer", symmetry=symmetry))
        assert traffic.task_class_bytes(lw.graph.args) == expected


def test_pipeline_messages_whole_on_plaits_engines_split_under_sp_or_megatrons_scatter_gather(cluster):
    """pp=2 x tp=2: the simulator sends what the planner counts -- each tensor rank's whole replicated
    boundary value by default (plait's engines), 1/tp of it with sequence parallelism or with legacy
    Megatron-LM's scatter-gather (`SimOptions.pp_scatter_gather`, `iteration_traffic(scatter_gather=)`)."""
    c, view = cluster
    graph = inspect_model(MODELS["gpt"], 2)
    plan = Plan(pp=2, tp=2, micro_batch=2, global_batch=8)
    sp = Plan(pp=2, tp=2, micro_batch=2, global_batch=8, sequence_parallel=True)

    def sim(p: Plan, scatter_gather: bool = False) -> int:
        lw = lower(graph, p, view, SimOptions(granularity="layer", pp_scatter_gather=scatter_gather))
        return traffic.task_class_bytes(lw.graph.args)["pp"]

    whole = sim(plan)
    assert whole == traffic.iteration_traffic(graph, plan).totals()["pp"] > 0
    assert sim(plan, True) == traffic.iteration_traffic(graph, plan, scatter_gather=True).totals()["pp"] == whole // 2
    assert sim(sp) == traffic.iteration_traffic(graph, sp).totals()["pp"] == whole // 2
