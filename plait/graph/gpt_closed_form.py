"""An OpGraph for the zoo's GPT written down from its shapes, without running the capture.

`plait.graph.capture` builds the OpGraph of any module by running it on the meta
device; that takes seconds per layer on a small CPU, too slow to simulate GPT-3 175B
(96 layers) in a benchmark loop. A GPT layer's per-sample costs follow from
(s, h, a, f, V) in closed form, so this module writes the same graph the capture
produces for ``plait.graph.zoo`` GPT -- the same layers (``embed``, ``layers.i``,
``head``), op names, targets, FLOPs, parameter bytes, saved bytes (Korthikanti et al.
2022: ``sbh(34 + 5as/h)`` per layer in 16-bit), output bytes and config -- op for op.
``tests/test_sim_gpt.py`` checks it against a real capture.

``autocast="bf16" | "fp16"`` writes the graph the capture records under autocast with CUDA's op
lists (``capture(autocast=..., autocast_rules="cuda")``, plait's engines' precision: fp32 master
parameters, every linear computing with a 16-bit copy of its weight and input): the residual
stream, LayerNorms, the softmax of unfused attention and the loss in fp32, the matmuls and what
they feed in 16-bit, and one cast op before each matmul per weight, bias and fp32 input.
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
    ab: int  # activation bytes of what the matmuls compute (16-bit under autocast)
    pb: int  # parameter bytes
    sdpa: bool  # attention through F.scaled_dot_product_attention
    rb: int = 0  # bytes of the residual stream, LayerNorms and loss (fp32 under autocast; 0: ab)
    autocast: bool = False  # the matmuls compute with cast copies of fp32 weights and inputs

    @property
    def sh(self) -> int:
        """Bytes of one [s, h] activation of the matmuls' dtype."""
        return self.s * self.h * self.ab

    @property
    def shr(self) -> int:
        """Bytes of one [s, h] activation of the residual stream."""
        return self.s * self.h * (self.rb or self.ab)

    @property
    def stats(self) -> int:
        """Bytes of a LayerNorm's mean and rstd (fp32)."""
        return 8 * self.s


_Add = Callable[..., str]


def gpt_opgraph(spec: str | dict[str, Any], dtype: str = "bf16", autocast: str | None = None) -> OpGraph:
    """OpGraph of the zoo GPT `spec` (per sample), as `plait.graph.capture` would record it:
    in `dtype`, or (`autocast` "bf16" / "fp16") fp32 under autocast to that dtype with CUDA's op
    lists, as ``capture(autocast=autocast, autocast_rules="cuda")``."""
    cfg = gpt_config(spec)
    sdpa = bool(cfg.get("sdpa"))
    L, h, a, s, V = cfg["layers"], cfg["hidden"], cfg["heads"], cfg["seq"], cfg["vocab"]
    f = cfg["ffn"]
    if autocast is not None and autocast not in ("bf16", "fp16"):
        raise ValueError(f"autocast: 'bf16', 'fp16' or None, got {autocast!r}")
    ab = _DTYPE[autocast or dtype]  # activation bytes of the matmuls
    pb = 4 if autocast else ab  # parameters in the model dtype, as the capture sees them
    d = _Dims(s=s, h=h, a=a, f=f, V=V, ab=ab, pb=pb, sdpa=sdpa, rb=pb if autocast else 0, autocast=bool(autocast))
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
                   tied=[TiedParams(layers[0].name, "head", V * h, tp_sharded=True)] if tied else [],
                   autocast=autocast or "", autocast_rules="cuda" if autocast else "",
                   autocast_params="fp32" if autocast else "")


def _embedding_layer(add: _Add, ops: dict[str, Op], d: _Dims) -> tuple[Layer, str]:
    """The token and position embeddings and their dropout; returns the layer and its output op."""
    s, h, V, pb, sh = d.s, d.h, d.V, d.pb, d.shr  # outside autocast's lists: the parameters' dtype
    lay = "embed"
    add(lay, "embed", "aten.arange.default", output_bytes=4.0 * s)
    tok = add(lay, "embed.tok", "aten.embedding.default", param_bytes=V * h * pb, saved_bytes=8.0 * s,
              output_bytes=sh)
    pos = add(lay, "embed.pos", "aten.embedding.default", param_bytes=s * h * pb, saved_bytes=4.0 * s,
              output_bytes=sh / 2)
    x = add(lay, "embed", "aten.add.Tensor", inputs=(tok, pos), output_bytes=sh)
    x = add(lay, "embed", "aten.clone.default", inputs=(x,), output_bytes=sh)
    x = add(lay, "embed.drop", "aten.native_dropout.default", inputs=(x,), saved_bytes=s * h,
            output_bytes=sh + s * h)
    emb_ops = [n for n in ops]
    layer = Layer(name=lay, kind="GPTEmbedding", ops=emb_ops, param_count=(V + s) * h,
                  param_bytes=(V + s) * h * pb, saved_bytes=8.0 * s + 4.0 * s + s * h,
                  input_bytes=8.0 * s, output_bytes=sh, tp_style="embedding")
    return layer, x


