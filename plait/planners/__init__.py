"""Planners: the families that turn (model, cluster, batch) into Plans.

The 3D configurator (Pipette) is `plait.planners.threed`; rank placement `plait.planners.placement`;
uneven splits for mixed GPU kinds `plait.planners.hetero`; framework export `plait.planners.export`.
The `Plan` type itself lives in the neutral IR (`plait.ir.plan`), re-exported here. Planners
never import the simulator or the runtime: the search driver (`plait.search`) sits above them
and hands them the simulator to rank with.

`plait.plan(...)` (the package called like a function) is the search; the top-level
`plait/__init__.py` makes it so, because the driver sits above this package.
"""

from __future__ import annotations

from plait.ir.plan import Plan, PlanError, StageSpec

__all__ = ["Plan", "PlanError", "StageSpec"]
