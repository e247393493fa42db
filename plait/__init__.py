"""plait: plan, predict, run and watch distributed DNN training on heterogeneous clusters.

The Python API mirrors the CLI: `plait.inspect`, `plait.simulate`, `plait.plan`, `plait.run`.
"""

from __future__ import annotations

from plait.api import *  # noqa: F401,F403
from plait.api import __all__  # noqa: F401

__version__ = "0.1.0"
