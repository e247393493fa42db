"""A user model for plait: `--model examples/models/tiny_mlp.py:make_model` (see the README).

The factory returns (module, sample_batch[, loss]). `sample_batch` is a FUNCTION, not a batch:
plait calls it for every micro-batch it needs, `sample_batch(batch, device="cpu", seed=0)`, and it
returns `(inputs: tuple, target: Tensor)`."""

from __future__ import annotations

import torch
from torch import nn


def make_model() -> tuple[nn.Module, object]:
    module = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))

    def sample_batch(batch: int, device: str = "cpu", seed: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, 32, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        return (x,), y  # integer targets: cross-entropy over the last dimension by default

    return module, sample_batch
