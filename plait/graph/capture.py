"""Capture an `nn.Module` as an `OpGraph` on the meta device.

One forward and one backward pass run on meta tensors (shapes only, no data, no
real memory). Four PyTorch mechanisms do the observing:

* a `TorchDispatchMode` sees every aten op of the forward, the loss and the backward;
  its FLOPs come from `torch.utils.flop_counter.flop_registry` (the same formulas
  `FlopCounterMode` uses: 2·m·n·k per matmul, convolutions, attention kernels);
* global module forward pre/post hooks keep a stack of the modules running, so each
  forward op knows its module path and its `Layer`;
* autograd sequence numbers tie each backward op to the forward op that made it:
  every autograd node takes the next number of a per-thread counter when the forward
  op is recorded (`torch._C._autograd._get_sequence_nr()` peeks at the counter), and
  during backward `torch._C._current_autograd_node()._sequence_nr()` names the node
  that is running;
* `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd keeps for
  backward; the pack hook runs while the saving node is the newest node, so
  `counter - 1` is the saver. Saved bytes are deduplicated by storage
  (`untyped_storage()._cdata`, stable while the storage lives; the pack hook keeps
  every saved storage alive), so a tensor saved by two ops, or two views of one
  storage, count once, at the op that saved it first.

CUDA kernels: plait predicts GPU training, but on CPU and meta `F.dropout` keeps a
mask in the activation dtype (CUDA's fused `native_dropout`: 1 byte, as Korthikanti
et al. 2022 count it) and `F.scaled_dot_product_attention` takes the math path that
keeps the s x s probabilities (CUDA: flash / memory-efficient attention, O(s)). So
capture routes both to the CUDA kernels, whose meta implementations exist
(`cuda_kernels=False` keeps the CPU behaviour).

All figures are divided by the capture batch: an `OpGraph` is per sample.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from plait.errors import PlaitError
from plait.graph.layer_cut import input_signature, is_marked, layer_cut, model_inputs, pure_chains
from plait.ir.opgraph import TP_CUT_ROLES, Layer, Op, OpGraph, TiedParams

__all__ = ["CaptureError", "capture", "is_kv_cache", "layer_assignment"]


class CaptureError(PlaitError):
    """An op or module could not run on the meta device (data-dependent, or no meta kernel)."""


_peek_seq = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node

# Metadata queries: not ops of the model.
_IGNORED = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.dim.default,
    torch.ops.aten.storage_offset.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.aten.is_strides_like_format.default,
    torch.ops.aten.is_non_overlapping_and_dense.default,
    torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}

_FORWARD, _BACKWARD, _OFF = 0, 1, 2


def _sid(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it). Valid while the storage lives."""
    return t.untyped_storage()._cdata


def _tensors(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> Iterator[torch.Tensor]:
    """The tensors among aten op arguments (flat, or one level of list: cat, stack, ...)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
    if kwargs:
        yield from _tensors(tuple(kwargs.values()))


# ---------------------------------------------------------------------------- layers
@dataclass
class _ModuleInfo:
    path: str
    layer: str | None  # the Layer this module belongs to; None for containers above layers
    tp: bool  # inside a Megatron column-parallel linear or sharded region
    selective: bool  # marked plait_selective
    role: str = ""  # the nearest tensor-parallel marker above: "column", "row", "sharded", ... or ""


def layer_assignment(root: nn.Module, root_name: str = "model") -> dict[str, tuple[str, str]]:
    """{module path: (layer name, tp_style)} for every module that heads a Layer: the cut of
    `plait.graph.layer_cut.layer_cut` (marked modules; a user model's modules refined until
    a pipeline of its granularity can balance). A root with no children is one Layer named
    `root_name`."""
    return layer_cut(root, root_name).heads


def is_kv_cache(value: Any) -> bool:
    """A transformers key/value `Cache` (any subclass), recognised without importing
    transformers. T5's decoder makes one and returns it even with `use_cache` off: state that
    carries from one call into the next and that no loss reads."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.")
               for c in type(value).__mro__)


def _module_infos(root: nn.Module, heads: dict[str, tuple[str, str]]) -> dict[int, _ModuleInfo]:
    infos: dict[int, _ModuleInfo] = {}

    def walk(m: nn.Module, path: str, layer: str | None, tp: bool, role: str) -> None:
        if id(m) in infos:
            return
        if path in heads:
            layer = heads[path][0]
        style = getattr(m, "plait_tp", None)
        if style is not None:  # the nearest marker decides (a row linear ends a sharded region)
            tp = style in ("column", "sharded", "experts")  # its activations are this rank's slice
            role = style if style in TP_CUT_ROLES else ""
        infos[id(m)] = _ModuleInfo(path, layer, tp, bool(getattr(m, "plait_selective", False)), role)
        for name, child in m.named_children():
            walk(child, f"{path}.{name}" if path else name, layer, tp, role)

    walk(root, "", None, False, "")
    return infos


# ---------------------------------------------------------------------------- records
class _Rec:
    """One forward op, compact (a 175B GPT has tens of thousands)."""

    __slots__ = (
        "target", "module", "layer", "frame_sel", "tp", "role", "fwd_flops", "bwd_flops",
        "param_bytes", "param_count", "saved", "saved_tp", "saved_sel", "saved_cast", "out_bytes",
        "ins", "act", "weights",
    )  # fmt: skip

    def __init__(self, target: str, module: str, layer: str | None, frame_sel: int, tp: bool):
        self.target = target
        self.module = module
        self.layer = layer
        self.frame_sel = frame_sel
        self.tp = tp
        self.role = ""  # tensor-parallel role of the module that ran it (`_ModuleInfo.role`)
        self.fwd_flops = 0.0
        self.bwd_flops = 0.0
        self.param_bytes = 0
        self.param_count = 0
        self.saved = 0.0
        self.saved_tp = 0.0
        self.saved_sel = 0.0
        self.saved_cast = 0.0  # autocast's low-precision parameter copies saved (per forward, not per sample)
        self.out_bytes = 0
        # (producer rec index, storage id, tensor bytes) of each activation input
        self.ins: list[tuple[int, int, int]] = []
        self.act = False  # depends on the model's inputs or parameters (else a constant: masks, positions)
        self.weights = False  # reads a parameter


@dataclass
class _Frame:
    info: _ModuleInfo
    sel: int  # invocation id of the enclosing plait_selective module, -1 outside


