"""Traffic: the bytes of every message of one training iteration, and their time on a cluster path.

One module says how big each message is; the planner's analytic model
(`plait.planners.threed`), placement (`plait.planners.placement`), the memory estimator's
communication buffers (`plait.cost.memory`) and the simulator's lowering
(`plait.sim.lowering.tensor_parallel`) call it and keep no byte formulas of their own. Times come from
`plait.cost.collectives` (alpha-beta, NCCL-like algorithm choice); nothing is re-derived.

Message sizes (``S``, per rank, in nccl-tests' convention: the full buffer of an
all-reduce, the full output of an all-gather / full input of a reduce-scatter):

* **pp** -- activations forward and their gradients backward over every stage edge, per
  overlapping pair of micro-batches: ``bytes_per_sample * samples * a / a_capture / t``
  per tensor rank, where ``bytes_per_sample`` is what crosses the cut in the stage graph
  (`plait.ir.stage_graph`), ``a`` the plan's activation element size and ``t`` the
  producer's tensor-parallel degree where each tensor rank sends 1/t: with sequence
  parallelism (the boundary value is this rank's part of the sequence) or, in legacy
  Megatron-LM, its scatter-gather of pipeline tensors (``--scatter-gather-tensors-in-pipeline``:
  `scatter_gather`; the all-gather after the receive is not priced). Without either
  (``t = 1`` above) each tensor rank sends the whole replicated value to its peer: plait's
  engines (torch's pipelining over DTensor stages and plait's own executor) and torchtitan.
* **dp** -- gradients of a replica's parameters (per tensor rank) in the plan's
  gradient-reduction dtype (`Plan.grad_dtype`): all-reduce, or reduce-scatter under
  ZeRO-1/2 (Rajbhandari et al. 2020), once per iteration; none under ZeRO-3.
* **zero** -- ZeRO-3, per unit as the runtime shards them (`zero3_units`): every layer's own
  parameters all-gathered (compute dtype) before its forward and its backward of each
  micro-batch and its gradients reduce-scattered after its backward; parameters two layers
  of the stage share (the root unit) gathered and reduce-scattered once per iteration;
  ZeRO-1/2: the updated parameters all-gathered after the step.
* **tp** -- the collectives of Megatron's kernel sequence (`plait.cost.compute.layer_cost`:
  2 all-reduces of ``b s h a`` bytes forward and 2 backward per transformer layer, or an
  all-gather and a reduce-scatter at each with sequence parallelism; vocabulary-parallel
  embedding and cross-entropy all-reduces), per micro-batch and pass (recompute included).
* **tied** -- a tied embedding split over two stages: the embedding gradient
  (``V h / t`` elements per tensor rank, gradient dtype) all-reduced between the stage
  holding the embedding and the one holding the head (Megatron's embedding group).

Byte counts are whole bytes (rounded up). `Message.wire_bytes` is what all ranks of one
collective put on the wire in the ring decomposition -- all-reduce ``2(n-1) S``,
reduce-scatter / all-gather ``(n-1) S``, send/recv ``S`` -- the same total a pipelined
tree all-reduce moves; `Message.flows` lists it as point-to-point flows (ring order) so a
fabric model can route them. The per-step gradient-norm all-reduce (one fp32 scalar) is
left out.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from plait.cost.collectives import (
    GroupLinks,
    choose_algorithm,
    collective_time,
    group_links,
    ring_hops,
)
from plait.cost.compute import DEFAULT_MODEL, ComputeModel, LayerCost, dtype_bytes, layer_cost
from plait.errors import PlaitError
from plait.ir.stage_graph import Edge, Stage, StageGraph, largest_micro_batch, stage_graph

if TYPE_CHECKING:
    from plait.cluster.spec import GPUKind
    from plait.ir.opgraph import Layer, OpGraph, TiedParams
    from plait.ir.plan import Plan

CLASSES = ("dp", "tp", "pp", "zero", "tied", "spmd")  # spmd: a synthesized SPMD program's collectives


class TrafficError(PlaitError, ValueError):
    """A traffic question with impossible arguments."""


# ---------------------------------------------------------------- the formulas
def whole_bytes(x: float) -> int:
    """A message of x bytes occupies ceil(x) bytes (tolerating float noise below 1e-6)."""
    return int(math.ceil(x - 1e-6)) if x > 0 else 0


def wire_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes all `n` ranks send for one `op` of `nbytes` per rank (ring decomposition)."""
    if op == "send_recv":
        return nbytes
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes
    if op in ("reduce_scatter", "all_gather", "all_to_all", "broadcast"):
        return (n - 1) * nbytes
    raise TrafficError(f"unknown collective {op!r}")


