"""The runtime: trains under a plan with real torch.distributed workers (`plait.runtime.api.run`).

`supports(plan) -> (bool, reason)` is the runtime's own statement of what it can run; `run`
refuses exactly those plans, with that reason."""

from plait.runtime.layout import supports

__all__ = ["supports"]
