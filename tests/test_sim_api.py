"""simulate() API, JSON fields, Chrome trace validity, Gantt PNG, and the `plait simulate` CLI."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.errors import PlaitError
from plait.sim.api import SimResult, simulate

SPEC = "gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000"
PLAN = "dp=2,tp=2,pp=2,micro_batch=2,global_batch=16"
FIELDS = ("iteration_time_s", "throughput_samples_per_s", "tflops_per_gpu", "exposed_comm_s",
          "memory_peak_bytes", "fits_memory", "critical_path")


@pytest.fixture(scope="module")
def result() -> SimResult:
    return simulate(SPEC, "a100-80g:nodes=1", PLAN, analytic=True)


def test_result_fields_and_memory(result: SimResult) -> None:
    d = result.to_dict()
    for key in FIELDS:
        assert key in d
    json.dumps(d)  # serialisable
    assert d["iteration_time_s"] > 0 and d["throughput_samples_per_s"] == pytest.approx(16 / d["iteration_time_s"])
    assert len(d["memory_peak_bytes"]) == 8 and all(b > 2**30 for b in d["memory_peak_bytes"])  # per device
    assert d["fits_memory"] is True
    assert d["critical_path"][0]["start_s"] == 0.0
    assert d["critical_path"][-1]["end_s"] == pytest.approx(d["iteration_time_s"])


def test_chrome_trace_is_valid_trace_event_json(result: SimResult, tmp_path) -> None:
    path = tmp_path / "trace.json"
    result.save_chrome_trace(path)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == result.num_tasks
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert isinstance(e["ts"], float) and e["dur"] >= 0 and isinstance(e["pid"], int)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert "dev0" in names and any(n.startswith("link") for n in names)


def test_gantt_png_shows_stages_and_comm(result: SimResult, tmp_path) -> None:
    path = result.save_gantt(tmp_path / "gantt.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {e.resource for e in result.timeline.events}
    assert {"dev0/compute", "dev4/compute"} <= rows and any(r.startswith("link") for r in rows)


def test_model_forms() -> None:
    from plait.graph.gpt_closed_form import gpt_opgraph
    from plait.sim.topology import ClusterView

    graph = gpt_opgraph(SPEC, "bf16")
    from plait.cluster import load_cluster

    view = ClusterView.from_cluster(load_cluster("a100-80g:nodes=1"))
    a = simulate(graph, view, PLAN)
    b = simulate(SPEC, "a100-80g:nodes=1", PLAN, analytic=True, memory=False)
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s)
    with pytest.raises(PlaitError, match="unknown option"):
        simulate(graph, view, PLAN, granularty="layer")


def test_cli_json_trace_and_gantt(tmp_path, capsys, monkeypatch) -> None:
    import plait.sim.api as api

    monkeypatch.setattr(api, "resolve_model", lambda model, plan, inputs=None, analytic=None:
                        __import__("plait.graph.gpt_closed_form", fromlist=["x"]).gpt_opgraph(model, plan.dtype))
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    code = main(["simulate", "--model", SPEC, "--cluster", "a100-80g:nodes=1", "--plan", PLAN, "--json",
                 "--trace", str(trace), "--gantt", str(gantt)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in FIELDS:
        assert key in out
    assert json.loads(trace.read_text())["traceEvents"] and gantt.stat().st_size > 1000
    assert main(["simulate", "--model", SPEC, "--cluster", "a100-80g:nodes=1", "--plan", PLAN]) == 0
    assert "iteration time" in capsys.readouterr().out
    # Bad input: one line naming the problem, exit code 2.
    assert main(["simulate", "--model", SPEC, "--cluster", "a100-80g:nodes=1", "--plan", "dp=3,tp=3"]) == 2
    assert "global_batch" in capsys.readouterr().err
