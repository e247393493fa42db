"""`plait run --predict`: the simulator's prediction for this machine next to the measured run."""

from __future__ import annotations

import json
import statistics

import pytest

from plait.cli import main

MODEL = "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64"
CLUSTER = "emulated-mixed:namespaces=false,gpus_per_node=1"


# ~22 s (calibrates this machine, then a run); `plait plan --run` in test_plan_cli covers the same path
@pytest.mark.slow
def test_predict_prints_machine_prediction_next_to_measurement(capsys):
    rc = main(["run", "--model", MODEL, "--cluster", CLUSTER, "--plan", "pp=2,micro_batch=2,global_batch=4",
               "--steps", "4", "--predict", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    m = out["machine"]
    assert m["warmup_steps"] == 2 and len(out["losses"]) == 4
    assert m["predicted_iteration_s"] > 0 and m["error"] == pytest.approx(
        m["predicted_iteration_s"] / m["measured_iteration_s"] - 1)
    assert statistics.median(out["iteration_times"][2:]) == pytest.approx(m["measured_iteration_s"])
    assert len(m["device_speed"]) == 2


@pytest.mark.parametrize("argv,needle", [
    (["--plan", "dp=2,micro_batch=1,global_batch=2"], "emulated cluster"),
    (["--cluster", CLUSTER, "--plan", "dp=2,micro_batch=1,global_batch=2", "--dtype", "bf16"], "fp32"),
    (["--cluster", "a100-80gb:nodes=1", "--plan", "dp=2,micro_batch=1,global_batch=2"], "emulated cluster"),
])
def test_predict_refuses_what_it_cannot_predict(argv, needle, capsys):
    rc = main(["run", "--model", MODEL, *argv, "--predict"])
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


# ~40 s (profiles 4 devices' links, calibrates the plan's 2 ranks, then a 2-rank run)
@pytest.mark.slow
def test_predict_calibrates_on_the_plans_ranks_when_the_cluster_has_more(tmp_path, capsys):
    """issue 29: a 2-stage graph plan on emulated-mixed's 4 GPUs ran under `plait run --plan` but its
    calibration failed ("rank 2: the plan's stages hold 2 ranks"): the machine was profiled one rank per
    device; it is calibrated for the plan's own ranks."""
    from plait.ir.plan import Plan, StageSpec

    plan = Plan(pp=2, micro_batch=2, global_batch=4, stage_edges=[(0, 1)], dtype="fp32",
                stages=[StageSpec("s0", ["embed", "layers.0"], [2]), StageSpec("s1", ["layers.1", "head"], [0])])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    cluster = "emulated-mixed:namespaces=false"
    rc = main(["run", "--model", MODEL, "--cluster", cluster, "--plan", str(path), "--steps", "4", "--predict",
               "--json"])
    assert rc == 0
    m = json.loads(capsys.readouterr().out)["machine"]
    assert m["predicted_iteration_s"] > 0 and m["measured_iteration_s"] > 0
    speed = m["device_speed"]  # the plan's devices measured, the idle ones left at 1
    assert len(speed) == 4 and speed[1] == speed[3] == 1.0 and speed[0] > 0 and speed[2] > 0
    assert not any("time-share" in n for n in m["notes"])  # calibrated for 2 ranks on 2 CPUs, not 4
