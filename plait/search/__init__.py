"""`plait plan`'s front door: the search driver over every planner family.

    from plait.search import plan
    result = plan("gpt:layers=24,hidden=2048,heads=16,seq=2048", "uneven:nodes=8", global_batch=512)
    result.best.plan, result.best.iteration_time_s, result.pruned_reasons

The driver sits above the planners, the simulator and the runtime (docs/DESIGN.md): the
planners enumerate, prune by memory and rank analytically without knowing the simulator; the
driver hands them the simulator as their `evaluate` function, so every family is ranked by the
same simulator. Families register in `plait.search.driver.FAMILIES` ("3d": the Pipette-style
configurator, `plait.plan.threed`); `plan(..., families="all")` searches them all and merges
their finalists into one ranking.
With no arguments it plans `DEFAULT_MODEL` on `DEFAULT_CLUSTER` at `DEFAULT_GLOBAL_BATCH`.
"""

from __future__ import annotations

from plait.plan.threed import AnalyticModel, SearchSpace, enumerate_groups
from plait.plan.types import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    Candidate,
    PlanResult,
    SearchError,
    auto_dtype,
    load_graph,
)
from plait.search.driver import (
    FAMILIES,
    plan,
    register_family,
    resolve_families,
    simulator_evaluate,
)

__all__ = [
    "DEFAULT_CLUSTER", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MODEL", "AnalyticModel", "Candidate", "PlanResult",
    "SearchError", "SearchSpace", "auto_dtype", "enumerate_groups", "load_graph", "plan",
    "simulator_evaluate", "FAMILIES", "register_family", "resolve_families",
]
