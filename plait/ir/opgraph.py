"""OpGraph: a model as a DAG of ops grouped into layers, with costs per sample.

Made by `plait.graph.capture.capture(module, sample_input)` on the meta device.
All byte and FLOP figures are **per sample** (the capture batch divided out), so
a consumer multiplies by its micro-batch size.

Saved-for-backward bytes carry two refinements the memory estimator needs to
reproduce Korthikanti et al. (2022) for Megatron transformers:

* `saved_tp_bytes`   -- the part that Megatron tensor parallelism splits across
  the t tensor ranks (tensors produced inside column-parallel linears and the
  regions between a column- and a row-parallel linear); the rest is replicated
  (or split by sequence parallelism).
* `saved_selective_bytes` -- the part that selective recompute drops (tensors
  both produced and saved inside an attention core; always tp-sharded).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx

from plait.ir.formats import MIGRATIONS, check_version, stamp


@dataclass
class Op:
    name: str  # unique, e.g. "layers.3.attn.qkv/aten.addmm#0"
    target: str  # aten op, e.g. "aten.mm.default"
    layer: str  # name of the Layer this op belongs to
    module: str  # full module path that ran the op
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    param_bytes: int = 0  # parameters first used by this op
    saved_bytes: float = 0.0
    saved_tp_bytes: float = 0.0
    saved_selective_bytes: float = 0.0
    # bytes of autocast's low-precision parameter copies this op saved: one per forward (micro-batch),
    # not per sample (a capture under autocast, `OpGraph.autocast`)
    saved_cast_bytes: float = 0.0
    output_bytes: float = 0.0
    inputs: list[str] = field(default_factory=list)  # names of producer ops
    # Megatron role of the module that ran it, from the model's markers (`plait_tp`, or its own
    # tensor-parallel plan: `plait.graph.tp_plan`): "column", "row", "sharded", "experts" (an MoE
    # experts module cut in its intermediate features: its output all-reduced), "column_gather" /
    # "row_split" (a linear cut alone: its output all-gathered / its input split) or "" (by name)
    tp_role: str = ""


# The `Op.tp_role` / `plait_tp` marks whose modules tensor parallelism cuts, and those among them
# cut without a column/row partner in their layer (so a layer holding one is cut on its own).
TP_CUT_ROLES = ("column", "row", "sharded", "experts", "column_gather", "row_split")
TP_ALONE_ROLES = ("experts", "column_gather", "row_split")


@dataclass
class Layer:
    """A group of ops at one level of the module hierarchy (e.g. one transformer block).

    `kind` is the module class name; `tp_style` says how Megatron tensor parallelism
    splits it ("transformer", "embedding", "head", or "none" for replicated layers).
    """

    name: str
    kind: str
    ops: list[str] = field(default_factory=list)
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    param_count: int = 0
    param_bytes: int = 0
    saved_bytes: float = 0.0
    saved_tp_bytes: float = 0.0
    saved_selective_bytes: float = 0.0
    saved_cast_bytes: float = 0.0  # autocast's parameter copies saved, per micro-batch (`Op.saved_cast_bytes`)
    input_bytes: float = 0.0  # bytes of the activations entering the layer (kept by full recompute)
    output_bytes: float = 0.0  # bytes of the activations leaving the layer (pipeline messages)
    tp_style: str = "none"


@dataclass(frozen=True)
class TiedParams:
    """Parameters one layer shares with an earlier one (a tied word embedding and LM head, say).

    They are counted once, in `owner` (the layer that uses them first). A pipeline stage that
    holds `user` but not `owner` keeps its own copy, and the copies' gradients are summed every
    step (Megatron's embedding group, Shoeybi et al. 2019 §3; plait's runtime does the same for
    any parameter two stages share)."""

    owner: str
    user: str
    params: int
    # split over tensor-parallel ranks with the layers (a vocabulary-parallel embedding): each
    # rank's copy, and its gradient all-reduce, holds params / tp
    tp_sharded: bool = False


@dataclass
class OpGraph:
    """The captured model. `layers` are in topological (execution) order."""

    model: str
    ops: dict[str, Op] = field(default_factory=dict)
    layers: list[Layer] = field(default_factory=list)
    layer_edges: list[tuple[str, str]] = field(default_factory=list)
    param_dtype_bytes: int = 4
    activation_dtype_bytes: int = 2
    # "" when every activation is in one dtype (`activation_dtype_bytes`); "bf16" / "fp16" when the
    # model was captured as torch's autocast runs it -- fp32 parameters, each op in the dtype autocast
    # gives it -- and the bytes are as they are (`autocast_rules`: whose op lists, "cuda" or "cpu")
    autocast: str = ""
    autocast_rules: str = ""
    # "fp32": the parameters fp32, cast by autocast (DDP, one process); "low": in the low dtype, as
    # FSDP2's MixedPrecisionPolicy gathers them (nothing for autocast to cast)
    autocast_params: str = ""
    capture_batch: int = 1
    # Architecture facts a consumer may use (hidden, heads, seq, vocab, ffn, layers, ...).
    config: dict[str, Any] = field(default_factory=dict)
    # parameters shared between layers (found by the capture: one tensor in two layers' modules)
    tied: list[TiedParams] = field(default_factory=list)

    # ---------------------------------------------------------------- totals
    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.bwd_flops for layer in self.layers)

    @property
    def saved_bytes(self) -> float:
        return sum(layer.saved_bytes for layer in self.layers)

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r} in {self.model}")

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    # ---------------------------------------------------------------- graphs
    def op_dag(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for op in self.ops.values():
            g.add_node(op.name, op=op)
            for src in op.inputs:
                g.add_edge(src, op.name)
        return g

    def layer_dag(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for layer in self.layers:
            g.add_node(layer.name, layer=layer)
        g.add_edges_from(self.layer_edges)
        return g

    def is_chain(self) -> bool:
        """True when the layers form a single path (a linear pipeline can cut it anywhere)."""
        names = self.layer_names
        return set(self.layer_edges) <= {(a, b) for a, b in zip(names, names[1:])} or all(
            names.index(b) == names.index(a) + 1 for a, b in self.layer_edges
        )

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_edges"] = [list(e) for e in self.layer_edges]
        return stamp("opgraph", d)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "opgraph") -> OpGraph:
        d = check_version("opgraph", d, source)
        ops = {k: Op(**v) for k, v in d.pop("ops").items()}
        layers = [Layer(**v) for v in d.pop("layers")]
        edges = [tuple(e) for e in d.pop("layer_edges")]
        tied = [TiedParams(**t) for t in d.pop("tied", [])]
        return cls(ops=ops, layers=layers, layer_edges=edges, tied=tied, **d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _opgraph_v1_to_v2(d: dict[str, Any]) -> dict[str, Any]:
    """Version 1 had no autocast captures: every activation in one dtype, no parameter copies saved
    (the new fields' defaults say exactly that)."""
    return dict(d)


MIGRATIONS[("opgraph", 1)] = _opgraph_v1_to_v2
