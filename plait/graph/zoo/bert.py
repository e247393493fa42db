"""BERT encoder (Devlin et al. 2019) with its masked-LM head, Megatron-style blocks in post-LN order.

Layers: ``embed`` (word + position + token-type embeddings, LayerNorm, dropout; embedding),
``layers.i`` (transformer, post-LN: ``ln1(x + attn(x))``, ``ln2(. + mlp(.))``, bidirectional),
``head`` (MLM transform ``dense -> GELU -> LayerNorm`` and a decoder tied to the word embeddings,
with its own bias). No next-sentence head. Inputs: token ids and token types ``[b, s]``.
With ``classes=N`` the head is instead a sequence classifier, as HuggingFace's
BertForSequenceClassification: the pooler (``dense -> tanh`` on the first token), dropout and a
linear to N logits, trained by cross-entropy on one label per sample.

Parameters: ``12Lh^2 + 13Lh + (V + s + types)h + 2h`` (embeddings + their LN) ``+ h^2 + 3h + V``
(MLM head) -- 109,514,298 for bert-base, as HuggingFace's BertForMaskedLM.
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
    mark,
    transformer_block_params,
)
from plait.graph.zoo.registry import ModelEntry, ModelSpec, ModelSpecError, Param, register

IGNORE = -100  # target of unmasked positions (F.cross_entropy's default ignore_index)


class BertEmbedding(nn.Module):
    """``embed.{tok, pos, segment, ln, drop}`` (``segment``: token-type embeddings)."""

    plait_layer = "embedding"

    def __init__(self, vocab: int, seq: int, types: int, hidden: int, eps: float, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.segment = nn.Embedding(types, hidden)
        self.ln = nn.LayerNorm(hidden, eps=eps)
        self.drop = Dropout(dropout)

    def forward(self, ids: Tensor, types: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions) + self.segment(types)
        return self.drop(self.ln(x.transpose(0, 1).contiguous()))


class MLMHead(nn.Module):
    """``head.{dense, act, ln, decoder}``: the BERT prediction-head transform, then vocabulary logits."""

    plait_layer = "head"

    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.ln = nn.LayerNorm(hidden, eps=eps)
        self.decoder = mark(nn.Linear(hidden, vocab), tp="column")

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln(self.act(self.dense(x.transpose(0, 1).contiguous())))
        return self.decoder(x)  # [b, s, V]


class ClassifierHead(nn.Module):
    """``head.{pooler, drop, classifier}``: the [CLS] token pooled (dense, tanh), then the class logits."""

    plait_layer = "head"

    def __init__(self, hidden: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.drop = Dropout(dropout)
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.drop(torch.tanh(self.pooler(x[0]))))  # x: [s, b, h] -> [b, classes]


class Bert(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden"]
        self.embed = BertEmbedding(cfg["vocab"], cfg["seq"], cfg["type_vocab"], h, cfg["eps"], cfg["dropout"])
        self.layers = nn.ModuleList(
            TransformerBlock(
                h,
                cfg["heads"],
                cfg["ffn"],
                dropout=cfg["dropout"],
                attn_dropout=cfg["attn_dropout"],
                causal=False,
                pre_ln=False,
                eps=cfg["eps"],
                sdpa=cfg["sdpa"],
            )
            for _ in range(cfg["layers"])
        )
        self.head: nn.Module
        if cfg["classes"]:
            self.head = ClassifierHead(h, cfg["classes"], cfg["dropout"])
        else:
            self.head = MLMHead(h, cfg["vocab"], cfg["eps"])
            self.head.decoder.weight = self.embed.tok.weight

    def forward(self, ids: Tensor, types: Tensor) -> Tensor:
        x = self.embed(ids, types)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over the masked positions only (mean over them)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE)


def class_batch(vocab: int, seq: int, classes: int) -> Any:
    """Random sentence pairs, one class label per sample."""

    def make(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor, Tensor], Tensor]:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
        return (ids, types), torch.randint(0, classes, (batch,), generator=gen)

    return make


def mlm_batch(vocab: int, seq: int, mask_prob: float) -> Any:
    """Random sentence pairs; ``round(mask_prob * s)`` (>= 1) positions per sample become [MASK].

    [MASK] is id 103 (bert-base-uncased) when the vocabulary has it, else the last id.
    """
    mask_id = 103 if vocab > 103 else vocab - 1
    n_mask = max(1, round(mask_prob * seq))

    def make(batch: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple[Tensor, Tensor], Tensor]:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
        masked = torch.rand(batch, seq, generator=gen).argsort(dim=1)[:, :n_mask]
        target = torch.full_like(ids, IGNORE)
        target.scatter_(1, masked, ids.gather(1, masked))
        ids = ids.scatter(1, masked, mask_id)
        return (ids, types), target

    return make


PARAMS = {
    "layers": Param(int, 12, "transformer layers"),
    "hidden": Param(int, 768, "hidden size h"),
    "heads": Param(int, 12, "attention heads a"),
    "seq": Param(int, 512, "sequence length s"),
    "vocab": Param(int, 30522, "vocabulary size V"),
    "type_vocab": Param(int, 2, "token types (segments)"),
    "ffn": Param(int, None, "MLP width (default 4h)"),
    "dropout": Param(float, 0.1, "hidden dropout"),
    "attn_dropout": Param(float, 0.1, "attention-probability dropout"),
    "mask_prob": Param(float, 0.15, "fraction of tokens masked per sample"),
    "sdpa": Param(bool, False, "use F.scaled_dot_product_attention"),
    "eps": Param(float, 1e-12, "LayerNorm epsilon"),
    "init_std": Param(float, 0.02, "weight init std"),
    "classes": Param(int, 0, "a sequence classifier of this many classes instead of the MLM head (0: MLM)"),
}

SIZES = {
    "base": dict(layers=12, hidden=768, heads=12),
    "large": dict(layers=24, hidden=1024, heads=16),
}


def bert_param_count(cfg: dict[str, Any]) -> int:
    h, v = cfg["hidden"], cfg["vocab"]
    embed = (v + cfg["seq"] + cfg["type_vocab"]) * h + 2 * h
    head = h * h + h + 2 * h + v  # dense, LN, decoder bias (decoder weight tied)
    if cfg.get("classes"):  # pooler, classifier
        head = h * h + h + (h + 1) * cfg["classes"]
    return cfg["layers"] * transformer_block_params(h, cfg["ffn"]) + embed + head


def bert_config(cfg: dict[str, Any], family: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A checked BERT-shaped config (the MLP width defaults to 4 h; `extra`: more integer keys to
    check), with the attention facts every BERT-family model sets."""
    cfg = dict(cfg)
    cfg["ffn"] = cfg["ffn"] or 4 * cfg["hidden"]
    check_transformer(cfg, ("layers", "hidden", "heads", "seq", "vocab", "type_vocab", *extra))
    if not 0.0 < cfg["mask_prob"] <= 1.0:
        raise ModelSpecError(f"mask_prob must be in (0, 1], got {cfg['mask_prob']}")
    if cfg.get("classes", 0) < 0:
        raise ModelSpecError(f"classes must be >= 0, got {cfg['classes']}")
    cfg.update(family=family, causal=False, kv_heads=cfg["heads"], head_dim=cfg["hidden"] // cfg["heads"], tie=True,
               **architecture("layernorm", "gelu", "learned", "post", bias=True))
    return cfg


def make_bert(cfg: dict[str, Any]) -> ModelSpec:
    cfg = bert_config(cfg, "bert")
    return ModelSpec(
        name="bert",
        config=cfg,
        construct=lambda: Bert(cfg),
        make_batch=class_batch(cfg["vocab"], cfg["seq"], cfg["classes"]) if cfg["classes"]
        else mlm_batch(cfg["vocab"], cfg["seq"], cfg["mask_prob"]),
        loss_fn=F.cross_entropy if cfg["classes"] else mlm_loss,
        init=lambda m: init_transformer(m, cfg["init_std"], cfg["layers"]),
        param_formula=lambda: bert_param_count(cfg),
        description="BERT encoder, post-LN, " + (f"a {cfg['classes']}-class sequence classifier" if cfg["classes"]
                                                  else "masked-LM head tied to the word embeddings"),
    )


register(
    ModelEntry(
        name="bert",
        description="BERT encoder with MLM head (default: bert-base; size=large)",
        params=PARAMS,
        make=make_bert,
        sizes=SIZES,
    )
)
