"""`plait report`: the page of a plan file and of a run folder, its content, and a real browser's view.

tests/data/report_run is the folder of a real `plait run` (2-stage pipeline of a tiny GPT on one
A100 and one V100 node, 3 steps on CPU; config.json, cluster.yaml, result.json, losses.csv).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plait.cli import main
from plait.ir.diagnosis import Diagnosis, Finding
from plait.ir.plan import Plan
from plait.report import ReportError, load, render, write_report

RUN = Path(__file__).parent / "data" / "report_run"
MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256"
CLUSTER = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2"
FABRIC = "examples/clusters/leaf-spine.yaml"
ROOT = Path(__file__).resolve().parents[1]


def _sections(html: str) -> list[str]:
    return re.findall(r'<section id="([a-z]+)"', html)


def _self_contained(html: str) -> None:
    """Nothing a browser would fetch: no src/href attributes, no CSS url() or @import."""
    assert not re.search(r"\b(src|href)\s*=", html), "the page references another file"
    assert "url(" not in html and "@import" not in html and "<script" not in html


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "plan.json"
    Plan.parse("dp=2,pp=2,micro_batch=2,global_batch=16,dtype=bf16").save(path)
    return path


def test_plan_file_report_shows_plan_prediction_memory_and_traffic(plan_file):
    data = load(plan_file, MODEL, CLUSTER)
    html = render(data)
    _self_contained(html)
    assert _sections(html) == ["plan", "timeline", "memory", "traffic"]  # no run: no doctor section
    # the summary's numbers are the simulator's and the memory estimator's
    assert f"{data.sim.iteration_time_s * 1e3:.2f} ms" in html
    free, dev = data.memory_margin
    assert free == min(data.sim.memory.capacity_bytes[d] - data.sim.memory.peak_bytes[d]
                       for d in data.sim.memory.devices)
    assert f"{free / 2**30:.1f} GiB" in html
    # placement: every device of the plan has a role, stage by stage
    assert sorted(data.roles) == sorted(Plan.load(plan_file).device_of(r) for r in range(4))
    assert {r["stage"] for r in data.roles.values()} == {0, 1}
    assert html.count("GPU 0 · r0") == 1 and "s1 dp1 tp0" in html
    # the critical path is drawn, and it spans the predicted iteration
    path = data.sim.critical_path
    assert path and abs(path[-1]["end_s"] - path[0]["start_s"] - data.sim.iteration_time_s) < 1e-9 * 10
    assert 'class="crit"' in html and "critical path" in html
    # traffic: the matrix carries the bytes plait.cost.traffic counts (pp activations, dp gradients)
    tr = data.traffic
    assert set(tr.by_class) >= {"pp", "dp"}
    assert sum(map(sum, tr.matrix)) > 0 and "traffic heat map" in html
    assert not tr.links  # no switched fabric in this preset


def test_fabric_cluster_report_has_cable_loads(plan_file):
    plan = Plan.parse("dp=2,tp=2,pp=2,micro_batch=1,global_batch=8,dtype=bf16,device_order="
                      + ":".join(str(d) for d in (0, 1, 8, 9, 16, 17, 24, 25)))
    path = plan_file.with_name("fabric.json")
    plan.save(path)
    data = load(path, "gpt:layers=4,hidden=256,heads=8,seq=64,vocab=512", str(ROOT / FABRIC))
    assert data.traffic.routing == "ECMP" and data.traffic.links
    # the cables carry what crosses nodes: at least every inter-node byte once (ports + uplinks)
    dev = data.cluster.devices
    cross = sum(data.traffic.matrix[i][j] for i, a in enumerate(data.traffic.devices)
                for j, b in enumerate(data.traffic.devices) if dev[a].node != dev[b].node)
    ports = sum(link.bytes for link in data.traffic.links if ".nic" in link.name and ">" in link.name)
    assert cross > 0 and ports > 0
    html = render(data)
    assert "Busiest fabric cables (ECMP)" in html and "cable loads" in html


def test_run_folder_report_shows_measured_step_and_doctor(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    data = load(run)
    assert data.kind == "run" and data.run is not None
    times = json.loads((RUN / "result.json").read_text())["iteration_times"]
    assert data.measured_s == pytest.approx(sum(times[1:]) / len(times[1:]))
    assert data.measured_step is not None and data.measured_step.events
    assert {e.resource for e in data.measured_step.events} & {e.resource for e in data.sim.timeline.events}
    assert any("diagnosis.json" in n for n in data.notes)
    html = render(data)
    _self_contained(html)
    assert _sections(html) == ["plan", "timeline", "memory", "traffic", "doctor"]
    assert "Measured (step" in html and "measured Gantt chart" in html and "not comparable" in html
    assert "has not looked at this run" in html
    # the doctor's findings, when there are some
    diag = Diagnosis(run_dir=str(run), world_size=2, findings=[
        Finding("slow_link", (0, 1), 1.25, step=1, collective="send_recv pp", evidence={"ratio": 3.5},
                nodes=("a100-0", "v100-0"))])
    (run / "diagnosis.json").write_text(json.dumps(diag.to_dict()))
    html = render(load(run))
    assert "slow link" in html and "ratio=3.5" in html and "a100-0, v100-0" in html
    (run / "diagnosis.json").write_text(json.dumps(Diagnosis(run_dir=str(run)).to_dict()))
    assert "healthy" in render(load(run))
    (run / "diagnosis.json").write_text("{not json")  # unreadable: said, and the page still written
    data = load(run)
    assert data.diagnosis is None and any("unreadable" in n for n in data.notes)
    (run / "result.json").unlink()  # a run that did not finish: the prediction, and the note why
    data = load(run)
    assert data.run is None and data.measured_s is None and any("did not finish" in n for n in data.notes)
    assert "Measured (step" not in render(data)


def test_bad_sources_are_clear_errors(tmp_path, plan_file, capsys):
    with pytest.raises(ReportError, match="give --model and --cluster"):
        load(plan_file)
    with pytest.raises(ReportError, match="no such plan file or run folder"):
        load(tmp_path / "nope")
    with pytest.raises(ReportError, match="not a plait run folder"):
        load(tmp_path)
    old = tmp_path / "old"
    shutil.copytree(RUN, old)
    (old / "cluster.yaml").unlink()
    with pytest.raises(ReportError, match="no cluster.yaml.*--cluster"):
        load(old)
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "plait report: error:" in err and err.count("\n") == 1


def test_cli_writes_the_page(tmp_path, plan_file, capsys):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file() and "measured" in capsys.readouterr().out
    out = tmp_path / "p.html"
    assert main(["report", str(plan_file), "--model", MODEL, "--cluster", CLUSTER, "-o", str(out)]) == 0
    assert out.read_text().startswith("<!doctype html>")


# ----------------------------------------------------------------------------- a real browser
def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium (make browser installs it)")
def test_headless_chromium_renders_the_report(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    page = run / "report.html"
    write_report(run, page)
    browser = _chromium()
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # the browser parsed the page into the sections, cards and charts the HTML says
    assert re.findall(r'<section id="([a-z]+)"', dom.stdout) == ["plan", "timeline", "memory", "traffic", "doctor"]
    assert dom.stdout.count('class="card"') >= 6 and dom.stdout.count("<svg") >= 6
    assert 'aria-label="predicted Gantt chart"' in dom.stdout and 'aria-label="measured Gantt chart"' in dom.stdout
    shot = tmp_path / "report.png"
    done = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1280, 2400)
    assert len(png) > 50_000  # drawn, not a blank page (a blank 1280x2400 PNG is a few KiB)


def test_large_clusters_keep_the_page_small(tmp_path):
    """128 GPUs: the heat map is node x node, identical memory rows fold, the Gantt keeps its rows."""
    path = tmp_path / "wide.json"
    Plan.parse("dp=32,tp=4,micro_batch=1,global_batch=64,dtype=bf16").save(path)
    data = load(path, "gpt:layers=4,hidden=256,heads=8,seq=64,vocab=512", "a100-80g:nodes=16")
    html = render(data)
    assert len(data.traffic.devices) == 128
    assert html.count("per iteration</title>") == 16 * 16  # one cell per node pair
    assert "GPUs 0-127 · a100-80gb (128)" in html  # one memory row for 128 identical GPUs
    assert len(html) < 2_000_000


def test_prediction_for_this_machine_is_shown_and_compared(tmp_path):
    """`plait run --predict --run-dir` keeps its prediction in prediction.json; the report draws it
    beside the measured step and takes the error against it (not against the GPUs' prediction)."""
    from types import SimpleNamespace

    from plait.commands.run_cmd import write_prediction
    from plait.sim.api import simulate

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    cfg = json.loads((RUN / "config.json").read_text())
    sim = simulate(cfg["model"], str(RUN / "cluster.yaml"), Plan.from_dict(cfg["plan"]))
    measured = 0.03
    mr = SimpleNamespace(prediction=SimpleNamespace(result=sim), summary=lambda: {
        "predicted_iteration_s": sim.iteration_time_s * 2, "measured_iteration_s": measured})
    assert write_prediction(run, mr, ["a note"]).name == "prediction.json"
    data = load(run)
    assert data.machine is not None and data.predicted_s == pytest.approx(sim.iteration_time_s * 2)
    assert data.measured_s == measured  # the figure --predict compared with, not the report's own mean
    assert data.error == pytest.approx((data.predicted_s - data.measured_s) / data.measured_s)
    assert len(data.machine.timeline.events) == len(sim.timeline.events)
    html = render(data)
    assert "Predicted for this machine" in html and "machine Gantt chart" in html
    assert "this machine&#x27;s prediction" in html and "not comparable" not in html
    (run / "prediction.json").write_text(json.dumps({"format_version": 99}))
    assert load(run).machine is None  # a newer file: said in the notes, the page still written


@pytest.mark.parametrize("family, model, cluster, batch", [
    ("graph", "mmt:branches=2,layers=2,hidden=64,heads=4,seq=16,in_dim=16,dropout=0,attn_dropout=0",
     "a100-80g:nodes=1,gpus_per_node=4", "32"),
    ("spmd", "bert:layers=1,hidden=32,heads=4,seq=8,vocab=64,dropout=0,attn_dropout=0",
     "emulated-mixed:gpus_per_node=1", "8"),
])
def test_one_family_search_writes_the_search_file_too(tmp_path, capsys, family, model, cluster, batch):
    """`plait plan --family graph|spmd --out` writes `PLAN.search.json` as the default search does:
    one row, the family's pick, naming the plan written beside it; the report of either plan shows it."""
    from plait.search.summary import read_summary

    out = tmp_path / "plan.json"
    assert main(["plan", "--family", family, "--model", model, "--cluster", cluster, "--global-batch", batch,
                 "--out", str(out)]) == 0
    saved = read_summary(tmp_path / "plan.search.json")
    assert [(r["family"], r["status"]) for r in saved["families"]] == [(family, "picked")]
    assert saved["picked"]["plan"] == saved["families"][0]["best_plan"] == str(Plan.load(out))
    assert saved["picked"]["iteration_time_s"] > 0 and saved["families"][0]["margin_bytes"] > 0
    assert "plan.search.json" in capsys.readouterr().out.replace("\n", "")  # rich wraps a long path
    data = load(out, model, cluster)  # the report of either plan: its search, prediction and memory margin
    assert data.search is not None and data.predicted_s > 0
    assert data.memory_margin is not None and data.memory_margin[0] > 0
    if family == "spmd":  # every program rank holds the whole model; the matrix is its collectives' ring
        assert sorted(data.roles) == sorted(Plan.load(out).device_of(r) for r in range(Plan.load(out).world_size))
        tr = data.traffic
        assert tr is not None and set(tr.by_class) <= {"spmd"}  # (this tiny program may replicate every op)
        assert sum(map(sum, tr.matrix)) == pytest.approx(sum(tr.by_class.values()))  # every wire byte, device to device
        assert all(tr.matrix[i][i] == 0 for i in range(len(tr.devices)))
        assert any("SPMD program" in n for n in data.notes)
        html = render(data)
        assert "What the SPMD program keeps on each GPU" in html


def test_unified_search_file_gives_the_per_family_table(tmp_path, capsys):
    """`plait plan --out` writes each family's best beside the plan; the report of that plan shows
    it as the search section (picked family first in the text, declined families with their
    reason), and a damaged search file is a note, not a failure."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "16", "--top", "2",
                 "--no-progress", "--out", str(out)]) == 0
    search = tmp_path / "plan.search.json"
    assert search.is_file() and "plan.search.json" in capsys.readouterr().out.replace("\n", "")  # a long path wraps
    saved = json.loads(search.read_text())
    assert saved["format_version"] == 1
    rows = {r["family"]: r for r in saved["families"]}
    assert set(rows) >= {"3d", "graph", "spmd"}
    assert sum(r["status"] == "picked" for r in rows.values()) == 1
    picked = next(r for r in rows.values() if r["status"] == "picked")
    assert picked["best_plan"] == str(Plan.load(out)) == saved["picked"]["plan"]
    searched = [r for r in rows.values() if r["status"] != "declined"]
    # the pick is the fastest family's best, as the one simulator ranked them
    assert picked["iteration_time_s"] == min(r["iteration_time_s"] for r in searched)
    assert all(r.get("reason") for r in rows.values() if r["status"] == "declined")
    data = load(out, MODEL, CLUSTER)
    html = render(data)
    assert _sections(html) == ["plan", "search", "timeline", "memory", "traffic"]
    for r in rows.values():
        assert f"<td>{r['family']}</td>" in html
    assert f"{picked['iteration_time_s'] * 1e3:.2f} ms" in html
    search.write_text('{"format_version": 99}')
    data = load(out, MODEL, CLUSTER)
    assert data.search is None and any("newer than this plait reads" in n for n in data.notes)
    with pytest.raises(Exception, match="newer than this plait reads"):
        load(out, MODEL, CLUSTER, search=search)
