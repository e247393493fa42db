"""Planners: the Plan IR and the Pipette-style 3D configurator.

`plait.plan.ir.Plan` is the plan every planner returns. The 3D search lives in
`plait.plan.search` (`plan(model, cluster, global_batch=...) -> PlanResult`, the 3D
configurator itself in `plait.plan.threed`), rank
placement in `plait.plan.placement`, uneven splits for mixed GPU kinds in
`plait.plan.hetero`, and framework export in `plait.plan.export`. Those are imported
lazily so `import plait` stays light.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from plait.plan.ir import Plan, PlanError, StageSpec

__all__ = ["Plan", "PlanError", "StageSpec", "plan", "PlanResult", "SearchSpace", "export"]


def __getattr__(name: str) -> Any:
    if name in ("plan", "PlanResult", "SearchSpace", "Candidate"):
        from plait.plan import search

        return getattr(search, name)
    if name == "export":
        from plait.plan.export import export

        return export
    raise AttributeError(f"module 'plait.plan' has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    """Lets `plait.plan(...)` search, as the CLI's `plait plan` does, while `plait.plan` stays
    the package (`import plait.plan.search` keeps working)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from plait.plan.search import plan as _plan

        return _plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
