"""plait.cost.traffic: hand-computed bytes pin the formulas of every traffic class."""

from __future__ import annotations

import numpy as np
import pytest

from plait.cost import traffic
from plait.cost.collectives import ring_all_reduce_time
from plait.graph.inspect import inspect_model
from plait.ir.plan import Plan

H, S, V = 64, 32, 128
GPT = f"gpt:layers=2,hidden={H},heads=4,seq={S},vocab={V}"


@pytest.fixture(scope="module")
def gpt():
    return inspect_model(GPT, 2)


def _one(t: traffic.IterationTraffic, cls: str, name: str | None = None) -> list[traffic.Message]:
    return [m for m in t.of_class(cls) if name is None or m.name.startswith(name)]


def test_pipeline_activation_is_b_s_h_in_bf16_per_micro_batch(gpt):
    b = 2
    t = traffic.iteration_traffic(gpt, Plan(pp=2, micro_batch=b, global_batch=3 * b))
    act = _one(t, "pp", "send act")
    grad = _one(t, "pp", "send grad")
    assert [m.nbytes for m in act] == [b * S * H * 2] and [m.nbytes for m in grad] == [b * S * H * 2]
    assert act[0].count == 3 and act[0].groups == ((0, 1),) and grad[0].groups == ((1, 0),)
    assert t.totals()["pp"] == 2 * 3 * b * S * H * 2
    # fp32 compute doubles it; at tp=2 each tensor rank sends the whole replicated value to its peer,
    # as plait's engines (torch's pipelining over DTensor stages, plait's executor) and torchtitan do;
    # half of it under sequence parallelism (its part of the sequence) or legacy Megatron's scatter-gather
    t32 = traffic.iteration_traffic(gpt, Plan(pp=2, micro_batch=b, global_batch=b, dtype="fp32"))
    assert _one(t32, "pp", "send act")[0].nbytes == b * S * H * 4
    tp2 = Plan(pp=2, tp=2, micro_batch=b, global_batch=b)
    m = _one(traffic.iteration_traffic(gpt, tp2), "pp", "send act")[0]
    assert m.nbytes == b * S * H * 2 and m.groups == ((0, 2), (1, 3))
    sp = _one(traffic.iteration_traffic(gpt, Plan(pp=2, tp=2, micro_batch=b, global_batch=b, sequence_parallel=True)),
              "pp", "send act")[0]
    legacy = _one(traffic.iteration_traffic(gpt, tp2, scatter_gather=True), "pp", "send act")[0]
    assert sp.nbytes == legacy.nbytes == b * S * H


def test_ring_all_reduce_of_fp32_gradients(gpt):
    P = gpt.param_count
    n = 4
    t = traffic.iteration_traffic(gpt, Plan(dp=n, micro_batch=1, global_batch=n))  # bf16: fp32 grads
    (m,) = t.of_class("dp")
    assert (m.op, m.nbytes, m.groups) == ("all_reduce", 4 * P, ((0, 1, 2, 3),))
    per_rank = [f.nbytes for f in m.flows()]
    assert per_rank == [pytest.approx(2 * (n - 1) / n * 4 * P)] * n
    assert t.totals()["dp"] == 2 * (n - 1) * 4 * P
    # the plan's gradient dtype is the one truth: bf16 reduction halves it, fp16 reduces in fp16
    for plan in (Plan(dp=n, micro_batch=1, global_batch=n, grad_reduce_dtype="bf16"),
                 Plan(dp=n, micro_batch=1, global_batch=n, dtype="fp16")):
        assert traffic.iteration_traffic(gpt, plan).of_class("dp")[0].nbytes == 2 * P
    # ZeRO-1: reduce-scatter of the gradients + all-gather of the bf16 parameters after the step
    z1 = traffic.iteration_traffic(gpt, Plan(dp=n, micro_batch=1, global_batch=n, zero=1))
    assert [(m.op, m.nbytes) for m in z1.of_class("dp")] == [("reduce_scatter", 4 * P)]
    assert [(m.op, m.nbytes) for m in z1.of_class("zero")] == [("all_gather", 2 * P)]


def test_megatron_tensor_parallel_collectives(gpt):
    b = 2
    t = traffic.iteration_traffic(gpt, Plan(tp=2, micro_batch=b, global_batch=b))
    big = [m for m in t.of_class("tp") if m.nbytes == b * S * H * 2]
    # 2 all-reduces forward and 2 backward per transformer layer (2 layers), plus the
    # vocabulary-parallel embedding's forward and the head input-gradient all-reduce
    assert sorted((m.name, m.op, m.count) for m in big) == [("tp bwd", "all_reduce", 5), ("tp fwd", "all_reduce", 5)]
    # cross-entropy (Megatron's _VocabParallelCrossEntropy): max, target logit and sum of fp32 per-token scalars
    small = [m for m in t.of_class("tp") if m.nbytes != b * S * H * 2]
    assert [(m.op, m.nbytes, m.count) for m in small] == [("all_reduce", 4 * b * S, 3)]
    # sequence parallelism: all-gather + reduce-scatter in place of each all-reduce of a layer
    sp = traffic.iteration_traffic(gpt, Plan(tp=2, micro_batch=b, global_batch=b, sequence_parallel=True))
    ops = {(m.name, m.op): m.count for m in sp.of_class("tp") if m.nbytes == b * S * H * 2}
    assert ops[("tp fwd", "all_gather")] == 4 and ops[("tp fwd", "reduce_scatter")] == 4
    # full recompute repeats the transformer layers' forward all-reduces (2 layers x 2, ring of 2)
    rec = traffic.iteration_traffic(gpt, Plan(tp=2, micro_batch=b, global_batch=b, recompute="full"))
    assert sum(m.wire_bytes for m in rec.of_class("tp") if m.name == "tp rec") == 2 * 2 * (2 * 1 * b * S * H * 2)
    assert rec.totals()["tp"] == t.totals()["tp"] + 4 * 2 * b * S * H * 2


