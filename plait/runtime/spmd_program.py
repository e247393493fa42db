"""Per-rank SPMD programs: a synthesized HAP program run op by op on each rank, on torch.distributed.

`plait.spmd` decides, per aten op of the model's `AtenGraph`, how each tensor is placed (``R``,
``S<d>``, ``P``) and with which per-device ratios (HAP, Zhang et al. EuroSys'24 sections 4-5).
This module runs that decision: `compile_program` checks it against the graph (every op has a
strategy its sharding rule offers, every conversion exists, every shard has rows) and turns the
ratios into integer shard sizes (`plait.cost.program.round_shards`, HAP's rounding); a
`RankProgram` is one rank's interpreter over the graph -- each op runs on the rank's shard
(`plait.graph.sharding.local_call`), and every placement conversion the program needs is a
collective of the communication facade (`plait.runtime.comm`: padded or grouped uneven
all-gather / reduce-scatter, all-reduce, all-to-all).

Backward is autograd's, with differentiable conversions: a conversion ``q0 -> q`` of a tensor
read by an op is an autograd Function whose backward converts the reader's gradient -- in
placement ``grad_placement(q, op computes a shard)`` -- to where the tensor's gradient must
arrive (its own placement; ``R`` for partial sums). Both directions use the one conversion
table of `plait.ir.program`, the one the search prices, so the collectives that run are
the program's `Comm`s: a replicated parameter read by a sharded op gets its data-parallel
gradient all-reduce, a row-parallel output its forward all-reduce and a free backward, a
column-parallel input its backward all-reduce (Megatron's f and g, one rule). Readers that need
the same placement share one forward conversion and one gradient conversion per kind of reader
(gradients are summed before the collective), as the search counts them.

Parameters are stored where their first reader wants them (sharded by the program's ratios, or
whole), or where the program's `homes` say (ZeRO-3 storage: all-gathered for a whole read, the
gradient reduce-scattered back); tied parameters (one tensor under two names) are stored whole and sliced per use.
Inputs are on every rank whole and sliced for free. The model's outputs are gathered whole on
every rank and the loss is computed redundantly, so its gradient is the same everywhere.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from plait.graph.sharding import SIZED_CREATION, local_call, strategies
from plait.ir.aten_graph import AtenGraph
from plait.ir.program import (
    PARTIAL,
    REPLICATED,
    ShardingError,
    Strategy,
    grad_home,
    grad_placement,
    shard_dim,
)

COLLECTIVE_MODES = ("padded", "grouped")
_RANDOM = {"native_dropout", "dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like"}


@dataclass
class CompiledProgram:
    """A program checked against its graph, with integer shard sizes."""

    graph: AtenGraph
    strategies: dict[str, Strategy]  # op name -> strategy
    sizes: dict[tuple[str, int], list[int]]  # (tensor, dim) -> rows per rank
    world: int
    stored: dict[str, str]  # parameter tensor -> the placement it is stored in
    collective: dict[str, str] = field(default_factory=dict)  # tensor -> padded | grouped (default padded)
    devices: list[str] = field(default_factory=list)


class _View:
    """What `segments` / `round_shards` read of a search Problem: the graph and device names."""

    def __init__(self, graph: AtenGraph, names: Sequence[str]) -> None:
        self.graph = graph
        self.devices = type("Names", (), {"names": tuple(names)})()


def compile_program(graph: AtenGraph, chosen: dict[str, Strategy], ratios: Any, world: int, *,
                    devices: Sequence[str] | None = None, collective: dict[str, str] | None = None,
                    homes: dict[str, str] | None = None) -> CompiledProgram:
    """Check `chosen` (op name -> strategy) against `graph` and round `ratios` to shard sizes.

    `ratios`: one vector of `world` ratios, or one per segment of the program (`plait.spmd.ratios.
    segments`). Errors (ShardingError) name the op, tensor or device: an op without a strategy or
    whose kind has no sharding rule, a strategy its rule does not offer, a conversion that does not
    exist, a ratio that leaves a device zero rows. `homes`: parameters stored in another placement
    than their first reader's (`plait.cost.program.Problem.homes`: ZeRO-3 storage), each read
    converted from there."""
    from plait.cost.program import Program, round_shards, segments

    names = list(devices) if devices is not None else [f"rank {i}" for i in range(world)]
    if len(names) != world:
        raise ShardingError(f"spmd program: {len(names)} device names for {world} ranks")
    ops = {op.name for op in graph.ops}
    unknown = sorted(set(chosen) - ops)
    if unknown:
        raise ShardingError(f"spmd program: strategies for ops not in model {graph.model}: {unknown[:5]}"
                            f"{' ...' if len(unknown) > 5 else ''} (was the plan made for another model or batch?)")
    for op in graph.ops:
        offered = strategies(op, graph, world)  # ShardingError naming the op when its kind has no rule
        s = chosen.get(op.name)
        if s is None:
            raise ShardingError(f"op {op.name} ({op.target}, in {op.module or 'the model'}): no strategy in the "
                                "spmd program")
        if s not in offered:
            raise ShardingError(f"op {op.name} ({op.target}): strategy {_show(s)} is not one its sharding rule "
                                f"offers for {world} devices; it offers {', '.join(_show(x) for x in offered)}")
    homes = dict(homes or {})
    bad = sorted(t for t in homes if t not in graph.tensors or graph.tensors[t].role != "param")
    if bad:
        raise ShardingError(f"spmd program: homes for tensors that are not parameters of model {graph.model}: "
                            f"{bad[:5]}")
    for t, q in homes.items():
        d = shard_dim(q) if isinstance(q, str) and q[:1] == "S" and q[1:].isdigit() else None
        if q != REPLICATED and (d is None or d >= len(graph.tensors[t].shape)):
            raise ShardingError(f"spmd program: parameter {t} of shape {list(graph.tensors[t].shape)} cannot be "
                                f"stored as {q!r} (R, or S<d> with d one of its dimensions)")
    stored = _check_conversions(graph, chosen, homes)
    for t, mode in (collective or {}).items():
        if mode not in COLLECTIVE_MODES:
            raise ShardingError(f"spmd program: collective for tensor {t!r} must be one of {COLLECTIVE_MODES}, "
                                f"got {mode!r}")
    view = _View(graph, names)
    program = Program(strategies=dict(chosen), homes=homes)
    segs = segments(view, program)  # type: ignore[arg-type]
    r = np.asarray(ratios, dtype=float)
    if r.ndim == 1:
        if r.shape[0] != world:
            raise ShardingError(f"spmd program: {r.shape[0]} ratios for {world} devices")
    elif r.ndim != 2 or r.shape != (segs.count, world):
        raise ShardingError(f"spmd program: ratios of shape {list(r.shape)}; the program has {segs.count} "
                            f"segment(s) of {world} devices (one vector, or one per segment)")
    sizes = round_shards(view, program, r, segs)  # type: ignore[arg-type]
    return CompiledProgram(graph, dict(chosen), sizes, world, stored, dict(collective or {}), names)


def _show(s: Strategy) -> str:
    return f"{','.join(s.inputs)} -> {','.join(s.outputs)}"


def _check_conversions(graph: AtenGraph, chosen: dict[str, Strategy], homes: dict[str, str]) -> dict[str, str]:
    """Replay the placements: every read must be reachable from where the tensor is; returns
    where each parameter is stored (its `homes` entry, else its first reader's placement; whole
    when that is partial)."""
    from plait.ir.program import conversion

    origin: dict[str, str] = {}
    stored: dict[str, str] = {}
    for op in graph.ops:
        s = chosen[op.name]
        for t, q in zip(op.inputs, s.inputs):
            meta = graph.tensors[t]
            if t not in origin:
                first = REPLICATED if (q == PARTIAL or meta.producer is None and meta.role != "param") else q
                first = homes.get(t, first)
                origin[t] = first
                if meta.role == "param":
                    stored[t] = first
            if conversion(origin[t], q, t, 0) is None:
                raise ShardingError(f"op {op.name} ({op.target}): reads tensor {t} as {q} but it is {origin[t]}; "
                                    f"no collective turns {origin[t]} into {q}")
        for t, p in zip(op.outputs, s.outputs):
            origin[t] = p
    return stored


# ----------------------------------------------------------------------------- emulated compute spans
class Spans:
    """Compute spans between collectives on the rank's `Recorder`: a span closes before each
    collective and reopens after it, so an emulated slower kind is stretched where its compute
    happened (`Recorder.compute` sleeps at the end of a span), not at the end of the pass."""

    def __init__(self, rec: Any = None) -> None:
        self.rec = rec
        self._open: Any = None
        self.name = ""

    def begin(self, name: str) -> None:
        self.end()
        self.name = name
        if self.rec is not None:
            self._open = self.rec.compute(name, "spmd")
            self._open.__enter__()

    def end(self) -> None:
        if self._open is not None:
            span, self._open = self._open, None
            span.__exit__(None, None, None)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        was = self._open is not None
        self.end()
        try:
            yield
        finally:
            if was:
                self.begin(self.name)


# ----------------------------------------------------------------------------- differentiable conversions
class _Convert(torch.autograd.Function):
    """Forward: ``fwd(x)`` (or an already converted value); backward: ``bwd(grad)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, done: torch.Tensor | None, fwd: Callable[[torch.Tensor], torch.Tensor],
                bwd: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.bwd = bwd
        if done is not None:
            return done.clone()
        y = fwd(x)
        return y.view_as(y) if y is x else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.bwd(grad.contiguous()), None, None, None


