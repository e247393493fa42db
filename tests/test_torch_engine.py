"""The torch engine (issue 29, `plait.runtime.torch_worker`): data-parallel and ZeRO-3 plans run
on torch's DDP and FSDP2 by default and train equal to one process (losses and parameters after
3 steps, the tolerances of tests/test_runtime_forms.py), uneven shares included, with every
collective of torch's modules in the rank's comm records and timeline."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from plait.ir.comm import read_comm_records
from plait.runtime import engine_for
from plait.runtime.api import (
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    RunResult,
    TrainingConfig,
    reference_run,
    run,
)

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
STEPS = 3
FP32 = "global_batch=8,dtype=fp32"


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_run(TINY, "dp=1,micro_batch=8," + FP32, STEPS)


def _run(plan: str, tmp_path) -> RunResult:
    return run(TINY, None, plan, steps=STEPS, launch=LaunchConfig(timeout=120),
               records=RecordsConfig(return_params=True, run_dir=tmp_path / "run"))


def _check_equal(result: RunResult, reference: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    ref_losses, ref_params = reference
    assert result.engine == "torch"
    assert result.steps == list(range(STEPS))
    assert result.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert result.params is not None
    # a tied tensor is returned under each of its names, as one process returns it
    assert set(result.params) == set(ref_params)
    torch.testing.assert_close(result.params["head.lm.weight"], result.params["embed.tok.weight"])
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=2e-6, msg=name)


def _calls(result: RunResult, rank: int, op: str) -> list:
    assert result.run_dir is not None
    records = read_comm_records(f"{result.run_dir}/comm/rank{rank}.jsonl").records
    return [r for r in records if r.op == op and r.step is not None]


def _calls_any(result: RunResult, rank: int) -> list:
    assert result.run_dir is not None
    return [r for r in read_comm_records(f"{result.run_dir}/comm/rank{rank}.jsonl").records if r.step is not None]


def _spans(result: RunResult, rank: int, step: int) -> Counter:
    return Counter(e.category for e in result.timeline.events if e.args.get("rank") == rank
                   and e.args.get("step") == step)


@pytest.mark.parametrize("shares", ["", "dp_shares=0.75:0.25,"])
def test_ddp_equals_one_process(shares, reference, tmp_path) -> None:
    result = _run(f"dp=2,micro_batch=2,{shares}grad_bucket_mb=0.01," + FP32, tmp_path)
    _check_equal(result, reference)
    numel = sum(v.numel() for n, v in reference[1].items() if n != "head.lm.weight")
    counts = [[4, 4], [6, 2]][bool(shares)]
    assert [r.samples_per_step for r in result.ranks] == counts
    for rank in (0, 1):
        # DDP reduces once per step, in the last micro-batch's backward: every fp32 gradient once,
        # in buckets started as they fill and recorded at their completion
        for step in range(STEPS):
            calls = [r for r in _calls(result, rank, "all_reduce") if r.step == step and "bucket" in r.name]
            assert sum(r.bytes for r in calls) == 4 * numel
            assert all(r.t_enqueue <= r.t_start <= r.t_end for r in calls)
            spans = _spans(result, rank, step)
            assert spans["forward"] == spans["backward"] == counts[rank] // 2
            assert spans["comm_dp"] == len(calls) and spans["optimizer"] == 1
    # after DDP's first step the plan's buckets (10 kB) apply: several per step
    assert len([r for r in _calls(result, 0, "all_reduce") if r.step == 1 and "bucket" in r.name]) > 1


# suite time: the even case to the slow set (the uneven one runs every path it does)
@pytest.mark.parametrize("shares", [pytest.param("", marks=pytest.mark.slow), "dp_shares=0.75:0.25,"])
def test_zero3_on_fsdp2_equals_one_process(shares, reference, tmp_path) -> None:
    result = _run(f"dp=2,micro_batch=2,zero=3,{shares}" + FP32, tmp_path)
    _check_equal(result, reference)
    counts = [[4, 4], [6, 2]][bool(shares)]
    units = 4 + 1  # the transformer blocks, then the root (the tied embedding and LM head, the norms)
    for rank in (0, 1):
        for step in range(STEPS):
            gathers = [r for r in _calls(result, rank, "all_gather") if r.step == step]
            scatters = [r for r in _calls(result, rank, "reduce_scatter") if r.step == step]
            # each unit (the root too: ZeRO-3 reshards it after forward as well) gathers its parameters
            # in every forward and again in every backward; a replica with fewer micro-batches joins the
            # others' gathers with ghost ones. Gradients are reduce-scattered every micro-batch (ZeRO-3).
            rounds = max(counts) // 2
            assert len(gathers) == rounds * 2 * units
            assert len(scatters) == rounds * units and {r.key for r in scatters} == \
                {f"reduce_scatter zero {n}" for n in ["layers.0", "layers.1", "layers.2", "layers.3", "root"]}
            spans = _spans(result, rank, step)
            assert spans["forward"] == spans["backward"] == counts[rank] // 2
            assert spans["ghost"] == 2 * (rounds - counts[rank] // 2)
            assert spans["comm_zero"] == len(gathers) + len(scatters)
    # the ranks hold about half the parameters each between steps
    full = sum(v.numel() * 4 for n, v in reference[1].items() if n != "head.lm.weight")
    assert result.run_dir is not None
    ranks = json.loads(Path(result.run_dir, "result.json").read_text())["ranks"]
    assert all(0.4 * full < r["param_bytes"] < 0.6 * full for r in ranks)


@pytest.mark.parametrize("zero, shares", [(1, "dp_shares=0.75:0.25,"), pytest.param(2, "", marks=pytest.mark.slow)])
def test_zero12_on_fsdp2_equals_one_process(zero, shares, reference, tmp_path) -> None:
    """ZeRO-1/2 on FSDP2 (parameters kept gathered from the first forward to the last backward of a
    step, gradients accumulated whole and reduce-scattered once, in the last micro-batch's backward;
    optimizer state sharded): each unit gathers and reduce-scatters once a step on every replica,
    whatever its micro-batch count (no ghost micro-batches), as plait's own ZeRO-1/2 step reduces once."""
    result = _run(f"dp=2,micro_batch=2,zero={zero},{shares}" + FP32, tmp_path)
    _check_equal(result, reference)
    counts = [[4, 4], [6, 2]][bool(shares)]
    units = 4 + 1
    for rank in (0, 1):
        for step in range(STEPS):
            gathers = [r for r in _calls(result, rank, "all_gather") if r.step == step]
            scatters = [r for r in _calls(result, rank, "reduce_scatter") if r.step == step]
            assert len(gathers) == len(scatters) == units
            spans = _spans(result, rank, step)
            assert spans["forward"] == spans["backward"] == counts[rank] // 2 and spans["ghost"] == 0
    # between steps each rank holds about half the parameters (FSDP2 reshards after the last backward)
    full = sum(v.numel() * 4 for n, v in reference[1].items() if n != "head.lm.weight")
    assert result.run_dir is not None
    ranks = json.loads(Path(result.run_dir, "result.json").read_text())["ranks"]
    assert all(0.4 * full < r["param_bytes"] < 0.6 * full for r in ranks)


