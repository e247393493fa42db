"""Per-input fan-in (`StageSpec.segments`): a stage that holds one branch's last layer and the join
runs its own branch's part before the other branch's input arrives -- in the schedule, the
simulator and the runtime -- with the same numbers as one process (issue 13)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.ir.plan import Plan, PlanError, StageSpec
from plait.runtime import supports
from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run
from plait.schedule import PipelineGraph, execute, graph_1f1b

TWO_BRANCHES = '''
import torch
from torch import nn


class TwoBranches(nn.Module):
    """a0 -> a1 and b0 -> b1, joined in d (which also reads a0: a skip into the join)."""

    def __init__(self):
        super().__init__()
        self.a0, self.a1 = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b0, self.b1 = nn.Linear(5, 6), nn.Linear(6, 6)
        self.d = nn.Linear(6, 3)

    def forward(self, x, y):
        ha = torch.tanh(self.a0(x))
        hb = torch.tanh(self.b1(torch.tanh(self.b0(y))))
        return self.d(torch.tanh(self.a1(ha)) * hb + ha)


def sample_batch(batch, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y, t = (torch.randn(batch, n, generator=g) for n in (6, 5, 3))
    return (x.to(device), y.to(device)), t.to(device)


def make():
    return TwoBranches, sample_batch, torch.nn.functional.mse_loss
'''

TRAINING = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5)


def _plan() -> Plan:
    """Stage 2 holds a1 (after stage 0's a0) and the join d (after stage 1's b1, and a0's skip) as
    two segments, on 2 data-parallel replicas (its micro-batches dealt to them in turn); stage 1 cuts
    the batch coarser (4) than the others (2)."""
    stages = [StageSpec(name="a", layers=["a0"], devices=[0], micro_batch=2),
              StageSpec(name="b", layers=["b0", "b1"], devices=[1], micro_batch=4),
              StageSpec(name="join", layers=["a1", "d"], devices=[2, 3], dp=2, micro_batch=2, segments=[1, 1])]
    return Plan(stages=stages, stage_edges=[(0, 2), (1, 2)], micro_batch=2, global_batch=8, dtype="fp32")


def test_segments_are_checked() -> None:
    bad = dataclasses.replace(_plan())
    bad.stages[2] = dataclasses.replace(bad.stages[2], segments=[2, 1])
    with pytest.raises(PlanError, match=r"stages\[2\]\.segments"):
        bad.validate()
    assert "segments" not in _plan().stages[0].to_dict() and _plan().stages[2].to_dict()["segments"] == [1, 1]
    assert Plan.from_dict(_plan().to_dict()).stages[2].segments == [1, 1]


def test_graph_1f1b_runs_a_fan_in_stage_per_input() -> None:
    """Nodes: 0 = stage a, 1 = stage b, 2 = a1 (stage 2 chunk 0), 3 = the join (stage 2 chunk 1).
    The join stage forwards a1 before it waits for b's input, and its warm-up counts stages, not
    segments (the segments of one stage are one hop)."""
    g = PipelineGraph((*PipelineGraph.dag([[1] * 4, [1] * 4], []).nodes,
                       *(dataclasses.replace(n, stage=2, chunk=k) for k, n in enumerate(
                           PipelineGraph.dag([[1] * 4, [1] * 4], []).nodes))),
                      ((0, 2), (1, 3), (2, 3)))
    assert g.depth() == {0: 1, 1: 1, 2: 0, 3: 0}
    s = graph_1f1b(g)
    assert s.lines(2)[:5] == ["recv_fwd s2 c0 mb0 <- s0 c0 mb0", "fwd s2 c0 mb0",
                              "recv_fwd s2 c1 mb0 <- s1 c0 mb0", "fwd s2 c1 mb0", "bwd s2 c1 mb0"]
    assert s.lines(2)[5:7] == ["send_bwd s2 c1 mb0 -> s1 c0 mb0", "bwd s2 c0 mb0"]
    assert [a.key for a in s.compute(0)][:3] == ["fwd s0 c0 mb0", "fwd s0 c0 mb1", "bwd s0 c0 mb0"]
    execute(s)
    execute(s, rendezvous=True)


@pytest.mark.distributed
def test_fan_in_stage_per_input_on_4_ranks_equals_one_process(tmp_path) -> None:
    path = tmp_path / "two.py"
    path.write_text(TWO_BRANCHES)
    model, plan = f"{path}:make", _plan()
    assert supports(plan) == (True, "")
    ref_losses, ref_params = reference_run(model, plan, 2, training=TRAINING)
    result = run(model, None, plan, steps=2, training=TRAINING, launch=LaunchConfig(timeout=120),
                 records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None and set(result.params) == set(ref_params)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-6, msg=name)
    # once the headers are known, d's inputs are posted with a1's (early) and waited at d's forward
    batches = [e.args["batch"] for e in result.timeline.events if e.category == "comm_pp" and e.args.get("batch")]
    assert any(any(x.startswith("recv_fwd s2 c0 mb2 ") for x in b) and any(x.startswith("recv_fwd s2 c1 mb2 ") for x in b)
               for b in batches)


def _hand_graph():
    from plait.ir.opgraph import Layer, OpGraph

    layers = [Layer(name=n, kind="Linear", param_count=10, param_bytes=40, output_bytes=4.0)
              for n in ("a0", "b0", "a1", "d")]
    return OpGraph(model="two", layers=layers, activation_dtype_bytes=4,
                   layer_edges=[("a0", "a1"), ("b0", "d"), ("a1", "d")])


def test_stage_graph_chunks_a_per_input_stage_by_its_segments() -> None:
    """The join stage is two chunks: a1 fed by stage a, d fed by stage b and by a1 in memory; a
    segment that feeds an earlier one of its stage is refused, naming the field."""
    from plait.ir.stage_graph import StageGraphError, stage_graph

    stages = [StageSpec(name="a", layers=["a0"], devices=[0]), StageSpec(name="b", layers=["b0"], devices=[1]),
              StageSpec(name="join", layers=["a1", "d"], devices=[2], segments=[1, 1])]
    plan = Plan(stages=stages, stage_edges=[(0, 2), (1, 2)], micro_batch=1, global_batch=2, dtype="fp32")
    sg = stage_graph(plan, _hand_graph())
    assert [(c.stage, c.layers) for c in sg.chunks] == [(0, ["a0"]), (1, ["b0"]), (2, ["a1"]), (2, ["d"])]
    assert [(e.src, e.dst, [t.producer for t in e.tensors]) for e in sg.edges] == [
        (0, 2, ["a0"]), (1, 3, ["b0"]), (2, 3, ["a1"])]
    assert sg.stages[2].chunks == [2, 3]
    backwards = dataclasses.replace(plan, stages=[*stages[:2], dataclasses.replace(stages[2], layers=["d", "a1"])])
    with pytest.raises(StageGraphError, match=r"stages\[2\]\.segments"):
        stage_graph(backwards, _hand_graph())


@pytest.mark.parametrize("tf_a1, msg, per_input_ms, whole_ms, alphas", [
    (1e-3, 0.0, 13.5, 16.5, 2),  # zero-byte messages
    (5e-3, 1e7, 16.5, 22.5, 2),  # b0's output takes 1 ms more on the link, a1 runs 5 ms
])
def test_simulator_runs_the_join_stage_per_input_closed_form(tf_a1: float, msg: float, per_input_ms: float,
                                                              whole_ms: float, alphas: int) -> None:
    """One micro-batch, messages of a + bytes/B, no software overheads (as tests/test_sim_closed_form.py).
    Stage 0 runs a0 (1 ms fwd, 2 ms bwd), stage 1 the slow b0 (4, 8), stage 2 a1 (`tf_a1`, 2) and the
    join d (0.5, 1). Zero bytes: per input, a1 runs while b0 still computes; d starts at 4 + a, its
    backward ends at 5.5 + a and sends b0 its gradient at once, so b0 ends at 13.5 ms + 2a. Whole
    (the stage waits for both inputs, then a1 and d; its gradients leave after both backwards):
    16.5 ms + 2a. With b0's output 1 ms on the link and a1 at 5 ms: d's input is received while a1
    runs (posted with a1's, as the executor does), d runs at 6 + a (a1's end), its gradient leaves at
    7.5 + a and reaches b0 1 ms + a later: 16.5 + 2a; whole, the stage starts at 5 + a (b0's output
    in), ends its backward at 13.5 + a, b0 at 22.5 + 2a."""
    from plait.cluster.catalog import GPU_KINDS
    from plait.cost.compute import ComputeModel
    from plait.ir.opgraph import Layer, OpGraph
    from plait.net.view import ClusterView
    from plait.sim.api import simulate

    alpha = 5e-6
    zero = ComputeModel(host_fwd_s=0.0, host_bwd_s=0.0, host_comm_s=0.0, p2p_host_s=0.0, loss_host_s=0.0,
                        batch_host_s=0.0, step_host_s=0.0, optimizer_bytes_per_param=0.0, kernel_gpu_s=0.0)
    view = ClusterView.uniform(3, GPU_KINDS["a100-80gb"], 3, 10e9, alpha, inter_bandwidth=10e9, inter_latency=alpha)
    layers = [Layer(name=n, kind="Linear", param_count=10, param_bytes=40, output_bytes=msg if n == "b0" else 0.0)
              for n in ("a0", "b0", "a1", "d")]
    graph = OpGraph(model="two", layers=layers, activation_dtype_bytes=4,
                    layer_edges=[("a0", "a1"), ("b0", "d"), ("a1", "d")])
    times = {"a0": (1e-3, 2e-3), "b0": (4e-3, 8e-3), "a1": (tf_a1, 2e-3), "d": (0.5e-3, 1e-3)}
    stages = [StageSpec(name="a", layers=["a0"], devices=[0]), StageSpec(name="b", layers=["b0"], devices=[1]),
              StageSpec(name="join", layers=["a1", "d"], devices=[2], segments=[1, 1])]
    per_input = Plan(stages=stages, stage_edges=[(0, 2), (1, 2)], micro_batch=1, global_batch=1, dtype="fp32")
    whole = dataclasses.replace(per_input, stages=[dataclasses.replace(s, segments=None) for s in stages])
    t = {name: simulate(graph, view, plan, compute=zero, layer_times=times).iteration_time_s
         for name, plan in (("per_input", per_input), ("whole", whole))}
    barrier = t["whole"] - (whole_ms * 1e-3 + alphas * alpha)  # the gradient-norm all-reduce, the same in both
    assert 0 <= barrier < 10 * alpha
    assert t["per_input"] == pytest.approx(per_input_ms * 1e-3 + alphas * alpha + barrier, rel=1e-12)
