"""The search's speed-ups change no result, the driver reports each family's phases, and the
search-time bench's core runs (bench/plan_search_time.py, issue 17 item 3)."""

import sys
from pathlib import Path

import pytest

from plait.api import plan
from plait.ir.plan import Plan
from plait.planners.types import Candidate, PlanResult
from plait.search import FAMILIES, NoOptions, register_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import plan_search_time  # noqa: E402

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=16,vocab=128"
MIXED = "large-mixed:nodes=2,gpus_per_node=4"


@pytest.fixture
def families():
    saved = dict(FAMILIES)
    yield
    FAMILIES.clear()
    FAMILIES.update(saved)


def _rows(res: PlanResult) -> list[tuple]:
    return [(c.family, str(c.plan), c.analytic_s, c.iteration_time_s) for c in res.top]


@pytest.mark.slow  # suite time (2026-12-07): tests/test_search_exact.py pins the same search's picks in make test
def test_fast_and_baseline_searches_agree_exactly():
    kw = dict(global_batch=16, top=6, finalists=4, families="all")
    fast = plan(MODEL, MIXED, fast=True, **kw)
    slow = plan(MODEL, MIXED, fast=False, **kw)
    assert _rows(fast) == _rows(slow)
    assert {n: (r if isinstance(r, str) else _rows(r)) for n, r in fast.families.items()} == \
        {n: (r if isinstance(r, str) else _rows(r)) for n, r in slow.families.items()}
    assert (fast.enumerated, fast.pruned, fast.ranked_analytic) == (slow.enumerated, slow.pruned, slow.ranked_analytic)


def test_progress_names_each_family_and_phase(families):
    def quiet(model, cluster, common, simulator, options):
        p = Plan(dp=cluster.num_devices, global_batch=common.global_batch)
        return PlanResult(model="m", cluster=cluster.name, global_batch=common.global_batch,
                          world_size=cluster.num_devices, top=[Candidate(plan=p, analytic_s=1.0)])

    register_family("quiet", quiet, NoOptions)  # reports no phases of its own
    seen: list[tuple[str, int, int]] = []
    plan(MODEL, "a100-80gb:nodes=1,gpus_per_node=4", global_batch=8, simulate=False, families="3d,quiet",
         finalists=2, progress=True, on_progress=lambda *a: seen.append(a))
    phases = list(dict.fromkeys(p for p, _, _ in seen))
    assert phases == ["3d", "3d memory", "3d analytic", "3d simulate", "quiet", "quiet search"]
    assert ("3d", 0, 1) in seen and seen.index(("3d", 1, 1)) < seen.index(("quiet", 0, 1))
    assert seen[-2:] == [("quiet search", 1, 1), ("quiet", 1, 1)]
    done = {p: d == t for p, d, t in seen}  # every phase ends complete
    assert all(done.values())


def test_bench_core_times_each_family_and_phase():
    run = plan_search_time.measure(MODEL, MIXED, global_batch=16, finalists=2, top=3, fast=True)
    times = run["times"]
    assert {"3d", "3d memory", "3d analytic", "3d simulate", "graph"} <= set(times)
    assert all(t >= 0 for t in times.values())
    phases = sum(t for k, t in times.items() if k.startswith("3d "))
    assert 0 < phases <= times["3d"] + 1e-6  # (enumeration runs before the first phase)
    assert times["3d"] + times["graph"] <= run["wall_s"] + 1e-6  # phases are wall time
    assert run["cpu_s"] > 0 and run["result"]["best_iteration_time_s"] > 0
    assert run["result"]["top"][0]["plan"] == run["result"]["best_plan"]


@pytest.mark.parametrize("finalists", [1, 4])
def test_bounded_analytic_ranking_keeps_the_exhaustive_finalists(finalists):
    """Ranking in order of the compute + optimizer lower bound and stopping once it passes the
    finalists-th best time picks the exhaustive ranking's finalists, times equal to the bit,
    while pricing the communication of fewer candidates."""
    from plait.cluster import load_cluster
    from plait.planners.threed import AnalyticModel, Progress, _rank_analytic, enumerate_groups
    from plait.planners.types import load_graph

    cluster = load_cluster("a100-80gb:nodes=2,gpus_per_node=4")
    graph = load_graph("gpt:layers=8,hidden=256,heads=8,seq=128,vocab=512", "bf16")[1]
    analytic = AnalyticModel(graph, cluster)
    cands = [Candidate(plan=p) for g in enumerate_groups(graph, cluster, 32) for p in g.plans]
    full = [Candidate(plan=c.plan) for c in cands]
    _rank_analytic(full, analytic, None, Progress(False, None))
    _rank_analytic(cands, analytic, finalists, Progress(False, None))

    def best(cs):
        return [(c.analytic_s, str(c.plan)) for c in sorted(cs, key=lambda c: (c.analytic_s, str(c.plan)))][:finalists]

    assert best(cands) == best(full)
    assert 0 < sum(c.analytic_s == float("inf") for c in cands) < len(cands)  # some skipped, not all


