"""Per-device peak memory of one training iteration: (OpGraph, Plan, Cluster) -> MemoryEstimate.

The planners call this for thousands of candidate plans, so everything that depends
only on the model is reduced once per `OpGraph` to numpy arrays over layers
(`_layer_arrays`), and a plan costs a few vector operations per pipeline stage.

What lives on a device at its peak (all bytes):

* **Model states** (Rajbhandari et al. 2020, "ZeRO", §3.1 and Fig. 1) -- ``precision="megatron"``;
  under ``"amp"`` (torch's autocast over fp32 parameters, plait's engines) 4 + 4 + 8 bytes with
  Adam, FSDP2's gathered low-precision parameters beside them (its gradients sharded from ZeRO-1
  on: it reduce-scatters every one), and autocast's bf16 parameter
  copies counted per micro-batch among the activations (`state_bytes_per_param`). With Ψ
  parameters on the device and N data-parallel replicas, mixed precision
  (bf16/fp16) Adam keeps 2Ψ weights + 2Ψ gradients + 12Ψ optimizer state (fp32
  master weights, m, v) = 16Ψ; fp32 training keeps 4Ψ + 4Ψ + 8Ψ. ZeRO-1
  partitions the optimizer state (4Ψ + 12Ψ/N), ZeRO-2 also the gradients
  (2Ψ + 14Ψ/N), ZeRO-3 also the weights (16Ψ/N).
  Ψ itself is what Megatron tensor parallelism leaves on a tensor rank: the
  weights of matmuls in transformer and head layers, and the word-embedding table
  (vocab-parallel), are split by the rank's tensor share; layer norms, biases of
  non-matmul ops and position embeddings are replicated (Shoeybi et al. 2019, §3).
  Parameters two layers share (`OpGraph.tied`: a tied word embedding) get a second copy on the stage
  holding the head when that is not the embedding's stage, as Megatron does.
* **Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", §4). Per layer and sample the capture records the
  bytes autograd saves (`saved_bytes`), the part tensor parallelism splits
  (`saved_tp_bytes`) and the part selective recompute drops
  (`saved_selective_bytes`). On a tensor rank holding share r (1/t when even):
  ``replicated * (r if sequence_parallel else 1) + tp_part * r``; selective
  recompute subtracts ``selective * r``; full recompute keeps only the layer input
  (`input_bytes`, split by r under sequence parallelism) and, while a layer is
  being recomputed in backward, that layer's full activations. For a GPT layer
  this reproduces sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)),
  sbh(34/t + 5as/(ht)), selective sbh(34/t) / sbh(10 + 24/t), and full 2sbh.
  A stage keeps several micro-batches in flight: 1F1B ``min(pp - i, m)``
  (Narayanan et al. 2021, §2.2), GPipe all m, interleaved 1F1B
  ``min(2(pp - i - 1) + (v - 1)pp + 1, m v)`` model chunks (Megatron-LM's warm-up
  count + 1; on stage 0 that is L(1 + (p-1)/(pv)) layers' worth, Korthikanti
  §4.2.3), and a stage of a graph pipeline 1 + its longest path to a sink stage
  (GraphPipe's generalised 1F1B), more where stages' micro-batch sizes or replicas differ
  (read off the built graph 1F1B action lists, `plait.schedule.graph_in_flight`).
* **Loss working set** (``loss="eager"``). The sink layers' outputs (GPT: the
  logits, s·b·vocab) converted to fp32 for the loss. PyTorch's eager
  ``cross_entropy`` holds four such tensors at the start of backward -- the logits
  the caller keeps, the saved log-softmax output, and the gradients of both -- as
  measured with ``MemTracker`` (bench/memory_error.py); the caller's logits are in the
  model's output dtype (a bf16 step under autocast: 3.5 fp32 copies, measured the same
  way, table (e)); the training loop then keeps
  the outputs (one copy) through the rest of backward and the optimizer step.
  Megatron's fused vocab-parallel cross entropy (``loss="fused"``) keeps one fp32
  copy at the loss and frees the logits afterwards; ``loss="eager-low"`` is the eager loss in the
  outputs' dtype (a whole-model fp16 engine without autocast: DeepSpeed's fp16).
* **Backward of a layer**: walking its ops in reverse, at op k the saved tensors of
  ops 0..k are still alive (under full recompute all of them rebuilt; under
  selective recompute the attention core's once backward reaches it) plus the
  gradients of op k's output and inputs (e.g. the attention scores, the MLP's
  4h-wide hidden state) and of the layer's output: max_k of that, on top of what
  the earlier layers keep. Graphs without op detail use the layer totals.
* **Gradients over time.** Megatron's contiguous gradient buffer, DDP's buckets,
  ZeRO partitions and gradient accumulation (m > 1) keep every gradient allocated
  for the whole iteration. A plain eager fp32 loop with one micro-batch and
  ``zero_grad(set_to_none=True)`` (PyTorch's default) has none during forward and
  gradients only of the layers backward has passed; we model that case exactly
  (prefix sums over layers), because there it decides the peak.
* **Optimizer step working set**: ``adam`` is a fused kernel (Megatron/Apex
  FusedAdam, ``torch.optim.Adam(fused=True)``) with no full-size temporaries;
  ``adam-foreach`` (PyTorch's default on CUDA) makes one fp32 copy of the whole
  state partition (``_foreach_sqrt(exp_avg_sq)``); ``adam-loop`` (PyTorch's
  default on CPU) makes two temporaries the size of the largest parameter tensor.
  The step runs after backward, so the peak is the larger of the two phases.
* **Communication buffers** (under ``"amp"``: DDP reduces its bucket views in place, FSDP2 has
  no bucket and gathers a ZeRO-3 layer only while it runs): one in-flight data-parallel gradient bucket
  (the plan's ``grad_bucket_mb``, 25 MiB by default as DDP's ``bucket_cap_mb``; 0 for
  Megatron's contiguous buffer reduced in place), with gradients as bucket views, the ZeRO-3 parameter all-gather buffer (the two
  largest layers: the one running and the one prefetched), and pipeline send/recv
  buffers of one micro-batch of each activation crossing a stage boundary.
* **Framework overhead**: ``FRAMEWORK_OVERHEAD_BYTES`` = 1 GiB per GPU: the CUDA
  context with PyTorch's kernels (about 0.5-0.8 GiB on recent GPUs), cuBLAS
  workspaces and NCCL communicator buffers (NCCL_BUFFSIZE 4 MiB per channel and
  peer). Pass ``overhead_bytes=0`` when comparing with a CPU measurement, which
  has none of these.

`plait.measure.step_memory.measure_step_peak` measures the same quantity on a real CPU training step with
PyTorch's MemTracker; bench/memory_error.py compares the two, and the per-layer
activations with Korthikanti's formulas.

The other plan forms' memory lives here too: an SPMD program's (`memory_model`: per device
``replicated + sum_g ratio_g * sharded_g``, `MemoryModel`) and a composed plan's
(`composed_peak_memory`: each stage's program plus the activations of the micro-batches its
schedule keeps in flight, read off the schedule's action lists by `plait.schedule.in_flight`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster
from plait.cost.program import Problem, Program, Segments, segments, stored_placements
from plait.cost.traffic import pp_message_bytes, pp_split
from plait.errors import PlaitError
from plait.ir.opgraph import TP_CUT_ROLES, OpGraph
from plait.ir.plan import Plan, default_grad_dtype
from plait.ir.program import PARTIAL, REPLICATED, shard_dim
from plait.ir.stage_graph import (
    chain_cut_bytes,
    chunk_graph,
    micro_batch_sizes,
    replica_loads,
)
from plait.schedule import ScheduleError, chain_in_flight, graph_in_flight
from plait.schedule.builders import eager_warmup

KiB, MiB, GiB = 2**10, 2**20, 2**30
FRAMEWORK_OVERHEAD_BYTES = 1 * GiB
DP_BUCKET_BYTES = 25 * MiB
# loss implementation -> (copies of the model outputs at the loss, of which the first is the caller's
# in the outputs' dtype and the rest fp32; copies of the outputs (their dtype) the training loop
# holds through backward and the step). "eager-low": the same eager loss in the outputs' dtype,
# as a whole-model fp16 / bf16 engine without autocast computes it (DeepSpeed's fp16).
LOSS_MODELS = {"eager": (4.0, 1.0), "eager-low": (4.0, 1.0), "fused": (1.0, 0.0)}

_DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}

# name -> (optimizer-state bytes per parameter in fp32 / mixed precision, step working set kind).
# Mixed precision keeps the fp32 master weights (4 bytes) inside the optimizer state.
_OPTIMIZERS: dict[str, tuple[int, int, str]] = {
    "adam": (8, 12, "fused"),
    "adamw": (8, 12, "fused"),
    "adam-foreach": (8, 12, "foreach"),
    "adamw-foreach": (8, 12, "foreach"),
    "adam-loop": (8, 12, "loop"),
    "adamw-loop": (8, 12, "loop"),
    "sgd": (0, 4, "fused"),
    "sgd-momentum": (4, 8, "fused"),
}
OPTIMIZERS = tuple(_OPTIMIZERS)
# How a bf16 / fp16 plan keeps its states (`state_bytes_per_param`): Megatron-LM's low-precision
# weights with fp32 masters, or torch's autocast over fp32 parameters (plait's engines)
PRECISIONS = ("megatron", "amp")

CATEGORIES = ("weights", "grads", "optimizer", "activations", "logits", "comm_buffers", "other")
_W, _G, _O, _A, _L, _C, _X = range(len(CATEGORIES))
_MATMUL_HINTS = ("mm", "linear", "matmul", "conv")
_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy", "mse_loss", "binary_cross_entropy", "l1_loss",
             "smooth_l1_loss", "huber_loss", "kl_div")


class MemoryEstimateError(PlaitError, ValueError):
    """A (graph, plan, cluster) the memory estimator cannot evaluate; the message names the field."""


# ============================================================================ result types


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes live on one device at its peak, by category (they sum to `total`).

    `phase` says when the peak happens: ``"backward"`` (activations, loss and
    backward temporaries) or ``"optimizer step"`` (all gradients plus the step's
    temporaries, activations freed)."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0  # loss working set on the stage holding the model's outputs
    comm_buffers: int = 0
    other: int = 0  # framework overhead, backward/recompute/optimizer-step temporaries
    phase: str = "backward"

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.comm_buffers + self.other)

    def as_dict(self) -> dict[str, int | str]:
        d: dict[str, int | str] = {c: getattr(self, c) for c in CATEGORIES}
        d["total"] = self.total
        d["phase"] = self.phase
        return d


@dataclass
class MemoryEstimate:
    """Per-device peak memory of a plan on a cluster.

    `peak_bytes` and `capacity_bytes` are indexed by cluster device id (0 for devices
    the plan does not use). `devices` lists the ids the plan uses."""

    model: str
    cluster: str
    devices: list[int]
    peak_bytes: list[int]
    capacity_bytes: list[int]
    kinds: list[str]  # GPU kind name per cluster device
    nodes: list[int]  # node index per cluster device
    _matrix: np.ndarray = field(repr=False)  # (num_devices, len(CATEGORIES)) bytes at the peak
    _phase_step: np.ndarray = field(repr=False)  # bool per device: peak in the optimizer step

    @property
    def fits(self) -> bool:
        return not self.over_devices

    @property
    def over_devices(self) -> list[int]:
        peak = np.asarray(self.peak_bytes)
        cap = np.asarray(self.capacity_bytes)
        return [int(d) for d in np.flatnonzero(peak > cap)]

    @property
    def headroom_bytes(self) -> list[int]:
        """Capacity minus peak per device id (negative where it does not fit)."""
        return [c - p for c, p in zip(self.capacity_bytes, self.peak_bytes)]

    @property
    def max_peak_bytes(self) -> int:
        return max(self.peak_bytes) if self.peak_bytes else 0

    @property
    def violations(self) -> list[str]:
        """One human sentence per device that runs out of memory."""
        out = []
        for d in self.over_devices:
            need, has = self.peak_bytes[d], self.capacity_bytes[d]
            out.append(
                f"does not fit on GPU {d} ({self.kinds[d]}, node {self.nodes[d]}): needs "
                f"{need / GiB:.1f} GiB, has {has / GiB:.1f} GiB — over by {(need - has) / GiB:.1f} GiB"
            )
        return out

    def breakdown(self, device: int) -> MemoryBreakdown:
        row = self._matrix[device]
        weights, grads, optimizer, activations, logits, comm, other = (int(round(x)) for x in row)
        return MemoryBreakdown(weights, grads, optimizer, activations, logits, comm, other,
                               phase="optimizer step" if self._phase_step[device] else "backward")

    @property
    def breakdowns(self) -> dict[int, MemoryBreakdown]:
        return {d: self.breakdown(d) for d in self.devices}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "cluster": self.cluster,
            "fits": self.fits,
            "peak_bytes": list(self.peak_bytes),
            "capacity_bytes": list(self.capacity_bytes),
            "breakdown": {str(d): b.as_dict() for d, b in self.breakdowns.items()},
            "violations": self.violations,
        }

    def table(self, title: str | None = None) -> Any:
        """A rich Table: one row per group of devices with the same kind and breakdown."""
        from rich.table import Table

        table = Table(title=title or f"memory per GPU: {self.model} on {self.cluster}")
        table.add_column("GPUs")
        table.add_column("kind")
        for c in CATEGORIES:
            table.add_column(c.replace("_", " "), justify="right")
        table.add_column("peak", justify="right")
        table.add_column("capacity", justify="right")
        table.add_column("headroom", justify="right")
        groups: dict[tuple, list[int]] = {}
        for d in self.devices:
            b = self.breakdown(d)
            groups.setdefault((self.kinds[d], b), []).append(d)
        for (kind, b), ids in groups.items():
            room = self.capacity_bytes[ids[0]] - b.total
            style = "red" if room < 0 else ""
            table.add_row(
                _ranges(ids), kind, *(_gib(getattr(b, c)) for c in CATEGORIES), _gib(b.total),
                _gib(self.capacity_bytes[ids[0]]), _gib(room), style=style,
            )
        return table

    def __str__(self) -> str:
        status = "fits" if self.fits else f"does NOT fit ({len(self.over_devices)} GPUs over)"
        return f"MemoryEstimate({self.model} on {self.cluster}: max peak {self.max_peak_bytes / GiB:.2f} GiB, {status})"


def state_bytes_per_param(dtype: str, optimizer: str = "adam", grad_dtype: str | None = None,
                          precision: str = "megatron") -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter (Rajbhandari et al. 2020, §3.1).

    `precision` "megatron": mixed precision (bf16/fp16) keeps 2-byte weights and the fp32 master
    copy in the optimizer state (Adam: 4 + 4 + 4 = 12 bytes); fp32 keeps 4-byte weights and Adam's 8.
    Gradients are held in `grad_dtype`, default Megatron-LM's for the compute dtype
    (`default_grad_dtype`: fp32 main grads for bf16, so 2 + 4 + 12 = 18 bytes with Adam).
    `precision` "amp": torch's autocast recipe, as plait's engines run a bf16 / fp16 plan -- the
    parameters stay fp32 (they are the masters), so are their gradients (the plan's
    `grad_reduce_dtype` is the wire's), and the optimizer keeps fp32 state only: 4 + 4 + 8 with
    Adam; the low-precision copies live among the activations (`OpGraph.autocast`)."""
    if precision not in PRECISIONS:
        raise MemoryEstimateError(f"precision: unknown {precision!r}; use one of {PRECISIONS}")
    if optimizer not in _OPTIMIZERS:
        raise MemoryEstimateError(f"optimizer: unknown {optimizer!r}; use one of {OPTIMIZERS}")
    if dtype not in _DTYPE_BYTES:
        raise MemoryEstimateError(f"dtype: unknown {dtype!r}; use one of {tuple(_DTYPE_BYTES)}")
    mixed = dtype in ("bf16", "fp16")
    opt_fp32, opt_mixed, _ = _OPTIMIZERS[optimizer]
    if precision == "amp":
        return 4, 4, opt_fp32
    g_b = _DTYPE_BYTES[grad_dtype or default_grad_dtype(dtype)]
    return (2, g_b, opt_mixed) if mixed else (4, g_b, opt_fp32)


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB" if abs(x) >= 0.1 * GiB else f"{x / MiB:.1f} MiB"


