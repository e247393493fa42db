"""The stage graph (plait.ir.stage_graph): stages, one rounding rule, boundary tensors, validation."""

from __future__ import annotations

import pytest

from plait.ir.opgraph import Layer, OpGraph
from plait.ir.plan import Plan, PlanError, StageSpec
from plait.ir.stage_graph import StageGraphError, micro_batch_sizes, stage_graph


def _graph(edges: list[tuple[str, str]], names: list[str], out: float = 100.0) -> OpGraph:
    layers = [Layer(name=n, kind="Linear", output_bytes=out * (i + 1)) for i, n in enumerate(names)]
    return OpGraph(model="toy", layers=layers, layer_edges=edges)


def _chain(n: int = 4) -> OpGraph:
    names = [f"l{i}" for i in range(n)]
    return _graph(list(zip(names, names[1:])), names)


def test_rounding_rule_ten_samples_at_micro_batch_four():
    assert micro_batch_sizes(10, 4) == [4, 3, 3]
    assert micro_batch_sizes(8, 4) == [4, 4]
    assert micro_batch_sizes(3, 4) == [3]
    assert micro_batch_sizes(0, 4) == []


def test_uneven_shares_give_contiguous_micro_batches():
    plan = Plan(dp=2, micro_batch=4, global_batch=16, dp_shares=[10 / 16, 6 / 16])
    sg = stage_graph(plan, _chain())
    reps = sg.stages[0].replicas
    assert [r.samples for r in reps] == [10, 6]
    assert [(m.first, m.size) for m in reps[0].micro_batches] == [(0, 4), (4, 3), (7, 3)]
    assert [(m.first, m.size) for m in reps[1].micro_batches] == [(10, 3), (13, 3)]


def test_runtime_uses_the_same_rule():
    from plait.runtime.partition import replica_micro_batches

    plan = Plan(dp=2, micro_batch=4, global_batch=16, dp_shares=[10 / 16, 6 / 16])
    sg = stage_graph(plan, _chain())
    for d in range(2):
        got = [(m.first, m.size) for m in replica_micro_batches(plan, 0, d)]
        assert got == [(m.first, m.size) for m in sg.stages[0].replicas[d].micro_batches]
    # the next step starts after the whole global batch
    assert replica_micro_batches(plan, 1, 0)[0].first == 16


def test_chain_stages_devices_and_interleaved_chunks():
    plan = Plan(dp=2, tp=2, pp=2, micro_batch=1, global_batch=4, schedule="interleaved", virtual_stages=2)
    sg = stage_graph(plan, _chain(8))
    assert [c.stage for c in sg.chunks] == [0, 1, 0, 1]
    assert sg.stages[0].chunks == [0, 2] and sg.stages[1].devices == [4, 5, 6, 7]
    assert sg.stages[1].replicas[1].devices == [6, 7]
    assert [(e.src, e.dst) for e in sg.edges] == [(0, 1), (1, 2), (2, 3)]
    # the cut after l1 carries l1's output (2 * 100 bytes per sample)
    assert sg.edges[0].bytes_per_sample == 200.0


def test_chain_cut_carries_every_value_alive_across_it_not_the_last_output():
    # a -> b -> c -> d with a skip a -> d: the cut after b carries a's and b's outputs
    g = _graph([("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")], ["a", "b", "c", "d"])
    sg = stage_graph(Plan(pp=2, micro_batch=1, global_batch=1), g)
    assert sorted(t.producer for t in sg.edges[0].tensors) == ["a", "b"]
    assert sg.edges[0].bytes_per_sample == 100.0 + 200.0


def _dag_plan(edges: list[tuple[int, int]], **kw) -> Plan:
    stages = [StageSpec("s0", ["a"], [0]), StageSpec("s1", ["b"], [1]), StageSpec("s2", ["c"], [2])]
    return Plan(stages=stages, stage_edges=edges, **kw)


def test_dag_edge_bytes_come_from_the_producer_stage_only():
    g = _graph([("a", "b"), ("a", "c"), ("b", "c")], ["a", "b", "c"])
    sg = stage_graph(_dag_plan([(0, 1), (0, 2), (1, 2)]), g)
    by = {(e.src, e.dst): [t.producer for t in e.tensors] for e in sg.edges}
    assert by == {(0, 1): ["a"], (0, 2): ["a"], (1, 2): ["b"]}


