"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"), ViT-B/16 by default.

Layers: ``embed`` (a ``patch`` x ``patch`` convolution with stride ``patch`` cutting the image into
``(image/patch)^2`` tokens, a learned class token prepended, learned position embeddings added,
dropout), ``layers.i`` (pre-LN transformer blocks, bidirectional, GELU MLP of width 4h -- the same
Megatron-style block as GPT, so tensor parallelism shards it), ``head`` (final LayerNorm, the class
token, a linear classifier). Activations between layers are ``[s, b, h]`` with ``s = 1 + (image/patch)^2``.

Parameters: ``3 p^2 h + h`` (patch conv) ``+ h`` (class token) ``+ s h`` (positions)
``+ L (12h^2 + 13h) + 2h`` (final LN) ``+ h C + C`` (classifier): 86,567,656 for ViT-B/16 at 224
pixels and 1000 classes, as torchvision's ``vit_b_16``.
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
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register


class PatchEmbedding(nn.Module):
    """``embed.{proj, cls, pos, drop}``: image ``[b, 3, H, W]`` -> tokens ``[s, b, h]``."""

    plait_layer = "none"

    def __init__(self, image: int, patch: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, hidden, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.zeros(1, tokens, hidden))
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)  # [b, n, h]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.drop(x.transpose(0, 1).contiguous())  # [s, b, h]


class ClassTokenHead(nn.Module):
    """``head.{ln, fc}``: final LayerNorm, then the class token's logits."""

    plait_layer = "none"

    def __init__(self, hidden: int, classes: int, eps: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=eps)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.ln(x[0]))  # x[0]: the class token of every sample, [b, h]


class ViT(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.embed = PatchEmbedding(cfg["image"], cfg["patch"], h, cfg["dropout"])
        self.layers = nn.ModuleList(
            TransformerBlock(h, cfg["heads"], cfg["ffn"], dropout=cfg["dropout"],
                             attn_dropout=cfg["attn_dropout"], causal=False, pre_ln=True,
                             eps=cfg["eps"], sdpa=cfg["sdpa"])
            for _ in range(cfg["layers"])
        )
        self.head = ClassTokenHead(h, cfg["classes"], cfg["eps"])

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@torch.no_grad()
def init_vit(model: nn.Module, std: float, layers: int) -> None:
    """Megatron-style init of the blocks and classifier; class token and positions N(0, std)."""
    init_transformer(model, std, layers)
    for module in model.modules():
        if isinstance(module, PatchEmbedding):
            module.cls.normal_(0.0, std)
            module.pos.normal_(0.0, std)


def vit_param_count(cfg: dict[str, Any]) -> int:
    h, p, c = cfg["hidden"], cfg["patch"], cfg["classes"]
    tokens = (cfg["image"] // p) ** 2 + 1
    embed = 3 * p * p * h + h + h + tokens * h
    return embed + cfg["layers"] * transformer_block_params(h, cfg["ffn"]) + 2 * h + h * c + c


def image_batch(image: int, classes: int) -> Any:
    def make(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor], Tensor]:
        x = torch.randn(batch, 3, image, image, generator=gen).to(dtype)
        return (x,), torch.randint(0, classes, (batch,), generator=gen)

    return make


def make_vit(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["ffn"] = cfg["ffn"] or 4 * cfg["hidden"]
    check_transformer(cfg, ("layers", "hidden", "heads", "patch", "image", "classes"))
    if cfg["image"] % cfg["patch"]:
        raise ModelSpecError(f"image={cfg['image']} must be a multiple of patch={cfg['patch']}")
    seq = (cfg["image"] // cfg["patch"]) ** 2 + 1
    cfg.update(family="vit", causal=False, seq=seq, kv_heads=cfg["heads"],
               head_dim=cfg["hidden"] // cfg["heads"], **architecture("layernorm", "gelu", "learned", "pre", bias=True))
    return ModelSpec(
        name="vit",
        config=cfg,
        construct=lambda: ViT(cfg),
        make_batch=image_batch(cfg["image"], cfg["classes"]),
        loss_fn=F.cross_entropy,
        init=lambda m: init_vit(m, cfg["init_std"], cfg["layers"]),
        param_formula=lambda: vit_param_count(cfg),
        description="Vision Transformer, pre-LN blocks, class-token classifier",
    )


register(
    ModelEntry(
        name="vit",
        description="Vision Transformer (default ViT-B/16, 224x224, 1000 classes; size=large for ViT-L/16)",
        params={
            "layers": Param(int, 12, "transformer layers"),
            "hidden": Param(int, 768, "hidden size h"),
            "heads": Param(int, 12, "attention heads"),
            "patch": Param(int, 16, "patch side in pixels"),
            "image": Param(int, 224, "input image side in pixels"),
            "classes": Param(int, 1000, "output classes"),
            "ffn": Param(int, None, "MLP width (default 4h)"),
            "dropout": Param(float, 0.0, "hidden dropout (ViT's ImageNet-21k pre-training uses 0.1)"),
            "attn_dropout": Param(float, 0.0, "attention-probability dropout"),
            "sdpa": Param(bool, False, "use F.scaled_dot_product_attention"),
            "eps": Param(float, 1e-6, "LayerNorm epsilon"),
            "init_std": Param(float, 0.02, "weight init std"),
        },
        make=make_vit,
        sizes={
            "base": dict(layers=12, hidden=768, heads=12),
            "large": dict(layers=24, hidden=1024, heads=16),
        },
    )
)
