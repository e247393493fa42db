"""The Python API: each function mirrors a CLI subcommand and takes the same string forms.

Imports are lazy so `import plait` stays fast and light.
"""

from __future__ import annotations

from typing import Any

from plait.ir.plan import Plan

# `plan` is not re-exported: `plait.plan` is the (callable) package plait/plan, which calls
# `plait.search.plan`, so that `plait.plan(...)` and `import plait.search` both work.
__all__ = ["inspect", "load_cluster", "load_model", "Plan", "simulate", "run"]




def load_cluster(spec: Any):
    """A Cluster from a YAML path, a preset string (`a100-80g:nodes=8`) or a Cluster."""
    from plait.cluster import load_cluster as _load

    return _load(spec)


def load_model(spec: Any):
    """(nn.Module factory result, sample-input builder) from a zoo spec or `file.py:factory`."""
    from plait.graph.zoo import load_model as _load

    return _load(spec)


def inspect(model: Any, batch: int = 1, **kwargs: Any):
    """Capture `model` (zoo spec, `file.py:factory`, or nn.Module) and return its OpGraph."""
    from plait.graph.inspect import inspect_model

    return inspect_model(model, batch=batch, **kwargs)


def simulate(model: Any, cluster: Any, plan: Any, **kwargs: Any):
    """Predict one iteration: returns a SimResult (see plait.sim)."""
    from plait.sim.api import simulate as _simulate

    return _simulate(model, cluster, plan, **kwargs)


def run(model: Any, cluster: Any, plan: Any, steps: int = 3, **configs: Any):
    """Train `model` under `plan` with real torch.distributed workers (see plait.runtime).
    `configs`: `training`, `checkpoint`, `launch`, `records`, `faults` (the dataclasses of
    `plait.runtime.config`) and `watch`, as `plait.runtime.api.run` takes them."""
    from plait.runtime.api import run as _run

    return _run(model, cluster, plan, steps=steps, **configs)