def test_gpipe_plans_reuse_their_1f1b_twins_communication_exactly():
    """The analytic model prices a GPipe plan's messages as its 1F1B twin's (the stage graph
    and the traffic never read the schedule): the same seconds as pricing it afresh."""
    import dataclasses

    from plait.cluster import load_cluster
    from plait.planners.threed import AnalyticModel
    from plait.planners.types import load_graph

    cluster = load_cluster("large-mixed:nodes=2,gpus_per_node=4")
    graph = load_graph("gpt:layers=8,hidden=256,heads=8,seq=128,vocab=512", "fp16")[1]
    fast, fresh = AnalyticModel(graph, cluster), AnalyticModel(graph, cluster, fast=False)
    for dp, tp, pp, split in [(2, 2, 2, None), (1, 2, 4, [1, 3, 3, 3]), (4, 1, 2, [6, 4]), (2, 1, 4, None)]:
        p = Plan(dp=dp, tp=tp, pp=pp, micro_batch=2, global_batch=16, dtype="fp16", zero=1, layer_split=split)
        g = dataclasses.replace(p, schedule="gpipe")
        fast.comm_times(p)  # the 1F1B twin first: the GPipe plan is a hit
        assert fast.comm_times(g) == fresh.comm_times(g) == fresh.comm_times(p)


def _random_cluster(rng) -> str:
    kinds = ["a100-40gb", "t4", "v100-16gb"]
    nodes = []
    for i in range(int(rng.integers(2, 4))):
        gpus = ", ".join(f"{{kind: {k}, count: {int(rng.integers(1, 3))}}}"
                         for k in rng.choice(kinds, size=int(rng.integers(1, 3)), replace=False))
        nodes.append(f"  - {{name: n{i}, gpus: [{gpus}], intra: {{type: pcie, bandwidth: "
                     f"{int(rng.integers(5, 200))} Gb/s, latency: {int(rng.integers(1, 9))} us}}, nic: "
                     f"{{type: ethernet, bandwidth: {int(rng.integers(5, 100))} Gb/s, latency: "
                     f"{int(rng.integers(5, 30))} us, count: {int(rng.integers(1, 4))}}}}}")
    return "name: random-bound-test\nnodes:\n" + "\n".join(nodes) + "\n"


@pytest.mark.parametrize("seed", range(5))
def test_communication_bound_holds_at_every_placement(seed):
    """`AnalyticModel.bound_with_comm` of a plan's start order is at most its analytic time at
    random kind-preserving placements (placement's moves) and at its annealed one, on random
    mixed clusters (kinds per node, intra-node and NIC speeds, NICs per node)."""
    import dataclasses

    import numpy as np

    from plait.cluster import parse_yaml_text
    from plait.planners.placement import _Space
    from plait.planners.threed import AnalyticModel, _place, enumerate_groups
    from plait.planners.types import load_graph

    rng = np.random.default_rng(seed)
    cluster = parse_yaml_text(_random_cluster(rng))
    kinds, nodes = [d.kind.name for d in cluster.devices], [d.node for d in cluster.devices]
    graph = load_graph("gpt:layers=6,hidden=256,heads=8,seq=128,vocab=512", "fp16")[1]
    analytic = AnalyticModel(graph, cluster)
    gb = 8 * cluster.num_devices
    checked = 0
    for g in enumerate_groups(graph, cluster, gb):
        if g.key[6] != "none" or g.key[3] == "gpipe":  # recompute and GPipe add no message
            continue
        p = g.plans[0] if g.order == list(range(g.plans[0].world_size)) else \
            dataclasses.replace(g.plans[0], device_order=g.order)
        parts = analytic.compute_and_optimizer(p)
        bound = analytic.bound_with_comm(p, parts)
        assert analytic.lower_bound(parts) <= bound
        start = np.asarray(g.order + [d for d in range(cluster.num_devices) if d not in g.order])
        space = _Space(start, kinds, nodes)
        orders = [space.shuffle(start, rng, level) for level in space.levels for _ in range(2)]
        orders.append(np.asarray(_place(analytic.path_model(p), cluster, p, 0, 200).order))
        for order in orders:
            placed = dataclasses.replace(p, device_order=[int(d) for d in order[: p.world_size]])
            assert bound <= analytic.estimate(placed, parts), (str(placed), bound)
            checked += 1
    assert checked > 20