def test_validate_rejects_a_dependency_without_an_edge():
    g = _graph([("a", "b"), ("a", "c"), ("b", "c")], ["a", "b", "c"])
    with pytest.raises(StageGraphError, match="stage_edges.*no edge \\(0, 2\\)"):
        stage_graph(_dag_plan([(0, 1), (1, 2)]), g)


def test_validate_rejects_an_edge_against_the_dependencies():
    g = _graph([("a", "b"), ("b", "c")], ["a", "b", "c"])
    with pytest.raises(StageGraphError, match="stage_edges.*runs against"):
        stage_graph(_dag_plan([(1, 0), (1, 2)]), g)


def test_validate_rejects_a_layer_in_no_stage_and_unknown_layers():
    g = _graph([("a", "b"), ("b", "c"), ("c", "d")], ["a", "b", "c", "d"])
    with pytest.raises(StageGraphError, match="'stages'.*\\['d'\\] are in no stage"):
        stage_graph(_dag_plan([(0, 1), (1, 2)]), g)
    bad = Plan(stages=[StageSpec("s0", ["a", "zz"], [0])])
    with pytest.raises(StageGraphError, match="stages\\[0\\].layers"):
        stage_graph(bad, g)


@pytest.mark.parametrize("stages, edges, field", [
    ([StageSpec("s0", ["a"], [0]), StageSpec("s1", ["a"], [1])], [(0, 1)], "stages\\[1\\].layers"),
    ([StageSpec("s0", ["a"], [0]), StageSpec("s1", ["b"], [0])], [(0, 1)], "stages\\[1\\].devices"),
    ([StageSpec("s0", ["a"], [0]), StageSpec("s1", ["b"], [1]), StageSpec("s2", ["c"], [2])],
     [(0, 1), (1, 2), (2, 0)], "stage_edges.*cycle"),
])
def test_plan_validate_rejects_overlaps_and_cycles(stages, edges, field):
    with pytest.raises(PlanError, match=field):
        Plan(stages=stages, stage_edges=edges)


def test_grad_reduce_dtype_is_a_validated_plan_field():
    assert Plan(dtype="bf16").grad_dtype == "fp32"  # Megatron: bf16 forces fp32 main grads
    assert Plan(dtype="fp16").grad_dtype == "fp16"
    assert Plan(dtype="fp32").grad_dtype == "fp32"
    p = Plan.parse("dp=2,global_batch=2,grad_reduce_dtype=bf16")
    assert p.grad_dtype == "bf16" and "grad_reduce_dtype=bf16" in str(p)
    assert Plan.parse(str(p)) == p and Plan.from_json(p.to_json()) == p
    with pytest.raises(PlanError, match="grad_reduce_dtype"):
        Plan.parse("grad_reduce_dtype=int8")


def test_chain_cut_sums_match_the_edge_tensors():
    from plait.ir.stage_graph import chain_cut_bytes

    g = _graph([("a", "b"), ("b", "c"), ("c", "d"), ("a", "d"), ("b", "e"), ("d", "e")], list("abcde"))
    cut = chain_cut_bytes(g)
    for split in ([1, 4], [2, 3], [3, 2], [4, 1], [1, 1, 1, 2], [2, 1, 2]):
        plan = Plan(pp=len(split), micro_batch=1, global_batch=1, layer_split=split)
        sg = stage_graph(plan, g)
        bounds = [sum(split[:i + 1]) for i in range(len(split) - 1)]
        assert [e.bytes_per_sample for e in sg.edges] == [cut[k] for k in bounds]
    assert cut[0] == 0.0 and cut[-1] == 0.0


def test_count_and_largest_follow_the_sizes():
    from plait.ir.stage_graph import largest_micro_batch, micro_batch_count

    for n in range(0, 40):
        for b in range(1, 9):
            sizes = micro_batch_sizes(n, b)
            assert micro_batch_count(n, b) == len(sizes)
            assert largest_micro_batch(n, b) == (sizes[0] if sizes else 0)
            assert sum(sizes) == n and (not sizes or max(sizes) - min(sizes) <= 1 and max(sizes) <= b)
