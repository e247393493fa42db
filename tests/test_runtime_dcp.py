"""A checkpoint written under one plan loads under another (real torchrun workers).

Saved at dp=2, tp=2 (uneven tensor shards 3:1, ZeRO-1: fused-QKV slices and flat optimizer shards),
it holds the single-process model's parameters and AdamW state; it loads at pp=2 and at dp=3 with
uneven shares under ZeRO-3, and training continues equal to the uninterrupted single-process
reference (bit-exact loading is checked in-process in tests/test_checkpoint_dcp.py). torch's own `dcp_to_torch_save` turns it into a plain
state dict that a plain model loads.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.runtime import checkpoint as ckpt
from plait.runtime.api import CheckpointConfig, LaunchConfig, run
from plait.runtime.data_parallel import make_optimizer
from plait.runtime.partition import load_model_spec, make_samples

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
FP32 = "global_batch=8,dtype=fp32"
SOURCE = "dp=2,tp=2,tp_ratios=0.75:0.25,zero=1,micro_batch=2," + FP32
STEPS = 4


def _reference(steps: int) -> list[tuple[float, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]]:
    """Single process, whole global batch: (loss, parameters, AdamW state by name) after each step."""
    spec = load_model_spec(TINY)
    torch.manual_seed(0)
    module = spec.build(device="cpu", dtype=torch.float32, seed=0)
    module.train()
    named = list(module.named_parameters())
    opt = make_optimizer([p for _, p in named], {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0})
    out = []
    for step in range(steps):
        inputs, target = make_samples(spec, step * 8, 8, 0)
        loss = spec.loss(module(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        params = {n: p.detach().clone() for n, p in named}
        state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in named}
        out.append((float(loss.detach()), params, state))
    return out


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    return _reference(STEPS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp") / "ck"
    run(TINY, None, SOURCE, steps=2, checkpoint=CheckpointConfig(dir=root, every=2), launch=LaunchConfig(timeout=120))
    return root


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to the plans' different summation orders. Adam's step m/sqrt(v) amplifies them on
    elements whose gradient is ~0, so the bound is relative to the tensor's largest value: a slice
    put in the wrong place is off by O(1) of it."""
    assert got.shape == want.shape, what
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max()) + 1e-12, what


