"""The one pipeline executor runs stage DAGs and interleaved 1F1B, equal to a single process,
with global gradient-norm clipping (--clip-grad) on.

Each run trains 2 steps with SGD (lr 0.5) so the parameters after each step differ from the
reference's by exactly the difference of the gradients (times lr): parameters within 1e-6
mean gradients within 2e-6, and the second step's loss checks the first step's update. The
clip norm is below the gradients' norm, so every step is clipped (checked on the reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.graph.zoo import load_model
from plait.ir.plan import Plan, PlanError, StageSpec
from plait.runtime import supports
from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run
from plait.runtime.layout import pipeline_layout, rank_actions
from plait.runtime.partition import RuntimeSetupError, layer_modules
from plait.schedule import PipelineGraph, graph_1f1b, interleaved_1f1b

pytestmark = pytest.mark.distributed

STEPS = 2
SGD = {"name": "sgd"}
CLIP = 0.05
TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"

DIAMOND = '''
import torch
from torch import nn


class Diamond(nn.Module):
    """a -> b, a -> c, b -> d, c -> d, and a skip a -> d (h and the input y reach d directly)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.d = nn.Linear(6, 3)

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        hb = torch.tanh(self.b(h))
        hc = torch.tanh(self.c(h * 0.5))
        return self.d(hb * hc + h) + y