def test_zero3_gathers_and_scatters_per_layer_and_micro_batch(gpt):
    """ZeRO-3 as the runtime shards it (plait.runtime.zero3): one unit per layer (its own
    parameters, bf16 gathers, fp32 gradient reduce-scatters) per forward / backward of each
    micro-batch; the tied word embedding (V h, shared by embedding and head) is the root unit,
    gathered and reduce-scattered once per iteration."""
    P, n, m, T = gpt.param_count, 2, 3, V * H
    t = traffic.iteration_traffic(gpt, Plan(dp=n, micro_batch=1, global_batch=n * m, zero=3))
    assert t.of_class("dp") == []
    own = {layer.name: layer.param_count for layer in gpt.layers}
    own["embed"] -= T  # position embedding only: the word embedding is the root's
    got = sorted((x.name, x.op, x.nbytes, x.count) for x in t.of_class("zero"))
    sizes = sorted(set(own.values()))
    want = [("allgather params", "all_gather", 2 * p, 2 * m * list(own.values()).count(p)) for p in sizes] + \
        [("allgather params root", "all_gather", 2 * T, 1), ("reducescatter grads root", "reduce_scatter", 4 * T, 1)] + \
        [("reducescatter grads", "reduce_scatter", 4 * p, m * list(own.values()).count(p)) for p in sizes]
    assert got == sorted(want)
    assert t.totals()["zero"] == (n - 1) * (2 * m * 2 * (P - T) + m * 4 * (P - T) + 2 * T + 4 * T)


def test_tied_embedding_split_over_stages(gpt):
    t = traffic.iteration_traffic(gpt, Plan(pp=2, tp=2, micro_batch=1, global_batch=1))
    (m,) = t.of_class("tied")
    assert (m.op, m.nbytes, m.groups) == ("all_reduce", V * H // 2 * 4, ((0, 2), (1, 3)))
    assert traffic.iteration_traffic(gpt, Plan(micro_batch=1, global_batch=1)).of_class("tied") == []


def test_uneven_shares_use_the_stage_graph_rounding(gpt):
    t = traffic.iteration_traffic(gpt, Plan(dp=2, pp=2, micro_batch=4, global_batch=16,
                                            dp_shares=[10 / 16, 6 / 16]))
    sizes = sorted((m.nbytes // (S * H * 2), m.count) for m in _one(t, "pp", "send act"))
    # replica 0: [4, 3, 3], replica 1: [3, 3]
    assert sizes == [(3, 2), (3, 2), (4, 1)]


def test_flows_list_every_message_and_sum_to_the_totals(gpt):
    t = traffic.iteration_traffic(gpt, Plan(dp=2, tp=2, pp=2, micro_batch=1, global_batch=4))
    flows = t.flows()
    assert {f.cls for f in flows} == {"dp", "tp", "pp", "tied"}
    for cls, total in t.totals().items():
        assert sum(f.nbytes for f in flows if f.cls == cls) == pytest.approx(total)
    assert all(f.src != f.dst for f in flows)


def test_message_time_is_the_collectives_formula():
    msg = traffic.Message("x", "dp", "all_reduce", 4_000_000, ((0, 1, 2, 3),), 1, 0)
    bw = np.full((4, 4), 100e9)
    lat = np.full((4, 4), 5e-6)
    assert traffic.message_time(msg, bw, lat, [0, 0, 0, 0]) == pytest.approx(
        ring_all_reduce_time(4e6, 4, 100e9, 5e-6))
    p2p = traffic.Message("y", "pp", "send_recv", 1000, ((0, 1),), 1, 0)
    assert traffic.message_time(p2p, bw, lat, [0, 0, 0, 0]) == pytest.approx(5e-6 + 1000 / 100e9)


def test_wire_bytes_rejects_unknown_ops():
    with pytest.raises(traffic.TrafficError, match="all_shuffle"):
        traffic.wire_bytes("all_shuffle", 1, 2)


def test_an_spmd_programs_collectives_are_ring_messages_by_hand():
    """`program_messages`: whole-tensor sizes (an all-to-all's per-rank buffer is 1/n of it), one
    call per iteration, the ring's bytes: all-reduce 2(n-1)S, all-gather (n-1)S, all-to-all (n-1)S/n."""
    from types import SimpleNamespace as C

    comms = [("a", C(op="all_reduce", tensor="w", nbytes=100, group="world")),
             ("b", C(op="all_gather", tensor="x", nbytes=40, group="world")),
             ("c", C(op="all_to_all", tensor="y", nbytes=400, group="world"))]
    ms = traffic.program_messages(comms, [3, 1, 0, 2])
    assert {m.cls for m in ms} == {"spmd"} and all(m.groups == ((3, 1, 0, 2),) and m.count == 1 for m in ms)
    assert sum(m.wire_bytes for m in ms) == 2 * 3 * 100 + 3 * 40 + 3 * 100
    flows = [f for m in ms for f in m.flows()]
    assert {(f.src, f.dst) for f in flows} == {(3, 1), (1, 0), (0, 2), (2, 3)}
    with pytest.raises(traffic.TrafficError, match="group 'node'"):
        traffic.program_messages([("d", C(op="all_reduce", tensor="z", nbytes=8, group="node"))], [0, 1])
