"""The search driver over several planner families (plait.search.driver)."""

from dataclasses import dataclass

import pytest

from plait.api import plan
from plait.ir.plan import Plan
from plait.planners.types import Candidate, PlanResult, SearchError
from plait.search import (
    FAMILIES,
    GraphOptions,
    NoOptions,
    SearchOptions,
    ThreeDOptions,
    register_family,
    search_plans,
)

MODEL = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128"
CLUSTER = "a100-80gb:nodes=1,gpus_per_node=4"


def _fixed(seconds: float, fail: str | None = None):
    def search(model, cluster, common, simulator, options):
        if fail:
            raise SearchError(fail)
        p = Plan(dp=cluster.num_devices, global_batch=common.global_batch or 8)
        return PlanResult(model="m", cluster=cluster.name, global_batch=p.global_batch,
                          world_size=cluster.num_devices, top=[Candidate(plan=p, analytic_s=seconds)],
                          enumerated=1, search_time_s=0.01)
    return search


@pytest.fixture
def families():
    saved = dict(FAMILIES)
    yield
    FAMILIES.clear()
    FAMILIES.update(saved)


def test_merges_families_by_time_and_keeps_each_result(families):
    register_family("fast", _fixed(1e-9), NoOptions)
    register_family("never", _fixed(1.0, fail="no branches in this model"), NoOptions)
    res = plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="3d,fast,never", finalists=2)
    assert res.best.family == "fast"  # faster than any 3D plan of the model
    assert {c.family for c in res.top} == {"fast", "3d"}
    assert [c.time_s for c in res.top] == sorted(c.time_s for c in res.top)
    assert isinstance(res.families["3d"], PlanResult) and res.families["never"] == "no branches in this model"
    d = res.to_dict()
    assert d["families"]["never"] == "no branches in this model"
    assert d["families"]["fast"]["best_time_s"] == pytest.approx(1e-9)
    assert d["top"][0]["family"] == "fast"


def test_single_family_is_its_own_result_and_errors_are_clear(families):
    register_family("never", _fixed(1.0, fail="no branches in this model"), NoOptions)
    with pytest.raises(SearchError, match="no branches"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="never")
    with pytest.raises(SearchError, match="unknown"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="4d")
    with pytest.raises(SearchError, match="not taken"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="never", finalists=3)
    res = plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="3d", finalists=2)
    assert res.families == {} and res.best.family == "3d"


@dataclass(frozen=True)
class _KnobOptions:
    knob: int = 0
    """A field of this family's options only."""


@dataclass(frozen=True)
class _DialOptions:
    dial: str = "low"
    """A field of the other family's options only."""


def _recording(seen: dict, name: str):
    """A family that records what the driver hands it and proposes one data-parallel plan."""
    def search(model, cluster, common, simulator, options):
        seen[name] = (model, common, simulator, options)
        p = Plan(dp=cluster.num_devices, global_batch=common.global_batch)
        return PlanResult(model="m", cluster=cluster.name, global_batch=p.global_batch,
                          world_size=cluster.num_devices, top=[Candidate(plan=p, analytic_s=1.0)])
    return search


def test_the_driver_hands_each_family_its_own_typed_options(families):
    from plait.cluster import load_cluster
    from plait.runtime import supports

    seen: dict = {}
    register_family("knob", _recording(seen, "knob"), _KnobOptions)
    register_family("dial", _recording(seen, "dial"), _DialOptions)
    plan(MODEL, CLUSTER, global_batch=8, top=3, simulate=False, families="knob,dial", knob=7, dtype="fp32")
    model, common, simulator, knob = seen["knob"]
    assert knob == _KnobOptions(knob=7) and seen["dial"][3] == _DialOptions()  # built, else its defaults
    assert model.spec == MODEL and simulator is None  # the spec string resolved once, into its ModelSpec
    assert isinstance(common, SearchOptions) and (common.global_batch, common.top, common.dtype) == (8, 3, "fp32")
    assert common.supports is supports and callable(common.on_progress)  # filled in by the driver
    # search_plans takes the dataclasses themselves; each goes to the family registered with its type
    search_plans(None, load_cluster(CLUSTER), simulator=None, common=SearchOptions(global_batch=4),
                 families=["dial", "knob"], options=[_DialOptions(dial="high"), _KnobOptions(knob=1)])
    assert seen["dial"][3] == _DialOptions(dial="high") and seen["knob"][3] == _KnobOptions(knob=1)
    assert seen["knob"][0] is not None and seen["knob"][1].global_batch == 4  # the default model, resolved


def test_bad_options_are_refused_naming_them(families):
    from plait.cluster import load_cluster

    register_family("never", _fixed(1.0, fail="no branches in this model"), NoOptions)
    with pytest.raises(SearchError, match=r"option\(s\) \['finalistz'\] are not taken by the families \['3d', 'graph'\]"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="3d,graph", finalistz=2)
    with pytest.raises(SearchError, match="option finalists must be a whole number >= 1 or None, got 0"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, finalists=0)
    with pytest.raises(SearchError, match="option top must be a whole number >= 1, got 0"):
        SearchOptions(top=0)
    with pytest.raises(SearchError, match="option dtype must be one of"):
        SearchOptions(dtype="fp8")
    with pytest.raises(SearchError, match="option candidates"):
        GraphOptions(candidates=0)
    cluster = load_cluster(CLUSTER)
    with pytest.raises(SearchError, match=r"GraphOptions are the options of \['graph'\], not of the families "
                                          r"searched \['3d', 'never'\]"):
        search_plans(MODEL, cluster, simulator=None, families="3d,never", options=[GraphOptions()])
    with pytest.raises(SearchError, match="two ThreeDOptions"):
        search_plans(MODEL, cluster, simulator=None, options=[ThreeDOptions(), ThreeDOptions(seed=1)])

    @dataclass(frozen=True)
    class Required:
        width: int  # no default: the driver could not build it for a caller who gives none

    with pytest.raises(SearchError, match="options 'Required' must build with no arguments"):
        register_family("broken", _fixed(1.0), Required)
    with pytest.raises(SearchError, match="options 'dict' must be a dataclass"):
        register_family("broken", _fixed(1.0), dict)
    assert "broken" not in FAMILIES


