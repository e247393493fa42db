"""plait: plan, predict, run and watch distributed DNN training on heterogeneous clusters.

The Python API mirrors the CLI: `plait.inspect`, `plait.simulate`, `plait.plan`, `plait.run`
(`plait.api`); the planner families live in `plait.planners`, `plait.spmd` and `plait.search`.
"""

from __future__ import annotations

from plait.api import *  # noqa: F401,F403
from plait.api import __all__ as __all__

__version__ = "0.1.0"
