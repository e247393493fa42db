"""`plait.runtime.engine_for` (issue 29 item 3): the engine that runs each plan family, or why none
can, naming the field; `api.run` refuses such a plan before any process starts."""

from __future__ import annotations

import json

import pytest

from plait.ir.plan import Plan, StageSpec
from plait.ir.program import SpmdProgram, Strategy
from plait.runtime import ENGINES, engine_for, supports
from plait.runtime.entry import engine_of
from plait.runtime.partition import RuntimeSetupError

PROGRAM = {"version": 1, "ratios": [0.6, 0.4], "strategies": {"linear": [["S0", "R"], ["S0"], True]}}


def _graph(**change) -> Plan:
    stages = [StageSpec("a", ["l0"], [0]), StageSpec("b", ["l1"], [1]), StageSpec("c", ["l2"], [2])]
    return Plan(pp=3, micro_batch=2, global_batch=8, stages=stages, stage_edges=[(0, 2), (1, 2)], **change)


def _composed() -> Plan:
    return Plan(pp=2, micro_batch=2, global_batch=8,
                stages=[StageSpec("s0", ["l0"], [0, 1], spmd=PROGRAM),
                        StageSpec("s1", ["l1"], [2], spmd={**PROGRAM, "ratios": [1.0]})], stage_edges=[(0, 1)])


def _spmd() -> Plan:
    program = SpmdProgram({"mm": Strategy(("S0", "R"), ("S0",), True)}, [0.25, 0.75])
    return Plan(micro_batch=8, global_batch=8, spmd=program, device_order=[1, 0])


