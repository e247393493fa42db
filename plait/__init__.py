"""plait: plan, predict, run and watch distributed DNN training on heterogeneous clusters.

The Python API mirrors the CLI: `plait.inspect`, `plait.simulate`, `plait.plan`, `plait.run`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from plait import plan  # noqa: F401  (made callable below: plait.plan(model, cluster, ...))
from plait.api import *  # noqa: F401,F403
from plait.api import __all__ as _api_all

__all__ = [*_api_all, "plan"]

__version__ = "0.1.0"


class _CallablePackage(types.ModuleType):
    """Lets `plait.plan(...)` search, as the CLI's `plait plan` does, while `plait.plan` stays
    the planners' package. Installed from here, the top of the import order, because the
    search driver (`plait.search`) sits above the planners."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from plait.api import plan as _plan

        return _plan(*args, **kwargs)


sys.modules["plait.plan"].__class__ = _CallablePackage