def activation_scale(graph: OpGraph, plan: Plan) -> float:
    """Captured activation bytes -> the plan's compute dtype."""
    return dtype_bytes(plan.dtype) / max(1, graph.activation_dtype_bytes)


def composed_boundaries(plan: Plan, graph: OpGraph, aten: Any) -> tuple[dict[tuple[int, int], float],
                                                                       list[tuple[int, int, float]]]:
    """A composed plan's boundaries (its stages run SPMD programs): the bytes per sample each stage
    edge carries in the plan's dtype (the one stage graph's edge tensors), and the parameters two
    stages read -- tied embeddings -- as (first stage, last stage, bytes of the gradient in the plan's
    gradient-reduction dtype), from the model's aten graph `aten` (`plait.graph.aten_stage.shared_params`)."""
    from plait.graph.aten_stage import shared_params

    scale = activation_scale(graph, plan)
    per_sample = {(e.src, e.dst): e.bytes_per_sample * scale for e in stage_graph(plan, graph).edges}
    layers = [st.layers for st in plan.stages]
    tied = []
    for t in shared_params(aten, layers):
        holders = [s for s, lays in enumerate(layers) if any(op.layer in lays and t in op.inputs for op in aten.ops)]
        tied.append((holders[0], holders[-1], float(aten.tensors[t].numel * grad_elem_bytes(plan))))
    return per_sample, tied


def pp_message_bytes(bytes_per_sample: float, samples: int, scale: float, tp: int, split: bool) -> int:
    """Bytes one tensor rank sends over a stage edge for `samples` samples: 1/tp of the value when
    `split` (sequence parallelism, or legacy Megatron's scatter-gather), else all of it (module
    docstring)."""
    return whole_bytes(bytes_per_sample * samples * scale / (max(1, tp) if split else 1))


def pp_split(plan: Plan, scatter_gather: bool = False) -> bool:
    """Whether each tensor rank sends 1/tp of a pipeline boundary value (`pp_message_bytes`)."""
    return bool(plan.sequence_parallel) or scatter_gather


def grad_elem_bytes(plan: Plan) -> int:
    """Bytes per reduced gradient element: the plan's gradient-reduction dtype."""
    return dtype_bytes(plan.grad_dtype)


def dp_grad_op(plan: Plan) -> str | None:
    """The data-parallel gradient collective: all-reduce, reduce-scatter (ZeRO-1/2), none (ZeRO-3)."""
    if plan.zero == 3:
        return None
    return "reduce_scatter" if plan.zero >= 1 else "all_reduce"


def dp_grad_bytes(params: float, plan: Plan) -> int:
    return whole_bytes(params * grad_elem_bytes(plan))


def param_gather_bytes(params: float, plan: Plan) -> int:
    """ZeRO parameter all-gather (ZeRO-3 before each pass, ZeRO-1/2 after the step): compute dtype."""
    return whole_bytes(params * dtype_bytes(plan.dtype))


def grad_scatter_bytes(params: float, plan: Plan) -> int:
    """ZeRO-3 gradient reduce-scatter after each backward: gradient dtype."""
    return whole_bytes(params * grad_elem_bytes(plan))


def tied_grad_bytes(tied: TiedParams, tp: int, plan: Plan) -> int:
    """Bytes of one tensor rank's gradient of parameters two stages share (`OpGraph.tied`),
    summed between the stages' copies every step: the gradient dtype; vocabulary-parallel
    tensors are split over the tensor ranks."""
    return whole_bytes(tied.params / (max(1, tp) if tied.tp_sharded else 1) * grad_elem_bytes(plan))


