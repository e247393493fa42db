"""Attention as SDPA / flash vs explicit in the analytic model: the kernel's time against a hand
computation, the activations it keeps (no s x s term) and the LLaMA default (issue 37)."""

from __future__ import annotations

import pytest

from plait.cluster.catalog import GPU_KINDS
from plait.cost.compute import (
    DEFAULT_MODEL,
    TransformerShape,
    flash_attention_time,
    transformer_layer_cost,
)
from plait.cost.memory import activation_bytes_per_layer
from plait.graph.gpt_closed_form import gpt_opgraph
from plait.ir.plan import Plan

A100 = GPU_KINDS["a100-80gb"]
H100 = GPU_KINDS["h100-80gb"]
HBM = 2039e9 * 0.899  # A100 80GB datasheet bandwidth x the shipped memory efficiency


def test_flash_forward_time_by_hand() -> None:
    # 1 sample, 2 heads, 256 tokens, d = 64, not causal, bf16, forward. 2 x 2 blocks of 128.
    t, flops = flash_attention_time(1, 2, 256, 256, 64, False, A100, "bf16", DEFAULT_MODEL, backward=False)
    work = 4 * 2 * 256 * 256 * 64  # QK^T and PV: 2 s^2 d each, per head
    # 4 thread blocks (2 heads x 2 query blocks) on 108 SMs: one wave 4/108 full; 2 key blocks per
    # query block against 2 blocks' worth of per-block overhead: half the long-sequence rate (0.73).
    eff = 0.73 * (2 / 4) * (4 / 108)
    compute = work / (312e12 * eff)
    memory = (4 * 2 * 2 * 256 * 64 + 4 * 2 * 256) / HBM  # q k v o in bf16, fp32 log-sum-exp
    assert compute > memory
    assert flops == work
    assert t == pytest.approx(compute + 8.56e-6, rel=1e-12)


def test_flash_causal_backward_time_by_hand() -> None:
    # 4 samples x 27 heads x 4 query blocks = 432 thread blocks = 4 full waves on 108 SMs.
    t, flops = flash_attention_time(4, 27, 512, 512, 64, True, A100, "fp16", DEFAULT_MODEL, backward=True)
    # causal: query block i visits key blocks 0..i, (1+2+3+4)/4 = 2.5 of 4 on average
    executed = 2.5 * 4 * 4 * 27 * 512 * 512 * 64 * (2.5 / 4)  # 5 products in backward = 2.5x forward
    eff = 0.63 * 2.5 / (2.5 + 2.0)
    assert t == pytest.approx(executed / (312e12 * eff) + 8.56e-6, rel=1e-12)
    assert flops == pytest.approx(2.5 * 4 * 4 * 27 * 512 * 512 * 64 / 2)  # the usual causal count


def test_flash_on_hopper_runs_at_its_measured_fraction() -> None:
    """FA2 on an H100 reaches about a third of the datasheet peak (not the A100's 73 %)."""
    args = (8, 32, 8192, 8192, 128, False)
    t_h, _ = flash_attention_time(*args, H100, "bf16", backward=False)
    t_a, _ = flash_attention_time(*args, A100, "bf16", backward=False)
    n = 64  # key blocks per query block
    blocks = 8 * 32 * 64  # 16384 thread blocks: 125 waves on 132 SMs, 152 on 108
    util_h, util_a = blocks / (125 * 132), blocks / (152 * 108)
    expect = 4 * 8 * 32 * 8192 * 8192 * 128 / (989.4e12 * 0.34 * n / (n + 2) * util_h)
    assert t_h == pytest.approx(expect + 8.56e-6, rel=1e-9)
    assert (t_a - 8.56e-6) / (t_h - 8.56e-6) == pytest.approx((989.4 * 0.34 * util_h) / (312 * 0.73 * util_a))


def test_flash_layer_beats_explicit_attention_at_long_sequence() -> None:
    """At s = 8192 the explicit path moves b a s^2 scores through HBM ~10 times each way; flash
    does not, so the layer is much faster, and the gap closes at short sequences."""
    def step(seq: int, flash: bool) -> float:
        shape = TransformerShape(hidden=4096, heads=32, seq=seq, ffn=16384, kv_heads=32, head_dim=128, flash=flash)
        c = transformer_layer_cost(shape, 1, A100, "bf16")
        return c.fwd.compute_s + c.bwd.compute_s
    assert step(8192, False) > 1.5 * step(8192, True)
    assert step(512, False) < 1.15 * step(512, True)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sdpa_keeps_no_quadratic_activation(dtype: str) -> None:
    """Korthikanti et al. 2022: a GPT layer keeps s b h (34 + 5 a s / h) bytes in 16-bit; with the
    fused kernel the 5 a s^2 b scores term is gone and the fp32 log-sum-exp (4 a s b) is kept."""
    s, h, a = 256, 64, 4
    ab = 2 if dtype == "bf16" else 4
    cfg = dict(layers=2, hidden=h, heads=a, seq=s, vocab=128)
    plan = Plan(micro_batch=2, global_batch=2, dtype=dtype)
    flash = activation_bytes_per_layer(gpt_opgraph(dict(cfg, sdpa=True), dtype), plan)["layers.1"]
    explicit = activation_bytes_per_layer(gpt_opgraph(cfg, dtype), plan)["layers.1"]
    lse = 4 * a * s if dtype == "bf16" else 4 * a * (-(-s // 32) * 32)
    rng = 12 if dtype == "bf16" else 8
    ln_stats = 2 * 8 * s  # two LayerNorms' fp32 mean and rstd
    # per sample: 16 s h tensors in the dtype, two 1-byte dropout masks; 34 s h in 16-bit
    assert flash == pytest.approx(2 * (16 * s * h * ab + 2 * s * h + ln_stats + lse + rng))
    quadratic = a * s * s * (2 * ab + 1)  # softmax output, dropout mask, dropout output
    assert explicit - flash == pytest.approx(2 * (quadratic - lse - rng))


def test_llama_defaults_to_sdpa() -> None:
    from plait.graph.zoo import load_model

    assert load_model("llama:layers=1,hidden=64,heads=4,seq=16,vocab=64").config["sdpa"] is True
    assert load_model("llama:layers=1,hidden=64,heads=4,seq=16,vocab=64,sdpa=false").config["sdpa"] is False
