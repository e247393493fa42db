"""Sharding rules as data: for each aten op kind, which input placements give which output placement.

A rule turns one `AtenOp` (with its tensors' shapes) into a list of `Strategy` -- HAP's Hoare
triples for compute instructions (Zhang et al. EuroSys'24, section 4.1): ``{inputs placed so}
op {outputs placed so}``, plus whether the op computes a shard (its work scales with the
device's ratio) or runs redundantly on every device. Every op has the redundant strategy (all
``R`` in, all ``R`` out); the rules add the sharded ones:

* elementwise (with broadcasting): shard any output dimension, the inputs along theirs (size-1
  broadcast dimensions stay replicated); linear ones (add, sub, mul/div by a replicated factor,
  copies) also pass partial sums through;
* linear / addmm / matmul / bmm / einsum: shard any index letter of the einsum; a contracted
  letter gives a partial output (row-parallel: Megatron), a kept one a sharded output (data or
  column parallel); one partial operand with the others replicated stays partial;
* layer_norm, softmax, log_softmax, cumsum, topk: any dimension but the one they work along;
* scaled_dot_product_attention: batch and head dimensions of q, k and v together;
* conv2d: batch (data parallel), output channels (weight rows), input channels (partial);
* embedding: lookups sharded by index position, table sharded by columns (sharded output) or
  by rows (vocabulary parallel: partial output, each device looks up its own rows);
* sum / mean over dimensions: kept dimensions shard through, a summed sharded one gives partial;
* views (view, reshape, flatten, unsqueeze, transpose, permute, expand, select, split, cat,
  slice): a dimension maps to where it goes, when it stays contiguous;
* MoE gating: topk and cumsum as above, scatter along the other dimensions, one-hot
  comparisons elementwise; dispatch and combine are einsums (sharding the expert letter is
  expert parallelism, moving tokens-sharded to experts-sharded is GShard's all-to-all).

How compute scales: a sharded strategy's work on device ``i`` is ``r_i`` of the op's; a
redundant one's is all of it (`plait.spmd.cost`). `local_call` runs an op on one device's shard
(the numerical tests, and later the per-rank programs, use it).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

import torch

from plait.ir.aten_graph import AtenGraph, AtenOp
from plait.ir.program import PARTIAL, REPLICATED, ShardingError, Strategy, shard, shard_dim

Shapes = list[list[int]]
Rule = Callable[[AtenOp, Shapes, Shapes], list[Strategy]]
RULES: dict[str, Rule] = {}


def rule(*kinds: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for kind in kinds:
            RULES[kind] = fn
        return fn

    return register


def strategies(op: AtenOp, graph: AtenGraph, devices: int = 2) -> list[Strategy]:
    """Every strategy of `op`: the redundant one first, then the sharded ones whose sharded
    dimensions have at least `devices` elements (each device needs one). ShardingError naming
    the op when no rule knows its kind."""
    fn = RULES.get(op.kind)
    if fn is None:
        raise ShardingError(
            f"op {op.name} ({op.target}, in {op.module or 'the model'}): no sharding rule for "
            f"{op.kind!r}, so the SPMD and composed families cannot place it; add one "
            f"(`plait.graph.sharding.rule`, {len(RULES)} ops have rules: `all_rules()`) or plan "
            "another family")
    ins = [graph.tensors[t].shape for t in op.inputs]
    outs = [graph.tensors[t].shape for t in op.outputs]
    floats = [graph.tensors[t].dtype.startswith(("float", "bfloat")) for t in (*op.inputs, *op.outputs)]
    redundant = Strategy(tuple(REPLICATED for _ in ins), tuple(REPLICATED for _ in outs), False)
    found = [redundant]
    for s in fn(op, ins, outs):
        partial_ok = all(f or p != PARTIAL for f, p in zip(floats, (*s.inputs, *s.outputs)))
        if s not in found and partial_ok and _big_enough(s, ins, outs, devices):
            found.append(s)
    return found


def _big_enough(s: Strategy, ins: Shapes, outs: Shapes, devices: int) -> bool:
    for placement, shape in zip((*s.inputs, *s.outputs), (*ins, *outs)):
        d = shard_dim(placement)
        if d is not None and (d >= len(shape) or shape[d] < devices):
            return False
    return True


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _arg(op: AtenOp, i: int, key: str, default: Any = None) -> Any:
    if key in op.kwargs:
        return op.kwargs[key]
    return op.args[i] if len(op.args) > i else default


# ----------------------------------------------------------------------------- elementwise

_LINEAR_UNARY = {"contiguous", "clone", "to", "_to_copy", "neg", "alias", "lift_fresh_copy", "detach"}
_LINEAR_BINARY = {"add", "sub"}
_SCALE = {"mul", "div"}


def _broadcast_strategies(ins: Shapes, out: list[int], n_out: int) -> list[Strategy]:
    found = []
    for d in range(len(out)):
        places = []
        for shape in ins:
            k = d - (len(out) - len(shape))  # aligned from the right (broadcasting)
            places.append(shard(k) if k >= 0 and shape[k] == out[d] else REPLICATED)
        if any(p != REPLICATED for p in places):
            found.append(Strategy(tuple(places), tuple(shard(d) for _ in range(n_out)), True))
    return found


@rule("add", "sub", "mul", "div", "gelu", "relu", "silu", "tanh", "sigmoid", "native_dropout",
      "dropout", "contiguous", "clone", "to", "_to_copy", "neg", "lt", "le", "gt", "ge", "eq", "ne",
      "where", "pow", "rsqrt", "sqrt", "exp", "log", "alias", "detach", "lift_fresh_copy",
      "masked_fill", "abs", "__and__", "__or__", "bitwise_and", "bitwise_or", "logical_and", "logical_or",
      "logical_not", "bitwise_not", "minimum", "maximum", "clamp", "clamp_min", "clamp_max", "floor", "ceil",
      "reciprocal", "square", "sin", "cos", "type_as", "detach_", "add_", "mul_", "div_", "sub_", "isinf",
      "isnan", "isfinite", "floor_divide", "remainder")
def elementwise(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    found = _broadcast_strategies(ins, outs[0], len(outs))
    n = len(ins)
    if op.kind in _LINEAR_UNARY and n == 1:
        found.append(Strategy((PARTIAL,), (PARTIAL,), True))
    elif op.kind in _LINEAR_BINARY and n == 2:
        found.append(Strategy((PARTIAL, PARTIAL), (PARTIAL,), True))
    elif op.kind in _SCALE and n >= 1:
        # (sum_i x_i) * y = sum_i (x_i * y): one partial factor, the other replicated
        found.append(Strategy((PARTIAL, *(REPLICATED,) * (n - 1)), (PARTIAL,), True))
        if op.kind == "mul" and n == 2:
            found.append(Strategy((REPLICATED, PARTIAL), (PARTIAL,), True))
    return found


# ----------------------------------------------------------------------------- einsum family


def _einsum_strategies(inputs: list[str], output: str, sizes: dict[str, int]) -> list[Strategy]:
    """Strategies of ``inputs -> output`` (einsum subscripts, one string per operand).

    For each letter: operands holding it are sharded where it sits, the others replicated;
    the output is sharded where the letter sits, or partial when the letter is summed over.
    One partial operand with the others replicated gives a partial output (einsum is linear in
    each operand).
    """
    found = []
    for letter in dict.fromkeys("".join(inputs)):
        if sizes[letter] < 2:
            continue
        places = tuple(shard(s.index(letter)) if letter in s else REPLICATED for s in inputs)
        out = shard(output.index(letter)) if letter in output else PARTIAL
        found.append(Strategy(places, (out,), True))
    for i in range(len(inputs)):
        places = tuple(PARTIAL if j == i else REPLICATED for j in range(len(inputs)))
        found.append(Strategy(places, (PARTIAL,), True))
    return found


def _letters(shapes: Shapes, subs: list[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for s, shape in zip(subs, shapes):
        for c, n in zip(s, shape):
            sizes[c] = n
    return sizes


@rule("einsum")
def einsum(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    eq = str(op.args[0]).replace(" ", "")
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if "..." in eq or len(subs) != len(ins):
        return []  # ellipsis einsums run redundantly
    return _einsum_strategies(subs, out, _letters(ins, subs))


def _batch_letters(n: int) -> str:
    return string.ascii_lowercase[:n]


@rule("linear")
def linear(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """``y[..., n] = x[..., k] W[n, k]^T + b[n]``: the einsum ``...k,nk->...n`` plus the bias,
    which follows ``n`` (sharded with it, else replicated) and is kept on one device (``P``)
    when ``k`` is split and the output is partial (Megatron adds it after the all-reduce)."""
    x = ins[0]
    batch = _batch_letters(len(x) - 1)
    subs, out = [batch + "K", "NK"], batch + "N"
    found = _einsum_strategies(subs, out, _letters(ins[:2], subs))
    if len(ins) < 3:
        return found
    with_bias = []
    for s in found:
        d_w = shard_dim(s.inputs[1])
        bias = shard(0) if d_w == 0 else PARTIAL if s.outputs[0] == PARTIAL else REPLICATED
        with_bias.append(Strategy((*s.inputs, bias), s.outputs, True))
    return with_bias


@rule("mm", "bmm", "matmul")
def matmul(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    a, b = ins
    if len(a) < 2 or len(b) < 2:
        return []
    batch = _batch_letters(max(len(a), len(b)) - 2)
    sa = batch[len(batch) - (len(a) - 2):] + "MK"
    sb = batch[len(batch) - (len(b) - 2):] + "KN"
    if any(x != y for c in batch for x, y in [(_size(c, sa, a), _size(c, sb, b))] if x and y):
        return []  # broadcast batch dimensions stay replicated
    return _einsum_strategies([sa, sb], batch + "MN", _letters([a, b], [sa, sb]))


def _size(c: str, subs: str, shape: list[int]) -> int:
    return shape[subs.index(c)] if c in subs else 0


@rule("addmm")
def addmm(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """``bias + a @ b`` (bias ``[n]`` or ``[m, n]``): as linear with ``b`` already transposed."""
    bias, a, b = ins
    found = []
    for letter, pa, pb, out in (("M", shard(0), REPLICATED, shard(0)), ("N", REPLICATED, shard(1), shard(1)),
                                ("K", shard(1), shard(0), PARTIAL)):
        if letter == "M":
            pbias = shard(0) if len(bias) == 2 and bias[0] == a[0] else REPLICATED
        elif letter == "N":
            pbias = shard(len(bias) - 1) if bias[-1] == b[1] else REPLICATED
        else:
            pbias = PARTIAL
        found.append(Strategy((pbias, pa, pb), (out,), True))
    return found


# ----------------------------------------------------------------------------- normalisation


@rule("layer_norm", "native_layer_norm")
def layer_norm(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    x = ins[0]
    normalized = len(_arg(op, 1, "normalized_shape", [x[-1]]))
    rest = (REPLICATED,) * (len(ins) - 1)  # weight, bias
    return [Strategy((shard(d), *rest), tuple(shard(d) for _ in outs), True)
            for d in range(len(x) - normalized)]


def _all_but(op: AtenOp, ins: Shapes, outs: Shapes, dim: int) -> list[Strategy]:
    x = ins[0]
    dim = _dim(dim, len(x))
    rest = (REPLICATED,) * (len(ins) - 1)
    return [Strategy((shard(d), *rest), tuple(shard(d) for _ in outs), True)
            for d in range(len(x)) if d != dim]


@rule("softmax", "_softmax", "log_softmax", "_log_softmax")
def softmax(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    return _all_but(op, ins, outs, int(_arg(op, 1, "dim")))


@rule("topk")
def topk(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """Top-k gating: every dimension but the one the k best are chosen along."""
    return _all_but(op, ins, outs, int(_arg(op, 2, "dim", -1)))


@rule("cumsum")
def cumsum(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """A prefix sum (MoE capacity positions) along a sharded dimension would need the previous
    devices' totals: only the other dimensions shard; it is linear, so partial passes through."""
    return _all_but(op, ins, outs, int(_arg(op, 1, "dim"))) + [Strategy((PARTIAL,), (PARTIAL,), True)]


