"""Graph-pipeline, SPMD and composed plans in bf16 and fp16 (issue 30 item 1): fp32 master
parameters, ops autocast to the plan's precision, fp16 with dynamic loss scaling agreed over every
rank; each run against the single-process reference in the same precision (`reference_run` with
`training.dtype`).

Low precision rounds differently where a program splits a reduction over ranks (a row-parallel
matmul's partial sums are added after rounding), so the runs are held to bf16's / fp16's own
resolution -- a few units of 2^-8 (bf16) and 2^-11 (fp16) relative -- not fp32's 1e-5; the fp32
reference sits farther away than that, so the runs did compute in low precision."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_spmd_checkpoint import NAME
from test_spmd_program import BATCH, RATIOS, captured, synthesized

pytestmark = pytest.mark.distributed

STEPS = 3
TOL = {"bf16": 3 * 2.0 ** -8, "fp16": 3 * 2.0 ** -11}


TORCH_TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"


def _torch_low_precision_run(tmp_path, monkeypatch, plan: str, dtype: str) -> tuple[Any, Any, Any]:
    """`plan` on torch's modules in `dtype` (fp16's loss scaler on a fixed schedule, the reference's
    too), held to the same-precision single-process reference: (result, reference, training)."""
    from plait.runtime import engine_for
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    assert engine_for(plan).engine == "torch"
    scale = {"PLAIT_LOSS_SCALE": "init=1024,growth_interval=2"}
    monkeypatch.setenv("PLAIT_LOSS_SCALE", scale["PLAIT_LOSS_SCALE"])  # the reference's scaler
    training = TrainingConfig(dtype=dtype, optimizer="adam", lr=1e-2)
    result = run(TORCH_TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180, env=scale),
                 records=RecordsConfig(run_dir=tmp_path / "run"))
    reference = reference_run(TORCH_TINY, plan, STEPS, training=training)
    assert result.engine == "torch"
    assert _close(result.losses, reference[0], TOL[dtype]), (result.losses, reference[0])
    return result, reference, training


def _spmd_plan(tmp_path, dtype: str) -> tuple[str, str]:
    from plait.graph.aten_capture import capture_aten
    from plait.runtime.partition import make_samples
    from plait.spmd.program_plan import program_plan

    spec, model, *_ = captured(NAME)
    inputs, _ = make_samples(spec, 0, BATCH, 0)
    program = synthesized(capture_aten(model, inputs, name=spec.name))
    path = tmp_path / f"spmd-{dtype}.json"
    program_plan(program.strategies, RATIOS, BATCH, model=spec.spec, dtype=dtype).save(path)
    return spec.spec, str(path)


def _close(got: list[float], want: list[float], tol: float) -> bool:
    return all(abs(g - w) <= tol * abs(w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])  # suite time (2026-12-08)
def test_spmd_plan_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, dtype: str) -> None:
    from plait.runtime.api import LaunchConfig, TrainingConfig, reference_run, run

    scale = {"PLAIT_LOSS_SCALE": "init=1024,growth_interval=2"}
    monkeypatch.setenv("PLAIT_LOSS_SCALE", scale["PLAIT_LOSS_SCALE"])  # the reference's scaler
    model, plan = _spmd_plan(tmp_path, dtype)
    training = TrainingConfig(dtype=dtype, optimizer="adam", lr=1e-2)
    result = run(model, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180, env=scale))
    low, _ = reference_run(model, plan, STEPS, training=training)
    fp32, _ = reference_run(model, plan, STEPS, training=TrainingConfig(dtype="fp32", optimizer="adam", lr=1e-2))
    assert _close(result.losses, low, TOL[dtype]), (result.losses, low)
    assert not _close(result.losses, fp32, 1e-6), "the run did not compute in low precision"
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


# suite time: fp16 in the slow set (its loss scaler stays in make test with the other families' fp16 cases)
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_composed_plan_trains_in_low_precision_as_one_process(monkeypatch, dtype: str) -> None:
    from test_compose_run import TINY, _composed_plan

    from plait.runtime.api import LaunchConfig, TrainingConfig, reference_run, run

    scale = {"PLAIT_LOSS_SCALE": "init=1024,growth_interval=2"}
    monkeypatch.setenv("PLAIT_LOSS_SCALE", scale["PLAIT_LOSS_SCALE"])  # the reference's scaler
    plan = dataclasses.replace(_composed_plan(), dtype=dtype)
    training = TrainingConfig(dtype=dtype, optimizer={"name": "sgd"}, lr=0.5)
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180, env=scale))
    low, _ = reference_run(TINY, plan, STEPS, training=training)
    assert _close(result.losses, low, TOL[dtype]), (result.losses, low)
    if dtype == "fp16":  # every rank of both stages agreed on the scale
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []


# suite time: fp16's loss scaler keeps its make-test cases in the data-parallel family on torch's
# modules (ZeRO 0 and 3) and tests/test_runtime_amp.py (the scaler is one class, amp.DynamicLossScaler);
# the tensor-parallel, SPMD and torch-pipeline fp16 cases went to the slow set too (2026-12-08)
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_stage_graph_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, dtype: str) -> None:
    # A GraphPipe-shaped plan on 3 ranks: stage a fans out to b (micro-batches of 1) and to the sink
    # {c, d} (micro-batches of 4), which also reads b's output and its own input y (a skip edge).
    from test_runtime_pipeline_graph import DIAMOND

    from plait.ir.plan import Plan, StageSpec
    from plait.runtime import engine_for
    from plait.runtime.api import LaunchConfig, TrainingConfig, reference_run, run

    path = tmp_path / "diamond.py"
    path.write_text(DIAMOND)
    model = f"{path}:make"
    stages = [StageSpec(name="a", layers=["a"], devices=[0]), StageSpec(name="b", layers=["b"], devices=[1],
                                                                         micro_batch=1),
              StageSpec(name="cd", layers=["c", "d"], devices=[2], micro_batch=4)]
    plan = Plan(stages=stages, stage_edges=[(0, 1), (0, 2), (1, 2)], micro_batch=2, global_batch=8, dtype=dtype)
    assert engine_for(plan).engine == "pipeline"
    scale = {"PLAIT_LOSS_SCALE": "init=1024,growth_interval=2"}
    monkeypatch.setenv("PLAIT_LOSS_SCALE", scale["PLAIT_LOSS_SCALE"])  # the reference's scaler
    training = TrainingConfig(dtype=dtype, optimizer={"name": "sgd"}, lr=0.5)
    result = run(model, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180, env=scale))
    low, _ = reference_run(model, plan, STEPS, training=training)
    fp32, _ = reference_run(model, plan, STEPS, training=dataclasses.replace(training, dtype="fp32"))
    assert _close(result.losses, low, TOL[dtype]), (result.losses, low)
    # The first step's forward is the reference's to fp32 rounding (the sink sums two micro-batches'
    # losses); fp32 compute sits some 5e-5 away there.
    assert _close(result.losses[:1], low[:1], 1e-6) and not _close(result.losses[:1], fp32[:1], 1e-5), (
        result.losses, low, fp32)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("zero", [0, 3])
def test_data_parallel_plan_on_torch_modules_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, zero: int,
                                                                                   dtype: str) -> None:
    # issue 29: DDP under autocast, or FSDP2 with MixedPrecisionPolicy (parameters gathered in the
    # plan's dtype, gradients reduce-scattered in fp32), fp16 with plait's loss scaler.
    from plait.ir.comm import read_comm_records
    from plait.runtime.api import reference_run

    plan = f"dp=2,micro_batch=2,zero={zero},global_batch=8,dtype={dtype}"
    result, (low, params), training = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    fp32, _ = reference_run(TORCH_TINY, plan, STEPS, training=dataclasses.replace(training, dtype="fp32"))
    if zero:  # each step gathers every parameter in forward and backward of 2 micro-batches, at 2 bytes each
        numel = sum(v.numel() for n, v in params.items() if n != "head.lm.weight")  # tied to embed.tok
        gathers = [r for r in read_comm_records(tmp_path / "run" / "comm" / "rank0.jsonl").records
                   if r.op == "all_gather" and r.step == 1]
        assert sum(r.bytes for r in gathers) == 2 * 2 * numel * 2
    else:  # the first forward is the reference's, nearer it than fp32 compute
        assert abs(result.losses[0] - low[0]) < abs(result.losses[0] - fp32[0]), (result.losses, low, fp32)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


def test_fsdp2_reduces_gradients_in_the_plans_grad_reduce_dtype(tmp_path) -> None:
    # grad_reduce_dtype=bf16: FSDP2 reduce-scatters bf16 gradients (2 bytes per element of every
    # micro-batch's gradients; fp32 by default, 4), still the bf16 reference's losses.
    from plait.ir.comm import read_comm_records
    from plait.runtime import engine_for
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    tiny = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
    plan = "dp=2,micro_batch=2,zero=3,global_batch=8,dtype=bf16,grad_reduce_dtype=bf16"
    assert engine_for(plan).engine == "torch"
    training = TrainingConfig(dtype="bf16", optimizer="adam", lr=1e-2)
    result = run(tiny, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180),
                 records=RecordsConfig(run_dir=tmp_path / "run"))
    low, params = reference_run(tiny, plan, STEPS, training=training)
    assert _close(result.losses, low, TOL["bf16"]), (result.losses, low)
    numel = sum(v.numel() for n, v in params.items() if n != "head.lm.weight")  # tied to embed.tok
    scatters = [r for r in read_comm_records(tmp_path / "run" / "comm" / "rank0.jsonl").records
                if r.op == "reduce_scatter" and r.step == 1]
    assert sum(r.bytes for r in scatters) == 2 * numel * 2


def _reduction_bytes(run_dir, step: int = 1) -> dict[tuple[str, str, int], int]:
    """(name, op, seq) -> bytes of every collective rank 0 ran in `step` (point-to-point left out)."""
    from plait.ir.comm import read_comm_records

    records = read_comm_records(run_dir / "comm" / "rank0.jsonl").records
    return {(r.name or "", r.op, r.seq): r.bytes for r in records
            if r.step == step and r.op not in ("send", "recv", "barrier")}


@pytest.mark.parametrize("family", ["pipeline",  # suite time: the 3D grid's case (1 s) in make test,
                                    pytest.param("spmd", marks=pytest.mark.slow),  # the SPMD (10 s) and
                                    pytest.param("composed", marks=pytest.mark.slow)])  # composed (12-18 s) slow
def test_gradients_cross_the_wire_in_the_plans_grad_reduce_dtype(tmp_path, family: str) -> None:
    # issue 30: grad_reduce_dtype=bf16 on plait's own engines -- the 3D grid's ZeRO-1 reduce-scatter,
    # an SPMD program's parameter-gradient collectives, a composed plan's deferred buckets. Paired with
    # the same bf16 run reducing in fp32: every gradient collective carries exactly half the bytes,
    # every other call the same, and the losses stay the bf16 reference's.
    from test_compose_run import TINY, _composed_plan

    from plait.ir.plan import Plan
    from plait.runtime import engine_for
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    if family == "pipeline":
        model, base = TINY, Plan.parse("dp=2,zero=1,micro_batch=2,global_batch=8,dtype=bf16")
    elif family == "spmd":
        model, path = _spmd_plan(tmp_path, "bf16")
        base = Plan.load(path)
    else:
        model, base = TINY, dataclasses.replace(_composed_plan(), dtype="bf16")
    training = TrainingConfig(dtype="bf16", optimizer="adam", lr=1e-2)
    sent, losses = {}, {}
    for wire in ("bf16", "fp32"):
        plan = dataclasses.replace(base, grad_reduce_dtype=wire)
        # the 3D grid on plait's own engine (torch's modules run such a plan by default: FSDP2's
        # reduce dtype, tests/test_program_precision.py::test_fsdp2_reduces_gradients_in_the_plans_grad_reduce_dtype)
        engine = "plait" if family == "pipeline" else None
        run_engine = engine_for(plan, {"engine": engine} if engine else None).engine
        assert run_engine == ("compose" if family == "composed" else family), run_engine
        result = run(model, None, plan, steps=2, training=training,
                     launch=LaunchConfig(timeout=180, **({"engine": engine} if engine else {})),
                     records=RecordsConfig(run_dir=tmp_path / wire))
        sent[wire], losses[wire] = _reduction_bytes(tmp_path / wire), result.losses
    low, _ = reference_run(model, dataclasses.replace(base, grad_reduce_dtype="bf16"), 2, training=training)
    assert _close(losses["bf16"], low, TOL["bf16"]), (losses["bf16"], low)
    assert sent["bf16"].keys() == sent["fp32"].keys()
    halved = [k for k in sent["fp32"] if sent["bf16"][k] != sent["fp32"][k]]
    assert halved, "no gradient collective changed"
    grads = {"pipeline": ("reducescatter dp grads",), "spmd": ("bwd",),
             "composed": ("gradients P->R", "all_reduce tied")}[family]  # its buckets and the tied embedding
    assert all(any(g in k[0] for g in grads) for k in halved), halved  # only the gradients' collectives
    assert all(2 * sent["bf16"][k] == sent["fp32"][k] for k in halved), [
        (k, sent["bf16"][k], sent["fp32"][k]) for k in halved]


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])  # suite time (above)
def test_chain_pipeline_on_torch_pipelining_trains_in_low_precision_as_one_process(tmp_path, monkeypatch,
                                                                                   dtype: str) -> None:
    # issue 29: torch's pipeline stages in plait's 1F1B order under autocast (the stages' boundary
    # values cross in the compute dtype), DDP over each stage's replicas, fp16 with plait's loss
    # scaler agreed over the job; every message in the comm records
    from plait.ir.comm import read_comm_records
    from plait.runtime.api import reference_run

    plan = f"dp=2,pp=2,micro_batch=2,layer_split=2:4,schedule=1f1b,global_batch=8,dtype={dtype}"
    result, (low, _), training = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    fp32, _ = reference_run(TORCH_TINY, plan, STEPS, training=dataclasses.replace(training, dtype="fp32"))
    assert abs(result.losses[0] - low[0]) < abs(result.losses[0] - fp32[0]), (result.losses, low, fp32)
    # each micro-batch's activations crossed through the facade (the residual stream autocast leaves
    # in fp32: micro-batch 2 x seq 8 x hidden 16 x 4 bytes, as on plait's own engine)
    sends = [r for r in read_comm_records(tmp_path / "run" / "comm" / "rank0.jsonl").records
             if r.op == "send" and r.key != "probe" and r.step == 1]
    assert [r.key for r in sends] == ["send_fwd s0 c0 mb0", "send_fwd s0 c0 mb1"]
    assert all(r.bytes == 2 * 8 * 16 * 4 for r in sends)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []



@pytest.mark.parametrize("dtype, sp", [("bf16", False), pytest.param("fp16", False, marks=pytest.mark.slow),
                                       pytest.param("bf16", True, marks=pytest.mark.slow)])  # suite time
def test_tensor_parallel_plan_on_dtensor_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, dtype: str,
                                                                                sp: bool) -> None:
    # issue 29: DTensor's colwise / rowwise linears (and sequence parallelism's styles) under autocast,
    # fp32 master parameters and optimizer state, fp16 with plait's loss scaler agreed over the job
    from collections import Counter

    from plait.ir.comm import read_comm_records
    from plait.runtime.api import reference_run

    plan = f"tp=2,micro_batch=4,global_batch=8,dtype={dtype},sequence_parallel={str(sp).lower()}"
    result, (low, _), training = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    if dtype == "bf16":  # the first forward nearer the bf16 reference than fp32 compute (fp16's are too near)
        fp32, _ = reference_run(TORCH_TINY, plan, STEPS, training=dataclasses.replace(training, dtype="fp32"))
        assert abs(result.losses[0] - low[0]) < abs(result.losses[0] - fp32[0]), (result.losses, low, fp32)
    # Each step's tp calls (4 layers x 2 micro-batches of [s=8, b=4, h=16]): what the row linears
    # reduce (their outputs) crosses in the low dtype, 2 bytes an element; what the column linears'
    # inputs carry in forward and backward (the layer norms' outputs and their gradients, which
    # autocast keeps in fp32) 4 bytes -- as on plait's own engine.
    half, full, n = 4 * 8 * 16 * 2, 4 * 8 * 16 * 4, 4 * 2 * 2
    if sp:  # all-gather before the regions, reduce-scatter after the rows; the region left / entered
        want = {("all_gather", "allgather tp fwd", full): n + 2, ("reduce_scatter", "reducescatter tp fwd", half): n,
                ("all_gather", "allgather tp bwd", half): n, ("reduce_scatter", "reducescatter tp bwd", full): n,
                ("all_gather", "allgather tp bwd", full): 2, ("all_reduce", "allreduce tp sp-grads", 4 * 4 * 16 * 4): 1}
    else:
        want = {("all_reduce", "allreduce tp fwd", half): n, ("all_reduce", "allreduce tp bwd", full): n}
    for rank in (0, 1):
        calls = [r for r in read_comm_records(tmp_path / "run" / "comm" / f"rank{rank}.jsonl").records
                 if r.step == 1 and r.group == "tp"]
        assert Counter((r.op, r.name, r.bytes) for r in calls) == want
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


@pytest.mark.parametrize("dtype, zero", [pytest.param("bf16", 1, marks=pytest.mark.slow),  # suite time
                                         pytest.param("bf16", 0, marks=pytest.mark.slow),
                                         pytest.param("bf16", 2, marks=pytest.mark.slow),
                                         pytest.param("bf16", 3, marks=pytest.mark.slow),
                                         pytest.param("fp16", 2, marks=pytest.mark.slow),
                                         pytest.param("fp16", 3, marks=pytest.mark.slow),
                                         pytest.param("fp16", 1, marks=pytest.mark.slow),
                                         pytest.param("fp16", 0, marks=pytest.mark.slow)])
def test_dp_x_tp_on_dtensor_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, dtype: str,
                                                                   zero: int) -> None:
    # issue 29: dp=2 x tp=2, DTensor's colwise / rowwise linears under autocast in each replica; at
    # ZeRO-1/2/3 FSDP2 over the DTensor-TP model with its MixedPrecisionPolicy (each tp shard gathered in
    # the low dtype), at ZeRO-0 torch's `replicate`; the gradients reduced over dp in the plan's
    # reduction dtype (fp32 for bf16, fp16 for fp16: `amp.reduce_dtype`), fp16's loss scaler agreed
    # over the job
    from collections import Counter

    from test_torch_engine import _tp_local_numel

    from plait.ir.comm import read_comm_records
    from plait.runtime.api import reference_run

    plan = f"dp=2,tp=2,zero={zero},micro_batch=2,global_batch=8,dtype={dtype}"
    result, (low, params), training = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    if dtype == "bf16":  # the first forward nearer the bf16 reference than fp32 compute
        fp32, _ = reference_run(TORCH_TINY, plan, STEPS, training=dataclasses.replace(training, dtype="fp32"))
        assert abs(result.losses[0] - low[0]) < abs(result.losses[0] - fp32[0]), (result.losses, low, fp32)
    local, grad = _tp_local_numel(params), {"bf16": 4, "fp16": 2}[dtype]
    # the tp calls of the tp=2 count per micro-batch ([s=8, b=2, h=16]; 4 layers x 2 micro-batches a
    # replica), each in the low dtype: the row linears' outputs, and (unlike dp=1's fp32) the column
    # linears' input gradients -- FSDP2's and `replicate`'s MixedPrecisionPolicy casts each unit's
    # inputs to the low dtype (`cast_forward_inputs`), so what the column linears take in is low too
    half, n = 2 * 8 * 16 * 2, 4 * 2 * 2
    for rank in range(4):
        calls = [r for r in read_comm_records(tmp_path / "run" / "comm" / f"rank{rank}.jsonl").records
                 if r.step == 1 and r.key != "probe"]
        assert Counter((r.op, r.name, r.bytes) for r in calls if r.group == "tp") == {
            ("all_reduce", "allreduce tp fwd", half): n, ("all_reduce", "allreduce tp bwd", half): n}
        dp = [r for r in calls if r.group == "dp"]
        if zero:  # each unit's tp shard gathered in the low dtype, its gradients reduce-scattered: once a
            # step at ZeRO-1/2; at ZeRO-3 gathered for each micro-batch's forward and backward (resharded
            # after each) and scattered every micro-batch (no rank holds whole gradients between them)
            mbs = 8 // (2 * 2)  # global batch / (dp x micro-batch)
            gathers, scatters = (2 * mbs, mbs) if zero == 3 else (1, 1)
            assert {r.op for r in dp} == {"all_gather", "reduce_scatter"}
            assert sum(r.bytes for r in dp if r.op == "all_gather") == gathers * 2 * local
            assert sum(r.bytes for r in dp if r.op == "reduce_scatter") == scatters * grad * local
        else:  # each unit all-reduces its local gradients once a step
            assert {r.op for r in dp} == {"all_reduce"} and sum(r.bytes for r in dp) == grad * local
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


@pytest.mark.slow  # suite time: pp x tp stays in make test in fp32 (tests/test_torch_pipeline.py)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_pp_x_tp_on_dtensor_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, dtype: str) -> None:
    # issue 29: pp=2 x tp=2 (rank = stage * tp + t) -- each stage's DTensor colwise / rowwise linears
    # under autocast in plait's 1F1B order, the boundary values crossing between tensor rank t of the
    # stages as at fp32, fp16's loss scaler agreed over the job
    from collections import Counter

    from plait.ir.comm import read_comm_records
    from plait.runtime.api import reference_run

    plan = f"pp=2,tp=2,micro_batch=2,layer_split=2:4,schedule=1f1b,global_batch=8,dtype={dtype}"
    result, (low, _), training = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    if dtype == "bf16":  # the first forward nearer the bf16 reference than fp32 compute
        fp32, _ = reference_run(TORCH_TINY, plan, STEPS, training=dataclasses.replace(training, dtype="fp32"))
        assert abs(result.losses[0] - low[0]) < abs(result.losses[0] - fp32[0]), (result.losses, low, fp32)
    act = 2 * 8 * 16  # a micro-batch's [s=8, b=2, h=16] activation
    for rank, layers in ((0, 1), (1, 1), (2, 3), (3, 3)):  # 2:4 of embedding, 4 layers, head
        calls = [r for r in read_comm_records(tmp_path / "run" / "comm" / f"rank{rank}.jsonl").records
                 if r.step == 1 and r.key != "probe"]
        # the tp=2 count per layer and micro-batch (4 a step): the row linears' outputs in the low
        # dtype, the column linears' input gradients fp32 (the layer norms' outputs, as at pp=1)
        assert Counter((r.op, r.name, r.bytes) for r in calls if r.group == "tp") == {
            ("all_reduce", "allreduce tp fwd", act * 2): 2 * layers * 4,
            ("all_reduce", "allreduce tp bwd", act * 4): 2 * layers * 4}
        if rank < 2:  # stage 0 sends each micro-batch's residual stream, which autocast leaves in fp32
            sends = [r for r in calls if r.op == "send"]
            assert [r.key for r in sends] == [f"send_fwd s0 c0 mb{m}" for m in range(4)]
            assert all(r.bytes == act * 4 for r in sends)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


@pytest.mark.slow  # suite time: 8 ranks; pp x tp and dp x tp in low precision have their own tests
@pytest.mark.parametrize("dtype, plan", [
    # 6 and 2 samples (3 and 1 micro-batches of 2) under torch's replicate, bf16
    ("bf16", "pp=2,dp=2,tp=2,zero=0,micro_batch=2,layer_split=2:4,dp_shares=0.75:0.25,schedule=1f1b"),
    # FSDP2 over each stage's DTensor modules, fp16 with its loss scaler agreed over the 8 ranks
    ("fp16", "pp=2,dp=2,tp=2,zero=1,micro_batch=2,layer_split=2:4,schedule=1f1b"),
    # ZeRO-2 (gathered once a step) and ZeRO-3 (gathered per micro-batch) over the stages' replicas
    ("bf16", "pp=2,dp=2,tp=2,zero=2,micro_batch=2,layer_split=2:4,schedule=1f1b"),
    ("bf16", "pp=2,dp=2,tp=2,zero=3,micro_batch=2,layer_split=2:4,schedule=1f1b"),
])
def test_3d_grid_on_torch_trains_in_low_precision_as_one_process(tmp_path, monkeypatch, dtype: str, plan: str) -> None:
    # issue 29: the full composition -- DTensor's colwise / rowwise linears in each stage under
    # autocast, torch's pipelining between stages, replicate (ZeRO-0) or FSDP2 (ZeRO-1) over each
    # stage's replicas with their MixedPrecisionPolicy -- against the same-precision one-process run
    from plait.ir.comm import read_comm_records

    plan = f"{plan},global_batch=8,dtype={dtype}"
    result, _, _ = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    for rank in range(8):  # every rank's tensor-parallel calls and its stage's replica reduction ran
        groups = {r.group for r in read_comm_records(tmp_path / "run" / "comm" / f"rank{rank}.jsonl").records
                  if r.step == 1 and r.key != "probe"}
        assert {"tp", "dp"} <= groups, (rank, groups)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


@pytest.mark.slow  # suite time: SP in low precision at dp=1 and SP beside dp x tp in fp32 have their own tests
@pytest.mark.parametrize("dtype, zero", [("bf16", 0), ("fp16", 1), ("bf16", 3)])
def test_sequence_parallelism_beside_dp_on_dtensor_trains_in_low_precision_as_one_process(
        tmp_path, monkeypatch, dtype: str, zero: int) -> None:
    # issue 29: dp=2 x tp=2 with sequence parallelism in torch's styles under autocast, replicate
    # (ZeRO-0) or FSDP2 (ZeRO-1/3) with their MixedPrecisionPolicy over the replicas, uneven shares
    from plait.ir.comm import read_comm_records

    plan = f"dp=2,tp=2,zero={zero},sequence_parallel=true,micro_batch=2,dp_shares=0.75:0.25,global_batch=8,dtype={dtype}"
    result, _, _ = _torch_low_precision_run(tmp_path, monkeypatch, plan, dtype)
    for rank in range(4):  # sequence parallelism's collectives (not the plain tp all-reduces) ran
        ops = {r.op for r in read_comm_records(tmp_path / "run" / "comm" / f"rank{rank}.jsonl").records
               if r.step == 1 and r.group == "tp"}
        assert {"all_gather", "reduce_scatter"} <= ops, (rank, ops)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []
