"""Chain pipeline plans on torch.distributed.pipelining (issue 29, `parallelize.apply_pp`): by
default, uneven layer splits run on torch's PipelineStage in the order of plait's schedules
(`torch_schedule.ActionSchedule`, every message through the communication facade) and train
equal to one process (losses and parameters after 3 steps, the tolerances of
tests/test_runtime_forms.py; with SGD and clipping, those of tests/test_runtime_pipeline_graph.py),
under DDP or, at ZeRO-1/2/3, FSDP2 over each stage's replicas."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from plait.ir.comm import CommRecord, read_comm_records, read_run_comm_records
from plait.ir.plan import Plan
from plait.runtime import engine_for
from plait.runtime.api import (
    LaunchConfig,
    RecordsConfig,
    RunResult,
    TrainingConfig,
    read_step_records,
    reference_run,
    run,
)
from plait.runtime.layout import pipeline_layout, step_schedule
from plait.runtime.partition import replica_micro_batches

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
STEPS = 3
FP32 = "global_batch=8,dtype=fp32"
TORCH = {"engine": "torch"}


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_run(TINY, "dp=1,micro_batch=8," + FP32, STEPS)


def _run(plan: str, training: TrainingConfig = TrainingConfig(), run_dir: Path | None = None) -> RunResult:
    """A run on the torch engine; with `run_dir`, kept there with its step records."""
    return run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=120, engine="torch"),
               records=RecordsConfig(return_params=True, step_records=run_dir is not None, run_dir=run_dir))


def _check_equal(result: RunResult, reference: tuple[list[float], dict[str, torch.Tensor]],
                 rel: float = 1e-5, atol: float = 2e-6) -> None:
    ref_losses, ref_params = reference
    assert result.engine == "torch"
    assert result.steps == list(range(STEPS))
    assert result.losses == pytest.approx(ref_losses, rel=rel, abs=1e-6)
    assert result.params is not None
    # every parameter, the LM head tied to embed.tok (its stages' gradients summed) under both names
    assert set(result.params) == set(ref_params)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=rel, atol=atol, msg=name)


def _compute_order(result: RunResult, stage: int, step: int, rank: int | None = None) -> list[str]:
    """A stage's compute spans of one step, in time order (with `rank`: that rank's only)."""
    return [e.name for e in sorted(result.timeline.events, key=lambda e: e.start)
            if e.stage == stage and e.args.get("step") == step and e.category in ("forward", "backward")
            and rank in (None, e.args.get("rank"))]


def _plait_order(plan: str, stage: int) -> list[str]:
    """The compute actions of plait's own schedule for `stage` (what `plait.runtime.worker` runs)."""
    p = Plan.parse(plan)
    layout = pipeline_layout(p)
    mbs = {n: replica_micro_batches(p, 0, 0) for n in range(layout.num_nodes)}
    return [a.key for a in step_schedule(p, layout, mbs, p.schedule).of(stage) if a.is_compute]


