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
