"""Lowering behaviour: schedules, granularity, symmetry, heterogeneity, ZeRO, placement, errors."""

from __future__ import annotations

import numpy as np
import pytest

from plait.cluster.catalog import GPU_KINDS
from plait.errors import PlaitError
from plait.graph.gpt_closed_form import gpt_opgraph
from plait.ir.plan import Plan
from plait.net.view import ClusterView
from plait.sim.api import simulate
from plait.sim.lowering import lower

A100, V100 = GPU_KINDS["a100-80gb"], GPU_KINDS["v100-32gb"]
GRAPH = gpt_opgraph({"layers": 8, "hidden": 512, "heads": 8, "seq": 256, "vocab": 4096}, "bf16")
BIG = gpt_opgraph({"layers": 4, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 4096}, "bf16")  # GPU-bound


def view(n: int = 8, per_node: int = 8, inter: float = 25e9) -> ClusterView:
    return ClusterView.uniform(n, A100, per_node, 300e9, 2e-6, inter_bandwidth=inter, inter_latency=5e-6)


def sim(plan: str, cluster: ClusterView | None = None, **kw):
    return simulate(GRAPH, cluster or view(), plan, **kw)


def test_layer_and_stage_granularity_agree() -> None:
    plan = "dp=2,tp=2,pp=2,micro_batch=2,global_batch=16"
    a, b = sim(plan, granularity="layer"), sim(plan, granularity="stage")
    assert a.num_tasks > 3 * b.num_tasks
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=1e-9)


def test_symmetry_collapses_replicas_without_changing_time() -> None:
    plan = "dp=2,tp=2,pp=2,micro_batch=2,global_batch=16"
    sym, full = sim(plan), sim(plan, symmetry=False)
    assert "symmetric" in sym.symmetry and full.num_tasks > sym.num_tasks
    assert sym.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-6)


def test_schedules_and_interleaving() -> None:
    base = "dp=1,tp=1,pp=4,micro_batch=1,global_batch=8"
    one = sim(base + ",schedule=1f1b", granularity="stage")
    gpipe = sim(base + ",schedule=gpipe", granularity="stage")
    inter = sim(base + ",schedule=interleaved,virtual_stages=2", granularity="stage")
    big = "dp=1,tp=1,pp=2,micro_batch=1,global_batch=4"
    big_one = simulate(BIG, view(), big)
    big_inter = simulate(BIG, view(), big + ",schedule=interleaved,virtual_stages=2")
    # Same bubble in theory; with blocking sends GPipe's all-forward phase couples the stages.
    assert one.iteration_time_s <= gpipe.iteration_time_s < 1.2 * one.iteration_time_s
    assert big_inter.iteration_time_s < big_one.iteration_time_s  # smaller bubble: (pp-1)/v
    # ...at the price of more pipeline sends: 2 (pp v - 1) per micro-batch instead of 2 (pp - 1).
    sends = {name: sum(e.category == "comm_pp" for e in r.timeline.events) for name, r in
             (("1f1b", one), ("interleaved", inter))}
    assert sends == {"1f1b": 2 * 3 * 8, "interleaved": 2 * 7 * 8}
    fwd = [e for e in inter.timeline.events if e.category == "forward" and e.device == 0]
    # Stage 0 holds chunks 0 and pp (its local chunks 0 and 1); names follow plait.schedule.event_key.
    assert {e.name.split()[2] for e in fwd} == {"c0", "c1"} and {e.chunk for e in fwd} == {0, 1}
    assert {e.name.split()[1] for e in fwd} == {"s0"}
    assert big_one.iteration_time_s > 0


def test_recompute_adds_forward_work() -> None:
    plan = "dp=1,tp=1,pp=2,micro_batch=2,global_batch=8"
    none, full = sim(plan + ",recompute=none"), sim(plan + ",recompute=full")
    sel = sim(plan + ",recompute=selective")
    assert none.iteration_time_s < sel.iteration_time_s < full.iteration_time_s
    assert any(e.category == "recompute" for e in full.timeline.events)


