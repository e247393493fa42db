"""An OpGraph for the zoo's GPT written down from its shapes, without running the capture.

`plait.graph.capture` builds the OpGraph of any module by running it on the meta
device; that takes seconds per layer on a small CPU, too slow to simulate GPT-3 175B
(96 layers) in a benchmark loop. A GPT layer's per-sample costs follow from
(s, h, a, f, V) in closed form, so this module writes the same graph the capture
produces for ``plait.graph.zoo`` GPT -- the same layers (``embed``, ``layers.i``,
``head``), op names, targets, FLOPs, parameter bytes, saved bytes (Korthikanti et al.
2022: ``sbh(34 + 5as/h)`` per layer in 16-bit), output bytes and config -- op for op.
``tests/test_sim_gpt.py`` checks it against a real capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.ir.opgraph import Layer, Op, OpGraph, TiedParams

_DTYPE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def gpt_config(spec: str | dict[str, Any]) -> dict[str, Any]:
    """The zoo's GPT config for a spec string (``gpt:layers=24,hidden=1024``) or a dict."""
    if isinstance(spec, dict):
        cfg = dict(spec)
        cfg.setdefault("family", "gpt")
        cfg.setdefault("ffn", None)
        cfg["ffn"] = cfg["ffn"] or 4 * cfg["hidden"]
        cfg.setdefault("tie", True)
        cfg.setdefault("sdpa", False)
        cfg.setdefault("causal", True)
        cfg.setdefault("kv_heads", cfg["heads"])
        cfg.setdefault("head_dim", cfg["hidden"] // cfg["heads"])
        cfg.setdefault("vocab", 50257)
        return cfg
    from plait.graph.zoo import load_model

    model = load_model(spec)
    if model.config.get("family") != "gpt":
        raise ValueError(f"{spec!r} is not a GPT (family {model.config.get('family')!r})")
    return dict(model.config)


@dataclass(frozen=True)
class _Dims:
    """A GPT's sizes, as the closed form reads them."""

    s: int  # sequence length
    h: int  # hidden size
    a: int  # attention heads
    f: int  # MLP hidden size
    V: int  # vocabulary
    ab: int  # activation bytes
    pb: int  # parameter bytes
    sdpa: bool  # attention through F.scaled_dot_product_attention

    @property
    def sh(self) -> int:
        """Bytes of one [s, h] activation."""
        return self.s * self.h * self.ab

    @property
    def stats(self) -> int:
        """Bytes of a LayerNorm's mean and rstd (fp32)."""
        return 8 * self.s


_Add = Callable[..., str]


def gpt_opgraph(spec: str | dict[str, Any], dtype: str = "bf16") -> OpGraph:
    """OpGraph of the zoo GPT `spec` (per sample), as `plait.graph.capture` would record it."""
    cfg = gpt_config(spec)
    sdpa = bool(cfg.get("sdpa"))
    L, h, a, s, V = cfg["layers"], cfg["hidden"], cfg["heads"], cfg["seq"], cfg["vocab"]
    f = cfg["ffn"]
    ab = _DTYPE[dtype]  # activation bytes
    pb = ab  # parameters in the model dtype, as the capture sees them
    d = _Dims(s=s, h=h, a=a, f=f, V=V, ab=ab, pb=pb, sdpa=sdpa)
    ops: dict[str, Op] = {}

    def add(layer: str, module: str, target: str, idx: int = 0, inputs: tuple[str, ...] = (), **kw: float) -> str:
        name = f"{module or '<root>'}/{target.split('.')[0]}.{target.split('.')[1]}#{idx}"
        ops[name] = Op(name=name, target=target, layer=layer, module=module, inputs=list(inputs), **kw)
        return name

    embed, resid = _embedding_layer(add, ops, d)
    layers: list[Layer] = [embed]
    for i in range(L):
        layer, resid = _transformer_layer(add, ops, d, i, resid)
        layers.append(layer)
    # `head_out`: a classifier of that many outputs (e.g. BERT's sequence classification) instead of
    # the vocabulary projection; its weight is its own
    n_out = int(cfg.get("head_out") or V)
    tied = bool(cfg.get("tie", True)) and n_out == V
    layers.append(_head_layer(add, ops, d, resid, n_out, tied))
    edges = [(a_.name, b_.name) for a_, b_ in zip(layers, layers[1:])]
    return OpGraph(model="gpt", ops=ops, layers=layers, layer_edges=edges, param_dtype_bytes=pb,
                   activation_dtype_bytes=ab, capture_batch=1, config=cfg,
                   tied=[TiedParams(layers[0].name, "head", V * h, tp_sharded=True)] if tied else [])


def _embedding_layer(add: _Add, ops: dict[str, Op], d: _Dims) -> tuple[Layer, str]:
    """The token and position embeddings and their dropout; returns the layer and its output op."""
    s, h, V, pb, sh = d.s, d.h, d.V, d.pb, d.sh
    lay = "embed"
    add(lay, "embed", "aten.arange.default", output_bytes=4.0 * s)
    tok = add(lay, "embed.tok", "aten.embedding.default", param_bytes=V * h * pb, saved_bytes=8.0 * s,
              output_bytes=sh)
    add(lay, "embed.pos", "aten.embedding.default", param_bytes=s * h * pb, saved_bytes=4.0 * s,
        output_bytes=sh / 2)
    x = add(lay, "embed", "aten.add.Tensor", inputs=(tok,), output_bytes=sh)
    x = add(lay, "embed", "aten.clone.default", inputs=(x,), output_bytes=sh)
    x = add(lay, "embed.drop", "aten.native_dropout.default", inputs=(x,), saved_bytes=s * h,
            output_bytes=sh + s * h)
    emb_ops = [n for n in ops]
    layer = Layer(name=lay, kind="GPTEmbedding", ops=emb_ops, param_count=(V + s) * h,
                  param_bytes=(V + s) * h * pb, saved_bytes=8.0 * s + 4.0 * s + s * h,
                  input_bytes=8.0 * s, output_bytes=sh, tp_style="embedding")
    return layer, x


def _transformer_layer(add: _Add, ops: dict[str, Op], d: _Dims, i: int, resid: str) -> tuple[Layer, str]:
    """Transformer block `i`, reading the residual stream `resid`; returns the layer and its output op."""
    s, h, a, f, ab, pb, sh, stats = d.s, d.h, d.a, d.f, d.ab, d.pb, d.sh, d.stats
    lay = f"layers.{i}"
    start = len(ops)
    p = f"layers.{i}"
    ln1 = add(lay, f"{p}.ln1", "aten.native_layer_norm.default", inputs=(resid,), param_bytes=2 * h * pb,
              saved_bytes=sh + stats, output_bytes=sh + stats)
    qkv = add(lay, f"{p}.attn.qkv", "aten.addmm.default", inputs=(ln1,), fwd_flops=2.0 * s * h * 3 * h,
              bwd_flops=4.0 * s * h * 3 * h, param_bytes=(3 * h * h + 3 * h) * pb, saved_bytes=sh,
              output_bytes=3 * sh)
    core = f"{p}.attn.core"
    if d.sdpa:
        target, kw = _fused_attention(s, h, a, ab)
        ctx = add(lay, core, target, inputs=(qkv,), **kw)
        proj_saved = 0.0  # its input, the attention output, is already saved by the fused kernel
    else:
        ctx = _explicit_attention(add, lay, core, qkv, s, h, a, ab)
        proj_saved = sh
    pr = add(lay, f"{p}.attn.proj", "aten.addmm.default", inputs=(ctx,), fwd_flops=2.0 * s * h * h,
             bwd_flops=4.0 * s * h * h, param_bytes=(h * h + h) * pb, saved_bytes=proj_saved,
             saved_tp_bytes=proj_saved, output_bytes=sh)
    pr = add(lay, f"{p}.attn.drop", "aten.native_dropout.default", inputs=(pr,), saved_bytes=s * h,
             output_bytes=sh + s * h)
    r1 = add(lay, p, "aten.add.Tensor", inputs=(resid, pr), output_bytes=sh)
    ln2 = add(lay, f"{p}.ln2", "aten.native_layer_norm.default", inputs=(r1,), param_bytes=2 * h * pb,
              saved_bytes=sh + stats, output_bytes=sh + stats)
    fc1 = add(lay, f"{p}.mlp.fc1", "aten.addmm.default", inputs=(ln2,), fwd_flops=2.0 * s * h * f,
              bwd_flops=4.0 * s * h * f, param_bytes=(h * f + f) * pb, saved_bytes=sh, output_bytes=s * f * ab)
    act = add(lay, f"{p}.mlp.act", "aten.gelu.default", inputs=(fc1,), saved_bytes=s * f * ab,
              saved_tp_bytes=s * f * ab, output_bytes=s * f * ab)
    fc2 = add(lay, f"{p}.mlp.fc2", "aten.addmm.default", inputs=(act,), fwd_flops=2.0 * s * f * h,
              bwd_flops=4.0 * s * f * h, param_bytes=(f * h + h) * pb, saved_bytes=s * f * ab,
              saved_tp_bytes=s * f * ab, output_bytes=sh)
    d2 = add(lay, f"{p}.mlp.drop", "aten.native_dropout.default", inputs=(fc2,), saved_bytes=s * h,
             output_bytes=sh + s * h)
    resid = add(lay, p, "aten.add.Tensor", 1, inputs=(r1, d2), output_bytes=sh)
    names = list(ops)[start:]
    lops = [ops[n] for n in names]
    layer = Layer(
        name=lay, kind="TransformerBlock", ops=names,
        fwd_flops=sum(o.fwd_flops for o in lops), bwd_flops=sum(o.bwd_flops for o in lops),
        param_count=int(sum(o.param_bytes for o in lops) // pb), param_bytes=int(sum(o.param_bytes for o in lops)),
        saved_bytes=sum(o.saved_bytes for o in lops), saved_tp_bytes=sum(o.saved_tp_bytes for o in lops),
        saved_selective_bytes=sum(o.saved_selective_bytes for o in lops),
        input_bytes=sh, output_bytes=sh, tp_style="transformer")
    return layer, resid


def _head_layer(add: _Add, ops: dict[str, Op], d: _Dims, resid: str, n_out: int, tied: bool) -> Layer:
    """The final LayerNorm, the `n_out`-way projection (tied: the LM weight was first used by the
    embedding) and the loss."""
    s, h, ab, pb, sh, stats = d.s, d.h, d.ab, d.pb, d.sh, d.stats
    lay = "head"
    start = len(ops)
    x = add(lay, "head", "aten.clone.default", inputs=(resid,), output_bytes=sh)
    ln = add(lay, "head.ln", "aten.native_layer_norm.default", inputs=(x,), param_bytes=2 * h * pb,
             saved_bytes=sh + stats, output_bytes=sh + stats)
    lm = add(lay, "head.lm", "aten.mm.default", inputs=(ln,), fwd_flops=2.0 * s * h * n_out, bwd_flops=4.0 * s * h * n_out,
             param_bytes=0 if tied else n_out * h * pb, saved_bytes=sh, output_bytes=s * n_out * ab)
    ls = add(lay, "", "aten._log_softmax.default", inputs=(lm,), saved_bytes=s * n_out * ab, output_bytes=s * n_out * ab)
    add(lay, "", "aten.nll_loss_forward.default", inputs=(ls,), saved_bytes=8.0 * s + ab / 2, output_bytes=ab)  # targets + total weight
    names = list(ops)[start:]
    hops = [ops[n] for n in names]
    head_params = 2 * h + (0 if tied else n_out * h)
    return Layer(name=lay, kind="LMHead", ops=names, fwd_flops=sum(o.fwd_flops for o in hops),
                 bwd_flops=sum(o.bwd_flops for o in hops), param_count=head_params,
                 param_bytes=head_params * pb, saved_bytes=sum(o.saved_bytes for o in hops),
                 input_bytes=sh, output_bytes=s * n_out * ab, tp_style="head")


def _explicit_attention(add, lay: str, core: str, qkv: str, s: int, h: int, a: int, ab: int) -> str:
    """The zoo's bmm-softmax-dropout-bmm attention: keeps the s x s probabilities (5as^2 per sample
    in 16-bit, Korthikanti et al. 2022)."""
    sh = s * h * ab
    sc = add(lay, core, "aten.bmm.default", inputs=(qkv,), fwd_flops=2.0 * s * s * h, bwd_flops=4.0 * s * s * h,
             saved_bytes=3 * sh, saved_tp_bytes=3 * sh, output_bytes=a * s * s * ab)
    sc = add(lay, core, "aten.mul.Tensor", inputs=(sc,), output_bytes=a * s * s * ab)
    add(lay, core, "aten.full.default", output_bytes=s * s * ab / 2)
    add(lay, core, "aten.triu.default", output_bytes=s * s * ab / 2)
    sc = add(lay, core, "aten.add.Tensor", inputs=(sc,), output_bytes=a * s * s * ab)
    sm = add(lay, core, "aten._softmax.default", inputs=(sc,), saved_bytes=a * s * s * ab,
             saved_tp_bytes=a * s * s * ab, saved_selective_bytes=a * s * s * ab, output_bytes=a * s * s * ab)
    dr = add(lay, f"{core}.drop", "aten.native_dropout.default", inputs=(sm,), saved_bytes=a * s * s,
             saved_tp_bytes=a * s * s, saved_selective_bytes=a * s * s, output_bytes=a * s * s * (ab + 1))
    ctx = add(lay, core, "aten.bmm.default", 1, inputs=(dr, qkv), fwd_flops=2.0 * s * s * h,
              bwd_flops=4.0 * s * s * h, saved_bytes=a * s * s * ab, saved_tp_bytes=a * s * s * ab,
              saved_selective_bytes=a * s * s * ab, output_bytes=sh)
    return add(lay, core, "aten.clone.default", inputs=(ctx,), output_bytes=sh)


def _fused_attention(s: int, h: int, a: int, ab: int) -> tuple[str, dict[str, float]]:
    """``F.scaled_dot_product_attention`` as the capture records CUDA's fused kernel
    (`plait.graph.capture._CudaKernels`): flash attention in 16-bit, memory-efficient attention in
    fp32. It saves Q, K, V, the output and the fp32 log-sum-exp -- O(s) per head, no s x s matrix
    (Dao et al. 2022, FlashAttention, sec. 3.1) -- plus the dropout RNG state; the log-sum-exp of the
    memory-efficient kernel is padded to 32 rows. FLOPs: 4 s^2 h forward, 2.5x that backward (no
    causal discount, as torch's flop counter reports them)."""
    sh = s * h * ab
    if ab == 2:
        target, lse, rng = "aten._scaled_dot_product_flash_attention.default", 4.0 * a * s, 12.0
    else:
        target, lse, rng = "aten._scaled_dot_product_efficient_attention.default", 4.0 * a * (-(-s // 32) * 32), 8.0
    saved = 4 * sh + lse + rng
    return target, dict(fwd_flops=4.0 * s * s * h, bwd_flops=10.0 * s * s * h, saved_bytes=saved,
                        saved_tp_bytes=saved, saved_selective_bytes=lse + rng, output_bytes=sh + lse + rng)
