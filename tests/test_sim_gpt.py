"""The closed-form GPT OpGraph equals the capture of the zoo's GPT, layer by layer and op by op."""

from __future__ import annotations

import pytest

from plait.graph.gpt_closed_form import gpt_opgraph

SPEC = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=100"
FIELDS = ("fwd_flops", "bwd_flops", "param_count", "param_bytes", "saved_bytes", "saved_tp_bytes",
          "saved_selective_bytes", "input_bytes", "output_bytes", "tp_style", "kind")


@pytest.mark.parametrize("dtype,sdpa", [("bf16", False), ("bf16", True), ("fp32", True)])
def test_matches_capture(dtype: str, sdpa: bool) -> None:
    """sdpa: the fused kernel (flash in 16-bit, memory-efficient in fp32) the capture records."""
    from plait.graph.inspect import inspect_model

    spec = SPEC.replace("seq=32", "seq=40,sdpa=true") if sdpa else SPEC  # 40: not a multiple of 32 (padding)
    captured = inspect_model(spec, batch=1, dtype=dtype)
    closed = gpt_opgraph(spec, dtype)
    assert closed.layer_names == captured.layer_names
    assert closed.layer_edges == captured.layer_edges
    for a, b in zip(closed.layers, captured.layers):
        for f in FIELDS:
            assert getattr(a, f) == pytest.approx(getattr(b, f)), (a.name, f)
        assert a.ops == b.ops
    for name, op in captured.ops.items():
        mine = closed.ops[name]
        for f in ("target", "module", "layer", "fwd_flops", "bwd_flops", "param_bytes", "saved_bytes",
                  "output_bytes", "inputs"):
            assert getattr(mine, f) == pytest.approx(getattr(op, f)), (name, f)
    assert closed.config["ffn"] == captured.config["ffn"] and closed.param_count == captured.param_count


def _same_graph(closed, captured) -> None:
    assert closed.layer_names == captured.layer_names and closed.layer_edges == captured.layer_edges
    for a, b in zip(closed.layers, captured.layers):
        for f in (*FIELDS, "saved_cast_bytes"):
            assert getattr(a, f) == pytest.approx(getattr(b, f)), (a.name, f)
        assert a.ops == b.ops
    for name, op in captured.ops.items():
        mine = closed.ops[name]
        for f in ("target", "module", "layer", "fwd_flops", "bwd_flops", "param_bytes", "saved_bytes",
                  "saved_tp_bytes", "saved_selective_bytes", "saved_cast_bytes", "output_bytes", "inputs"):
            assert getattr(mine, f) == pytest.approx(getattr(op, f)), (name, f)
    for f in ("param_dtype_bytes", "activation_dtype_bytes", "autocast", "autocast_rules", "autocast_params",
              "param_count", "tied"):
        assert getattr(closed, f) == getattr(captured, f), f


@pytest.mark.parametrize("autocast,sdpa", [("bf16", False), ("bf16", True), ("fp16", True)])
def test_matches_capture_under_autocast(autocast: str, sdpa: bool) -> None:
    """The graph plait's engines train (fp32 master parameters, CUDA's autocast lists): op for op the
    capture under autocast -- the casts of each linear's bias, weight and fp32 input, the fp32
    residual stream, LayerNorms, softmax and loss, the weight copies saved per micro-batch."""
    from plait.graph.capture import capture
    from plait.graph.zoo import load_model

    text = SPEC.replace("seq=32", "seq=40,sdpa=true") if sdpa else SPEC
    spec = load_model(text)
    inputs, target = spec.sample_batch(2, device="meta")
    captured = capture(spec.build("meta"), inputs, name=spec.name, config=spec.config,
                       loss_fn=lambda out: spec.loss(out, target), autocast=autocast, autocast_rules="cuda")
    _same_graph(gpt_opgraph(text, "fp32", autocast=autocast), captured)


def test_gpt3_175b_shape() -> None:
    g = gpt_opgraph({"layers": 96, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 50257}, "bf16")
    assert g.param_count == pytest.approx(174.6e9, rel=2e-3)  # GPT-3 175B (Brown et al. 2020)
    # Forward FLOPs per sample: 24 s L h^2 (1 + s/6h) + 2 s h V (Narayanan et al. 2021, eq. 3 / 3).
    s, h, L, V = 2048, 12288, 96, 50257
    assert g.fwd_flops == pytest.approx(24 * s * L * h * h * (1 + s / (6 * h)) + 2 * s * h * V)
