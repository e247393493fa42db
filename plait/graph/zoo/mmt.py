"""Multi-modal transformer (MMT), the multi-branch model of GraphPipe (Jeon et al. 2025, appendix).

Paper configuration: 4 branches x 8 transformer layers, sequence 256, hidden 1024, 16 heads,
FFN 4096. Each branch has its own input (a modality's feature sequence ``[b, s, in_dim]``),
its own input projection + learned positions, and its own stack of encoder blocks; the
branches meet only in the head, which mean-pools each branch over the sequence,
concatenates, normalises and classifies. So the OpGraph's layer DAG has ``branches``
independent chains joined at ``head``:

    branches.i.embed -> branches.i.layers.0 -> ... -> branches.i.layers.{L-1} -> head

Blocks are the same Megatron blocks as GPT (pre-LN, bidirectional), ``[s, b, h]`` between layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.gpt import check_transformer
from plait.graph.zoo.layers import (
    Dropout,
    TransformerBlock,
    architecture,
    init_transformer,
    transformer_block_params,
)
from plait.graph.zoo.registry import ModelEntry, ModelSpec, Param, register


class BranchEmbedding(nn.Module):
    """``proj`` (modality features -> hidden) + learned positions, dropout, to ``[s, b, h]``."""

    plait_layer = "none"

    def __init__(self, in_dim: int, seq: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        x = self.proj(x) + self.pos(positions)
        return self.drop(x.transpose(0, 1).contiguous())


class Branch(nn.Module):
    """A container (not a layer): its ``embed`` and each of its ``layers`` are OpGraph layers."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.embed = BranchEmbedding(cfg["in_dim"], cfg["seq"], h, cfg["dropout"])
        self.layers = nn.ModuleList(
            TransformerBlock(
                h,
                cfg["heads"],
                cfg["ffn"],
                dropout=cfg["dropout"],
                attn_dropout=cfg["attn_dropout"],
                causal=False,
                pre_ln=True,
                sdpa=cfg["sdpa"],
            )
            for _ in range(cfg["layers"])
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


class MergeHead(nn.Module):
    """Joins the branches: mean over the sequence per branch, concat, LayerNorm, fc1, GELU, fc2."""

    plait_layer = "none"

    def __init__(self, branches: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(branches * hidden)
        self.fc1 = nn.Linear(branches * hidden, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, *xs: Tensor) -> Tensor:
        pooled = torch.cat([x.mean(dim=0) for x in xs], dim=-1)  # each x: [s, b, h]
        return self.fc2(F.gelu(self.fc1(self.ln(pooled))))


class MMT(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(Branch(cfg) for _ in range(cfg["branches"]))
        self.head = MergeHead(cfg["branches"], cfg["hidden"], cfg["classes"])

    def forward(self, *xs: Tensor) -> Tensor:
        # Index xs (no iteration over it) so torch.fx can trace the branch structure.
        outs = [branch(xs[i]) for i, branch in enumerate(self.branches)]
        return self.head(*outs)


def mmt_param_count(cfg: dict[str, Any]) -> int:
    h, B = cfg["hidden"], cfg["branches"]
    branch = (cfg["in_dim"] + 1) * h + cfg["seq"] * h + cfg["layers"] * transformer_block_params(h, cfg["ffn"])
    head = 2 * B * h + (B * h + 1) * h + (h + 1) * cfg["classes"]
    return B * branch + head


def make_mmt(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["ffn"] = cfg["ffn"] or 4 * cfg["hidden"]
    cfg["in_dim"] = cfg["in_dim"] or cfg["hidden"]
    check_transformer(cfg, ("layers", "hidden", "heads", "seq", "branches", "in_dim", "classes"))
    # "layers" counts one branch's blocks; "transformer_layers" all of them.
    cfg.update(
        family="mmt",
        causal=False,
        kv_heads=cfg["heads"],
        head_dim=cfg["hidden"] // cfg["heads"],
        transformer_layers=cfg["branches"] * cfg["layers"],
        **architecture("layernorm", "gelu", "learned", "pre", bias=True),
    )
    B, s, d, classes = cfg["branches"], cfg["seq"], cfg["in_dim"], cfg["classes"]

    def make_batch(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor, ...], Tensor]:
        xs = tuple(torch.randn(batch, s, d, generator=gen).to(dtype) for _ in range(B))
        return xs, torch.randint(0, classes, (batch,), generator=gen)

    return ModelSpec(
        name="mmt",
        config=cfg,
        construct=lambda: MMT(cfg),
        make_batch=make_batch,
        loss_fn=F.cross_entropy,
        init=lambda m: init_transformer(m, cfg["init_std"], cfg["layers"]),
        param_formula=lambda: mmt_param_count(cfg),
        description="multi-modal transformer: parallel transformer branches merged in the head",
    )


register(
    ModelEntry(
        name="mmt",
        description="multi-modal transformer (GraphPipe): 4 branches x 8 layers, s=256, h=1024, 16 heads",
        params={
            "branches": Param(int, 4, "parallel branches (modalities), each with its own input"),
            "layers": Param(int, 8, "transformer layers per branch"),
            "seq": Param(int, 256, "sequence length per branch"),
            "hidden": Param(int, 1024, "hidden size h"),
            "heads": Param(int, 16, "attention heads"),
            "ffn": Param(int, None, "MLP width (default 4h = 4096)"),
            "in_dim": Param(int, None, "input feature size per position (default h)"),
            "classes": Param(int, 1000, "output classes"),
            "dropout": Param(float, 0.1, "hidden dropout"),
            "attn_dropout": Param(float, 0.1, "attention dropout"),
            "sdpa": Param(bool, False, "use F.scaled_dot_product_attention"),
            "init_std": Param(float, 0.02, "weight init std"),
        },
        make=make_mmt,
    )
)
