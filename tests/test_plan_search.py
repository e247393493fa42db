"""The 3D search: exhaustive ranking equals brute force, nothing returned overflows memory,
uneven splits on mixed kinds, placement never worse than Megatron's order."""

from __future__ import annotations

import itertools

import pytest

from plait.api import plan
from plait.cluster import load_cluster, parse_yaml_text
from plait.cost.memory import estimate_memory
from plait.graph.gpt_closed_form import gpt_config, gpt_opgraph
from plait.ir.plan import Plan
from plait.planners import hetero
from plait.planners.threed import TIE_PENALTY
from plait.search import SearchError, SearchSpace, auto_dtype
from plait.sim.api import simulate

TINY = gpt_opgraph(gpt_config("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"))
SMALL = gpt_opgraph(gpt_config("gpt:layers=4,hidden=512,heads=8,seq=256,vocab=1024"))
HOMO = "a100-80gb:nodes=1,gpus_per_node=4"
# an A100 runs a layer of this model about twice as fast as a V100 (both fp16)
MIXED = gpt_opgraph(gpt_config("gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=1024"), dtype="fp16")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_exhaustive_search_ranks_first_the_brute_force_minimum():
    space = SearchSpace(recompute=("none", "full"), zero=(0, 1), schedules=("1f1b", "gpipe"),
                        sequence_parallel=(False,))
    res = plan(TINY, HOMO, global_batch=8, top=3, finalists=None, placement=False, space=space)
    cluster = load_cluster(HOMO)
    # brute force, written independently: every dp x tp x pp, micro-batch, recompute, ZeRO, schedule
    times, levels = {}, {}
    for tp, pp in itertools.product(_divisors(4), _divisors(4)):
        if 4 % (tp * pp) or tp * pp > 4 or 4 % tp or pp > len(TINY.layers):
            continue
        dp = 4 // (tp * pp)
        if tp * pp * dp != 4 or 8 % dp:
            continue
        for mb, rc, zero, sched in itertools.product(_divisors(8 // dp), ("none", "full"), (0, 1),
                                                     ("1f1b", "gpipe")):
            if (zero and dp == 1) or (sched == "gpipe" and pp == 1):
                continue
            p = Plan(dp=dp, tp=tp, pp=pp, micro_batch=mb, global_batch=8, recompute=rc, zero=zero,
                     schedule=sched, dtype="bf16")
            if estimate_memory(TINY, p, cluster).fits:
                times[str(p)] = simulate(TINY, cluster, p, memory=False).iteration_time_s
                levels[str(p)] = zero + {"none": 0, "full": 2}[rc]
    assert res.enumerated == len(times) and res.simulated == len(times)
    # the search's documented tie rule: each ZeRO / recompute level must buy TIE_PENALTY to win
    score = {k: t * (1 + TIE_PENALTY * levels[k]) for k, t in times.items()}
    assert str(res.best.plan) == min(score, key=lambda k: (score[k], k))
    assert times[str(res.best.plan)] == pytest.approx(res.best.iteration_time_s, rel=1e-12)
    assert res.best.iteration_time_s <= min(times.values()) * (1 + 4 * TIE_PENALTY)
    ranked = [score[str(c.plan)] for c in res.top]
    assert ranked == sorted(ranked)
    # the default finalist cut (analytic first pass) keeps the same winner here
    quick = plan(TINY, HOMO, global_batch=8, top=1, placement=False, space=space)
    assert quick.simulated < res.simulated
    assert quick.best.iteration_time_s <= min(times.values()) * 1.05


def _tight_cluster():
    return parse_yaml_text(
        "gpu_kinds: {tiny: {like: a100-80gb, memory: 1.25 GiB}}\n"
        "nodes: [{name: n0, gpus: {kind: tiny, count: 4}}]", source="tight.yaml")


def test_no_returned_plan_exceeds_memory_and_pruning_is_counted():
    cluster = _tight_cluster()
    res = plan(SMALL, cluster, global_batch=16, top=8, finalists=8)
    assert res.pruned > 0 and res.enumerated == res.pruned + res.ranked_analytic
    assert all("tiny" in reason for reason in res.pruned_reasons)
    assert sum(res.pruned_reasons.values()) == res.pruned
    for c in res.top:
        est = estimate_memory(SMALL, c.plan, cluster)
        assert est.fits, est.violations
        assert min(c.headroom_by_kind.values()) >= 0
        assert c.peak_bytes == est.peak_bytes


def test_nothing_fits_is_a_clear_error():
    cluster = parse_yaml_text("gpu_kinds: {crumb: {like: a100-80gb, memory: 1.01 GiB}}\n"
                              "nodes: [{gpus: {kind: crumb, count: 2}}]", source="crumb.yaml")
    with pytest.raises(SearchError, match="fits in memory"):
        plan(SMALL, cluster, global_batch=8, simulate=False)
    with pytest.raises(SearchError, match="global batch 3"):  # 4 replicas, 3 samples: one would idle
        plan(TINY, HOMO, global_batch=3, simulate=False, space=SearchSpace(tp=[1], pp=[1]))
    # a degree that does not divide the batch is searched (issue 37): dp=2 at pp=2, 2 + 1 samples
    res = plan(TINY, HOMO, global_batch=3, simulate=False, space=SearchSpace(tp=[1], pp=[1, 2]))
    assert res.best.plan.dp == 2 and res.best.plan.samples_per_replica() == [2, 1]


def test_mixed_kinds_get_uneven_layers_and_batches():
    # compute-bound enough that an A100 is clearly faster than a V100 (fp16 on both)
    graph = MIXED
    cluster = load_cluster("mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2")
    assert auto_dtype(cluster) == "fp16"
    # two stages, the first on the A100 node: it gets more layers
    pipe = Plan(dp=2, tp=1, pp=2, micro_batch=4, global_batch=32, dtype="fp16")
    res = hetero.balance(graph, pipe, cluster)
    assert res is not None and res.plan.layer_split is not None
    assert res.plan.layer_split[0] > res.plan.layer_split[1] and sum(res.plan.layer_split) == len(graph.layers)
    assert res.predicted < res.even_predicted
    # two replicas on different kinds: the A100 replica gets the larger share
    rep = Plan(dp=2, tp=2, pp=1, micro_batch=4, global_batch=32, dtype="fp16")
    res = hetero.balance(graph, rep, cluster)
    assert res.plan.dp_shares is not None
    a100, v100 = res.plan.samples_per_replica()
    assert a100 > v100 and a100 + v100 == 32
    # and the simulator agrees the uneven plans are faster than the even ones
    for even, uneven in ((pipe, hetero.balance(graph, pipe, cluster).plan), (rep, res.plan)):
        t_even = simulate(graph, cluster, even, memory=False).iteration_time_s
        t_uneven = simulate(graph, cluster, uneven, memory=False).iteration_time_s
        assert t_uneven < t_even


def test_replicas_with_fewer_micro_batches_than_replicas_keep_even_shares_on_a_mixed_cluster():
    """A degree that does not divide the batch can leave fewer whole micro-batches than replicas
    (4 replicas of 1 or 2 samples at micro-batch 2: 3 micro-batches). Re-balancing by batch then
    has nothing to hand out; it raised instead, and the raise ended the whole 3D search (GPT-3
    175B on large-mixed:nodes=128, global batch 1536: 'no family proposed a plan'). The replicas
    keep their even shares, and the search answers."""
    cluster = load_cluster("mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2")
    uneven = Plan(dp=4, tp=1, pp=1, micro_batch=2, global_batch=6, dtype="fp16", dp_shares=[0.25] * 4)
    res = hetero.balance(MIXED, uneven, cluster)
    assert res is not None and res.plan.samples_per_replica() == [2, 2, 1, 1]
    found = plan(MIXED, cluster, global_batch=6, simulate=False, space=SearchSpace(tp=[1], pp=[1]))
    assert found.best.plan.dp == 4


def test_search_on_mixed_cluster_uses_uneven_splits_and_beats_equal_treatment():
    graph = MIXED
    cluster = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2"
    space = SearchSpace(recompute=("selective",), zero=(1,), schedules=("1f1b",), sequence_parallel=(False,))
    aware = plan(graph, cluster, global_batch=32, top=1, finalists=6, space=space, seed=1)
    equal = plan(graph, cluster, global_batch=32, top=1, finalists=6, seed=1,
                 space=SearchSpace(recompute=("selective",), zero=(1,), schedules=("1f1b",),
                                   sequence_parallel=(False,), hetero=False))
    best = aware.best.plan
    assert best.layer_split is not None or best.dp_shares is not None
    assert equal.best.plan.layer_split is None and equal.best.plan.dp_shares is None
    assert aware.best.iteration_time_s < equal.best.iteration_time_s


def test_placement_beats_megatron_order_on_uneven_links_and_is_deterministic():
    graph = gpt_opgraph(gpt_config("gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=1024"))
    cluster = "uneven:nodes=4,gpus_per_node=2,slow_fraction=0.5,seed=1"
    space = SearchSpace(tp=[2], pp=[2], micro_batch=[1], recompute=("selective",), zero=(1,),
                        schedules=("1f1b",), sequence_parallel=(False,))
    a = plan(graph, cluster, global_batch=32, top=1, space=space, seed=3)
    b = plan(graph, cluster, global_batch=32, top=1, space=space, seed=3)
    pl = a.best.placement
    assert pl is not None and pl.cost <= pl.default_cost
    assert a.best.plan.device_order == b.best.plan.device_order
    assert a.best.iteration_time_s <= a.best.default_order_time_s * (1 + 1e-9)


def test_search_never_offers_a_plan_the_runtime_refuses() -> None:
    """The driver hands the planner `plait.runtime.supports`: every plan it returns the runtime
    accepts, and a refusal is counted among the pruned with its reason."""
    from plait.api import plan as search
    from plait.runtime import supports
    from plait.search import SearchSpace

    space = SearchSpace(tp=[1], pp=[1, 2], schedules=("interleaved", "1f1b"), zero=(0, 3))
    res = search(TINY, HOMO, global_batch=4, top=50, simulate=False, space=space)
    assert res.top and all(supports(c.plan)[0] for c in res.top)

    def refuse_pp(p):
        return (p.pp == 1, "plan field 'pp': refused by this test")

    res2 = search(TINY, HOMO, global_batch=4, top=50, simulate=False, space=space, supports=refuse_pp)
    assert all(c.plan.pp == 1 for c in res2.top)
    assert any("runtime cannot run it (plan field 'pp')" in r for r in res2.pruned_reasons)
