"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training", §3.2).

fp16 keeps 5 exponent bits: gradients below 2^-24 flush to zero. The loss is multiplied by a
scale S before backward, so every gradient (and every activation gradient crossing a
pipeline cut or a tensor-parallel collective, which are linear) is S times larger; before the
optimizer the gradients are multiplied by 1/S. S is a power of two, so scaling and
unscaling fp32 gradients is exact. When any gradient is inf/nan the step is skipped and S
halved; after `growth_interval` good steps in a row S doubles (the schedule of Megatron-LM's
and torch's `GradScaler`, whose defaults are used: S0 = 2^16, interval 2000).

In a distributed step each rank sees only its gradients (its stage, its tensor shard, under
ZeRO its shard of the reduced gradient), so the found-inf flag is all-reduced with MAX over
**every** rank of the job before anyone decides: all ranks skip or step together, or their
parameters and scales would diverge. Only fp16 scales; bf16 has fp32's exponent range.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from plait.ir.plan import default_grad_dtype
from plait.runtime.partition import RuntimeSetupError

if TYPE_CHECKING:
    from plait.ir.plan import Plan
    from plait.runtime.comm import Group

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_for(dtype: str | None, device: str = "cpu") -> AbstractContextManager[Any]:
    """The compute precision of every engine: fp32 master parameters, their ops autocast to
    bf16 / fp16 (torch's autocast lists: matmuls low, reductions and losses fp32); fp32 and tf32 run
    as they are."""
    low = LOW_PRECISION.get(dtype or "")
    return torch.autocast(device, dtype=low) if low is not None else nullcontext()


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reduce_dtype(plan: Plan, dtype: str | None = None) -> torch.dtype | None:
    """The dtype every engine reduces gradients in: the plan's `grad_reduce_dtype`, else Megatron-LM's
    default for the run's compute dtype `dtype` (default the plan's) -- `Plan.grad_dtype`, the one
    the simulator's traffic and the memory model price (fp16 reduces fp16, bf16 and fp32 fp32).
    None: fp32, the dtype of the fp32 master parameters' gradients (no cast)."""
    name = plan.grad_reduce_dtype or default_grad_dtype(dtype or plan.dtype)
    return None if name == "fp32" else _TORCH_DTYPES[name]


SCALE_ENV = "PLAIT_LOSS_SCALE"  # e.g. "init=1024,growth_interval=100" (run(launch=LaunchConfig(env=...)) passes it to the workers)


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 2.0 ** -24) -> None:
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.good_steps = 0  # finite steps since the last change of scale
        self.skipped: list[int] = []  # steps whose update was skipped
        self.found_inf = False  # the agreed flag of the current step
        # The ranks that must agree on skipping (the worker sets the job's "world" group); None: this
        # rank decides alone.
        self.group: Group | None = None

    @classmethod
    def from_string(cls, text: str | None) -> DynamicLossScaler:
        """Settings from `init=..,growth_interval=..,growth_factor=..,backoff_factor=..`."""
        names = {"init": "init_scale", "growth_interval": "growth_interval", "growth_factor": "growth_factor",
                 "backoff_factor": "backoff_factor", "min": "min_scale"}
        kwargs: dict[str, Any] = {}
        for item in filter(None, (text or "").split(",")):
            key, _, value = item.partition("=")
            if key.strip() not in names:
                raise RuntimeSetupError(f"{SCALE_ENV}: unknown field {key.strip()!r}; use {', '.join(names)}")
            try:
                kwargs[names[key.strip()]] = float(value)
            except ValueError:
                raise RuntimeSetupError(f"{SCALE_ENV}: field {key.strip()!r} must be a number, got {value!r}") from None
        if "growth_interval" in kwargs:
            kwargs["growth_interval"] = int(kwargs["growth_interval"])
        scaler = cls(**kwargs)
        if scaler.scale <= 0 or scaler.growth_interval < 1 or scaler.growth_factor < 1 or \
                not 0 < scaler.backoff_factor < 1:
            raise RuntimeSetupError(f"{SCALE_ENV}: need init > 0, growth_interval >= 1, growth_factor >= 1 and "
                                    f"0 < backoff_factor < 1, got {text!r}")
        return scaler

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Multiply `grads` by 1/scale in place and return the job-wide found-inf flag.

        Every rank of `self.group` must call it once per step: the flag is all-reduced (MAX)
        over the group, recorded as the span "allreduce amp found-inf"."""
        distributed = self.group is not None and self.group.size > 1
        if grads:
            device = grads[0].device
        elif self.group is not None and distributed and self.group.comm.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())  # a rank without gradients still joins
        else:
            device = torch.device("cpu")
        found = torch.zeros(1, device=device)
        if grads:
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            # One pass per device: checks for inf/nan and unscales (what torch's GradScaler runs).
            by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault((g.device, g.dtype), []).append(g)
            for (dev, _), gs in by_device.items():
                f = torch.zeros(1, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(dev))
                found = torch.maximum(found, f.to(device))
        if distributed:
            assert self.group is not None
            self.group.all_reduce(found, "allreduce amp found-inf", "comm", op="max")
        self.found_inf = bool(found.item() > 0)
        return self.found_inf

    def update(self, step: int) -> None:
        """After the step: back off on overflow (the step was skipped), else count towards growth."""
        if self.found_inf:
            self.skipped.append(step)
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        self.found_inf = False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": list(self.skipped),
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = [int(s) for s in state.get("skipped", [])]
