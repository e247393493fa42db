"""The 3D search covers data-parallel degrees that do not divide the global batch (issue 37): even
shares, the remainder carried by the first replicas, as the runtime runs them."""

from __future__ import annotations

from plait.api import plan
from plait.cluster import load_cluster
from plait.planners.threed import SearchSpace, enumerate_groups
from plait.planners.types import load_graph

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128"
SIX = "a100-80gb:nodes=1,gpus_per_node=6"


def test_a_degree_that_does_not_divide_the_batch_is_enumerated() -> None:
    _, graph = load_graph(MODEL, "bf16")
    plans = [p for g in enumerate_groups(graph, load_cluster(SIX), 8) for p in g.plans]
    six = [p for p in plans if p.dp == 6]
    assert six, "dp=6 (8 samples on 6 replicas) must be searched"
    for p in six:
        assert p.samples_per_replica() == [2, 2, 1, 1, 1, 1]  # the remainder on the first replicas
        assert 8 % p.micro_batch == 0 and p.micro_batch <= 2 and p.schedule != "interleaved"
    assert {p.dp for p in plans} == {1, 2, 3, 6}
    even = [p for p in plans if 8 % p.dp == 0]
    assert all(p.dp_shares is None for p in even)  # dividing degrees keep Megatron's form
    # a framework's plan (export) keeps to dividing degrees
    only_even = [p for g in enumerate_groups(graph, load_cluster(SIX), 8, SearchSpace(uneven_dp=False))
                 for p in g.plans]
    assert {p.dp for p in only_even} == {1, 2}


def test_uneven_degree_is_simulated_and_ranked() -> None:
    """dp=6 plans reach the finalists, the simulator prices them (the two-sample replicas set the
    pace), and they compete with the dividing degrees in one ranking."""
    res = plan(MODEL, SIX, global_batch=8, top=50, finalists=None, placement=False, families="3d",
               space=SearchSpace(tp=[1], pp=[1, 3], recompute=("none",), zero=(0,)))  # dp 6 and 2
    by_dp = {}
    for c in res.top:
        by_dp.setdefault(c.plan.dp, []).append(c)
    assert 6 in by_dp and 2 in by_dp, sorted(by_dp)
    six = min(by_dp[6], key=lambda c: c.time_s)
    assert six.plan.samples_per_replica() == [2, 2, 1, 1, 1, 1]
    assert six.time_s > 0 and six.iteration_time_s
