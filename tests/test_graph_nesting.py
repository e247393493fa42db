"""GraphPipe's partitioner on nested series-parallel DAGs (issue 13): a layer handed on to a
branch (a join layer after a parallel part, a stem before one) is never lost, however deep the
nesting -- regression for ``KeyError: 'head'`` on the three-tower user model -- and, on random
nested DAGs, every layer lands in exactly one stage and the stage graph is acyclic."""

from __future__ import annotations

import networkx as nx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.cluster import load_cluster
from plait.graph.sp import decompose
from plait.ir.opgraph import Layer, Op, OpGraph
from plait.planners.graph_cost import StageCost
from plait.planners.graphpipe import partition


def _graph(nodes: list[str], edges: list[tuple[str, str]], flops: dict[str, float]) -> OpGraph:
    """A layer DAG of one linear per layer (`flops` GFLOPs per sample forward)."""
    dag = nx.DiGraph(edges)
    dag.add_nodes_from(nodes)
    ops, layers = {}, []
    for n in nx.lexicographical_topological_sort(dag):
        f = flops.get(n, 1.0) * 1e9
        ops[f"{n}/mm"] = Op(f"{n}/mm", "aten.mm.default", n, n, fwd_flops=f, bwd_flops=2 * f,
                            param_bytes=4_000_000, saved_bytes=8192.0, output_bytes=8192.0)
        layers.append(Layer(n, "Linear", ops=[f"{n}/mm"], fwd_flops=f, bwd_flops=2 * f, param_count=1_000_000,
                            param_bytes=4_000_000, saved_bytes=8192.0, output_bytes=8192.0, input_bytes=8192.0))
    return OpGraph("nested", ops=ops, layers=layers, layer_edges=list(edges))


def _check(cost: StageCost, part) -> None:
    names = sorted(cost.graph.layer_names)
    for stages in part.stages:
        held = sorted(n for s in stages for n in s.layers)
        assert held == names  # every layer in exactly one stage
        dag = nx.DiGraph(cost.stage_edges(stages))
        dag.add_nodes_from(range(len(stages)))
        assert nx.is_directed_acyclic_graph(dag)
        plan = cost.to_plan(stages)  # Plan validates its stage graph (cycles, edges) itself
        assert sorted(n for s in plan.stages for n in s.layers) == names
        assert sum(s.dp for s in plan.stages) <= sum(cost.counts)


def _towers(n_blocks: int = 4) -> OpGraph:
    """The three-tower user model's layer DAG (tests/test_user_models.py TOWERS): the stem feeds
    towers 0 and 1, tower 2 reads the input, all three meet in the head; skip proj -> blocks.2."""
    edges = []
    for t in range(3):
        chain = [f"t{t}.proj"] + [f"t{t}.b{i}" for i in range(n_blocks)]
        edges += list(zip(chain, chain[1:])) + [(f"t{t}.proj", f"t{t}.b2"), (chain[-1], "head")]
    edges += [("stem", "t0.proj"), ("stem", "t1.proj")]
    nodes = sorted({n for e in edges for n in e})
    # its FLOPs per sample (a tiny model: every layer costs about one kernel launch)
    flops = {n: (128 if n in ("stem",) or n.endswith("proj") else 240 if n == "head" else 512) * 1e-9
             for n in nodes}
    return _graph(nodes, edges, flops)


def test_towers_nested_one_level_deeper_keep_the_head():
    g = _towers()
    tree = decompose(g)
    # parallel(series(stem, parallel(tower0, tower1)), tower2) -> head: the head is handed to a
    # branch that is itself a series ending in a parallel part.
    assert tree.kind == "series" and [c.kind for c in tree.children] == ["parallel", "leaf"]
    for gpus in (4, 8):
        cost = StageCost(g, load_cluster(f"a100-80g:nodes=1,gpus_per_node={gpus}"), global_batch=16)
        part = partition(cost)
        _check(cost, part)
        head_stages = [s for s in part.best if "head" in s.layers]
        assert len(head_stages) == 1


def test_a_stem_may_join_a_branchs_first_stage():
    # x -> (a0 -> a1, b0 -> b1) -> h: on 4 GPUs one of the plans the search meets puts the tiny stem
    # x with a branch's first layer instead of on a GPU of its own.
    edges = [("x", "a0"), ("x", "b0"), ("a0", "a1"), ("b0", "b1"), ("a1", "h"), ("b1", "h")]
    g = _graph(["x", "a0", "a1", "b0", "b1", "h"], edges, {"x": 0.05, "h": 0.05})
    cost = StageCost(g, load_cluster("a100-80g:nodes=1,gpus_per_node=4"), global_batch=32, memory=False)
    part = partition(cost, candidates=50)
    _check(cost, part)
    assert any(any(set(s.layers) in ({"x", "a0"}, {"x", "b0"}) for s in stages) for stages in part.stages)


# ---------------------------------------------------------------- random nested series-parallel DAGs
def _tree(depth: int):
    leaf = st.just(("leaf",))
    if depth == 0:
        return leaf
    sub = _tree(depth - 1)
    return st.one_of(leaf, st.tuples(st.just("series"), st.lists(sub, min_size=2, max_size=3)),
                     st.tuples(st.just("parallel"), st.lists(sub, min_size=2, max_size=3)))


def _build(tree, nodes: list[str], edges: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Add `tree`'s layers and edges; return its (sources, sinks)."""
    if tree[0] == "leaf":
        n = f"l{len(nodes)}"
        nodes.append(n)
        return [n], [n]
    parts = [_build(c, nodes, edges) for c in tree[1]]
    if tree[0] == "parallel":
        return [s for p in parts for s in p[0]], [t for p in parts for t in p[1]]
    for (_, sinks), (sources, _) in zip(parts, parts[1:]):
        edges += [(a, b) for a in sinks for b in sources]
    return parts[0][0], parts[-1][1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=_tree(3), gpus=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 10**6))
def test_random_nested_series_parallel_dags_partition_every_layer_once(tree, gpus, seed):
    nodes: list[str] = []
    edges: list[tuple[str, str]] = []
    # an input and a loss layer around the random part, as in a model (a stem and a head)
    inner = ("series", [("leaf",), tree, ("leaf",)])
    _build(inner, nodes, edges)
    rng = __import__("random").Random(seed)
    flops = {n: rng.choice([0.1, 0.5, 1.0, 2.0, 4.0]) for n in nodes}
    g = _graph(nodes, edges, flops)
    cost = StageCost(g, load_cluster(f"a100-80g:nodes=1,gpus_per_node={gpus}"), global_batch=16,
                     memory=False)
    _check(cost, partition(cost, candidates=8))
