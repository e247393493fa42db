"""`plait inspect`: capture a model and summarise it per layer for a given batch.

`inspect_model` returns the per-sample `OpGraph`; `summarize` scales it to a batch
(the figures a user reads: parameters, forward/backward FLOPs, activation bytes kept
for backward, bytes leaving each layer), and `render_table` prints that with rich.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from plait.errors import PlaitError
from plait.graph.capture import capture
from plait.ir.opgraph import OpGraph

__all__ = ["DTYPES", "InspectError", "inspect_model", "parse_dtype", "render_table", "summarize"]


class InspectError(PlaitError):
    """Bad input to `plait inspect` (model, batch, dtype)."""


DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

# The batch the capture runs at when the user asks for fewer samples: with 2, a
# dimension of size 1 cannot hide a batch-dimension mistake (broadcast, squeeze), and
# every figure is still divided back to one sample.
MIN_CAPTURE_BATCH = 2


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise InspectError(
            f"dtype: unknown value {dtype!r}; expected one of {', '.join(sorted(set(DTYPES)))}"
        )
    return DTYPES[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def inspect_model(
    spec_or_module: Any,
    batch: int = 1,
    dtype: str | torch.dtype = torch.bfloat16,
    *,
    sample_inputs: Any = None,
    loss_fn: Any = None,
    name: str | None = None,
    autocast: str | None = None,
) -> OpGraph:
    """Capture a model on the meta device and return its per-sample OpGraph.

    `autocast` ("bf16" / "fp16"): the model in fp32 (`dtype` is ignored), its step under autocast
    to that dtype with CUDA's op lists -- how plait's engines train a 16-bit plan.

    `spec_or_module` is a zoo spec string (`gpt:layers=24,hidden=1024`), a
    `path/to/file.py:factory` string, a `ModelSpec`, or an `nn.Module` (then
    `sample_inputs` is required and `loss_fn(output)` optional). The capture runs at
    max(batch, 2) samples and divides by it; `summarize(graph, batch)` scales back.
    """
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InspectError(f"batch: must be a positive integer, got {batch!r}")
    torch_dtype = torch.float32 if autocast else parse_dtype(dtype)
    capture_batch = max(batch, MIN_CAPTURE_BATCH)
    if isinstance(spec_or_module, nn.Module):
        if sample_inputs is None:
            raise InspectError(
                "sample_inputs: required when inspecting an nn.Module (a tuple of forward arguments)"
            )
        module = spec_or_module
        return capture(
            module,
            sample_inputs,
            name=name or type(module).__name__,
            loss_fn=loss_fn,
            autocast=autocast,
        )
    spec = spec_or_module
    if isinstance(spec, str):
        from plait.graph.zoo import load_model

        spec = load_model(spec)
    if not (hasattr(spec, "build") and hasattr(spec, "sample_batch")):
        raise InspectError(
            f"model: expected a zoo spec string, a ModelSpec or an nn.Module, got {type(spec).__name__}"
        )
    module = spec.build(device="meta", dtype=torch_dtype)
    inputs, target = spec.sample_batch(capture_batch, device="meta", dtype=torch_dtype)

    def spec_loss(output: Any) -> torch.Tensor:
        return spec.loss(output, target)

    config = dict(getattr(spec, "config", {}) or {})
    from plait.graph.tp_plan import head_counts, transformer_shape

    # the heads tp must divide, and a dense decoder's shape for the closed-form block cost (an HF config)
    seq = inputs[0].shape[1] if inputs and getattr(inputs[0], "dim", lambda: 0)() >= 2 else 0
    shape = transformer_shape(module, seq) if seq else {}
    for key, value in {**head_counts(module), **shape}.items():
        config.setdefault(key, value)
    return capture(
        module,
        inputs,
        name=name or spec.name,
        config=config,
        loss_fn=loss_fn or spec_loss,
        batch=capture_batch,
        autocast=autocast,
    )


def summarize(graph: OpGraph, batch: int = 1) -> dict[str, Any]:
    """Per-layer and total figures for `batch` samples (JSON-ready; what `--json` prints)."""
    layers = []
    for layer in graph.layers:
        layers.append(
            {
                "name": layer.name,
                "kind": layer.kind,
                "tp_style": layer.tp_style,
                "params": layer.param_count,
                "param_bytes": layer.param_bytes,
                "fwd_flops": layer.fwd_flops * batch,
                "bwd_flops": layer.bwd_flops * batch,
                "saved_bytes": layer.saved_bytes * batch,
                "saved_tp_bytes": layer.saved_tp_bytes * batch,
                "saved_selective_bytes": layer.saved_selective_bytes * batch,
                "input_bytes": layer.input_bytes * batch,
                "output_bytes": layer.output_bytes * batch,
                "ops": len(layer.ops),
            }
        )
    totals = {
        key: sum(row[key] for row in layers)
        for key in (
            "params",
            "param_bytes",
            "fwd_flops",
            "bwd_flops",
            "saved_bytes",
            "saved_tp_bytes",
            "saved_selective_bytes",
            "ops",
        )
    }
    return {
        "model": graph.model,
        "batch": batch,
        "param_dtype_bytes": graph.param_dtype_bytes,
        "activation_dtype_bytes": graph.activation_dtype_bytes,
        "capture_batch": graph.capture_batch,
        "autocast": graph.autocast or None,  # the step captured under autocast to this dtype (None: as it is)
        "config": graph.config,
        "layers": layers,
        "layer_edges": [list(e) for e in graph.layer_edges],
        "is_chain": graph.is_chain(),
        "totals": totals,
    }


def _count(n: float, units: tuple[str, ...] = ("K", "M", "B", "T")) -> str:
    for unit, scale in reversed(list(zip(units, (1e3, 1e6, 1e9, 1e12, 1e15)))):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _flops(n: float) -> str:
    return _count(n, ("K", "M", "G", "T", "P"))


def render_table(summary: dict[str, Any], dtype: str | None = None) -> Any:
    """A rich Table of `summarize(...)` output."""
    from rich.table import Table

    title = f"{summary['model']} — batch {summary['batch']}"
    if dtype:
        title += f", {dtype}"
    table = Table(title=title, show_footer=True)
    tot = summary["totals"]
    columns = [
        ("layer", "left", "total"),
        ("kind", "left", ""),
        ("tp", "left", ""),
        ("params", "right", _count(tot["params"])),
        ("fwd FLOP", "right", _flops(tot["fwd_flops"])),
        ("bwd FLOP", "right", _flops(tot["bwd_flops"])),
        ("saved act.", "right", _bytes(tot["saved_bytes"])),
        ("output", "right", ""),
    ]
    # A layer graph that branches shows where each layer's inputs come from.
    preds: dict[str, list[str]] | None = None
    if not summary["is_chain"]:
        preds = {row["name"]: [] for row in summary["layers"]}
        for a, b in summary["layer_edges"]:
            preds[b].append(a)
        columns.insert(1, ("inputs from", "left", ""))
    longest = max((len(row["name"]) for row in summary["layers"]), default=5)
    for header, justify, footer in columns:
        if header == "inputs from":  # may wrap: the other columns keep their figures whole
            table.add_column(header, justify="left", ratio=1, overflow="fold")
        else:
            table.add_column(header, justify=justify, footer=footer, no_wrap=True,  # type: ignore[arg-type]
                             min_width=longest if header == "layer" else None)
    for row in summary["layers"]:
        table.add_row(
            row["name"],
            *([", ".join(preds[row["name"]]) or "(model inputs)"] if preds is not None else []),
            row["kind"],
            row["tp_style"],
            _count(row["params"]),
            _flops(row["fwd_flops"]),
            _flops(row["bwd_flops"]),
            _bytes(row["saved_bytes"]),
            _bytes(row["output_bytes"]),
        )
    return table


def dtype_label(dtype: str | torch.dtype) -> str:
    return _dtype_name(parse_dtype(dtype))