@rule("scatter")
def scatter(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """``self.scatter(dim, index, src|value)``: every dimension but `dim`, on self and index."""
    dim = _dim(int(_arg(op, 1, "dim")), len(ins[0]))
    found = []
    for d in range(len(ins[0])):
        if d != dim and all(len(s) > d and s[d] == ins[0][d] for s in ins):
            found.append(Strategy(tuple(shard(d) for _ in ins), (shard(d),), True))
    return found


@rule("scaled_dot_product_attention")
def attention(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """q, k, v ``[..., s, d]``: the leading (batch, head) dimensions shard together; a mask, if
    any, too where it has that dimension."""
    q = ins[0]
    found = []
    for d in range(len(q) - 2):
        if all(len(s) == len(q) and s[d] == q[d] for s in ins[:3]):
            places = tuple(shard(d) if len(s) == len(q) and s[d] == q[d] else REPLICATED for s in ins)
            found.append(Strategy(places, tuple(shard(d) for _ in outs), True))
    return found


@rule("conv2d", "convolution")
def conv2d(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """x ``[N, C, H, W]``, w ``[O, C/g, kh, kw]``, b ``[O]``: batch (data parallel), output
    channels (weight rows, bias with them), input channels (partial; bias on one device).
    Spatial sharding would need halo exchanges and is not offered."""
    groups = int(_arg(op, 6, "groups", 1) if op.kind == "conv2d" else _arg(op, 8, "groups", 1))
    bias = len(ins) == 3
    b = lambda p: (p,) if bias else ()  # noqa: E731
    found = [Strategy((shard(0), REPLICATED, *b(REPLICATED)), (shard(0),), True)]
    if groups == 1:
        found.append(Strategy((REPLICATED, shard(0), *b(shard(0))), (shard(1),), True))
        found.append(Strategy((shard(1), shard(1), *b(PARTIAL)), (PARTIAL,), True))
    return found


@rule("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "max_pool2d_with_indices")
def pool2d(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    found = [Strategy((shard(d),), tuple(shard(d) for _ in outs), True) for d in range(len(ins[0]) - 2)]
    if op.kind in ("avg_pool2d", "adaptive_avg_pool2d"):  # linear
        found.append(Strategy((PARTIAL,), (PARTIAL,), True))
    return found


@rule("triu", "tril")
def triangle(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """A causal mask's triangle is over the last two dimensions; the leading ones shard."""
    return [Strategy((shard(d),), (shard(d),), True) for d in range(len(ins[0]) - 2)]


@rule("embedding")
def embedding(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """``out[..., h] = W[ids[...], h]``: by index position (data parallel); table by columns;
    table by rows (Megatron's vocabulary-parallel embedding: each device looks up the ids in
    its rows and writes zeros elsewhere, so the output is partial)."""
    w, ids = ins
    found = [Strategy((REPLICATED, shard(d)), (shard(d),), True) for d in range(len(ids))]
    found.append(Strategy((shard(1), REPLICATED), (shard(len(ids)),), True))
    found.append(Strategy((shard(0), REPLICATED), (PARTIAL,), True))
    return found


@rule("sum", "mean")
def reduce(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    x = ins[0]
    dims = _arg(op, 1, "dim", None)
    dims = list(range(len(x))) if dims in (None, []) else [dims] if isinstance(dims, int) else dims
    dims = {_dim(int(d), len(x)) for d in dims}
    keep = bool(_arg(op, 2, "keepdim", False))
    found = [Strategy((PARTIAL,), (PARTIAL,), True)]  # linear
    for d in range(len(x)):
        if d in dims:
            if op.kind == "sum":  # a sum over a sharded dimension is a partial sum; a mean is not
                found.append(Strategy((shard(d),), (PARTIAL,), True))
        else:
            out = d if keep else d - sum(1 for r in dims if r < d)
            found.append(Strategy((shard(d),), (shard(out),), True))
    return found


# ----------------------------------------------------------------------------- creation


@rule("zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like")
def creation(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """Each device makes its own shard (no inputs, or a template read only for its shape)."""
    linear = op.kind in ("zeros", "zeros_like")  # zeros are a partial sum of zeros
    found = [Strategy(tuple(shard(d) for _ in ins), (shard(d),), True) for d in range(len(outs[0]))]
    return found + ([Strategy(tuple(PARTIAL for _ in ins), (PARTIAL,), True)] if linear else [])


@rule("new_zeros", "new_ones", "new_full", "new_empty")
def creation_from_template(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """``t.new_ones(size)``: the template gives only the dtype and device, so each device makes
    its own shard of the output from whatever piece of the template it holds (the same dimension
    where the template has it)."""
    linear = op.kind == "new_zeros"
    template = len(ins[0]) if ins else 0
    found = [Strategy(tuple(shard(d) if d < template else REPLICATED for _ in ins), (shard(d),), True)
             for d in range(len(outs[0]))]
    return found + ([Strategy(tuple(PARTIAL for _ in ins), (PARTIAL,), True)] if linear else [])


@rule("min", "max")
def min_max(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """``min.other`` / ``max.other`` (two tensors) are elementwise; ``min()`` of one tensor
    reduces it whole and stays redundant."""
    return elementwise(op, ins, outs) if len(ins) == 2 else []


@rule("index", "gather", "any", "all", "sort", "argsort", "histc", "index_put", "index_put_", "_grouped_mm",
      "transformers.grouped_mm_fallback")  # transformers' own op where _grouped_mm lacks the dtype
def made_whole(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    """Gathers at data-dependent positions (T5's relative-position lookup, BERT's token-type
    ids), whole-tensor tests (T5's fp16 overflow check ``isinf(h).any()``) and an MoE layer's
    routing -- tokens sorted by expert, counted per expert (``histc``), each expert's rows through
    its own weights (``_grouped_mm`` at the counts' offsets), scattered back (``index_put_``): a
    shard of the tokens would sort and count differently, so these run whole, redundant only."""
    return []


@rule("arange")
def arange(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    return []  # values depend on the position: made whole, then sliced for free where sharded


# ----------------------------------------------------------------------------- views


def _dim_map(src: list[int], dst: list[int]) -> dict[int, int]:
    """Dimensions of `src` that stay contiguous in `dst`: the first dimension of each group of
    dimensions whose products match (a reshape splits or merges only within a group)."""
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    return mapping
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return mapping
                gj.append(j)
                b *= dst[j]
        # sharding the outermost dimension of a group keeps every shard contiguous when one of
        # the two outermost dimensions is a multiple of the other: rows of b become rows of b*a
        # (a per row), and rows of b*a, taken a at a time, become rows of b (the rounding of
        # `plait.cost.program.round_shards` keeps linked dimensions in proportion)
        lead = next((k for k in gi if src[k] > 1), None)
        out = next((k for k in gj if dst[k] > 1), None)
        if lead is not None and out is not None and (dst[out] % src[lead] == 0 or src[lead] % dst[out] == 0):
            mapping[lead] = out
        i, j = i + 1, j + 1
    return mapping


@rule("view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze", "unflatten")
def reshape(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    mapping = _dim_map(ins[0], outs[0])
    found = [Strategy((shard(i),), (shard(j),), True) for i, j in mapping.items()]
    return found + [Strategy((PARTIAL,), (PARTIAL,), True)]


def _permutation(op: AtenOp, ndim: int) -> list[int]:
    """out dim j comes from input dim perm[j]."""
    if op.kind == "t":
        return [1, 0] if ndim == 2 else [0]
    if op.kind == "transpose":
        a, b = _dim(int(op.args[1]), ndim), _dim(int(op.args[2]), ndim)
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return [_dim(int(d), ndim) for d in op.args[1]]


@rule("transpose", "permute", "t")
def permute(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    perm = _permutation(op, len(ins[0]))
    found = [Strategy((shard(i),), (shard(perm.index(i)),), True) for i in range(len(ins[0]))]
    return found + [Strategy((PARTIAL,), (PARTIAL,), True)]


@rule("expand")
def expand(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    x, out = ins[0], outs[0]
    off = len(out) - len(x)
    return [Strategy((shard(d),), (shard(d + off),), True) for d in range(len(x)) if x[d] == out[d + off]]


@rule("select")
def select(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    dim = _dim(int(op.args[1]), len(ins[0]))
    found = [Strategy((shard(d),), (shard(d if d < dim else d - 1),), True)
             for d in range(len(ins[0])) if d != dim]
    return found + [Strategy((PARTIAL,), (PARTIAL,), True)]


@rule("slice", "split", "split_with_sizes", "chunk", "narrow")
def split(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    default = 0 if op.kind != "narrow" else None
    dim = _dim(int(_arg(op, 1 if op.kind == "slice" else 2, "dim", default)), len(ins[0]))
    if op.kind == "narrow":
        dim = _dim(int(op.args[1]), len(ins[0]))
    found = [Strategy((shard(d),), tuple(shard(d) for _ in outs), True) for d in range(len(ins[0])) if d != dim]
    return found + [Strategy((PARTIAL,), tuple(PARTIAL for _ in outs), True)]


@rule("cat")
def cat(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    dim = _dim(int(_arg(op, 1, "dim", 0)), len(outs[0]))
    found = [Strategy(tuple(shard(d) for _ in ins), (shard(d),), True)
             for d in range(len(outs[0])) if d != dim and all(len(s) == len(outs[0]) and s[d] == outs[0][d] for s in ins)]
    return found + [Strategy(tuple(PARTIAL for _ in ins), (PARTIAL,), True)]


@rule("stack")
def stack(op: AtenOp, ins: Shapes, outs: Shapes) -> list[Strategy]:
    dim = _dim(int(_arg(op, 1, "dim", 0)), len(outs[0]))
    found = [Strategy(tuple(shard(d) for _ in ins), (shard(d if d < dim else d + 1),), True)
             for d in range(len(ins[0]))]
    return found + [Strategy(tuple(PARTIAL for _ in ins), (PARTIAL,), True)]


# ----------------------------------------------------------------------------- running a shard


def resolve(target: str) -> Any:
    """The torch op of a target string: "aten.linear.default" -> torch.ops.aten.linear.default."""
    ns, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


_SHAPE_ARG = {"view": 1, "reshape": 1, "_unsafe_view": 1, "expand": 1}
_SIZE_ARG = {"zeros": 0, "ones": 0, "empty": 0, "full": 0,
             "new_zeros": 1, "new_ones": 1, "new_empty": 1, "new_full": 1}
# Creation ops whose size is an argument: the caller passes each device's shard as `out_shape`.
SIZED_CREATION = frozenset(_SIZE_ARG)


def local_call(op: AtenOp, strategy: Strategy, local_inputs: Sequence[torch.Tensor], graph: AtenGraph,
               out_shape: Sequence[int] | None = None, row_offset: int = 0) -> list[torch.Tensor]:
    """Run `op` on one device's inputs under `strategy`; its outputs (as `op.outputs`).

    Shape arguments are rewritten to the local shape: a view/reshape/expand's output dimension
    that is sharded takes the size its input's sharded dimension implies; a creation op takes
    `out_shape` (the caller's shard of the output, from `shard_sizes`). A vocabulary-parallel
    embedding (table sharded by rows) needs the device's first row, `row_offset`."""
    if op.kind == "embedding" and strategy.inputs[0] == shard(0):
        return [_vocab_parallel_embedding(local_inputs[0], local_inputs[1], row_offset)]
    it = iter(local_inputs)
    # a device the capture recorded (`aten.to.device`'s positional device: "meta" when the graph
    # was captured on the meta device, as the planner captures it) is this rank's
    here = next((str(x.device) for x in local_inputs if isinstance(x, torch.Tensor)), "cpu")

    def sub(a: Any) -> Any:
        if isinstance(a, dict) and set(a) == {"t"}:
            return next(it)
        if isinstance(a, list):
            return [sub(x) for x in a]
        if isinstance(a, str) and (a in ("meta", "cpu") or a.startswith("cuda")):
            return here
        if isinstance(a, str) and isinstance(getattr(torch, a, None), torch.dtype):
            return getattr(torch, a)  # the capture wrote dtypes by name (softmax's, to's, arange's)
        return a

    args = [sub(a) for a in op.args]
    kwargs = {k: sub(v) for k, v in op.kwargs.items() if k not in ("device", "layout", "pin_memory")}
    if op.kind in _SHAPE_ARG:
        args[_SHAPE_ARG[op.kind]] = _local_view_shape(op, strategy, local_inputs[0], graph)
    if op.kind in _SIZE_ARG and out_shape is not None:
        args[_SIZE_ARG[op.kind]] = list(out_shape)
    if op.kind in _SIZE_ARG:
        kwargs["device"] = "cpu"
    if op.kind == "histc" and here == "cpu" and not args[0].is_floating_point():
        # the graph holds the GPU's integer histc (captured on the meta device); CPU counts floats
        return [torch.histc(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)]
    out = resolve(op.target)(*args, **kwargs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _vocab_parallel_embedding(table: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """Megatron's VocabParallelEmbedding: look up the ids in this device's rows, zeros elsewhere."""
    local = ids - first
    mine = (local >= 0) & (local < table.shape[0])
    out = torch.nn.functional.embedding(local.clamp(0, table.shape[0] - 1), table)
    return out * mine.unsqueeze(-1).to(out.dtype)


def _local_view_shape(op: AtenOp, strategy: Strategy, x: torch.Tensor, graph: AtenGraph) -> list[int]:
    gin = graph.tensors[op.inputs[0]].shape
    gout = list(graph.tensors[op.outputs[0]].shape)
    d_in, d_out = shard_dim(strategy.inputs[0]), shard_dim(strategy.outputs[0])
    if d_in is not None and d_out is not None:
        gout[d_out] = x.shape[d_in] * gout[d_out] // gin[d_in]
    return gout


def all_rules() -> list[str]:
    return sorted(RULES)
