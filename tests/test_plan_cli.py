"""`plait plan` from the command line: JSON, plan file for simulate/run, export, errors, --run."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.ir.plan import Plan

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
HOMO = "a100-80gb:nodes=1,gpus_per_node=4"


def test_json_output_and_plan_file_accepted_by_simulate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", MODEL, "--cluster", HOMO, "--global-batch", "8", "--top", "2", "--json",
               "--out", str(out)])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["world_size"] == 4 and res["global_batch"] == 8 and len(res["top"]) == 2
    cand = res["candidates"]
    assert cand["enumerated"] == cand["pruned_memory"] + cand["ranked_analytic"]
    assert 0 < cand["simulated"] <= cand["ranked_analytic"]
    best = res["top"][0]
    assert best["iteration_time_s"] <= res["top"][1]["iteration_time_s"]
    assert set(best["memory_headroom_bytes_by_kind"]) == {"a100-80gb"}
    # every family searched (the default), each ranked by the same simulator
    assert set(res["families"]) == {"3d", "graph", "spmd", "compose"} and best["family"] in res["families"]
    # one node of one GPU kind: nothing to compose, and the family says so
    assert "one node of one GPU kind" in res["families"]["compose"]
    plan = Plan.load(str(out))
    assert str(plan) == best["plan_str"]
    # the saved plan is what `plait simulate` predicts
    assert main(["simulate", "--model", MODEL, "--cluster", HOMO, "--plan", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(best["iteration_time_s"], rel=1e-9)


def test_table_output_and_megatron_export(capsys):
    rc = main(["plan", "--model", MODEL, "--cluster", HOMO, "--global-batch", "8", "--top", "3",
               "--export", "megatron", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "top 3 plans" in text and "candidates:" in text and "best:" in text
    assert "--tensor-model-parallel-size" in text and "--global-batch-size 8" in text


def test_export_of_a_mixed_cluster_plan_is_refused(capsys):
    rc = main(["plan", "--model", MODEL, "--cluster", "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2",
               "--global-batch", "8", "--top", "1", "--export", "deepspeed", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "heterogeneous" in err and "mixed GPU kinds" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,needle", [
    (["--top", "0"], "--top"),
    (["--cluster", "no-such-preset"], "no-such-preset"),
    (["--model", "gpt:layers=two"], "layers"),
])
def test_bad_arguments_give_one_line_errors(argv, needle, capsys):
    rc = main(["plan", "--model", MODEL, "--cluster", HOMO, "--global-batch", "8", "--no-progress", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("plait plan: error:") and needle in err and err.count("\n") == 1


@pytest.mark.slow  # suite time (2026-12-08): test_run_without_machine_prediction and tests/test_machine.py keep the run and the prediction
def test_run_trains_the_chosen_plan_and_prints_predicted_vs_measured(capsys):
    # one rank per node: the machine prediction calibrates this machine first (LocalMachine)
    rc = main(["plan", "--family", "3d", "--model", MODEL, "--cluster", "emulated-mixed:namespaces=false,gpus_per_node=1",
               "--global-batch", "4", "--top", "2", "--run", "--steps", "3", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    run = res["run"]
    assert run["predicted_iteration_s"] > 0 and run["measured_iteration_s"] > 0
    assert len(run["losses"]) == 3 and all(x == x for x in run["losses"])  # finite
    assert Plan.parse(run["plan"]).world_size == 2
    machine = run["machine"]
    assert machine["dtype"] == "fp32" and machine["measured_iteration_s"] == run["measured_iteration_s"]
    assert machine["predicted_iteration_s"] > 0 and machine["error"] == pytest.approx(
        machine["predicted_iteration_s"] / machine["measured_iteration_s"] - 1)
    assert len(machine["device_speed"]) == 2


def test_run_without_machine_prediction(capsys):
    rc = main(["plan", "--family", "3d", "--model", MODEL, "--cluster", "emulated-mixed:namespaces=false,gpus_per_node=1",
               "--global-batch", "4", "--top", "1", "--run", "--steps", "2", "--no-machine-prediction",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "plait run of plan #1" in out and "iteration time: predicted" in out
    assert "predicted for this machine" not in out


def test_slurm_export_writes_the_sbatch_script_beside_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", MODEL, "--cluster", HOMO, "--global-batch", "8", "--top", "1",
                 "--out", str(out), "--export", "slurm", "--no-progress"]) == 0
    script = (tmp_path / "plan.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=1" in script
    assert f"--cluster '{HOMO}'" in script and f"--plan {out}" in script
    assert "sbatch script written to" in capsys.readouterr().out
    assert main(["plan", "--model", MODEL, "--cluster", HOMO, "--global-batch", "8", "--top", "1",
                 "--export", "slurm", "--no-progress"]) == 2  # the script needs the plan file
    assert "--out PLAN.json" in capsys.readouterr().err


# ~60 s on 2 shared cores (profiles emulated-mixed's 4 devices, calibrates 2 ranks, runs 2 steps)
@pytest.mark.slow
def test_run_of_a_graph_plan_on_fewer_ranks_than_the_cluster_calibrates_on_its_ranks(monkeypatch, capsys):
    """issue 29 item 5: a 2-stage graph plan on 2 of emulated-mixed's 4 GPUs trained under
    `plait run --plan` but `plait plan --run` failed calibrating this machine ("rank 2: the plan's
    stages hold 2 ranks"): the machine was calibrated one profiler per cluster device. The graph
    search's pick is replaced by that plan (on this tiny model the family picks one stage)."""
    import dataclasses

    import plait.commands.plan_cmd as plan_cmd
    from plait.ir.plan import StageSpec

    two = Plan(pp=2, micro_batch=2, global_batch=4, stage_edges=[(0, 1)], dtype="fp32",
               stages=[StageSpec("s0", ["embed", "layers.0"], [2]), StageSpec("s1", ["layers.1", "head"], [0])])
    search = plan_cmd.search

    def two_stages_first(*args, **kwargs):
        result = search(*args, **kwargs)
        result.top.insert(0, dataclasses.replace(result.top[0], plan=two))
        return result

    monkeypatch.setattr(plan_cmd, "search", two_stages_first)
    rc = main(["plan", "--family", "graph", "--model", MODEL, "--cluster", "emulated-mixed:namespaces=false",
               "--global-batch", "4", "--top", "1", "--run", "--steps", "2", "--json"])
    assert rc == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert run["plan"] == str(two) and len(run["losses"]) == 2 and all(x == x for x in run["losses"])
    machine = run["machine"]
    assert machine["predicted_iteration_s"] > 0 and machine["measured_iteration_s"] > 0
    speed = machine["device_speed"]  # the plan's devices (2 and 0) measured, the idle ones left at 1
    assert len(speed) == 4 and speed[1] == speed[3] == 1.0
    assert not any("time-share" in n for n in machine["notes"])  # 2 ranks on 2 CPUs, not 4