def test_engine_for_names_torch_when_asked_and_the_reason_otherwise() -> None:
    plan = "pp=2,micro_batch=2,layer_split=2:4,schedule=1f1b," + FP32
    assert engine_for(plan, TORCH).engine == "torch"
    assert engine_for(plan).engine == "torch"  # the default: every message is recorded (ActionSchedule)
    verdict = engine_for(plan, {"engine": "plait"})
    assert verdict.engine == "pipeline" and "engine=plait" in verdict.not_torch
    # 1F1B with fewer micro-batches than stages: plait's schedule runs it (torch's Schedule1F1B does not)
    assert engine_for("pp=4,micro_batch=4,global_batch=8,dtype=fp32,schedule=1f1b").engine == "torch"
    assert engine_for("pp=2,micro_batch=2,global_batch=8,dtype=bf16").engine == "torch"
    shares = "dp=2,pp=2,micro_batch=2,schedule=gpipe,dtype=fp32,global_batch=8,dp_shares="
    assert engine_for(shares + "0.75:0.25", TORCH).engine == "torch"  # 6 and 2 samples: micro-batches of 2
    # what torch's pipelining does not run, each with its reason, goes to plait's own engine
    assert engine_for(shares + "0.625:0.375").engine == "torch"  # 5 samples: micro-batches of 2, 2 and 1
    # tensor parallelism on DTensor inside each stage, over one replica or under data parallelism over
    # each stage's replicas (torch's replicate at ZeRO-0, FSDP2 at ZeRO-1/2/3)
    assert engine_for("pp=2,tp=2,micro_batch=2,global_batch=8,dtype=fp32", TORCH).engine == "torch"
    for zero in (0, 1, 2, 3):
        assert engine_for(f"pp=2,tp=2,dp=2,micro_batch=2,global_batch=8,dtype=fp32,zero={zero}").engine == "torch"
    # ZeRO-3 with 3 and 1 micro-batches on the replicas: the lighter one runs ghosts
    assert engine_for("pp=2,tp=2,dp=2,micro_batch=2,global_batch=8,dtype=fp32,zero=3,dp_shares=0.75:0.25"
                      ).engine == "torch"
    assert engine_for(plan, {"checkpoint": True}).engine == "torch"  # checkpoints in the one DCP format
    # ZeRO-1/2/3 shard each stage over its replicas with FSDP2 whatever the shares: ZeRO-1/2 gather and
    # reduce-scatter once a step, ZeRO-3 every micro-batch, a lighter replica with ghost micro-batches
    for zero in (1, 2, 3):
        assert engine_for(f"{shares}0.5:0.5,zero={zero}").engine == "torch"
        assert engine_for(f"{shares}0.75:0.25,zero={zero}").engine == "torch"
    # a pipeline's FSDP2 shards are checkpointed by the torch engine (tests/test_runtime_dcp.py)
    assert engine_for(f"{shares}0.5:0.5,zero=1", {"checkpoint": True}).engine == "torch"
    assert engine_for(f"{shares}0.5:0.5,zero=3", {"checkpoint": True}).engine == "torch"


def test_two_stage_uneven_split_gpipe_equals_one_process(reference) -> None:
    plan = "pp=2,micro_batch=2,layer_split=2:4,schedule=gpipe," + FP32
    result = _run(plan)
    _check_equal(result, reference)
    assert [r.layers for r in result.ranks] == [["embed", "layers.0"], ["layers.1", "layers.2", "layers.3", "head"]]
    # plait's GPipe (`plait.schedule`, what the simulator prices): every forward, then the backwards
    # latest first (torch's own ScheduleGPipe runs them in micro-batch order)
    for stage in range(2):
        assert _compute_order(result, stage, 1) == _plait_order(plan, stage)
    assert _compute_order(result, 0, 1) == [f"fwd s0 c0 mb{i}" for i in range(4)] + \
        [f"bwd s0 c0 mb{i}" for i in reversed(range(4))]


def test_three_stage_uneven_split_1f1b_clipped_with_lr_schedule_equals_one_process(tmp_path: Path) -> None:
    plan = "pp=3,micro_batch=2,layer_split=1:3:2,schedule=1f1b," + FP32
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=0.05, lr_warmup_iters=1,
                              lr_decay_style="linear")
    ref_losses, ref_params = reference_run(TINY, plan, STEPS, training=training)
    unclipped = reference_run(TINY, plan, STEPS, training=dataclasses.replace(training, clip_grad=None))[1]
    assert all(not torch.allclose(ref_params[n], unclipped[n], rtol=0, atol=1e-5) for n in ref_params)  # clipping bit
    result = _run(plan, training, run_dir=tmp_path / "run")
    _check_equal(result, (ref_losses, ref_params), rel=0, atol=1e-6)
    # the streamed step records hold one loss share, on the last stage, whose sum is the step's loss
    steps = tmp_path / "run" / "steps"
    assert read_step_records(tmp_path / "run", 3).losses == pytest.approx(dict(enumerate(result.losses)), abs=1e-7)
    last = [json.loads(line) for line in (steps / "rank2.jsonl").read_text().splitlines()]
    assert len(last) == STEPS and all("loss_share" in r for r in last)
    assert not any("loss_share" in (steps / f"rank{r}.jsonl").read_text() for r in (0, 1))
    assert [r.layers for r in result.ranks] == [["embed"], ["layers.0", "layers.1", "layers.2"],
                                                ["layers.3", "head"]]
    # plait's PipeDream-Flush order on every stage
    for stage in range(3):
        assert _compute_order(result, stage, 1) == _plait_order(plan, stage)
    _check_p2p_records(tmp_path / "run", plan)


