"""DLRM as GraphPipe configures it (Jeon et al. 2025, appendix; Naumov et al. 2019).

7 dense branches (each 4 feed-forward layers, hidden 4096, on its own dense feature vector)
and 7 sparse branches (an ``EmbeddingBag`` of 1M rows x 64, summing a bag of 100 ids),
concatenated, then a top MLP (hidden 4096) and one click logit. Layers:

    dense.i.0 -> ... -> dense.i.3 ─┐
    sparse.j ──────────────────────┼─> top.0 (concat + fc) -> top.1 .. top.{T-1} -> out

Inputs: ``dense_branches`` float tensors ``[b, dense_in]`` then ``sparse_branches`` id tensors
``[b, bag]``. Target: click labels in {0, 1}; loss: binary cross-entropy with logits.
The paper gives neither the dense input width nor the top depth: ``dense_in`` defaults to the
hidden size and ``top_layers`` to the dense depth (4).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.layers import FeedForward, Scalar, mlp_stack, mlp_stack_params
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register


class SparseBag(nn.Module):
    """``bag``: sum of the embeddings of a bag of ids (one sparse feature)."""

    plait_layer = "none"

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, mode="sum")

    def forward(self, ids: Tensor) -> Tensor:
        return self.bag(ids)


class DLRM(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.dense = nn.ModuleList(
            mlp_stack(cfg["dense_in"], h, cfg["dense_layers"]) for _ in range(cfg["dense_branches"])
        )
        self.sparse = nn.ModuleList(
            SparseBag(cfg["rows"], cfg["emb_dim"]) for _ in range(cfg["sparse_branches"])
        )
        merged = cfg["dense_branches"] * h + cfg["sparse_branches"] * cfg["emb_dim"]
        self.top = nn.ModuleList(
            FeedForward(merged if i == 0 else h, h) for i in range(cfg["top_layers"])
        )
        self.out = Scalar(h)

    def forward(self, *xs: Tensor) -> Tensor:
        # Index xs (no iteration over it) so torch.fx can trace the branch structure.
        branch_outs = []
        for i, branch in enumerate(self.dense):
            y = xs[i]
            for layer in branch:
                y = layer(y)
            branch_outs.append(y)
        n_dense = len(self.dense)
        for j, bag in enumerate(self.sparse):
            branch_outs.append(bag(xs[n_dense + j]))
        z = self.top[0](*branch_outs)
        for layer in self.top[1:]:
            z = layer(z)
        return self.out(z)


def dlrm_param_count(cfg: dict[str, Any]) -> int:
    h, nd, ns = cfg["hidden"], cfg["dense_branches"], cfg["sparse_branches"]
    dense = nd * mlp_stack_params(cfg["dense_in"], h, cfg["dense_layers"])
    sparse = ns * cfg["rows"] * cfg["emb_dim"]
    top = mlp_stack_params(nd * h + ns * cfg["emb_dim"], h, cfg["top_layers"])
    return dense + sparse + top + h + 1


def click_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype))


def make_dlrm(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["dense_in"] = cfg["dense_in"] or cfg["hidden"]
    for key in ("dense_layers", "hidden", "dense_in", "emb_dim", "bag", "rows", "top_layers"):
        if cfg[key] < 1:
            raise ModelSpecError(f"{key} must be >= 1, got {cfg[key]}")
    for key in ("dense_branches", "sparse_branches"):
        if cfg[key] < 0:
            raise ModelSpecError(f"{key} must be >= 0, got {cfg[key]}")
    if cfg["dense_branches"] + cfg["sparse_branches"] < 1:
        raise ModelSpecError("dense_branches + sparse_branches must be >= 1")
    cfg.update(family="dlrm", branches=cfg["dense_branches"] + cfg["sparse_branches"])
    nd, ns, d_in, bag, rows = cfg["dense_branches"], cfg["sparse_branches"], cfg["dense_in"], cfg["bag"], cfg["rows"]

    def make_batch(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor, ...], Tensor]:
        dense = [torch.randn(batch, d_in, generator=gen).to(dtype) for _ in range(nd)]
        sparse = [torch.randint(0, rows, (batch, bag), generator=gen) for _ in range(ns)]
        clicks = torch.randint(0, 2, (batch,), generator=gen).to(dtype)
        return (*dense, *sparse), clicks

    return ModelSpec(
        name="dlrm",
        config=cfg,
        construct=lambda: DLRM(cfg),
        make_batch=make_batch,
        loss_fn=click_loss,
        param_formula=lambda: dlrm_param_count(cfg),
        description="DLRM: dense MLP branches and embedding-bag branches, concatenated, top MLP",
    )


register(
    ModelEntry(
        name="dlrm",
        description="DLRM (GraphPipe): 7 dense branches x 4 FF (h=4096) + 7 EmbeddingBag(1M x 64, bag 100)",
        params={
            "dense_branches": Param(int, 7, "dense (MLP) branches"),
            "dense_layers": Param(int, 4, "feed-forward layers per dense branch"),
            "hidden": Param(int, 4096, "width of every feed-forward layer"),
            "dense_in": Param(int, None, "dense input features per branch (default hidden)"),
            "sparse_branches": Param(int, 7, "sparse (embedding-bag) branches"),
            "rows": Param(int, 1_000_000, "rows per embedding table"),
            "emb_dim": Param(int, 64, "embedding dimension"),
            "bag": Param(int, 100, "ids summed per sample per sparse feature"),
            "top_layers": Param(int, 4, "feed-forward layers after the concatenation"),
        },
        make=make_dlrm,
    )
)
