"""Hand-built DAGs whose iteration time has a closed form; the simulator must match it exactly.

Layer times are given (`SimOptions.layer_times`) and every software overhead of the
compute model is zero, so the only costs are the given layer times and the alpha-beta
communication on a hand-built two-GPU cluster (bandwidth B, latency a)."""

from __future__ import annotations

import math

import pytest

from plait.cluster.catalog import GPU_KINDS
from plait.cost.compute import ComputeModel
from plait.ir.opgraph import Layer, OpGraph, TiedParams
from plait.ir.plan import Plan
from plait.net.view import ClusterView
from plait.sim.api import simulate

B = 10e9  # bytes/s
ALPHA = 5e-6
ZERO = ComputeModel(host_fwd_s=0.0, host_bwd_s=0.0, host_comm_s=0.0, p2p_host_s=0.0, loss_host_s=0.0,
                    batch_host_s=0.0, step_host_s=0.0, optimizer_bytes_per_param=0.0, kernel_gpu_s=0.0)


def two_gpus(gpus_per_node: int = 2) -> ClusterView:
    return ClusterView.uniform(2, GPU_KINDS["a100-80gb"], gpus_per_node, B, ALPHA, inter_bandwidth=B,
                               inter_latency=ALPHA)


def chain(params: list[int], out_bytes: float = 0.0) -> OpGraph:
    layers = [Layer(name=f"l{i}", kind="Linear", param_count=p, param_bytes=4 * p, output_bytes=out_bytes)
              for i, p in enumerate(params)]
    # output bytes are given in fp32, the plans' dtype (pipeline messages scale by plan/capture dtype)
    return OpGraph(model="chain", layers=layers, activation_dtype_bytes=4,
                   layer_edges=[(a.name, b.name) for a, b in zip(layers, layers[1:])])


@pytest.mark.parametrize("tb1", [0.5e-3, 4e-3])
def test_two_layers_wfbp_overlap(tb1: float) -> None:
    """Data parallelism on 2 GPUs, one gradient bucket per layer (Shi et al. 2018, WFBP):
    bucket 2 (the last layer) reduces while layer 1 runs backward, and
    comm_start_1 = max(comm_end_2, bwd_end_1)."""
    tf1, tf2, tb2 = 1e-3, 2e-3, 3e-3
    p1, p2 = 5_000_000, 3_000_000  # parameters; gradients reduced in fp32 (4 bytes)
    graph = chain([p1, p2])
    times = {"l0": (tf1, tb1), "l1": (tf2, tb2)}
    res = simulate(graph, two_gpus(), Plan(dp=2, micro_batch=1, global_batch=2, dtype="fp32",
                                               grad_bucket_mb=1e-6),
                   compute=ZERO, layer_times=times, overlap_grad_reduce=True, granularity="layer")

    def ring(nbytes: float) -> float:  # 2-rank ring all-reduce: 2(n-1)a + 2(n-1)/n M/B
        return 2 * ALPHA + nbytes / B

    bwd_end_2 = tf1 + tf2 + tb2
    comm_end_2 = bwd_end_2 + ring(4 * p2)
    bwd_end_1 = bwd_end_2 + tb1
    comm_end_1 = max(comm_end_2, bwd_end_1) + ring(4 * p1)
    barrier = 2 * math.ceil(math.log2(2)) * ALPHA  # gradient-norm all-reduce before the step
    assert res.iteration_time_s == pytest.approx(comm_end_1 + barrier, rel=1e-12)
    # The overlap is real: without buckets the reduction starts after the whole backward.
    whole = simulate(graph, two_gpus(), Plan(dp=2, micro_batch=1, global_batch=2, dtype="fp32"),
                     compute=ZERO, layer_times=times)
    assert whole.iteration_time_s == pytest.approx(bwd_end_1 + ring(4 * (p1 + p2)) + barrier, rel=1e-12)
    assert res.iteration_time_s < whole.iteration_time_s


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("msg", [0.0, 4e6])
def test_two_stage_1f1b(m: int, msg: float) -> None:
    """2-stage 1F1B (Megatron's blocking send/recv) with per-stage t_f, t_b and a transfer of
    t_c = a + msg/B per activation or gradient. Stage 1 runs F_i B_i, and the exchange of
    act_{i+1} and grad_i overlaps, so every period is t_f + t_b + t_c:
    T = (m + pp - 1)(t_f + t_b + t_c) for pp = 2 (Pipette's (gas//pp)(pp_comm + pp(t_f+t_b))
    + (pp-1)(t_f+t_b) when t_c = 0), plus the gradient-norm barrier."""
    tf, tb = 1e-3, 2e-3
    graph = chain([1000, 1000], out_bytes=msg)
    times = {"l0": (tf, tb), "l1": (tf, tb)}
    res = simulate(graph, two_gpus(), Plan(pp=2, micro_batch=1, global_batch=m, dtype="fp32"),
                   compute=ZERO, layer_times=times)
    tc = ALPHA + msg / B
    expected = (m + 1) * (tf + tb + tc) + 2 * ALPHA
    assert res.iteration_time_s == pytest.approx(expected, rel=1e-12)


