"""The simulator: lower (model, plan, cluster) to a task DAG and run it with link contention.

``plait.sim.simulate(model, cluster, plan) -> SimResult`` (see `plait.sim.api`); the pieces
are `plait.sim.lowering` (task graph), `plait.sim.engine` (discrete events), `plait.net.view`
(links), `plait.graph.gpt_closed_form` (closed-form GPT OpGraph) and `plait.ir.timeline` (shared schema).
Imported lazily so that `plait.ir.timeline` stays cheap for the runtime.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SimOptions", "SimResult", "simulate"]


def __getattr__(name: str) -> Any:
    if name in ("simulate", "SimResult"):
        from plait.sim import api

        return getattr(api, name)
    if name == "SimOptions":
        from plait.sim.lowering import SimOptions

        return SimOptions
    raise AttributeError(f"module 'plait.sim' has no attribute {name!r}")
