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
    from plait.net.view import ClusterView

    graph = gpt_opgraph(SPEC, "bf16")
    from plait.cluster import load_cluster

    view = ClusterView.from_cluster(load_cluster("a100-80g:nodes=1"))
    a = simulate(graph, view, PLAN)
    b = simulate(SPEC, "a100-80g:nodes=1", PLAN, analytic=True, memory=False, precision="megatron")
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s)
    # the default: as plait's engines train a bf16 plan, the model under autocast
    amp = simulate(gpt_opgraph(SPEC, "fp32", autocast="bf16"), view, PLAN)
    c = simulate(SPEC, "a100-80g:nodes=1", PLAN, analytic=True)
    assert c.iteration_time_s == pytest.approx(amp.iteration_time_s)
    assert c.memory_peak_bytes == amp.memory_peak_bytes != a.memory_peak_bytes  # dp x tp: FSDP2's shards
    with pytest.raises(PlaitError, match="unknown option"):
        simulate(graph, view, PLAN, granularty="layer")


def test_cli_json_trace_and_gantt(tmp_path, capsys, monkeypatch) -> None:
    import plait.sim.api as api

    monkeypatch.setattr(api, "resolve_model", lambda model, plan, inputs=None, analytic=None, precision="amp":
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


# ---------------------------------------------------------------- FLOP conventions
def _transformer_fwd_flops(layers: int, hidden: int, seq: int) -> float:
    """Forward FLOPs per sample of GPT transformer layers, by hand: QKV 6 s h^2, QK^T and PV
    2 s^2 h each, projection 2 s h^2, MLP 16 s h^2 (Narayanan et al. SC'21, sec. 5.1)."""
    return layers * (24 * seq * hidden**2 + 4 * seq**2 * hidden)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_model_and_hardware_flops_conventions(recompute: str) -> None:
    L, h, s, V, gb = 4, 256, 128, 1000, 16
    res = simulate(f"gpt:layers={L},hidden={h},heads=4,seq={s},vocab={V}", "a100-80g:nodes=1",
                   f"dp=2,tp=2,pp=2,micro_batch=2,global_batch={gb},recompute={recompute}", analytic=True)
    layers_fwd = _transformer_fwd_flops(L, h, s)
    head_fwd = 2 * s * h * V  # logits GEMM; the embedding is a gather (no FLOPs)
    model_flops = 3 * (layers_fwd + head_fwd) * gb  # backward = 2 x forward
    per_s = 1.0 / (res.iteration_time_s * res.world_size * 1e12)
    assert res.model_tflops_per_gpu == pytest.approx(model_flops * per_s, rel=1e-9)
    assert res.tflops_per_gpu == res.model_tflops_per_gpu  # the old name stays an alias
    extra = res.hardware_tflops_per_gpu / per_s - model_flops
    layers_model = 3 * layers_fwd * gb
    if recompute == "full":
        # Megatron recomputes the transformer layers' forward, not the embedding or the head:
        # their share is (3 + 1) / 3 of the model FLOPs.
        assert (layers_model + extra) / layers_model == pytest.approx(4 / 3, rel=1e-9)
    elif recompute == "selective":
        assert extra == pytest.approx(L * 4 * s**2 * h * gb, rel=1e-9)  # QK^T and PV again
    else:
        assert extra == pytest.approx(0.0, abs=1e-3)
        assert res.hardware_tflops_per_gpu == pytest.approx(res.model_tflops_per_gpu, rel=1e-12)
    d = res.to_dict()
    assert d["model_tflops_per_gpu"] == res.model_tflops_per_gpu
    assert d["hardware_tflops_per_gpu"] == res.hardware_tflops_per_gpu


def test_cli_prints_both_flop_conventions(capsys) -> None:
    rc = main(["simulate", "--model", SPEC, "--cluster", "a100-80g:nodes=1",
               "--plan", "dp=2,tp=2,pp=2,micro_batch=2,global_batch=16,recompute=full"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "model TFLOP/s/GPU (no recompute)" in out
    assert "hardware TFLOP/s/GPU (with recompute)" in out
