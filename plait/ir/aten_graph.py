"""AtenGraph: the model's forward pass as aten ops with tensor shapes and dtypes.

The op-level view of one capture, for planners that decide per op and per tensor (HAP-style SPMD
synthesis, `plait.spmd`). The layer-level `OpGraph` is the other view of the same model: every
`AtenOp.layer` names one of the OpGraph's layers (same names, from
`plait.graph.capture.layer_assignment`), so a planner can move between the two.

Made by `plait.graph.aten_capture.capture_aten(module, sample_inputs)` (torch.export on the meta
device). Unlike the OpGraph, figures here are for the capture batch (`batch`), not per sample:
shapes are real shapes.

Tensors are named; an op reads `inputs` and writes `outputs` (tensor names). Non-tensor arguments
are kept in `args` / `kwargs` in the op's own order, a tensor argument written ``{"t": name}``, so
a sharding rule reads e.g. the einsum equation or the softmax dimension from the op itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from plait.errors import PlaitError
from plait.ir.formats import check_version, stamp

ROLES = ("input", "param", "buffer", "activation", "constant")


class AtenGraphError(PlaitError, ValueError):
    """An AtenGraph that is inconsistent; the message names the op or tensor."""


@dataclass
class TensorMeta:
    name: str
    shape: list[int]
    dtype: str  # torch dtype without the "torch." prefix: "float32", "int64", "bool"
    role: str  # one of ROLES; "constant": made inside the model from no input (arange, masks)
    producer: str | None = None  # op that writes it; None for inputs, parameters and buffers
    param: str | None = None  # parameter / buffer path (role param or buffer)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}  # fmt: skip


@dataclass
class AtenOp:
    name: str  # unique, the fx node name: "linear_3"
    target: str  # "aten.linear.default"
    layer: str  # the OpGraph Layer this op belongs to
    module: str  # innermost module path that ran it ("" for top-level glue)
    inputs: list[str] = field(default_factory=list)  # tensor names, in argument order
    outputs: list[str] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)  # tensors as {"t": name}
    kwargs: dict[str, Any] = field(default_factory=dict)
    flops: float = 0.0  # forward FLOPs at the capture batch (torch's flop_registry formulas)

    @property
    def kind(self) -> str:
        """The op's name without namespace and overload: "aten.linear.default" -> "linear"; an op
        of another library keeps its namespace ("transformers.grouped_mm_fallback.default" ->
        "transformers.grouped_mm_fallback", so it never takes an aten op's rule)."""
        parts = self.target.split(".")
        if len(parts) >= 2 and parts[0] == "aten":
            return parts[1]
        return f"{parts[0]}.{parts[1]}" if len(parts) == 3 else parts[0]


@dataclass
class AtenGraph:
    """Ops in execution (topological) order; `outputs` are the model's outputs."""

    model: str
    batch: int
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    ops: list[AtenOp] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def op(self, name: str) -> AtenOp:
        for op in self.ops:
            if op.name == name:
                return op
        raise AtenGraphError(f"{self.model}: no op named {name!r}")

    @property
    def params(self) -> list[str]:
        return [t.name for t in self.tensors.values() if t.role == "param"]

    @property
    def layers(self) -> list[str]:
        """Layer names in order of first use."""
        return list(dict.fromkeys(op.layer for op in self.ops))

    def consumers(self) -> dict[str, list[str]]:
        """tensor name -> names of the ops that read it."""
        out: dict[str, list[str]] = {t: [] for t in self.tensors}
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                out[t].append(op.name)
        return out

    def validate(self) -> None:
        """Every tensor an op reads exists and is written before it; raises naming the op."""
        written = {t.name for t in self.tensors.values() if t.producer is None}
        for op in self.ops:
            for t in op.inputs:
                if t not in self.tensors:
                    raise AtenGraphError(f"{self.model}: op {op.name} reads unknown tensor {t!r}")
                if t not in written:
                    raise AtenGraphError(f"{self.model}: op {op.name} reads {t!r} before it is written")
            for t in op.outputs:
                if t not in self.tensors or self.tensors[t].producer != op.name:
                    raise AtenGraphError(f"{self.model}: op {op.name} writes {t!r}, not recorded as its output")
                written.add(t)
        for t in self.outputs:
            if t not in written:
                raise AtenGraphError(f"{self.model}: output {t!r} is never written")

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return stamp("atengraph", asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "atengraph") -> AtenGraph:
        d = check_version("atengraph", d, source, AtenGraphError)
        try:
            tensors = {k: TensorMeta(**v) for k, v in d.pop("tensors").items()}
            ops = [AtenOp(**v) for v in d.pop("ops")]
            graph = cls(tensors=tensors, ops=ops, **d)
        except (KeyError, TypeError) as exc:
            raise AtenGraphError(f"{source}: not an AtenGraph: {exc}") from None
        graph.validate()
        return graph

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
