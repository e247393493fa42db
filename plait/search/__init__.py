"""`plait plan`'s front door: the search driver over every planner family.

    from plait.search import plan
    result = plan("gpt:layers=24,hidden=2048,heads=16,seq=2048", "uneven:nodes=8", global_batch=512)
    result.best.plan, result.best.iteration_time_s, result.pruned_reasons

The driver sits above the planners, the simulator and the runtime (docs/DESIGN.md): the
planners enumerate, prune by memory and rank analytically without knowing the simulator; the
driver hands them the simulator as their `evaluate` function, so every family is ranked by the
same simulator. Today the family is the Pipette-style 3D configurator (`plait.plan.threed`).
With no arguments it plans `DEFAULT_MODEL` on `DEFAULT_CLUSTER` at `DEFAULT_GLOBAL_BATCH`.
"""

from __future__ import annotations

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
)
from plait.search.driver import plan, simulator_evaluate

__all__ = [
    "DEFAULT_CLUSTER", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MODEL", "AnalyticModel", "Candidate", "PlanResult",
    "SearchError", "SearchSpace", "auto_dtype", "enumerate_groups", "load_graph", "plan",
    "simulator_evaluate",
]
