"""An SPMD program as a `Plan` (`Plan.spmd`), and back: what `plait plan --family spmd --out` writes
and `plait run --plan FILE` runs.

The plan keeps the decisions only -- one strategy per aten op (by the op's name in the model's
`AtenGraph` at the plan's `global_batch`) and the per-device ratios (one vector per segment) --
not shard sizes or collectives: those follow from the graph (`plait.spmd.ratios.round_shards`,
the conversion table), so a plan cannot disagree with the model it runs on without the run
saying which op differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.ir.plan import SPMD_VERSION, Plan, PlanError
from plait.spmd.rules import Strategy


def program_plan(strategies: dict[str, Strategy], ratios: Any, batch: int, *, model: str | None = None,
                 predicted_s: float | None = None, device_order: Sequence[int] | None = None,
                 collectives: dict[str, str] | None = None, dtype: str = "fp32") -> Plan:
    """The Plan of a program: `strategies` by op name, `ratios` one vector or one per segment."""
    r = np.asarray(ratios, dtype=float)
    r = r / r.sum(axis=-1, keepdims=True)  # exact sums after the LP's rounding noise
    spmd: dict[str, Any] = {
        "version": SPMD_VERSION,
        "ratios": [[float(x) for x in row] for row in r] if r.ndim == 2 else [float(x) for x in r],
        "strategies": {op: [list(s.inputs), list(s.outputs), bool(s.sharded)] for op, s in strategies.items()},
    }
    if collectives:
        spmd["collectives"] = dict(collectives)
    if model is not None:
        spmd["model"] = model
    if predicted_s is not None:
        spmd["predicted_s"] = float(predicted_s)
    return Plan(dp=1, tp=1, pp=1, micro_batch=batch, global_batch=batch, dtype=dtype, spmd=spmd,
                device_order=list(device_order) if device_order is not None else None)


def plan_strategies(plan: Plan) -> dict[str, Strategy]:
    """The strategies of an SPMD plan, by op name."""
    if plan.spmd is None:
        raise PlanError("plan field 'spmd': the plan has no SPMD program")
    return {op: Strategy(tuple(s[0]), tuple(s[1]), bool(s[2])) for op, s in plan.spmd["strategies"].items()}


def plan_ratios(plan: Plan) -> np.ndarray:
    if plan.spmd is None:
        raise PlanError("plan field 'spmd': the plan has no SPMD program")
    return np.asarray(plan.spmd["ratios"], dtype=float)
