"""Building blocks shared by the zoo models, written the way Megatron-LM writes them.

Why Megatron's way: the capture reads the bytes autograd saves for backward, and
the memory estimator checks them against Korthikanti et al. (2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.1). A GPT layer
saves ``sbh(34 + 5as/h)`` bytes in fp16 with dropout:

* attention: LN input 2sbh, QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b,
  softmax-dropout mask as^2b, dropout output 2as^2b, V 2sbh, proj input 2sbh,
  residual-dropout mask sbh;
* MLP: LN input 2sbh, fc1 input 2sbh, GELU input 8sbh, fc2 input 8sbh, dropout mask sbh.

Under tensor parallelism 10sbh of it stays replicated (the two LN inputs, the QKV
and fc1 inputs and the two residual-dropout masks); the rest lives in tensors made
by column-parallel linears or between a column- and a row-parallel linear, which
is what the markers below tell the capture. Selective recompute drops the 5as^2b
made and saved inside the attention core.

To save exactly those tensors:

* activations between transformer layers are laid out ``[s, b, h]`` (Megatron's
  layout), so Q, K and V are *views* of the QKV output that ``bmm`` consumes
  directly -- no hidden copies appear in the saved set;
* dropout calls ``torch.native_dropout``, which saves a 1-byte bool mask on every
  device (``F.dropout`` on CPU and meta saves a mask in the input dtype);
* the causal mask is added as a bias (``add`` saves nothing) instead of
  ``masked_fill`` (which would save the mask);
* attention is explicit ``bmm``/``softmax`` math; ``sdpa=True`` switches to
  ``F.scaled_dot_product_attention`` (flash-style, saves O(s) not O(s^2)).

Module markers (plain attributes the capture and the runtime read; see
docs/DESIGN.md, "Contracts between rooms"):

* ``plait_layer``: this module is one OpGraph layer, value = its TP style;
* ``plait_tp``: ``"column"`` / ``"row"`` Megatron linears, ``"sharded"`` regions
  between them whose tensors tensor parallelism splits;
* ``plait_selective``: the attention core, dropped by selective recompute.

Tensor-parallel friendliness: the attention cores infer the number of local heads
from the width of their input, and the QKV (and GQA KV) output features are
ordered ``(head, {q,k,v}, head_dim)`` as in Megatron-LM, so a contiguous column
shard of ``attn.qkv`` holds whole heads and the core runs unchanged on a shard.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ------------------------------------------------------------------------ architecture
# The architecture facts every transformer in the zoo states in its config (and the exports to
# other frameworks read: Megatron-LM's --normalization, --swiglu, --position-embedding-type, ...).
ARCHITECTURE_FIELDS = {
    "norm": ("layernorm", "rmsnorm"),  # the normalisation layers
    "activation": ("gelu", "swiglu"),  # the MLP: fc1-GELU-fc2, or SwiGLU's gate/up/down
    "position": ("learned", "rope"),  # learned absolute position embeddings, or rotary
    "norm_position": ("pre", "post"),  # x + f(norm(x)) (GPT, LLaMA), or norm(x + f(x)) (BERT)
    "bias": (True, False),  # the transformer's linears carry biases
}


def architecture(norm: str, activation: str, position: str, norm_position: str, bias: bool) -> dict[str, object]:
    """The architecture fields of a zoo config (`ARCHITECTURE_FIELDS`), checked."""
    out: dict[str, object] = {"norm": norm, "activation": activation, "position": position,
                              "norm_position": norm_position, "bias": bias}
    for key, value in out.items():
        if value not in ARCHITECTURE_FIELDS[key]:
            raise ValueError(f"architecture field {key}={value!r}: use one of {ARCHITECTURE_FIELDS[key]}")
    return out


# ----------------------------------------------------------------------------- markers


def mark(module: nn.Module, **markers: object) -> nn.Module:
    """Set plait markers (``plait_tp="column"``, ...) as plain attributes and return the module."""
    for key, value in markers.items():
        setattr(module, f"plait_{key}", value)
    return module


def column_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """Megatron ColumnParallelLinear: output features split across tensor ranks."""
    return mark(nn.Linear(in_features, out_features, bias=bias), tp="column")  # type: ignore[return-value]


def row_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """Megatron RowParallelLinear: input features split, partial outputs all-reduced."""
    return mark(nn.Linear(in_features, out_features, bias=bias), tp="row")  # type: ignore[return-value]


# ----------------------------------------------------------------------------- dropout


class Dropout(nn.Dropout):
    """nn.Dropout that saves a bool mask (1 byte/element) on every device, like CUDA's fused kernel.

    ``F.dropout`` on CPU and meta multiplies by a noise tensor of the input dtype and
    saves that, which would make the capture see 2-4 bytes per mask element instead
    of Korthikanti's 1.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        return torch.native_dropout(x, self.p, True)[0]