def test_tensor_parallel_on_dtensor_equals_one_process(reference, tmp_path) -> None:
    """By default a tp=2 plan runs with torch's ColwiseParallel / RowwiseParallel on the transformer
    layers, every collective DTensor issues recorded through the facade (`recorded_pg`): one record
    per call, with t_end at its completion, and its span."""
    plan = "tp=2,micro_batch=4," + FP32
    assert engine_for(plan).engine == "torch" and engine_for(plan).not_torch == ""
    result = _run(plan, tmp_path)
    _check_equal(result, reference)
    assert [(r.dp, r.tp) for r in result.ranks] == [(0, 0), (0, 1)]
    # each tensor rank holds half of every transformer linear's weight, the rest (embedding, norms) whole
    full = sum(v.numel() for n, v in reference[1].items() if n != "head.lm.weight")
    linears = sum(v.numel() for n, v in reference[1].items() if n.startswith("layers.") and ".ln" not in n
                  and not (n.endswith(".bias") and ("proj" in n or "fc2" in n)))
    assert result.ranks[0].params == result.ranks[1].params == full - linears // 2
    # Megatron's count: per layer and micro-batch (2 a step) the row-parallel attention projection and
    # fc2 all-reduce their outputs in forward, the column-parallel QKV and fc1 their inputs' gradients
    # in backward; each a [4, 8, 16] fp32 activation. Nothing else crosses the tp group in a step.
    for rank in (0, 1):
        for step in range(STEPS):
            calls = [r for r in _calls(result, rank, "all_reduce") if r.step == step]
            assert all(r.group == "tp" and r.key == "all_reduce tp" and r.bytes == 4 * 8 * 16 * 4 for r in calls)
            assert Counter(r.name for r in calls) == {"allreduce tp fwd": 2 * 4 * 2, "allreduce tp bwd": 2 * 4 * 2}
            others = {(r.op, r.group) for r in _calls_any(result, rank) if r.step == step and r.key != "probe"}
            assert others == {("all_reduce", "tp"), ("barrier", "world")}
            assert all(r.t_enqueue <= r.t_start <= r.t_end and r.injected_s == 0 for r in calls)
            assert _spans(result, rank, step)["comm_tp"] == len(calls)