@dataclass
class _State:
    infos: dict[int, _ModuleInfo]
    frames: list[_Frame] = field(default_factory=list)
    recs: list[_Rec] = field(default_factory=list)
    # storage id -> (producer rec index or -1, last writer rec index or -1, is activation)
    storages: dict[int, list[int]] = field(default_factory=dict)
    params: dict[int, tuple[int, int, str]] = field(
        default_factory=dict
    )  # sid -> numel, bytes, path
    used_params: set[int] = field(default_factory=set)
    buffers: set[int] = field(default_factory=set)
    seq2rec: dict[int, int] = field(default_factory=dict)
    seq_keys: list[int] = field(default_factory=list)
    last_seq: int = 0
    # saved storage id -> [saver node seq, bytes, selective frame of first saver, all savers in it]
    saved: dict[int, list[int]] = field(default_factory=dict)
    # storages autocast made by casting a parameter (its low-precision copy, one per forward) -> the
    # parameter's storage: the op computing with the copy is the one that uses the parameter
    casts: dict[int, int] = field(default_factory=dict)
    # saved cast storage id -> [saver node seq, bytes]
    saved_casts: dict[int, list[int]] = field(default_factory=dict)
    sel_inputs: dict[int, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # frame -> (sid, bytes)
    sel_first_rec: dict[int, int] = field(default_factory=dict)
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    n_sel: int = 0
    phase: int = _OFF
    bwd_last_rec: int = -1
    unattributed_bwd_flops: float = 0.0
    counters: dict[tuple[str, str], int] = field(default_factory=dict)

    def frame(self) -> _Frame | None:
        return self.frames[-1] if self.frames else None

    def where(self) -> str:
        f = self.frame()
        return f"module {f.info.path or '<root>'!r}" if f else "the loss (outside the model)"


# ---------------------------------------------------------------------------- modes
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast_low() -> torch.dtype | None:
    """The low dtype of the autocast a capture runs under (CPU autocast on fake CPU tensors), or None."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


@contextlib.contextmanager
def _autocast(low: str | None, rules: str) -> Iterator[None]:
    """The forward and the loss as torch's autocast runs them in `low`: CPU autocast over the fake CPU
    tensors the capture runs on (CUDA autocast cannot dispatch in a CPU build: a device guard for
    CUDA aborts the process), and for `rules` "cuda" the ops CUDA's autocast runs in fp32 and CPU's
    does not (`_CudaFp32Ops`)."""
    if low is None:
        yield
        return
    with torch.autocast("cpu", dtype=_LOW[low]), (_CudaFp32Ops() if rules == "cuda" else contextlib.nullcontext()):
        yield


def _fp32_funcs() -> frozenset[Any]:
    """The functions CUDA autocast runs in fp32 (torch's "autocast op reference", CUDA ops that can
    autocast to float32), as Python sees them; CPU autocast leaves norms, softmax and the
    elementwise ones among them in their input's dtype. `F.rms_norm` decomposes into two of them
    (pow, rsqrt), so its output is fp32 on CUDA too."""
    T = torch.Tensor
    names = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2", "pow",
             "prod", "reciprocal", "rsqrt", "sinh", "tan", "sum", "cumsum", "cumprod", "norm", "renorm",
             "softmax", "log_softmax", "cdist", "dist", "logsumexp")
    funcs: set[Any] = {getattr(torch, n) for n in names if hasattr(torch, n)}
    funcs |= {getattr(T, n) for n in names if hasattr(T, n)}
    funcs |= {T.__pow__, T.__rpow__, T.__rtruediv__, getattr(T, "__rdiv__", T.__rtruediv__)}
    funcs |= {getattr(F, n) for n in (
        "layer_norm", "group_norm", "rms_norm", "softmax", "softmin", "log_softmax", "softplus", "normalize",
        "cosine_similarity", "pdist", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
        "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "poisson_nll_loss", "hinge_embedding_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "multi_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "cosine_embedding_loss") if hasattr(F, n)}
    return frozenset(funcs)


class _CudaFp32Ops(TorchFunctionMode):
    """CUDA autocast's fp32 list over CPU autocast: a listed function's low-precision floating
    arguments are cast to fp32 before it runs (as CUDA's autocast casts them), so its output and
    what it saves are fp32. A call with an explicit ``dtype=`` is left alone (autocast does too)."""

    _funcs = _fp32_funcs()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._funcs and kwargs.get("dtype") is None and _autocast_low() is not None:
            def up(x: Any) -> Any:
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16) else x

            args, kwargs = tree_map(up, (args, kwargs))
        return func(*args, **kwargs)


class _CudaKernels(TorchFunctionMode):
    """Run dropout and attention through the fused kernels CUDA training uses.

    * dropout: `native_dropout` keeps a 1-byte bool mask (CPU/meta `F.dropout` keeps
      a mask in the activation dtype);
    * `F.scaled_dot_product_attention` without a mask: flash attention (fp16/bf16) or
      memory-efficient attention (fp32), which keep Q, K, V, the output and the
      log-sum-exp, O(s) per head, where the CPU/meta math path keeps the s x s
      probabilities. Grouped-query attention (fewer KV heads, ``enable_gqa=True``) takes
      the flash kernel in fp16/bf16, as on CUDA. FLOPs then follow `flop_registry`'s formulas for those kernels.
    """

    _dropout = {F.dropout, torch.dropout}
    _sdpa_args = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                  "enable_gqa")  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
            if train and 0.0 < p < 1.0 and isinstance(x, torch.Tensor) and x.is_floating_point():
                return torch.native_dropout(x, p, True)[0]
        elif func is F.scaled_dot_product_attention:
            out = self._fused_attention(dict(zip(self._sdpa_args, args), **kwargs))
            if out is not None:
                return out
        return func(*args, **kwargs)

    @staticmethod
    def _fused_attention(a: dict[str, Any]) -> torch.Tensor | None:
        q, k, v = a["query"], a["key"], a["value"]
        low = _autocast_low()
        if low is not None and all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (q, k, v)):
            # scaled_dot_product_attention is on autocast's lower-precision list: its inputs cast
            q, k, v = (t.to(low) for t in (q, k, v))
        if (
            a.get("attn_mask") is not None
            or not all(isinstance(t, torch.Tensor) for t in (q, k, v))
            or not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4))
            or q.dtype not in (torch.float16, torch.bfloat16, torch.float32)
        ):
            return None
        if q.shape[:-2] != k.shape[:-2]:
            # GQA (fewer KV heads): the flash kernel takes it when the call allows enable_gqa
            # (fp16/bf16; the memory-efficient kernel does not, so fp32 keeps the math path).
            gqa = (
                bool(a.get("enable_gqa", False))
                and q.dim() == 4
                and q.dtype != torch.float32
                and q.shape[0] == k.shape[0]
                and k.shape[1] > 0
                and q.shape[1] % k.shape[1] == 0
            )
            if not gqa:
                return None
        three = q.dim() == 3
        if three:  # [B, s, d]: one head per batch row
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        p, causal, scale = (
            float(a.get("dropout_p", 0.0)),
            bool(a.get("is_causal", False)),
            a.get("scale"),
        )
        if q.dtype == torch.float32:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, p, causal, scale=scale
            )[0]
        else:
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, p, causal, False, scale=scale
            )[0]
        return out.squeeze(0) if three else out


class _Recorder(TorchDispatchMode):
    def __init__(self, state: _State, flops: dict[Any, Callable[..., int]], fake_mode: FakeTensorMode,
                 device: torch.device | None = None):
        super().__init__()
        self.device = device  # the fake tensors' device (None: meta)
        self.s = state
        self.flops = flops
        self.fake_mode = fake_mode
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its stand-in)
        self._composite: dict[Any, bool] = {}

    def _faked(self, t: Any) -> Any:
        """A tensor made outside the capture (a loss's target, a constant in a closure) as the
        fake tensor the fake mode would make of it (memoised: one stand-in, one storage), so a
        view of it is seen as a view."""
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            hit = self._fakes.get(id(t))
            if hit is None or hit[0] is not t:
                hit = self._fakes[id(t)] = (t, _fake(self.fake_mode, _meta(t), self.device))
                # A new storage (kept alive by the memo): a constant, whatever a freed storage
                # at the same address was.
                self.s.storages[_sid(hit[1])] = [-1, -1, 0]
            return hit[1]
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        if any(not isinstance(t, FakeTensor) for t in _tensors(args, kwargs)):
            args, kwargs = tree_map(self._faked, (args, kwargs))
        packet = func._overloadpacket
        if packet not in self.flops and self._is_composite(func):
            # Same as FlopCounterMode: decompose ops that have no formula of their own.
            r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        s = self.s
        if s.phase == _BACKWARD:
            return self._backward(func, packet, args, kwargs)
        seq = _peek_seq()
        new_nodes = seq != s.last_seq
        first_seq = s.last_seq
        s.last_seq = seq
        try:
            out = _run(func, args, kwargs)
        except Exception as exc:
            raise CaptureError(
                f"cannot capture op {func} in {s.where()}{_source_line()}: {_reason(exc)}"
            ) from exc
        if s.phase != _FORWARD:
            return out
        self._record(func, packet, args, kwargs, out, first_seq if new_nodes else -1, seq)
        return out

    def _is_composite(self, func) -> bool:
        c = self._composite.get(func)
        if c is None:
            c = torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"
            )
            self._composite[func] = c
        return c

    # ------------------------------------------------------------------ forward
    def _record(self, func, packet, args, kwargs, out, first_seq: int, seq: int) -> None:
        s = self.s
        storages = s.storages
        in_sids: dict[int, int] = {}  # sid -> tensor bytes (max over views)
        act = weights = False
        new_params: list[int] = []
        tensors = list(_tensors(args, kwargs))
        # autocast's cast of a parameter: the op that computes with the copy uses the parameter
        cast = packet is torch.ops.aten._to_copy and len({_sid(t) for t in tensors}) == 1 and _sid(tensors[0]) in s.params
        for t in tensors:
            sid = _sid(t)
            nb = t.numel() * t.element_size()
            if nb > in_sids.get(sid, -1):
                in_sids[sid] = nb
            param = s.casts.get(sid, sid)
            if param in s.params and param not in s.used_params and not cast and param not in new_params:
                new_params.append(param)
            st = storages.get(sid)
            if (st is not None and st[2]) or sid in s.params:
                act = True  # a trainable value: its gradient flows back through every reader
            weights = weights or param in s.params
        outs = [t for t in _tensors(out if isinstance(out, (tuple, list)) else (out,))]
        mutable = func._schema.is_mutable
        fresh = [t for t in outs if _sid(t) not in in_sids]
        if not fresh and not mutable and packet not in self.flops:
            # A view or alias (view, t, expand, detach, ...): no work, no new memory,
            # and a parameter seen through it counts at the op that computes with it.
            # Its autograd node (if any) belongs to the op that wrote the base storage.
            if first_seq >= 0 and outs:
                st = storages.get(_sid(outs[0]))
                owner = st[1] if st is not None else -1
                for n in range(first_seq, seq):
                    s.seq2rec[n] = owner if owner >= 0 else len(s.recs) - 1
            return
        f = s.frame()
        rec = self._new_rec(func, f, tensors[0] if packet is torch.ops.aten._to_copy and not cast
                            and len(tensors) == 1 else None)
        idx = len(s.recs)
        s.recs.append(rec)
        if f is not None and f.sel >= 0 and f.sel not in s.sel_first_rec:
            s.sel_first_rec[f.sel] = idx
        rec.fwd_flops = self._count(packet, args, kwargs, out)
        for sid in new_params:
            numel, nbytes, _ = s.params[sid]
            s.used_params.add(sid)
            rec.param_bytes += nbytes
            rec.param_count += numel
        for sid, nb in in_sids.items():
            st = storages.get(sid)
            if st is not None and st[2] and sid not in s.casts:  # a parameter's copy is no activation input
                rec.ins.append((st[1], sid, nb))
        rec.act = act
        rec.weights = weights
        for t in fresh:
            sid = _sid(t)
            storages[sid] = [idx, idx, act]
            rec.out_bytes += t.untyped_storage().nbytes()
            if cast:
                s.casts[sid] = _sid(tensors[0])
        if mutable:  # in-place: this op is now the last writer of its outputs' storage
            for t in outs:
                st = storages.get(_sid(t))
                if st is not None:
                    st[1] = idx
                    st[2] = st[2] or act
        if first_seq >= 0:
            for n in range(first_seq, seq):
                s.seq2rec[n] = idx

    def _new_rec(self, func, f, cast_of: torch.Tensor | None) -> _Rec:
        """The record of a forward op run in frame `f` (None: outside every module). `cast_of`:
        the activation an autocast copy was made of -- the copy keeps its source's layout (a column
        linear's input copy is whole on every tensor rank, not this rank's slice)."""
        if f is None:
            return _Rec(str(func), "", None, -1, False)
        info = f.info
        rec = _Rec(str(func), info.path, info.layer, f.sel, info.tp)
        rec.role = info.role
        st = self.s.storages.get(_sid(cast_of)) if cast_of is not None else None
        if st is not None and st[0] >= 0:
            rec.tp = self.s.recs[st[0]].tp
        return rec

    def _count(self, packet, args, kwargs, out) -> float:
        fn = self.flops.get(packet)
        if fn is None:
            return 0.0
        return float(fn(*args, **kwargs, out_val=out))

    # ------------------------------------------------------------------ backward
    def _backward(self, func, packet, args, kwargs):
        s = self.s
        try:
            out = _run(func, args, kwargs)
        except Exception as exc:
            node = _current_node()
            idx = self._backward_owner()
            module = s.recs[idx].module or "<root>" if idx >= 0 else "?"
            raise CaptureError(
                f"cannot capture backward op {func} (autograd node "
                f"{node.name() if node is not None else '?'}, forward in module {module!r}) "
                f"on the meta device: {exc}"
            ) from exc
        flops = self._count(packet, args, kwargs, out)
        if flops:
            idx = self._backward_owner()
            if idx >= 0:
                s.recs[idx].bwd_flops += flops
            else:
                s.unattributed_bwd_flops += flops
        return out

    def _backward_owner(self) -> int:
        """The forward op whose autograd node is running now."""
        s = self.s
        node = _current_node()
        if node is None:
            return s.bwd_last_rec
        seq = node._sequence_nr()
        idx = s.seq2rec.get(seq)
        if idx is None:
            # A node we did not see created (e.g. made outside any dispatched op):
            # nodes are numbered in creation order, so take the op just before it.
            if len(s.seq_keys) != len(s.seq2rec):
                s.seq_keys = sorted(s.seq2rec)
            keys = s.seq_keys
            i = bisect.bisect_right(keys, seq) - 1
            idx = s.seq2rec[keys[i]] if i >= 0 else -1
        s.bwd_last_rec = idx
        return idx


# ---------------------------------------------------------------------------- grouped GEMM
def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """FLOPs of `aten._grouped_mm` (MoE experts: each group of rows of `a` times its expert's
    matrix): every element of `a` meets one column of its group's `b` per output column, so
    2·numel(a)·n for the 2D x 3D forward ([T, k] x [E, k, n]), the 3D x 3D batched form and the
    2D x 2D weight gradient ([k, T] x [T, n] into [E, k, n]) alike."""
    return 2 * a.numel() * b.shape[-1]


def _run(func: Any, args: Any, kwargs: Any) -> Any:
    """Run an op on the fake tensors. `aten._grouped_mm` has a meta kernel for bf16 only (the
    CUDA kernel takes fp16 and fp32 too): other dtypes run it in bf16 for the shapes and cast
    back, so MoE models capture in any dtype."""
    if func is torch.ops.aten._grouped_mm.default:
        a, b = args[0], args[1]
        if a.dtype != torch.bfloat16:
            rest = args[2:]
            dtype = kwargs.get("out_dtype") or a.dtype
            kw = {k: v for k, v in kwargs.items() if k != "out_dtype"}
            return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kw).to(dtype)
    return func(*args, **kwargs)


# ---------------------------------------------------------------------------- errors
_OWN = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent), contextlib.__file__)


def _source_line() -> str:
    """`` at file:line (`code`)`` of the innermost frame of the model's own code (not torch's,
    not plait's) on the stack: where an op that cannot run was called."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_OWN) and "<" not in frame.filename:
            return f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    return ""


def _reason(exc: Exception) -> str:
    """The first line of why an op failed, and a way out where the cause is known."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException)) or "item()" in text:
        return (f"{type(exc).__name__}: {text}; the value depends on tensor data, which capture does not "
                "have (it runs on fake tensors, shapes only): compute it from shapes or the config, or skip "
                "it while tracing (transformers' is_tracing(tensor) is true here; torch.compiler."
                "is_compiling() is not)")
    return f"{type(exc).__name__}: {text}"


@contextlib.contextmanager
def quiet_fake_mode() -> Iterator[None]:
    """The fake mode logs every op it cannot run before raising; the CaptureError says it once."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


# ---------------------------------------------------------------------------- capture
def _to_meta_inputs(sample_inputs: Any) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            # requires_grad survives: an input that needs its gradient costs backward FLOPs
            return x.detach().to("meta").requires_grad_(x.requires_grad)
        return x

    return tree_map(conv, sample_inputs)


def _meta(t: torch.Tensor) -> torch.Tensor:
    """`t` on meta, shapes only (a real tensor's data is never copied)."""
    return t.detach() if t.is_meta else torch.empty_like(t, device="meta")


def _infer_batch(inputs: Any) -> int:
    for leaf in tree_flatten(inputs)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise CaptureError("capture: cannot infer the batch size (no tensor input); pass batch=")


def _default_loss(output: Any) -> torch.Tensor:
    leaves = [
        t
        for t in tree_flatten(output)[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not leaves:
        raise CaptureError("capture: the model's output has no tensor that requires grad")
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


def capture(
    module: nn.Module,
    sample_inputs: Any,
    *,
    name: str,
    config: dict[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    batch: int | None = None,
    cuda_kernels: bool = True,
    replicate: bool = True,
    autocast: str | None = None,
    autocast_rules: str = "cuda",
    autocast_params: str = "fp32",
) -> OpGraph:
    """Run one training step of `module` on the meta device and describe it as an OpGraph.

    `sample_inputs` is a tuple of positional arguments (or one tensor); tensors not on
    meta are copied to meta (shapes only). A module whose parameters are not on meta is
    run through `torch.func.functional_call` with meta stand-ins, so it is neither
    moved nor copied. `loss_fn(output) -> scalar` is the training loss (default: the sum
    of the floating outputs); its ops count in the layer that feeds it. `batch` is the
    number of samples in `sample_inputs` (default: dim 0 of the first tensor); every
    figure is divided by it.

    `cuda_kernels`: trace dropout and attention as CUDA runs them (see the module doc).
    `replicate`: a run of three or more structurally identical layers in one
    `nn.ModuleList`/`nn.Sequential` (same classes, parameter and buffer shapes, dtypes,
    plain attributes, no hooks, no shared parameters) is traced with its first two
    layers only; the second, once checked op-for-op against the first, stands for the
    rest. A 96-layer GPT then traces 2 blocks, not 96. If the check fails the model is
    traced in full.
    `autocast` ("bf16" / "fp16"): the step as torch's autocast runs it over the module's own
    (fp32) parameters -- the forward and the loss autocast, backward outside, as torch's recipe and
    plait's engines run it -- so each activation is in the dtype autocast gives it, and the
    low-precision parameter copies autocast makes and autograd saves are counted apart
    (`Layer.saved_cast_bytes`: one set per forward, not per sample). `autocast_rules`: whose op
    lists, "cuda" (the GPU a plan trains on; emulated over CPU autocast, `_CudaFp32Ops`) or "cpu"
    (CPU autocast as it is: what a CPU measurement runs). `autocast_params`: "fp32" (DDP, one
    process: autocast casts them, and its copies are saved) or "low" (FSDP2's MixedPrecisionPolicy
    gathers them in the low dtype and casts the floating inputs: nothing left for autocast to cast;
    the embeddings' outputs, and so the residual stream, are low-precision too).
    """
    if autocast is not None and autocast not in _LOW:
        raise CaptureError(f"capture: autocast must be one of {sorted(_LOW)} or None, got {autocast!r}")
    if autocast_rules not in ("cuda", "cpu"):
        raise CaptureError(f"capture: autocast_rules must be 'cuda' or 'cpu', got {autocast_rules!r}")
    if autocast_params not in ("fp32", "low"):
        raise CaptureError(f"capture: autocast_params must be 'fp32' or 'low', got {autocast_params!r}")
    amp = (autocast, autocast_rules, autocast_params)
    if not isinstance(sample_inputs, tuple):
        sample_inputs = (sample_inputs,)
    inputs = _to_meta_inputs(sample_inputs)
    batch = _infer_batch(inputs) if batch is None else int(batch)
    if batch < 1:
        raise CaptureError(f"capture: batch must be >= 1, got {batch}")
    if model_inputs(module) is None:  # torch.fx traces the forward called with these inputs
        module.plait_inputs = input_signature(inputs)
    # The cut is made once, on the whole model (replication below truncates its containers).
    cut = layer_cut(module, name)
    heads = cut.heads
    if cut.notes:
        config = {**(config or {}), "capture_notes": list(cut.notes)}
    runs = _find_runs(module, heads) if replicate else []
    if runs and not is_marked(module):
        # A user's loop over its blocks may do more than chain them (a skip connection after
        # block 1, a second argument): replicate only runs torch.fx shows to be plain chains.
        chained = pure_chains(module, heads, [r.paths for r in runs])
        runs = [r for r, ok in zip(runs, chained) if ok]
    while runs:
        try:
            with _truncated(runs):
                state, out_leaves = _trace(module, heads, inputs, name, loss_fn, cuda_kernels, amp)
        except CaptureError:
            # A container whose layers run side by side (parallel branches, e.g. DLRM's
            # embedding bags) is no chain: dropping its copies changes shapes downstream.
            # Replication is only a shortcut, so trace the whole model instead.
            break
        try:
            return _build_graph(state, name, batch, out_leaves, module, heads, config, runs, amp)
        except _NotReplicable as exc:
            # Often the first layer of a run differs (its input needs no gradient, so its
            # backward is shorter): retry the run without it, or trace it in full.
            bad = exc.args[0]
            runs = [r for r in runs if r is not bad]
            if len(bad.keys) > 3:
                runs.append(_Run(bad.container, bad.keys[1:], bad.paths[1:]))
    state, out_leaves = _trace(module, heads, inputs, name, loss_fn, cuda_kernels, amp)
    return _build_graph(state, name, batch, out_leaves, module, heads, config, [], amp)


def _trace(
    module: nn.Module,
    heads: dict[str, tuple[str, str]],
    inputs: tuple[Any, ...],
    name: str,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    cuda_kernels: bool,
    amp: tuple[str | None, str, str] = (None, "cuda", "fp32"),
) -> tuple[_State, list[torch.Tensor]]:
    """One forward, loss and backward on meta under the recorder; returns the raw records. Under
    autocast (`amp`: the low dtype and the rules) the fake tensors stand on the CPU device, whose
    autocast dispatches on them (fake meta tensors have no autocast key)."""
    state = _State(infos=_module_infos(module, heads))
    # Fake tensors (torch's tracing tensors, as torch.compile and export see them) stand for
    # the parameters, buffers and inputs: library code takes its tracing-friendly path on them
    # (transformers' `is_tracing()` builds masks without `.item()`), where a bare meta tensor
    # would be read. The module runs through `torch.func.functional_call` with them, so it is
    # neither moved nor copied; tied names share one stand-in.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device("cpu") if amp[0] is not None else None
    low = _LOW[amp[0]] if amp[0] is not None and amp[2] == "low" else None  # FSDP2's gathered dtype
    substitutes = _fake_weights(module, fake_mode, state, device, low)

    def fake_input(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if low is not None and x.is_floating_point():  # FSDP2 casts the floating forward inputs
            x = _meta(x).to(low).requires_grad_(x.requires_grad)
        return _fake(fake_mode, x, device)

    inputs = tree_map(fake_input, inputs)
    for leaf in tree_flatten(inputs)[0]:
        if isinstance(leaf, torch.Tensor):
            state.storages[_sid(leaf)] = [-1, -1, 1]

    flops = dict(flop_registry)
    flops[torch.ops.aten._grouped_mm] = _grouped_mm_flops
    recorder = _Recorder(state, flops, fake_mode, device)
    pre_hook, post_hook = _module_hooks(state)
    pack = _pack_hook(state)

    modes = [(m, m.training) for m in module.modules()]
    module.train()  # a training step: dropout on, batch norm on batch statistics
    h_pre = nn.modules.module.register_module_forward_pre_hook(pre_hook)
    h_post = nn.modules.module.register_module_forward_hook(post_hook, always_call=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            state.last_seq = _peek_seq()
            state.phase = _FORWARD
            with fake_mode, quiet_fake_mode(), recorder, \
                    _CudaKernels() if cuda_kernels else contextlib.nullcontext():
                output = _forward_backward(module, substitutes, inputs, name, loss_fn, state, amp)
    finally:
        state.phase = _OFF
        state.frames.clear()
        h_pre.remove()
        h_post.remove()
        for m, training in modes:
            m.training = training

    out_leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return state, out_leaves


def _fake(fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A fake stand-in of `t` (shapes only), on `device` where given (else on meta)."""
    if device is None:
        return fake_mode.from_tensor(t)
    fake = fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, _meta(t), device)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake


def _fake_weights(module: nn.Module, fake_mode: FakeTensorMode, state: _State,
                  device: torch.device | None = None, low: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Fake stand-ins for the module's parameters and buffers, by name (tied names share one),
    entered in `state.params` and `state.buffers`; floating parameters in `low` where given."""
    named_params = list(module.named_parameters(remove_duplicate=False))
    named_buffers = list(module.named_buffers(remove_duplicate=False))
    substitutes: dict[str, torch.Tensor] = {}
    owner_path: dict[int, str] = {}
    made: dict[int, torch.Tensor] = {}
    for pname, p in named_params:
        if id(p) not in made:
            meta = _meta(p).to(low) if low is not None and p.is_floating_point() else _meta(p)
            made[id(p)] = _fake(fake_mode, meta, device).requires_grad_(p.requires_grad)
            owner_path[id(made[id(p)])] = pname.rpartition(".")[0]
        substitutes[pname] = made[id(p)]
    params_by_id = {id(m): m for m in made.values()}
    buf_made: dict[int, torch.Tensor] = {}
    for bname, b in named_buffers:
        if id(b) not in buf_made:
            buf_made[id(b)] = _fake(fake_mode, _meta(b), device)
        substitutes[bname] = buf_made[id(b)]
    buffers = list(buf_made.values())
    for p in params_by_id.values():
        state.params[_sid(p)] = (p.numel(), p.numel() * p.element_size(), owner_path[id(p)])
    state.buffers = {_sid(b) for b in buffers}
    return substitutes


def _module_hooks(
    state: _State,
) -> tuple[Callable[[nn.Module, Any], None], Callable[[nn.Module, Any, Any], None]]:
    """Global forward pre/post hooks that keep `state.frames`, the stack of modules running."""

    def pre_hook(mod: nn.Module, args: Any) -> None:
        info = state.infos.get(id(mod))
        parent = state.frame()
        if info is None:  # a module outside the captured tree, e.g. made inside forward
            info = parent.info if parent else _ModuleInfo("", None, False, False)
        sel = parent.sel if parent else -1
        if info.selective:
            sel = state.n_sel
            state.n_sel += 1
            ins: list[tuple[int, int]] = []
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor) and _sid(t) not in state.params:
                    ins.append((_sid(t), t.untyped_storage().nbytes()))
                    # held so that no later storage takes its id (meta: costs nothing)
                    state.keep_alive.append(t)
            state.sel_inputs[sel] = ins
        state.frames.append(_Frame(info, sel))

    def post_hook(mod: nn.Module, args: Any, out: Any) -> None:
        if state.frames:
            state.frames.pop()

    return pre_hook, post_hook


def _pack_hook(state: _State) -> Callable[[torch.Tensor], torch.Tensor]:
    """A saved-tensors pack hook that notes each activation autograd keeps for backward."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        if state.phase != _FORWARD:
            return t
        sid = _sid(t)
        if sid in state.params or sid in state.buffers:
            return t  # weights are counted as parameters, not activations
        if sid in state.casts:  # a parameter's autocast copy: one per forward, whatever the batch
            state.saved_casts.setdefault(sid, [_peek_seq() - 1, t.untyped_storage().nbytes()])
            return t
        f = state.frame()
        sel = f.sel if f else -1
        entry = state.saved.get(sid)
        if entry is None:
            state.saved[sid] = [_peek_seq() - 1, t.untyped_storage().nbytes(), sel, 1]
        elif entry[2] != sel:
            entry[3] = 0
        return t  # keeps the storage alive, so its id stays unique

    return pack


def _forward_backward(
    module: nn.Module,
    substitutes: dict[str, torch.Tensor],
    inputs: tuple[Any, ...],
    name: str,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    state: _State,
    amp: tuple[str | None, str, str] = (None, "cuda", "fp32"),
) -> Any:
    """The forward, the loss and the backward, under the modes and hooks in place (the forward and
    the loss under `amp`'s autocast); returns the model's output."""
    try:
        with _autocast(amp[0], amp[1]):
            output = torch.func.functional_call(module, substitutes, inputs)
            state.frames.clear()
            loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"cannot capture {name}: {type(exc).__name__} in {state.where()}: {exc}"
        ) from exc
    if (
        not isinstance(loss, torch.Tensor)
        or loss.numel() != 1
        or not loss.requires_grad
    ):
        raise CaptureError(
            f"cannot capture {name}: the loss must be a scalar tensor that requires grad"
        )
    state.phase = _BACKWARD
    try:
        loss.backward()
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"cannot capture {name}: backward failed on the meta device: {exc}"
        ) from exc
    return output


# ---------------------------------------------------------------------------- replication
class _NotReplicable(Exception):
    """The two traced copies of a run of layers differ: trace the model in full."""


@dataclass
class _Run:
    container: nn.Module  # the nn.ModuleList / nn.Sequential holding the run
    keys: list[str]  # child names in the container, in order
    paths: list[str]  # full module paths (= layer names)


_PLAIN = (bool, int, float, str, type(None))


def _signature(m: nn.Module) -> tuple[Any, ...]:
    """What a module's forward can depend on, besides its inputs: classes, parameter and
    buffer shapes/dtypes, plain attributes (dropout p, eps, flags), hooks, patched forwards."""
    sig: list[Any] = []
    for path, sub in m.named_modules(remove_duplicate=False):
        attrs = []
        for k, v in sorted(vars(sub).items(), key=lambda kv: kv[0]):
            if k.startswith("_") or k == "training":
                continue
            if isinstance(v, _PLAIN) or (
                isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)
            ):
                attrs.append((k, v))
            else:
                attrs.append((k, type(v).__qualname__))
        sig.append(
            (
                path,
                type(sub),
                tuple(attrs),
                tuple(
                    (n, tuple(p.shape), p.dtype, p.requires_grad)
                    for n, p in sub._parameters.items()
                    if p is not None
                ),
                tuple(
                    (n, tuple(b.shape), b.dtype) for n, b in sub._buffers.items() if b is not None
                ),
                bool(
                    sub._forward_hooks
                    or sub._forward_pre_hooks
                    or sub._backward_hooks
                    or sub._backward_pre_hooks
                ),
                "forward" in vars(sub),
            )
        )
    return tuple(sig)


def _find_runs(root: nn.Module, heads: dict[str, tuple[str, str]] | None = None) -> list[_Run]:
    """Runs of >= 3 consecutive, structurally identical layers in a ModuleList/Sequential."""
    heads = layer_assignment(root) if heads is None else heads
    uses: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    runs: list[_Run] = []
    for cpath, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        items = [(k, c) for k, c in container._modules.items() if c is not None]
        i = 0
        while i < len(items):
            path = f"{cpath}.{items[i][0]}" if cpath else items[i][0]
            if path not in heads or heads[path][0] != path:
                i += 1
                continue
            sig = _signature(items[i][1])
            j = i + 1
            while j < len(items):
                p2 = f"{cpath}.{items[j][0]}" if cpath else items[j][0]
                if p2 not in heads or _signature(items[j][1]) != sig:
                    break
                j += 1
            run = items[i:j]
            # shared weights make the copies differ (first use counts them)
            private = all(uses[id(p)] == 1 for _, c in run for p in c.parameters())
            if len(run) >= 3 and private:
                runs.append(
                    _Run(
                        container,
                        [k for k, _ in run],
                        [f"{cpath}.{k}" if cpath else k for k, _ in run],
                    )
                )
            i = max(j, i + 1)
    return runs


class _truncated:
    """Temporarily drop all but the first two layers of each run from their containers."""

    def __init__(self, runs: list[_Run]):
        self.runs = runs
        self.saved: list[tuple[nn.Module, Any]] = []

    def __enter__(self) -> None:
        for run in self.runs:
            original = run.container._modules
            drop = set(run.keys[2:])
            kept = type(original)((k, v) for k, v in original.items() if k not in drop)
            object.__setattr__(run.container, "_modules", kept)
            self.saved.append((run.container, original))

    def __exit__(self, *exc: Any) -> None:
        for container, original in reversed(self.saved):
            object.__setattr__(container, "_modules", original)
        self.saved.clear()


_SAME = ("target", "fwd_flops", "bwd_flops", "param_bytes", "param_count", "saved", "saved_tp",
         "saved_sel", "out_bytes", "act")  # fmt: skip


def _block(recs: list[_Rec], layer: str, run: _Run) -> range:
    idx = [i for i, r in enumerate(recs) if r.layer == layer]
    if not idx or idx != list(range(idx[0], idx[-1] + 1)):
        raise _NotReplicable(run)
    return range(idx[0], idx[-1] + 1)


def _after(p: int, start: int, insert_at: int, last: int, shift: int) -> int:
    if p >= insert_at:
        return p + shift
    if start <= p < insert_at:
        return last + (p - start)
    return p


def _expand_runs(state: _State, runs: list[_Run], out_recs: list[int]) -> dict[str, list[str]]:
    """Put copies of each run's second traced layer in place of the layers not traced.

    Checked first, else `_NotReplicable`: the two traced layers ran back to back, op for
    op with the same costs, and nothing outside them reads the first one's tensors
    except the second.
    """
    recs = state.recs
    blocks = []
    for run in runs:
        b0, b1 = _block(recs, run.paths[0], run), _block(recs, run.paths[1], run)
        if b1.start != b0.stop or len(b0) != len(b1):
            raise _NotReplicable(run)
        for u, v in zip(b0, b1):
            if any(getattr(recs[u], f) != getattr(recs[v], f) for f in _SAME):
                raise _NotReplicable(run)
        for i, r in enumerate(recs):
            if i not in b0 and i not in b1 and any(p in b0 for p, _, _ in r.ins):
                raise _NotReplicable(run)
        for sid, (_, _, path) in state.params.items():
            if sid not in state.used_params and any(
                path == q or path.startswith(q + ".") for q in run.paths[:2]
            ):
                raise _NotReplicable(run)
        blocks.append((b1.start, len(b1), run))
    replicated: dict[str, list[str]] = {}
    for start, n, run in sorted(blocks, key=lambda b: -b[0]):
        first, template = start - n, run.paths[1]
        copies = len(run.paths) - 2
        insert_at = start + n
        new: list[_Rec] = []
        prev = start  # the block the next copy reads from
        for j in range(copies):
            base = insert_at + j * n
            path = run.paths[2 + j]
            for u in range(n):
                src = recs[start + u]
                c = _Rec(
                    src.target, path + src.module[len(template) :], path, src.frame_sel, src.tp
                )
                for f in ("fwd_flops", "bwd_flops", "param_bytes", "param_count", "saved",
                          "saved_tp", "saved_sel", "saved_cast", "out_bytes", "act", "role"):  # fmt: skip
                    setattr(c, f, getattr(src, f))
                c.ins = [
                    (
                        base + (p - start)
                        if start <= p < insert_at
                        else prev + (p - first)
                        if first <= p < start
                        else p,
                        sid,
                        nb,
                    )
                    for p, sid, nb in src.ins
                ]
                new.append(c)
            prev = base
        # Ops after the run now follow the copies, and read the last copy, not the template.
        last, shift = insert_at + (copies - 1) * n, copies * n
        for r in recs[insert_at:]:
            r.ins = [(_after(p, start, insert_at, last, shift), sid, nb) for p, sid, nb in r.ins]
        out_recs[:] = [_after(p, start, insert_at, last, shift) for p in out_recs]
        recs[insert_at:insert_at] = new
        replicated[template] = [run.paths[2], run.paths[-1]]
    return replicated


# ---------------------------------------------------------------------------- assembly
def _attribute_saved(state: _State) -> None:
    recs = state.recs
    keys = sorted(state.seq2rec)
    for sid, (seq, nbytes, sel, same_frame) in state.saved.items():
        idx = state.seq2rec.get(seq)
        if idx is None or idx < 0:
            i = bisect.bisect_right(keys, seq) - 1
            idx = state.seq2rec[keys[i]] if i >= 0 else len(recs) - 1
            idx = max(idx, 0)
        rec = recs[idx]
        rec.saved += nbytes
        st = state.storages.get(sid)
        producer = recs[st[0]] if st is not None and st[0] >= 0 else None
        if producer is not None and producer.tp:
            rec.saved_tp += nbytes
        # Selective recompute (Korthikanti et al. §4.2) drops what the attention core
        # both makes and alone keeps.
        if producer is not None and sel >= 0 and producer.frame_sel == sel and same_frame:
            rec.saved_sel += nbytes
    for seq, nbytes in state.saved_casts.values():
        idx = state.seq2rec.get(seq)
        if idx is None or idx < 0:
            i = bisect.bisect_right(keys, seq) - 1
            idx = max(state.seq2rec[keys[i]] if i >= 0 else len(recs) - 1, 0)
        recs[idx].saved_cast += nbytes
    # ...and must keep the core's inputs instead, where nothing else keeps them.
    kept: set[int] = set()
    for frame, ins in state.sel_inputs.items():
        first = state.sel_first_rec.get(frame)
        if first is None:
            continue
        for sid, nbytes in ins:
            if sid in state.saved or sid in kept or sid in state.buffers:
                continue
            kept.add(sid)
            recs[first].saved_sel -= nbytes


def _assign_glue(state: _State, layer_order: dict[str, int]) -> set[int]:
    """Give ops that ran outside every layer (top-level glue, the loss) a layer.

    An op goes to the layer of its first consumer (e.g. a concat feeding the head), except
    that an op computed from one layer's outputs alone and read by several layers (a shared
    activation feeding parallel branches) stays with that producer, so the layer edges say
    that the branches depend on the producer and not on each other; an op nobody consumes
    (the loss) goes to the layer of its latest producer.

    Returns the glue computed from the model's inputs alone, reading no parameter (a reshape
    or scaling of an input): like the inputs themselves it ties no layer to another (each
    reader can compute it; the runtime does so where the readers run in parallel stages).
    """
    recs = state.recs
    consumers: dict[int, list[int]] = {}
    sources: list[frozenset[str]] = []  # the layers each op's activations come from
    data: set[int] = set()
    for i, r in enumerate(recs):
        src: set[str] = set()
        for p, _, _ in r.ins:
            if p >= 0:
                consumers.setdefault(p, []).append(i)
                src |= {recs[p].layer} if recs[p].layer is not None else sources[p]
        sources.append(frozenset(src))
        if r.layer is None and not r.weights and all(p < 0 or p in data for p, _, _ in r.ins):
            data.add(i)
    for i in range(len(recs) - 1, -1, -1):
        if recs[i].layer is None:
            readers = list(dict.fromkeys(recs[c].layer for c in consumers.get(i, ())
                                         if recs[c].layer is not None))
            if len(readers) > 1 and len(sources[i]) == 1:
                recs[i].layer = next(iter(sources[i]))
            elif readers:
                recs[i].layer = readers[0]
    for i, r in enumerate(recs):
        if r.layer is None:
            prods = [recs[p].layer for p, _, _ in r.ins if p >= 0 and recs[p].layer is not None]
            if prods:
                r.layer = max(prods, key=lambda n: layer_order.get(n, -1))
            else:
                r.layer = next((q.layer for q in reversed(recs[:i]) if q.layer), None)
    if recs and any(r.layer is None for r in recs):
        first = next((r.layer for r in recs if r.layer is not None), None)
        for r in recs:
            if r.layer is None:
                r.layer = first
    return data


def _build_graph(
    state: _State,
    name: str,
    batch: int,
    out_leaves: list[torch.Tensor],
    module: nn.Module,
    heads: dict[str, tuple[str, str]],
    config: dict[str, Any] | None,
    runs: list[_Run],
    amp: tuple[str | None, str, str] = (None, "cuda", "fp32"),
) -> OpGraph:
    """The per-sample OpGraph of a trace's records, each replicated run expanded to its full length."""
    recs = state.recs
    if not recs:
        raise CaptureError(f"cannot capture {name}: the forward pass ran no ops")
    _attribute_saved(state)
    outs = _model_outputs(state, out_leaves)
    out_recs = [o[0] for o in outs]
    replicated = _expand_runs(state, runs, out_recs) if runs else {}

    style = dict(heads.values())
    kinds = _layer_kinds(module, heads)
    order, data_glue = _order_layers(state)

    b = float(batch)
    layers: dict[str, Layer] = {
        n: Layer(name=n, kind=kinds.get(n, "Module"), tp_style=style.get(n, "none")) for n in order
    }
    unused_paths = _add_unused_params(state, heads, layers, order[-1])
    flows = _Flows()
    ops = _wire_ops(recs, _op_names(state), layers, data_glue, b, flows)
    # The model's outputs leave the layer that made them.
    for idx, (_, sid, nb) in zip(out_recs, outs):
        if idx >= 0:
            src = recs[idx].layer
            flows.out_flow[(src, sid)] = max(flows.out_flow.get((src, sid), 0), nb)
    _add_boundary_bytes(layers, flows, b)

    position = {n: i for i, n in enumerate(order)}
    _check_one_way(name, flows.edges, position)
    param_dtype = next((p.element_size() for p in module.parameters() if p.is_floating_point()), 4)
    if amp[0] is not None and amp[2] == "low":
        param_dtype = _LOW[amp[0]].itemsize
    act_dtype = next((t.element_size() for t in out_leaves if t.is_floating_point()), param_dtype)
    if amp[0] is not None:  # the bytes are as autocast left them: scaled by 1 for a plan in its dtype
        act_dtype = _LOW[amp[0]].itemsize
    return OpGraph(
        model=name,
        ops=ops,
        layers=[layers[n] for n in order],
        layer_edges=sorted(flows.edges, key=lambda e: (position[e[0]], position[e[1]])),
        param_dtype_bytes=param_dtype,
        activation_dtype_bytes=act_dtype,
        autocast=amp[0] or "",
        autocast_rules=amp[1] if amp[0] else "",
        autocast_params=amp[2] if amp[0] else "",
        capture_batch=batch,
        config=_graph_config(state, config, unused_paths, replicated, b),
        tied=tied_parameters_between_layers(module, heads, order),
    )


def _model_outputs(state: _State, out_leaves: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(last writer rec, storage id, bytes) of each model output."""
    outs = []
    for t in out_leaves:
        st = state.storages.get(_sid(t))
        outs.append((st[1] if st is not None else -1, _sid(t), t.numel() * t.element_size()))
    return outs


def _layer_kinds(module: nn.Module, heads: dict[str, tuple[str, str]]) -> dict[str, str]:
    """{layer name: class name of the module that heads it}."""
    kinds: dict[str, str] = {}
    for path, (lname, _) in heads.items():
        kinds[lname] = type(module.get_submodule(path)).__name__ if path else type(module).__name__
    return kinds


def _order_layers(state: _State) -> tuple[list[str], set[int]]:
    """Give every op a layer (`_assign_glue`); returns the layers in order of their first op, and
    the glue computed from the model's inputs alone."""
    recs = state.recs
    first_seen: dict[str, int] = {}
    for i, r in enumerate(recs):
        if r.layer is not None and r.layer not in first_seen:
            first_seen[r.layer] = i
    data_glue = _assign_glue(state, first_seen)
    for i, r in enumerate(recs):
        if r.layer not in first_seen:
            first_seen[r.layer] = i
    return sorted(first_seen, key=first_seen.__getitem__), data_glue


def _add_unused_params(
    state: _State, heads: dict[str, tuple[str, str]], layers: dict[str, Layer], last: str
) -> list[str]:
    """Count the parameters no op read in their layers; returns their paths."""
    # Parameters no op read (modules that never ran) still take memory: count them in
    # the layer that owns them, or else in the last layer, so the totals equal
    # sum(p.numel()) over unique parameters; config["unused_params"] names them.
    unused_paths: list[str] = []
    for sid, (numel, nbytes, path) in state.params.items():
        if sid in state.used_params:
            continue
        owner = next(
            (
                n
                for p, (n, _) in heads.items()
                if n in layers and (p == "" or path == p or path.startswith(p + "."))
            ),
            last,
        )
        layers[owner].param_count += numel
        layers[owner].param_bytes += nbytes
        unused_paths.append(path or "<root>")
    return unused_paths


def _op_names(state: _State) -> list[str]:
    """``module/op#k`` of each record, k counting the earlier records of that op in that module."""
    names: list[str] = []
    for r in state.recs:
        key = (r.module, r.target)
        k = state.counters.get(key, 0)
        state.counters[key] = k + 1
        names.append(f"{r.module or '<root>'}/{r.target.rsplit('.', 1)[0]}#{k}")
    return names


@dataclass
class _Flows:
    """What crosses layer boundaries: the layer edges, and by (layer, storage id) the largest
    tensor of each storage read into a layer from outside or sent out of it."""

    edges: set[tuple[str, str]] = field(default_factory=set)
    in_flow: dict[tuple[str, int], int] = field(default_factory=dict)
    out_flow: dict[tuple[str, int], int] = field(default_factory=dict)


def _wire_ops(
    recs: list[_Rec], names: list[str], layers: dict[str, Layer], data_glue: set[int], b: float,
    flows: _Flows,
) -> dict[str, Op]:
    """Each record as an Op in its layer, summed into the layer's costs; notes in `flows` what
    crosses layer boundaries."""
    ops: dict[str, Op] = {}
    for i, r in enumerate(recs):
        lname = r.layer
        layer = layers[lname]
        layer.ops.append(names[i])
        _add_rec_costs(layer, r, b)
        producers = []
        for p, sid, nb in r.ins:
            src = recs[p].layer if p >= 0 else None
            if p >= 0:
                producers.append(names[p])
            if src != lname:
                flows.in_flow[(lname, sid)] = max(flows.in_flow.get((lname, sid), 0), nb)
                if src is not None and p not in data_glue:
                    flows.out_flow[(src, sid)] = max(flows.out_flow.get((src, sid), 0), nb)
                    flows.edges.add((src, lname))
        ops[names[i]] = Op(
            name=names[i],
            target=r.target,
            layer=lname,
            module=r.module,
            fwd_flops=r.fwd_flops / b,
            bwd_flops=r.bwd_flops / b,
            param_bytes=r.param_bytes,
            saved_bytes=r.saved / b,
            saved_tp_bytes=r.saved_tp / b,
            saved_selective_bytes=r.saved_sel / b,
            saved_cast_bytes=r.saved_cast,
            output_bytes=r.out_bytes / b,
            inputs=list(dict.fromkeys(producers)),
            tp_role=r.role,
        )
    return ops


def _add_rec_costs(layer: Layer, r: _Rec, b: float) -> None:
    """Add one record's per-sample costs to its layer's."""
    layer.fwd_flops += r.fwd_flops / b
    layer.bwd_flops += r.bwd_flops / b
    layer.param_count += r.param_count
    layer.param_bytes += r.param_bytes
    layer.saved_bytes += r.saved / b
    layer.saved_tp_bytes += r.saved_tp / b
    layer.saved_selective_bytes += r.saved_sel / b
    layer.saved_cast_bytes += r.saved_cast


def _add_boundary_bytes(layers: dict[str, Layer], flows: _Flows, b: float) -> None:
    """Each layer's per-sample input and output bytes: what flows across its boundary."""
    for (lname, _), nb in flows.in_flow.items():
        layers[lname].input_bytes += nb / b
    for (lname, _), nb in flows.out_flow.items():
        layers[lname].output_bytes += nb / b


def _check_one_way(name: str, edges: set[tuple[str, str]], position: dict[str, int]) -> None:
    """Raise `CaptureError` where data flows from a later layer back to an earlier one."""
    back = sorted((a, c) for a, c in edges if position[a] > position[c])
    if back:
        a, c = back[0]
        raise CaptureError(
            f"cannot capture {name}: layers {a!r} and {c!r} pass data both ways (a module "
            "called more than once?); mark a module that encloses both with plait_layer"
        )


def _graph_config(
    state: _State, config: dict[str, Any] | None, unused_paths: list[str],
    replicated: dict[str, list[str]], b: float,
) -> dict[str, Any]:
    """The OpGraph's config: the model's, plus what the capture noted."""
    cfg = dict(config or {})
    if unused_paths:
        cfg["unused_params"] = sorted(set(unused_paths))
    if replicated:
        cfg["capture_replicated"] = replicated
    if state.unattributed_bwd_flops:
        cfg["unattributed_bwd_flops"] = state.unattributed_bwd_flops / b
    return cfg


def tied_parameters_between_layers(module: nn.Module, heads: dict[str, tuple[str, str]],
                                   order: list[str]) -> list[TiedParams]:
    """Each parameter tensor that sits in the modules of two or more layers (one tensor under
    several names: a tied embedding and LM head, a shared projection): the layer that uses it
    first owns it, each later one is a `TiedParams` user. Vocabulary-parallel pairs (an
    "embedding" layer's tensor reused by a "head" layer) are split by tensor parallelism."""
    position = {n: i for i, n in enumerate(order)}
    style = {layer: tp for layer, tp in heads.values()}
    paths = sorted(heads, key=len, reverse=True)  # the innermost layer head wins

    def layer_of(param_name: str) -> str | None:
        mod = param_name.rpartition(".")[0]
        for path in paths:
            if not path or mod == path or mod.startswith(path + "."):
                return heads[path][0]
        return None

    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, []))[1].append(pname)
    out: list[TiedParams] = []
    for p, names in groups.values():
        layers = sorted({x for x in map(layer_of, names) if x in position}, key=position.__getitem__)
        for user in layers[1:]:
            sharded = style.get(layers[0]) == "embedding" and style.get(user) == "head"
            out.append(TiedParams(layers[0], user, int(p.numel()), tp_sharded=sharded))
    return out
