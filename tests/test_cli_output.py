"""Issue 12, item 6: output a person can read (critical path, files confirmed, titles that fit,
tables that fit the terminal, near-duplicate plans folded, one 'measured' figure, notes once)."""

from __future__ import annotations

import json
import re

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


# ---------------------------------------------------------------------------------- plait plan table
def _cand(plan: str, t: float, free_gib: float = 30.0, kinds: tuple[str, ...] = ("a100", "v100")):
    from plait.ir.plan import Plan
    from plait.planners.types import Candidate

    c = Candidate(Plan.parse(plan), iteration_time_s=t, tflops_per_gpu=1.0, throughput=100.0)
    c.headroom_by_kind = {k: int((free_gib + i) * 2**30) for i, k in enumerate(kinds)}
    return c


class _Result:
    ranker = "simulator"

    def __init__(self, top):
        self.top = top


def _render(table, width: int) -> list[str]:
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width).print(table)
    return buf.getvalue().splitlines()


BASE = "dp=2,micro_batch=1,global_batch=8"
TOP = [_cand(BASE, 1.000), _cand(BASE + ",zero=1", 1.004, 31.5), _cand(BASE + ",zero=3", 1.009, 33.0),
       _cand(BASE + ",zero=2", 1.02),  # 2 % slower: its own row
       _cand("pp=2,micro_batch=1,global_batch=8", 1.005),  # another shape
       _cand(BASE + ",recompute=full", 1.006)]


def test_near_duplicates_fold_into_one_row_listing_variants_and_margins() -> None:
    from plait.commands.plan_cmd import _variants, fold_plans

    groups = fold_plans(TOP)
    assert [[str(c.plan.zero) + c.plan.recompute for c in g] for g in groups] == [
        ["0none", "1none", "3none", "0full"], ["2none"], ["0none"]]
    assert [g[0].plan.pp for g in groups] == [1, 1, 2]
    two = fold_plans(TOP[:2])[0]
    assert _variants(two) == "zero 0 30.0G, zero 1 31.5G"  # each variant with its least free memory
    assert _variants(groups[0]).count("G") == 3 and "recompute=full" in _variants(groups[0])


def test_plan_table_fits_the_terminal_and_wide_shows_every_column() -> None:
    from plait.commands.plan_cmd import plan_table

    table, hidden = plan_table(_Result(TOP), 80)
    lines = _render(table, 80)
    assert max(len(x) for x in lines) <= 80 and hidden
    assert all(h not in "\n".join(lines) for h in ("free a100", "TFLOP/s/GPU"))
    wide, none_hidden = plan_table(_Result(TOP), None)
    text = "\n".join(_render(wide, 400))
    assert none_hidden == [] and "free a100" in text and "free v100" in text and "TFLOP/s/GPU" in text
    assert "3 near-duplicates folded" in text


def test_uneven_split_column_only_when_a_plan_has_one() -> None:
    from plait.commands.plan_cmd import plan_table

    table, _ = plan_table(_Result(TOP[:1]), None)
    assert "uneven split" not in "\n".join(_render(table, 400))
    shares = _cand("dp=2,micro_batch=1,global_batch=8,dp_shares=0.75:0.25", 0.9)
    text = "\n".join(_render(plan_table(_Result([shares] + TOP[:1]), None)[0], 400))
    assert "uneven split" in text and "batch 6:2" in text


# ---------------------------------------------------------------------------------- plait run text
def _run_result():
    from plait.ir.timeline import Timeline
    from plait.runtime.api import RunResult

    return RunResult("m", "c", "dp=1", "gloo", "cpu", [0, 1, 2], [1.0, 0.9, 0.8], [0.5, 0.4, 0.42],
                     Timeline([], "measured"), [], notes=["network: kernel has no sch_netem: link latency is not "
                                                          "emulated (bandwidth is)", "same", "same"])


def _args(*extra: str):
    import argparse

    from plait.commands import run_cmd

    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", "--model", "gpt", "--plan", "dp=1,dtype=fp16", *extra])


def test_run_predict_prints_one_measured_figure_and_the_dtype_it_ran(capsys) -> None:
    from plait.commands.run_cmd import _print

    machine = {"error": 0.05, "predicted_iteration_s": 0.4, "measured_iteration_s": 0.42, "warmup_steps": 1,
               "profile_drift": 0.01, "notes": ["same"]}
    _print(_run_result(), _args("--predict", "--cluster", "emulated-mixed"), machine)
    out = capsys.readouterr().out
    measured = [line for line in out.splitlines() if re.search(r"measured.*\d ms", line)]
    assert len(measured) == 1 and "median after 1 warm-up" in measured[0] and "420.00 ms" in measured[0]
    assert "dtype fp32 (the plan's fp16, --predict runs CPU ranks in fp32)" in out
    assert out.count("note: same") == 1
    _print(_run_result(), _args())
    out = capsys.readouterr().out
    assert "dtype fp16," in out and sum(bool(re.search(r"measured.*\d ms", x)) for x in out.splitlines()) == 1


def test_network_notes_are_printed_once(caplog, capsys) -> None:
    import logging

    from rich.console import Console

    from plait.commands.run_cmd import print_notes
    from plait.runtime import netns

    reason = "kernel has no sch_netem: link latency is not emulated (bandwidth is) [test]"
    with caplog.at_level(logging.DEBUG, logger=netns.log.name):
        for _ in range(4):  # calibration, profile, gloo fit, the run: four networks built
            netns.warn_once(reason)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] + [logging.DEBUG] * 3
    print_notes(Console(), [f"network: {reason}", "other"], ["other"])
    out = capsys.readouterr().out
    assert "sch_netem" not in out and out.count("note: other") == 1


def test_memory_options_reach_simulate(capsys) -> None:
    """Issue 12: the optimizer kind and loss fusion of the memory estimate are CLI flags."""
    import json

    from plait.cli import main

    def peak(*flags: str) -> int:
        assert main(["simulate", "--model", "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=4096",
                     "--cluster", "a100-80g:nodes=1,gpus_per_node=1", "--plan", "dp=1,micro_batch=4,global_batch=4",
                     "--json", *flags]) == 0
        return max(json.loads(capsys.readouterr().out)["memory_peak_bytes"])

    eager, fused = peak(), peak("--loss", "fused")
    assert fused < eager  # Megatron's fused loss keeps no fp32 copies of the logits
    assert peak("--optimizer", "sgd") < eager  # no Adam moments


def test_plan_run_with_too_few_steps_does_not_judge_warm_up_as_error() -> None:
    """plan --run --steps 2 measured its two warm-up steps (T5: 3.4 s against a 45 ms prediction)
    and printed a red -98.7 % error; with no step left after warm-up the figure is shown as what it
    is, not judged. With steady-state steps the error is judged as before."""
    from rich.console import Console

    from plait.commands.plan_cmd import _print_run

    def printed(warmup: int) -> str:
        console = Console(record=True, width=200)
        run = {"predicted_iteration_s": 0.1, "measured_iteration_s": 3.4, "rank_in_top": 1, "plan": "dp=1",
               "iteration_times_s": [3.4, 3.3], "backend": "gloo", "device": "cpu", "losses": [5.4, 5.3], "notes": [],
               "machine": {"error": -0.987, "predicted_iteration_s": 0.045, "warmup_steps": warmup,
                           "emulated_dtype": "fp16", "profile_drift": 0.0, "notes": []}}
        _print_run(run, console)
        return console.export_text()

    few = printed(0)
    assert "warm-up included" in few and "not judged" in few and "error" not in few
    assert "error -98.7 %" in printed(2)
