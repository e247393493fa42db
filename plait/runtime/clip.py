"""Global gradient-norm clipping across every shard of every parallel form (Megatron's --clip-grad).

The single-process rule (`torch.nn.utils.clip_grad_norm_`): with the global norm
``N = sqrt(sum over all parameters of |g|^2)``, every gradient is multiplied by
``min(1, max_norm / (N + 1e-6))``.

Distributed, each rank adds up the squares of the gradient elements it holds, each
weighted by 1 / (the number of ranks that hold a copy of that element), and one SUM
all-reduce over the whole job (`global_grad_norm`, the only reduction) gives N:

* data-parallel replicas (ZeRO-0, any dp_shares) hold identical reduced gradients:
  weight 1/dp (Megatron reduces over the model-parallel group only -- the same sum);
* ZeRO-1/2/3 shards are disjoint: weight 1 on each shard's elements;
* tensor-parallel shards are disjoint (weight 1); parameters replicated over the tensor
  group (LayerNorms, row-parallel biases, sequence-parallel params) weight 1/tp;
* pipeline stages and stage-DAG nodes hold disjoint parameters, except tied ones (the
  embedding in the first and last stage) held by k ranks: weight 1/k.

The clipping then runs where the optimizer reads the gradients: after the data-parallel
reduction and the fp16 unscale, before the update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def global_grad_norm(local_sq: torch.Tensor, group: Any = None) -> float:
    """sqrt of the job-wide SUM of the ranks' weighted squared gradient elements: one all-reduce
    over `group` (the communication facade's world group; None: one process)."""
    total = local_sq.detach().double().reshape(1).clone()
    if group is not None and group.size > 1:
        group.all_reduce(total, "allreduce grad-norm", "comm_dp")
    return math.sqrt(float(total.item()))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


class GradClipper:
    """Clips the gradients one rank holds, given each parameter's copy weight (see module docstring)."""

    def __init__(self, max_norm: float, weights: dict[int, float], group: Any = None) -> None:
        if not max_norm > 0:
            raise ValueError(f"clip_grad: must be > 0, got {max_norm}")
        self.max_norm = float(max_norm)
        self.weights = weights  # id(parameter) -> weight
        self.group = group  # plait.runtime.comm.Group over every rank (None: one process)
        self.norms: list[float] = []  # the global norm of every step, before clipping
        self._flat_cache: dict[tuple, torch.Tensor] = {}

    def weight(self, p: nn.Parameter) -> float:
        return self.weights.get(id(p), 1.0)

    def flat_weights(self, params: Sequence[nn.Parameter], padded: int, lo: int, hi: int,
                     scale: float = 1.0) -> torch.Tensor:
        """Per-element weights of the slice [lo, hi) of the flat (padded) gradient of `params`."""
        key = (tuple(id(p) for p in params), padded, lo, hi, scale)
        hit = self._flat_cache.get(key)
        if hit is None:
            parts = [torch.full((p.numel(),), self.weight(p) * scale, dtype=torch.float64) for p in params]
            flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
            flat = torch.cat([flat, flat.new_zeros(max(0, padded - flat.numel()))])
            hit = self._flat_cache[key] = flat[lo:hi].clone()
        return hit

    def clip_params(self, params: Sequence[nn.Parameter], replicas: int) -> float:
        """Whole gradients, identical on `replicas` data-parallel copies (ZeRO-0)."""
        grads = [(p.grad, self.weight(p) / replicas) for p in params if p.grad is not None]
        local = sum((w * g.detach().double().pow(2).sum() for g, w in grads), torch.zeros((), dtype=torch.float64))
        return self._apply(local, [g for g, _ in grads])

    def clip_flat(self, shards: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Flat gradient shards with their per-element weights (ZeRO-1/2/3)."""
        local = torch.zeros((), dtype=torch.float64)
        for g, w in shards:
            local = local + (w.to(g.device) * g.detach().double().pow(2)).sum()
        return self._apply(local, [g for g, _ in shards])

    def _apply(self, local: torch.Tensor, grads: list[torch.Tensor]) -> float:
        norm = global_grad_norm(local, self.group)
        self.norms.append(norm)
        coef = clip_coefficient(norm, self.max_norm)
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
        return norm
