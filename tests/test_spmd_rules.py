"""Sharding rules, checked numerically: every strategy of every op of captured models (ViT,
BERT-MoE, VGG-19 and a module using the remaining op kinds), run shard by shard on real values with
uneven ratios, gathers to the unsharded op's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.graph.aten_capture import capture_aten_values
from plait.graph.sharding import SIZED_CREATION, local_call, strategies
from plait.graph.zoo import load_model
from plait.ir.aten_graph import AtenGraph, AtenOp
from plait.ir.program import PARTIAL, REPLICATED, ShardingError, Strategy, shard_dim, shard_sizes

RATIOS = (0.5, 0.3, 0.2)  # uneven, three devices


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops gain nothing from intra-op threads; on a busy machine they cost a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Misc(nn.Module):
    """Op kinds the zoo models do not use: addmm, mm, matmul, sdpa, sum/mean, cat, permute, conv
    without groups but with bias, adaptive pooling, min of two tensors, new_ones."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))
        self.b = nn.Parameter(torch.randn(5))
        self.conv = nn.Conv2d(4, 6, 3, padding=1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.addmm(self.b, x, self.w)  # [6, 5]
        m = torch.mm(x, self.w)
        lo = torch.min(a, m) * x.new_ones(6, 5)  # min.other, new_ones (T5's relative positions)
        q = torch.stack([lo, m, a * m]).reshape(3, 2, 3, 5).permute(1, 0, 2, 3)  # [2, 3, 3, 5]
        att = F.scaled_dot_product_attention(q, q * 0.5, q + 1.0)
        s = att.sum(dim=(2,)) + att.mean(dim=-1, keepdim=True).sum(-2)
        c = torch.cat([s, s * 2.0], dim=1)
        mm = torch.matmul(c, c.transpose(-1, -2))
        im = F.adaptive_avg_pool2d(self.conv(img), 2).flatten(1)
        return mm, im


def _models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    out = {}
    for spec in ("vit:layers=1,hidden=24,heads=4,patch=8,image=24,classes=6",
                 "bert_moe:layers=2,hidden=24,heads=4,seq=8,vocab=40,experts=4,dropout=0,attn_dropout=0",
                 "vgg19:width=8,fc=16,image=32,pool=1,classes=6,dropout=0"):
        m = load_model(spec)
        out[m.name] = (m.build(), m.sample_batch(6)[0])
    torch.manual_seed(0)
    out["misc"] = (Misc(), (torch.randn(6, 6), torch.randn(6, 4, 5, 5)))
    return out


@pytest.fixture(scope="module")
def captured() -> dict[str, tuple[AtenGraph, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    return {name: capture_aten_values(model, inputs, name=name) for name, (model, inputs) in _models().items()}


def _split(value: torch.Tensor, placement: str, gen: torch.Generator, unit: int = 1
           ) -> tuple[list[torch.Tensor], list[int]]:
    """Each device's part of `value` and its offset along the sharded dimension (shards in
    multiples of `unit`)."""
    n = len(RATIOS)
    d = shard_dim(placement)
    if placement == REPLICATED:
        return [value.clone() for _ in range(n)], [0] * n
    if placement == PARTIAL:  # random summands
        parts = [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(n - 1)]
        return [value - sum(parts), *parts], [0] * n
    sizes = shard_sizes(value.shape[d], RATIOS, unit)
    offsets = [sum(sizes[:i]) for i in range(n)]
    return list(torch.split(value, sizes, dim=d)), offsets


def _gather(parts: list[torch.Tensor], placement: str) -> torch.Tensor:
    if placement == PARTIAL:
        return sum(parts[1:], parts[0])
    d = shard_dim(placement)
    if d is None:
        for p in parts[1:]:
            torch.testing.assert_close(p, parts[0])
        return parts[0]
    return torch.cat(parts, dim=d)


def _unit(op: AtenOp, strategy: Strategy, graph: AtenGraph) -> int:
    """A view that turns rows of b*a into rows of b needs shards of b*a in multiples of a (the
    rounding of `round_shards` gives them that)."""
    d_in, d_out = shard_dim(strategy.inputs[0]) if strategy.inputs else None, \
        shard_dim(strategy.outputs[0]) if strategy.outputs else None
    if d_in is None or d_out is None:
        return 1
    a = graph.tensors[op.inputs[0]].shape[d_in]
    b = graph.tensors[op.outputs[0]].shape[d_out]
    return a // b if a > b else 1


def _check(op: AtenOp, strategy: Strategy, graph: AtenGraph, values: dict[str, torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(1)
    local: list[list[torch.Tensor]] = [[] for _ in RATIOS]
    first_row = [0] * len(RATIOS)
    unit = _unit(op, strategy, graph)
    for i, (t, placement) in enumerate(zip(op.inputs, strategy.inputs)):
        parts, offsets = _split(values[t], placement, gen, unit if i == 0 else 1)
        for dev in range(len(RATIOS)):
            local[dev].append(parts[dev])
        if i == 0:
            first_row = offsets
    outs_per_device = []
    for dev in range(len(RATIOS)):
        out_shape = None
        if op.outputs and (not op.inputs or op.kind in SIZED_CREATION):  # creation: this device's shard
            full = list(graph.tensors[op.outputs[0]].shape)
            d = shard_dim(strategy.outputs[0])
            if d is not None:
                full[d] = shard_sizes(full[d], RATIOS)[dev]
            out_shape = full
        outs_per_device.append(local_call(op, strategy, local[dev], graph, out_shape, first_row[dev]))
    for k, (t, placement) in enumerate(zip(op.outputs, strategy.outputs)):
        got = _gather([o[k] for o in outs_per_device], placement)
        want = values[t]
        if got.dtype == torch.bool or not got.is_floating_point():
            assert torch.equal(got, want), f"{op.name} {strategy}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{op.name} {strategy}: {m}")


@pytest.mark.parametrize("name", ["vit", "bert_moe", "vgg19", "misc"])
def test_every_strategy_of_every_op_gathers_to_the_unsharded_result(captured, name) -> None:
    graph, values = captured[name]
    kinds, checked = set(), 0
    for op in graph.ops:
        for strategy in strategies(op, graph, devices=len(RATIOS)):
            _check(op, strategy, graph, values)
            checked += 1
            if strategy.sharded:
                kinds.add(op.kind)
    assert checked > len(graph.ops)
    expected = {"vit": {"linear", "layer_norm", "softmax", "bmm", "conv2d", "gelu", "cat", "expand", "select"},
                "bert_moe": {"embedding", "einsum", "topk", "cumsum", "scatter", "linear", "softmax"},
                "vgg19": {"conv2d", "max_pool2d", "relu", "linear", "adaptive_avg_pool2d"},
                "misc": {"addmm", "mm", "matmul", "scaled_dot_product_attention", "sum", "mean",
                         "permute", "cat", "min", "new_ones"}}[name]
    assert expected <= kinds, expected - kinds


def test_strategies_name_what_each_op_offers(captured) -> None:
    graph, _ = captured["bert_moe"]
    qkv = next(op for op in graph.ops if op.module.endswith("attn.qkv"))
    found = {(s.inputs, s.outputs) for s in strategies(qkv, graph, devices=2)}
    assert (("S0", "R", "R"), ("S0",)) in found  # data parallel over the sequence
    assert (("R", "S0", "S0"), ("S2",)) in found  # Megatron column parallel
    assert (("S2", "S1", "P"), ("P",)) in found  # row parallel: partial sum, bias on one device
    vocab = next(op for op in graph.ops if op.kind == "embedding" and "tok" in op.module)
    assert (("S0", "R"), ("P",)) in {(s.inputs, s.outputs) for s in strategies(vocab, graph)}
    # the attention core's output [s, b*a, d] -> [s, b, h]: rows of b*a, a at a time, are rows of b,
    # so data parallelism flows through attention without a gather
    merge = next(op for op in graph.ops if op.kind in ("reshape", "view") and
                 len(graph.tensors[op.inputs[0]].shape) == 3 and
                 graph.tensors[op.inputs[0]].shape[1] == 4 * graph.tensors[op.outputs[0]].shape[1])
    assert (("S1",), ("S1",)) in {(s.inputs, s.outputs) for s in strategies(merge, graph)}
    topk = next(op for op in graph.ops if op.kind == "topk")
    assert all(shard_dim(s.inputs[0]) != 1 for s in strategies(topk, graph))  # never along experts


def test_op_without_rule_is_named() -> None:
    graph = AtenGraph("m", 1)
    op = AtenOp("fft_0", "aten.fft_fft.default", "layer0", "block.fft")
    with pytest.raises(ShardingError, match=r"op fft_0 \(aten.fft_fft.default, in block.fft\): no sharding rule"):
        strategies(op, graph)


def test_shard_sizes_round_like_hap_and_refuse_empty_devices() -> None:
    assert shard_sizes(10, (0.5, 0.3, 0.2)) == [5, 3, 2]
    assert shard_sizes(7, (0.5, 0.3, 0.2)) == [4, 2, 1]  # floor 3,2,1; the largest deficit gets 1
    assert shard_sizes(12, (0.5, 0.5), unit=4) == [8, 4]
    assert sum(shard_sizes(1000, (0.37, 0.21, 0.42))) == 1000
    with pytest.raises(ShardingError, match="layers.0.attn.qkv.*leave gpu 2 \\(p100\\) with zero rows"):
        shard_sizes(8, (0.6, 0.38, 0.02), what="layers.0.attn.qkv", devices=["gpu 0", "gpu 1", "gpu 2 (p100)"])
    with pytest.raises(ShardingError, match="multiple of the shard unit"):
        shard_sizes(10, (0.5, 0.5), unit=4)


def test_only_sharded_tensors_split_the_work() -> None:
    """``P + P`` differs per device but each adds full-size tensors: no ratio saving."""
    assert not Strategy(("P", "P"), ("P",), True).splits_work
    assert not Strategy(("R", "R"), ("R",), False).splits_work
    assert Strategy(("S2", "S1", "P"), ("P",), True).splits_work


def _grad_check(op: AtenOp, strategy: Strategy, graph: AtenGraph, values: dict[str, torch.Tensor]) -> bool:
    """The gradient placements the search charges for (`placement.grad_placement`) are what
    autograd gives: run the op shard by shard, feed each device its part of a random output
    gradient (sharded: its slice; partial or replicated: the whole), and gather the input
    gradients by the placement the table names. False when the op has nothing to differentiate."""
    from plait.ir.program import grad_placement

    floats = [i for i, t in enumerate(op.inputs) if values[t].is_floating_point()]
    if not floats or not op.outputs:
        return False
    full_in = [values[t].detach().clone().requires_grad_(i in floats) for i, t in enumerate(op.inputs)]
    full_out = local_call(op, Strategy(tuple("R" for _ in op.inputs), tuple("R" for _ in op.outputs), False),
                          full_in, graph)
    diff = [k for k, o in enumerate(full_out) if o.requires_grad and o.is_floating_point()]
    if not diff:
        return False
    gen = torch.Generator().manual_seed(2)
    grads_out = {k: torch.randn(full_out[k].shape, generator=gen, dtype=full_out[k].dtype) for k in diff}
    want = torch.autograd.grad([full_out[k] for k in diff], [full_in[i] for i in floats],
                               [grads_out[k] for k in diff], allow_unused=True)
    n = len(RATIOS)
    local_in: list[list[torch.Tensor]] = [[] for _ in range(n)]
    first_row = [0] * n
    unit = _unit(op, strategy, graph)
    for i, (t, placement) in enumerate(zip(op.inputs, strategy.inputs)):
        parts, offsets = _split(values[t], placement, gen, unit if i == 0 else 1)
        for dev in range(n):
            local_in[dev].append(parts[dev].detach().clone().requires_grad_(i in floats))
        if i == 0:
            first_row = offsets
    outs = [local_call(op, strategy, local_in[dev], graph, None, first_row[dev]) for dev in range(n)]
    got: list[list[torch.Tensor | None]] = []
    for dev in range(n):
        gs = []
        for k in diff:
            d = shard_dim(strategy.outputs[k])
            if d is None:  # partial or replicated output: every device gets the whole gradient
                gs.append(grads_out[k])
            else:  # its own slice, as large as its output shard
                sizes = [outs[e][k].shape[d] for e in range(n)]
                gs.append(torch.split(grads_out[k], sizes, dim=d)[dev])
        got.append(list(torch.autograd.grad([outs[dev][k] for k in diff], [local_in[dev][i] for i in floats],
                                            gs, allow_unused=True)))
    for j, i in enumerate(floats):
        if want[j] is None:
            continue
        placement = grad_placement(strategy.inputs[i], strategy.sharded)
        parts = [g[j] if g[j] is not None else torch.zeros_like(local_in[dev][i]) for dev, g in enumerate(got)]
        torch.testing.assert_close(_gather(parts, placement), want[j], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, i=i: f"{op.name} {strategy} input {i}: {m}")
    return True


@pytest.mark.parametrize("name", ["vit", "bert_moe", "misc"])
def test_gradient_placements_are_what_autograd_gives(captured, name) -> None:
    graph, values = captured[name]
    checked = 0
    for op in graph.ops:
        for strategy in strategies(op, graph, devices=len(RATIOS)):
            checked += _grad_check(op, strategy, graph, values)
    assert checked > 20
