"""Hugging Face transformers models as users bring them (issue 38): built from tiny configs with
random weights (nothing is downloaded), no wrapper, through capture, the layer cut, the planner
and the runtime. The factories are `examples/models/hf.py`, the file the README points at."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from plait.graph.capture import CaptureError, capture  # noqa: E402
from plait.graph.inspect import inspect_model  # noqa: E402
from plait.graph.zoo import load_model  # noqa: E402

HF = Path(__file__).resolve().parents[1] / "examples" / "models" / "hf.py"


def spec(name: str):
    return load_model(f"{HF}:{name}")


# ---------------------------------------------------------------------------- 1. fake tensors
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_capture_on_fake_tensors(name):
    """Stock decoders and BERT with a padding mask capture: transformers' masking sees fake
    tensors and takes its tracing path (on bare meta tensors it called .item())."""
    s = spec(name)
    g = inspect_model(s, batch=2, dtype="fp32")
    module = s.build("meta")
    assert g.param_count == sum(p.numel() for p in module.parameters())
    tokens = 32
    # every weight matrix multiplies each token at least once: 2 FLOPs per weight per token
    matmul_params = sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2 and "embed" not in n
                        and "wte" not in n and "wpe" not in n)
    assert g.fwd_flops >= 2 * matmul_params * tokens * 0.9


def test_data_dependent_op_is_named_with_its_line():
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            n = int(x.sum().item())  # the line the error must name
            return self.lin(x)[:, : max(n, 1)]

    with pytest.raises(CaptureError) as err:
        capture(Reads(), (torch.randn(2, 4),), name="reads")
    msg = str(err.value)
    assert f"{Path(__file__).name}:" in msg and "x.sum().item()" in msg
    assert "depends on tensor data" in msg and "is_tracing" in msg


# ---------------------------------------------------------------------------- 2. per-block layers
BLOCKS = {  # model -> (module path of its blocks, number of blocks)
    "llama": ["model.layers"], "gpt2": ["transformer.h"], "mixtral": ["model.layers"],
    "qwen2_moe": ["model.layers"], "bert": ["bert.encoder.layer"], "t5": ["encoder.block", "decoder.block"],
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_one_layer_per_block(name):
    """The layer cut traces the forward with the blocks as leaves (shapes answered from a fake
    run of the sample inputs), so every transformer block is one layer, and the capture uses
    the same cut."""
    s = spec(name)
    module = s.build("meta")
    from plait.runtime.partition import layer_modules

    names = [n for n, _ in layer_modules(module)]
    for path in BLOCKS[name]:
        blocks = module.get_submodule(path)
        assert [n for n in names if n.startswith(path + ".")] == [f"{path}.{i}" for i in range(len(blocks))]
    g = inspect_model(s, batch=1, dtype="bf16")
    # a layer without ops in the capture is glue that does nothing (dropout at p=0)
    assert set(g.layer_names) <= set(names)
    assert all(not any(True for _ in module.get_submodule(n).parameters()) for n in set(names) - set(g.layer_names))
    if name == "t5":  # `shared` never runs: its tensor is each stack's embed_tokens (tied)
        assert "shared" not in names
    assert g.param_count == sum(p.numel() for p in module.parameters())
