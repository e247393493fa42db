"""Issue 12, item 6: output a person can read (critical path, files confirmed, titles that fit,
tables that fit the terminal, near-duplicate plans folded, one 'measured' figure, notes once)."""

from __future__ import annotations

import json

from plait.cli import main

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32"
PLAN = "dp=2,pp=2,micro_batch=2,global_batch=8,dtype=fp32"


def test_simulate_prints_critical_path_dtype_and_confirms_files(tmp_path, capsys) -> None:
    trace, gantt = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["simulate", "--model", MODEL, "--cluster", "emulated-mixed", "--plan", PLAN,
                 "--trace", str(trace), "--gantt", str(gantt)]) == 0
    out = capsys.readouterr().out
    assert trace.exists() and gantt.exists()
    assert f"trace written to {trace}" in out and f"Gantt chart written to {gantt}" in out
    assert "critical path:" in out and "dev2/compute" in out
    assert "training dtype" in out and "fp32" in out
    # --json keeps stdout one JSON document; the confirmations go to stderr
    assert main(["simulate", "--model", MODEL, "--cluster", "emulated-mixed", "--plan", PLAN, "--json",
                 "--trace", str(trace)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["critical_path"]
    assert f"trace written to {trace}" in cap.err


def test_critical_path_segments_merge_consecutive_tasks() -> None:
    from plait.commands.simulate_cmd import critical_path_segments

    path = [{"name": f"fwd {i}", "category": "forward", "resource": "dev0/compute", "start_s": i, "end_s": i + 1}
            for i in range(3)]
    path.append({"name": "send", "category": "comm_pp", "resource": "link 0->1", "start_s": 3, "end_s": 3.5})
    segs = critical_path_segments(path)
    assert [(s["resource"], s["tasks"], s["start_s"], s["end_s"]) for s in segs] == [
        ("dev0/compute", 3, 0, 3), ("link 0->1", 1, 3, 3.5)]
    assert segs[0]["first"] == "fwd 0" and segs[0]["last"] == "fwd 2"


def test_gantt_title_is_wrapped_not_cut() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plait.sim.gantt import TITLE_POINTS, wrap_title

    title = ("gpt:layers=4,hidden=64,heads=4,seq=32 | dp=2,tp=1,pp=2,micro_batch=2,global_batch=8,recompute=none,"
             "zero=0,schedule=1f1b,dtype=fp32,layer_split=3:3,dp_shares=0.5:0.5,collective.dp=ring,device_order=0:1:2:3")

    def fits(text: str) -> bool:
        fig, ax = plt.subplots(figsize=(12, 3))
        ax.set_title(text, fontsize=TITLE_POINTS)
        fig.tight_layout()
        fig.canvas.draw()
        box = ax.title.get_window_extent(fig.canvas.get_renderer())
        plt.close(fig)
        return box.x0 >= 0 and box.x1 <= fig.bbox.x1

    assert not fits(title)  # as it was: cut at the figure's edge
    wrapped = wrap_title(title, 12.0, TITLE_POINTS)
    assert wrapped.replace("\n", "").replace(" ", "") == title.replace(" ", "")  # nothing lost
    assert fits(wrapped)
