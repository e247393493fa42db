"""plait: plan, predict, run and watch distributed DNN training on heterogeneous clusters.

The Python API mirrors the CLI: `plait.inspect`, `plait.simulate`, `plait.plan`, `plait.run`.
"""

from __future__ import annotations

from plait import plan  # noqa: F401  (callable package: plait.plan(model, cluster, ...))
from plait.api import *  # noqa: F401,F403
from plait.api import __all__ as _api_all

__all__ = [*_api_all, "plan"]

__version__ = "0.1.0"