class RankProgram:
    """One rank's interpreter of a `CompiledProgram` (`group` None: a single rank, no collectives)."""

    def __init__(self, program: CompiledProgram, rank: int, group: Any = None, spans: Spans | None = None,
                 seed: int = 0) -> None:
        if group is None and program.world != 1:
            raise ShardingError(f"a program of {program.world} ranks needs a process group")
        self.program = program
        self.graph = program.graph
        self.rank = rank
        self.group = group
        self.spans = spans or Spans()
        self.seed = seed
        self.step = 0
        self.moves: dict[str, int] = {}  # collective conversions run, "fwd S0->R" -> count
        reads: dict[str, int] = {}
        for op in self.graph.ops:
            for t in set(op.inputs):
                reads[t] = reads.get(t, 0) + 1
        self._reads = reads
        self.params: dict[str, nn.Parameter] = {}  # parameter path (first name) -> this rank's leaf
        self.param_placement: dict[str, str] = {}  # path -> placement of the leaf
        self._given: dict[str, tuple[torch.Tensor, str]] = {}  # graph param/buffer tensor -> (local value, origin)
        self._tied: dict[str, tuple[nn.Parameter, str]] = {}  # graph param tensor of a tied group -> (whole leaf, want)
        # Gradient accumulation over micro-batches (a pipeline stage, `compose_worker`): with
        # `defer_param_grads` a parameter's partial-sum gradient (P -> R, its data-parallel all-reduce)
        # is summed locally per micro-batch and all-reduced once per step by `flush_param_grads`
        # (DDP's no_sync; exact, the all-reduce is linear) -- as `plait.sim.lowering.pipeline` prices it.
        self.defer_param_grads = False
        # The dtype parameter gradients cross the wire in (`amp.reduce_dtype`, the plan's gradient-
        # reduction dtype, as the simulator prices them: `plait.cost.program.Problem.grad_dtype`);
        # None: their own (fp32, the masters').
        self.grad_dtype: torch.dtype | None = None
        self._deferred: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (reader op, tensor) -> (leaf, sum)
        self._op = 0

    # ------------------------------------------------------------------ shards
    def rows(self, tensor: str, dim: int) -> tuple[int, int]:
        """(first row, rows) of this rank along `dim` of `tensor`."""
        sizes = self.program.sizes.get((tensor, dim))
        if sizes is None:
            raise ShardingError(f"tensor {tensor}: dimension {dim} is sharded but has no shard sizes")
        return sum(sizes[:self.rank]), sizes[self.rank]

    def local_slice(self, value: torch.Tensor, tensor: str, placement: str) -> torch.Tensor:
        """This rank's part of the whole `value` of `tensor` in `placement` (R, S<d>; P: rank 0 holds it)."""
        d = shard_dim(placement)
        if d is not None:
            first, n = self.rows(tensor, d)
            return value.narrow(d, first, n)
        if placement == PARTIAL and self.rank != 0:
            return torch.zeros_like(value)
        return value

    # ------------------------------------------------------------------ parameters
    def load(self, module: nn.Module) -> list[nn.Parameter]:
        """This rank's parameters (leaves for the optimizer), sliced from `module`'s whole ones."""
        by_param: dict[int, list[str]] = {}
        objects: dict[int, torch.Tensor] = {}
        for t in self.graph.tensors.values():
            if t.role in ("param", "buffer") and t.param is not None:
                value = module.get_parameter(t.param) if t.role == "param" else module.get_buffer(t.param)
                if t.role == "buffer":
                    self._given[t.name] = (value.detach(), REPLICATED)
                    continue
                by_param.setdefault(id(value), []).append(t.name)
                objects[id(value)] = value
        for t in self.graph.tensors.values():
            # an empty tensor export lifted as a constant (transformers' attention makes one): its
            # value is its shape and dtype, whichever device the graph was captured on
            if t.role == "constant" and t.producer is None and t.numel == 0 and t.name not in self._given:
                self._given[t.name] = (torch.empty(t.shape, dtype=getattr(torch, t.dtype)), REPLICATED)
        self._leaf_tensor: dict[str, str] = {}
        for key, tensors in by_param.items():
            whole = objects[key].detach()
            used = [t for t in tensors if t in self.program.stored]  # export may keep an unread alias
            if not used:
                continue
            path = self.graph.tensors[used[0]].param or used[0]
            self._leaf_tensor[path] = used[0]
            if len(used) == 1:
                t = used[0]
                q = self.program.stored[t]
                leaf = nn.Parameter(self.local_slice(whole, t, q).clone())
                self._given[t] = (leaf, q)
                self.params[path], self.param_placement[path] = leaf, q
            else:  # tied: stored whole, each use converted from it
                leaf = nn.Parameter(whole.clone())
                self.params[path], self.param_placement[path] = leaf, REPLICATED
                for t in used:
                    self._tied[t] = (leaf, self.program.stored[t])
        return list(self.params.values())

    def param_paths(self) -> dict[str, str]:
        """leaf path -> the graph tensor whose shard sizes the leaf has."""
        return dict(self._leaf_tensor)

    # ------------------------------------------------------------------ forward
    def forward(self, inputs: Sequence[Any], keep_shards: frozenset[str] = frozenset()) -> list[torch.Tensor]:
        """Run the program on this rank; the model's outputs, whole (replicated) on every rank --
        but those named in `keep_shards` stay this rank's shard (a loss computed per batch shard)."""
        graph = self.graph
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        if len(tensors) != len(graph.inputs):
            raise ShardingError(f"{graph.model}: the program takes {len(graph.inputs)} tensor inputs, got {len(tensors)}")
        self._values: dict[str, tuple[torch.Tensor, str]] = {}
        self._fwd: dict[tuple[str, str], torch.Tensor] = {}
        self._read_cache: dict[tuple[str, str, bool], torch.Tensor] = {}
        self._left = dict(self._reads)
        self._op = 0
        for name, x in zip(graph.inputs, tensors):
            self._values[name] = (x, REPLICATED)
        for t, (v, q) in self._given.items():
            self._values[t] = (v, q)
        for t, (leaf, want) in self._tied.items():
            self._values[t] = (self._convert(leaf, REPLICATED, want, t, sharded=False), want)
        for k, op in enumerate(graph.ops):
            self._op = k
            s = self.program.strategies[op.name]
            missing = [t for t in op.inputs if t not in self._values]
            if missing:
                raise ShardingError(f"op {op.name}: reads {missing[0]} ({graph.tensors[missing[0]].role}), which "
                                    "this rank has no value for (a constant lifted by export?)")
            local = [self._read(t, q, s.sharded) for t, q in zip(op.inputs, s.inputs)]
            out_shape = None
            if op.outputs and (not op.inputs or op.kind in SIZED_CREATION):  # creation: this rank's shard
                out_shape = list(graph.tensors[op.outputs[0]].shape)
                d = shard_dim(s.outputs[0])
                if d is not None:
                    out_shape[d] = self.rows(op.outputs[0], d)[1]
            row_offset = self.rows(op.inputs[0], 0)[0] if op.kind == "embedding" and s.inputs[0] == "S0" else 0
            if op.kind in _RANDOM:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_op_seed(self.seed, self.step, k, self.rank if s.splits_work else 0))
                    outs = local_call(op, s, local, graph, out_shape, row_offset)
            else:
                outs = local_call(op, s, local, graph, out_shape, row_offset)
            for t, p, v in zip(op.outputs, s.outputs, outs):
                self._check_shape(op.name, t, p, v)
                self._values[t] = (v, p)
            for t in set(op.inputs):
                self._left[t] -= 1
                if self._left[t] == 0 and t not in graph.outputs:
                    self._forget(t)
        outs = []
        for t in graph.outputs:
            v, p = self._values[t]
            keep = p == REPLICATED or t in keep_shards and shard_dim(p) is not None
            outs.append(v if keep else self._convert(v, p, REPLICATED, t, sharded=False))
        self._values, self._fwd, self._read_cache = {}, {}, {}
        return outs

    def flush_param_grads(self, bucket_bytes: float | None) -> None:
        """All-reduce the deferred parameter gradients (`defer_param_grads`) into their leaves, in
        buckets of `bucket_bytes` (None: one) taken in reverse op order (the order backward makes
        them, as the simulator's buckets); every rank of the group runs the same buckets."""
        if not self._deferred:
            return
        order = sorted(self._deferred, key=lambda kt: (-kt[0], kt[1]))
        bucket: list[tuple[int, str]] = []
        for n, key in enumerate(order):
            bucket.append(key)
            size = sum(self._deferred[k][1].numel() * self._deferred[k][1].element_size() for k in bucket)
            if n == len(order) - 1 or bucket_bytes is not None and size >= bucket_bytes:
                self._reduce_bucket(bucket)
                bucket = []
        self._deferred = {}

    def _reduce_bucket(self, keys: list[tuple[int, str]]) -> None:
        flat = torch.cat([self._deferred[k][1].reshape(-1) for k in keys])
        name = f"bwd bucket of {len(keys)} gradients P->R"
        self.moves["bwd P->R"] = self.moves.get("bwd P->R", 0) + 1
        with self.spans.collective():
            self.group.all_reduce(flat, name, "comm_spmd", dtype=self.grad_dtype)
        first = 0
        for k in keys:
            leaf, total = self._deferred[k]
            g = flat[first:first + total.numel()].view_as(total)
            first += total.numel()
            leaf.grad = g.clone() if leaf.grad is None else leaf.grad + g

    def _forget(self, t: str) -> None:
        self._values.pop(t, None)
        for key in [k for k in self._fwd if k[0] == t]:
            del self._fwd[key]
        for key in [k for k in self._read_cache if k[0] == t]:
            del self._read_cache[key]

    def _check_shape(self, op: str, t: str, p: str, v: torch.Tensor) -> None:
        want = list(self.graph.tensors[t].shape)
        d = shard_dim(p)
        if d is not None:
            want[d] = self.rows(t, d)[1]
        if list(v.shape) != want:
            raise ShardingError(f"op {op}: on rank {self.rank} its output {t} ({p}) has shape {list(v.shape)}, "
                                f"the program's shard sizes say {want}")

    def _read(self, t: str, q: str, sharded: bool) -> torch.Tensor:
        """`t` as the reader needs it: placement `q`, read by an op that computes a shard or not
        (only a whole read differs: a sharded reader's gradient is a partial sum)."""
        kind = sharded and q == REPLICATED
        key = (t, q, kind)
        got = self._read_cache.get(key)
        if got is None:
            value, origin = self._values[t]
            got = self._read_cache[key] = self._convert(value, origin, q, t, sharded)
        return got

    def _convert(self, value: torch.Tensor, origin: str, q: str, t: str, sharded: bool) -> torch.Tensor:
        differentiable = value.requires_grad and value.is_floating_point()
        done = self._fwd.get((t, q))
        if not differentiable:
            if done is None:
                done = self._fwd[(t, q)] = self._move(value, origin, q, t, "fwd")
            return done
        g_from, g_to = grad_placement(q, sharded), grad_home(origin)
        if q == origin and g_from == g_to:
            return value
        wire = self.grad_dtype if self.graph.tensors[t].role == "param" else None

        def bwd(g: torch.Tensor) -> torch.Tensor:
            if wire is not None and g.dtype != wire:  # a parameter's gradient moves in the reduction dtype
                return self._move(g.to(wire), g_from, g_to, t, "bwd").to(g.dtype)
            return self._move(g, g_from, g_to, t, "bwd")

        if self.defer_param_grads and (g_from, g_to) == (PARTIAL, REPLICATED) and self.graph.tensors[t].role == "param":
            key = (self._op, t)

            def bwd(g: torch.Tensor) -> torch.Tensor:  # noqa: F811 -- the deferred variant
                leaf, total = self._deferred.get(key, (value, None))
                self._deferred[key] = (leaf, g.clone() if total is None else total + g)
                return torch.zeros_like(value)

        out = _Convert.apply(value, done, lambda x: self._move(x, origin, q, t, "fwd"), bwd)
        if done is None:
            self._fwd[(t, q)] = out.detach()
        return out

    def _move(self, x: torch.Tensor, src: str, dst: str, t: str, phase: str) -> torch.Tensor:
        """The value of `x` (placement `src`) in placement `dst`: `plait.ir.program`'s table."""
        if src == dst:
            return x
        d_src, d_dst = shard_dim(src), shard_dim(dst)
        if src == REPLICATED:  # free: slice, or keep on rank 0
            return self.local_slice(x, t, dst).contiguous()
        if self.group is None:
            raise ShardingError(f"tensor {t}: {src} -> {dst} needs a collective but this program has one rank")
        name = f"{phase} {t} {src}->{dst}"
        what = f"{phase} {'S' if d_src is not None else src}->{'S' if d_dst is not None else dst}"
        self.moves[what] = self.moves.get(what, 0) + 1
        mode = self.program.collective.get(t, "padded")
        with self.spans.collective():
            if src == PARTIAL and dst == REPLICATED:
                y = x.contiguous().clone()
                self.group.all_reduce(y, name, "comm_spmd")
                return y
            if src == PARTIAL and d_dst is not None:
                return self.group.reduce_scatter_uneven(x, self.program.sizes[(t, d_dst)], d_dst, name, "comm_spmd",
                                                        mode=mode)
            if d_src is not None and dst == REPLICATED:
                return self.group.all_gather_uneven(x, self.program.sizes[(t, d_src)], d_src, name, "comm_spmd",
                                                    mode=mode)
            if d_src is not None and d_dst is not None:
                return self.group.all_to_all_uneven(x, self.program.sizes[(t, d_src)], d_src,
                                                    self.program.sizes[(t, d_dst)], d_dst, name, "comm_spmd")
        raise ShardingError(f"tensor {t}: no collective turns {src} into {dst}")


def _op_seed(seed: int, step: int, op_index: int, rank: int) -> int:
    """One random stream per (step, op): the same on every rank for a redundant op (replicated
    tensors stay equal), the rank's own for a sharded one."""
    return (seed * 1_000_003 + step * 10_007 + op_index * 101 + rank) % (2**63 - 1)


def whole_parameters(program: RankProgram, gather: Callable[[torch.Tensor, list[int], int], torch.Tensor] | None
                     ) -> dict[str, torch.Tensor]:
    """Every parameter whole (by path), its shards gathered with `gather(local, sizes, dim)`."""
    out = {}
    tensors = program.param_paths()
    for path, leaf in program.params.items():
        d = shard_dim(program.param_placement[path])
        value = leaf.detach()
        if d is not None:
            if gather is None:
                raise ShardingError(f"parameter {path} is sharded: gathering it needs the process group")
            value = gather(value, program.program.sizes[(tensors[path], d)], d)
        out[path] = value.clone()
    return out


def bytes_of(params: Sequence[torch.Tensor]) -> int:
    return sum(math.prod(p.shape) * p.element_size() for p in params)