def _tp_local_numel(params: dict[str, torch.Tensor]) -> int:
    """Elements a tensor rank of tp=2 holds: the transformer linears' weights and column biases halved."""
    full = sum(v.numel() for n, v in params.items() if n != "head.lm.weight")
    linears = sum(v.numel() for n, v in params.items() if n.startswith("layers.") and ".ln" not in n
                  and not (n.endswith(".bias") and ("proj" in n or "fc2" in n)))
    return full - linears // 2


def _check_dp_tp_calls(result: RunResult, rank: int, step: int, micro_batches: int) -> list:
    """A dp=2 x tp=2 rank's step: DTensor's tp all-reduces as the tp=2 test counts them, per micro-batch
    of its replica; returns its records on the dp group."""
    calls = [r for r in _calls_any(result, rank) if r.step == step and r.key != "probe"]
    tp = [r for r in calls if r.group == "tp"]
    assert all(r.op == "all_reduce" and r.bytes == 2 * 8 * 16 * 4 for r in tp)  # a [2, 8, 16] activation
    assert Counter(r.name for r in tp) == {"allreduce tp fwd": 2 * 4 * micro_batches,
                                           "allreduce tp bwd": 2 * 4 * micro_batches}
    assert _spans(result, rank, step)["comm_tp"] == len(tp)
    return [r for r in calls if r.group == "dp"]


