"""Issue 14 item 7: a synthesized SPMD program lowers into the one DAG simulator; a tiny program's
simulated time equals its DAG computed by hand, and gradient all-reduces overlap backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_spmd_collectives import two_nodes
from torch import nn

from plait.cost.collectives import choose_algorithm, collective_time
from plait.cost.compute import DEFAULT_MODEL, op_time, optimizer_time
from plait.cost.memory import memory_model
from plait.cost.program import Problem, Synthesis, evaluate
from plait.cost.spmd import Devices
from plait.graph.aten_capture import capture_aten
from plait.sim.api import SimResult, simulate_spmd


def data_parallel(problem: Problem, ratios: np.ndarray) -> Synthesis:
    graph = problem.graph
    choice = [next(i for i, s in enumerate(opts) if s.inputs and s.inputs[0] == "S0" and all(
        q == "R" for t, q in zip(op.inputs, s.inputs) if graph.tensors[t].role == "param"))
        for op, opts in zip(graph.ops, problem.options)]
    program = evaluate(problem, choice, ratios)
    memory = memory_model(problem, program).on(ratios)
    return Synthesis(program, ratios, program.cost, memory, capacity=problem.devices.memory)


def test_a_linear_layer_in_data_parallel_by_hand() -> None:
    """One linear op, batch split 3:1 over a V100 and a P100 of different nodes. The DAG: each
    rank's forward then backward (``r_i t_i`` and ``2 r_i t_i``), the weight's and then the bias's
    gradient all-reduce once both ranks are done (host cost + the cost module's time, one after
    the other on the communication stream), then each rank's optimizer step."""
    cluster = two_nodes(1)
    graph = capture_aten(nn.Linear(1024, 1024), (torch.randn(256, 1024),), name="linear")
    devices = Devices.from_cluster(cluster)
    problem = Problem.build(graph, devices)
    r = np.array([0.75, 0.25])
    syn = data_parallel(problem, r)
    result = simulate_spmd(problem, syn, cluster, bucket_bytes=None, batch=256, fixed_costs=False)
    assert isinstance(result, SimResult)
    op = graph.ops[0]
    out = graph.tensors[op.outputs[0]].nbytes
    t = [op_time(op.flops, out, k, "fp32") for k in devices.kinds]
    compute = max(3 * r[i] * t[i] for i in range(2))
    links = devices.links
    comms = 0.0
    for name in ("p_weight", "p_bias"):
        nbytes = graph.tensors[name].nbytes
        comms += DEFAULT_MODEL.host_comm_s + collective_time(
            "all_reduce", nbytes, links, choose_algorithm("all_reduce", nbytes, links))
    step = max(optimizer_time(1024 * 1024 + 1024, k) for k in devices.kinds)
    assert result.iteration_time_s == pytest.approx(compute + comms + step, rel=1e-9)
    assert result.world_size == 2 and result.fits_memory is True
    assert result.memory_peak_bytes == [int(x) for x in syn.memory]
    names = {e.name for e in result.timeline.events}
    assert {"fwd linear", "bwd linear", "optimizer step", "all_reduce p_weight (bwd)"} <= names


def test_zero3_storage_of_a_linear_layer_by_hand() -> None:
    """The same layer with its weight stored in even shards (`synthesize_stored`, ZeRO-3): the
    weight's all-gather before the forward (nothing to wait for: it starts at once), each rank's
    forward and backward at the LP's ratios, then the weight's reduce-scatter and the bias's
    all-reduce, then each rank steps half the weight and the whole bias."""
    from plait.cost.spmd import comm_seconds
    from plait.spmd.ratios import synthesize_stored

    cluster = two_nodes(1)
    graph = capture_aten(nn.Linear(1024, 1024), (torch.randn(256, 1024),), name="linear")
    devices = Devices.from_cluster(cluster)
    problem = Problem.build(graph, devices)
    base = data_parallel(problem, np.array([0.75, 0.25]))
    syn = synthesize_stored(problem, base, homes={"p_weight": "S0"})
    assert syn is not None and syn.program.homes == {"p_weight": "S0"}
    kinds = {(c.op, c.tensor, c.phase) for _, c in syn.program.comms}
    assert kinds == {("all_gather", "p_weight", "fwd"), ("reduce_scatter", "p_weight", "bwd"),
                     ("all_reduce", "p_bias", "bwd")}
    segs = syn.segments
    storage = segs.of_dim[("p_weight", 0)]
    assert storage in segs.even and np.allclose(syn.segment_ratios[storage], 0.5)
    r = syn.segment_ratios[segs.of_op[graph.ops[0].name]]
    result = simulate_spmd(problem, syn, cluster, bucket_bytes=None, batch=256, fixed_costs=False)
    op = graph.ops[0]
    out = graph.tensors[op.outputs[0]].nbytes
    t = [op_time(op.flops, out, k, "fp32") for k in devices.kinds]
    compute = max(3 * r[i] * t[i] for i in range(2))
    comms = sum(DEFAULT_MODEL.host_comm_s + comm_seconds(c, devices, np.full(2, 0.5) if c.tensor == "p_weight"
                                                         else r) for _, c in syn.program.comms)
    step = max(optimizer_time(1024 * 1024 / 2 + 1024, k) for k in devices.kinds)
    assert result.iteration_time_s == pytest.approx(compute + comms + step, rel=1e-9)
    # memory: the weight's state in halves, its gathered copy and gradient whole while in use
    w = 1024 * 1024
    assert syn.memory[0] - base.memory[0] == pytest.approx(-w * 16 / 2 + w * 8, rel=1e-9)


