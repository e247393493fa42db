"""Composed plans run (issue 17 item 1): a 2-stage pipeline whose stages each run an SPMD program on
2 gloo ranks at uneven ratios, by 1F1B over 2 micro-batches, with the global gradient norm clipped,
equals one process (fp32); the last stage computes the loss on its batch shards of the logits.

The plan comes from the composed family's own search (`plait.search`, family "compose") on two
2-GPU nodes; its stage ratios are set uneven (0.7:0.3 and 0.3:0.7), so the shards, the uneven
collectives inside each stage and the k = 2 rank pairs that carry each boundary value are all
exercised. The tiny GPT ties its embedding to its head across the two stages."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from plait.ir.plan import Plan
from plait.runtime import supports

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128,dropout=0,attn_dropout=0"
STEPS = 2
MICRO_BATCH = 8  # the last stage's program then shards the logits on the batch: the loss per shard
CLIP = 0.05  # below every step's gradient norm: the global norm over both stages' shards is clipped


RATIOS = ([0.7, 0.3], [0.3, 0.7])


@functools.cache
def _composed() -> tuple[Plan, list, object]:
    """The composed family's plan on two 2-GPU nodes (its layer split and stage groups), with stage
    programs that shard at uneven ratios: plait.spmd's beam search on devices a million times slower
    than a V100 (as test_spmd_program: the tiny model's ops then outweigh the link latency and the
    search shards them; the family's own programs keep this tiny model replicated). Returns the
    plan, the stage programs (`plait.cost.program.ProgramStage`) and the cluster."""
    import numpy as np
    from test_compose import _two_gpu_cluster
    from test_spmd_program import synthesized_problem

    from plait.api import plan
    from plait.cost.program import Problem, ProgramStage
    from plait.cost.spmd import Devices
    from plait.graph.aten_capture import capture_aten
    from plait.graph.aten_stage import stage_subgraph
    from plait.graph.zoo import load_model
    from plait.spmd.program_plan import program_plan
    from plait.spmd.search import beam_search

    cluster = _two_gpu_cluster(per_node=2)
    best = plan(TINY, cluster, global_batch=8, top=1, families="compose").best.plan
    best = dataclasses.replace(best, micro_batch=MICRO_BATCH, global_batch=2 * MICRO_BATCH)
    spec = load_model(TINY)
    inputs, _ = spec.sample_batch(best.micro_batch)
    aten = capture_aten(spec.build(device="meta"), inputs, name=spec.name)
    stages, programs = [], []
    for st, ratios in zip(best.stages, RATIOS):
        sub = stage_subgraph(aten, st.layers)
        program = beam_search(synthesized_problem(sub), ratios, width=16)
        stages.append(dataclasses.replace(st, micro_batch=MICRO_BATCH,
                                          spmd=program_plan(program.strategies, ratios, MICRO_BATCH).spmd))
        problem = Problem.build(sub, Devices.from_cluster(cluster, "fp32", st.devices))
        programs.append(ProgramStage(problem, program, np.asarray(ratios)))
    return dataclasses.replace(best, stages=stages, dtype="fp32"), programs, cluster


def _composed_plan() -> Plan:
    return _composed()[0]


def test_composed_plan_runs_equal_to_one_process() -> None:
    from plait.graph.aten_stage import batch_loss_output
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    plan, programs, cluster = _composed()
    assert plan.num_micro_batches == 2 and [len(s.devices) for s in plan.stages] == [2, 2]
    last = programs[-1]
    assert batch_loss_output(last.problem.graph, last.program.strategies) == "linear_8"  # no logits gather
    assert supports(plan) == (True, "")
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=CLIP)
    ref_losses, ref_params = reference_run(TINY, plan, STEPS, training=training)
    unclipped = reference_run(TINY, plan, STEPS, training=dataclasses.replace(training, clip_grad=None))[1]
    assert not torch.allclose(unclipped["layers.0.mlp.fc1.weight"], ref_params["layers.0.mlp.fc1.weight"],
                              rtol=0, atol=1e-4)  # the clipping acts
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=120),
                 records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-5)
    assert result.params is not None and set(result.params) <= set(ref_params)
    tied = {"head.lm.weight", "embed.tok.weight"}  # one tensor under two names: one is returned
    assert len(set(ref_params) - set(result.params)) == 1 and set(ref_params) - set(result.params) <= tied
    assert torch.equal(ref_params["head.lm.weight"], ref_params["embed.tok.weight"])
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=name)
    # rank 0's data-parallel gradient all-reduces ran once per step (accumulated over the 4
    # micro-batches, one bucket), as the simulator prices them
    assert result.spmd is not None and result.spmd["moves"].get("bwd P->R") == STEPS, result.spmd
    _check_simulator_models_the_run(result, plan, programs, cluster)


def _check_simulator_models_the_run(result, plan: Plan, programs: list, cluster) -> None:
    """Prediction and execution are one truth: per stage, the collectives the simulator lowers for
    one iteration (`plait.sim.lowering.lower_compose`) are the ones the stage's first rank ran in step 1 --
    the program's own (per micro-batch, plus one bucket of parameter gradients), the all-gather of
    each received message, the tied gradient's gather / all-reduce / broadcast -- and the k = 2 pair
    messages of each boundary value."""
    from collections import Counter

    from plait.net.view import ClusterView
    from plait.sim.lowering import lower_compose

    tied = [(0, 1, float(128 * 64 * 4))]  # GPT's tied embedding / head (vocab x hidden, fp32)
    low = lower_compose(programs, [(0, 1)], {(0, 1): 16 * 64 * 4.0}, plan.num_micro_batches, plan.micro_batch,
                        ClusterView.from_cluster(cluster), tied=tied)
    tg = low.graph
    for s, first in ((0, 0), (1, 2)):
        ran = Counter()
        for e in result.timeline.events:
            if e.device == first and e.args.get("step") == 1 and e.category.startswith("comm") \
                    and e.name not in ("gather parameters", "allreduce grad-norm", "allreduce loss"):  # not priced
                kind = "spmd" if e.category == "comm_spmd" else "tied" if "tied" in e.name else \
                    "gather" if e.name.startswith("gather") else e.name.split()[0]
                ran[kind] += 1
        predicted = Counter()
        for k in range(len(tg)):
            name = tg.name[k]
            if "tied" in name:  # "... tied gradients s0+s1": run by both stages' first ranks
                predicted["tied"] += f"s{s}" in name.split()[-1].split("+")
                continue
            if tg.stage[k] != s or not tg.category[k].startswith("comm"):
                continue
            kind = "gather" if name.startswith("gather") else name.split()[0] if tg.category[k] == "comm_pp" \
                else "spmd"
            predicted[kind] += 1
            if kind in ("send_fwd", "send_bwd"):
                assert tg.args[k]["copies"] == 2  # k = min(2, 2) rank pairs
        # the simulator files a message under its sender's stage, the runtime under each end's rank
        ran.pop("recv_fwd", None), ran.pop("recv_bwd", None)
        assert ran == predicted, (s, ran, predicted)


def test_composed_plan_refusals_name_the_field() -> None:
    plan = _composed_plan()
    graph = dataclasses.replace(plan, stage_edges=[])
    ok, why = supports(graph)
    assert not ok and "stage_edges" in why
    ok, why = supports(dataclasses.replace(plan, zero=1))
    assert not ok and "'zero'" in why
    # checkpoints and bf16/fp16 are no longer refused: test_composed_plan_checkpoints_and_resumes_...
    # and tests/test_program_precision.py run them


@pytest.mark.slow
def test_one_device_stage_feeding_a_two_device_stage_equals_one_process() -> None:
    """k = min(1, 2) = 1: the one-device stage sends each boundary value whole to the next stage's
    first rank, which shares it by a grouped all-gather (one broadcast per piece); the gradient goes
    back from that rank alone."""
    import numpy as np
    from test_compose import TINY_SPLIT, _two_gpu_cluster
    from test_spmd_program import synthesized_problem

    from plait.cost.program import Problem
    from plait.cost.spmd import Devices
    from plait.graph.aten_capture import capture_aten
    from plait.graph.aten_stage import stage_subgraph
    from plait.graph.zoo import load_model
    from plait.ir.plan import StageSpec
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run
    from plait.spmd.program_plan import program_plan
    from plait.spmd.search import beam_search

    spec = load_model(TINY)
    inputs, _ = spec.sample_batch(2)
    aten = capture_aten(spec.build(device="meta"), inputs, name=spec.name)
    first = stage_subgraph(aten, TINY_SPLIT[0])
    alone = Problem.build(first, Devices.from_cluster(_two_gpu_cluster(per_node=2), "fp32", [0]))
    one = program_plan(beam_search(alone, [1.0], width=4).strategies, [1.0], 2).spmd
    two = program_plan(beam_search(synthesized_problem(stage_subgraph(aten, TINY_SPLIT[1])), [0.3, 0.7],
                                   width=16).strategies, [0.3, 0.7], 2).spmd
    plan = Plan(pp=2, micro_batch=2, global_batch=8, dtype="fp32", stage_edges=[(0, 1)],
                stages=[StageSpec("s0", TINY_SPLIT[0], [0], spmd=one), StageSpec("s1", TINY_SPLIT[1], [1, 2], spmd=two)])
    assert supports(plan) == (True, "") and np.isclose(sum(two.ratios), 1.0)
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5)
    ref_losses, ref_params = reference_run(TINY, plan, STEPS, training=training)
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180),
                 records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-5)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_eager_1f1b_composed_plan_equals_one_process() -> None:
    """Eager 1F1B (the composed family's schedule over slow links): stage 0 of 2 runs all 3
    forwards before its first backward (1F1B: f0 f1 b0 f2 b1 b2); the run equals one process."""
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run
    from plait.runtime.compose_worker import composed_schedule

    plan = dataclasses.replace(_composed_plan(), global_batch=3 * MICRO_BATCH, schedule="eager_1f1b")
    order = [(a.op, a.micro_batch) for a in composed_schedule(plan, plan.schedule).of(0) if a.op in ("fwd", "bwd")]
    assert order == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("bwd", 1), ("bwd", 2)]
    assert supports(plan) == (True, "")
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5, clip_grad=CLIP)
    ref_losses, ref_params = reference_run(TINY, plan, STEPS, training=training)
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=180),
                 records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow  # suite time (2026-12-08): test_composed_plan_runs_equal_to_one_process keeps the run, tests/test_runtime_dcp.py the resume
def test_composed_plan_checkpoints_and_resumes_under_itself(tmp_path) -> None:
    """A composed run saved after step 2 of 4 resumes under the same plan, equal to the
    uninterrupted run (under a 3D plan: test_composed_checkpoint_resumes_under_a_3d_plan)."""
    from plait.runtime.api import CheckpointConfig, LaunchConfig, TrainingConfig, reference_run, run

    plan = _composed_plan()
    training = TrainingConfig(optimizer={"name": "adam"}, lr=1e-2, clip_grad=CLIP)
    ref, _ = reference_run(TINY, plan, 4, training=training)
    root = tmp_path / "ck"
    launch = LaunchConfig(timeout=120)
    first = run(TINY, None, plan, steps=2, training=training, checkpoint=CheckpointConfig(dir=root, every=2),
                launch=launch)
    assert first.losses == pytest.approx(ref[:2], rel=0, abs=1e-5)
    assert (root / "step-00000002").is_dir()
    same = run(TINY, None, plan, steps=4, training=training, checkpoint=CheckpointConfig(dir=root, resume=True),
               launch=launch)
    assert same.steps == [2, 3] and same.losses == pytest.approx(ref[2:], rel=0, abs=1e-5)


@pytest.mark.slow  # suite time: the composed checkpoint's resume under itself stays in make test (above)
def test_composed_checkpoint_resumes_under_a_3d_plan(tmp_path) -> None:
    """A composed run saved after step 2 of 4 resumes under a 3D plan of the model (DCP reshards the
    stage programs' shards; the tied embedding written once), equal to the uninterrupted run."""
    from plait.runtime.api import CheckpointConfig, LaunchConfig, TrainingConfig, reference_run, run

    plan = _composed_plan()
    training = TrainingConfig(optimizer={"name": "adam"}, lr=1e-2, clip_grad=CLIP)
    ref, _ = reference_run(TINY, plan, 4, training=training)
    root, launch = tmp_path / "ck", LaunchConfig(timeout=120)
    run(TINY, None, plan, steps=2, training=training, checkpoint=CheckpointConfig(dir=root, every=2), launch=launch)
    other = run(TINY, None, f"pp=2,micro_batch={MICRO_BATCH},global_batch={2 * MICRO_BATCH},dtype=fp32", steps=4,
                training=training, checkpoint=CheckpointConfig(dir=root, resume=True), launch=launch)
    assert other.steps == [2, 3] and other.losses == pytest.approx(ref[2:], rel=0, abs=1e-5)


@pytest.mark.slow  # suite time: the composed checkpoint stays in make test (test_composed_plan_checkpoints_and_resumes_under_itself...)
def test_composed_plan_resumes_another_plans_checkpoint(tmp_path) -> None:
    """The other way round: a 3D pipeline's checkpoint after step 2 resumes into the composed plan,
    and that one's checkpoint after step 3 into the composed plan at other ratios (each stage's
    program resharded 0.3:0.7 / 0.7:0.3), each equal to the uninterrupted run."""
    from plait.runtime.api import CheckpointConfig, LaunchConfig, TrainingConfig, reference_run, run

    plan = _composed_plan()
    swapped = dataclasses.replace(plan, stages=[
        dataclasses.replace(st, spmd=dataclasses.replace(st.spmd, ratios=list(reversed(ratios))))
        for st, ratios in zip(plan.stages, RATIOS)])
    assert supports(swapped) == (True, "")
    training = TrainingConfig(optimizer={"name": "adam"}, lr=1e-2, clip_grad=CLIP)
    ref, _ = reference_run(TINY, plan, 4, training=training)
    root, launch = tmp_path / "ck", LaunchConfig(timeout=120)
    three_d = f"pp=2,micro_batch={MICRO_BATCH},global_batch={2 * MICRO_BATCH},dtype=fp32"
    first = run(TINY, None, three_d, steps=2, training=training, checkpoint=CheckpointConfig(dir=root, every=2),
                launch=launch)
    assert first.losses == pytest.approx(ref[:2], rel=0, abs=1e-5)
    composed = run(TINY, None, plan, steps=3, training=training,
                   checkpoint=CheckpointConfig(dir=root, every=1, resume=True), launch=launch)
    assert composed.steps == [2] and composed.losses == pytest.approx(ref[2:3], rel=0, abs=1e-5)
    other = run(TINY, None, swapped, steps=4, training=training, checkpoint=CheckpointConfig(dir=root, resume=True),
                launch=launch)
    assert other.steps == [3] and other.losses == pytest.approx(ref[3:], rel=0, abs=1e-5)
