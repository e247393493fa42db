"""LLaMA-style decoder: RMSNorm, SwiGLU MLP, grouped-query attention with rotary positions, untied head.

Layers: ``embed`` (embedding), ``layers.i`` (transformer), ``head`` (RMSNorm + LM head).
Block submodules: ``ln1, attn.{q, kv, core, proj}, ln2, mlp.{gate, up, act, down}`` with
``q, kv, gate, up`` column-parallel, ``proj, down`` row-parallel, ``core`` and ``act`` sharded.
No biases, no dropout (as LLaMA). Activations between layers are ``[s, b, h]``.

Parameters: per layer ``2h^2 + 2h*kv*d + 3h*f + 2h`` (q and proj h^2 each, K and V h*kv*d each,
gate/up/down h*f each, two RMSNorm weights), plus ``Vh`` embedding, ``h`` final norm and ``Vh``
untied head -- 6,738,415,616 for LLaMA-2-7B.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.gpt import LMHead, check_transformer, lm_loss, token_batch
from plait.graph.zoo.layers import (
    GQAttentionCore,
    RMSNorm,
    architecture,
    column_linear,
    init_transformer,
    row_linear,
)
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register


class TokenEmbedding(nn.Module):
    """``embed.tok``: word embeddings only (positions are rotary, inside attention), to ``[s, b, h]``."""

    plait_layer = "embedding"

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)

    def forward(self, ids: Tensor) -> Tensor:
        return self.tok(ids).transpose(0, 1).contiguous()


class GQAttention(nn.Module):
    """``attn.{q, kv, core, proj}``: KV projection holds ``kv_heads`` heads, shared by ``heads/kv_heads`` queries."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_base: float, sdpa: bool) -> None:
        super().__init__()
        d = hidden // heads
        self.q = column_linear(hidden, heads * d, bias=False)
        self.kv = column_linear(hidden, 2 * kv_heads * d, bias=False)
        self.core = GQAttentionCore(d, rope_base, sdpa)
        self.proj = row_linear(heads * d, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.core(self.q(x), self.kv(x)))


class SwiGLU(nn.Module):
    """silu(gate) * up (Shazeer 2020); the region between the column and row linears."""

    plait_tp = "sharded"

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    """``mlp.{gate, up, act, down}``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = column_linear(hidden, ffn, bias=False)
        self.up = column_linear(hidden, ffn, bias=False)
        self.act = SwiGLU()
        self.down = row_linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


class LlamaBlock(nn.Module):
    plait_layer = "transformer"

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.ln1 = RMSNorm(h, eps=cfg["eps"])
        self.attn = GQAttention(h, cfg["heads"], cfg["kv_heads"], cfg["rope_base"], cfg["sdpa"])
        self.ln2 = RMSNorm(h, eps=cfg["eps"])
        self.mlp = GatedMLP(h, cfg["ffn"])

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Llama(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed = TokenEmbedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg["layers"]))
        self.head = LMHead(cfg["hidden"], cfg["vocab"], eps=cfg["eps"], norm="rms")
        if cfg["tie"]:
            self.head.lm.weight = self.embed.tok.weight

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


PARAMS = {
    "layers": Param(int, 32, "transformer layers"),
    "hidden": Param(int, 4096, "hidden size h"),
    "heads": Param(int, 32, "query heads a"),
    "kv_heads": Param(int, None, "key/value heads (grouped-query attention; default = heads)"),
    "seq": Param(int, 4096, "sequence length s"),
    "vocab": Param(int, 32000, "vocabulary size V"),
    "ffn": Param(int, None, "SwiGLU width (default: 8h/3 rounded up to a multiple of 256)"),
    "tie": Param(bool, False, "LM head shares the embedding weights"),
    "rope_base": Param(float, 10000.0, "rotary embedding base"),
    # LLaMA training runs fused attention (flash / SDPA; Touvron et al. 2023 use xformers' memory-efficient
    # kernel), never the explicit s x s softmax: at seq 8192 the explicit path predicts a 2.8x slower step.
    "sdpa": Param(bool, True, "use F.scaled_dot_product_attention (false: explicit bmm-softmax-bmm)"),
    "eps": Param(float, 1e-5, "RMSNorm epsilon"),
    "init_std": Param(float, 0.02, "weight init std"),
}

# Touvron et al. 2023 (LLaMA-2, table 1 / model cards); 1b is LLaMA-3.2-1B's shape with LLaMA-2's vocab.
SIZES = {
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192),
    "7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008),
    "13b": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824),
    "70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672),
}


def llama_param_count(cfg: dict[str, Any]) -> int:
    h, f, v, L = cfg["hidden"], cfg["ffn"], cfg["vocab"], cfg["layers"]
    kv_width = cfg["kv_heads"] * (h // cfg["heads"])
    per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * f + 2 * h
    return L * per_layer + v * h + h + (0 if cfg["tie"] else v * h)


def make_llama(cfg: dict[str, Any]) -> ModelSpec:
    cfg = dict(cfg)
    cfg["kv_heads"] = cfg["kv_heads"] or cfg["heads"]
    cfg["ffn"] = cfg["ffn"] or 256 * -(-(8 * cfg["hidden"] // 3) // 256)
    check_transformer(cfg)
    if cfg["kv_heads"] < 1 or cfg["heads"] % cfg["kv_heads"]:
        raise ModelSpecError(f"heads={cfg['heads']} is not a multiple of kv_heads={cfg['kv_heads']}")
    if (cfg["hidden"] // cfg["heads"]) % 2:
        raise ModelSpecError(f"head size hidden/heads={cfg['hidden'] // cfg['heads']} must be even for rotary embeddings")
    cfg.update(family="llama", causal=True, head_dim=cfg["hidden"] // cfg["heads"], dropout=0.0,
               **architecture("rmsnorm", "swiglu", "rope", "pre", bias=False))
    return ModelSpec(
        name="llama",
        config=cfg,
        construct=lambda: Llama(cfg),
        make_batch=token_batch(cfg["vocab"], cfg["seq"]),
        loss_fn=lm_loss,
        init=lambda m: init_transformer(m, cfg["init_std"], cfg["layers"]),
        param_formula=lambda: llama_param_count(cfg),
        description="LLaMA-style decoder: RMSNorm, SwiGLU, GQA, rotary, untied head",
    )


register(
    ModelEntry(
        name="llama",
        description="LLaMA-style decoder (default: LLaMA-2-7B shape)",
        params=PARAMS,
        make=make_llama,
        sizes=SIZES,
    )
)