def _assert_state(state: dict[str, Any], params: dict[str, torch.Tensor],
                  optim: dict[str, dict[str, torch.Tensor]]) -> None:
    assert set(state["model"]) == set(params)
    for name, value in params.items():
        _close(state["model"][name], value, name)
        assert set(state["optim"][name]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, want in optim[name].items():
            _close(state["optim"][name][key], want, f"{name} {key}")


def test_checkpoint_holds_the_single_process_state(saved: Path, reference: list[Any]) -> None:
    state = ckpt.load_consolidated(ckpt.step_dir(saved, 2))
    _assert_state(state, reference[1][1], reference[1][2])
    assert state["train"]["step"] == 2 and state["train"]["plan"].startswith("dp=2,tp=2")
    assert state["train"]["tied"] == {"head.lm.weight": "embed.tok.weight"}
    assert sorted(state["rank_state"]) == ["0", "1", "2", "3"]
    assert ckpt.decode_object(state["rank_state"]["3"])["coords"] == [0, 1, 1]


def test_loads_at_pp2_and_continues_like_one_process(saved: Path, reference: list[Any], tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    plan = "pp=2,micro_batch=2," + FP32
    resumed = run(TINY, None, plan, steps=STEPS, checkpoint=CheckpointConfig(dir=root, every=1, resume=True),
                  launch=LaunchConfig(timeout=120))
    # written by plait's own engine (tp, ZeRO-1), read and written again by the torch engine's pipeline
    assert resumed.engine == "torch"
    assert resumed.steps == [2, 3] and resumed.resumed_from == 2
    for got, (want, _, _) in zip(resumed.losses, reference[2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    # Parameters and AdamW state after one step under pp=2 (the tied embedding on both stages).
    _assert_state(ckpt.load_consolidated(ckpt.step_dir(root, 3)), reference[2][1], reference[2][2])
    _assert_state(ckpt.load_consolidated(ckpt.step_dir(root, STEPS)), reference[-1][1], reference[-1][2])


def test_loads_at_dp3_uneven_zero3_and_converts_to_a_plain_state_dict(saved: Path, reference: list[Any],
                                                                      tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    plan = "dp=3,dp_shares=0.5:0.25:0.25,zero=3,micro_batch=2," + FP32
    resumed = run(TINY, None, plan, steps=3, checkpoint=CheckpointConfig(dir=root, every=1, resume=True),
                  launch=LaunchConfig(timeout=120))
    assert resumed.steps == [2] and [r.samples_per_step for r in resumed.ranks] == [4, 2, 2]
    assert abs(resumed.losses[0] - reference[2][0]) <= 1e-5 * abs(reference[2][0])
    # The README's recipe: torch's own converter, then a plain model.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plain = tmp_path / "plain.pt"
    dcp_to_torch_save(str(ckpt.step_dir(root, 3)), str(plain))
    state = torch.load(plain, weights_only=True)
    _assert_state(state, reference[2][1], reference[2][2])
    model = load_model_spec(TINY).build(device="cpu", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    assert missing == ["head.lm.weight"] and unexpected == []  # tied to embed.tok.weight, stored once
    assert model.head.lm.weight is model.embed.tok.weight


@pytest.mark.slow  # suite time: the torch engine's checkpoints stay in make test through FSDP2's (DTensor shards)
def test_torch_engine_resumes_bit_for_bit_and_its_checkpoint_loads_on_plaits_engine(reference: list[Any],
                                                                                    tmp_path: Path) -> None:
    """DDP with uneven shares on the torch engine: a checkpoint at step 2 holds the single-process
    state; resumed under the same plan it continues exactly as the uninterrupted run; resumed
    under another plan on plait's own engine (tp=2, ZeRO-1) it continues like one process."""
    plan = "dp=2,dp_shares=0.75:0.25,micro_batch=2," + FP32
    whole = run(TINY, None, plan, steps=STEPS, launch=LaunchConfig(timeout=120))
    root = tmp_path / "ck"
    first = run(TINY, None, plan, steps=2, checkpoint=CheckpointConfig(dir=root, every=2),
                launch=LaunchConfig(timeout=120))
    assert first.engine == "torch" and first.losses == whole.losses[:2]
    state = ckpt.load_consolidated(ckpt.step_dir(root, 2))
    _assert_state(state, reference[1][1], reference[1][2])
    assert state["train"]["tied"] == {"head.lm.weight": "embed.tok.weight"}
    again = tmp_path / "again"
    shutil.copytree(root, again)
    resumed = run(TINY, None, plan, steps=STEPS, checkpoint=CheckpointConfig(dir=root, every=2, resume=True),
                  launch=LaunchConfig(timeout=120))
    assert resumed.engine == "torch" and resumed.steps == [2, 3] and resumed.resumed_from == 2
    assert resumed.losses == whole.losses[2:]  # the same plan: bit for bit
    other = run(TINY, None, "tp=2,zero=1,dp=2,micro_batch=2," + FP32, steps=STEPS,
                checkpoint=CheckpointConfig(dir=again, every=2, resume=True),
                launch=LaunchConfig(timeout=120, engine="plait"))
    assert other.engine == "pipeline" and other.steps == [2, 3]
    for got, (want, _, _) in zip(other.losses, reference[2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)


def _save_resume_and_move(tmp_path: Path, reference: list[Any], plan: str, launch: LaunchConfig, other: str) -> None:
    """`plan` on the torch engine: its checkpoint at step 2 holds the single-process state, resumes
    bit for bit under `plan`, and under `other` continues like one process."""
    whole = run(TINY, None, plan, steps=STEPS, launch=launch)
    root, again = tmp_path / "ck", tmp_path / "again"
    first = run(TINY, None, plan, steps=2, checkpoint=CheckpointConfig(dir=root, every=2), launch=launch)
    assert first.engine == "torch" and first.losses == whole.losses[:2]
    _assert_state(ckpt.load_consolidated(ckpt.step_dir(root, 2)), reference[1][1], reference[1][2])
    shutil.copytree(root, again)
    resumed = run(TINY, None, plan, steps=STEPS, checkpoint=CheckpointConfig(dir=root, every=2, resume=True),
                  launch=launch)
    assert resumed.steps == [2, 3] and resumed.losses == whole.losses[2:]  # the same plan: bit for bit
    moved = run(TINY, None, other, steps=STEPS, checkpoint=CheckpointConfig(dir=again, every=2, resume=True),
                launch=LaunchConfig(timeout=120))
    assert moved.engine == "torch" and moved.steps == [2, 3]
    for got, (want, _, _) in zip(moved.losses, reference[2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.slow  # suite time (2026-12-08): test_loads_at_dp3_uneven_zero3_and_converts_to_a_plain_state_dict keeps FSDP2's checkpoint
def test_fsdp2_checkpoint_holds_the_whole_state_and_resumes_under_ddp(reference: list[Any], tmp_path: Path) -> None:
    """ZeRO-3 on FSDP2 with uneven shares (a parameter's dim-0 pieces 3:2 and so on): each rank
    writes its shard at its place in the whole tensor (`sharded_state.dtensor_cuts`)."""
    _save_resume_and_move(tmp_path, reference, "dp=2,zero=3,dp_shares=0.75:0.25,micro_batch=2," + FP32,
                          LaunchConfig(timeout=120), "dp=2,micro_batch=2," + FP32)


@pytest.mark.slow  # suite time: the FSDP2 checkpoint test stays in make test
def test_fsdp2_pipeline_checkpoint_holds_the_whole_state_and_resumes_without_pipeline(reference: list[Any],
                                                                                     tmp_path: Path) -> None:
    """ZeRO-3 on a 2-stage pipeline (FSDP2 over each stage's 2 replicas, the tied embedding in both
    stages' roots: written by the first stage), into ZeRO-3 without pipeline."""
    _save_resume_and_move(tmp_path, reference, "pp=2,dp=2,zero=3,micro_batch=1," + FP32, LaunchConfig(timeout=120),
                          "dp=2,zero=3,micro_batch=2," + FP32)


@pytest.mark.slow  # ~70 s on 2 cores: four runs of 4, 4, 4 and 2 ranks
def test_fsdp2_over_dtensor_checkpoint_holds_the_whole_state_and_resumes_under_ddp(reference: list[Any],
                                                                                  tmp_path: Path) -> None:
    """dp=2 x tp=2 at ZeRO-1 with uneven shares (issue 29): FSDP2 over DTensor's tensor parallelism
    makes 2D parameters -- (`_StridedShard(0)` over dp, Shard(0) over tp) for the colwise linears,
    (Shard(0), Shard(1)) for the rowwise ones, (Shard(0), Replicate()) for their biases -- each
    written as one box at its place in the whole tensor (`sharded_state.dtensor_cuts`' boxes)."""
    _save_resume_and_move(tmp_path, reference, "dp=2,tp=2,zero=1,dp_shares=0.75:0.25,micro_batch=2," + FP32,
                          LaunchConfig(timeout=120), "dp=2,micro_batch=2," + FP32)


@pytest.mark.slow
def test_dtensor_checkpoint_holds_the_whole_state_and_resumes_under_fsdp2(reference: list[Any],
                                                                          tmp_path: Path) -> None:
    """tp=2 on DTensor (colwise Shard(0), rowwise Shard(1), replicated biases written once), into
    ZeRO-3 on three ranks with uneven shares (FSDP2 loading its shards from DTensor's)."""
    _save_resume_and_move(tmp_path, reference, "tp=2,micro_batch=4," + FP32, LaunchConfig(timeout=120, engine="torch"),
                          "dp=3,zero=3,dp_shares=0.5:0.25:0.25,micro_batch=1," + FP32)


@pytest.mark.slow  # ~25 s each on 2 cores: three runs of 8 ranks and one of 2
@pytest.mark.parametrize("zero", [0, 1])
def test_3d_pipeline_checkpoint_holds_the_whole_state_and_resumes_without_pipeline(zero: int, reference: list[Any],
                                                                                   tmp_path: Path) -> None:
    """pp=2 x dp=2 x tp=2 (issue 29, the full 3D composition) with uneven shares: DTensor TP inside each
    stage under torch's replicate (ZeRO-0: each stage's replica 0 writes its tensor ranks' shards) or
    FSDP2 (ZeRO-1: 2D shards, one box over both mesh dims each) over the stage's replicas; into DDP
    without pipeline or tensor parallelism."""
    _save_resume_and_move(tmp_path, reference, f"pp=2,dp=2,tp=2,zero={zero},dp_shares=0.75:0.25,micro_batch=2,"
                          + FP32, LaunchConfig(timeout=180), "dp=2,micro_batch=2," + FP32)


@pytest.mark.slow
def test_dtensor_pipeline_checkpoint_holds_the_whole_state_and_resumes_without_pipeline(reference: list[Any],
                                                                                      tmp_path: Path) -> None:
    """pp=2 x tp=2 on torch's pipelining with DTensor inside each stage: each stage's tensor ranks write
    their shards at their places (`dtensor_cuts`), the tied embedding by the first stage's tensor rank 0;
    into DDP without pipeline or tensor parallelism."""
    _save_resume_and_move(tmp_path, reference, "pp=2,tp=2,micro_batch=2," + FP32,
                          LaunchConfig(timeout=120, engine="torch"), "dp=2,micro_batch=2," + FP32)


@pytest.mark.slow  # suite time: the FSDP2 checkpoint test stays in make test
def test_sequence_parallel_dtensor_checkpoint_resumes_under_ddp(reference: list[Any], tmp_path: Path) -> None:
    """tp=2 with sequence parallelism on DTensor (issue 29: `SequenceParallel` layer norms, replicated
    DTensors whose gradients are summed over tp, written once), into DDP."""
    _save_resume_and_move(tmp_path, reference, "tp=2,sequence_parallel=true,micro_batch=4," + FP32,
                          LaunchConfig(timeout=120), "dp=2,micro_batch=2," + FP32)