def sample_batch(batch, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y, t = (torch.randn(batch, n, generator=g) for n in (6, 3, 3))
    return (x.to(device), y.to(device)), t.to(device)


def make():
    return Diamond, sample_batch, torch.nn.functional.mse_loss
'''


def _diamond_plan() -> Plan:
    # Stage b cuts the batch finer than its neighbours (micro-batches of 1), stage c coarser (4): their
    # inputs are split, their outputs concatenated. The sink d runs 2 data-parallel replicas (5 ranks):
    # its micro-batches are dealt to them in turn, so every edge into d, the skip edge a -> d too, feeds
    # both replicas, c's micro-batches are cut between them, and the replicas all-reduce d's gradients.
    mbs, dps = {"b": 1, "c": 4}, {"d": 2}
    devices = {"a": [0], "b": [1], "c": [2], "d": [3, 4]}
    stages = [StageSpec(name=n, layers=[n], devices=devices[n], dp=dps.get(n, 1), micro_batch=mbs.get(n))
              for n in "abcd"]
    return Plan(stages=stages, stage_edges=[(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)], micro_batch=2,
                global_batch=8, dtype="fp32")


TRAINING = TrainingConfig(optimizer=SGD, lr=0.5, clip_grad=CLIP)  # the same for run and its reference


def _reference(model: str, plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    ref_losses, ref_params = reference_run(model, plan, STEPS, training=TRAINING)
    unclipped = reference_run(model, plan, STEPS, training=dataclasses.replace(TRAINING, clip_grad=None))[1]
    initial = reference_run(model, plan, 0)[1]
    moved = [n for n in ref_params if not torch.equal(unclipped[n], initial[n])]
    assert moved and all(not torch.allclose(ref_params[n], unclipped[n], rtol=0, atol=1e-5)
                         for n in moved)  # clipping was active
    return ref_losses, ref_params


def _run(model: str, plan) -> object:
    return run(model, None, plan, steps=STEPS, training=TRAINING,
               launch=LaunchConfig(timeout=120), records=RecordsConfig(return_params=True))


def _check(result, ref_losses, ref_params) -> None:
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None
    assert set(ref_params) - set(result.params) <= {"head.lm.weight"}
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-6, msg=name)


def test_diamond_with_skip_edge_and_a_data_parallel_stage_on_5_ranks_equals_one_process(tmp_path) -> None:
    path = tmp_path / "diamond.py"
    path.write_text(DIAMOND)
    model, plan = f"{path}:make", _diamond_plan()
    assert supports(plan) == (True, "")
    ref_losses, ref_params = _reference(model, plan)
    result = _run(model, plan)
    _check(result, ref_losses, ref_params)
    assert [(r.layers, r.pp, r.dp, r.device, r.samples_per_step) for r in result.ranks] == [
        (["a"], 0, 0, 0, 8), (["b"], 1, 0, 1, 8), (["c"], 2, 0, 2, 8), (["d"], 3, 0, 3, 4), (["d"], 3, 1, 4, 4)]
    # Graph 1F1B: stage a's warm-up counts its longest path to the sink (a -> b -> d), stage b runs
    # twice as many (half-size) micro-batches, stage c half as many; d's replicas each run the
    # stage's micro-batches dealt to them (0, 2 and 1, 3) in the stage's order, with their own warm-up.
    sched = graph_1f1b(PipelineGraph.dag([[2] * 4, [1] * 8, [4] * 2, [2] * 4],
                                         [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)], [1, 1, 1, 2]))
    layout = pipeline_layout(plan)
    for r in result.ranks:
        measured = [e.name for e in sorted(result.timeline.events, key=lambda e: e.start)
                    if e.device == r.device and e.args.get("step") == 1 and e.category in ("forward", "backward")]
        assert measured == [a.key for a in rank_actions(sched, layout, r.pp, r.dp) if a.is_compute]
    assert [a.key for a in rank_actions(sched, layout, 3, 1) if a.is_compute] == [
        "fwd s3 c0 mb1", "bwd s3 c0 mb1", "fwd s3 c0 mb3", "bwd s3 c0 mb3"]
    batches = [x for e in result.timeline.events for x in e.args.get("batch", [])]
    # The skip edge carries messages a -> d directly, to the replica that owns each micro-batch ...
    assert "recv_fwd s3 c0 mb1 <- s0 c0 mb1" in batches and "send_fwd s0 c0 mb1 -> s3 c0 mb1" in batches
    # ... and c's micro-batch 0 (samples 0-3) is cut between d's micro-batches 0 and 1 on two ranks.
    assert {"send_fwd s2 c0 mb0 -> s3 c0 mb0", "send_fwd s2 c0 mb0 -> s3 c0 mb1"} <= set(batches)
    sends = [e for e in result.timeline.events if e.category == "comm_pp" and "send_fwd s2 c0 mb0 -> s3 c0 mb1"
             in e.args.get("batch", [])]
    assert sends and all(e.device == 2 for e in sends)


@pytest.mark.slow
def test_tied_weight_across_stages_of_different_data_parallel_degrees_with_zero1(tmp_path) -> None:
    # Stage d reuses stage a's weight; a runs 2 replicas, d one: the tied gradient is summed over all
    # three ranks that hold it and carried by a's replica 0 alone into a's ZeRO-1 reduce-scatter.
    path = tmp_path / "tied.py"
    path.write_text(DIAMOND.replace("self.d = nn.Linear(6, 3)", "self.d = nn.Linear(6, 6)\n        "
                                    "self.d.weight = self.a.weight")
                    .replace("return self.d(hb * hc + h) + y", "return self.d(hb * hc + h)[:, :3] + y"))
    mbs = {"b": 1, "c": 4}
    devices = {"a": [0, 1], "b": [2], "c": [3], "d": [4]}
    plan = Plan(stages=[StageSpec(name=n, layers=[n], devices=devices[n], dp=len(devices[n]),
                                  micro_batch=mbs.get(n)) for n in "abcd"],
                stage_edges=[(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)], micro_batch=2, global_batch=8, dtype="fp32",
                zero=1)
    model = f"{path}:make"
    ref_losses, ref_params = _reference(model, plan)
    _check(_run(model, plan), ref_losses, ref_params)


def test_interleaved_pp2_two_chunks_per_rank_with_data_parallel_equals_one_process() -> None:
    # dp=2 (ZeRO-0: replicas hold equal reduced gradients) x pp=2 x 2 chunks; GPT's tied embedding
    # lives in chunk 0 of rank 0 and chunk 1 of rank 1.
    plan = "dp=2,pp=2,virtual_stages=2,schedule=interleaved,micro_batch=1,global_batch=8,dtype=fp32"
    ref_losses, ref_params = _reference(TINY, plan)
    result = _run(TINY, plan)
    _check(result, ref_losses, ref_params)
    # Megatron's layout: rank 0 holds chunks 0 and 2 (embed+layer0, layer2), rank 1 chunks 1 and 3.
    firsts = [r for r in result.ranks if r.dp == 0]
    assert [r.layers for r in firsts] == [["embed", "layers.0", "layers.2"], ["layers.1", "layers.3", "head"]]
    sched = interleaved_1f1b(PipelineGraph.chain(2, 4, virtual_stages=2))
    for r in firsts:
        measured = [(e.name, e.chunk) for e in sorted(result.timeline.events, key=lambda e: e.start)
                    if e.device == r.device and e.args.get("step") == 1 and e.category in ("forward", "backward")]
        assert measured == [(a.key, a.chunk) for a in sched.compute(r.pp)]


def test_clip_grad_over_tensor_shards_zero3_and_uneven_replicas() -> None:
    # Tensor shards sum, tensor-replicated parameters count once, ZeRO shards are disjoint, and the
    # replicas' shares of the batch differ (5 and 3 samples). ZeRO-1/2 clip their flat shards with the
    # same GradClipper.clip_flat (tests/test_runtime_units.py checks it in one process).
    plan = "dp=2,tp=2,zero=3,micro_batch=2,global_batch=8,dp_shares=0.625:0.375,dtype=fp32"
    ref_losses, ref_params = _reference(TINY, plan)
    _check(_run(TINY, plan), ref_losses, ref_params)


def test_supports_states_what_the_runtime_refuses() -> None:
    from plait.runtime.api import _check_plan

    # Data-parallel stages of any degree run; a tensor-parallel stage does not (yet), and says so.
    dp = Plan(stages=[StageSpec(name="a", layers=["a"], devices=[0, 1], dp=2), StageSpec(name="b", layers=["b"],
                                                                                    devices=[2])],
              stage_edges=[(0, 1)], global_batch=4)
    assert supports(dp) == (True, "")
    bad = Plan(stages=[StageSpec(name="a", layers=["a"], devices=[0, 1], tp=2), StageSpec(name="b", layers=["b"],
                                                                                     devices=[2])],
               stage_edges=[(0, 1)], global_batch=4)
    ok, reason = supports(bad)
    assert not ok and "stages[0].tp" in reason and "tp=2" in reason
    with pytest.raises(RuntimeSetupError, match=r"stages\[0\]\.tp"):
        _check_plan(bad)
    # A cyclic stage graph is not even a Plan (Plan.validate names the field), so it never reaches the runtime.
    with pytest.raises(PlanError, match=r"plan field 'stage_edges': the stage graph has a cycle"):
        Plan(stages=[StageSpec(name=n, layers=[n], devices=[i]) for i, n in enumerate("abc")],
             stage_edges=[(0, 1), (1, 2), (2, 1)], global_batch=4)
    # a chain pipeline's ZeRO-3 runs on the torch engine (FSDP2 per stage, issue 29); a stage graph's nowhere
    assert supports("pp=2,zero=3,global_batch=4") == (True, "")
    ok, reason = supports(Plan(stages=dp.stages, stage_edges=[(0, 1)], global_batch=4, zero=3))
    assert not ok and "'zero'" in reason
    uneven = "dp=2,pp=2,virtual_stages=2,schedule=interleaved,micro_batch=1,global_batch=8,dp_shares=0.625:0.375"
    ok, reason = supports(uneven)
    assert not ok and "replica 0 runs 5 micro-batches" in reason
    assert supports("pp=2,virtual_stages=2,schedule=interleaved,micro_batch=1,global_batch=4") == (True, "")


def test_zoo_multi_branch_model_as_a_stage_graph_with_a_coarser_head() -> None:
    # MMT: two transformer branches (one per input, each stage reads its input itself) merged by a head
    # stage that runs micro-batches of 4 while the branches run 2: the head joins two branch pieces along
    # their batch dimension, which for these [seq, batch, hidden] tensors is dim 1 (found by ShapeProp).
    model = "mmt:branches=2,layers=2,hidden=16,heads=2,seq=4,in_dim=8,dropout=0,attn_dropout=0"
    names = [n for n, _ in layer_modules(load_model(model).build())]
    branches = [[n for n in names if n.startswith(f"branches.{i}.")] for i in range(2)]
    stages = [StageSpec(name=f"branch{i}", layers=branches[i], devices=[i]) for i in range(2)]
    stages.append(StageSpec(name="head", layers=["head"], devices=[2], micro_batch=4))
    plan = Plan(stages=stages, stage_edges=[(0, 2), (1, 2)], micro_batch=2, global_batch=8, dtype="fp32")
    ref_losses, ref_params = _reference(model, plan)
    result = _run(model, plan)
    _check(result, ref_losses, ref_params)
    recv = [x for e in result.timeline.events if e.category == "comm_pp" and e.args.get("step") == 0
            for x in e.args["batch"] if x.startswith("recv_fwd s2 c0 mb0")]
    assert sorted(set(recv)) == [f"recv_fwd s2 c0 mb0 <- s{s} c0 mb{j}" for s in (0, 1) for j in (0, 1)]