def test_heterogeneous_kinds_and_uneven_shares() -> None:
    kinds = [A100] * 4 + [V100] * 4
    v = view()
    mixed = ClusterView(kinds=kinds, node_of=v.node_of, bandwidth=v.bandwidth, latency=v.latency,
                        node_nic_bandwidth=v.node_nic_bandwidth, name="mixed")
    plan = "dp=2,tp=4,pp=1,micro_batch=2,global_batch=16"
    even = simulate(BIG, mixed, plan)
    assert "every replica" in even.symmetry  # replicas differ in GPU kind: both simulated
    fast_only = simulate(BIG, view(), plan)
    assert even.iteration_time_s > 1.5 * fast_only.iteration_time_s  # the V100 replica paces the step
    skewed = simulate(BIG, mixed, plan + ",dp_shares=0.75:0.25")
    assert skewed.iteration_time_s < even.iteration_time_s  # HAP: give the fast replica more samples
    # Mixed kinds inside one tensor-parallel group: every segment waits for the V100.
    straddle = simulate(BIG, mixed, "dp=1,tp=8,pp=1,micro_batch=2,global_batch=16")
    a100_only = simulate(BIG, view(), "dp=1,tp=8,pp=1,micro_batch=2,global_batch=16")
    assert straddle.iteration_time_s > 1.5 * a100_only.iteration_time_s
    # Uneven layer split: the stage with more layers bounds the pipeline.
    split = sim("dp=1,tp=1,pp=2,micro_batch=1,global_batch=8,layer_split=8:2")
    balanced = sim("dp=1,tp=1,pp=2,micro_batch=1,global_batch=8")
    assert split.iteration_time_s > balanced.iteration_time_s


def test_device_order_places_pipeline_across_nodes() -> None:
    two_nodes = view(16, 8, inter=1e9)
    plan = "dp=1,tp=8,pp=2,micro_batch=4,global_batch=32"
    inside = sim(plan, two_nodes)  # tp groups inside nodes, pipeline across
    order = ":".join(str(d) for d in [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15])
    spread = sim(plan + ",device_order=" + order, two_nodes)  # every TP group straddles the slow link
    assert spread.iteration_time_s > 1.2 * inside.iteration_time_s


def test_zero_and_dp_collectives() -> None:
    base = "dp=4,tp=1,pp=1,micro_batch=1,global_batch=8"
    cats = {z: {e.name.split()[0] for e in sim(f"{base},zero={z}").timeline.events
                if e.category.startswith("comm")} for z in (0, 1, 3)}
    assert "allreduce" in cats[0]
    assert {"reducescatter", "allgather"} <= cats[1]
    assert "allgather" in cats[3] and "reducescatter" in cats[3]


def test_wfbp_buckets_overlap_backward() -> None:
    plan = "dp=8,tp=1,pp=1,micro_batch=1,global_batch=8"
    slow = view(8, 1, inter=2e9)  # one GPU per node: gradients cross a slow network
    one = sim(plan + ",grad_bucket_mb=0", slow)
    after = sim(plan + ",grad_bucket_mb=4", slow)  # the runtime's way: buckets after the backward
    buckets = sim(plan + ",grad_bucket_mb=4", slow, overlap_grad_reduce=True)
    assert buckets.iteration_time_s < one.iteration_time_s
    assert one.exposed_comm_s > buckets.exposed_comm_s
    # without overlap the buckets only add their latencies to the one reduction
    n = sum(1 for e in after.timeline.events if "dp bucket" in e.name and e.device == after.timeline.events[0].device)
    assert n > 1 and after.iteration_time_s >= one.iteration_time_s


def test_one_bucket_size_for_runtime_simulator_and_memory() -> None:
    """Plan.grad_bucket_mb is the runtime's bucket, the simulator's and the memory estimate's."""
    import torch

    from plait.runtime.data_parallel import DataParallelStep

    plan = "dp=8,tp=1,pp=1,micro_batch=1,global_batch=8"
    small, big = sim(plan + ",grad_bucket_mb=1"), sim(plan + ",grad_bucket_mb=64")
    names = lambda r: {e.name for e in r.timeline.events if "dp bucket" in e.name}  # noqa: E731
    assert len(names(small)) > len(names(big)) >= 1
    two = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 4 MiB each
    params = list(two.parameters())
    step = DataParallelStep(params, lambda ps: torch.optim.SGD(ps, lr=0.1), None, 1, None,
                            bucket_bytes=Plan.parse(plan + ",grad_bucket_mb=1").grad_bucket_bytes)
    assert len(step.buckets) == 2  # in backward order: [bias2, weight2], [bias1, weight1]
    one = DataParallelStep(params, lambda ps: torch.optim.SGD(ps, lr=0.1), None, 1, None, bucket_bytes=0)
    assert len(one.buckets) == 1


