"""CANDLE-Uno as GraphPipe configures it (Jeon et al. 2025, appendix; Xia et al. 2018).

7 feature branches (cell-line and drug feature sets), each 4 feed-forward layers of hidden
4096 on its own input, concatenated, then a top MLP (hidden 4096) and one regression
output (drug response). Layers:

    branches.i.0 -> ... -> branches.i.3 ─┐  (i = 0..6)
                                         ├─> top.0 (concat + fc) -> top.1 .. -> out

Inputs: ``branches`` float tensors ``[b, in_dim]``; target ``[b]``; loss: mean squared error.
The paper gives neither the input widths nor the top depth: ``in_dim`` defaults to the hidden
size and ``top_layers`` to the branch depth (4).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.layers import FeedForward, Scalar, mlp_stack, mlp_stack_params
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register


class CandleUno(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.branches = nn.ModuleList(
            mlp_stack(cfg["in_dim"], h, cfg["branch_layers"]) for _ in range(cfg["branches"])
        )
        self.top = nn.ModuleList(
            FeedForward(cfg["branches"] * h if i == 0 else h, h) for i in range(cfg["top_layers"])
        )
        self.out = Scalar(h)

    def forward(self, *xs: Tensor) -> Tensor:
        outs = []
        for i, branch in enumerate(self.branches):  # index xs so torch.fx can trace it
            y = xs[i]
            for layer in branch:
                y = layer(y)
            outs.append(y)
        z = self.top[0](*outs)
        for layer in self.top[1:]:
            z = layer(z)
        return self.out(z)


def uno_param_count(cfg: dict[str, Any]) -> int:
    h, B = cfg["hidden"], cfg["branches"]
    branches = B * mlp_stack_params(cfg["in_dim"], h, cfg["branch_layers"])
    return branches + mlp_stack_params(B * h, h, cfg["top_layers"]) + h + 1


def make_uno(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["in_dim"] = cfg["in_dim"] or cfg["hidden"]
    for key in ("branches", "branch_layers", "hidden", "in_dim", "top_layers"):
        if cfg[key] < 1:
            raise ModelSpecError(f"{key} must be >= 1, got {cfg[key]}")
    cfg.update(family="candle_uno", layers=cfg["branch_layers"])
    B, d_in = cfg["branches"], cfg["in_dim"]

    def make_batch(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor, ...], Tensor]:
        xs = tuple(torch.randn(batch, d_in, generator=gen).to(dtype) for _ in range(B))
        return xs, torch.randn(batch, generator=gen).to(dtype)

    return ModelSpec(
        name="candle_uno",
        config=cfg,
        construct=lambda: CandleUno(cfg),
        make_batch=make_batch,
        loss_fn=lambda out, target: F.mse_loss(out, target.to(out.dtype)),
        param_formula=lambda: uno_param_count(cfg),
        description="CANDLE-Uno: parallel feed-forward feature branches, concatenated, top MLP",
    )


register(
    ModelEntry(
        name="candle_uno",
        description="CANDLE-Uno (GraphPipe): 7 branches x 4 feed-forward layers, hidden 4096",
        params={
            "branches": Param(int, 7, "feature branches, each with its own input"),
            "branch_layers": Param(int, 4, "feed-forward layers per branch"),
            "hidden": Param(int, 4096, "width of every feed-forward layer"),
            "in_dim": Param(int, None, "input features per branch (default hidden)"),
            "top_layers": Param(int, 4, "feed-forward layers after the concatenation"),
        },
        make=make_uno,
    )
)