# ----------------------------------------------------------------------------- attention cores


def causal_bias(s: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[s, s] additive mask, -inf above the diagonal. Added (``add`` saves nothing for backward)."""
    return torch.full((s, s), float("-inf"), device=device, dtype=dtype).triu(1)


class SelfAttentionCore(nn.Module):
    """Everything between the QKV linear's output and the output projection's input.

    Input ``qkv``: ``[s, b, heads_local * 3 * head_dim]`` with features ordered
    ``(head, {q,k,v}, head_dim)``. Output: ``[s, b, heads_local * head_dim]``.
    Saves (explicit path) Q, K, V as views of ``qkv`` plus softmax output, dropout
    mask and dropout output: ``6sbh + 5as^2b`` bytes in fp16.
    """

    plait_tp = "sharded"
    plait_selective = True

    def __init__(self, head_dim: int, causal: bool, dropout: float, sdpa: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.causal = causal
        self.sdpa = sdpa
        self.drop = Dropout(dropout)

    def forward(self, qkv: Tensor) -> Tensor:
        s, b, width = qkv.shape
        d = self.head_dim
        heads = width // (3 * d)
        # [s, b*a, 3d] is a view because b and a are adjacent in [s, b, h] (why Megatron is seq-first).
        q, k, v = qkv.view(s, b * heads, 3 * d).split(d, dim=-1)
        ctx = attend(q, k, v, self.causal, self.drop, self.sdpa)  # [b*a, s, d]
        return ctx.transpose(0, 1).reshape(s, b, heads * d)


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool, drop: Dropout, sdpa: bool) -> Tensor:
    """softmax(Q K^T / sqrt(d) [+ causal]) -> dropout -> . V  on ``[s, B, d]`` views; returns ``[B, s, d]``."""
    s, _, d = q.shape
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [B, s, d] views
    if sdpa:
        p = drop.p if drop.training else 0.0
        # The fused kernels (flash, memory-efficient) take only 4-D inputs; 3-D ones fall back to
        # the math path, which keeps the s x s probabilities (measured on an H100: 1.5x the memory
        # and 2-3x the step time of 4-D). [1, B, s, d] is a view and the same attention.
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                             dropout_p=p, is_causal=causal)
        return out.squeeze(0)
    scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))  # [B, s, s]; saves Q, K
    if causal:
        scores = scores + causal_bias(s, scores.device, scores.dtype)
    probs = torch.softmax(scores, dim=-1)  # saves its output: 2as^2b
    probs = drop(probs)  # saves a bool mask: as^2b
    return torch.bmm(probs, v)  # saves dropout output 2as^2b and V


class RMSNorm(nn.RMSNorm):
    """torch's `nn.RMSNorm` (Zhang & Sennrich 2019; same parameter, still an `nn.RMSNorm` to any
    code that asks) computed as LLaMA's reference code and transformers compute it: the
    statistics in fp32, the weight applied to the result cast back to the input's dtype, so the
    backward keeps that product's input at the activation dtype (torch's own keeps it in fp32
    under a bf16 model: 2 extra bytes per element per norm)."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__(hidden, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        eps = self.eps if self.eps is not None else torch.finfo(h.dtype).eps  # nn.RMSNorm's default
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * h.to(x.dtype)


class GQAttentionCore(nn.Module):
    """Grouped-query attention core with rotary embeddings (LLaMA).

    Inputs: ``q`` ``[s, b, heads_local * d]`` and ``kv`` ``[s, b, kv_heads_local * 2 * d]``
    (features ``(kv_head, {k,v}, d)``, so column shards hold whole KV heads). With SDPA in
    fp16/bf16 the flash kernel reads each KV head for its query group (``enable_gqa``, as
    transformers and Megatron's Transformer Engine path do: K and V saved at kv_heads width);
    in fp32 (no fused GQA kernel on CUDA) and on the explicit path K and V are repeated to the
    query heads as Megatron's non-flash path does.
    """

    plait_tp = "sharded"
    plait_selective = True

    def __init__(self, head_dim: int, rope_base: float = 10000.0, sdpa: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_base = rope_base
        self.sdpa = sdpa
        self.drop = Dropout(0.0)

    def forward(self, q: Tensor, kv: Tensor) -> Tensor:
        s, b, _ = q.shape
        d = self.head_dim
        heads = q.shape[-1] // d
        kv_heads = kv.shape[-1] // (2 * d)
        k, v = kv.view(s, b, kv_heads, 2 * d).split(d, dim=-1)
        cos, sin = rotary_tables(s, d, self.rope_base, q.device, q.dtype)
        q = apply_rotary(q.view(s, b, heads, d), cos, sin)
        k = apply_rotary(k, cos, sin)
        rep = heads // kv_heads
        if self.sdpa and rep > 1 and q.dtype in (torch.float16, torch.bfloat16):
            # [b, heads, s, d] queries over [b, kv_heads, s, d] keys and values: the flash kernel
            # takes GQA in half precision; in fp32 CUDA's memory-efficient kernel does not (GQA
            # there falls back to the math path's s x s probabilities), so fp32 repeats K and V.
            p = self.drop.p if self.drop.training else 0.0
            out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                 v.permute(1, 2, 0, 3), dropout_p=p, is_causal=True,
                                                 enable_gqa=True)
            return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        if rep > 1:  # query head i reads KV head i // rep
            k = k.unsqueeze(3).expand(s, b, kv_heads, rep, d)
            v = v.unsqueeze(3).expand(s, b, kv_heads, rep, d)
        k = k.reshape(s, b * heads, d)
        v = v.reshape(s, b * heads, d)
        ctx = attend(q.reshape(s, b * heads, d), k, v, True, self.drop, self.sdpa)
        return ctx.transpose(0, 1).reshape(s, b, heads * d)