def test_link_sharing_between_pipeline_transfers() -> None:
    """Two tensor ranks' activations cross the same slow node link: each gets half of it."""
    plan = "dp=1,tp=2,pp=2,micro_batch=8,global_batch=8"
    cluster = ClusterView.uniform(4, A100, 2, 300e9, 2e-6, inter_bandwidth=1e9, inter_latency=5e-6,
                                  nics_per_node=1)
    res = sim(plan, cluster, granularity="stage")
    sends = [e for e in res.timeline.events if e.category == "comm_pp" and e.name.startswith("send_fwd")]
    assert sends
    nbytes = sends[0].args["bytes"]
    # 2 tensor ranks share one 1 GB/s NIC: each transfer takes twice bytes/B.
    assert sends[0].duration == pytest.approx(5e-6 + res_p2p(res) + 2 * nbytes / 1e9, rel=1e-6)


def res_p2p(res) -> float:
    from plait.cost.compute import DEFAULT_MODEL

    return DEFAULT_MODEL.p2p_host_s


def test_errors_name_the_problem() -> None:
    with pytest.raises(PlaitError, match="needs 16 devices"):
        sim("dp=2,tp=4,pp=2,micro_batch=1,global_batch=8")
    with pytest.raises(PlaitError, match="layer_split"):
        sim("dp=1,tp=1,pp=2,micro_batch=1,global_batch=8,layer_split=3:3")
    with pytest.raises(PlaitError, match="device_order"):
        lower(GRAPH, Plan(dp=2, global_batch=2, device_order=[0, 9]), view(8))


def test_timeline_rows_and_busy_fraction() -> None:
    res = sim("dp=2,tp=2,pp=2,micro_batch=2,global_batch=16")
    assert set(res.busy_fraction) == {"dev0/compute", "dev4/compute"}  # stage representatives
    assert all(0 < f <= 1 for f in res.busy_fraction.values())
    ends = np.array([e.end for e in res.timeline.events])
    assert ends.max() == pytest.approx(res.iteration_time_s)
    assert res.critical_path[-1]["category"] in ("optimizer", "comm_zero")
    assert res.tflops_per_gpu > 0 and res.throughput_samples_per_s == pytest.approx(16 / res.iteration_time_s)


def test_default_split_is_megatrons() -> None:
    """Transformer layers are divided evenly; embedding and head ride on the first and last chunk."""
    lw = lower(GRAPH, Plan.parse("pp=4,micro_batch=1,global_batch=4"), view())
    assert [[layer.name for layer in c.layers] for c in lw.chunks] == [
        ["embed", "layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5"],
        ["layers.6", "layers.7", "head"]]
    inter = lower(GRAPH, Plan.parse("pp=2,micro_batch=1,global_batch=4,schedule=interleaved,virtual_stages=2"),
                  view())
    assert [len(c.layers) for c in inter.chunks] == [3, 2, 2, 3] and [c.stage for c in inter.chunks] == [0, 1, 0, 1]
    given = lower(GRAPH, Plan.parse("pp=2,micro_batch=1,global_batch=4,layer_split=4:6"), view())
    assert [len(c.layers) for c in given.chunks] == [4, 6]


def test_lowering_runs_the_schedule_modules_compute_order():
    """The simulator's program per stage is exactly plait.schedule's compute actions, by event key."""
    from plait.schedule import PipelineGraph, interleaved_1f1b

    res = simulate(BIG, view(), "dp=1,tp=1,pp=2,micro_batch=1,global_batch=4,schedule=interleaved,virtual_stages=2",
                   granularity="stage")
    sched = interleaved_1f1b(PipelineGraph.chain(2, 4, virtual_stages=2))
    for stage in range(2):
        events = sorted((e for e in res.timeline.events if e.stage == stage and e.category in ("forward", "backward")),
                        key=lambda e: e.start)
        assert [e.name for e in events] == [a.key for a in sched.compute(stage)]
