"""The runtime: trains under a plan with real torch.distributed workers (`plait.runtime.api.run`).

`engine_for(plan)` names the engine that runs a plan (one of `ENGINES`, by the plan's form) or why
none can, naming the field; `supports(plan) -> (bool, reason)` is its yes/no. `run` refuses exactly
those plans, with that reason, before any process starts."""

from plait.runtime.layout import ENGINES, EngineVerdict, engine_for, supports

__all__ = ["ENGINES", "EngineVerdict", "engine_for", "supports"]
