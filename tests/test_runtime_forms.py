"""Every parallel form equals the single-process reference (losses and parameters after 3 steps).

Each test launches real torchrun workers (gloo, CPU) on a tiny GPT from the zoo (tied LM
head, so pipeline runs also check the tied-embedding gradient sum). The reference trains the
unsplit model on the whole global batch in one process with the same seed, samples and AdamW.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter, defaultdict

import pytest
import torch

from plait.ir.plan import Plan
from plait.runtime.api import (
    CheckpointConfig,
    LaunchConfig,
    RecordsConfig,
    RunResult,
    reference_run,
    run,
)
from plait.runtime.partition import replica_micro_batches

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
STEPS = 3
FP32 = "global_batch=8,dtype=fp32"


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, params = reference_run(TINY, "dp=1,micro_batch=8," + FP32, STEPS)
    initial = reference_run(TINY, "dp=1,micro_batch=8," + FP32, 0)[1]
    assert all(not torch.equal(params[n], initial[n]) for n in params)  # training moved every weight
    return losses, params


def _check_equal(result: RunResult, reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    ref_losses, ref_params = reference
    assert result.steps == list(range(STEPS))
    assert result.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert result.params is not None
    # Every parameter is compared; the LM head is tied to embed.tok, listed once unless pipelining cut them apart.
    assert set(ref_params) - set(result.params) <= {"head.lm.weight"}
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=2e-6, msg=name)
    assert result.loss_scales == [] and result.final_loss_scale is None  # only fp16 scales the loss


def _check_timeline(result: RunResult, tmp_path) -> None:
    """Measured spans: per device compute never overlaps, every micro-batch has a forward and a
    backward on every rank of its replica, each step has an optimizer span, trace exports."""
    tl = result.timeline
    assert len(result.iteration_times) == STEPS and all(t > 0 for t in result.iteration_times)
    by_dev = defaultdict(list)
    for e in tl.events:
        assert e.end >= e.start
        assert e.resource in (f"dev{e.device}/compute", f"dev{e.device}/comm")
        if e.resource.endswith("compute"):
            by_dev[e.device].append((e.start, e.end))
    for spans in by_dev.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    for r in result.ranks:
        for step in result.steps:
            mine = [e for e in tl.events if e.device == r.device and e.args.get("step") == step]
            fwd = sorted(e.micro_batch for e in mine if e.category == "forward")
            bwd = sorted(e.micro_batch for e in mine if e.category == "backward")
            n_mb = len(replica_micro_batches(Plan.parse(result.plan), step, r.dp))
            assert fwd == bwd == list(range(n_mb)) and n_mb > 0
            assert sum(e.category == "optimizer" for e in mine) == 1
    path = tmp_path / "trace.json"
    tl.save_chrome_trace(path)
    trace = json.loads(path.read_text())["traceEvents"]
    assert sum(ev["ph"] == "X" for ev in trace) == len(tl.events)


def _run(plan: str, engine: str = "auto") -> RunResult:
    return run(TINY, None, plan, steps=STEPS, launch=LaunchConfig(timeout=120, engine=engine),
               records=RecordsConfig(return_params=True))


def test_data_parallel_zero1(reference, tmp_path) -> None:
    result = _run("dp=2,micro_batch=2,zero=1," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    cats = {e.category for e in result.timeline.events}
    # FSDP2 (the torch engine): its all-gathers of parameters and reduce-scatters of gradients
    assert result.engine == "torch" and "comm_zero" in cats
    assert [r.samples_per_step for r in result.ranks] == [4, 4]


def test_data_parallel_uneven_shares(reference, tmp_path) -> None:
    result = _run("dp=2,micro_batch=2,dp_shares=0.75:0.25," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    assert [r.samples_per_step for r in result.ranks] == [6, 2]


def test_tensor_parallel_selective_recompute(reference, tmp_path) -> None:
    result = _run("tp=2,micro_batch=4,recompute=selective," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    tp_comm = [e for e in result.timeline.events if e.category == "comm_tp"]
    # Per layer and micro-batch: g after attn.proj and mlp.fc2 forward, f before qkv and fc1 backward
    # (recomputing the attention core repeats no collective).
    assert len(tp_comm) == 2 * 4 * 4 * 2 * STEPS  # ranks x layers x (2 fwd + 2 bwd) x micro-batches x steps
    assert result.ranks[0].params == result.ranks[1].params < sum(v.numel() for v in reference[1].values())


def _sp_comm(result: RunResult, rank: int, step: int) -> Counter:
    return Counter(e.name for e in result.timeline.events if e.category == "comm_tp" and e.args.get("step") == step
                   and e.args.get("rank") == rank)


def test_sequence_parallel_selective_recompute(reference, tmp_path) -> None:
    # plait's own Megatron-style SP (DTensor's by default: tests/test_torch_engine.py counts its calls)
    result = _run("tp=2,sequence_parallel=true,micro_batch=4,recompute=selective," + FP32, engine="plait")
    assert result.engine == "pipeline"
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    assert not any("sequence_parallel" in n for n in result.notes)
    # Per layer and micro-batch, the two all-reduces forward and backward become an all-gather before each
    # column linear (backward: reduce-scatter) and a reduce-scatter after each row linear (backward:
    # all-gather); the region is entered once (split; backward all-gather) and left once (all-gather) per
    # micro-batch; the LayerNorm / bias gradients are summed once per step. No all-reduce is left.
    per = 4 * 2 * 2  # layers x micro-batches x (attention, MLP)
    expected = {"allgather tp sp-fwd": per, "reducescatter tp sp-fwd": per, "reducescatter tp sp-bwd": per,
                "allgather tp sp-bwd": per, "allgather tp sp-enter-bwd": 2, "allgather tp sp-leave-fwd": 2,
                "allreduce tp sp-grads": 1}
    for rank in (0, 1):
        for step in result.steps:
            assert _sp_comm(result, rank, step) == expected


@pytest.mark.slow  # suite time: torch's modules run it by default (tests/test_torch_engine.py, make test)
def test_sequence_parallel_with_pipeline(reference, tmp_path) -> None:
    # plait's own engine (engine=plait)
    result = _run("tp=2,pp=2,sequence_parallel=true,micro_batch=2,schedule=1f1b," + FP32, engine="plait")
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    # The hidden state crosses the cut between layers.1 and layers.2 still cut along the sequence: stage 0
    # enters the region and never leaves it, stage 1 never enters and leaves before the head.
    for r in result.ranks:
        names = _sp_comm(result, r.rank, 1)
        assert (names["allgather tp sp-enter-bwd"], names["allgather tp sp-leave-fwd"]) == \
            ((4, 0) if r.pp == 0 else (0, 4))
    sends = [e for e in result.timeline.events if e.name.startswith("send_fwd s0 c0") and e.args.get("step") == 1]
    assert sends and all(e.args["sent"] == (8 // 2) * 2 * 16 * 4 for e in sends)  # [s/tp, b, h] fp32


@pytest.mark.slow  # suite time (2026-12-08): test_sequence_parallel_selective_recompute keeps sequence parallelism
def test_sequence_parallel_dropout_resume_is_bit_exact(tmp_path) -> None:
    """With dropout, sequence-parallel layers draw from a per-tensor-rank stream (each rank holds other
    tokens); that stream is checkpointed, so a resumed run continues bit for bit."""
    model = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32,dropout=0.2,attn_dropout=0.2"
    plan = "tp=2,sequence_parallel=true,micro_batch=4," + FP32
    straight = run(model, None, plan, steps=4, checkpoint=CheckpointConfig(dir=tmp_path, every=2),
                   launch=LaunchConfig(timeout=120), records=RecordsConfig(return_params=True))
    shutil.rmtree(tmp_path / "step-00000004")
    resumed = run(model, None, plan, steps=4, checkpoint=CheckpointConfig(dir=tmp_path, resume=True),
                  launch=LaunchConfig(timeout=120), records=RecordsConfig(return_params=True))
    assert resumed.steps == [2, 3] and resumed.losses == straight.losses[2:]
    assert straight.params is not None and resumed.params is not None
    for name, value in straight.params.items():
        assert torch.equal(resumed.params[name], value), name


def _compute_order(result: RunResult, stage: int, step: int) -> list[str]:
    return [e.name.split()[0][0].upper() + str(e.micro_batch) for e in result.timeline.events
            if e.stage == stage and e.args.get("step") == step and e.category in ("forward", "backward")]


def test_pipeline_gpipe(reference, tmp_path) -> None:
    result = _run("pp=2,micro_batch=2,schedule=gpipe," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    # plait.schedule's GPipe (the simulator's too): all forwards, then the backwards latest first.
    assert _compute_order(result, 0, 1) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]
    assert [r.layers for r in result.ranks] == [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]


def test_pipeline_1f1b(reference, tmp_path) -> None:
    result = _run("pp=2,micro_batch=2,schedule=1f1b," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    # PipeDream-Flush: stage 0 warms up with pp - 1 = 1 forward, then alternates; the last stage alternates.
    assert _compute_order(result, 0, 1) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert _compute_order(result, 1, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert any(e.name == "allreduce tied" for e in result.timeline.events)


def test_data_and_tensor_parallel_full_recompute(reference, tmp_path) -> None:
    result = _run("dp=2,tp=2,micro_batch=2,recompute=full," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    assert [(r.dp, r.tp) for r in result.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Full recompute re-runs each layer's forward inside the backward, collectives included -- up to
    # the last tensor backward needs: torch's non-reentrant checkpoint stops early, before the MLP's g.
    per_rank_step = [e for e in result.timeline.events if e.category == "comm_tp" and e.device == 0
                     and e.args.get("step") == 0]
    assert len(per_rank_step) == 4 * 2 * (2 + 1 + 2)  # layers x micro-batches x (fwd g, recompute g, bwd f)


def test_data_and_pipeline_parallel_zero1(reference, tmp_path) -> None:
    result = _run("dp=2,pp=2,micro_batch=2,schedule=1f1b,zero=1," + FP32)
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    assert [(r.pp, r.dp) for r in result.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow  # suite time: pp x tp on torch's modules stays in make test (tests/test_torch_pipeline.py)
@pytest.mark.parametrize("engine", ["torch", "plait"])  # DTensor in torch's pipeline stages by default (issue 29)
def test_tensor_and_pipeline_parallel(engine, reference, tmp_path) -> None:
    result = run(TINY, None, "tp=2,pp=2,micro_batch=2,schedule=gpipe," + FP32, steps=STEPS,
                 launch=LaunchConfig(timeout=120, engine="auto" if engine == "torch" else engine),
                 records=RecordsConfig(return_params=True))
    assert result.engine == ("torch" if engine == "torch" else "pipeline")
    _check_equal(result, reference)
    _check_timeline(result, tmp_path)
    assert {e.category for e in result.timeline.events} >= {"comm_tp", "comm_pp"}


SKIP_MODEL = '''
import torch
from torch import nn


class Skip(nn.Module):
    """No markers; glue between layers, a root parameter used in both stages, a relayed input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.d = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x, y):
        h0 = torch.tanh(self.a(x)) * self.scale
        h = torch.tanh(self.c(torch.tanh(self.b(h0))))
        return self.d(h + h0 * self.scale) + y


def sample_batch(batch, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y, t = (torch.randn(batch, n, generator=g) for n in (6, 3, 3))
    return (x.to(device), y.to(device)), t.to(device)


def make():
    return Skip, sample_batch, torch.nn.functional.mse_loss
'''


def test_pipeline_of_a_model_with_glue_and_skips(tmp_path) -> None:
    path = tmp_path / "skip_model.py"
    path.write_text(SKIP_MODEL)
    model = f"{path}:make"
    plan = "pp=2,micro_batch=2,schedule=1f1b," + FP32
    ref_losses, ref_params = reference_run(model, plan, STEPS)
    result = run(model, None, plan, steps=STEPS, launch=LaunchConfig(timeout=120),
                 records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    assert result.params is not None and set(result.params) == set(ref_params)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-6, msg=name)
    # `scale` lives on stage 0 and reaches stage 1 as a message; its gradient comes back the same way.
    assert [r.layers for r in result.ranks] == [["a", "b"], ["c", "d"]]
    assert not torch.equal(ref_params["scale"], torch.tensor(1.5))