def rotary_tables(s: int, d: int, base: float, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[s, 1, 1, d]`` for rotary embeddings (Su et al. 2021), GPT-NeoX half-rotation."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- transformer blocks


class Attention(nn.Module):
    """``attn.{qkv, core, proj, drop}``: column QKV, sharded core, row projection, residual dropout."""

    def __init__(
        self, hidden: int, heads: int, dropout: float, attn_dropout: float, causal: bool, sdpa: bool
    ) -> None:
        super().__init__()
        self.qkv = column_linear(hidden, 3 * hidden)
        self.core = SelfAttentionCore(hidden // heads, causal, attn_dropout, sdpa)
        self.proj = row_linear(hidden, hidden)
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(self.core(self.qkv(x))))


class MLP(nn.Module):
    """``mlp.{fc1, act, fc2, drop}``: column fc1, sharded GELU, row fc2, residual dropout."""

    def __init__(self, hidden: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = column_linear(hidden, ffn)
        self.act = mark(nn.GELU(), tp="sharded")
        self.fc2 = row_linear(ffn, hidden)
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class TransformerBlock(nn.Module):
    """One transformer layer on ``[s, b, h]``; pre-LN (GPT, Megatron) or post-LN (BERT).

    Pre-LN:  x + attn(ln1(x)), then + mlp(ln2(.)).  Post-LN: ln1(x + attn(x)), ln2(. + mlp(.)).
    """

    plait_layer = "transformer"

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int,
        dropout: float = 0.1,
        attn_dropout: float = 0.1,
        causal: bool = True,
        pre_ln: bool = True,
        eps: float = 1e-5,
        sdpa: bool = False,
    ) -> None:
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads, dropout, attn_dropout, causal, sdpa)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, ffn, dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


def transformer_block_params(hidden: int, ffn: int) -> int:
    """QKV 3h^2+3h, proj h^2+h, fc1 h*f+f, fc2 f*h+h, two LNs 4h  (= 12h^2 + 13h when f = 4h)."""
    return 4 * hidden * hidden + 2 * hidden * ffn + ffn + 9 * hidden


# ----------------------------------------------------------------------------- init


@torch.no_grad()
def init_transformer(model: nn.Module, std: float, layers: int) -> None:
    """Megatron-LM init: N(0, std) weights, zero biases, row-parallel (output) linears N(0, std/sqrt(2L))."""
    out_std = std / math.sqrt(2.0 * max(layers, 1))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            tp = getattr(module, "plait_tp", None)
            module.weight.normal_(0.0, out_std if tp == "row" else std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding | nn.EmbeddingBag):
            module.weight.normal_(0.0, std)


# ----------------------------------------------------------------------------- feed-forward layers


class FeedForward(nn.Module):
    """One fully connected layer + ReLU; ``*xs`` are concatenated first (the merge of branches)."""

    plait_layer = "none"

    def __init__(self, in_features: int, out_features: int, relu: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.relu = relu

    def forward(self, *xs: Tensor) -> Tensor:
        x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=-1)
        x = self.fc(x)
        return F.relu(x) if self.relu else x


class Scalar(nn.Module):
    """Final Linear(h, 1) producing one value per sample (``[b]``)."""

    plait_layer = "none"

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x).squeeze(-1)


def mlp_stack(in_features: int, hidden: int, layers: int) -> nn.ModuleList:
    """``layers`` FeedForward layers: in -> hidden -> ... -> hidden (each one OpGraph layer)."""
    return nn.ModuleList(FeedForward(in_features if i == 0 else hidden, hidden) for i in range(layers))


def mlp_stack_params(in_features: int, hidden: int, layers: int) -> int:
    return (in_features + 1) * hidden + (layers - 1) * (hidden + 1) * hidden