def test_dp_x_tp_zero0_on_replicate_clipped_equals_one_process(tmp_path) -> None:
    """dp=2 x tp=2 at ZeRO-0 with uneven shares (6 and 2 samples) and global-norm clipping (issue 29):
    DTensor's TP inside each replica, torch's FSDP2-based `replicate` across them (DDP fails on DTensor
    parameters). Each unit (4 blocks, the root) all-reduces its whole local gradients once a step, in
    the last micro-batch's backward, on the mesh's recorded "dp" group; the clipping norm is one
    all-reduce over the world (tp-replicated parameters and replicas counted once)."""
    plan = "dp=2,tp=2,micro_batch=2,dp_shares=0.75:0.25," + FP32
    assert engine_for(plan).engine == "torch"
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=0.05)
    reference = reference_run(TINY, plan, STEPS, training=training)
    unclipped = reference_run(TINY, plan, STEPS, training=dataclasses.replace(training, clip_grad=None))[1]
    assert all(not torch.allclose(reference[1][n], unclipped[n], rtol=0, atol=1e-5) for n in unclipped)
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=120),
                 records=RecordsConfig(return_params=True, run_dir=tmp_path / "run"))
    _check_equal(result, reference)
    assert [(r.dp, r.tp, r.samples_per_step) for r in result.ranks] == [(0, 0, 6), (0, 1, 6), (1, 0, 2), (1, 1, 2)]
    local = _tp_local_numel(reference[1])
    assert all(r.params == local for r in result.ranks)
    for rank in range(4):
        for step in range(STEPS):
            dp = _check_dp_tp_calls(result, rank, step, [3, 1][rank // 2])
            assert len(dp) == 4 + 1 and all(r.op == "all_reduce" and r.name == "allreduce dp bwd" for r in dp)
            assert sum(r.bytes for r in dp) == 4 * local  # every local fp32 gradient once
            norm = [r for r in _calls(result, rank, "all_reduce") if r.step == step and r.group == "world"]
            assert [r.name for r in norm] == ["allreduce grad-norm"]
            assert _spans(result, rank, step)["comm_dp"] == len(dp) + 1


@pytest.mark.slow  # suite time: FSDP2 over DTensor at ZeRO-1 stays in make test under SP and in bf16
def test_dp_x_tp_zero1_on_fsdp2_over_dtensor_equals_one_process(reference, tmp_path) -> None:
    """dp=2 x tp=2 at ZeRO-1 with uneven shares (issue 29): FSDP2 over the DTensor-TP model (2D
    parameters, torchtitan's FSDP + TP); each unit gathers and reduce-scatters its tp shard once a step
    on every replica whatever its micro-batch count, through the facade's dp group."""
    result = _run("dp=2,tp=2,zero=1,micro_batch=2,dp_shares=0.75:0.25," + FP32, tmp_path)
    _check_equal(result, reference)
    assert [(r.dp, r.tp, r.samples_per_step) for r in result.ranks] == [(0, 0, 6), (0, 1, 6), (1, 0, 2), (1, 1, 2)]
    local = _tp_local_numel(reference[1])
    units = ["layers.0", "layers.1", "layers.2", "layers.3", "root"]
    for rank in range(4):
        for step in range(STEPS):
            dp = _check_dp_tp_calls(result, rank, step, [3, 1][rank // 2])
            assert sorted(r.key for r in dp) == sorted([f"all_gather zero {u}" for u in units] +
                                                       [f"reduce_scatter zero {u}" for u in units])
            assert sum(r.bytes for r in dp if r.op == "reduce_scatter") == 4 * local
            assert _spans(result, rank, step)["comm_zero"] == len(dp)
    # between steps each rank holds half its tensor rank's parameters
    assert result.run_dir is not None
    ranks = json.loads(Path(result.run_dir, "result.json").read_text())["ranks"]
    assert all(r["param_bytes"] == 4 * local // 2 for r in ranks)


@pytest.mark.slow  # suite time: SP at pp=1 stays in make test beside dp (ZeRO-1), and inside pipeline stages
def test_sequence_parallelism_on_dtensor_equals_one_process(reference, tmp_path) -> None:
    """sequence_parallel=true runs on torch's styles (`SequenceParallel` layer norms, an all-gather
    before each column region, `RowwiseParallel(output_layouts=Shard(0))`: the zoo's [s, b, h]) and
    trains as one process; every all-reduce of a layer becomes an all-gather or a reduce-scatter."""
    plan = "tp=2,sequence_parallel=true,micro_batch=4," + FP32
    assert engine_for(plan).engine == "torch" and engine_for(plan).not_torch == ""
    result = _run(plan, tmp_path)
    _check_equal(result, reference)
    full = [4 * 8 * 16 * 4]  # a micro-batch's whole [s=8, b=4, h=16] fp32 activation (gathered / scattered)
    norms = 4 * 4 * 16 * 4  # 4 layers x (ln1, ln2) x (weight, bias) x h, fp32
    # Megatron's count per layer and micro-batch (4 layers, 2 micro-batches a step): forward all-gathers
    # the attention's and the MLP's input and reduce-scatters attn.proj's and fc2's output, backward
    # the reverse; the region is entered once a micro-batch (its backward all-gathers the input's
    # gradient) and left once (its forward all-gathers the last layer's output); the layer norms'
    # gradients are summed once a step (the row biases' come out whole: DTensor computes them from the
    # all-gathered output gradient; plait's own engine adds them on the shard and sums them too).
    # No other all-reduce, and nothing else crosses the tp group.
    per = 4 * 2 * 2
    want = {("all_gather", "allgather tp fwd"): per + 2, ("reduce_scatter", "reducescatter tp fwd"): per,
            ("reduce_scatter", "reducescatter tp bwd"): per, ("all_gather", "allgather tp bwd"): per + 2,
            ("all_reduce", "allreduce tp sp-grads"): 1}
    for rank in (0, 1):
        for step in range(STEPS):
            calls = [r for r in _calls_any(result, rank) if r.step == step and r.group == "tp"]
            assert Counter((r.op, r.name) for r in calls) == want
            assert {r.bytes for r in calls if r.op != "all_reduce"} == set(full)
            assert [r.bytes for r in calls if r.op == "all_reduce"] == [norms]
            others = {(r.op, r.group) for r in _calls_any(result, rank) if r.step == step and r.key != "probe"
                      and r.group != "tp"}
            assert others == {("barrier", "world")}
            assert _spans(result, rank, step)["comm_tp"] == len(calls)


@pytest.mark.parametrize("zero", [1, pytest.param(0, marks=pytest.mark.slow),  # suite time
                                  pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_sequence_parallelism_under_dp_x_tp_equals_one_process(reference, tmp_path, zero: int) -> None:
    """sequence_parallel=true at dp=2 x tp=2 with uneven shares (6 and 2 samples; issue 29): FSDP2
    (ZeRO-1/2/3) or torch's `replicate` (ZeRO-0) over the sequence-parallel DTensor model. The tp calls
    are the dp=1 count per micro-batch of the replica; the layer norms' `Partial` gradients are summed
    over tp by FSDP2's / replicate's own reduction, one all-reduce per norm parameter a step (4 layers
    x 2 norms x weight and bias, 16 floats each; at ZeRO-3 per micro-batch, ghosts included), so none
    is left for `_sum_partial_grads`."""
    plan = f"dp=2,tp=2,zero={zero},sequence_parallel=true,micro_batch=2,dp_shares=0.75:0.25," + FP32
    assert engine_for(plan).engine == "torch" and engine_for(plan).not_torch == ""
    result = _run(plan, tmp_path)
    _check_equal(result, reference)
    local = _tp_local_numel(reference[1])
    for rank in range(4):
        # the micro-batches the replica runs: its own (3 or 1, of 2 samples); at ZeRO-3 ghosts of one
        # sample up to the most any replica runs (FSDP2 gathers and reduce-scatters per micro-batch)
        sizes = [2] * [3, 1][rank // 2] + ([1] * (3 - [3, 1][rank // 2]) if zero == 3 else [])
        want: Counter = Counter()
        for size in sizes:  # per micro-batch: 4 layers x 2 regions, one more gather at the head
            act = size * 8 * 16 * 4  # its whole [s=8, b, h=16] fp32 activation
            want.update({("all_gather", "allgather tp fwd", act): 9, ("reduce_scatter", "reducescatter tp fwd", act): 8,
                         ("reduce_scatter", "reducescatter tp bwd", act): 8, ("all_gather", "allgather tp bwd", act): 9})
        reductions = len(sizes) if zero == 3 else 1  # FSDP2 / replicate reduce once a step, ZeRO-3 per micro-batch
        want[("all_reduce", "allreduce tp bwd", 16 * 4)] = 16 * reductions
        for step in range(STEPS):
            calls = [r for r in _calls_any(result, rank) if r.step == step and r.key != "probe"]
            assert Counter((r.op, r.name, r.bytes) for r in calls if r.group == "tp") == want
            dp = [r for r in calls if r.group == "dp"]
            if zero:
                assert {r.op for r in dp} == {"all_gather", "reduce_scatter"}
                assert sum(r.bytes for r in dp if r.op == "reduce_scatter") == 4 * local * reductions
            else:
                assert {r.op for r in dp} == {"all_reduce"} and sum(r.bytes for r in dp) == 4 * local


def test_sequence_parallelism_inside_pipeline_stages_equals_one_process(reference, tmp_path) -> None:
    """sequence_parallel=true at pp=2 x tp=2 (1F1B, embedding + 1 layer | 3 layers + head): torch's
    styles inside each torch pipeline stage, one region across the pipeline's cut (plait's own engine's
    and Megatron's layout): the boundary values are each tensor rank's part of the sequence, sent to
    tensor rank t of the next stage, and trains as one process. Counted by hand per micro-batch (4 a
    step) and stage: each layer's two regions all-gather their input and reduce-scatter their output
    forward, the reverse backward; the first stage enters the region (backward all-gathers the input's
    gradient), the last leaves it (forward all-gathers the last layer's output); no stage boundary
    gathers; each stage's layer norms' `Partial` gradients summed once a step."""
    plan = "pp=2,tp=2,sequence_parallel=true,micro_batch=2,layer_split=2:4,schedule=1f1b," + FP32
    assert engine_for(plan).engine == "torch" and engine_for(plan).not_torch == ""
    result = _run(plan, tmp_path)
    _check_equal(result, reference)
    act = 2 * 8 * 16 * 4  # a micro-batch's whole [s=8, b=2, h=16] fp32 activation
    for rank, layers in ((0, 1), (1, 1), (2, 3), (3, 3)):  # rank = stage * tp + t
        first = rank < 2
        want = {("all_gather", "allgather tp fwd", act): 4 * (2 * layers + (not first)),
                ("reduce_scatter", "reducescatter tp fwd", act): 4 * 2 * layers,
                ("reduce_scatter", "reducescatter tp bwd", act): 4 * 2 * layers,
                ("all_gather", "allgather tp bwd", act): 4 * (2 * layers + first),
                ("all_reduce", "allreduce tp sp-grads", layers * 4 * 16 * 4): 1}
        for step in range(STEPS):
            calls = [r for r in _calls_any(result, rank) if r.step == step and r.key != "probe"]
            tp = Counter((r.op, r.name, r.bytes) for r in calls if r.group == "tp")
            if step == 0:  # torch's one-time setup: one more forward of each stage (its output
                # shapes), one more backward of the last stage's layers (no gradient kept: all equal)
                tp.subtract({("all_gather", "allgather tp fwd", act): 2 * layers + (not first),
                             ("reduce_scatter", "reducescatter tp fwd", act): 2 * layers,
                             ("all_gather", "allgather tp bwd", act): 0 if first else 2 * layers,
                             ("reduce_scatter", "reducescatter tp bwd", act): 0 if first else 2 * layers})
            assert tp == want
            p2p = [r for r in calls if r.op in ("send", "recv")]
            assert len(p2p) == 8 and {r.bytes for r in p2p} == {act // 2}  # this rank's half of the sequence
            assert {r.group for r in p2p} == ({f"p2p {rank}->{rank + 2}", f"p2p {rank + 2}->{rank}"} if first
                                              else {f"p2p {rank - 2}->{rank}", f"p2p {rank}->{rank - 2}"})


@pytest.mark.slow  # suite time: 8 ranks; SP inside pipeline stages at dp=1 stays in make test
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_sequence_parallelism_in_the_3d_grid_equals_one_process(reference, tmp_path, zero: int) -> None:
    """dp=2 x pp=2 x tp=2 with sequence parallelism inside the stages, uneven shares (6 and 2 samples):
    torch's replicate (ZeRO-0) or FSDP2 (ZeRO-1; ZeRO-3, the lighter replica's pipeline running ghost
    micro-batches) over each stage's sequence-parallel DTensor modules, trains as one process; each
    rank sends its half of the sequence and its tensor group gathers and scatters, never all-reduces
    a layer's activations."""
    plan = (f"dp=2,pp=2,tp=2,zero={zero},sequence_parallel=true,micro_batch=2,layer_split=2:4,schedule=1f1b,"
            "dp_shares=0.75:0.25," + FP32)
    assert engine_for(plan).engine == "torch" and engine_for(plan).not_torch == ""
    result = _run(plan, tmp_path)
    _check_equal(result, reference)
    act = 2 * 8 * 16 * 4  # a micro-batch's whole [s=8, b=2, h=16] fp32 activation
    for rank in range(8):
        calls = [r for r in _calls_any(result, rank) if r.step == 1 and r.key != "probe"]
        tp = {(r.op, r.bytes) for r in calls if r.group == "tp" and r.name != "allreduce tp bwd"}
        assert {("all_gather", act), ("reduce_scatter", act)} <= tp <= {
            ("all_gather", act), ("reduce_scatter", act), ("all_gather", act // 2), ("reduce_scatter", act // 2)}
        # a ghost's half sequence is one sample's
        assert {r.bytes for r in calls if r.op in ("send", "recv")} <= {act // 2, act // 4}


def test_a_slow_link_slows_dtensor_collectives_and_the_doctor_names_it(tmp_path) -> None:
    """A link fault between the two tensor ranks (from step 3) delays every DTensor collective of
    the tp group (recorded: injected_s, and t_end - t_enqueue holds it); the doctor reads the run and
    names the link and its onset, nothing else."""
    from plait.doctor import diagnose

    # 7 steps: a lone pair is named after 4 slow probes in a row (doctor.Thresholds.lone_link_min_hits)
    result = run(TINY, None, "tp=2,micro_batch=4," + FP32, steps=7, launch=LaunchConfig(timeout=120),
                 records=RecordsConfig(run_dir=tmp_path / "run", probe_every=1),
                 faults=FaultsConfig(inject="link:ranks=0-1,delay=30ms,from=3"))
    assert result.engine == "torch"
    for rank in (0, 1):
        calls = [r for r in _calls(result, rank, "all_reduce") if r.group == "tp"]
        assert len(calls) == 7 * 32
        for r in calls:
            assert (r.injected_s >= 0.02 and r.t_end - r.t_enqueue >= 0.02) if r.step >= 3 else r.injected_s == 0
    assert result.run_dir is not None
    d = diagnose(Path(result.run_dir))
    assert [(f.kind, f.ranks, f.step) for f in d.findings] == [("slow_link", (0, 1), 3)], d.findings