@pytest.mark.parametrize("plan, engine", [
    (Plan(dp=2, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # data parallel on DDP
    (Plan(dp=2, micro_batch=2, global_batch=8, dp_shares=[0.75, 0.25], dtype="fp32"), "torch"),  # uneven shares
    (Plan(dp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # ZeRO-3 on FSDP2
    (Plan(dp=2, micro_batch=2, global_batch=8), "torch"),  # bf16: DDP under autocast
    (Plan(dp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp16"), "torch"),  # FSDP2 MixedPrecisionPolicy
    (Plan(dp=2, zero=3, micro_batch=2, global_batch=8, grad_reduce_dtype="bf16"), "torch"),  # its reduce_dtype
    (Plan(dp=2, micro_batch=2, global_batch=8, grad_reduce_dtype="bf16"), "torch"),  # DDP: a compressing hook
    (Plan(dp=2, zero=1, micro_batch=2, global_batch=8, grad_reduce_dtype="fp16"), "torch"),  # its reduce_dtype
    (Plan.from_dict({**_spmd().to_dict(), "grad_reduce_dtype": "bf16"}), "spmd"),  # its parameter gradients
    (Plan(dp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # ZeRO-1 on FSDP2
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # tensor parallel on DTensor
    (Plan(dp=2, tp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # FSDP2 over DTensor's TP
    (Plan(tp=2, micro_batch=2, global_batch=8, sequence_parallel=True), "torch"),  # tensor + sequence, bf16
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp16"), "torch"),  # DTensor under autocast, loss scaling
    (Plan(tp=2, dp=2, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), "torch"),  # + data
    (Plan(tp=2, dp=2, micro_batch=2, global_batch=8, sequence_parallel=True), "torch"),  # bf16 SP + data
    (Plan(dp=2, tp=2, pp=2, micro_batch=1, global_batch=8), "torch"),  # the 3D grid in bf16
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8, sequence_parallel=True), "torch"),  # SP inside the stages
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # DTensor inside pipeline stages
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8), "torch"),  # bf16: DTensor under autocast in the stages
    (Plan(dp=2, tp=2, pp=2, micro_batch=1, global_batch=8, dtype="fp32"), "torch"),  # replicate over DTensor stages
    (Plan(dp=2, tp=2, pp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp32", dp_shares=[0.75, 0.25]),
     "torch"),  # FSDP2 over each stage's DTensor-TP modules
    (Plan(dp=2, tp=2, pp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32"), "torch"),  # as many micro-batches
    (Plan(pp=2, micro_batch=1, global_batch=8, schedule="interleaved", virtual_stages=2), "torch"),  # pipelining
    (Plan(dp=2, pp=2, micro_batch=2, global_batch=10, dp_shares=[0.5, 0.5]), "torch"),  # micro-batches 2, 2, 1
    (Plan(dp=2, pp=2, zero=1, micro_batch=2, global_batch=8, dp_shares=[0.75, 0.25]), "torch"),  # FSDP2 per stage
    (Plan(dp=2, pp=2, zero=2, micro_batch=2, global_batch=8, dtype="fp16"), "torch"),
    (Plan(dp=2, pp=2, zero=3, micro_batch=1, global_batch=8), "torch"),  # ZeRO-3 with pipelines: torch's only
    (Plan(dp=2, pp=2, tp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32", dp_shares=[0.75, 0.25]),
     "torch"),  # 3 and 1 micro-batches: the lighter replica's pipeline runs ghosts
    (Plan(pp=2, zero=3, micro_batch=1, global_batch=8), "torch"),  # dp=1: nothing to shard
    (_graph(), "pipeline"),  # a stage graph (fan-in)
    (_spmd(), "spmd"),
    (_composed(), "compose"),
])
def test_every_plan_family_is_named_its_engine(plan, engine, tmp_path):
    verdict = engine_for(plan)
    assert verdict.engine == engine and verdict.ok and verdict.reason == ""
    assert (verdict.not_torch == "") == (engine == "torch")  # plait's own engines say why not torch's
    assert engine in ENGINES and supports(plan) == (True, "")
    assert engine_of(plan) == engine  # the worker entry builds the engine the check named
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    assert engine_for(str(path)) == verdict  # a plan file gets the same verdict


@pytest.mark.parametrize("plan, field", [
    (_graph(zero=3), "'zero'"),  # a stage graph's ZeRO-3: neither engine
    (Plan(pp=2, micro_batch=2, global_batch=8, schedule="eager_1f1b"), "'schedule'"),
    (_graph(schedule="interleaved"), "'schedule'"),
    (Plan.from_dict({**_graph().to_dict(), "stage_edges": [[0, 2]]}), "'stage_edges'"),  # two sinks
    (Plan.from_dict({**_composed().to_dict(), "schedule": "interleaved"}), "'schedule'"),
    (Plan(pp=2, micro_batch=2, global_batch=8,
          stages=[StageSpec("s0", ["l0"], [0, 1], spmd=PROGRAM), StageSpec("s1", ["l1"], [2])],
          stage_edges=[(0, 1)]), "'stages[1].program'"),
])
def test_a_plan_no_engine_runs_is_named_with_the_field(plan, field):
    verdict = engine_for(plan)
    assert verdict.engine is None and not verdict.ok and f"plan field {field}" in verdict.reason
    assert supports(plan) == (False, verdict.reason)
    with pytest.raises(RuntimeSetupError) as info:
        engine_of(plan)
    assert str(info.value) == verdict.reason  # a worker never builds an engine for it either


def test_run_refuses_before_any_process_starts(tmp_path):
    from plait.runtime.api import run
    from plait.runtime.config import RecordsConfig

    plan = Plan(pp=2, micro_batch=2, global_batch=8, schedule="eager_1f1b")
    with pytest.raises(RuntimeSetupError, match="plan field 'schedule'"):
        run("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8", None, plan, steps=1,
            records=RecordsConfig(run_dir=tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before the run folder, config or any worker


@pytest.mark.parametrize("run, why", [
    ({"engine": "plait"}, "engine=plait"),
])
def test_zero3_pipelines_run_on_the_torch_engine_only(run, why):
    """issue 29: FSDP2 shards a ZeRO-3 pipeline's stages (torch's engine); plait's own engine never
    gets one -- what keeps it off the torch engine refuses it, with both reasons."""
    plan = Plan(dp=2, pp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32")
    assert engine_for(plan).engine == "torch" and supports(plan) == (True, "")
    verdict = engine_for(plan, run)
    assert verdict.engine is None and "plan field 'zero'" in verdict.reason and why in verdict.reason
    with pytest.raises(RuntimeSetupError, match="runs on the torch engine only"):
        engine_of(plan, run)
    # ZeRO-1/2 pipelines go to plait's own engine then, which runs them
    for zero in (1, 2):
        low = Plan(dp=2, pp=2, zero=zero, micro_batch=2, global_batch=8, dtype="fp32")
        assert engine_for(low).engine == "torch"
        assert engine_for(low, run).engine == "pipeline" and why in engine_for(low, run).not_torch


def test_run_asking_plaits_engine_for_a_zero3_pipeline_is_refused_before_any_process_starts(tmp_path):
    from plait.runtime.api import LaunchConfig, run
    from plait.runtime.config import RecordsConfig

    plan = Plan(dp=2, pp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32")
    with pytest.raises(RuntimeSetupError, match="plan field 'zero'.*engine=plait"):
        run("gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8", None, plan, steps=1,
            launch=LaunchConfig(engine="plait"), records=RecordsConfig(run_dir=tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("run, engine, why", [
    ({}, "torch", ""),
    ({"dtype": "fp32", "checkpoint": None}, "torch", ""),
    ({"dtype": "fp16"}, "torch", ""),  # mixed precision on DDP (autocast, loss scaling) too
    ({"dtype": "fp32", "checkpoint": {"dir": "ck", "every": 1}}, "torch", ""),  # DDP's in the one DCP format
    ({"engine": "plait"}, "pipeline", "engine=plait"),  # LaunchConfig(engine="plait")
])
def test_the_run_config_can_keep_a_plan_on_plaits_engine(run, engine, why):
    """What the worker config asks for counts too: the same verdict in `api.run` and in the worker."""
    plan = Plan(dp=2, micro_batch=2, global_batch=8, dtype="fp32")
    verdict = engine_for(plan, run)
    assert verdict.engine == engine and why in verdict.not_torch and verdict.ok
    assert engine_of(plan, run) == engine


def test_fsdp2_and_dtensor_checkpoints_run_on_torch_modules():
    ck = {"checkpoint": {"dir": "ck", "every": 1}}
    assert engine_for(Plan(dp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32"), ck).engine == "torch"
    for zero in (1, 3):  # a pipeline's FSDP2 shards too
        assert engine_for(Plan(dp=2, pp=2, zero=zero, micro_batch=2, global_batch=8, dtype="fp32"), ck).engine == "torch"
    assert engine_for(Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {**ck, "engine": "torch"}).engine == "torch"


def test_a_replica_without_samples_stays_on_plaits_engine():
    plan = Plan(dp=2, micro_batch=1, global_batch=2, dp_shares=[1.0, 0.0], dtype="fp32")
    assert plan.samples_per_replica() == [2, 0]
    assert engine_for(plan).engine == "pipeline" and "no samples" in engine_for(plan).not_torch


@pytest.mark.parametrize("plan, run, engine, why", [
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {}, "torch", ""),  # DTensor, its calls recorded
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="tf32"), {}, "torch", ""),
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"engine": "plait"}, "pipeline", "engine=plait"),
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32", tp_ratios=[0.75, 0.25]), {}, "pipeline",
     "DTensor shards every dimension evenly"),
    # dp x tp (issue 29): torch's FSDP2-based replicate at ZeRO-0, FSDP2 over the DTensor-TP model at ZeRO-1/2/3,
    # uneven shares (ZeRO-3's ghost micro-batches) and checkpoints (2D shards as boxes) included
    (Plan(tp=2, dp=2, micro_batch=2, global_batch=8, dtype="fp32"), {}, "torch", ""),
    (Plan(tp=2, dp=2, micro_batch=2, global_batch=8, dtype="fp32", dp_shares=[0.75, 0.25]),
     {"checkpoint": {"dir": "ck", "every": 1}}, "torch", ""),
    (Plan(tp=2, dp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp32", dp_shares=[0.75, 0.25]),
     {"checkpoint": {"dir": "ck", "every": 1}}, "torch", ""),
    (Plan(tp=2, dp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32", dp_shares=[0.75, 0.25]), {}, "torch", ""),
    # dp x tp in low precision (issue 29): FSDP2's / replicate's MixedPrecisionPolicy over DTensor under autocast
    (Plan(tp=2, dp=2, micro_batch=2, global_batch=8, dtype="bf16"), {}, "torch", ""),
    (Plan(tp=2, dp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp16"), {}, "torch", ""),
    (Plan(tp=2, dp=2, zero=1, micro_batch=2, global_batch=8, dtype="bf16", dp_shares=[0.75, 0.25]), {}, "torch", ""),
    # ... at ZeRO-2/3 and in the 3D grid (tests/test_program_precision.py)
    (Plan(tp=2, dp=2, zero=3, micro_batch=2, global_batch=8, dtype="bf16", dp_shares=[0.75, 0.25]), {}, "torch", ""),
    (Plan(tp=2, pp=2, dp=2, zero=1, micro_batch=2, global_batch=8, dtype="bf16"), {}, "torch", ""),
    (Plan(tp=2, dp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), {}, "torch", ""),
    (Plan(tp=2, dp=2, zero=3, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), {}, "torch", ""),
    (Plan(tp=2, dp=2, micro_batch=1, global_batch=2, dtype="fp32", dp_shares=[1.0, 0.0]), {}, "pipeline",
     "no samples"),
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"engine": "torch"}, "torch", ""),  # per stage
    # the full 3D composition: torch's replicate (ZeRO-0; DDP takes no DTensor parameters) or FSDP2 over
    # each stage's DTensor-TP modules
    (Plan(tp=2, pp=2, dp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"engine": "torch"}, "torch", ""),
    (Plan(tp=2, pp=2, dp=2, zero=2, micro_batch=2, global_batch=8, dtype="fp32"), {}, "torch", ""),
    (Plan(tp=2, pp=2, dp=2, micro_batch=2, global_batch=8, dtype="bf16"), {}, "torch", ""),
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), {}, "torch", ""),
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8, dtype="bf16"), {}, "torch", ""),  # pp x tp under autocast
    (Plan(tp=2, pp=2, zero=1, micro_batch=2, global_batch=8, dtype="fp16"), {}, "torch", ""),
    (Plan(tp=2, pp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"model": "gpt:layers=2,hidden=12,heads=3,seq=4,vocab=8"},
     "pipeline", "3 heads, not divisible by tp=2"),
    # issue 29: mixed precision on DTensor (fp32 masters, autocast, fp16's loss scaler agreed over the job)
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="bf16"), {"engine": "torch"}, "torch", ""),
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"dtype": "fp16"}, "torch", ""),
    # sequence parallelism in torch's styles (SequenceParallel norms, all-gather / reduce-scatter)
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), {}, "torch", ""),
    (Plan(tp=2, micro_batch=2, global_batch=8, sequence_parallel=True), {"model": "llama:layers=1,hidden=16,heads=4,"
     "kv_heads=2,seq=8,vocab=8"}, "torch", ""),  # GQA: q and kv read one gathered input
    (Plan(tp=2, micro_batch=2, global_batch=8, sequence_parallel=True), {"model": "bert:layers=1,hidden=16,heads=4,"
     "seq=8,vocab=8"}, "torch", ""),  # post-LN
    (Plan(tp=2, dp=2, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), {}, "torch", ""),  # dp x tp
    (Plan(tp=2, pp=2, dp=2, micro_batch=2, global_batch=8, dtype="fp32", sequence_parallel=True), {}, "torch",
     ""),  # the 3D grid with SP inside the stages
    # a cut torch's styles do not express: MoE experts (whole) between the regions, not a layer norm
    (Plan(tp=2, micro_batch=2, global_batch=8, sequence_parallel=True), {"model": "bert_moe"}, "pipeline",
     "plan field 'sequence_parallel'"),
    (Plan(tp=2, micro_batch=2, global_batch=8), {"model": "bert_moe"}, "torch", ""),  # without it: DTensor's
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"checkpoint": {"dir": "ck", "every": 1}},
     "torch", ""),  # DTensor's shards in the one DCP format
    # the run's model counts too: its cut must be DTensor's (here: whole heads on each rank)
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"model": "gpt:layers=1,hidden=16,heads=4,seq=4,vocab=8"},
     "torch", ""),
    (Plan(tp=2, micro_batch=2, global_batch=8, dtype="fp32"), {"model": "gpt:layers=1,hidden=12,heads=3,seq=4,vocab=8"},
     "pipeline", "3 heads, not divisible by tp=2"),
])
def test_tensor_parallelism_runs_on_dtensor_by_default(plan, run, engine, why):
    verdict = engine_for(plan, run)
    assert verdict.engine == engine and (verdict.not_torch == "") == (engine == "torch") and why in verdict.not_torch
    assert engine_of(plan, run) == engine