def test_gpipe_two_stages_no_comm() -> None:
    """GPipe, no communication cost: T = (m + pp - 1)(t_f + t_b) as for 1F1B."""
    tf, tb, m = 1e-3, 2e-3, 4
    view = ClusterView.uniform(2, GPU_KINDS["a100-80gb"], 2, B, 0.0)
    graph = chain([1000, 1000])
    res = simulate(graph, view, Plan(pp=2, micro_batch=1, global_batch=m, schedule="gpipe", dtype="fp32"),
                   compute=ZERO, layer_times={"l0": (tf, tb), "l1": (tf, tb)})
    assert res.iteration_time_s == pytest.approx((m + 1) * (tf + tb), rel=1e-12)


def test_graph_pipeline_branches_run_concurrently() -> None:
    """GraphPipe stage DAG a -> (b, c) -> d on four GPUs, one micro-batch, no communication cost:
    the branches overlap, so T = t(a) + max(t(b), t(c)) + t(d) for forward and backward."""
    from plait.ir.plan import StageSpec

    view = ClusterView.uniform(4, GPU_KINDS["a100-80gb"], 4, B, 0.0)
    layers = [Layer(name=n, kind="Linear", param_count=10) for n in "abcd"]
    graph = OpGraph(model="diamond", layers=layers,
                    layer_edges=[("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    stages = [StageSpec(name=f"s{i}", layers=[n], devices=[i]) for i, n in enumerate("abcd")]
    plan = Plan(stages=stages, stage_edges=[(0, 1), (0, 2), (1, 3), (2, 3)], micro_batch=1, global_batch=1,
                dtype="fp32")
    times = {"a": (1e-3, 2e-3), "b": (3e-3, 6e-3), "c": (1e-3, 2e-3), "d": (2e-3, 4e-3)}
    res = simulate(graph, view, plan, compute=ZERO, layer_times=times)
    fwd = 1e-3 + 3e-3 + 2e-3
    bwd = 4e-3 + 6e-3 + 2e-3
    assert res.iteration_time_s == pytest.approx(fwd + bwd, rel=1e-12)
    starts = {e.stage: e.start for e in res.timeline.events if e.category == "forward"}
    assert starts[1] == starts[2] == pytest.approx(1e-3)
    assert {e.name for e in res.timeline.events if e.category == "forward"} >= {"fwd s1 c0 mb0 b", "fwd s2 c0 mb0 c"}


@pytest.mark.parametrize("rs_algorithm", ["auto", "allreduce"])
def test_zero3_per_layer_gathers_without_prefetch(rs_algorithm: str) -> None:
    """ZeRO-3 on 2 GPUs as plait's runtime runs it (plait.runtime.zero3): layers l0, l1, l2 with
    l0's first T parameters tied to l2 (the root unit: gathered once per step before the first
    forward, reduce-scattered once after the last backward); per micro-batch, layer by layer,
    all-gather before its forward, all-gather before its backward and reduce-scatter after it,
    each waited for by the compute (no prefetch). fp32: a unit of p parameters all-gathers
    S = 4p bytes in (n-1) a + (n-1)/n S/B = a + 2p/B; its reduce-scatter is a ring
    a + 2p/B, or under gloo ("allreduce": ProcessGroupGloo all-reduces the whole input)
    2a + 4p/B. 1F1B on one stage: F0 B0 F1 B1."""
    p0, p1, p2, T, m = 3_000_000, 5_000_000, 2_000_000, 1_000_000, 2
    graph = chain([p0, p1, p2])
    graph.tied.append(TiedParams(owner="l0", user="l2", params=T))
    times = {"l0": (1e-3, 2e-3), "l1": (3e-3, 5e-3), "l2": (2e-3, 4e-3)}
    res = simulate(graph, two_gpus(gpus_per_node=1), Plan(dp=2, zero=3, micro_batch=1, global_batch=2 * m,
                                                           dtype="fp32"),
                   compute=ZERO.replace(reduce_scatter_algorithm=rs_algorithm), layer_times=times)

    def ag(p: float) -> float:
        return ALPHA + 2 * p / B

    def rs(p: float) -> float:
        return ALPHA + 2 * p / B if rs_algorithm == "auto" else 2 * ALPHA + 4 * p / B

    units = {"l0": p0 - T, "l1": p1, "l2": p2}
    fwd = sum(ag(units[n]) + times[n][0] for n in ("l0", "l1", "l2"))
    bwd = sum(ag(units[n]) + times[n][1] + rs(units[n]) for n in ("l2", "l1", "l0"))
    barrier = 2 * ALPHA
    assert res.iteration_time_s == pytest.approx(ag(T) + m * (fwd + bwd) + rs(T) + barrier, rel=1e-12)
    names = [e.name for e in sorted(res.timeline.events, key=lambda e: e.start)
             if e.device in (0, None) and e.category in ("comm_zero", "forward", "backward")]
    assert names[:4] == ["allgather params root", "allgather params l0 mb0", "fwd s0 c0 mb0 l0",
                         "allgather params l1 mb0"]
    assert names[-4:] == ["allgather params l0 mb1", "bwd s0 c0 mb1 l0", "reducescatter grads l0 mb1",
                          "reducescatter grads root"]
