"""Learning-rate schedule as Megatron-LM configures it (`--lr`, `--min-lr`, `--lr-warmup-iters`,
`--lr-decay-style`, `--lr-decay-iters`; megatron/core/optimizer_param_scheduler.py, `get_lr`).

For iteration s (0-based, the step's optimizer update): linear warm-up from 0 to `lr` over
`warmup` iterations, lr(s) = lr * s / warmup for s <= warmup; then, over the iterations up to
`decay_iters`, decay ratio r = (s - warmup) / (decay_iters - warmup) and
lr(s) = min_lr + c(r) * (lr - min_lr) with c = 1 - r (linear) or (cos(pi r) + 1) / 2 (cosine);
`min_lr` after `decay_iters`; `constant` keeps `lr` after the warm-up. The rate depends on the
step alone, so a resumed run (under any plan) continues the schedule exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from plait.errors import PlaitError

STYLES = ("constant", "linear", "cosine")


class LRScheduleError(PlaitError, ValueError):
    """A learning-rate schedule setting out of range; the message names the flag."""


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup: int = 0
    decay_style: str = "constant"
    decay_iters: int | None = None  # default: the run's steps

    def __post_init__(self) -> None:
        if self.decay_style not in STYLES:
            raise LRScheduleError(f"--lr-decay-style: must be one of {', '.join(STYLES)}, got {self.decay_style!r}")
        if self.lr < 0 or self.min_lr < 0:
            raise LRScheduleError(f"--lr / --min-lr: must be >= 0, got {self.lr} / {self.min_lr}")
        if self.min_lr > self.lr:
            raise LRScheduleError(f"--min-lr: {self.min_lr} is above --lr {self.lr}")
        if self.warmup < 0:
            raise LRScheduleError(f"--lr-warmup-iters: must be >= 0, got {self.warmup}")
        if self.decay_iters is not None and self.decay_iters <= self.warmup and self.decay_style != "constant":
            raise LRScheduleError(f"--lr-decay-iters: {self.decay_iters} must exceed --lr-warmup-iters {self.warmup}")

    def at(self, step: int, total_steps: int) -> float:
        """The learning rate of iteration `step` (0-based) of a run of `total_steps`."""
        if self.warmup > 0 and step <= self.warmup:
            return self.lr * step / self.warmup
        if self.decay_style == "constant":
            return self.lr
        decay = self.decay_iters if self.decay_iters is not None else total_steps
        if step > decay:
            return self.min_lr
        if decay <= self.warmup:
            return self.min_lr
        ratio = (step - self.warmup) / (decay - self.warmup)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, lr: float) -> LRSchedule:
        return cls(**data) if data else cls(lr=lr)