@dataclass(frozen=True)
class Zero3Units:
    """ZeRO-3's units of one stage as plait's runtime shards them (`plait.runtime.zero3`, FSDP's
    flat parameters): each layer's own parameters are one unit, all-gathered before the layer's
    forward and again before its backward, its gradient reduce-scattered right after its
    backward, per micro-batch; parameters two layers of the stage share (a tied embedding and LM
    head, `OpGraph.tied`) form the *root* unit, gathered once per step and reduce-scattered once
    after the step's last backward. Parameters per tensor rank."""

    layers: tuple[tuple[str, float], ...]  # (layer name, its unit's parameters), in layer order
    root: float  # parameters of the root unit (0: none)


def zero3_units(layers: Sequence[Layer], params: Sequence[float], tied: Sequence[TiedParams],
                tp: int = 1) -> Zero3Units:
    """`Zero3Units` of a stage holding `layers`, whose per-tensor-rank parameter counts are `params`
    (each tied parameter counted in its owner, as the capture counts it)."""
    own = {layer.name: float(p) for layer, p in zip(layers, params)}
    root = 0.0
    for t in tied:
        if t.owner in own and t.user in own:  # both users on this stage: one root parameter
            share = t.params / (max(1, tp) if t.tp_sharded else 1)
            own[t.owner] = max(0.0, own[t.owner] - share)
            root += share
    return Zero3Units(tuple((layer.name, own[layer.name]) for layer in layers), root)


class _GradParams(Protocol):
    """What `layer_grad_params` reads of a layer's cost (a `LayerCost` or the lowering's summary)."""

    params: float
    grad_params: float


def layer_grad_params(layer: Layer, cost: _GradParams, stage_has_embedding: bool) -> float:
    """Parameters of `layer` whose gradients one tensor rank reduces: its own, or for a head whose
    tied embedding is on another stage, the copy of the word embeddings Megatron keeps there."""
    if layer.tp_style == "head" and cost.grad_params > cost.params and not stage_has_embedding:
        return cost.grad_params
    return cost.params


def replica_grad_params(layers: Sequence[Layer], costs: Sequence[LayerCost]) -> float:
    """Parameters whose gradients one tensor rank of a replica reduces (`layer_grad_params` summed)."""
    has_embedding = any(layer.tp_style == "embedding" for layer in layers)
    return float(sum(layer_grad_params(layer, cost, has_embedding) for layer, cost in zip(layers, costs)))


# ---------------------------------------------------------------- messages and flows
@dataclass(frozen=True)
class Flow:
    """Bytes one device sends another for one traffic class and collective, per iteration."""

    src: int
    dst: int
    nbytes: float
    cls: str
    op: str
    name: str
    call_bytes: int = 0  # bytes per rank of one call (NCCL's channel count depends on it)


@dataclass(frozen=True)
class Message:
    """`count` calls per iteration of one collective (or send/recv) of `nbytes` per rank, on each
    of `groups` (device ids, ring order; a send/recv group is (src, dst)). `stage` / `replica`
    say where it runs (replica -1: it spans the replicas)."""

    name: str
    cls: str
    op: str
    nbytes: int
    groups: tuple[tuple[int, ...], ...]
    count: int
    stage: int
    replica: int = -1

    @property
    def ranks(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.op, self.nbytes, self.ranks) * len(self.groups) * self.count

    def flows(self, node_of: Sequence[int] | None = None, nics_of_node: Sequence[int] | None = None
              ) -> list[Flow]:
        """Device-to-device flows of its calls: send/recv as given; a ring collective as its
        ring's hops. With the cluster's `node_of` (and NICs per node), a hop between nodes is
        spread over the rails NCCL drives (`plait.cost.collectives.ring_hops`, the layout the
        simulator loads the links with); without, each hop is one flow."""
        out = []
        for g in self.groups:
            n = len(g)
            if self.op == "send_recv":
                out.append(Flow(g[0], g[1], float(self.nbytes * self.count), self.cls, self.op, self.name,
                                self.nbytes))
                continue
            per_hop = wire_bytes(self.op, self.nbytes, n) / n * self.count
            hops = ring_hops(g, node_of, nics_of_node) if node_of is not None else \
                [(g[i], g[(i + 1) % n], 1.0) for i in range(n)]
            out += [Flow(a, b, per_hop * share, self.cls, self.op, self.name, self.nbytes) for a, b, share in hops]
        return out


