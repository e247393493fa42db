"""Adding a planner family is one planner module and one `register_family` call (docs/DESIGN.md,
"Add a family"): the toy family of tests/toy_family.py (pure data parallelism), registered here and
nowhere in plait/, is searched by the driver beside the others, ranked by the same simulator, and
planned, shown and written by `plait plan --family toy`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from plait.api import plan
from plait.ir.plan import Plan
from plait.planners.types import PlanResult, SearchError
from plait.search import FAMILIES, register_family, resolve_families
from plait.sim.api import PlanSimulator

sys.path.insert(0, str(Path(__file__).parent))
from toy_family import ToyOptions, search_toy  # noqa: E402

MODEL = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128"
CLUSTER = "a100-80gb:nodes=1,gpus_per_node=4"
PLAIT = Path(__file__).resolve().parents[1] / "plait"


@pytest.fixture
def toy():
    """The toy family registered for one test; FAMILIES as it was afterwards."""
    saved = dict(FAMILIES)
    register_family("toy", search_toy, ToyOptions)  # the one line a new family adds
    yield
    FAMILIES.clear()
    FAMILIES.update(saved)


def test_nothing_in_plait_names_the_toy_family():
    """What makes the toy family work lives in tests/: plait/ has no branch or list naming it."""
    assert "toy" not in FAMILIES
    for path in PLAIT.rglob("*.py"):
        assert "search_toy" not in path.read_text() and '"toy"' not in path.read_text(), path


def test_the_driver_ranks_the_toy_family_with_the_others_by_the_simulator(toy):
    from plait.cluster import load_cluster
    from plait.planners.types import load_graph
    from plait.search.summary import family_rows

    assert "toy" in resolve_families("all")
    res = plan(MODEL, CLUSTER, global_batch=8, top=50, families="3d,toy", finalists=2)
    assert res.family == "3d+toy" and isinstance(res.families["toy"], PlanResult)
    own = res.families["toy"]
    assert own.family == "toy" and own.ranker == "simulator" and own.enumerated == 3  # dp = 1, 2, 4
    assert {c.family for c in res.top} == {"3d", "toy"}
    assert [c.time_s for c in res.top] == sorted(c.time_s for c in res.top)  # one ranking, one scale
    toys = [c for c in res.top if c.family == "toy"]
    assert sorted(c.plan.dp for c in toys) == [1, 2, 4]
    assert all(c.plan.tp == c.plan.pp == 1 and c.plan.micro_batch * c.plan.dp == 8 for c in toys)
    assert all(c.peak_bytes and c.headroom_by_kind and c.unsupported == "" for c in toys)
    # timed by the simulator the driver hands every family: the same seconds as simulating the plan
    evaluate = PlanSimulator(load_cluster(CLUSTER)).evaluate
    graph = load_graph(MODEL, toys[0].plan.dtype)[1]
    for c in toys:
        assert c.iteration_time_s == pytest.approx(evaluate(graph, c.plan)["iteration_time_s"], rel=1e-9)
    # the result and the search file show the family
    d = res.to_dict()
    assert d["families"]["toy"]["best_time_s"] == pytest.approx(own.best.time_s)
    assert {c["family"] for c in d["top"]} == {"3d", "toy"}
    rows = {r["family"]: r for r in family_rows(res)}
    assert rows["toy"]["status"] in ("picked", "searched") and rows["toy"]["enumerated"] == 3


def test_the_toy_family_alone_prunes_by_the_memory_estimator(toy):
    res = plan(MODEL, CLUSTER, global_batch=8, families="toy", simulate=False)
    assert res.family == "toy" and res.ranker == "analytic" and res.simulated == 0
    assert res.to_dict()["family"] == "toy"
    # a model too large for one replica's memory: every degree pruned, with the estimator's reason
    big = "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=50257"
    with pytest.raises(SearchError, match=r"toy: no data-parallel degree of gpt fits .*\(out of memory on a100-80gb"):
        plan(big, CLUSTER, global_batch=4, families="toy", simulate=False)


def test_the_toy_family_takes_its_own_options(toy):
    """`plait.plan`'s keyword `max_dp` is a field of ToyOptions only: the driver builds it and hands it
    to the toy family (dp = 1, 2 instead of 1, 2, 4); `search_plans` takes the dataclass itself."""
    from plait.cluster import load_cluster
    from plait.search import SearchOptions, search_plans

    res = plan(MODEL, CLUSTER, global_batch=8, families="toy", simulate=False, max_dp=2)
    assert sorted(c.plan.dp for c in res.top) == [1, 2] and res.enumerated == 2
    typed = search_plans(MODEL, load_cluster(CLUSTER), simulator=None, common=SearchOptions(global_batch=8),
                         families="toy", options=[ToyOptions(max_dp=2)])
    assert [str(c.plan) for c in typed.top] == [str(c.plan) for c in res.top]
    with pytest.raises(SearchError, match=r"option\(s\) \['max_dp'\] are not taken by the families \['3d'\]"):
        plan(MODEL, CLUSTER, global_batch=8, families="3d", simulate=False, max_dp=2)


def test_plait_plan_family_toy_on_the_command_line(toy, tmp_path, capsys):
    from plait.cli import main
    from plait.search.summary import read_summary, search_path

    out = tmp_path / "plan.json"
    args = ["plan", "--family", "toy", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "8"]
    assert main([*args, "--json", "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["family"] == "toy" and {c["family"] for c in res["top"]} == {"toy"}
    best = Plan.load(out)
    assert best.tp == best.pp == 1 and best.dp in (1, 2, 4) and str(best) == res["top"][0]["plan_str"]
    summary = read_summary(search_path(out))
    assert [(r["family"], r["status"]) for r in summary["families"]] == [("toy", "picked")]
    assert main([*args, "--no-progress", "--wide"]) == 0  # the table names the family
    text = capsys.readouterr().out
    assert "family" in text and "toy" in text and "dp=" in text


def test_an_unregistered_family_is_refused_by_the_command_line(capsys):
    from plait.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--family", "toy"])
    assert "invalid choice: 'toy'" in capsys.readouterr().err