# two servers that each mix 2 A100s and 2 T4s, joined by 10 Gb/s Ethernet (bench/data/
# mixed_2node_slow.yaml at half size): a kind layout's start order puts the first and last
# pipeline stages (the tied embedding) on different servers, which placement then avoids
SLOW_MIXED = """
name: a100t4x2-slow-test
# the T4 at its datasheet rate, as the scenario was built (the catalog's T4 is power-capped since)
gpu_kinds: {t4: {like: t4, tensor_sustained: 1.0}}
nodes:
  - name: m0
    gpus: [{kind: a100-40gb, count: 2}, {kind: t4, count: 2}]
    intra: {type: pcie, bandwidth: 12 GB/s, latency: 5 us}
    nic: {type: ethernet, bandwidth: 10 Gb/s, latency: 25 us}
  - name: m1
    gpus: [{kind: a100-40gb, count: 2}, {kind: t4, count: 2}]
    intra: {type: pcie, bandwidth: 12 GB/s, latency: 5 us}
    nic: {type: ethernet, bandwidth: 10 Gb/s, latency: 25 us}
"""


def test_finalists_are_the_exhaustive_placed_ranking_best():
    """The driver against brute force: the 3D family's finalists are chosen on their placed
    orders (the orders they are simulated at), so the bounded search's best plans are the best of
    every candidate placed and timed -- plan, order and seconds equal. Ranking on the layouts'
    unplaced start orders (before the fix) missed the best plan here: its start order sent the
    tied embedding's gradients across the 10 Gb/s link."""
    from plait.cluster import parse_yaml_text
    from plait.cost.compute import DEFAULT_MODEL

    cluster = parse_yaml_text(SLOW_MIXED)
    model = "gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=50257"
    # a fixed compute model (calib5's first refit), so that a recalibration of the defaults does not
    # change the scenario: with it the best plan is a placed pp = 4 one
    fixed = DEFAULT_MODEL.replace(unaligned_penalty=2.34, memory_efficiency=0.900, kernel_gpu_s=8.45e-6,
                                  host_fwd_s=46.9e-6, host_bwd_s=61.9e-6, host_comm_s=0.64e-6, p2p_host_s=472e-6,
                                  loss_host_s=0.394e-3, batch_host_s=0.355e-3, step_host_s=0.018e-3)
    opts = {"global_batch": 16, "simulate": False, "placement_iterations": 300, "compute": fixed,
            "precision": "megatron"}  # the scenario's memory as it was built (amp's prunes the placed pick)
    full = plan(model, cluster, top=10_000, finalists=None, **opts)
    res = plan(model, cluster, top=2, finalists=2, **opts)
    assert [(c.analytic_s, str(c.plan)) for c in res.top] == [(c.analytic_s, str(c.plan)) for c in full.top[:2]]
    assert full.top[0].plan.device_order is not None  # the best plan is a placed one


MIXED = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2"


def test_chain_on_mixed_kinds_asks_the_graph_family():
    # issue 36: beside the 3D family, a chain model on mixed GPU kinds still gets the graph
    # family's kind-homogeneous pipelines; on one kind the graph family declines chains.
    mixed = plan(MODEL, MIXED, global_batch=8, top=2, simulate=False, families=["3d", "graph"])
    assert isinstance(mixed.families["graph"], PlanResult) and mixed.families["graph"].top
    best = min(c.analytic_s for f in mixed.families.values() if isinstance(f, PlanResult) for c in f.top)
    assert mixed.top[0].analytic_s == pytest.approx(best)
    one = plan(MODEL, CLUSTER, global_batch=8, top=2, simulate=False, families=["3d", "graph"])
    assert isinstance(one.families["graph"], PlanResult)  # on one kind too (its plans may use fewer GPUs)
    old = plan(MODEL, CLUSTER, global_batch=8, top=2, simulate=False, families=["3d", "graph"],
               graph_chains="mixed-kinds")  # the driver of commit 67308ef declined there
    assert "no branches" in old.families["graph"]


def test_graph_chains_runs_the_policy_before_issue_36_beside_todays():
    # `graph_chains="never"` is the driver before issue 36 (the graph family declines chains beside
    # the 3D family), so a bench can run it next to today's default ("always").
    before = plan(MODEL, MIXED, global_batch=8, top=2, simulate=False, families=["3d", "graph"],
                  graph_chains="never")
    assert "no branches" in before.families["graph"]
    with pytest.raises(SearchError, match="graph_chains"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families=["3d", "graph"], graph_chains="sometimes")


def test_no_model_means_the_default_model_in_the_graph_familys_chain_check():
    """`plait.plan()` without a model plans DEFAULT_MODEL: the graph family's chain check reads it too
    (it once tried to load None and declined with "model: expected a zoo spec")."""
    res = plan(None, CLUSTER, global_batch=8, simulate=False, families=["3d", "graph"], graph_chains="never")
    assert "has no branches" in res.families["graph"]
