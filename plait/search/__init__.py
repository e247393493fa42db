"""`plait plan`'s front door: the search driver over every planner family.

    import plait
    result = plait.plan("gpt:layers=24,hidden=2048,heads=16,seq=2048", "uneven:nodes=8", global_batch=512)
    result.best.plan, result.best.iteration_time_s, result.pruned_reasons

`plait.plan` (`plait.api.plan`) builds the simulator for the cluster and calls `search_plans`.
The driver sits above the planners; the simulator is built above the driver and handed down
(docs/DESIGN.md): the planners enumerate, prune by memory and rank analytically without knowing the simulator; the
driver hands every family the one `Simulator` it is handed, so all are ranked on one scale,
and nothing in this package imports `plait.sim`. Families register in
`plait.search.driver.FAMILIES` ("3d": the Pipette-style configurator, `plait.planners.threed`);
`families="all"` searches them all and merges their finalists into one ranking. Every family is
handed the one `SearchOptions` and its own typed options (`ThreeDOptions`, `GraphOptions`,
`SpmdOptions`, `ComposeOptions`: `plait.planners.options`); `plait.plan` builds them from its
keyword arguments (`options_from_keywords`).
With no arguments it plans `DEFAULT_MODEL` on `DEFAULT_CLUSTER` at `DEFAULT_GLOBAL_BATCH`.
"""

from __future__ import annotations

from plait.planners.options import (
    ComposeOptions,
    GraphOptions,
    NoOptions,
    SearchOptions,
    SpmdOptions,
    ThreeDOptions,
)
from plait.planners.threed import AnalyticModel, SearchSpace, enumerate_groups
from plait.planners.types import (
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
    Family,
    FamilySearch,
    options_from_keywords,
    register_family,
    resolve_families,
    search_plans,
)

__all__ = [
    "DEFAULT_CLUSTER", "DEFAULT_GLOBAL_BATCH", "DEFAULT_MODEL", "AnalyticModel", "Candidate", "PlanResult",
    "SearchError", "SearchSpace", "auto_dtype", "enumerate_groups", "load_graph", "search_plans",
    "FAMILIES", "Family", "FamilySearch", "register_family", "resolve_families", "options_from_keywords",
    "SearchOptions", "ThreeDOptions", "GraphOptions", "SpmdOptions", "ComposeOptions", "NoOptions",
]
