"""Composition of families (issue 17 item 1): pipeline stages that run SPMD programs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plait.ir.plan import Plan, PlanError, StageSpec

PROGRAM = {"version": 1, "ratios": [0.6, 0.4], "strategies": {"linear": [["S0", "R"], ["S0"], True]}}


def _plan(**stage0) -> Plan:
    first = {"name": "s0", "layers": ["l0"], "devices": [0, 1], "spmd": PROGRAM, **stage0}
    return Plan(pp=2, micro_batch=2, global_batch=8,
                stages=[StageSpec(**first), StageSpec("s1", ["l1"], [2])], stage_edges=[(0, 1)])


def test_stage_program_round_trips_typed():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[0].spmd.to_dict() == PROGRAM
    written = json.loads(plan.to_json())["stages"]  # format 2: every stage names its program's kind
    assert written[0]["program"] == {"kind": "spmd", **PROGRAM}
    assert written[1]["program"] == {"kind": "tensor_parallel", "dp": 1, "tp": 1}
    assert "spmd_stages=2" in str(plan)


def test_a_format_1_composed_plan_is_migrated():
    old = json.loads(_plan().to_json())
    old["format_version"] = 1
    old["stages"] = [{"name": "s0", "layers": ["l0"], "devices": [0, 1], "dp": 1, "tp": 1, "spmd": PROGRAM},
                     {"name": "s1", "layers": ["l1"], "devices": [2], "dp": 1, "tp": 1}]
    assert Plan.from_dict(old) == _plan()
    old["stages"][0]["dp"] = 2
    with pytest.raises(PlanError, match=r"stages\[0\].spmd': .*needs dp=tp=1"):
        Plan.from_dict(old)


def test_old_stage_plan_still_loads():
    old = {"format_version": 1, "dp": 1, "tp": 1, "pp": 2, "micro_batch": 2, "global_batch": 8,
           "stages": [{"name": "a", "layers": ["l0"], "devices": [0], "dp": 1, "tp": 1},
                      {"name": "b", "layers": ["l1"], "devices": [1], "dp": 1, "tp": 1}],
           "stage_edges": [[0, 1]]}
    plan = Plan.from_dict(old)
    assert all(st.spmd is None for st in plan.stages)


@pytest.mark.parametrize("change, message", [
    ({"devices": [0, 1, 3]}, "2 ratios for the stage's 3 devices"),
    ({"dp": 2}, "needs dp=tp=1"),
    ({"spmd": {**PROGRAM, "version": 9}}, "newer than this plait reads"),
    ({"spmd": {**PROGRAM, "strategies": {"linear": [["Q"], ["S0"], True]}}}, "stages[0].program'.strategies.linear"),
])
def test_bad_stage_program_is_refused_naming_the_field(change, message):
    with pytest.raises(PlanError, match="stages\\[(0|s0)\\]") as info:  # by index, or the stage's name
        _plan(**change)
    assert message in str(info.value)


def test_runtime_refuses_a_composed_plan_it_cannot_run_with_the_reason():
    from plait.runtime import supports

    ok, why = supports(_plan())  # stage 1 is a plain stage
    assert not ok and "stages[1].program" in why and "has no SPMD program" in why
    one = {"name": "s1", "layers": ["l1"], "devices": [2], "spmd": {**PROGRAM, "ratios": [1.0]}}
    plan = Plan(pp=2, micro_batch=2, global_batch=8, stages=[_plan().stages[0], StageSpec(**one)],
                stage_edges=[(0, 1)])
    assert supports(plan) == (True, "")
    ok, why = supports(Plan.from_dict({**plan.to_dict(), "schedule": "interleaved"}))
    assert not ok and "'schedule'" in why


# ---------------------------------------------------------------- simulation (hand-computed)
def _two_nodes_yaml(per_node: int) -> str:
    node = ("  - {{name: n{i}, gpus: [{{kind: a100-80gb, count: {g}}}], intra: {{type: nvlink, bandwidth: 100 GB/s, "
            "latency: 5 us}}, nic: {{type: ethernet, bandwidth: 10 Gb/s, latency: 25 us}}}}\n")
    return "name: two-nodes\nnodes:\n" + "".join(node.format(i=i, g=per_node) for i in range(2))


def _two_gpu_cluster(per_node: int = 1):
    from plait.cluster.loader import parse_yaml_text

    return parse_yaml_text(_two_nodes_yaml(per_node))


def _stage_programs(cluster, model: str, batch: int, split: list[list[str]], groups: list[list[int]]):
    from plait.cost.program import Problem, ProgramStage
    from plait.cost.spmd import Devices
    from plait.graph.aten_capture import capture_aten
    from plait.graph.aten_stage import stage_subgraph
    from plait.graph.zoo import load_model
    from plait.spmd.ratios import synthesize

    spec = load_model(model)
    inputs, _ = spec.sample_batch(batch)
    aten = capture_aten(spec.build(device="meta"), inputs, name=spec.name)
    out = []
    for s, (layers, ids) in enumerate(zip(split, groups)):
        problem = Problem.build(stage_subgraph(aten, layers), Devices.from_cluster(cluster, "fp32", ids))
        syn = synthesize(problem, dtype="fp32", segmented=False)
        out.append(ProgramStage(problem, syn.program, np.asarray(syn.ratios), name=f"s{s}"))
    return out


TINY = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128"
TINY_SPLIT = [["embed", "layers.0"], ["layers.1", "head"]]


@pytest.mark.parametrize("m, per_sample", [(2, 0.0), (1, 1000.0)])
def test_two_one_gpu_stages_match_1f1b_by_hand(m, per_sample):
    """pp=2, one GPU per stage, no fixed costs: 1F1B's timeline written out by hand. With m=2 the
    messages carry no bytes (two in flight would share the link: the engine's job, not this
    test's); with m=1 one message at a time crosses the 10 Gb/s link."""
    from plait.cost.compute import optimizer_time
    from plait.net.view import ClusterView
    from plait.sim.api import simulate_compose

    cluster = _two_gpu_cluster()
    stages = _stage_programs(cluster, TINY, 4, TINY_SPLIT, [[0], [1]])
    f = [float(sum(w[0] for w in s.problem.work)) / 3 for s in stages]  # forward = work / 3
    b = [2 * x for x in f]  # backward = 2 x forward
    bw, lat = ClusterView.from_cluster(cluster).pair(0, 1)
    t = lat + per_sample * 4 / bw  # one micro-batch of 4 samples, either way
    if m == 2:  # stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1
        s0_f1 = 2 * f[0]
        s1_b0 = f[0] + t + f[1] + b[1]
        s1_b1 = max(s1_b0, s0_f1 + t) + f[1] + b[1]
        s0_b0 = max(s0_f1, s1_b0 + t) + b[0]
        s0_b1 = max(s0_b0, s1_b1 + t) + b[0]
    else:
        s1_b1 = f[0] + t + f[1] + b[1]
        s0_b1 = s1_b1 + t + b[0]
    kind = cluster.devices[0].kind
    opt = [optimizer_time(float(sum(s.problem.graph.tensors[p].numel for p in s.problem.graph.params)), kind)
           for s in stages]
    expected = max(s0_b1 + opt[0], s1_b1 + opt[1])
    sim = simulate_compose(stages, [(0, 1)], {(0, 1): per_sample}, m, 4, cluster, fixed_costs=False)
    assert sim.iteration_time_s == pytest.approx(expected, rel=1e-9)


def test_stage_program_compute_is_its_ratio_of_the_work_per_micro_batch():
    """A stage on 2 GPUs: each GPU computes m x (its ratio of every split op + every redundant op)."""
    from plait.net.view import ClusterView
    from plait.sim.engine import simulate as run
    from plait.sim.lowering import lower_compose
    from plait.sim.lowering.spmd import op_ratios

    cluster = _two_gpu_cluster(per_node=2)
    stages = _stage_programs(cluster, TINY, 8, TINY_SPLIT, [[0, 1], [2, 3]])
    m = 3
    low = lower_compose(stages, [(0, 1)], {(0, 1): 512.0}, m, 8, ClusterView.from_cluster(cluster))
    sched = run(low.graph)
    tg = low.graph
    for s, st in enumerate(stages):
        share = op_ratios(st.problem, st.program, st.ratios, None)
        for r in low.reps[s]:
            dev = st.ids[r]
            busy = sum(sched.end[i] - sched.start[i] for i in range(len(tg))
                       if tg.device[i] == dev and tg.category[i] in ("forward", "backward"))
            work = sum(float(w[r]) * share[k, r] for k, w in enumerate(st.problem.work))
            assert busy == pytest.approx(m * work, rel=1e-9)
        comms = [i for i in range(len(tg)) if tg.resource[i] == f"stage{s}/comm" and tg.micro_batch[i] is not None
                 and tg.category[i] != "comm_pp"]
        per_mb = sum(1 for _, c in st.program.comms
                     if not (c.phase == "bwd" and c.op == "all_reduce"
                             and st.problem.graph.tensors[c.tensor].role == "param"))
        assert len(comms) == m * per_mb


# ---------------------------------------------------------------- the family in the driver
def test_driver_plans_composed_pipelines_the_runtime_runs():
    from plait.api import plan
    from plait.search import FAMILIES

    assert "compose" in FAMILIES
    cluster = _two_gpu_cluster(per_node=2)
    res = plan(TINY, cluster, global_batch=8, top=2, families="compose")
    best = res.best
    assert best.family == "compose" and len(best.plan.stages) == 2
    assert all(st.spmd is not None and len(st.devices) == 2 for st in best.plan.stages)
    assert sorted(d for st in best.plan.stages for d in st.devices) == [0, 1, 2, 3]
    assert best.iteration_time_s and best.iteration_time_s > 0 and best.peak_bytes
    assert best.unsupported == ""  # the runtime runs it (plait.runtime.compose_worker)
    again = type(best.plan).from_json(best.plan.to_json())
    assert again.stages[0].spmd == best.plan.stages[0].spmd


def test_compose_declines_with_a_reason():
    from plait.api import plan
    from plait.cluster import load_cluster
    from plait.errors import PlaitError
    from plait.planners.types import auto_dtype

    with pytest.raises(PlaitError, match="compose: .*one node of one GPU kind"):
        plan(TINY, load_cluster("a100-80g:nodes=1"), global_batch=8, families="compose")
    runs = plan(TINY, _two_gpu_cluster(per_node=2), global_batch=8, families="compose", runnable=True)
    # the cluster's dtype (the runtime runs composed plans in bf16 / fp16 too), runnable as planned
    assert runs.best.plan.dtype == auto_dtype(_two_gpu_cluster(per_node=2)) == "bf16" and runs.best.unsupported == ""
    res = plan(TINY, load_cluster("a100-80g:nodes=1"), global_batch=8, families="3d,compose", finalists=2)
    assert "one node of one GPU kind" in res.families["compose"]


# ---------------------------------------------------------------- the stage's op-level graph
def test_stage_subgraphs_cover_the_model_once_and_take_earlier_values_as_inputs():
    from plait.graph.aten_capture import capture_aten
    from plait.graph.aten_stage import shared_params, stage_subgraph
    from plait.graph.zoo import load_model
    from plait.ir.program import ShardingError

    spec = load_model(TINY)
    inputs, _ = spec.sample_batch(2)
    aten = capture_aten(spec.build(device="meta"), inputs, name=spec.name)
    subs = [stage_subgraph(aten, layers) for layers in TINY_SPLIT]
    assert [op.name for s in subs for op in s.ops] == [op.name for op in aten.ops]
    crossing = [t for t in subs[1].inputs if aten.tensors[t].producer is not None]
    assert crossing and set(crossing) <= set(subs[0].outputs)  # what stage 1 reads, stage 0 sends
    assert all(subs[1].tensors[t].role == "input" for t in crossing)
    assert subs[1].outputs == aten.outputs
    assert shared_params(aten, TINY_SPLIT) == ["p_embed_tok_weight"]  # GPT's tied embedding, read by the head
    with pytest.raises(ShardingError, match="made later"):
        stage_subgraph(aten, ["embed", "layers.1"])  # layers.1 reads layers.0, made after embed


def test_memory_model_activations_are_part_of_the_total():
    from plait.cost.memory import memory_model
    from plait.spmd.ratios import synthesize

    cluster = _two_gpu_cluster(per_node=2)
    st = _stage_programs(cluster, TINY, 8, TINY_SPLIT, [[0, 1], [2, 3]])[1]
    syn = synthesize(st.problem, dtype="fp32", segmented=False)
    mm = memory_model(st.problem, syn.program, "fp32")
    act = mm.activations_on(syn.ratios)
    assert np.all(act > 0) and np.all(act < mm.on(syn.ratios))


def test_simulate_takes_a_composed_plan_as_its_family_timed_it(tmp_path):
    """Issue 27: `simulate()` takes every plan. A composed plan written to a file and read back is
    replayed stage by stage (`plait.sim.replay.composed_stages`) to the iteration time and memory
    the compose family simulated for it."""
    from plait.api import plan
    from plait.cli import main
    from plait.cost.memory import FRAMEWORK_OVERHEAD_BYTES
    from plait.sim.api import SimulateError, simulate

    cluster = _two_gpu_cluster(per_node=2)
    best = plan(TINY, cluster, global_batch=8, top=1, families="compose").best
    path = tmp_path / "composed.json"
    best.plan.save(path)
    got = simulate(TINY, cluster, str(path))
    assert got.iteration_time_s == pytest.approx(best.iteration_time_s, rel=1e-9)
    assert got.memory_peak_bytes == best.peak_bytes and got.fits_memory is True
    assert got.world_size == 4 and got.granularity == "op"
    # the framework constant is a memory option as for every other plan (gpu_check leaves it out)
    bare = simulate(TINY, cluster, str(path), memory_options={"overhead_bytes": 0})
    assert [a - b for a, b in zip(got.memory_peak_bytes, bare.memory_peak_bytes)] == [FRAMEWORK_OVERHEAD_BYTES] * 4
    lacking = best.plan.to_dict()
    lacking["stages"][1]["program"]["strategies"].pop(next(iter(lacking["stages"][1]["program"]["strategies"])))
    with pytest.raises(SimulateError, match=r"plan field 'stages\[1\].program': op .*: no strategy"):
        simulate(TINY, cluster, type(best.plan).from_dict(lacking))
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(_two_nodes_yaml(2))
    assert main(["simulate", "--model", TINY, "--cluster", str(cluster_file), "--plan", str(path)]) == 0


# A slow node (2 x P100) and a fast one (2 x V100) joined by one 10 Gb/s NIC each. A BERT of
# short sequences and wide layers: 100M parameters (200 MB of fp16 gradients) against 131 KB of
# activations per sample. One program over all four GPUs all-reduces the gradients over the slow
# link; a pipeline with a stage per node sends activations only, in micro-batches few and large
# enough that the ops' host time and the per-message gathers do not dominate (here 2 of 16).
# Before (only 2 pp micro-batches, a compute-only ranking): 63.5 ms, slower than the 3D family's
# 40.4; now 32.5 ms, against 3D's 40.4 and one SPMD program's 82.9.
SLOW_FIRST = """
name: p100x2+v100x2-10g
nodes:
  - name: p
    gpus: [{kind: p100-16gb, count: 2}]
    intra: {type: pcie, bandwidth: 12 GB/s, latency: 5 us}
    nic: {type: ethernet, bandwidth: 10 Gb/s, latency: 25 us, count: 1}
  - name: v
    gpus: [{kind: v100-32gb, count: 2}]
    intra: {type: nvlink, bandwidth: 150 GB/s, latency: 2 us}
    nic: {type: ethernet, bandwidth: 10 Gb/s, latency: 25 us, count: 1}
"""


@pytest.mark.slow  # suite time (2026-12-08): the other composed-search tests here stay
def test_composed_pipeline_beats_every_single_family_across_a_slow_link():
    from plait.api import plan
    from plait.cluster import parse_yaml_text

    cluster = parse_yaml_text(SLOW_FIRST)
    res = plan("bert:layers=8,hidden=1024,heads=16,seq=64,vocab=1024", cluster, global_batch=32, top=1,
               families="3d,spmd,compose", progress=False)
    best = {n: r.best for n, r in res.families.items()}
    single = min(best["3d"].time_s, best["spmd"].time_s)
    comp = best["compose"]
    assert not comp.unsupported
    assert comp.time_s * 1.2 <= single, {n: c.time_s for n, c in best.items()}
    assert [sorted(s.devices) for s in sorted(comp.plan.stages, key=lambda s: s.devices)] == [[0, 1], [2, 3]]


def test_eager_1f1b_keeps_twice_the_warm_up_deadlock_free_and_only_composed_plans_take_it():
    from plait.cost.memory import composed_in_flight
    from plait.ir.plan import Plan
    from plait.runtime import supports
    from plait.schedule import PipelineGraph, build
    from plait.schedule.check import execute

    for pp, m in ((2, 1), (2, 5), (3, 4), (4, 8)):
        sched = build("eager_1f1b", PipelineGraph.chain(pp, m, 1, 2))
        execute(sched), execute(sched, rendezvous=True)  # raises on a deadlock
        for p in range(pp):
            ops = [a.op for a in sched.of(p) if a.op in ("fwd", "bwd")]
            assert ops.index("bwd") == min(m, 2 * (pp - p - 1) + 1)  # warm-up forwards, then the first 1F1B pair
            assert composed_in_flight("eager_1f1b", pp, m)[p] == min(m, 2 * (pp - p) - 1)
            assert composed_in_flight("1f1b", pp, m)[p] == min(m, pp - p)
    ok, why = supports(Plan(dp=1, pp=2, micro_batch=2, global_batch=8, schedule="eager_1f1b"))
    assert not ok and "eager_1f1b" in why and "composed" in why


def test_pipeline_estimate_times_have_the_launch_floor_of_a_group():
    """A stage of g GPUs runs a micro-batch's GPU work g times faster, but each GPU still launches
    every kernel: the estimate's layer time is max(whole / g, one GPU's host time); the split's
    is whole / g."""
    from plait.cluster import load_cluster
    from plait.cost.compute import layer_cost
    from plait.planners.types import load_graph
    from plait.search.compose_family import layer_times

    cluster = load_cluster("v100:nodes=1,gpus_per_node=4")
    _, graph = load_graph("bert:layers=2,hidden=256,heads=4,seq=64,vocab=512", "fp16")
    groups = [[0, 1, 2, 3]]
    split, floored = (layer_times(graph, groups, cluster, 4, "fp16", f) for f in (False, True))
    kind = cluster.devices[0].kind
    for i, layer in enumerate(graph.layers):
        c = layer_cost(layer, graph, 4, kind, "fp16")
        whole, host = c.fwd.compute_s + c.bwd.compute_s, c.fwd.host_s + c.bwd.host_s
        assert split[0, i] == pytest.approx(whole / 4)
        assert floored[0, i] == pytest.approx(max(whole / 4, host))
    assert (floored > split).any()  # this small model is launch-bound somewhere
