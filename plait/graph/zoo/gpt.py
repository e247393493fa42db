"""GPT, Megatron-LM style: learned positions, pre-LN blocks, LM head tied to the word embeddings.

Layers (OpGraph layers, in order): ``embed`` (embedding), ``layers.0 .. layers.{L-1}``
(transformer), ``head`` (final LN + LM head). Between layers activations are
``[s, b, h]``; inputs are token ids ``[b, s]`` and logits come out ``[b, s, vocab]``.

Parameters (tied head, ffn = 4h): ``12Lh^2 + 13Lh + (V + s)h + 2h``
(Narayanan et al. 2021, eq. 2 counts the same weights) -- 174.6e9 for GPT-3 175B.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.layers import (
    Dropout,
    RMSNorm,
    TransformerBlock,
    architecture,
    init_transformer,
    mark,
    transformer_block_params,
)
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register


class GPTEmbedding(nn.Module):
    """``embed.{tok, pos, drop}``: word + learned position embeddings, to ``[s, b, h]``, dropout."""

    plait_layer = "embedding"

    def __init__(self, vocab: int, seq: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = Dropout(dropout)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)  # [b, s, h]
        return self.drop(x.transpose(0, 1).contiguous())  # Megatron's [s, b, h]


class LMHead(nn.Module):
    """``head.{ln, lm}``: final norm and the vocabulary projection (column-parallel in Megatron)."""

    plait_layer = "head"

    def __init__(self, hidden: int, vocab: int, eps: float = 1e-5, norm: str = "layer") -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden, eps=eps) if norm == "layer" else RMSNorm(hidden, eps=eps)
        self.lm = mark(nn.Linear(hidden, vocab, bias=False), tp="column")

    def forward(self, x: Tensor) -> Tensor:
        # Transpose the h-wide hidden state, not the vocab-wide logits, back to batch-first.
        return self.lm(self.ln(x.transpose(0, 1).contiguous()))


class GPT(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.embed = GPTEmbedding(cfg["vocab"], cfg["seq"], h, cfg["dropout"])
        self.layers = nn.ModuleList(
            TransformerBlock(
                h,
                cfg["heads"],
                cfg["ffn"],
                dropout=cfg["dropout"],
                attn_dropout=cfg["attn_dropout"],
                causal=True,
                pre_ln=True,
                eps=cfg["eps"],
                sdpa=cfg["sdpa"],
            )
            for _ in range(cfg["layers"])
        )
        self.head = LMHead(h, cfg["vocab"], eps=cfg["eps"])
        if cfg["tie"]:
            self.head.lm.weight = self.embed.tok.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all tokens of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def token_batch(vocab: int, seq: int) -> Any:
    """Random token streams of length s+1: inputs are the first s tokens, targets the next ones."""

    def make(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor], Tensor]:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    return make


def check_transformer(cfg: dict[str, Any], keys: tuple[str, ...] = ("layers", "hidden", "heads", "seq", "vocab")) -> None:
    for key in (*keys, "ffn"):
        if cfg.get(key) is not None and cfg[key] < 1:
            raise ModelSpecError(f"{key} must be >= 1, got {cfg[key]}")
    if cfg["hidden"] % cfg["heads"]:
        raise ModelSpecError(f"hidden={cfg['hidden']} is not divisible by heads={cfg['heads']}")
    for key in ("dropout", "attn_dropout"):
        if key in cfg and not 0.0 <= cfg[key] < 1.0:
            raise ModelSpecError(f"{key} must be in [0, 1), got {cfg[key]}")


PARAMS = {
    "layers": Param(int, 24, "transformer layers"),
    "hidden": Param(int, 1024, "hidden size h"),
    "heads": Param(int, 16, "attention heads a"),
    "seq": Param(int, 1024, "sequence length s (learned positions)"),
    "vocab": Param(int, 50257, "vocabulary size V"),
    "ffn": Param(int, None, "MLP width (default 4h)"),
    "dropout": Param(float, 0.1, "hidden (residual, embedding) dropout"),
    "attn_dropout": Param(float, 0.1, "attention-probability dropout"),
    "tie": Param(bool, True, "LM head shares the word-embedding weights"),
    "sdpa": Param(bool, False, "use F.scaled_dot_product_attention (saves O(s) not O(s^2))"),
    "eps": Param(float, 1e-5, "LayerNorm epsilon"),
    "init_std": Param(float, 0.02, "weight init std (output linears / sqrt(2L))"),
}

# GPT-3 (Brown et al. 2020, table 2.1) shapes as Megatron-LM runs them (seq 2048). 1.3b uses
# 16 heads of 128 (the paper lists 24 heads with d_head 128, which does not multiply out);
# 13b uses hidden 5120 (paper: 5140, not divisible by 40 heads).
SIZES = {
    "350m": dict(layers=24, hidden=1024, heads=16, seq=2048),
    "1.3b": dict(layers=24, hidden=2048, heads=16, seq=2048),
    "2.7b": dict(layers=32, hidden=2560, heads=32, seq=2048),
    "6.7b": dict(layers=32, hidden=4096, heads=32, seq=2048),
    "13b": dict(layers=40, hidden=5120, heads=40, seq=2048),
    "175b": dict(layers=96, hidden=12288, heads=96, seq=2048),
}


def gpt_param_count(cfg: dict[str, Any]) -> int:
    h, v, s, L = cfg["hidden"], cfg["vocab"], cfg["seq"], cfg["layers"]
    head = 0 if cfg["tie"] else v * h
    return L * transformer_block_params(h, cfg["ffn"]) + (v + s) * h + 2 * h + head


def make_gpt(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["ffn"] = cfg["ffn"] or 4 * cfg["hidden"]
    check_transformer(cfg)
    cfg.update(family="gpt", causal=True, kv_heads=cfg["heads"], head_dim=cfg["hidden"] // cfg["heads"],
               **architecture("layernorm", "gelu", "learned", "pre", bias=True))
    return ModelSpec(
        name="gpt",
        config=cfg,
        construct=lambda: GPT(cfg),
        make_batch=token_batch(cfg["vocab"], cfg["seq"]),
        loss_fn=lm_loss,
        init=lambda m: init_transformer(m, cfg["init_std"], cfg["layers"]),
        param_formula=lambda: gpt_param_count(cfg),
        description="GPT (Megatron-LM): pre-LN, learned positions, tied LM head",
    )


register(
    ModelEntry(
        name="gpt",
        description="GPT, Megatron-LM style (default: 345M GPT-2 medium shape, seq 1024)",
        params=PARAMS,
        make=make_gpt,
        sizes=SIZES,
    )
)