def _ranges(ids: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8'."""
    parts: list[str] = []
    start: int | None = ids[0]
    for a, b in zip(ids, [*ids[1:], None]):
        if b is None or b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


# ============================================================================ per-graph cache


@dataclass
class _LayerArrays:
    """Everything the estimator needs from an OpGraph, as float arrays over layers (per sample)."""

    index: dict[str, int]
    count_rep: np.ndarray  # parameters replicated across tensor ranks
    count_tp: np.ndarray  # parameters split across tensor ranks
    max_tensor: np.ndarray  # largest single parameter tensor (elements) per layer
    tp_sharded: np.ndarray  # bool: the layer's big intermediate tensors are split by tensor rank
    # Ops of all layers, concatenated in layer order (execution order inside a layer), for
    # the backward peak inside a layer; layers without ops use the layer totals.
    op_start: np.ndarray  # index of each layer's first op
    op_count: np.ndarray
    op_saved: np.ndarray
    op_tp: np.ndarray
    op_sel: np.ndarray
    op_grads: np.ndarray  # gradients alive while the op runs backward: its output + its inputs
    op_after_sel: np.ndarray  # bool: the op runs after the layer's last selective-recompute op
    op_covers: np.ndarray  # bool per layer: its ops carry its saved bytes (a captured graph)
    saved: np.ndarray
    saved_tp: np.ndarray
    saved_sel: np.ndarray
    inp: np.ndarray
    out: np.ndarray
    recomputable: np.ndarray  # bool: full recompute checkpoints this layer
    head_tp: np.ndarray  # bool: the layer's output is vocab-parallel (split by tensor share)
    sink: np.ndarray  # bool: the layer's output feeds the loss
    edges: np.ndarray  # (E, 2) int layer-index pairs
    cut: np.ndarray  # bytes per sample crossing a chain cut before layer k (stage graph's rule), k = 0..n
    loss_saved: np.ndarray  # bytes the captured loss itself saved (already inside `saved`)
    tied: list[tuple[int, int, float, bool]]  # (owner layer, user layer, parameters, tp-sharded)
    act_dtype_bytes: int
    n_layers: int
    cast: np.ndarray  # autocast's parameter copies a layer saves, per micro-batch (not per sample)
    autocast: str  # the graph's `OpGraph.autocast` ("" : activations in one dtype)
    autocast_params: str  # the graph's `OpGraph.autocast_params`
    terms: dict = field(default_factory=dict)  # _stage_terms cache


_CACHE: dict[int, tuple[int, _LayerArrays]] = {}


def _layer_arrays(graph: OpGraph) -> _LayerArrays:
    """Reduce `graph` to arrays once; cached per graph object (invalidated if its layers change)."""
    key = id(graph)
    stamp = hash((len(graph.layers), len(graph.ops), len(graph.layer_edges),
                  sum(layer.param_count for layer in graph.layers[:4])))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    arrays = _build_arrays(graph)
    if hit is None:
        try:
            weakref.finalize(graph, _CACHE.pop, key, None)
        except TypeError:  # pragma: no cover - OpGraph supports weak references
            pass
    _CACHE[key] = (stamp, arrays)
    return arrays


def _tp_param_fraction(graph: OpGraph, layer_index: int) -> float:
    """Fraction of a layer's parameter bytes that Megatron tensor parallelism splits.

    Transformer and head layers split the weights of their matmuls (column/row
    parallel linears) and keep norms replicated; an embedding layer splits its word
    table (vocab-parallel), the largest embedding, and replicates position tables.
    Without op detail the whole layer counts as split. A transformer layer whose ops carry the
    roles their markers gave them (`Op.tp_role`: the zoo's, or a model's own plan) splits the
    parameters of its column, row, sharded and experts ops -- not a router or an uncut shared
    expert, which are matmuls too."""
    layer = graph.layers[layer_index]
    if layer.tp_style not in ("transformer", "head", "embedding") or layer.param_bytes <= 0:
        return 0.0
    ops = [graph.ops[name] for name in layer.ops if name in graph.ops and graph.ops[name].param_bytes > 0]
    if not ops:
        return 1.0
    total = sum(op.param_bytes for op in ops)
    if layer.tp_style == "transformer" and any(op.tp_role for op in ops):
        return sum(op.param_bytes for op in ops if op.tp_role in TP_CUT_ROLES) / total
    if layer.tp_style == "embedding":
        tables = [op.param_bytes for op in ops if "embedding" in op.target]
        split = max(tables) if tables else max(op.param_bytes for op in ops)
    else:
        split = sum(op.param_bytes for op in ops if any(h in op.target.lower() for h in _MATMUL_HINTS))
    return split / total


def _param_counts(graph: OpGraph) -> np.ndarray:
    """Parameters per layer: the counts, or the bytes over the dtype where a layer has no count."""
    layers = graph.layers
    count = np.array([layer.param_count for layer in layers], dtype=np.float64)
    # A graph may carry bytes but no counts (hand-built); derive counts from the dtype.
    by_bytes = np.array([layer.param_bytes for layer in layers], dtype=np.float64) / max(graph.param_dtype_bytes, 1)
    return np.where(count > 0, count, by_bytes)


def _op_arrays(graph: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(largest parameter tensor per layer, each layer's first op row, its op count, the op rows):
    one row per op of every layer, in layer order -- saved, tensor-split saved, selective saved,
    gradients alive in its backward, whether it runs after the layer's last selective op."""
    layers = graph.layers
    n = len(layers)
    max_tensor = np.zeros(n)
    op_start, op_count = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    op_rows: list[tuple[float, float, float, float, bool]] = []
    for i, layer in enumerate(layers):
        ops = [graph.ops[o] for o in layer.ops if o in graph.ops]
        biggest = max((op.param_bytes for op in ops), default=0) or layer.param_bytes
        max_tensor[i] = biggest / max(graph.param_dtype_bytes, 1)
        op_start[i], op_count[i] = len(op_rows), len(ops)
        last_sel = max((k for k, op in enumerate(ops) if op.saved_selective_bytes > 0), default=-1)
        for k, op in enumerate(ops):
            # backward of one op holds the gradients of its output and of its inputs
            grads = op.output_bytes + sum(graph.ops[q].output_bytes for q in op.inputs if q in graph.ops)
            op_rows.append((op.saved_bytes, op.saved_tp_bytes, op.saved_selective_bytes, grads,
                            last_sel >= 0 and k > last_sel))
    return max_tensor, op_start, op_count, np.array(op_rows, dtype=np.float64).reshape(-1, 5)


def _layer_edges(graph: OpGraph, index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(the (E, 2) layer-index edges, whether each layer is a sink: its output feeds the loss)."""
    n = len(graph.layers)
    edges = np.array([(index[a], index[b]) for a, b in graph.layer_edges if a in index and b in index],
                     dtype=np.int64).reshape(-1, 2)
    if len(edges) == 0 and n > 1:  # no edges recorded: the layers form a chain
        edges = np.stack([np.arange(n - 1), np.arange(1, n)], axis=1)
    sink = np.ones(n, dtype=bool)
    sink[edges[:, 0]] = False
    return edges, sink


def _loss_saved_bytes(graph: OpGraph) -> np.ndarray:
    """Bytes per layer that a captured training loss saved (already in the layer's saved bytes)."""
    # A capture may include the training loss (its ops land in the layer feeding it, with
    # module ""): what the loss saved is then already in that layer's saved bytes.
    loss_saved = np.zeros(len(graph.layers))
    for i, layer in enumerate(graph.layers):
        for o in layer.ops:
            loss_op = graph.ops.get(o)
            if loss_op is not None and not loss_op.module and any(k in loss_op.target for k in _LOSS_OPS):
                loss_saved[i] += loss_op.saved_bytes
    return loss_saved


def _build_arrays(graph: OpGraph) -> _LayerArrays:
    """`graph` reduced to the estimator's arrays (uncached: `_layer_arrays` caches it)."""
    layers = graph.layers
    n = len(layers)
    if n == 0:
        raise MemoryEstimateError(f"model {graph.model!r}: the OpGraph has no layers")
    index = {layer.name: i for i, layer in enumerate(layers)}
    count = _param_counts(graph)
    frac = np.array([_tp_param_fraction(graph, i) for i in range(n)])
    max_tensor, op_start, op_count, op_arr = _op_arrays(graph)

    def arr(attr: str) -> np.ndarray:
        return np.array([float(getattr(layer, attr)) for layer in layers], dtype=np.float64)

    edges, sink = _layer_edges(graph, index)
    styles = [layer.tp_style for layer in layers]
    loss_saved = _loss_saved_bytes(graph)
    # Parameters two layers share (a tied word embedding and LM head): a stage holding the user
    # but not the owner keeps a second copy (Megatron's embedding group, Shoeybi et al. 2019, §3).
    tied = [(index[t.owner], index[t.user], float(t.params), t.tp_sharded) for t in graph.tied
            if t.owner in index and t.user in index]
    return _LayerArrays(
        index=index,
        count_rep=count * (1.0 - frac),
        count_tp=count * frac,
        max_tensor=max_tensor,
        tp_sharded=np.array([s == "transformer" for s in styles]),
        op_start=op_start,
        op_count=op_count,
        op_saved=op_arr[:, 0],
        op_tp=op_arr[:, 1],
        op_sel=op_arr[:, 2],
        op_grads=op_arr[:, 3],
        op_after_sel=op_arr[:, 4].astype(bool),
        op_covers=np.array([
            cnt > 0 and abs(op_arr[st:st + cnt, 0].sum() - layer.saved_bytes) <= 0.01 * layer.saved_bytes + 1.0
            for st, cnt, layer in zip(op_start, op_count, layers)
        ]),
        saved=arr("saved_bytes"),
        saved_tp=arr("saved_tp_bytes"),
        saved_sel=arr("saved_selective_bytes"),
        inp=arr("input_bytes"),
        out=arr("output_bytes"),
        # Megatron checkpoints transformer layers; embedding and output head stay stored.
        recomputable=np.array([s not in ("embedding", "head") for s in styles]),
        head_tp=np.array([s == "head" for s in styles]),
        sink=sink,
        edges=edges,
        cut=np.asarray(chain_cut_bytes(graph), dtype=np.float64),
        loss_saved=loss_saved,
        tied=tied,
        act_dtype_bytes=graph.activation_dtype_bytes or 2,
        n_layers=n,
        cast=arr("saved_cast_bytes"),
        autocast=graph.autocast,
        autocast_params=graph.autocast_params,
    )


# ============================================================================ cluster facts


_CLUSTER_CACHE: dict[int, tuple[tuple, tuple[list[str], list[int], np.ndarray]]] = {}


def _cluster_devices(cluster: Cluster) -> tuple[list[str], list[int], np.ndarray]:
    """(kind name, node index, capacity bytes) per device id, node-major as in Cluster.devices.

    Cached per cluster object; a change in the node or GPU count or in the kinds'
    capacities re-reads it (a cluster is otherwise taken as unchanged)."""
    stamp = (len(cluster.nodes), sum(len(n.gpus) for n in cluster.nodes),
             tuple((k, v.name, v.memory_bytes) for k, v in cluster.kinds.items()))
    hit = _CLUSTER_CACHE.get(id(cluster))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    facts = _read_cluster_devices(cluster)
    if hit is None:
        weakref.finalize(cluster, _CLUSTER_CACHE.pop, id(cluster), None)
    _CLUSTER_CACHE[id(cluster)] = (stamp, facts)
    return facts


def _read_cluster_devices(cluster: Cluster) -> tuple[list[str], list[int], np.ndarray]:
    kinds, nodes, caps = [], [], []
    for n, node in enumerate(cluster.nodes):
        for kind_name in node.gpus:
            kind = cluster.kinds.get(kind_name)
            if kind is None:
                raise MemoryEstimateError(
                    f"{cluster.source}: node '{node.name}' names GPU kind {kind_name!r}, which the cluster does not define"
                )
            kinds.append(kind.name)
            nodes.append(n)
            caps.append(kind.memory_bytes)
    return kinds, nodes, np.asarray(caps, dtype=np.int64)


# ============================================================================ the estimator


def estimate_memory(
    graph: OpGraph,
    plan: Plan,
    cluster: Cluster,
    *,
    optimizer: str = "adam",
    overhead_bytes: int | None = None,
    dp_bucket_bytes: int | None = None,
    loss: str = "eager",
    persistent_grads: bool | None = None,
    precision: str | None = None,
    grad_bucket_view: bool = True,
) -> MemoryEstimate:
    """Per-device peak bytes of one training iteration of `graph` under `plan` on `cluster`.

    `optimizer`: one of OPTIMIZERS (see the module docstring for the step's working set).
    `overhead_bytes`: per-GPU framework constant (default FRAMEWORK_OVERHEAD_BYTES; 0 for CPU).
    `loss`: "eager" (PyTorch cross_entropy on the outputs, in fp32), "eager-low" (the same in the
    outputs' dtype: a whole-model fp16 engine) or "fused" (Megatron's).
    `persistent_grads`: force gradients to live all iteration (True) or only from their
    backward to the step (False); default decides from the plan (see module docstring).
    `precision`: how a bf16 / fp16 plan keeps its states (`PRECISIONS`, `state_bytes_per_param`);
    default "amp" for a graph captured under autocast (`OpGraph.autocast`), else "megatron".
    `grad_bucket_view`: under "amp", DDP's gradients are views into its buckets (plait's engines);
    False: torch's default, the buckets a second copy of every gradient (PyTorch Lightning's DDP).
    """
    dp_bucket_bytes = _checked_bucket_bytes(plan, optimizer, loss, dp_bucket_bytes, overhead_bytes)
    la = _layer_arrays(graph)
    precision = _checked_precision(la, plan, precision)
    kinds, nodes, caps = _cluster_devices(cluster)
    n_dev = len(kinds)
    overhead = FRAMEWORK_OVERHEAD_BYTES if overhead_bytes is None else overhead_bytes
    ctx = _row_context(la, plan, optimizer, loss, dp_bucket_bytes, precision)
    if not grad_bucket_view:
        ctx = replace(ctx, bucket_copy=True)
    stages = _plan_stages(la, plan, graph)
    _check_stage_devices(stages, n_dev, cluster)
    matrix, step_phase, used = _device_matrix(la, graph, stages, ctx, n_dev, persistent_grads)
    matrix[used, _X] += overhead

    peak = np.ceil(matrix.sum(axis=1)).astype(np.int64)
    return MemoryEstimate(
        model=graph.model,
        cluster=cluster.name,
        devices=np.flatnonzero(used).tolist(),
        peak_bytes=peak.tolist(),
        capacity_bytes=caps.tolist(),
        kinds=kinds,
        nodes=nodes,
        _matrix=matrix,
        _phase_step=step_phase,
    )


def _checked_bucket_bytes(plan: Plan, optimizer: str, loss: str, dp_bucket_bytes: int | None,
                          overhead_bytes: int | None) -> int:
    """`estimate_memory`'s options checked; the data-parallel bucket bytes it uses."""
    if optimizer not in _OPTIMIZERS:
        raise MemoryEstimateError(f"optimizer: unknown {optimizer!r}; use one of {OPTIMIZERS}")
    if loss not in LOSS_MODELS:
        raise MemoryEstimateError(f"loss: unknown {loss!r}; use one of {tuple(LOSS_MODELS)}")
    if dp_bucket_bytes is None:  # the plan's bucket (Plan.grad_bucket_mb), as runtime and simulator use
        dp_bucket_bytes = plan.grad_bucket_bytes
    if dp_bucket_bytes < 0 or (overhead_bytes is not None and overhead_bytes < 0):
        raise MemoryEstimateError("estimate_memory: dp_bucket_bytes and overhead_bytes must be >= 0")
    return dp_bucket_bytes


def _checked_precision(la: _LayerArrays, plan: Plan, precision: str | None) -> str:
    """`estimate_memory`'s precision, checked against the graph: a graph captured under autocast
    holds its activations in the dtypes of that autocast, which only a plan in that dtype runs."""
    if precision is None:
        precision = "amp" if la.autocast else "megatron"
    if precision not in PRECISIONS:
        raise MemoryEstimateError(f"precision: unknown {precision!r}; use one of {PRECISIONS}")
    if la.autocast and (plan.dtype != la.autocast or precision != "amp"):
        raise MemoryEstimateError(
            f"plan field 'dtype': the graph was captured under {la.autocast} autocast (its activations in "
            f"autocast's dtypes); a plan in {plan.dtype} with precision {precision!r} needs a graph captured "
            "for it")
    if la.autocast_params == "low" and not _fsdp_form(plan):
        raise MemoryEstimateError(
            f"plan field 'zero': the graph was captured with its parameters in {la.autocast}, as FSDP2 gathers "
            f"them; a plan whose replicas keep fp32 parameters for autocast to cast (zero=0: DDP or one "
            "process) needs the graph captured with fp32 parameters (capture(autocast_params='fp32'))")
    return precision


def _fsdp_form(plan: Plan) -> bool:
    """Whether plait's engines run `plan`'s data parallelism on FSDP2 (ZeRO >= 1, or torch's FSDP2-based
    `replicate` for dp x tp), which gathers the parameters in the plan's dtype."""
    return plan.zero >= 1 or (plan.dp > 1 and plan.tp > 1)


def _check_stage_devices(stages: list[_Stage], n_dev: int, cluster: Cluster) -> None:
    """Refuse a stage that names a device the cluster does not have."""
    for st in stages:
        if len(st.devices) and (st.devices.min() < 0 or st.devices.max() >= n_dev):
            bad = int(st.devices[(st.devices < 0) | (st.devices >= n_dev)][0])
            raise MemoryEstimateError(
                f"plan stage '{st.name}': device {bad} is not in cluster {cluster.name!r} ({n_dev} devices)"
            )


def _device_matrix(la: _LayerArrays, graph: OpGraph, stages: list[_Stage], ctx: _RowContext, n_dev: int,
                   persistent_grads: bool | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes per device and category at the device's peak, whether that peak is in the optimizer
    step, whether the plan uses the device): each stage's rows scattered to its devices, no overhead."""
    plan = ctx.plan
    in_flight = _in_flight(plan, stages)
    p2p_send, p2p_recv = _p2p_per_sample(plan, graph, la, len(stages))

    matrix = np.zeros((n_dev, len(CATEGORIES)))
    step_phase = np.zeros(n_dev, dtype=bool)
    used = np.zeros(n_dev, dtype=bool)
    shapes: dict[tuple, tuple] = {}  # the stages of a chain share their batch and tensor layout
    for s, st in enumerate(stages):
        ids = st.ids
        mb = st.micro_batch or plan.micro_batch
        devs = st.devices
        skey = (id(st.dp_shares), st.dp, mb, id(st.tp_ratios), st.tp, len(devs))
        shape = shapes.get(skey)
        if shape is None:
            shape = shapes[skey] = _stage_layout(plan, st, mb)
        m, ratios, uniq, picks = shape
        persistent = persistent_grads
        if persistent is None:
            persistent = _persistent_grads(ctx, m, st.dp)
        tied_extra = _tied_copies(la, ids, ratios, ascending=not plan.stages)
        for k, (b_k, r_k) in enumerate(uniq):
            row = _device_row(
                la, ids, ctx, r=float(r_k), b=int(b_k), n_flight=in_flight[s], dp=st.dp, persistent=persistent,
                p2p=(p2p_send[s] + p2p_recv[s]), tp=st.tp, tied_extra=tied_extra,
            )
            sel = devs if len(uniq) == 1 else devs[picks[k]]
            if plan.stages:
                np.add.at(matrix, sel, row[:-1])  # a device in two stages holds both
            else:  # a Megatron stage's devices are distinct (Plan.validate): one add each
                matrix[sel] += row[:-1]
            if row[-1]:
                step_phase[sel] = True
        used[devs] = True
    return matrix, step_phase, used


def _stage_layout(plan: Plan, st: _Stage, mb: int) -> tuple[int, list[float], np.ndarray, list[np.ndarray] | None]:
    """(busiest replica's micro-batches, tensor shares, distinct (micro-batch, share) rows, the
    positions of each row's devices in the stage) of a stage: its devices differ only by tensor
    share and replica micro-batch, so one row per distinct pair (a single row for even plans) is
    scattered to them with numpy."""
    m = _stage_micro_batches(plan, st)
    batches = _replica_micro_batches(plan, st, mb)
    ratios = st.tp_ratios if (st.tp_ratios and st.tp > 1) else [1.0 / st.tp] * st.tp
    if len(set(batches)) == 1 and len(set(ratios)) == 1:
        return m, ratios, np.array([[batches[0], ratios[0] if st.tp > 1 else 1.0]]), None
    shares = np.asarray(ratios if st.tp > 1 else [1.0] * st.tp, dtype=np.float64)
    keys = np.stack([np.repeat(np.asarray(batches, dtype=np.float64), st.tp), np.tile(shares, st.dp)], axis=1)
    uniq, which = np.unique(keys, axis=0, return_inverse=True)
    which = which.reshape(-1)
    return m, ratios, uniq, [np.flatnonzero(which == k) for k in range(len(uniq))]


def stage_peak_bytes(graph: OpGraph, layers: list[str], plan: Plan, *, micro_batch: int, in_flight: float,
                     dp: int = 1, p2p_bytes_per_sample: float = 0.0, optimizer: str = "adam",
                     overhead_bytes: int | None = None, loss: str = "eager") -> int:
    """Peak bytes of one device of a candidate stage (layers, data-parallel degree `dp`, micro-batch,
    micro-batches in flight) before a plan exists: the same per-device row `estimate_memory` sums
    (`_device_row`), for planners that size stages one at a time (the graph-pipeline DP). Uses
    the plan's dtype, recompute, ZeRO stage and gradient dtype; tensor parallelism 1."""
    la = _layer_arrays(graph)
    try:
        ids = np.asarray(sorted(la.index[n] for n in layers), dtype=np.int64)
    except KeyError as exc:
        raise MemoryEstimateError(f"stage_peak_bytes: {exc.args[0]!r} is not a layer of {graph.model!r}") from None
    if not len(ids):
        raise MemoryEstimateError("stage_peak_bytes: a stage needs at least one layer")
    ctx = _row_context(la, plan, optimizer, loss, DP_BUCKET_BYTES, _checked_precision(la, plan, None))
    persistent = _persistent_grads(ctx, in_flight, dp)
    row = _device_row(la, ids, ctx, r=1.0, b=int(micro_batch), n_flight=float(in_flight), dp=dp,
                      persistent=persistent, p2p=p2p_bytes_per_sample, tp=1, tied_extra=np.zeros(len(ids)))
    overhead = FRAMEWORK_OVERHEAD_BYTES if overhead_bytes is None else overhead_bytes
    return int(np.ceil(row[:-1].sum() + overhead))


def _tied_copies(la: _LayerArrays, ids: np.ndarray, ratios: list[float], ascending: bool = False) -> np.ndarray:
    """Per layer of a stage, the tensor-sharded parameter count of shared parameters the stage
    keeps a copy of (it holds the user, not the owner). `_stage_terms` multiplies this by the
    rank's tensor share, so an unsharded copy enters divided by the smallest share: every tensor
    rank then holds it whole (within the rounding of uneven shares). `ascending`: `ids` are
    strictly increasing (a chain plan's stages), so consecutive ids are a range."""
    extra = np.zeros(len(ids))
    if not la.tied:
        return extra
    lo, n = int(ids[0]), len(ids)
    if ascending and int(ids[-1]) - lo + 1 == n:  # layers lo .. lo+n-1: membership by range
        for owner, user, params, sharded in la.tied:
            if lo <= user < lo + n and not lo <= owner < lo + n:
                extra[user - lo] += params if sharded else params / min(ratios)
        return extra
    for owner, user, params, sharded in la.tied:
        if user in ids and owner not in ids:
            extra[int(np.flatnonzero(ids == user)[0])] += params if sharded else params / min(ratios)
    return extra


@dataclass
class _StageTerms:
    """Per-sample quantities of one stage on one tensor share, reused across plans."""

    psi_layers: np.ndarray  # parameters per layer on this tensor rank
    psi: float
    psi_top2: float  # the two largest layers' parameters (ZeRO-3 gather buffer)
    step_tensor: float  # largest parameter tensor (elements) on this rank
    a_sum: float  # activations one micro-batch keeps
    cum: np.ndarray  # kept activations of layers 0..i
    extra: np.ndarray  # layer i's backward peak beyond what it keeps
    i_max: int  # argmax of cum + extra
    out_sum: float  # model outputs made on this stage
    loss_saved: float  # bytes a captured loss saved on this stage
    # autocast's parameter copies, per micro-batch (zeros where none are made, `_RowContext.casts`)
    cast_cum: np.ndarray  # kept by layers 0..i (saved for their backward)
    cast_extra: np.ndarray  # layer i's, rebuilt by full recompute for its backward
    cast_all: float  # every layer's (under full recompute only the layer being rebuilt keeps them: a
    # checkpointed forward's copies were freed, not held by autocast's cache -- measured, table (e))


def _stage_terms(la: _LayerArrays, ids: np.ndarray, *, r: float, sp: float, act_scale: float,
                 recompute: str, tied_extra: np.ndarray, casts: bool = False) -> _StageTerms:
    contiguous = len(ids) and int(ids[-1]) - int(ids[0]) + 1 == len(ids)
    key = ((int(ids[0]), len(ids)) if contiguous else ids.tobytes(), r, sp, act_scale, recompute,
           float(tied_extra.sum()), casts)
    hit = la.terms.get(key)
    if hit is not None:
        return hit
    psi_layers = la.count_rep[ids] + r * (la.count_tp[ids] + tied_extra)
    a_kept, work = _layer_activations(la, ids, r=r, sp=sp, act_scale=act_scale, recompute=recompute)
    inner = _backward_inner(la, ids, r=r, sp=sp, act_scale=act_scale, recompute=recompute,
                            a_kept=a_kept, work=work)
    cum = np.cumsum(a_kept)
    extra = inner - a_kept
    # a layer's copies are of its own parameters: split by the tensor share where they are
    cast = la.cast[ids] * np.where(la.count_tp[ids] > 0, r, 1.0) if casts else np.zeros(len(ids))
    ckpt = la.recomputable[ids] if recompute == "full" else np.zeros(len(ids), dtype=bool)
    terms = _StageTerms(
        psi_layers=psi_layers,
        psi=float(psi_layers.sum()),
        psi_top2=float(np.sort(psi_layers)[-2:].sum()),
        step_tensor=float(la.max_tensor[ids].max()) * (r if la.count_tp[ids].any() else 1.0),
        a_sum=float(cum[-1]),
        cum=cum,
        extra=extra,
        i_max=int(np.argmax(cum + extra)),
        out_sum=float((la.out[ids] * np.where(la.head_tp[ids], r, 1.0) * la.sink[ids]).sum()),
        loss_saved=float(la.loss_saved[ids].sum()),
        cast_cum=np.cumsum(np.where(ckpt, 0.0, cast)),
        cast_extra=np.where(ckpt, cast, 0.0),
        cast_all=float(cast.sum()),
    )
    if len(la.terms) > 8192:  # bounded (a few MB): planners sweep many splits
        la.terms.clear()
    la.terms[key] = terms
    return terms


@dataclass(frozen=True)
class _RowContext:
    """What every device row of one estimate shares: the plan, bytes per parameter, dtype scales."""

    plan: Plan
    w_b: int  # weight bytes per parameter
    g_b: int  # gradient bytes per parameter
    k_b: int  # optimizer-state bytes per parameter
    step_kind: str  # how the optimizer step runs (`_OPTIMIZERS`)
    act_scale: float  # capture dtype -> plan dtype
    loss_scale: float  # capture dtype -> fp32, the loss's
    loss_copies: float  # fp32 copies of the model outputs at the loss (LOSS_MODELS)
    held_copies: float  # copies of the outputs the training loop holds through backward and the step
    dp_bucket: int  # data-parallel gradient bucket bytes
    precision: str = "megatron"  # `PRECISIONS`
    casts: bool = False  # autocast's parameter copies are made (and saved) per micro-batch
    low_b: int = 0  # bytes per parameter of the whole low-precision parameters FSDP2 holds fwd -> bwd
    gather_b: int = 0  # bytes per parameter of ZeRO-3's gathered parameters (the running, the prefetched)
    fsdp: bool = False  # data parallelism over FSDP2 ("amp" at ZeRO >= 1, or dp x tp): no DDP bucket
    bucket_copy: bool = False  # DDP's buckets hold a copy of every gradient (not views: torch's default)


def _row_context(la: _LayerArrays, plan: Plan, optimizer: str, loss: str, dp_bucket: int,
                 precision: str = "megatron") -> _RowContext:
    """The row context of `plan` trained with `optimizer` and `loss`."""
    loss_copies, held_copies = LOSS_MODELS[loss]
    # gradients live in the dtype they are reduced in (Plan.grad_dtype, the one truth the traffic
    # module sends): Megatron's bf16 keeps fp32 main grads -- 2 + 4 + 12 = 18 bytes per parameter
    # with Adam (Korthikanti et al. 2022 count the same) -- fp16 keeps fp16 grads unless told
    w_b, g_b, k_b = state_bytes_per_param(plan.dtype, optimizer, plan.grad_dtype, precision)
    low = _DTYPE_BYTES[plan.dtype] if plan.dtype in ("bf16", "fp16") and precision == "amp" else 0
    # Under autocast, data parallelism over FSDP2 (ZeRO >= 1, and torch's `replicate` for dp x tp)
    # gathers the parameters in the low dtype (its MixedPrecisionPolicy): autocast then casts
    # nothing, and the gathered low-precision parameters are what is held -- whole from forward to
    # backward at ZeRO-1/2 and under `replicate`, the running and the prefetched unit at ZeRO-3.
    fsdp = _fsdp_form(plan)
    act_scale = 1.0 if la.autocast else _DTYPE_BYTES[plan.dtype] / la.act_dtype_bytes
    return _RowContext(
        plan=plan, w_b=w_b, g_b=g_b, k_b=k_b, step_kind=_OPTIMIZERS[optimizer][2],
        act_scale=act_scale,
        # the loss runs in fp32 (in the outputs' dtype for "eager-low")
        loss_scale=act_scale if loss == "eager-low" else 4.0 / la.act_dtype_bytes,
        loss_copies=loss_copies, held_copies=held_copies, dp_bucket=dp_bucket,
        precision=precision, casts=bool(low) and not fsdp,
        low_b=low if fsdp and plan.zero < 3 else 0, gather_b=low or w_b, fsdp=fsdp and precision == "amp",
    )


def _device_row(
    la: _LayerArrays,
    ids: np.ndarray,
    ctx: _RowContext,
    *,
    r: float,
    b: int,
    n_flight: float,
    dp: int,
    persistent: bool,
    p2p: float,
    tp: int,
    tied_extra: np.ndarray,
) -> np.ndarray:
    """Bytes per category at the peak of one device of a stage, plus a final 1.0 if the
    peak is in the optimizer step (layout: CATEGORIES..., step_flag; overhead added by caller)."""
    plan, w_b, g_b, k_b, act_scale = ctx.plan, ctx.w_b, ctx.g_b, ctx.k_b, ctx.act_scale
    zero = plan.zero
    sp = r if plan.sequence_parallel else 1.0  # share of the replicated activations this rank keeps
    t = _stage_terms(la, ids, r=r, sp=sp, act_scale=act_scale, recompute=plan.recompute, tied_extra=tied_extra,
                     casts=ctx.casts)

    # ---- model states (Rajbhandari et al. §3.1), Ψ = parameters on this tensor rank
    # FSDP2 shards the (fp32) parameters at every ZeRO level; ZeRO-1/2 keep its low-precision gather
    weights = w_b * t.psi / (dp if zero >= 3 or (ctx.fsdp and zero >= 1) else 1)
    low = ctx.low_b * t.psi  # FSDP2's gathered low-precision parameters, held from forward to backward
    # FSDP2 (plait's engines at ZeRO >= 1, "amp") reduce-scatters every gradient: ZeRO-1's are sharded too
    zg = 2 if ctx.precision == "amp" and zero == 1 else zero
    grads_full = g_b * t.psi / (dp if zg >= 2 else 1)
    opt = k_b * t.psi / (dp if zero >= 1 else 1)

    # ---- activations (one micro-batch: b * per-sample), loss working set, held outputs
    a_mb = b * t.a_sum + float(t.cast_cum[-1])  # autocast's copies: one set per micro-batch
    # at the loss: `loss_copies` fp32 copies of the outputs (what a captured loss saved is
    # already counted among the activations); afterwards the loop still holds the outputs
    # eager: the caller's outputs in their own dtype, the loss's copies and gradients in fp32
    caller = act_scale * t.out_sum if ctx.held_copies else 0.0
    fp32 = (ctx.loss_copies - (1.0 if ctx.held_copies else 0.0)) * ctx.loss_scale * t.out_sum
    loss_ws = b * max(0.0, caller + fp32 - act_scale * t.loss_saved)
    held = b * ctx.held_copies * act_scale * t.out_sum
    others = max(n_flight - 1.0, 0.0) * a_mb  # earlier micro-batches still waiting for backward

    # ---- peak during backward of layer i: all gradients (persistent) or those of layers i..end
    i_max, g_now = _backward_peak_layer(t, b=b, persistent=persistent, grads_full=grads_full, g_b=g_b,
                                        dp=dp, zero=zg)
    kept_i = b * float(t.cum[i_max]) + float(t.cast_cum[i_max])
    extra_i = b * max(0.0, float(t.extra[i_max])) + float(t.cast_extra[i_max])
    # FSDP2 at ZeRO-3 gathers a layer's parameters while it runs (and prefetches the next): there at
    # a layer's backward, resharded at the loss
    gather = ctx.gather_b * t.psi_top2 if ctx.fsdp and dp > 1 and zero >= 3 else 0.0
    at_layer = others + kept_i + extra_i + g_now + held + gather
    at_loss = others + a_mb + loss_ws + (grads_full if persistent else 0.0)
    if loss_ws > 0 and at_loss >= at_layer:
        act, logits, tmp, g_now, gather = others + a_mb, loss_ws, 0.0, (grads_full if persistent else 0.0), 0.0
    else:
        act, logits, tmp = others + kept_i, held, extra_i
    backward_total = act + logits + tmp + g_now + low + gather

    # ---- optimizer step: all gradients plus the step's temporaries
    step_tmp = _step_temporaries(ctx.step_kind, t, dp, zero)
    step_total = grads_full + step_tmp + held

    comm = _comm_buffers(t, ctx, b=b, dp=dp, p2p=p2p, tp=tp, grads_full=grads_full)

    row = np.zeros(len(CATEGORIES) + 1)
    row[_W], row[_O], row[_C] = weights, opt, comm
    if step_total > backward_total:
        row[_G], row[_L], row[_X], row[-1] = grads_full, held, step_tmp, 1.0
    else:
        row[_W] += low
        row[_C] += gather
        row[_G], row[_A], row[_L], row[_X] = g_now, act, logits, tmp
    return row


def _persistent_grads(ctx: _RowContext, micro_batches: float, dp: int) -> bool:
    """Whether every gradient lives all iteration (see the module docstring): Megatron's mixed
    precision keeps its main-grad buffer, accumulation and data parallelism their buffers; autocast
    over fp32 parameters with one micro-batch and no replicas frees and makes them as fp32 does."""
    plan = ctx.plan
    mixed = plan.dtype in ("bf16", "fp16") and ctx.precision == "megatron"
    if ctx.fsdp:  # FSDP2 makes each gradient shard at its unit's reduce-scatter (none at the start)
        return mixed or micro_batches > 1
    return mixed or micro_batches > 1 or dp > 1 or plan.zero > 0


def _backward_peak_layer(t: _StageTerms, *, b: int, persistent: bool, grads_full: float, g_b: int, dp: int,
                         zero: int) -> tuple[int, float]:
    """(the layer whose backward peaks, the gradient bytes alive then): all of them when gradients
    persist, else those of that layer and the layers after it."""
    casts = t.cast_all > 0  # a per-micro-batch term beside the per-sample ones: the layer depends on b
    if persistent:
        if not casts:
            return t.i_max, grads_full
        return int(np.argmax(b * (t.cum + t.extra) + t.cast_cum + t.cast_extra)), grads_full
    g_at = np.cumsum((g_b * t.psi_layers)[::-1])[::-1] / (dp if zero >= 2 else 1)
    i_max = int(np.argmax(b * (t.cum + t.extra) + t.cast_cum + t.cast_extra + g_at))
    return i_max, float(g_at[i_max])


def _step_temporaries(step_kind: str, t: _StageTerms, dp: int, zero: int) -> float:
    """Bytes the optimizer step allocates beside the model states, by how it runs."""
    if step_kind == "foreach":
        return 4.0 * t.psi / (dp if zero >= 1 else 1)
    if step_kind == "loop":
        return 2 * 4.0 * t.step_tensor
    return 0.0


def _comm_buffers(t: _StageTerms, ctx: _RowContext, *, b: int, dp: int, p2p: float, tp: int,
                  grads_full: float) -> float:
    """Communication buffers: pipeline messages, a gradient bucket, ZeRO-3's gathered parameters."""
    # one micro-batch in each direction across stage boundaries, as each tensor rank of plait's
    # engines sends it (1/tp under sequence parallelism, else whole)
    comm = float(pp_message_bytes(p2p, b, ctx.act_scale, tp, pp_split(ctx.plan)))
    if dp > 1:
        if not ctx.fsdp:  # DDP's in-flight bucket (FSDP2 reduce-scatters unit by unit instead)
            bucket = min(float(ctx.dp_bucket), grads_full)
            if ctx.precision == "amp":  # the gradients are views into DDP's buckets, reduced in place,
                # unless the wire's dtype differs: then one bucket cast to it (`recorded_allreduce_hook`)
                wire = _DTYPE_BYTES[ctx.plan.grad_dtype]
                bucket = bucket * wire / ctx.g_b if wire != ctx.g_b else 0.0
            if ctx.bucket_copy:  # every bucket allocated beside the gradients
                bucket = grads_full
            comm += bucket
        if ctx.plan.zero >= 3 and not ctx.fsdp:  # the running and the prefetched layer's gathered parameters
            comm += ctx.gather_b * t.psi_top2  # (FSDP2's: `_device_row`, only while a layer runs)
    return comm


def _backward_inner(
    la: _LayerArrays,
    ids: np.ndarray,
    *,
    r: float,
    sp: float,
    act_scale: float,
    recompute: str,
    a_kept: np.ndarray,
    work: np.ndarray,
) -> np.ndarray:
    """Per layer (per sample): the most its backward holds on top of the layers before it.

    Backward walks the layer's ops in reverse; at op k the saved tensors of ops 0..k are
    still alive (all of them rebuilt under full recompute; the attention core's only once
    backward reaches it under selective recompute) plus the gradients of op k's output and
    inputs and of the layer's output (the residual stream): max_k (saved[0..k] + grads_k).
    Layers captured without ops fall back to kept + recompute working set + the gradients
    of the layer's input and output."""
    share = np.where(la.tp_sharded[ids], r, sp)
    layer_grad = act_scale * la.out[ids] * sp
    inner = a_kept + work + act_scale * la.inp[ids] * sp + layer_grad
    has = la.op_covers[ids]
    if not has.any():
        return inner
    lids = ids[has]
    counts = la.op_count[lids]
    idx = np.concatenate([np.arange(la.op_start[i], la.op_start[i] + la.op_count[i]) for i in lids]) \
        if len(lids) > 1 else np.arange(la.op_start[lids[0]], la.op_start[lids[0]] + counts[0])
    seg = np.repeat(np.arange(len(lids)), counts)
    tp = la.op_tp[idx]
    saved = act_scale * ((la.op_saved[idx] - tp) * sp + tp * r)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

    def seg_cumsum(x: np.ndarray) -> np.ndarray:
        c = np.cumsum(x)
        return c - np.repeat(c[starts] - x[starts], counts)

    alive = seg_cumsum(saved)
    if recompute == "selective":
        alive = alive - la.op_after_sel[idx] * seg_cumsum(act_scale * la.op_sel[idx] * r)
    grads = act_scale * la.op_grads[idx] * share[has][seg] + layer_grad[has][seg]
    inner = inner.copy()
    inner[has] = np.maximum.reduceat(alive + grads, starts)
    return inner


def _layer_activations(
    la: _LayerArrays, ids: np.ndarray, *, r: float, sp: float, act_scale: float, recompute: str
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, recompute working set) bytes per sample for layers `ids` (Korthikanti §4).

    `r`: this tensor rank's share of the split tensors; `sp`: its share of the
    replicated ones (r under sequence parallelism, else 1)."""
    saved, tp_part, sel = la.saved[ids], la.saved_tp[ids], la.saved_sel[ids]
    a_none = act_scale * ((saved - tp_part) * sp + tp_part * r)
    if recompute == "selective":
        work = act_scale * sel * r  # the attention core, recomputed in backward
        return a_none - work, work
    if recompute == "full":
        ckpt = la.recomputable[ids]
        kept = np.where(ckpt, act_scale * la.inp[ids] * sp, a_none)
        return kept, np.where(ckpt, a_none, 0.0)  # a layer's activations rebuilt for its backward
    return a_none, np.zeros_like(a_none)


def activation_bytes_per_layer(
    graph: OpGraph, plan: Plan, *, micro_batch: int | None = None, tp_rank: int = 0
) -> dict[str, float]:
    """Bytes of activations one micro-batch leaves stored in each layer on tensor rank `tp_rank`.

    The per-layer quantity of Korthikanti et al. (2022) Table 2 (before multiplying by
    the micro-batches in flight), in the plan's dtype, honouring tp / tp_ratios,
    sequence_parallel and recompute."""
    la = _layer_arrays(graph)
    if not 0 <= tp_rank < plan.tp:
        raise MemoryEstimateError(f"tp_rank: {tp_rank} is not a tensor rank of a plan with tp={plan.tp}")
    r = (plan.tp_ratios[tp_rank] if plan.tp_ratios else 1.0 / plan.tp) if plan.tp > 1 else 1.0
    sp = r if plan.sequence_parallel else 1.0
    ids = np.arange(la.n_layers)
    kept, _ = _layer_activations(la, ids, r=r, sp=sp, act_scale=_DTYPE_BYTES[plan.dtype] / la.act_dtype_bytes,
                                 recompute=plan.recompute)
    b = plan.micro_batch if micro_batch is None else micro_batch
    return {name: float(b * kept[i]) for name, i in la.index.items()}


@dataclass
class _Stage:
    """A pipeline stage as the estimator needs it: layer indices and device ids as arrays."""

    name: str
    ids: np.ndarray
    devices: np.ndarray
    dp: int
    tp: int
    micro_batch: int | None
    dp_shares: list[float] | None
    tp_ratios: list[float] | None


def _plan_stages(la: _LayerArrays, plan: Plan, graph: OpGraph) -> list[_Stage]:
    """The plan's stages (Plan.stage_specs), built with numpy for the common chain of `pp`
    stages -- planners ask for thousands of 1024-GPU plans -- and from the explicit stage
    list otherwise. tests/test_memory.py checks both give the same stages."""
    if plan.stages:
        out = []
        for st in plan.stage_specs(graph.layer_names, [layer.tp_style for layer in graph.layers]):
            idx = []
            for name in st.layers:
                i = la.index.get(name)
                if i is None:
                    raise MemoryEstimateError(
                        f"plan stage '{st.name}': layer {name!r} is not a layer of model {graph.model!r}"
                    )
                idx.append(i)
            if not idx:
                raise MemoryEstimateError(f"plan stage '{st.name}': holds no layers")
            for fname, vals, count in (("tp_ratios", st.tp_ratios, st.tp), ("dp_shares", st.dp_shares, st.dp)):
                if vals is not None and (len(vals) != count or min(vals) < 0):
                    raise MemoryEstimateError(
                        f"plan stage '{st.name}': {fname} needs {count} non-negative values, got {vals}"
                    )
            if len(st.devices) != st.dp * st.tp:
                raise MemoryEstimateError(
                    f"plan stage '{st.name}': has {len(st.devices)} devices but dp*tp = {st.dp * st.tp}"
                )
            out.append(_Stage(st.name, np.asarray(idx, dtype=np.int64), np.asarray(st.devices, dtype=np.int64),
                              st.dp, st.tp, st.micro_batch, st.dp_shares, st.tp_ratios))
        return out
    # Megatron order (Plan.rank): rank = (p * dp + d) * tp + t; device stage p holds chunks
    # p, p + pp, p + 2pp, ... of the layer split (Plan.stage_specs).
    counts = plan.layers_per_stage(la.n_layers, [layer.tp_style for layer in graph.layers])
    bounds = np.concatenate([[0], np.cumsum(counts)])
    per_stage = plan.dp * plan.tp
    ranks = np.arange(plan.pp * per_stage, dtype=np.int64).reshape(plan.pp, per_stage)
    if plan.device_order is not None:
        ranks = np.asarray(plan.device_order, dtype=np.int64)[ranks]
    out = []
    for p in range(plan.pp):
        chunks = [np.arange(bounds[v * plan.pp + p], bounds[v * plan.pp + p + 1]) for v in range(plan.virtual_stages)]
        ids = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        out.append(_Stage(f"stage{p}", ids, ranks[p], plan.dp, plan.tp, plan.micro_batch, plan.dp_shares,
                          plan.tp_ratios))
    return out


_LOADS: dict[tuple, tuple[list[tuple[int, int]], int]] = {}


def _replica_loads(plan: Plan, shares: list[float] | None, dp: int, mb: int) -> tuple[list[tuple[int, int]], int]:
    """`replica_loads` and the busiest replica's micro-batches, remembered by everything they
    read (every stage of a plan, and the planners' many plans, ask the same few)."""
    key = (bool(plan.stages), plan.global_batch, None if shares is None else tuple(shares), dp, mb)
    hit = _LOADS.get(key)
    if hit is None:
        if len(_LOADS) > 4096:
            _LOADS.clear()
        loads = replica_loads(plan, shares, dp, mb)
        hit = _LOADS[key] = (loads, max(count for count, _ in loads))
    return hit


def _replica_micro_batches(plan: Plan, st: _Stage, mb: int) -> list[int]:
    """Largest micro-batch of each data-parallel replica of a stage: the stage graph's rounding
    rule (`plait.ir.stage_graph`: 10 samples at micro-batch 4 run as [4, 3, 3])."""
    return [largest for _, largest in _replica_loads(plan, st.dp_shares, st.dp, mb)[0]]


def _stage_micro_batches(plan: Plan, st: _Stage) -> int:
    """Micro-batches the busiest replica of a stage runs (the stage graph's rounding rule)."""
    mb = st.micro_batch or plan.micro_batch
    return max(1, _replica_loads(plan, st.dp_shares, st.dp, mb)[1])


def _in_flight(plan: Plan, stages: list[_Stage]) -> list[float]:
    """Micro-batches of activations each stage holds at once (in whole-stage units)."""
    if not plan.stages and stages:  # a chain's stages share the plan's replicas and micro-batch
        ms = [_stage_micro_batches(plan, stages[0])] * len(stages)
    else:
        ms = [_stage_micro_batches(plan, st) for st in stages]
    m = max(ms, default=1)
    if plan.schedule == "gpipe":
        return [float(x) for x in ms]
    if plan.stages:
        # GraphPipe's 1F1B read off its action lists: one plus the stage's longest path to a sink,
        # more where stages' micro-batch sizes or replicas differ (`plait.schedule.graph_in_flight`)
        sizes = tuple(tuple(micro_batch_sizes(plan.global_batch, st.micro_batch or plan.micro_batch)) or (1,)
                      for st in stages)
        try:
            return list(graph_in_flight("graph_1f1b", sizes, tuple(map(tuple, plan.stage_edges)),
                                        tuple(st.dp for st in stages)))
        except ScheduleError as exc:
            raise MemoryEstimateError(f"plan field 'stage_edges': {exc}") from None
    pp, v = plan.pp, plan.virtual_stages
    if plan.schedule == "eager_1f1b":  # one more than eager 1F1B's warm-up, 2 (pp - i - 1) forwards
        return [float(min(m, eager_warmup(pp, i) + 1)) for i in range(pp)]
    if plan.schedule == "interleaved" and v > 1:
        if m == pp:  # Megatron-LM runs every chunk-forward before the first backward then (all warm-up)
            return [float(m)] * pp
        # Megatron-LM interleaved warm-up: 2(pp - i - 1) + (v - 1) pp chunk-forwards, +1 running.
        return [min(2 * (pp - i - 1) + (v - 1) * pp + 1, m * v) / v for i in range(pp)]
    return [float(min(pp - i, m)) for i in range(pp)]


def _p2p_per_sample(plan: Plan, graph: OpGraph, la: _LayerArrays, n_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample bytes each stage sends and receives over the stage graph's edges (capture
    dtype): what crosses each cut (`plait.ir.stage_graph`; for a chain, its per-cut sums)."""
    send = np.zeros(n_stages)
    recv = np.zeros(n_stages)
    if n_stages == 1:
        return send, recv
    if not plan.stages:
        counts = plan.layers_per_stage(la.n_layers, [layer.tp_style for layer in graph.layers])
        bounds = np.cumsum(counts)
        for c in range(len(counts) - 1):  # chunk c -> c + 1, chunk c on stage c % pp
            send[c % plan.pp] += la.cut[bounds[c]]
            recv[(c + 1) % plan.pp] += la.cut[bounds[c]]
        return send, recv
    try:
        _, chunks, edges = chunk_graph(plan, graph)
    except PlaitError as exc:
        raise MemoryEstimateError(str(exc)) from None
    for e in edges:
        a, b = chunks[e.src].stage, chunks[e.dst].stage
        if a != b:
            send[a] += e.bytes_per_sample
            recv[b] += e.bytes_per_sample
    return send, recv


@dataclass
class MemoryModel:
    """Bytes a program keeps on device i: ``replicated + sum_g ratio_gi * sharded_g``."""

    replicated: float
    sharded: float  # all segments together
    overhead: float
    by_segment: dict[int, float] = field(default_factory=dict)
    # the part of the above that is activations kept for backward (one batch's): a pipeline stage
    # keeps several micro-batches' in flight (`activations_on`)
    act_replicated: float = 0.0
    act_by_segment: dict[int, float] = field(default_factory=dict)

    def on(self, ratios: np.ndarray) -> np.ndarray:
        """Bytes per device at `ratios`: one vector (n,) for all, or one row per segment (G, n)."""
        r = np.asarray(ratios, dtype=float)
        if r.ndim == 1:
            return self.overhead + self.replicated + r * self.sharded
        return self.overhead + self.replicated + sum(r[g] * b for g, b in self.by_segment.items())

    def activations_on(self, ratios: np.ndarray) -> np.ndarray:
        """Activation bytes per device at `ratios` (included in `on`)."""
        r = np.asarray(ratios, dtype=float)
        rows = r if r.ndim == 2 else r[None, :]
        out = np.full(rows.shape[1], self.act_replicated)
        for g, b in self.act_by_segment.items():
            out = out + rows[g if r.ndim == 2 else 0] * b
        return out


def memory_model(problem: Problem, program: Program, dtype: str = "fp32", optimizer: str = "adam",
                 overhead: float | None = None, segs: Segments | None = None) -> MemoryModel:
    w_b, g_b, k_b = state_bytes_per_param(dtype, optimizer)
    per_param = w_b + g_b + k_b
    act_bytes = 2 if dtype in ("bf16", "fp16") else 4
    graph = problem.graph
    segs = segs or segments(problem, program)
    # `overhead`: the per-GPU framework constant, FRAMEWORK_OVERHEAD_BYTES when None (as estimate_memory)
    model = MemoryModel(0.0, 0.0, float(FRAMEWORK_OVERHEAD_BYTES if overhead is None else overhead))

    def add(t: str, q: str, nbytes: float, activation: bool = False) -> None:
        d = shard_dim(q)
        if d is None:
            model.replicated += nbytes
            model.act_replicated += nbytes if activation else 0.0
        else:
            g = segs.of_dim.get((t, d), 0)
            model.sharded += nbytes
            model.by_segment[g] = model.by_segment.get(g, 0.0) + nbytes
            if activation:
                model.act_by_segment[g] = model.act_by_segment.get(g, 0.0) + nbytes

    stored = stored_placements(graph, program)
    kept: set[tuple[str, str]] = set()
    for op in graph.ops:
        strategy = program.strategies[op.name]
        for t, q in zip(op.inputs, strategy.inputs):
            meta = graph.tensors[t]
            if meta.role == "param":
                # a parameter stored elsewhere (`Program.homes`) is read through a collective whose
                # result autograd keeps for backward: its weights at the read placement, and the
                # gradient arriving there before it is reduce-scattered home
                if t in program.homes and (t, q) not in kept and stored[t] != (REPLICATED if q == PARTIAL else q):
                    kept.add((t, q))
                    add(t, REPLICATED if q == PARTIAL else q, meta.numel * (w_b + g_b))
            elif problem.needs_grad.get(t) and (t, q) not in kept:
                kept.add((t, q))
                add(t, q, meta.numel * act_bytes, activation=True)
    for t, q in stored.items():
        add(t, q, graph.tensors[t].numel * per_param)
    return model


def composed_in_flight(schedule: str, stages: int, micro_batches: int) -> tuple[float, ...]:
    """Per stage of a composed plan (a linear pipeline whose stages run SPMD programs,
    `plait.search.compose_family`), the micro-batches whose activations it holds at once under
    `schedule`: read off the action lists of the chain the simulator runs (`plait.sim.lowering.spmd`:
    GPipe, eager 1F1B, else 1F1B) by `plait.schedule.in_flight`, once per (schedule, stages, m)."""
    return chain_in_flight(schedule if schedule in ("gpipe", "eager_1f1b") else "1f1b", stages, micro_batches)


def composed_peak_memory(stage_bytes: list[tuple[list[int], np.ndarray, np.ndarray]], schedule: str,
                         micro_batches: int, devices: int) -> list[int]:
    """Peak bytes per cluster device of a composed plan under `schedule`: per stage ``(its devices,
    each one's bytes with one micro-batch in flight, the activation bytes of each further
    micro-batch)`` -- its program's `MemoryModel.on` and `MemoryModel.activations_on` -- with the
    micro-batches the schedule keeps in flight on that stage (`composed_in_flight`)."""
    flight = composed_in_flight(schedule, len(stage_bytes), micro_batches)
    out = [0] * devices
    for s, (ids, base, act) in enumerate(stage_bytes):
        for d, b in zip(ids, base + (int(flight[s]) - 1) * act):
            out[d] = int(b)
    return out