def _linear(add: _Add, lay: str, module: str, x: str, n_in: int, n_out: int, d: _Dims, *, bias: bool = True,
            target: str = "aten.addmm.default", cast_input: bool = False, saved: float | None = None,
            saved_tp: float = 0.0, param: bool = True) -> str:
    """A linear of `n_in` -> `n_out` features reading `x`; returns its matmul op. Under autocast it
    first casts its bias, its weight (each per forward: the capture's batch of 2 halves them per
    sample, as the position embedding) and, if `cast_input`, its fp32 input -- the weight copy saved
    for backward (`saved_cast_bytes`, per micro-batch). `saved`: the bytes it keeps (default its
    input); `param`: False for a weight first used elsewhere (the tied head)."""
    s, ab = d.s, d.ab
    if d.autocast:
        if bias:
            add(lay, module, "aten._to_copy.default", 0, output_bytes=n_out * ab / 2)
        add(lay, module, "aten._to_copy.default", int(bias), output_bytes=n_in * n_out * ab / 2)
        if cast_input:
            x = add(lay, module, "aten._to_copy.default", 1 + int(bias), inputs=(x,), output_bytes=s * n_in * ab)
    weights = n_in * n_out + (n_out if bias else 0)
    return add(lay, module, target, inputs=(x,), fwd_flops=2.0 * s * n_in * n_out, bwd_flops=4.0 * s * n_in * n_out,
               param_bytes=weights * d.pb if param else 0, saved_bytes=s * n_in * ab if saved is None else saved,
               saved_tp_bytes=saved_tp, saved_cast_bytes=n_in * n_out * ab if d.autocast else 0.0,
               output_bytes=s * n_out * ab)


def _layer_norm(add: _Add, lay: str, module: str, x: str, d: _Dims) -> str:
    """A LayerNorm over h features (fp32 under autocast: CUDA's fp32 list)."""
    return add(lay, module, "aten.native_layer_norm.default", inputs=(x,), param_bytes=2 * d.h * d.pb,
               saved_bytes=d.shr + d.stats, output_bytes=d.shr + d.stats)


