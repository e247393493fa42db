"""fp16 dynamic loss scaling in real runs (gloo, 2 CPU ranks) and the scaler on its own.

One fp16 run (dp=2, ZeRO-1, scale 1024 doubling after 2 good steps) has an inf injected into
ONE gradient element of rank 1 at step 1. Under ZeRO-1 that element reaches only rank 0's
gradient shard after the reduce-scatter, so rank 1 skips only because the found-inf flag is
agreed over the job. Expected scales: 1024, 1024 (overflow: skip, halve), 512, 512 (second
good step: grow) -> 1024.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from plait.runtime import checkpoint as ckpt
from plait.runtime.amp import DynamicLossScaler
from plait.runtime.api import (
    CheckpointConfig,
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    RunResult,
    run,
)
from plait.runtime.partition import RuntimeSetupError

TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
PLAN = "dp=2,micro_batch=2,zero=1,global_batch=8,dtype=fp16"
SCALE = {"PLAIT_LOSS_SCALE": "init=1024,growth_interval=2"}


@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path]:
    root = tmp_path_factory.mktemp("amp") / "ckpt"
    result = run(TINY, None, PLAN, steps=4, checkpoint=CheckpointConfig(dir=root, every=1, keep=None),
                 launch=LaunchConfig(timeout=120, env=SCALE), records=RecordsConfig(return_params=True),
                 faults=FaultsConfig(inject="inf:rank=1,step=1"))
    return result, root


@pytest.mark.distributed
def test_inf_on_one_rank_skips_the_step_on_every_rank(overflow_run: tuple[RunResult, Path]) -> None:
    result, root = overflow_run
    assert result.loss_scales == [1024.0, 1024.0, 512.0, 512.0]
    assert result.skipped_steps == [1] and result.skipped_by_rank == {0: [1], 1: [1]}
    assert result.final_loss_scale == 1024.0  # grew after growth_interval=2 good steps
    assert not any("loss scaling" in n for n in result.notes)
    # Checkpoint k holds the weights after k steps: step 1 (index 1) changed nothing, on either rank.
    states = [ckpt.load_consolidated(ckpt.step_dir(root, k)) for k in (1, 2, 3)]
    for name, value in states[0]["model"].items():
        assert torch.equal(states[1]["model"][name], value), name
    assert any(not torch.equal(states[2]["model"][n], v) for n, v in states[1]["model"].items())
    amp = json.loads(states[1]["train"]["amp"])  # the scaler's state, the same on every rank
    assert amp["scale"] == 512.0 and amp["skipped"] == [1]
    assert all(torch.isfinite(v).all() for v in result.params.values())


@pytest.mark.distributed
def test_scaler_state_survives_resume(overflow_run: tuple[RunResult, Path], tmp_path: Path) -> None:
    straight, root = overflow_run
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    for k in (3, 4):  # resume from the checkpoint after step 2: scale 512, one good step to go
        shutil.rmtree(ckpt.step_dir(copy, k))
    resumed = run(TINY, None, PLAN, steps=4, checkpoint=CheckpointConfig(dir=copy, resume=True),
                  launch=LaunchConfig(timeout=120, env=SCALE), records=RecordsConfig(return_params=True))
    assert resumed.steps == [2, 3] and resumed.resumed_from == 2
    assert resumed.loss_scales == straight.loss_scales[2:] == [512.0, 512.0]  # a fresh scaler would use 1024
    assert resumed.final_loss_scale == straight.final_loss_scale
    assert resumed.losses == straight.losses[2:]  # bit-exact
    assert resumed.params is not None and straight.params is not None
    for name, value in straight.params.items():
        assert torch.equal(resumed.params[name], value), name


def test_scaler_unscales_exactly_and_backs_off() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    grads = [torch.tensor([8.0, -24.0]), torch.tensor([0.5])]
    assert not scaler.unscale_and_check(grads)  # no process group: this rank decides alone
    assert grads[0].tolist() == [1.0, -3.0] and grads[1].tolist() == [0.0625]
    scaler.update(0)
    assert scaler.unscale_and_check([torch.tensor([1.0, float("nan")])])
    scaler.update(1)
    assert (scaler.scale, scaler.skipped, scaler.good_steps) == (4.0, [1], 0)
    for step in (2, 3):
        assert not scaler.unscale_and_check([torch.ones(3)])
        scaler.update(step)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    again = DynamicLossScaler()
    again.load_state_dict(scaler.state_dict())
    assert (again.scale, again.skipped, again.good_steps) == (8.0, [1], 0)


def test_scaler_settings_are_checked() -> None:
    s = DynamicLossScaler.from_string("init=256,growth_interval=10,backoff_factor=0.25")
    assert (s.scale, s.growth_interval, s.backoff_factor) == (256.0, 10, 0.25)
    with pytest.raises(RuntimeSetupError, match="unknown field 'start'"):
        DynamicLossScaler.from_string("start=3")
    with pytest.raises(RuntimeSetupError, match="growth_interval >= 1"):
        DynamicLossScaler.from_string("growth_interval=0")
