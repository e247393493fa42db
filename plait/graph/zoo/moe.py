"""BERT-MoE: BERT whose MLP in every ``moe_every``-th layer is a top-k mixture of experts (GShard).

Mixture-of-experts layer (Lepikhin et al. 2021, "GShard", section 2.2 and Algorithm 1), on
``[s, b, h]`` activations flattened to ``T = s b`` tokens:

* gating: ``softmax(x W_g)`` over ``E`` experts; the top ``k`` (default 2) experts of each token,
  their gate values renormalised to sum to 1;
* capacity ``C = ceil(capacity * k T / E)`` slots per expert; each (token, choice) takes the next
  free slot of its expert, first choices before second choices (a cumulative sum), and is dropped
  when its expert is full;
* dispatch and combine as dense einsums with a ``[T, E, C]`` one-hot tensor -- GShard's own
  formulation, static-shaped, so it captures on the meta device and every op has a sharding rule
  (sharding ``E`` is expert parallelism; moving from tokens-sharded to experts-sharded is the
  all-to-all of GShard);
* each expert is a GELU MLP ``h -> ffn -> h`` with biases, all experts' weights stacked
  ``[E, h, ffn]`` and ``[E, ffn, h]``.

Layers: as BERT (``embed``, ``layers.i``, ``head``); dense layers are "transformer" layers, MoE
layers ``plait_layer = "none"`` (Megatron tensor parallelism does not split them; the SPMD planner
shards them op by op). Parameters: BERT's, with each MoE layer's MLP ``2h f + f + h`` replaced by
``h E + E (2 h f + f + h)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.graph.zoo.bert import PARAMS as BERT_PARAMS
from plait.graph.zoo.bert import SIZES as BERT_SIZES
from plait.graph.zoo.bert import (
    BertEmbedding,
    MLMHead,
    bert_config,
    bert_param_count,
    mlm_batch,
    mlm_loss,
)
from plait.graph.zoo.layers import Attention, Dropout, TransformerBlock, init_transformer
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register


class MixtureOfExperts(nn.Module):
    """``moe.{gate, w1, b1, w2, b2, drop}``: GShard top-k gating, dense dispatch, stacked experts."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity: float,
                 dropout: float) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity = experts, top_k, capacity
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.b1 = nn.Parameter(torch.zeros(experts, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.b2 = nn.Parameter(torch.zeros(experts, hidden))
        self.drop = Dropout(dropout)

    def slots(self, tokens: int) -> int:
        """Capacity C of each expert for `tokens` tokens (GShard: capacity factor * k T / E)."""
        return max(1, math.ceil(self.capacity * self.top_k * tokens / self.experts))

    def forward(self, x: Tensor) -> Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        dispatch, combine = self.route(tokens)
        expert_in = torch.einsum("tec,th->ech", dispatch, tokens)
        hid = F.gelu(torch.einsum("ech,ehf->ecf", expert_in, self.w1) + self.b1.unsqueeze(1))
        out = torch.einsum("ecf,efh->ech", hid, self.w2) + self.b2.unsqueeze(1)
        y = torch.einsum("tec,ech->th", combine, out)
        return self.drop(y.reshape(s, b, h))

    def route(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``dispatch`` (0/1) and ``combine`` (gate weights) ``[T, E, C]``, GShard Algorithm 1."""
        t, e, k = tokens.shape[0], self.experts, self.top_k
        c = self.slots(t)
        probs = torch.softmax(self.gate(tokens), dim=-1)  # [T, E]
        top_p, top_i = probs.topk(k, dim=-1)  # [T, k]
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        # choice-major one-hot [k, T, E]: all first choices take slots before any second choice
        chosen = torch.zeros(k, t, e, dtype=tokens.dtype, device=tokens.device)
        chosen = chosen.scatter(2, top_i.t().unsqueeze(-1), 1.0)
        position = (chosen.reshape(k * t, e).cumsum(0).reshape(k, t, e) - 1.0) * chosen
        kept = chosen * (position < c).to(tokens.dtype)
        slot = torch.arange(c, device=tokens.device, dtype=tokens.dtype)
        one_hot = (position.unsqueeze(-1) == slot).to(tokens.dtype) * kept.unsqueeze(-1)  # [k,T,E,C]
        dispatch = one_hot.sum(0)
        combine = (one_hot * top_p.t().reshape(k, t, 1, 1)).sum(0)
        return dispatch, combine


class MoEBlock(TransformerBlock):
    """A post-LN BERT layer whose MLP is a mixture of experts: ``ln1(x + attn(x))``, ``ln2(. + moe(.))``."""

    plait_layer = "none"

    def __init__(self, cfg: dict[str, Any]) -> None:
        nn.Module.__init__(self)
        h = cfg["hidden"]
        self.pre_ln = False
        self.ln1 = nn.LayerNorm(h, eps=cfg["eps"])
        self.attn = Attention(h, cfg["heads"], cfg["dropout"], cfg["attn_dropout"], False, cfg["sdpa"])
        self.ln2 = nn.LayerNorm(h, eps=cfg["eps"])
        self.mlp = MixtureOfExperts(h, cfg["ffn"], cfg["experts"], cfg["top_k"], cfg["capacity"],
                                    cfg["dropout"])


class BertMoE(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.embed = BertEmbedding(cfg["vocab"], cfg["seq"], cfg["type_vocab"], h, cfg["eps"], cfg["dropout"])
        self.layers = nn.ModuleList(
            MoEBlock(cfg) if is_moe_layer(i, cfg["moe_every"]) else
            TransformerBlock(h, cfg["heads"], cfg["ffn"], dropout=cfg["dropout"],
                             attn_dropout=cfg["attn_dropout"], causal=False, pre_ln=False,
                             eps=cfg["eps"], sdpa=cfg["sdpa"])
            for i in range(cfg["layers"])
        )
        self.head = MLMHead(h, cfg["vocab"], cfg["eps"])
        self.head.decoder.weight = self.embed.tok.weight

    def forward(self, ids: Tensor, types: Tensor) -> Tensor:
        x = self.embed(ids, types)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def is_moe_layer(index: int, every: int) -> bool:
    """GShard puts an MoE layer in every other layer: layers every-1, 2 every-1, ... (1-based: every)."""
    return index % every == every - 1


@torch.no_grad()
def init_bert_moe(model: nn.Module, std: float, layers: int) -> None:
    init_transformer(model, std, layers)
    out_std = std / math.sqrt(2.0 * max(layers, 1))
    for module in model.modules():
        if isinstance(module, MixtureOfExperts):
            module.w1.normal_(0.0, std)
            module.w2.normal_(0.0, out_std)
            module.b1.zero_()
            module.b2.zero_()


def bert_moe_param_count(cfg: dict[str, Any]) -> int:
    h, f, e = cfg["hidden"], cfg["ffn"], cfg["experts"]
    moe_layers = sum(is_moe_layer(i, cfg["moe_every"]) for i in range(cfg["layers"]))
    dense_mlp = 2 * h * f + f + h
    moe = h * e + e * (2 * h * f + f + h)
    return bert_param_count(cfg) + moe_layers * (moe - dense_mlp)


def make_bert_moe(cfg: dict[str, Any]) -> ModelSpec:
    cfg = bert_config(cfg, "bert_moe", ("experts", "moe_every"))
    if not 1 <= cfg["top_k"] <= cfg["experts"]:
        raise ModelSpecError(f"top_k must be in [1, experts={cfg['experts']}], got {cfg['top_k']}")
    if cfg["capacity"] <= 0:
        raise ModelSpecError(f"capacity must be > 0, got {cfg['capacity']}")
    return ModelSpec(
        name="bert_moe",
        config=cfg,
        construct=lambda: BertMoE(cfg),
        make_batch=mlm_batch(cfg["vocab"], cfg["seq"], cfg["mask_prob"]),
        loss_fn=mlm_loss,
        init=lambda m: init_bert_moe(m, cfg["init_std"], cfg["layers"]),
        param_formula=lambda: bert_moe_param_count(cfg),
        description="BERT with a GShard top-k mixture of experts in every moe_every-th layer",
    )


register(
    ModelEntry(
        name="bert_moe",
        description="BERT-MoE: bert-base with a top-2 MoE MLP in every other layer (experts=8)",
        params={
            **BERT_PARAMS,
            "experts": Param(int, 8, "experts per MoE layer E"),
            "top_k": Param(int, 2, "experts per token (GShard: 2)"),
            "capacity": Param(float, 1.25, "capacity factor: slots per expert = factor * k T / E"),
            "moe_every": Param(int, 2, "an MoE layer every this many layers (GShard: 2)"),
        },
        make=make_bert_moe,
        sizes=BERT_SIZES,
    )
)
