"""The search driver over several planner families (plait.search.driver)."""

import pytest

from plait.ir.plan import Plan
from plait.plan.threed import Candidate, PlanResult, SearchError
from plait.search import FAMILIES, plan, register_family

MODEL = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128"
CLUSTER = "a100-80gb:nodes=1,gpus_per_node=4"


def _fixed(seconds: float, fail: str | None = None):
    def search(model, cluster, *, global_batch, top, evaluate, supports, compute, **_):
        if fail:
            raise SearchError(fail)
        p = Plan(dp=cluster.num_devices, global_batch=global_batch or 8)
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
    register_family("fast", _fixed(1e-9))
    register_family("never", _fixed(1.0, fail="no branches in this model"))
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
    register_family("never", _fixed(1.0, fail="no branches in this model"))
    with pytest.raises(SearchError, match="no branches"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="never")
    with pytest.raises(SearchError, match="unknown"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="4d")
    with pytest.raises(SearchError, match="not taken"):
        plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="never", finalists=3)
    res = plan(MODEL, CLUSTER, global_batch=8, simulate=False, families="3d", finalists=2)
    assert res.families == {} and res.best.family == "3d"
