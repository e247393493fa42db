"""`plait plan`'s front door: search every planner family for the fastest plan that fits.

    from plait.plan.search import plan
    result = plan("gpt:layers=24,hidden=2048,heads=16,seq=2048", "uneven:nodes=8", global_batch=512)
    result.best.plan, result.best.iteration_time_s, result.pruned_reasons

Today the family is the Pipette-style 3D configurator (`plait.plan.threed`): data x tensor
x pipeline parallelism with micro-batching, recompute, ZeRO and schedule, memory-pruned,
ranked by the simulator, placed on uneven links, split unevenly over mixed GPU kinds
(`plait.plan.hetero`). With no arguments it plans `DEFAULT_MODEL` (a small GPT this
machine can train) on `DEFAULT_CLUSTER` (`emulated-mixed`, one GPU per node on machines
with fewer than 4 CPUs) at `DEFAULT_GLOBAL_BATCH`.
"""

from __future__ import annotations

from typing import Any

from plait.plan.threed import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    AnalyticModel,
    Candidate,
    PlanResult,
    SearchError,
    SearchSpace,
    auto_dtype,
    enumerate_groups,
    load_graph,
    search_3d,
)

__all__ = [
    "DEFAULT_CLUSTER", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MODEL", "AnalyticModel", "Candidate", "PlanResult",
    "SearchError", "SearchSpace", "auto_dtype", "enumerate_groups", "load_graph", "plan",
]


def plan(model: Any = None, cluster: Any = None, *, global_batch: int | None = None, top: int = 5,
         **kwargs: Any) -> PlanResult:
    """The fastest plans of `model` on `cluster` for `global_batch` (see `threed.search_3d`
    for the keyword arguments: finalists, space, placement, simulate, seed, progress, ...)."""
    return search_3d(model, cluster, global_batch=global_batch, top=top, **kwargs)