def _check_p2p_records(run_dir: Path, plan: str) -> None:
    """Every message of the schedule went through the communication facade: each send and receive
    action of plait's list is a record in comm/rankN.jsonl, every step, with its action's key, and
    each send's record pairs with its peer's receive (same link, same sequence number, same bytes);
    replica d's tensor rank t of a stage exchanges with replica d's tensor rank t of its neighbours
    only (rank = (stage * dp + d) * tp + t), the actions of its replica's schedule (its share's
    micro-batches)."""
    p = Plan.parse(plan)
    layout = pipeline_layout(p)
    scheds = [step_schedule(p, layout, {n: replica_micro_batches(p, 0, d) for n in range(layout.num_nodes)},
                            p.schedule) for d in range(p.dp)]
    sends: dict[tuple[str, int], CommRecord] = {}
    recvs: dict[tuple[str, int], CommRecord] = {}
    for rank, records in read_run_comm_records(run_dir / "comm").items():
        p2p = [r for r in records.records if r.op in ("send", "recv") and r.key != "probe"]
        replica, stage = (rank // p.tp) % p.dp, rank // (p.tp * p.dp)
        for step in range(STEPS):
            keys = sorted(str(r.key) for r in p2p if r.step == step)
            assert keys == sorted(a.key for a in scheds[replica].of(stage) if not a.is_compute), (rank, step)
        assert all(r.peer is not None and r.peer % p.tp == rank % p.tp and (r.peer // p.tp) % p.dp == replica
                   and r.peer // (p.tp * p.dp) != stage for r in p2p)
        for r in p2p:
            (sends if r.op == "send" else recvs)[(r.group, r.seq)] = r
    assert sends and sends.keys() == recvs.keys()
    assert all(sends[k].bytes == recvs[k].bytes > 0 for k in sends)


@pytest.mark.slow
def test_data_parallel_pipeline_uneven_shares_on_ddp_equals_one_process(reference) -> None:
    plan = "dp=2,pp=2,micro_batch=2,dp_shares=0.75:0.25,schedule=gpipe,grad_bucket_mb=0.01," + FP32
    result = _run(plan)
    _check_equal(result, reference)
    assert [(r.pp, r.dp, r.samples_per_step) for r in result.ranks] == [(0, 0, 6), (0, 1, 2), (1, 0, 6), (1, 1, 2)]
    # DDP all-reduces each stage's gradients over its replicas once a step, through the facade
    assert {e.name.split(" bucket")[0] for e in result.timeline.events if e.category == "comm_dp"} >= \
        {"allreduce dp", "allreduce tied"}


@pytest.mark.slow
def test_interleaved_two_chunks_per_rank_equals_one_process(reference) -> None:
    plan = "pp=2,virtual_stages=2,micro_batch=1,layer_split=1:2:1:2,schedule=interleaved," + FP32
    result = _run(plan)
    _check_equal(result, reference)
    # nodes 0 and 2 on rank 0, 1 and 3 on rank 1 (Megatron's and torch's interleaved layout)
    assert [r.layers for r in result.ranks] == [["embed", "layers.2"], ["layers.0", "layers.1", "layers.3", "head"]]
    assert {e.chunk for e in result.timeline.events if e.category == "forward"} == {0, 1}
    for stage in range(2):  # Megatron's interleaved order, as plait's schedule has it
        assert _compute_order(result, stage, 1) == _plait_order(plan, stage)


@pytest.mark.slow
def test_four_stage_1f1b_equals_one_process(reference) -> None:
    result = _run("pp=4,micro_batch=2,layer_split=1:2:2:1,schedule=1f1b," + FP32)
    _check_equal(result, reference)
    assert [len(r.layers) for r in result.ranks] == [1, 2, 2, 1]


@pytest.mark.slow
def test_1f1b_with_fewer_micro_batches_than_stages_equals_one_process(reference) -> None:
    # 2 micro-batches over 4 stages: torch's Schedule1F1B refuses it, plait's 1F1B shortens the warm-up
    plan = "pp=4,micro_batch=4,layer_split=1:2:2:1,schedule=1f1b," + FP32
    result = _run(plan)
    _check_equal(result, reference)
    for stage in range(4):
        assert _compute_order(result, stage, 1) == _plait_order(plan, stage)


@pytest.mark.slow  # suite time: pp x tp stays in make test inside the 3D test (test_3d_pipeline_dp_tp_clipped...)
def test_pipeline_with_dtensor_tensor_parallelism_equals_one_process(reference, tmp_path: Path) -> None:
    """pp=2 x tp=2 (4 ranks: rank = stage * tp + t) with an uneven layer split: each stage's transformer
    layers cut by DTensor (`parallelize.apply_tp` over the mesh's recorded "tp" dim), the values between
    stages plain tensors replicated over tp, so tensor rank t of stage 0 exchanges with tensor rank t of
    stage 1 only; the tied embedding / LM head (replicated over tp) summed across the stages per tensor
    rank. Every DTensor all-reduce and every p2p message of plait's 1F1B is in the comm records."""
    plan = "pp=2,tp=2,micro_batch=2,layer_split=2:4,schedule=1f1b," + FP32
    assert engine_for(plan).engine == "torch" and engine_for(plan).not_torch == ""
    result = _run(plan, run_dir=tmp_path / "run")
    _check_equal(result, reference)
    split = [["embed", "layers.0"], ["layers.1", "layers.2", "layers.3", "head"]]
    assert [(r.pp, r.tp, r.layers) for r in result.ranks] == [(p, t, split[p]) for p in range(2) for t in range(2)]
    # each tensor rank holds half of its stage's transformer linears' weights (the biases of the
    # row-parallel ones whole), the rest of the stage whole
    ref = reference[1]
    for r in result.ranks:
        mine = [n for n in ref if ".".join(n.split(".")[:2 if n.startswith("layers.") else 1]) in r.layers]
        halves = [n for n in mine if n.startswith("layers.") and ".ln" not in n
                  and not (n.endswith(".bias") and ("proj" in n or "fc2" in n))]
        assert r.params == sum(ref[n].numel() for n in mine) - sum(ref[n].numel() for n in halves) // 2
    for rank in range(4):
        p, t = divmod(rank, 2)
        assert _compute_order(result, p, 1, rank) == _plait_order(plan, p)
        records = read_comm_records(tmp_path / "run" / "comm" / f"rank{rank}.jsonl")
        assert records.groups["tp"] == [2 * p, 2 * p + 1] and records.groups["tied s0-1"] == [t, 2 + t]
        # Megatron's count per transformer layer of the stage and micro-batch (4 a step): the row-parallel
        # attention projection and fc2 all-reduce their [2, 8, 16] fp32 outputs in forward, the column-
        # parallel QKV and fc1 their inputs' gradients in backward (step 0 also runs torch's shape
        # inference: a forward more)
        layers = len([n for n in split[p] if n.startswith("layers.")])
        for step in (1, 2):
            calls = [r for r in records.records if r.step == step and r.op == "all_reduce" and r.group == "tp"]
            assert Counter(r.name for r in calls) == {"allreduce tp fwd": 2 * layers * 4,
                                                      "allreduce tp bwd": 2 * layers * 4}
            assert all(r.bytes == 2 * 8 * 16 * 4 for r in calls)
            tied = [r for r in records.records if r.step == step and r.group == "tied s0-1"]
            assert [(r.op, r.bytes) for r in tied] == [("all_reduce", 32 * 16 * 4)]
    _check_p2p_records(tmp_path / "run", plan)


@pytest.mark.parametrize("plan", [
    pytest.param("pp=2,tp=2,micro_batch=2,layer_split=3:3,schedule=gpipe,", marks=pytest.mark.slow),  # suite time
    pytest.param("pp=2,tp=2,virtual_stages=2,micro_batch=2,layer_split=1:2:1:2,schedule=interleaved,",
                 marks=pytest.mark.slow),
])
def test_pipeline_with_dtensor_tensor_parallelism_clipped_equals_one_process(plan) -> None:
    """Clipping global over the job with tp inside the stages: the tp-sharded parameters' local norms
    summed over the tensor ranks, the parameters replicated over tp (norms, row-parallel biases, the
    embedding and the LM head tied to it) counted once -- with SGD and an lr schedule, at SGD's tolerance."""
    plan += FP32
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=0.05, lr_warmup_iters=1,
                              lr_decay_style="linear")
    _check_equal(_run(plan, training), reference_run(TINY, plan, STEPS, training=training), rel=0, atol=1e-6)


def test_uneven_shares_with_micro_batches_of_two_sizes_equal_one_process(reference, tmp_path: Path) -> None:
    # 5 and 3 samples in micro-batches of 2: 2, 2, 1 and 2, 1 -- torch's receive buffers re-sized per
    # micro-batch along each boundary value's batch dim (GPT's activations are [s, b, h]: dim 1)
    plan = "dp=2,pp=2,micro_batch=2,layer_split=2:4,dp_shares=0.625:0.375,schedule=1f1b," + FP32
    result = _run(plan, run_dir=tmp_path / "run")
    _check_equal(result, reference)
    assert [(r.pp, r.dp, r.samples_per_step) for r in result.ranks] == [(0, 0, 5), (0, 1, 3), (1, 0, 5), (1, 1, 3)]
    sends = [(r.key, r.bytes) for r in read_run_comm_records(tmp_path / "run" / "comm")[0].records
             if r.op == "send" and r.key != "probe" and r.step == 1]
    assert sends == [(f"send_fwd s0 c0 mb{i}", n * 8 * 16 * 4) for i, n in enumerate((2, 2, 1))]


def _zero_calls(run_dir: Path, rank: int, step: int, op: str) -> Counter[str]:
    """FSDP2's collectives of one rank and step, by unit (`parallelize.apply_fsdp`'s names)."""
    records = read_comm_records(run_dir / "comm" / f"rank{rank}.jsonl").records
    return Counter(str(r.key).split(" zero ", 1)[1] for r in records if r.op == op and r.step == step)


@pytest.mark.parametrize("zero, plan", [
    # uneven shares (5 and 3 samples: micro-batches 2, 2, 1 and 2, 1) and an uneven layer split
    (1, "dp=2,pp=2,micro_batch=2,layer_split=2:4,dp_shares=0.625:0.375,schedule=1f1b,"),
    pytest.param(2, "dp=2,pp=2,micro_batch=2,layer_split=3:3,schedule=gpipe,", marks=pytest.mark.slow),  # suite time
    # 6 and 2 samples: 3 micro-batches and 1, the lighter replica's pipeline runs 2 ghosts of one sample
    pytest.param(3, "dp=2,pp=2,micro_batch=2,layer_split=2:4,dp_shares=0.75:0.25,schedule=1f1b,",
                 marks=pytest.mark.slow),  # suite time (2026-12-08): ZeRO-3 with PP stays in the bf16 case below
])
def test_zero_on_fsdp2_pipeline_equals_one_process(zero, plan, reference, tmp_path: Path) -> None:
    """ZeRO-1/2/3 with pipelines (issue 29): each stage's module sharded by FSDP2 over the stage's
    replicas, a unit per transformer layer and the stage's root (the embedding, the LM head tied to it:
    its gradient summed across the stages on the shards); every gather and reduce-scatter through the
    facade (comm_zero spans). ZeRO-1/2: a unit gathers once a step (kept to the stage's last backward)
    and reduce-scatters once, in the last backward, whatever the replica's micro-batch count; ZeRO-3
    gathers in every micro-batch's forward and backward and reduce-scatters every micro-batch, so a
    replica with fewer micro-batches runs ghosts (one sample, loss weight 0; "ghost" spans) through
    its pipeline up to the most the other runs."""
    plan += f"zero={zero}," + FP32
    assert engine_for(plan).engine == "torch"
    result = _run(plan, run_dir=tmp_path / "run")
    _check_equal(result, reference)
    shares = {1: [5, 3], 2: [4, 4], 3: [6, 2]}[zero]
    assert [(r.pp, r.dp, r.samples_per_step) for r in result.ranks] == \
        [(p, d, shares[d]) for p in range(2) for d in range(2)]
    split = [2, 4] if zero != 2 else [3, 3]
    names = ["embed", *(f"layers.{i}" for i in range(4)), "head"]
    full = json.loads((tmp_path / "run" / "result.json").read_text())["ranks"]
    for r in result.ranks:
        stage_layers = names[sum(split[:r.pp]):sum(split[:r.pp + 1])]
        assert r.layers == stage_layers
        units = {n for n in stage_layers if n.startswith("layers.")} | {f"stage{r.pp}"}
        m = len(replica_micro_batches(Plan.parse(plan), 0, r.dp))
        most = len(replica_micro_batches(Plan.parse(plan), 0, 0)) if zero == 3 else m  # with ghosts
        gathers, scatters = (1, 1) if zero < 3 else (2 * most, most)
        # the first step also runs torch's shape inference (each stage's forward once more): from step 1
        for step in (1, 2):
            assert _zero_calls(tmp_path / "run", r.rank, step, "all_gather") == dict.fromkeys(units, gathers)
            assert _zero_calls(tmp_path / "run", r.rank, step, "reduce_scatter") == dict.fromkeys(units, scatters)
            spans = Counter(e.category for e in result.timeline.events
                            if e.args.get("rank") == r.rank and e.args.get("step") == step)
            assert spans["comm_zero"] == len(units) * (gathers + scatters)
            assert spans["forward"] == spans["backward"] == m and spans["ghost"] == 2 * (most - m)
        # each replica holds about half of its stage's parameters between steps
        assert 0.4 * 4 * r.params < full[r.rank]["param_bytes"] < 0.6 * 4 * r.params


@pytest.mark.slow  # suite time: ZeRO-3 pipelines stay in make test (test_zero_on_fsdp2_pipeline...[3])
def test_zero3_pipeline_three_stages_clipped_and_interleaved_equal_one_process(tmp_path: Path) -> None:
    # clipping over FSDP2's shards (each tied copy counted once) with an lr schedule, at SGD's tolerance
    plan = "dp=2,pp=3,micro_batch=2,layer_split=1:3:2,schedule=1f1b,zero=3," + FP32
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=0.05, lr_warmup_iters=1,
                              lr_decay_style="linear")
    _check_equal(_run(plan, training), reference_run(TINY, plan, STEPS, training=training), rel=0, atol=1e-6)
    # two stages per rank, each its own FSDP2 root
    plan = "dp=2,pp=2,virtual_stages=2,micro_batch=1,layer_split=1:2:1:2,schedule=interleaved,zero=3," + FP32
    _check_equal(_run(plan), reference_run(TINY, "dp=1,micro_batch=8," + FP32, STEPS))


TOL = {"bf16": 3 * 2.0 ** -8, "fp16": 3 * 2.0 ** -11}  # as tests/test_program_precision.py


@pytest.mark.parametrize("dtype, zero", [("bf16", 3), pytest.param("fp16", 1, marks=pytest.mark.slow)])  # suite time
def test_zero_pipeline_trains_in_low_precision_as_one_process(dtype, zero, tmp_path: Path, monkeypatch) -> None:
    # FSDP2's MixedPrecisionPolicy on each stage (parameters gathered in the run's dtype, gradients
    # reduce-scattered in the plan's reduce dtype: fp32 for bf16, fp16 for fp16), fp16 with plait's loss
    # scaler agreed over the job; against the single-process reference in the same precision
    scale = {"PLAIT_LOSS_SCALE": "init=1024,growth_interval=2"}
    monkeypatch.setenv("PLAIT_LOSS_SCALE", scale["PLAIT_LOSS_SCALE"])  # the reference's scaler
    plan = f"dp=2,pp=2,micro_batch=2,layer_split=2:4,schedule=1f1b,zero={zero},global_batch=8,dtype={dtype}"
    assert engine_for(plan).engine == "torch"
    training = TrainingConfig(dtype=dtype, optimizer="adam", lr=1e-2)
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180, env=scale),
                 records=RecordsConfig(run_dir=tmp_path / "run"))
    low, params = reference_run(TINY, plan, STEPS, training=training)
    assert result.engine == "torch"
    assert all(abs(g - w) <= TOL[dtype] * abs(w) for g, w in zip(result.losses, low, strict=True)), (result.losses, low)
    # stage 0's units (the embedding, layers.0) gathered at 2 bytes an element, reduced at 4 (bf16) or 2 (fp16)
    numel = sum(v.numel() for n, v in params.items() if n.startswith(("embed.", "layers.0.")))
    records = read_comm_records(tmp_path / "run" / "comm" / "rank0.jsonl").records
    gathers, scatters = (2 * 2, 2) if zero == 3 else (1, 1)  # ZeRO-3: each of 2 micro-batches' forward and backward
    assert sum(r.bytes for r in records if r.op == "all_gather" and r.step == 1) == gathers * numel * 2
    assert sum(r.bytes for r in records if r.op == "reduce_scatter" and r.step == 1) == \
        scatters * numel * (4 if dtype == "bf16" else 2)
    if dtype == "fp16":
        assert result.loss_scales == [1024.0, 1024.0, 2048.0] and result.skipped_steps == []
    else:
        assert result.loss_scales == []