@dataclass
class IterationTraffic:
    """Every message of one iteration of a plan (module docstring)."""

    messages: list[Message]
    stage_graph: StageGraph

    def of_class(self, cls: str) -> list[Message]:
        return [m for m in self.messages if m.cls == cls]

    def totals(self) -> dict[str, int]:
        """Wire bytes per traffic class (every class present, 0 when none)."""
        out = dict.fromkeys(CLASSES, 0)
        for m in self.messages:
            out[m.cls] += m.wire_bytes
        return out

    def flows(self, node_of: Sequence[int] | None = None, nics_of_node: Sequence[int] | None = None
              ) -> list[Flow]:
        """Every message's flows (`Message.flows`)."""
        return [f for m in self.messages for f in m.flows(node_of, nics_of_node)]


class _Acc:
    """Accumulates messages: identical (name, cls, op, bytes, stage, replica) calls on the same
    group add counts; groups with equal counts are folded into one Message."""

    def __init__(self) -> None:
        self.calls: dict[tuple, Counter] = defaultdict(Counter)

    def add(self, name: str, cls: str, op: str, nbytes: int, groups: Sequence[tuple[int, ...]], count: int,
            stage: int, replica: int = -1) -> None:
        if count <= 0:
            return
        c = self.calls[(name, cls, op, nbytes, stage, replica)]
        for g in groups:
            c[tuple(g)] += count

    def messages(self) -> list[Message]:
        out = []
        for (name, cls, op, nbytes, stage, replica), groups in self.calls.items():
            by_count: dict[int, list[tuple[int, ...]]] = defaultdict(list)
            for g, k in groups.items():
                by_count[k].append(g)
            for k, gs in by_count.items():
                out.append(Message(name, cls, op, nbytes, tuple(gs), k, stage, replica))
        return out


# ---------------------------------------------------------------- one iteration
LayerCostFn = Callable[["Layer", int, int, float | None], LayerCost]


def layer_cost_fn(graph: OpGraph, plan: Plan, kind: GPUKind | None = None,
                  model: ComputeModel = DEFAULT_MODEL) -> LayerCostFn:
    """`(layer, micro_batch, tp, share) -> LayerCost` from the compute model, cached. Message sizes
    and parameter counts do not depend on the GPU kind; `kind` only picks whose times come along."""
    if kind is None:
        from plait.cluster.catalog import GPU_KINDS

        kind = GPU_KINDS["a100-80gb"]
    cache: dict[tuple, LayerCost] = {}

    def cost(layer: Layer, mb: int, tp: int, share: float | None) -> LayerCost:
        sig = (("T", layer.kind, layer.fwd_flops, layer.param_count) if layer.tp_style == "transformer"
               else layer.name)
        key = (sig, mb, tp, None if share is None else round(share, 9))
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = layer_cost(layer, graph, mb, kind, plan.dtype, tp=tp, share=share,
                                          sequence_parallel=plan.sequence_parallel, model=model)
        return hit

    return cost