class Mlp(nn.Module):
    def __init__(self, layers: int = 4, h: int = 1024) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(h, h) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = torch.relu(fc(x))
        return x


def test_gradient_all_reduces_overlap_backward_and_buckets_pack_them() -> None:
    cluster = two_nodes(2, inter="100 Gb/s")
    graph = capture_aten(Mlp(), (torch.randn(2048, 1024),), name="mlp")
    problem = Problem.build(graph, Devices.from_cluster(cluster))
    syn = data_parallel(problem, np.full(4, 0.25))
    per_grad = simulate_spmd(problem, syn, cluster, bucket_bytes=None, fixed_costs=False)
    bucketed = simulate_spmd(problem, syn, cluster, bucket_bytes=8e6, fixed_costs=False)
    tl = per_grad.timeline
    first_ar = min(e.start for e in tl.events if e.name.startswith("all_reduce"))
    last_bwd = max(e.end for e in tl.events if e.category == "backward")
    assert first_ar < last_bwd  # the first layer's gradients reduce while earlier layers run backward
    serial = sum(e.end - e.start for e in tl.events if e.category in ("forward", "backward")
                 and e.device == 0) + sum(e.end - e.start for e in tl.events if e.name.startswith("all_reduce"))
    assert per_grad.iteration_time_s < serial
    n_ar = lambda res: sum(1 for e in res.timeline.events if e.name.startswith("all_reduce"))  # noqa: E731
    assert n_ar(bucketed) < n_ar(per_grad) == 8  # 4 weights + 4 biases, packed into fewer buckets
    # equal ranks of one kind are simulated once
    assert "2 of 4" in per_grad.symmetry


def test_overlap_aware_synthesis_keeps_what_the_simulator_ranks_first() -> None:
    from plait.ir.program import Comm
    from plait.spmd.ratios import synthesize_overlapped

    cluster = two_nodes(2, inter="10.4 Gb/s")
    graph = capture_aten(Mlp(layers=3, h=512), (torch.randn(1024, 512),), name="mlp")
    problem = Problem.build(graph, Devices.from_cluster(cluster))
    scores: dict[float, float] = {}

    def evaluate(p: Problem, syn: Synthesis) -> float:
        assert p is problem  # candidates are ranked on the problem as given
        return scores.setdefault(syn.overlap, simulate_spmd(p, syn, cluster).iteration_time_s)

    best = synthesize_overlapped(problem, evaluate, (1.0, 0.0), max_states=5000)
    assert set(scores) == {1.0, 0.0} and scores[best.overlap] == min(scores.values())
    hidden = Problem.build(graph, Devices.from_cluster(cluster), overlap=0.0)
    assert hidden.weight(Comm("all_reduce", "p_fcs_0_weight", 4, "bwd")) == 0.0
    assert hidden.weight(Comm("all_reduce", "relu", 4, "bwd")) == 1.0  # an activation's gradient blocks


def test_fixed_costs_are_the_compute_models_as_for_3d_plans() -> None:
    """With the compute model's fixed costs each rank pays at least the host's dispatch of every
    kernel, the batch fetch and the loss (plait.cost.compute), as the 3D lowering charges them."""
    from plait.cost.compute import DEFAULT_MODEL

    cluster = two_nodes(1)
    graph = capture_aten(nn.Linear(64, 64), (torch.randn(8, 64),), name="tiny")
    problem = Problem.build(graph, Devices.from_cluster(cluster))
    syn = data_parallel(problem, np.array([0.5, 0.5]))
    bare = simulate_spmd(problem, syn, cluster, bucket_bytes=None, fixed_costs=False).iteration_time_s
    full = simulate_spmd(problem, syn, cluster, bucket_bytes=None).iteration_time_s
    kernels = sum(1 for op in graph.ops if op.kind not in ("view", "t", "transpose"))
    m = DEFAULT_MODEL
    host_floor = kernels * (m.host_fwd_s + m.host_bwd_s) + m.batch_host_s + m.loss_host_s
    assert full - bare >= host_floor * 0.99