@pytest.mark.parametrize("zero, plan", [
    # 6 and 2 samples (3 and 1 micro-batches of 2) under torch's replicate
    (0, "pp=2,dp=2,tp=2,micro_batch=2,layer_split=2:4,dp_shares=0.75:0.25,schedule=1f1b,"),
    pytest.param(1, "pp=2,dp=2,tp=2,micro_batch=2,layer_split=2:4,schedule=gpipe,", marks=pytest.mark.slow),
    pytest.param(3, "pp=2,dp=2,tp=2,micro_batch=2,layer_split=2:4,schedule=1f1b,", marks=pytest.mark.slow),
])
def test_3d_pipeline_dp_tp_clipped_equals_one_process(zero, plan, tmp_path: Path) -> None:
    """The full 3D composition (issue 29), pp=2 x dp=2 x tp=2 on 8 ranks (rank = (stage * dp + d) * tp + t):
    DTensor TP inside each stage, then data parallelism over the stage's replicas -- torch's FSDP2-based
    replicate at ZeRO-0 (DDP takes no DTensor parameters: each unit all-reduces its whole local gradients
    over the mesh's recorded "dp" dim in the stage's last backward), FSDP2 at ZeRO-1 (each unit gathered
    and reduce-scattered once a step) and ZeRO-3 (gathered in every micro-batch's forward and backward,
    reduce-scattered every micro-batch); the tied embedding / LM head summed per (replica, tensor rank);
    global-norm clipping counting each element once over the job. With SGD and an lr schedule, at SGD's
    tolerance; every p2p action, tp all-reduce and dp gradient collective in the records."""
    plan += f"zero={zero}," + FP32
    assert engine_for(plan).engine == "torch"
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=0.05, lr_warmup_iters=1,
                              lr_decay_style="linear")
    result = _run(plan, training, run_dir=tmp_path / "run")
    _check_equal(result, reference_run(TINY, plan, STEPS, training=training), rel=0, atol=1e-6)
    p = Plan.parse(plan)
    shares = p.samples_per_replica()
    split = [["embed", "layers.0"], ["layers.1", "layers.2", "layers.3", "head"]]
    assert [(r.pp, r.dp, r.tp, r.samples_per_step, r.layers) for r in result.ranks] == \
        [(s, d, t, shares[d], split[s]) for s in range(2) for d in range(2) for t in range(2)]
    for r in result.ranks:
        records = read_comm_records(tmp_path / "run" / "comm" / f"rank{r.rank}.jsonl")
        stage_ranks = [4 * r.pp + 2 * d + t for d in range(2) for t in range(2)]
        assert records.groups["tp"] == [x for x in stage_ranks if x // 2 == r.rank // 2]
        assert records.groups["dp"] == [x for x in stage_ranks if x % 2 == r.tp]
        assert records.groups["tied s0-1"] == [2 * r.dp + r.tp, 4 + 2 * r.dp + r.tp]
        layers = len([n for n in split[r.pp] if n.startswith("layers.")])
        units = {f"layers.{i}" for i in range(4) if f"layers.{i}" in split[r.pp]} | {f"stage{r.pp}"}
        m = len(replica_micro_batches(p, 0, r.dp))
        for step in (1, 2):  # step 0 also runs torch's shape inference
            calls = [x for x in records.records if x.step == step and x.op == "all_reduce" and x.group == "tp"]
            assert Counter(x.name for x in calls) == {"allreduce tp fwd": 2 * layers * m,
                                                      "allreduce tp bwd": 2 * layers * m}
            assert all(x.bytes == 2 * 8 * 16 * 4 for x in calls)
            tied = [x for x in records.records if x.step == step and x.group == "tied s0-1"]
            # the embedding's gradient, whole under replicate, FSDP2's half-shard (its rows over dp) at ZeRO-1
            assert [(x.op, x.bytes) for x in tied] == [("all_reduce", 32 * 16 * 4 // (2 if zero else 1))]
            if zero == 0:  # replicate: one all-reduce per unit of the stage's whole local (tp-cut) gradients
                dp = [x for x in records.records if x.step == step and x.group == "dp" and x.op == "all_reduce"]
                assert len(dp) == len(units) and {x.name for x in dp} == {"allreduce dp bwd"}
                assert sum(x.bytes for x in dp) == 4 * r.params
            else:
                gathers, scatters = (1, 1) if zero < 3 else (2 * m, m)
                assert _zero_calls(tmp_path / "run", r.rank, step, "all_gather") == dict.fromkeys(units, gathers)
                assert _zero_calls(tmp_path / "run", r.rank, step, "reduce_scatter") == dict.fromkeys(units, scatters)
    _check_p2p_records(tmp_path / "run", plan)