def iteration_traffic(graph: OpGraph, plan: Plan, sg: StageGraph | None = None, *,
                      cost: LayerCostFn | None = None, memo: dict | None = None,
                      scatter_gather: bool = False) -> IterationTraffic:
    """Every message of one iteration of `plan` on `graph` (module docstring).

    `scatter_gather`: pipeline values cross as legacy Megatron-LM sends them (1/tp per tensor rank
    without sequence parallelism; `pp_message_bytes`), not as plait's engines do (whole).

    `memo`: a dict kept by a caller that asks about many plans (the planner's analytic model):
    the pipeline and tied-embedding messages of a stage graph (they depend on it and the dtype
    alone, not on ZeRO or recompute) and each stage's tensor-parallel call counts are computed
    once and replayed -- the same messages in the same order. Give it only with a `cost` that
    is the same function for every plan asked (it is part of the key by identity)."""
    sg = sg if sg is not None else stage_graph(plan, graph)
    cost = cost if cost is not None else layer_cost_fn(graph, plan)
    by_name = {layer.name: layer for layer in graph.layers}
    acc = _Acc()
    for st in sg.stages:
        share0 = st.tp_ratios[0] if st.tp > 1 else None
        layers = [by_name[n] for c in st.chunks for n in sg.chunks[c].layers]
        mb0 = max(1, largest_micro_batch(st.replicas[0].samples, st.micro_batch)) if st.replicas else 1
        costs = [cost(layer, mb0, st.tp, share0) for layer in layers]
        _tp_messages(acc, sg, st, by_name, cost, plan, memo)
        _dp_messages(acc, st, replica_grad_params(layers, costs), plan)
        _zero_messages(acc, sg, st, by_name, cost, mb0, share0, plan, graph.tied)
    split = pp_split(plan, scatter_gather)
    key = ("pp", id(sg), plan.dtype, plan.grad_dtype, split)
    calls = None if memo is None else memo.get(key)
    if calls is None or calls[0] is not sg:  # (the stage graph is held so its id stays unique)
        rec = _Recorder()
        for e in sg.edges:
            _pp_messages(rec, sg, e, activation_scale(graph, plan), split)
        _tied_messages(rec, sg, graph, by_name, plan)
        calls = (sg, rec.log)
        if memo is not None:
            memo[key] = calls
    for args in calls[1]:
        acc.add(*args)
    return IterationTraffic(acc.messages(), sg)


