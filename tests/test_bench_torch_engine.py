"""bench/torch_engine.py: one pair on the dp=2 plan, end to end (slow: four worker launches)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import torch_engine  # noqa: E402


@pytest.mark.slow
@pytest.mark.distributed
def test_one_pair_runs_both_engines_on_the_same_training(capsys) -> None:
    model = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
    plan = "dp=2,micro_batch=2,global_batch=8,dtype=fp32"
    assert torch_engine.main(["--pairs", "1", "--steps", "4", "--warmup", "1", "--plan", plan, "--model", model,
                              "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["rows"]
    assert row["engines"] == ["pipeline", "torch"]  # LaunchConfig(engine="plait") kept plait's own engine
    assert row["loss0_plait"] == pytest.approx(row["loss0_torch"], rel=1e-5)  # the same first step
    for what in ("step_s", "cpu_s"):
        assert row[what]["plait"] > 0 and row[what]["torch"] > 0
        assert row[what]["ci"][0] <= row[what]["diff"] <= row[what]["ci"][1]
    assert set(out["summary"]["step_diff"]) == {plan}