def test_plait_simulate_runs_an_spmd_plan_file(tmp_path, capsys) -> None:
    """`plait simulate --plan FILE` with `Plan.spmd` replays the program on the model's aten ops and
    lowers it like `simulate_spmd` (gradients one collective per tensor, as the runtime runs them);
    the table and --json show the same iteration time and per-GPU memory; a plan of another model
    is refused naming the op."""
    import json

    from plait.cli import main
    from plait.cluster import load_cluster
    from plait.graph.zoo import load_model
    from plait.spmd.program_plan import program_plan
    from plait.spmd.ratios import synthesize

    model, batch = "bert:layers=1,hidden=32,heads=2,seq=8,vocab=64", 8
    cluster = load_cluster("emulated-mixed")
    spec = load_model(model)
    graph = capture_aten(spec.build(device="meta"), spec.sample_batch(batch)[0], name=spec.name)
    problem = Problem.build(graph, Devices.from_cluster(cluster), collectives="padded")
    syn = synthesize(problem, max_states=2000)
    ratios = syn.segment_ratios if syn.segment_ratios is not None else syn.ratios
    path = tmp_path / "spmd.json"
    program_plan(syn.program.strategies, ratios, batch, model=model).save(path)
    want = simulate_spmd(problem, syn, cluster, bucket_bytes=None, batch=batch)
    assert main(["simulate", "--model", model, "--cluster", "emulated-mixed", "--plan", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["iteration_time_s"] == pytest.approx(want.iteration_time_s, rel=1e-9)
    assert got["memory_peak_bytes"] == want.memory_peak_bytes and got["fits_memory"] is True
    assert got["world_size"] == 4 and got["granularity"] == "op" and "spmd=" in got["plan"]
    assert main(["simulate", "--model", model, "--cluster", "emulated-mixed", "--plan", str(path)]) == 0
    assert f"{want.iteration_time_s * 1e3:.2f} ms" in capsys.readouterr().out
    other = "bert:layers=2,hidden=32,heads=2,seq=8,vocab=64"  # ops the plan has no strategy for
    assert main(["simulate", "--model", other, "--cluster", "emulated-mixed", "--plan", str(path)]) == 2
    assert "plan field 'spmd': op " in capsys.readouterr().err


def test_a_plan_with_stored_parameters_simulates_as_its_synthesis(tmp_path) -> None:
    """`Plan.spmd.homes` (ZeRO-3 storage) round-trips: `plait simulate --plan` replays the program
    with the parameters stored where the plan says, the same time and memory as the synthesis;
    a home that is not a placement is refused naming the field."""
    from plait.cluster import load_cluster
    from plait.cost.memory import FRAMEWORK_OVERHEAD_BYTES
    from plait.graph.zoo import load_model
    from plait.ir.plan import Plan, PlanError
    from plait.sim.api import simulate_spmd_plan
    from plait.spmd.program_plan import program_plan
    from plait.spmd.ratios import stored_homes, synthesize, synthesize_stored

    model, batch = "bert:layers=1,hidden=32,heads=2,seq=8,vocab=64", 8
    cluster = load_cluster("emulated-mixed")
    spec = load_model(model)
    graph = capture_aten(spec.build(device="meta"), spec.sample_batch(batch)[0], name=spec.name)
    problem = Problem.build(graph, Devices.from_cluster(cluster), collectives="padded")
    base = synthesize(problem, max_states=2000)
    homes = stored_homes(problem, base.program, min_numel=1, min_rows=1)
    syn = synthesize_stored(problem, base, homes=homes)
    assert syn is not None and syn.program.homes == homes
    path = tmp_path / "spmd.json"
    program_plan(syn.program.strategies, syn.segment_ratios, batch, model=model, homes=homes).save(path)
    assert Plan.load(path).spmd.homes == homes
    want = simulate_spmd(problem, syn, cluster, bucket_bytes=None, batch=batch)
    got = simulate_spmd_plan(model, cluster, str(path))
    assert got.iteration_time_s == pytest.approx(want.iteration_time_s, rel=1e-9)
    assert got.memory_peak_bytes == want.memory_peak_bytes
    bare = simulate_spmd_plan(model, cluster, str(path), memory_options={"overhead_bytes": 0})
    assert [a - b for a, b in zip(got.memory_peak_bytes, bare.memory_peak_bytes)] == \
        [FRAMEWORK_OVERHEAD_BYTES] * len(got.memory_peak_bytes)
    with pytest.raises(PlanError, match="homes"):
        program_plan(syn.program.strategies, syn.segment_ratios, batch, homes={next(iter(homes)): "P"}).validate()


@pytest.mark.parametrize("grad_dtype, size", [(None, 4), ("bf16", 2), ("fp32", 4)])
def test_parameter_gradients_are_priced_in_the_gradient_reduction_dtype(grad_dtype, size) -> None:
    """issue 30: a bf16 program's weights are captured in bf16, but its parameter gradients are
    all-reduced in the plan's gradient-reduction dtype -- fp32 by Megatron-LM's default for bf16,
    bf16 when the plan asks -- as the runtime's `RankProgram.grad_dtype` sends them."""
    graph = capture_aten(nn.Linear(64, 32).to(torch.bfloat16), (torch.randn(8, 64, dtype=torch.bfloat16),),
                         name="linear")
    problem = Problem.build(graph, Devices.from_cluster(two_nodes(1), "bf16"), grad_dtype=grad_dtype)
    syn = data_parallel(problem, np.array([0.5, 0.5]))
    grads = {c.tensor: c.nbytes for _, c in syn.program.comms if c.phase == "bwd"}
    assert grads == {"p_weight": 64 * 32 * size, "p_bias": 32 * size}