def _transformer_layer(add: _Add, ops: dict[str, Op], d: _Dims, i: int, resid: str) -> tuple[Layer, str]:
    """Transformer block `i`, reading the residual stream `resid`; returns the layer and its output op."""
    s, h, a, f, ab, sh, shr = d.s, d.h, d.a, d.f, d.ab, d.sh, d.shr
    lay = f"layers.{i}"
    start = len(ops)
    p = f"layers.{i}"
    ln1 = _layer_norm(add, lay, f"{p}.ln1", resid, d)
    qkv = _linear(add, lay, f"{p}.attn.qkv", ln1, h, 3 * h, d, cast_input=True)
    core = f"{p}.attn.core"
    if d.sdpa:
        target, kw = _fused_attention(s, h, a, ab)
        ctx = add(lay, core, target, inputs=(qkv,), **kw)
        proj_saved = 0.0  # its input, the attention output, is already saved by the fused kernel
    else:
        ctx = _explicit_attention(add, lay, core, qkv, d)
        proj_saved = sh
    pr = _linear(add, lay, f"{p}.attn.proj", ctx, h, h, d, saved=proj_saved, saved_tp=proj_saved)
    pr = add(lay, f"{p}.attn.drop", "aten.native_dropout.default", inputs=(pr,), saved_bytes=s * h,
             output_bytes=sh + s * h)
    r1 = add(lay, p, "aten.add.Tensor", inputs=(resid, pr), output_bytes=shr)
    ln2 = _layer_norm(add, lay, f"{p}.ln2", r1, d)
    fc1 = _linear(add, lay, f"{p}.mlp.fc1", ln2, h, f, d, cast_input=True)
    act = add(lay, f"{p}.mlp.act", "aten.gelu.default", inputs=(fc1,), saved_bytes=s * f * ab,
              saved_tp_bytes=s * f * ab, output_bytes=s * f * ab)
    fc2 = _linear(add, lay, f"{p}.mlp.fc2", act, f, h, d, saved_tp=s * f * ab)
    d2 = add(lay, f"{p}.mlp.drop", "aten.native_dropout.default", inputs=(fc2,), saved_bytes=s * h,
             output_bytes=sh + s * h)
    resid = add(lay, p, "aten.add.Tensor", 1, inputs=(r1, d2), output_bytes=shr)
    names = list(ops)[start:]
    lops = [ops[n] for n in names]
    layer = Layer(
        name=lay, kind="TransformerBlock", ops=names,
        fwd_flops=sum(o.fwd_flops for o in lops), bwd_flops=sum(o.bwd_flops for o in lops),
        param_count=int(sum(o.param_bytes for o in lops) // d.pb), param_bytes=int(sum(o.param_bytes for o in lops)),
        saved_bytes=sum(o.saved_bytes for o in lops), saved_tp_bytes=sum(o.saved_tp_bytes for o in lops),
        saved_selective_bytes=sum(o.saved_selective_bytes for o in lops),
        saved_cast_bytes=sum(o.saved_cast_bytes for o in lops),
        input_bytes=shr, output_bytes=shr, tp_style="transformer")
    return layer, resid


def _head_layer(add: _Add, ops: dict[str, Op], d: _Dims, resid: str, n_out: int, tied: bool) -> Layer:
    """The final LayerNorm, the `n_out`-way projection (tied: the LM weight was first used by the
    embedding) and the loss (fp32 under autocast: the logits cast up first)."""
    s, h, ab, shr = d.s, d.h, d.ab, d.shr
    rb = d.rb or ab
    lay = "head"
    start = len(ops)
    x = add(lay, "head", "aten.clone.default", inputs=(resid,), output_bytes=shr)
    ln = _layer_norm(add, lay, "head.ln", x, d)
    lm = _linear(add, lay, "head.lm", ln, h, n_out, d, bias=False, target="aten.mm.default", cast_input=True,
                 param=not tied)
    if d.autocast:
        lm = add(lay, "", "aten._to_copy.default", inputs=(lm,), output_bytes=s * n_out * rb)
    ls = add(lay, "", "aten._log_softmax.default", inputs=(lm,), saved_bytes=s * n_out * rb, output_bytes=s * n_out * rb)
    add(lay, "", "aten.nll_loss_forward.default", inputs=(ls,), saved_bytes=8.0 * s + rb / 2, output_bytes=rb)  # targets + total weight
    names = list(ops)[start:]
    hops = [ops[n] for n in names]
    head_params = 2 * h + (0 if tied else n_out * h)
    return Layer(name=lay, kind="LMHead", ops=names, fwd_flops=sum(o.fwd_flops for o in hops),
                 bwd_flops=sum(o.bwd_flops for o in hops), param_count=head_params,
                 param_bytes=head_params * d.pb, saved_bytes=sum(o.saved_bytes for o in hops),
                 saved_cast_bytes=sum(o.saved_cast_bytes for o in hops),
                 input_bytes=shr, output_bytes=s * n_out * ab, tp_style="head")


def _explicit_attention(add: _Add, lay: str, core: str, qkv: str, d: _Dims) -> str:
    """The zoo's bmm-softmax-dropout-bmm attention: keeps the s x s probabilities (5as^2 per sample
    in 16-bit, Korthikanti et al. 2022; under autocast the softmax and its dropout in fp32, the
    probabilities cast back down for the second bmm)."""
    s, h, a, ab = d.s, d.h, d.a, d.ab
    sh, ass = d.sh, a * s * s
    sb = 4 if d.autocast else ab  # the softmax's dtype
    sc = add(lay, core, "aten.bmm.default", inputs=(qkv,), fwd_flops=2.0 * s * s * h, bwd_flops=4.0 * s * s * h,
             saved_bytes=3 * sh, saved_tp_bytes=3 * sh, output_bytes=ass * ab)
    sc = add(lay, core, "aten.mul.Tensor", inputs=(sc,), output_bytes=ass * ab)
    add(lay, core, "aten.full.default", output_bytes=s * s * ab / 2)
    add(lay, core, "aten.triu.default", output_bytes=s * s * ab / 2)
    sc = add(lay, core, "aten.add.Tensor", inputs=(sc,), output_bytes=ass * ab)
    if d.autocast:
        sc = add(lay, core, "aten._to_copy.default", inputs=(sc,), output_bytes=ass * sb)
    sm = add(lay, core, "aten._softmax.default", inputs=(sc,), saved_bytes=ass * sb,
             saved_tp_bytes=ass * sb, saved_selective_bytes=ass * sb, output_bytes=ass * sb)
    dr = add(lay, f"{core}.drop", "aten.native_dropout.default", inputs=(sm,), saved_bytes=ass,
             saved_tp_bytes=ass, saved_selective_bytes=ass, output_bytes=ass * (sb + 1))
    if d.autocast:
        dr = add(lay, core, "aten._to_copy.default", 1, inputs=(dr,), output_bytes=ass * ab)
    ctx = add(lay, core, "aten.bmm.default", 1, inputs=(dr, qkv), fwd_flops=2.0 * s * s * h,
              bwd_flops=4.0 * s * s * h, saved_bytes=ass * ab, saved_tp_bytes=ass * ab,
              saved_selective_bytes=ass * ab, output_bytes=sh)
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
