"""Smoke test of bench/doctor.py's analysis (no runs): hand-written run folders with their case
files -> per-class precision / recall / attribution, and the two baselines' views."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.test_doctor import write_run

_spec = importlib.util.spec_from_file_location("bench_doctor", Path(__file__).parents[1] / "bench" / "doctor.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_doctor"] = bench
_spec.loader.exec_module(bench)


def _case(root: Path, cid: str, cls: str, truth: list[int], onset: int, **faults: object) -> None:
    d = write_run(root / cid, **faults)
    case = bench.Case(cid, cls, "DP", "dp=4", "", truth, onset, 0)
    (d / "case.json").write_text(json.dumps({"case": case.__dict__, "rc": 0, "wall_s": 1.0,
                                             "iteration_times": [0.2] * 10, "run_wall_s": 2.0}))


def test_bench_analysis_on_hand_written_runs(tmp_path: Path) -> None:
    _case(tmp_path, "slow_rank-00", "slow_rank", [2], 4, slow=(2, 4, 2.5, 1))
    _case(tmp_path, "slow_link-00", "slow_link", [0, 3], 3, link=(0, 3, 3, 2.0))
    _case(tmp_path, "comm_hang-00", "comm_hang", [1], 5, skip=(1, 5))
    _case(tmp_path, "mismatch-00", "mismatch", [3], 6, mismatch=(3, 6))
    _case(tmp_path, "clean-00", "clean", [], 0)
    rows = [bench.analyse_case(d, bench.Thresholds()) for d in sorted(tmp_path.iterdir())]
    by = {r["id"]: r for r in rows}
    s = bench.summarise(rows)["per_class"]
    for cls in ("slow_rank", "slow_link", "comm_hang", "mismatch"):
        assert (s[cls]["precision"], s[cls]["recall"], s[cls]["attribution"]) == (100.0, 100.0, 100.0), cls
    assert by["clean-00"]["verdict"] == "healthy"
    # Flight Recorder's matching: the skipped call as a hang naming the rank, the mismatch; no slowness.
    assert (by["comm_hang-00"]["fr"], by["comm_hang-00"]["fr_culprit"]) == ("hang", [1])
    assert by["mismatch-00"]["fr"] == "mismatch" and by["slow_rank-00"]["fr"] == "healthy"
    # The straggler scores: the slow rank, never the link.
    assert (by["slow_rank-00"]["sd"], by["slow_rank-00"]["sd_culprit"]) == ("slow_rank", [2])
    assert by["slow_link-00"]["sd"] == "healthy"


def test_set_matching_counts_a_missed_second_fault_and_the_live_replay(tmp_path: Path) -> None:
    # Two faults in one run (a slow rank and a skip): both must be found; the live replay names
    # nothing before the onset; a damaged copy of rank 0's file adds no finding.
    d = write_run(tmp_path / "two_faults-00", steps=10, slow=(1, 2, 2.5, 1), skip=(3, 8))
    case = bench.Case("two_faults-00", "two_faults", "DP", "dp=4", "", [1], 2, 0,
                      faults=[["slow_rank", [1]], ["comm_hang", [3]]])
    (d / "case.json").write_text(json.dumps({"case": case.__dict__, "rc": 0, "wall_s": 1.0}))
    row = bench.analyse_case(d, bench.Thresholds())
    s = bench.summarise([row])
    assert s["set_post_hoc"]["slow_rank"]["recall"] == 100.0 and s["set_post_hoc"]["comm_hang"]["recall"] == 100.0
    assert s["set_live"]["slow_rank"]["recall"] == 100.0 and not s["live_before_onset"]
    assert s["damaged"]["extra_findings"] == 0, s["damaged"]
    # the same scoring on the first finding alone would miss the slow rank: set matching counts it
    row["found"] = row["found"][:1]
    assert bench.summarise([row])["set_post_hoc"]["slow_rank"]["recall"] == 0.0


def test_cases_are_random_but_reproducible() -> None:
    a, b = bench.make_cases(2, 1, seed=7), bench.make_cases(2, 1, seed=7)
    assert a == b and len(a) == (6 + 4) * 2 + 2  # a clean case also runs with recording off
    assert {c.cls for c in a} == {*bench.CLASSES, *bench.EXTRA, "clean"} and any(not c.recording for c in a)
    two = [c for c in a if c.cls == "two_faults"]
    assert all([k for k, _ in c.faults] == ["slow_rank", "dead_rank"] and ";" in c.spec for c in two)
    assert all(1.5 <= float(c.spec.split("factor=")[1].split(",")[0]) <= 4.0 for c in a if "factor=" in c.spec)
    up = [c for c in a if c.cls == "uplink"]
    assert all(c.spec.startswith(f"uplink:node={c.node},") and c.node < c.cluster for c in up)
    assert all(c.timeout > bench.TIMEOUT and ",for=" in c.spec for c in a if c.cls == "stop_resume")


def test_scenarios_score_an_uplink_by_its_crossing_pairs_and_allow_a_hogged_rank(tmp_path: Path) -> None:
    # An uplink case on 4 one-rank nodes: its truth is the 3 pairs crossing node 2, read from the
    # run's layout, and the findings name the node; a hog run's slow rank of the hogged rank is no
    # false finding, a slow rank elsewhere is.
    nodes = ["n0", "n1", "n2", "n3"]
    d = write_run(tmp_path / "uplink-00", world=4, steps=10, nodes=nodes, uplink=("n2", 4, 3.0))
    cfg = json.loads((d / "config.json").read_text())
    for r in cfg["ranks"]:
        r["node"] = int(r["host"][1:])
    (d / "config.json").write_text(json.dumps(cfg))
    case = bench.Case("uplink-00", "uplink", "DP", "dp=4", "uplink:node=2,factor=3,from=4", [], 4, 0, node=2)
    (d / "case.json").write_text(json.dumps({"case": case.__dict__, "rc": 0, "wall_s": 1.0}))
    h = write_run(tmp_path / "hog-00", slow=(1, 4, 2.5, 1))
    hog = bench.Case("hog-00", "hog", "DP", "dp=4", "hog:rank=1,from=4", [1], 4, 0, faults=[])
    (h / "case.json").write_text(json.dumps({"case": hog.__dict__, "rc": 0, "wall_s": 1.0}))
    rows = [bench.analyse_case(x, bench.Thresholds()) for x in (d, h)]
    assert rows[0]["faults"] == [["slow_link", [0, 2]], ["slow_link", [1, 2]], ["slow_link", [2, 3]]]
    assert rows[0]["uplink_named"] is True
    s = bench.summarise(rows)
    assert s["scenario_post_hoc"]["uplink"]["recall"] == 100.0 and s["scenario_post_hoc"]["uplink"]["false"] == 0
    assert s["scenario_post_hoc"]["hog"]["false"] == 0 and s["set_post_hoc"]["slow_rank"]["precision"] is None
    rows[1]["tolerated"] = [["slow_rank", [3]]]  # the hog beside rank 3: rank 1's slow_rank is false
    assert bench.summarise(rows)["scenario_post_hoc"]["hog"]["false"] == 1


def _clean_bench():  # bench/doctor_clean.py, loaded as the suite is
    spec = importlib.util.spec_from_file_location("bench_doctor_clean", Path(__file__).parents[1] / "bench" /
                                                  "doctor_clean.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_clean_recover_bench_counts_live_findings_and_recoveries(tmp_path: Path) -> None:
    # bench/doctor_clean.py's analysis on hand-written folders: a clean run counts nothing; a run
    # whose records hold a slow rank counts it live and post hoc; a second phase is a recovery.
    clean = _clean_bench()
    for name, kw, phases in (("a", {}, 1), ("b", {"slow": (1, 3, 2.5, 1)}, 2)):
        d = tmp_path / name
        write_run(d / "phase-0", **kw)
        result = {"phases": [{"ended": "finished"}] * phases, "transitions": [{}] * (phases - 1), "actions": []}
        (d / "bench.json").write_text(json.dumps({"rc": 0, "wall_s": 1.0, "plan": "dp=4", "result": result}))
    rows = [clean.analyse(tmp_path / n, bench.Thresholds()) for n in ("a", "b")]
    s = clean.summarise(rows)
    assert (s["runs"], s["recoveries"], s["runs_with_live_findings"], s["runs_with_post_hoc_findings"]) == (2, 1, 1, 1)
    assert rows[0]["live"] == [] and rows[1]["live"][0].startswith("slow_rank[1]@") and len(s["false"]) == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_clean_recover_bench_runs_one_clean_run_that_does_nothing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # One real clean `plait run --recover` of the bench (the 20-run figure: python bench/doctor_clean.py).
    assert _clean_bench().main(["--runs", "1", "--steps", "12", "--out", str(tmp_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert (s["runs"], s["failed"], s["recoveries"], s["runs_with_actions"]) == (1, 0, 0, 0), s
