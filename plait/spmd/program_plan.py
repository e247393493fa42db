"""An SPMD program as a `Plan` (`Plan.spmd`), and back: what `plait plan --family spmd --out` writes
and `plait run --plan FILE` runs.

The plan keeps the decisions only -- one strategy per aten op (by the op's name in the model's
`AtenGraph` at the plan's `global_batch`), the per-device ratios (one vector per segment) and,
per tensor, how its uneven all-gathers / reduce-scatters run ("padded" or "grouped", the
search's per-message choice: `plan_collectives`) -- not shard sizes or which collectives: those
follow from the graph (`plait.cost.program.round_shards`, the conversion table), so a plan cannot
disagree with the model it runs on without the run saying which op differs. The plan's dtype is
the one the program was synthesized (and its graph captured, `capture_graph`) at.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.cost.spmd import Devices, comm_seconds
from plait.ir.aten_graph import AtenGraph
from plait.ir.plan import Plan
from plait.ir.program import Comm, ShardingError, SpmdProgram, Strategy

DTYPES = ("fp32", "tf32", "fp16", "bf16")  # tf32 computes on fp32 tensors
_MODED = ("all_gather", "reduce_scatter")  # the uneven collectives a plan says padded or grouped for


def capture_graph(spec: Any, batch: int, dtype: str = "fp32") -> AtenGraph:
    """The model's aten graph at `batch` on the meta device, built and fed in `dtype` -- the
    dtype the program is priced at (an fp16 plan's messages are fp16 bytes). For most models op
    names do not depend on the dtype, so the runtime (which captures in fp32 and autocasts its ops
    to the plan's dtype) finds the plan's ops; `dtype_changes_graph` names the models for which
    they do."""
    import torch

    from plait.graph.aten_capture import capture_on_meta

    if dtype not in DTYPES:
        raise ShardingError(f"dtype: must be one of {DTYPES}, got {dtype!r}")
    tdtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    return capture_on_meta(spec, batch, tdtype)


def dtype_changes_graph(spec: Any, batch: int, dtype: str, graph: AtenGraph) -> str | None:
    """Why the runtime cannot run a program planned on `graph` (captured in `dtype`), else None.
    The runtime captures the fp32 model and autocasts its ops; a model whose forward branches on
    its own dtype (T5's layer norm casts to a half-precision weight's dtype, its fp16 blocks clamp
    infinities) has other ops in fp32, and the program would name ops the runtime's graph lacks."""
    if dtype in ("fp32", "tf32"):
        return None
    runtime = [op.name for op in capture_graph(spec, batch, "fp32").ops]
    planned = [op.name for op in graph.ops]
    if runtime == planned:
        return None
    extra = sorted(set(planned) - set(runtime))[:3]
    return (f"the model's graph depends on its dtype ({len(planned)} ops in {dtype}, {len(runtime)} in fp32"
            f"{', e.g. ' + ', '.join(extra) if extra else ''}): the runtime autocasts the fp32 model, so it "
            f"cannot run a program planned in {dtype}; plan it with --dtype fp32 to run it")


def plan_collectives(comms: Sequence[tuple[str, Comm]], devices: Devices, ratios: Any) -> dict[str, str]:
    """tensor -> "padded" | "grouped" for every tensor with an uneven all-gather or reduce-scatter
    in the program (`Program.comms`, their algorithms chosen per message by the search). The
    runtime takes one mode per tensor (`plait.runtime.spmd_program`); where a tensor's messages
    were given different ones (its forward all-gather grouped, its gradient's reduce-scatter
    padded), the mode with the least total time of that tensor's messages at `ratios` (the
    segments' mean when there are several) is written."""
    r = np.asarray(ratios, dtype=float)
    r = r.mean(axis=0) if r.ndim == 2 else r
    r = r / r.sum()
    found: dict[str, list[Comm]] = {}
    for _, c in comms:
        if c.op in _MODED and c.algorithm in ("padded", "grouped"):
            found.setdefault(c.tensor, []).append(c)
    out: dict[str, str] = {}
    for t, cs in found.items():
        modes = {c.algorithm for c in cs}
        if len(modes) == 1:
            out[t] = modes.pop()
            continue
        cost = {m: sum(comm_seconds(Comm(c.op, c.tensor, c.nbytes, c.phase, c.dim, c.group, m), devices, r)
                       for c in cs) for m in ("padded", "grouped")}
        out[t] = min(cost, key=cost.__getitem__)
    return out


def program_plan(strategies: dict[str, Strategy], ratios: Any, batch: int, *, model: str | None = None,
                 predicted_s: float | None = None, device_order: Sequence[int] | None = None,
                 collectives: dict[str, str] | None = None, dtype: str = "fp32",
                 homes: dict[str, str] | None = None) -> Plan:
    """The Plan of a program: `strategies` by op name, `ratios` one vector or one per segment,
    `homes` the parameters stored elsewhere than their first reader wants them (`Program.homes`)."""
    r = np.asarray(ratios, dtype=float)
    r = r / r.sum(axis=-1, keepdims=True)  # exact sums after the LP's rounding noise
    spmd = SpmdProgram(
        strategies=dict(strategies),
        ratios=[[float(x) for x in row] for row in r] if r.ndim == 2 else [float(x) for x in r],
        collectives=dict(collectives or {}), homes=dict(homes or {}), model=model,
        predicted_s=float(predicted_s) if predicted_s is not None else None)
    return Plan(dp=1, tp=1, pp=1, micro_batch=batch, global_batch=batch, dtype=dtype, spmd=spmd,
                device_order=list(device_order) if device_order is not None else None)