class _Recorder(_Acc):
    """An `_Acc` that only logs its `add` calls, to replay them into another."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def add(self, *args: object) -> None:
        self.log.append(args)


def _replica_groups(st: Stage) -> dict[int, list[int]]:
    """Replicas of a stage with the same number of samples (the same micro-batches, so the
    same tensor-parallel traffic), by sample count."""
    out: dict[int, list[int]] = defaultdict(list)
    for r in st.replicas:
        out[r.samples].append(r.index)
    return out


def _tp_messages(acc: _Acc, sg: StageGraph, st: Stage, by_name: dict, cost: LayerCostFn, plan: Plan,
                 memo: dict | None = None) -> None:
    if st.tp <= 1:
        return
    share0 = st.tp_ratios[0]
    names = tuple(n for c in st.chunks for n in sg.chunks[c].layers)
    for _, reps in _replica_groups(st).items():
        groups = [tuple(st.replicas[r].devices) for r in reps]
        sizes = tuple(st.replicas[reps[0]].size_counts().items())
        key = ("tp", id(cost), names, sizes, st.tp, share0, plan.recompute)
        calls = None if memo is None else memo.get(key)
        if calls is None or calls[0] is not cost:
            counts: Counter = Counter()  # (pass, op, bytes) -> calls per replica
            for size, units in sizes:
                for layer in (by_name[n] for n in names):
                    lc = cost(layer, size, st.tp, share0)
                    for pname, part in (("fwd", lc.fwd), ("bwd", lc.bwd), ("rec", lc.recompute(plan.recompute))):
                        for c in part.collectives:
                            counts[(pname, c.op, whole_bytes(c.nbytes))] += units
            calls = (cost, counts)
            if memo is not None:
                memo[key] = calls
        for (pname, op, nbytes), k in calls[1].items():
            acc.add(f"tp {pname}", "tp", op, nbytes, groups, k, st.index, reps[0])


def _dp_messages(acc: _Acc, st: Stage, params: float, plan: Plan) -> None:
    op = dp_grad_op(plan)
    if st.dp < 2 or op is None:
        return
    rings = [tuple(r.devices[t] for r in st.replicas) for t in range(st.tp)]
    acc.add(f"{op} grads", "dp", op, dp_grad_bytes(params, plan), rings, 1, st.index)
    if plan.zero in (1, 2):
        acc.add("allgather params", "zero", "all_gather", param_gather_bytes(params, plan), rings, 1, st.index)


def _zero_messages(acc: _Acc, sg: StageGraph, st: Stage, by_name: dict, cost: LayerCostFn, mb0: int,
                   share0: float | None, plan: Plan, tied: Sequence[TiedParams]) -> None:
    if plan.zero != 3 or st.dp < 2:
        return
    rings = [tuple(r.devices[t] for r in st.replicas) for t in range(st.tp)]
    units = max(r.count for r in st.replicas)
    layers = [by_name[n] for c in st.chunks for n in sg.chunks[c].layers]
    z = zero3_units(layers, [cost(layer, mb0, st.tp, share0).params for layer in layers], tied, st.tp)
    for _name, params in z.layers:
        if params <= 0:  # a layer without parameters of its own has no unit
            continue
        # each layer's unit: before every forward and every backward of every micro-batch, and
        # after every backward (equal units add counts on one message)
        acc.add("allgather params", "zero", "all_gather", param_gather_bytes(params, plan), rings, 2 * units,
                st.index)
        acc.add("reducescatter grads", "zero", "reduce_scatter", grad_scatter_bytes(params, plan), rings, units,
                st.index)
    if z.root > 0:  # the root unit: once per step
        acc.add("allgather params root", "zero", "all_gather", param_gather_bytes(z.root, plan), rings, 1,
                st.index)
        acc.add("reducescatter grads root", "zero", "reduce_scatter", grad_scatter_bytes(z.root, plan), rings, 1,
                st.index)


def _pp_messages(acc: _Acc, sg: StageGraph, e: Edge, scale: float, split: bool) -> None:
    """Activations forward and gradients backward over edge `e`, per overlapping micro-batch pair."""
    src, dst = sg.stage_of_chunk(e.src), sg.stage_of_chunk(e.dst)
    aligned = (src.micro_batch == dst.micro_batch and len(src.replicas) == len(dst.replicas)
               and all((p.first, p.samples) == (q.first, q.samples) for p, q in zip(src.replicas, dst.replicas)))
    if aligned:  # every chain: replica r's micro-batches meet replica r's, one to one
        for _, reps in _replica_groups(src).items():
            pairs = [pair for r in reps if src.replicas[r].devices != dst.replicas[r].devices
                     for pair in _rank_pairs(src.replicas[r].devices, dst.replicas[r].devices)]
            if not pairs:
                continue  # two chunks of one device group: no transfer
            for size, units in src.replicas[reps[0]].size_counts().items():
                _pp_add(acc, e, src, dst, reps[0], reps[0], pairs, e.bytes_per_sample, size, scale, units, split)
        return
    for q in dst.replicas:
        for p in src.replicas:
            if p.devices == q.devices or p.first >= q.first + q.samples or q.first >= p.first + p.samples:
                continue
            for qm in q.micro_batches:
                for pm in p.micro_batches:
                    lo, hi = max(qm.first, pm.first), min(qm.first + qm.size, pm.first + pm.size)
                    if hi > lo:
                        _pp_add(acc, e, src, dst, p.index, q.index, _rank_pairs(p.devices, q.devices),
                                e.bytes_per_sample, hi - lo, scale, 1, split)


def _rank_pairs(src: list[int], dst: list[int]) -> list[tuple[int, int]]:
    """Tensor rank t of the producer sends to rank t (mod the consumer's tp) of the consumer."""
    return [(a, dst[t % len(dst)]) for t, a in enumerate(src)]


def _pp_add(acc: _Acc, e: Edge, src: Stage, dst: Stage, p: int, q: int, pairs: list[tuple[int, int]],
            per_sample: float, samples: int, scale: float, count: int, split: bool) -> None:
    nbytes = pp_message_bytes(per_sample, samples, scale, len(src.replicas[p].devices), split)
    acc.add(f"send act c{e.src}->c{e.dst}", "pp", "send_recv", nbytes, pairs, count, src.index, p)
    acc.add(f"send grad c{e.dst}->c{e.src}", "pp", "send_recv", nbytes, [(b, a) for a, b in pairs], count,
            dst.index, q)


def _tied_messages(acc: _Acc, sg: StageGraph, graph: OpGraph, by_name: dict, plan: Plan) -> None:
    """The all-reduce of shared parameters' gradients between a stage holding their owner layer
    and one holding a later user of them (Megatron's embedding group), per replica."""
    def holds(st: Stage, layer: str) -> bool:
        return any(layer in sg.chunks[c].layers for c in st.chunks)

    for t in graph.tied:
        for so in (s for s in sg.stages if holds(s, t.owner)):
            for su in (s for s in sg.stages if holds(s, t.user)):
                if so.index == su.index:
                    continue
                for ro, ru in zip(so.replicas, su.replicas):
                    pairs = [(a, b) for a, b in zip(ro.devices, ru.devices)]
                    acc.add("allreduce tied embedding", "tied", "all_reduce", tied_grad_bytes(t, so.tp, plan),
                            pairs, 1, so.index, ro.index)


def program_messages(comms: Sequence[tuple[str, Any]], ring: Sequence[int]) -> list[Message]:
    """An SPMD program's collectives (`plait.cost.program.Program.comms`: (name, Comm) with `op`,
    `tensor`, `nbytes` of the whole tensor, `group`) as Messages of class "spmd" over `ring` (the
    program's devices, ring order), each once per iteration (a program runs one pass).

    Sizes in nccl-tests' convention (module docstring): the whole tensor for all-reduce,
    all-gather and reduce-scatter; an all-to-all's per-rank buffer is 1/n of it. Uneven shares
    move the same ring total as even ones for grouped collectives (every shard crosses to the
    other n-1 ranks); padded ones move more -- the bytes here are the even ring's. Only programs
    over one flat group are described ("world"; hierarchical programs have no plan form)."""
    n = len(ring)
    acc = _Acc()
    for _, c in comms:
        if getattr(c, "group", "world") != "world":
            raise TrafficError(f"collective {c.op} of {c.tensor}: group {c.group!r}; only flat programs "
                               f"(group 'world') are described")
        nbytes = c.nbytes / n if c.op == "all_to_all" else c.nbytes
        acc.add(f"{c.op} {c.tensor}", "spmd", c.op, whole_bytes(nbytes), [tuple(ring)], 1, 0)
    return acc.messages()


# ---------------------------------------------------------------- time on a cluster
def message_time(msg: Message, bandwidth: np.ndarray, latency: np.ndarray, node_of: Sequence[int],
                 pinned: str | None = None,
                 links_of: Callable[[tuple[int, ...]], GroupLinks] | None = None) -> float:
    """Seconds of one call of `msg` on its slowest group (alpha-beta, `plait.cost.collectives`).
    `links_of` may supply (cached) group summaries; groups with the same one cost the same."""
    if msg.nbytes <= 0 or not msg.groups:
        return 0.0
    if msg.op == "send_recv":
        return max(float(latency[a, b]) + msg.nbytes / float(bandwidth[a, b]) if a != b else 0.0
                   for a, b in msg.groups)
    if links_of is None:
        def links_of(g: tuple[int, ...]) -> GroupLinks:
            return group_links(list(g), bandwidth, latency, node_of)
    worst = 0.0
    for links in {links_of(g) for g in msg.groups}:
        algo = choose_algorithm(msg.op, msg.nbytes, links, pinned)
        worst = max(worst, collective_time(msg.op, msg.nbytes, links, algo))
    return worst


def task_class_bytes(task_args: Sequence[dict | None]) -> dict[str, int]:
    """Wire bytes per traffic class of a lowered task graph's communication tasks: each task's
    args carry `cls`, `op`, `bytes` (per rank), `ranks` and `copies` (identical calls it stands
    for: tensor ranks' twins, replicas folded by symmetry)."""
    out = dict.fromkeys(CLASSES, 0)
    for a in task_args:
        if a and "cls" in a:
            out[a["cls"]] += wire_bytes(a["op"], int(a["bytes"]), int(a["ranks"])) * int(a["copies"])
    return out
