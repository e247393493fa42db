"""Megatron-style tensor parallelism for transformer layers (Shoeybi et al. 2019, §3).

Inside a layer marked with `plait_tp` submodules:

* a `"column"` linear keeps a slice of its output features; its input passes through
  **f** (identity forward, all-reduce of the gradient backward);
* a `"row"` linear keeps the matching slice of its input features; its partial output
  passes through **g** (all-reduce forward, identity backward) and the bias is added
  once, after the reduction;
* `"sharded"` modules (attention core, MLP activation) run on the local slice; an
  attribute that counts heads (`n_head`, `num_heads`, ...) is set to the local count;
* a `"column_gather"` / `"row_split"` linear is cut alone (transformers' `colwise_gather_output`
  / `rowwise_split_input`): its output features' slice, all-gathered (backward: its slice of the
  gradient; its input through f) / its slice of its whole input (backward: the slices'
  gradients all-gathered), its partial output through g -- the ops around it run whole.

Attention linears are cut in whole heads; Megatron (and the zoo) order fused QKV
features (head, {q,k,v}, head_dim), so a contiguous slice holds q, k and v of its heads
(a model with a [q | k | v] layout sets `plait_tp_chunks = 3` on the linear). Slices follow
`plan.tp_ratios` when given (HAP-style uneven shards); a group of row linears alone (BERT's
`attention.output.dense`) is cut in the heads of the column group before it. Embeddings and the
LM head stay replicated (every tensor rank computes them): vocabulary-parallel embedding and
cross-entropy are not implemented; a column-marked table inside an attention (T5's
relative-position bias, buckets x heads) keeps its rank's heads (`ColumnParallelEmbedding`).

**Sequence parallelism** (Korthikanti et al. 2022, §4.2.2), `TPContext.sequence_parallel`:
between the tensor-parallel regions (LayerNorms, bias-dropout-add, residuals) each tensor
rank holds 1/tp of the sequence instead of a replica. f becomes **g-bar**: all-gather along
the sequence forward, reduce-scatter backward; g becomes **g**: reduce-scatter forward,
all-gather backward -- the same bytes as the two all-reduces they replace. The row bias is
added after the reduce-scatter, on the shard. A run of consecutive tensor-parallel layers is
one sequence-parallel region (`apply_sequence_parallel`): the input of its first layer is split
(backward: all-gather), the output of its last layer all-gathered (backward: split, since the
replicated layer after it computes the same full gradient on every rank); inside the region,
and across a pipeline cut between two such layers, hidden states stay sharded. Parameters of
the region that tensor parallelism does not cut (LayerNorm weights, row biases) see only
their rank's tokens, so their gradients are summed over the tensor group after backward
(`sequence_parallel_params`; Megatron's `allreduce_sequence_parallel_grads`). Activations are
sequence-first (`[s, b, h]`, the zoo's and Megatron's layout); a layer may set
`plait_seq_dim` to name another dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.graph.tp_plan import is_conv1d, tensor_parallel_style
from plait.runtime.comm import Group, NullGroup
from plait.runtime.partition import RuntimeSetupError

HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "heads", "num_attention_heads")
WIDTH_ATTRS = ("split_size",)
KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "kv_heads", "num_key_value_heads")


@dataclass
class TPContext:
    """The tensor group of a layer (the facade's "tp" group: its calls are spans and records;
    a `NullGroup` to time one tensor rank's compute alone)."""

    group: Group | NullGroup | None
    size: int
    rank: int
    sequence_parallel: bool = False
    seq_dim: int = 0  # the sequence dimension of activations between layers ([s, b, h])

    def all_reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        t = t.contiguous()
        assert self.group is not None
        self.group.all_reduce(t, name, "comm_tp")
        return t

    # Sequence-parallel collectives concatenate / cut along `seq_dim`. They are recorded under
    # "comm_tp", the category the simulator gives the same all-gathers and reduce-scatters.
    def all_gather(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """[.., s/tp, ..] on every rank -> [.., s, ..] (rank order along the sequence)."""
        x = t.movedim(self.seq_dim, 0).contiguous()
        out = x.new_empty((x.shape[0] * self.size, *x.shape[1:]))
        assert self.group is not None
        self.group.all_gather_into(out, x, name, "comm_tp")
        return out.movedim(0, self.seq_dim)

    def reduce_scatter(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """[.., s, ..] partial sums -> this rank's [.., s/tp, ..] slice of their sum."""
        x = t.movedim(self.seq_dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        assert self.group is not None
        self.group.reduce_scatter(out, x, name, "comm_tp")
        return out.movedim(0, self.seq_dim)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/tp of the sequence (no communication)."""
        n = t.shape[self.seq_dim]
        if n % self.size:
            raise RuntimeSetupError(f"plan field 'sequence_parallel': the sequence length {n} does not divide "
                                    f"by tp={self.size} (sequence parallelism cuts the sequence into tp equal parts)")
        k = n // self.size
        return t.narrow(self.seq_dim, self.rank * k, k).contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce the input gradient backward (Megatron eq. 3)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_reduce(grad.clone(), "allreduce tp f-bwd"), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        return tp.all_reduce(x.clone(), "allreduce tp g-fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _gather_features(tp: TPContext, t: torch.Tensor, name: str) -> torch.Tensor:
    """[..., F/tp] on every rank -> [..., F] (rank order along the last dimension)."""
    x = t.movedim(-1, 0).contiguous()
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    assert tp.group is not None
    tp.group.all_gather_into(out, x, name, "comm_tp")
    return out.movedim(0, -1)


def _my_features(tp: TPContext, t: torch.Tensor) -> torch.Tensor:
    k = t.shape[-1] // tp.size
    return t.narrow(-1, tp.rank * k, k).contiguous()


class _GatherFeatures(torch.autograd.Function):
    """A gathered column's output (transformers' ``colwise_gather_output``): all-gather the
    features forward; backward keeps this rank's slice of the (whole, equal) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return _gather_features(tp, x, "allgather tp column-out")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _my_features(ctx.tp, grad), None


class _SplitFeatures(torch.autograd.Function):
    """A split row's input (``rowwise_split_input``): this rank's slice forward; backward
    all-gathers the slices' gradients into the whole input's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return _my_features(tp, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_features(ctx.tp, grad, "allgather tp row-in-bwd"), None


class _GatherSeqForLinear(torch.autograd.Function):
    """g-bar of sequence parallelism (Korthikanti et al. 2022, fig. 5): all-gather the sequence
    forward, reduce-scatter the (partial, per-rank) input gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return tp.all_gather(x, "allgather tp sp-fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.reduce_scatter(grad, "reducescatter tp sp-bwd"), None


class _ReduceScatterSeq(torch.autograd.Function):
    """g of sequence parallelism: reduce-scatter the partial outputs forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return tp.reduce_scatter(x, "reducescatter tp sp-fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_gather(grad, "allgather tp sp-bwd"), None


class _EnterSeqRegion(torch.autograd.Function):
    """Into a sequence-parallel region from a replicated one: keep this rank's slice forward;
    backward all-gather the slices' gradients (Megatron's scatter_to_sequence_parallel_region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return tp.split(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_gather(grad, "allgather tp sp-enter-bwd"), None


class _LeaveSeqRegion(torch.autograd.Function):
    """Out of a sequence-parallel region into a replicated one: all-gather forward; every rank
    then computes the same full gradient, so backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return tp.all_gather(x, "allgather tp sp-leave-fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.split(grad), None


class ColumnParallelLinear(nn.Module):
    """`transposed`: the weight is stored [in, out] as transformers' Conv1D stores it (GPT-2), so
    the parameter keeps the model's own layout and name."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPContext,
                 transposed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.tp = tp
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight
        if self.tp.sequence_parallel:
            return F.linear(_GatherSeqForLinear.apply(x, self.tp), w, self.bias)
        return F.linear(_CopyToTP.apply(x, self.tp), w, self.bias)


class _LinearAlone(nn.Module):
    """This rank's weight (and bias) of a linear cut alone, and its tensor group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.tp = tp


class GatheredColumnLinear(_LinearAlone):
    """A column linear cut alone: this rank's output features, all-gathered, so what follows runs
    on the whole output; its input passes through f (each rank's input gradient is partial)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherFeatures.apply(F.linear(_CopyToTP.apply(x, self.tp), self.weight, self.bias), self.tp)


class SplitRowLinear(_LinearAlone):
    """A row linear cut alone: it takes this rank's slice of its whole input, its partial output is
    all-reduced (g) and the bias added once (the bias is whole)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromTP.apply(F.linear(_SplitFeatures.apply(x, self.tp), self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class ColumnParallelEmbedding(nn.Module):
    """A table cut along its embedding dimension (T5's relative-position bias, buckets x heads, cut
    by heads): each rank looks up its own columns. Its input is indices, so no f is needed."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight)


class RowParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPContext,
                 transposed: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.tp = tp
        self.transposed = transposed  # stored [in, out] (Conv1D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = _ReduceScatterSeq if self.tp.sequence_parallel else _ReduceFromTP
        y = reduce.apply(F.linear(x, self.weight.t() if self.transposed else self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


def split_sizes(total: int, parts: int, ratios: list[float] | None) -> list[int]:
    """Integer sizes summing to `total`: equal, or proportional to `ratios` (largest remainder)."""
    if ratios is None:
        if total % parts:
            raise RuntimeSetupError(f"tensor parallel: {total} does not divide into tp={parts} equal parts")
        return [total // parts] * parts
    exact = [r * total for r in ratios]
    sizes = [int(x) for x in exact]
    for i in sorted(range(parts), key=lambda i: sizes[i] - exact[i])[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


@dataclass(frozen=True)
class ShardInfo:
    """How a full parameter is cut across tensor ranks: along `dim`, in `chunks` fused blocks,
    block b of rank t being [b*block + start_t, b*block + start_t + size_t)."""

    dim: int
    chunks: int
    sizes: tuple[int, ...]  # per tensor rank, within one block

    def ranges(self, t: int) -> list[tuple[int, int]]:
        block = sum(self.sizes)
        start = sum(self.sizes[:t])
        return [(b * block + start, b * block + start + self.sizes[t]) for b in range(self.chunks)]

    def take(self, full: torch.Tensor, t: int) -> torch.Tensor:
        return torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges(t)], dim=self.dim).clone()

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `take`: the full tensor from every rank's shard."""
        blocks = []
        for b in range(self.chunks):
            for t, s in enumerate(shards):
                blocks.append(s.narrow(self.dim, b * self.sizes[t], self.sizes[t]))
        return torch.cat(blocks, dim=self.dim)


def _find_int_attr(modules: list[nn.Module], names: tuple[str, ...]) -> tuple[nn.Module, str, int] | None:
    for m in modules:
        for a in names:
            v = getattr(m, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return m, a, v
    return None


def is_tensor_parallel_layer(layer: nn.Module) -> bool:
    """A layer with both column- and row-parallel linears (a transformer block), or with experts
    its plan cuts (an MoE block whose attention the plan leaves whole, as OLMoE's gathers it).

    A lone column linear (the LM head's vocabulary projection) stays replicated: splitting it
    would need a vocabulary-parallel cross-entropy, which is not implemented."""
    return tensor_parallel_style(layer) == "transformer"  # the capture's rule: one rule for both


def apply_tensor_parallel(layer: nn.Module, tp: TPContext, ratios: list[float] | None,
                          prefix: str = "") -> dict[str, ShardInfo]:
    """Shard one transformer layer in place; returns {param name: ShardInfo} for its cut params.

    Modules are grouped by their parent (`attn`, `mlp`). In a group whose sharded module has a
    `head_dim` (or a head count), every linear is cut in whole heads: H = row input / head_dim
    heads are dealt to the ranks (evenly or by `ratios`) and a column linear's output is cut
    contiguously in proportion -- Megatron orders fused QKV features (head, {q,k,v}, head_dim),
    so such a slice holds q, k and v of its heads. Other groups (the MLP) are cut in features.
    A column linear with `plait_tp_chunks = c` has c fused blocks [block0 | block1 | ...] and
    is cut block by block instead."""
    infos: dict[str, ShardInfo] = {}
    for name, m in list(layer.named_modules()):
        style = getattr(m, "plait_tp", None)
        if style == "experts":
            infos.update(shard_experts(m, tp, ratios, f"{prefix}{name}"))
        elif style in ("column_gather", "row_split"):
            infos.update(_cut_alone(layer, name, m, tp, ratios, prefix))
    fed_by: tuple[int, list[int]] | None = None  # heads of the last group with columns: its rows' cut
    for parent, members in _marked_groups(layer).items():
        if not any(m.plait_tp in ("column", "row") for m in members.values()):
            continue  # sharded modules alone (the attention under a block): cut with their own linears
        parent_mod = layer.get_submodule(parent) if parent else layer
        where = f"{prefix}{parent}" or "layer"
        sharded = [m for m in members.values() if m.plait_tp == "sharded"]
        cut = _group_cut(members, sharded, parent_mod, fed_by, tp, ratios, where)
        for name, m in members.items():
            if m.plait_tp == "sharded":
                continue
            infos.update(_cut_linear(layer, name, m, tp, ratios, prefix, cut))
        heads, head_sizes = cut.heads, cut.head_sizes
        if any(m.plait_tp == "column" for m in members.values()):
            fed_by = (heads, head_sizes) if heads is not None and head_sizes is not None else None
        # Cores that store their head counts (rather than infer them from the width) get the local ones.
        if heads is not None and head_sizes is not None:
            _localize_heads(sharded + [parent_mod], heads, head_sizes, tp, ratios)
    return infos


@dataclass(frozen=True)
class _GroupCut:
    """How one parent's column and row linears are cut: in whole heads (`heads` dealt to the ranks
    as `head_sizes`), or in features (`heads` None)."""

    where: str  # the group's name in errors
    heads: int | None
    head_sizes: list[int] | None
    head_dim: tuple[nn.Module, str, int] | None  # (module, attribute, value) of the group's head_dim


def _marked_groups(layer: nn.Module) -> dict[str, dict[str, nn.Module]]:
    """The layer's "column", "row" and "sharded" modules by parent name (`attn`, `mlp`)."""
    marked = {n: m for n, m in layer.named_modules() if getattr(m, "plait_tp", None) in ("column", "row", "sharded")}
    groups: dict[str, dict[str, nn.Module]] = {}
    for name, m in marked.items():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        groups.setdefault(parent, {})[name] = m
    return groups


def _group_cut(members: dict[str, nn.Module], sharded: list[nn.Module], parent_mod: nn.Module,
               fed_by: tuple[int, list[int]] | None, tp: TPContext, ratios: list[float] | None,
               where: str) -> _GroupCut:
    """The group's heads (from a `head_dim`, a head count, or the column group before it) and
    each rank's share of them."""
    rows = [m for m in members.values() if m.plait_tp == "row"]
    head_dim = _find_int_attr(sharded + [parent_mod], ("head_dim",))
    head_attr = _find_int_attr(sharded + [parent_mod], HEAD_ATTRS)
    heads: int | None = None
    if head_dim is not None and rows and isinstance(rows[0], nn.Linear):
        heads = rows[0].in_features // head_dim[2]
    elif head_attr is not None:
        heads = head_attr[2]
    only_rows = all(m.plait_tp in ("row", "sharded") for m in members.values())
    if heads is None and only_rows and fed_by is not None and rows:
        heads = fed_by[0]  # BERT: attention.output.dense is cut as attention.self's heads were
    head_sizes = None
    if heads is not None:
        if ratios is None and heads % tp.size:
            raise RuntimeSetupError(f"tensor parallel: {where} has {heads} heads, not divisible by tp={tp.size}")
        head_sizes = split_sizes(heads, tp.size, ratios)
        if min(head_sizes) < 1:
            raise RuntimeSetupError(f"tensor parallel: {where}: tp_ratios {ratios} leave a rank without heads")
    return _GroupCut(where, heads, head_sizes, head_dim)


def _cut_linear(layer: nn.Module, name: str, m: nn.Module, tp: TPContext, ratios: list[float] | None,
                prefix: str, cut: _GroupCut) -> dict[str, ShardInfo]:
    """A column or row linear (or a column-marked embedding table) of a group replaced by this
    rank's cut; returns the ShardInfos of its cut parameters."""
    infos: dict[str, ShardInfo] = {}
    table = isinstance(m, nn.Embedding) and m.plait_tp == "column"
    conv1d = is_conv1d(m)  # stored [in, out]: cut along the other dimension, same layout kept
    if not isinstance(m, nn.Linear) and not table and not conv1d:
        raise RuntimeSetupError(f"tensor parallel: {prefix}{name} is marked {m.plait_tp!r} but is a "
                                f"{type(m).__name__}, not nn.Linear")
    out_features, in_features = (m.weight.shape[1], m.weight.shape[0]) if conv1d or table else \
        (m.out_features, m.in_features)
    width = out_features if m.plait_tp == "column" else in_features
    chunks = int(getattr(m, "plait_tp_chunks", 1)) if m.plait_tp == "column" else 1
    sizes = _feature_sizes(name, prefix, width // chunks, tp, ratios, cut)
    if table:
        info = ShardInfo(1, 1, tuple(sizes))
        new: nn.Module = ColumnParallelEmbedding(info.take(m.weight.data, tp.rank))
    elif m.plait_tp == "column":
        info = ShardInfo(1 if conv1d else 0, chunks, tuple(sizes))
        w = info.take(m.weight.data, tp.rank)
        bias_info = ShardInfo(0, chunks, tuple(sizes))
        b = bias_info.take(m.bias.data, tp.rank) if m.bias is not None else None
        new = ColumnParallelLinear(w, b, tp, transposed=conv1d)
        if b is not None:
            infos[f"{prefix}{name}.bias"] = bias_info
    else:
        info = ShardInfo(0 if conv1d else 1, 1, tuple(sizes))
        w = info.take(m.weight.data, tp.rank)
        new = RowParallelLinear(w, m.bias.data.clone() if m.bias is not None else None, tp, transposed=conv1d)
    infos[f"{prefix}{name}.weight"] = info
    for attr in ("plait_tp", "plait_selective", "plait_tp_chunks"):
        if hasattr(m, attr):
            setattr(new, attr, getattr(m, attr))
    _set_submodule(layer, name, new)
    return infos


def _feature_sizes(name: str, prefix: str, per_block: int, tp: TPContext, ratios: list[float] | None,
                   cut: _GroupCut) -> list[int]:
    """Each rank's features of one fused block of a linear: whole heads' worth, or features split alone."""
    heads, head_sizes, head_dim, where = cut.heads, cut.head_sizes, cut.head_dim, cut.where
    if head_sizes is not None:
        assert heads is not None
        if per_block % heads:
            raise RuntimeSetupError(f"tensor parallel: {prefix}{name} has {per_block} features, not a "
                                    f"multiple of the {heads} heads of {where}")
        sizes = [h * (per_block // heads) for h in head_sizes]
        if name.rsplit(".", 1)[-1] == "kv" and head_dim is not None and any(s % (2 * head_dim[2]) for s in sizes):
            raise RuntimeSetupError(f"tensor parallel: {prefix}{name}: the key/value heads do not divide "
                                    f"over tp={tp.size} (grouped-query attention needs kv_heads % tp == 0)")
    else:
        sizes = split_sizes(per_block, tp.size, ratios)
    return sizes


def _localize_heads(mods: list[nn.Module], heads: int, head_sizes: list[int], tp: TPContext,
                    ratios: list[float] | None) -> None:
    """Head counts, head widths and (even cuts only) key/value head counts stored as attributes
    set to this rank's."""
    for m in mods:
        for a in HEAD_ATTRS:
            if getattr(m, a, None) == heads:
                setattr(m, a, head_sizes[tp.rank])
        hd = _find_int_attr([m], ("head_dim",))
        for a in WIDTH_ATTRS:  # widths of all heads kept as attributes (GPT-2's split of [q | k | v])
            if hd is not None and getattr(m, a, None) == heads * hd[2]:
                setattr(m, a, head_sizes[tp.rank] * hd[2])
        kv = _find_int_attr([m], KV_HEAD_ATTRS)
        if kv is not None and kv[2] % tp.size == 0 and ratios is None:
            setattr(m, kv[1], kv[2] // tp.size)


def _cut_alone(layer: nn.Module, name: str, m: nn.Module, tp: TPContext, ratios: list[float] | None,
               prefix: str) -> dict[str, ShardInfo]:
    """A ``"column_gather"`` / ``"row_split"`` linear replaced by its cut (`GatheredColumnLinear`,
    `SplitRowLinear`): even slices of its output / input features."""
    path = f"{prefix}{name}"
    if not isinstance(m, nn.Linear):
        raise RuntimeSetupError(f"tensor parallel: {path} is marked {m.plait_tp!r} but is a {type(m).__name__}, "
                                "not nn.Linear")
    if ratios is not None:
        raise RuntimeSetupError(f"plan field 'tp_ratios': {path} is cut with its output gathered or input split "
                                "(its model's plan), which takes even slices only")
    if m.plait_tp == "column_gather":
        sizes = tuple(split_sizes(m.out_features, tp.size, None))
        info = ShardInfo(0, 1, sizes)
        b = info.take(m.bias.data, tp.rank) if m.bias is not None else None
        new: nn.Module = GatheredColumnLinear(info.take(m.weight.data, tp.rank), b, tp)
        out = {f"{path}.weight": info} | ({f"{path}.bias": info} if b is not None else {})
    else:
        sizes = tuple(split_sizes(m.in_features, tp.size, None))
        info = ShardInfo(1, 1, sizes)
        new = SplitRowLinear(info.take(m.weight.data, tp.rank), m.bias.data.clone() if m.bias is not None else None,
                             tp)
        out = {f"{path}.weight": info}
    new.plait_tp = m.plait_tp
    _set_submodule(layer, name, new)
    return out


def shard_experts(m: nn.Module, tp: TPContext, ratios: list[float] | None, path: str) -> dict[str, ShardInfo]:
    """Cut an `"experts"` module (`plait.graph.tp_plan`: fused [gate | up] and down tensors of
    every expert, `plait_tp_experts` = {tensor: the intermediate features' dimension}) as Megatron
    cuts an MLP, expert by expert: each rank keeps its slice of every expert's intermediate
    features -- the gate half and the up half of the fused tensor alike, and the down tensor's
    matching input features -- so each expert's output on a rank is a partial sum. The inputs pass
    through f (identity forward, all-reduce of the gradient backward: the hidden states and the
    routing weights, whose gradients are partial too) and the output through g (all-reduce
    forward), as transformers' ``moe_tp_experts``. Returns {param name: ShardInfo}."""
    if tp.sequence_parallel:
        raise RuntimeSetupError(f"tensor parallel: {path}: sequence parallelism with tensor-parallel experts is "
                                "not implemented (their tokens are routed per rank); plan it without "
                                "sequence_parallel")
    cut: dict[str, int] = dict(m.plait_tp_experts)
    (a, da), (b, db) = cut.items()
    fused, down = (a, b) if getattr(m, a).shape[da] == 2 * getattr(m, b).shape[db] else (b, a)
    width = getattr(m, down).shape[cut[down]]
    sizes = tuple(split_sizes(width, tp.size, ratios))
    infos = {}
    for name, chunks in ((fused, 2), (down, 1)):
        info = ShardInfo(cut[name], chunks, sizes)
        full = getattr(m, name)
        setattr(m, name, nn.Parameter(info.take(full.data, tp.rank), requires_grad=full.requires_grad))
        infos[f"{path}.{name}"] = info

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        def f(v: Any) -> Any:
            return _CopyToTP.apply(v, tp) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        return tuple(f(v) for v in args), {k: f(v) for k, v in kwargs.items()}

    def leave(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        return _ReduceFromTP.apply(out, tp) if isinstance(out, torch.Tensor) else out

    m.register_forward_pre_hook(enter, with_kwargs=True)
    m.register_forward_hook(leave)
    return infos


def _first_tensor(values: tuple[Any, ...]) -> int | None:
    return next((i for i, v in enumerate(values) if isinstance(v, torch.Tensor)), None)


def apply_sequence_parallel(layer: nn.Module, tp: TPContext, enter: bool, leave: bool) -> list[Any]:
    """Make an already tensor-parallel layer part of a sequence-parallel region.

    `enter`: the layer before it is replicated, so split its hidden-state input (its first
    tensor argument); `leave`: the layer after it is replicated, so all-gather its output (the
    first tensor of a tuple). Between two tensor-parallel layers (also across a pipeline cut)
    the hidden state stays sharded. Returns the hook handles."""
    if not tp.sequence_parallel:
        raise ValueError("apply_sequence_parallel needs a TPContext with sequence_parallel=True")
    handles: list[Any] = []
    if enter:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            i = _first_tensor(args)
            if i is None:
                return None
            return (*args[:i], _EnterSeqRegion.apply(args[i], tp), *args[i + 1:])

        handles.append(layer.register_forward_pre_hook(pre))
    if leave:
        def post(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            if isinstance(out, torch.Tensor):
                return _LeaveSeqRegion.apply(out, tp)
            if isinstance(out, tuple) and (i := _first_tensor(out)) is not None:
                return (*out[:i], _LeaveSeqRegion.apply(out[i], tp), *out[i + 1:])
            return None

        handles.append(layer.register_forward_hook(post))
    return handles


def sequence_parallel_params(layer: nn.Module, infos: dict[str, ShardInfo], prefix: str = "") -> list[nn.Parameter]:
    """Parameters of a sequence-parallel layer that tensor parallelism left whole (LayerNorms,
    row biases): each rank's gradient covers only its tokens, so they are summed over the group."""
    return [p for n, p in layer.named_parameters() if p.requires_grad and f"{prefix}{n}" not in infos]


def head_local_params(layer: nn.Module, infos: dict[str, ShardInfo], prefix: str = "") -> list[nn.Parameter]:
    """Parameters tensor parallelism left whole inside a cut region (a ``"sharded"`` module) other
    than its column/row linears' and experts': Qwen3's per-head ``q_norm`` / ``k_norm`` weights,
    shared by every head, see only this rank's heads, so each rank's gradient is its heads' part
    and the parts are summed over the group (as Megatron sums its QK-layernorm gradients)."""
    out: list[nn.Parameter] = []
    for path, m in layer.named_modules():
        if getattr(m, "plait_tp", None) != "sharded":
            continue
        for sub, child in m.named_modules():
            if getattr(child, "plait_tp", None) in ("column", "row", "experts"):
                continue
            for n, p in child.named_parameters(recurse=False):
                full = f"{prefix}{'.'.join(x for x in (path, sub, n) if x)}"
                if p.requires_grad and full not in infos and all(p is not q for q in out):
                    out.append(p)
    return out


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)
