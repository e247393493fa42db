"""The op-level capture: aten ops with shapes and dtypes, linked to the layer-level OpGraph."""

from __future__ import annotations

import json

import pytest

from plait.graph.aten_capture import capture_aten
from plait.graph.capture import capture
from plait.graph.zoo import load_model
from plait.ir.aten_graph import AtenGraph, AtenGraphError

SPEC = "bert_moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,experts=4,dropout=0,attn_dropout=0"


@pytest.fixture(scope="module")
def moe():
    spec = load_model(SPEC)
    inputs, target = spec.sample_batch(2, device="meta")
    aten = capture_aten(spec.build("meta"), inputs, name=spec.name)
    layered = capture(spec.build("meta"), inputs, name=spec.name, loss_fn=lambda out: spec.loss(out, target.to("meta")))
    return spec, aten, layered


def test_ops_carry_shapes_dtypes_and_flops(moe) -> None:
    spec, g, _ = moe
    h, s, b, e = 32, 16, 2, 4
    qkv = next(op for op in g.ops if op.module == "layers.0.attn.qkv")
    assert qkv.target == "aten.linear.default" and qkv.kind == "linear"
    assert g.tensors[qkv.outputs[0]].shape == [s, b, 3 * h] and g.tensors[qkv.outputs[0]].dtype == "float32"
    assert qkv.flops == 2 * s * b * h * 3 * h  # torch's 2mnk
    assert [g.tensors[t].role for t in qkv.inputs] == ["activation", "param", "param"]
    assert {g.tensors[t].param for t in qkv.inputs[1:]} == {"layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias"}
    ids = g.tensors[g.inputs[0]]
    assert ids.role == "input" and ids.shape == [b, s] and ids.dtype == "int64"
    einsums = [op for op in g.ops if op.kind == "einsum"]
    assert [op.args[0] for op in einsums] == ["tec,th->ech", "ech,ehf->ecf", "ecf,efh->ech", "tec,ech->th"]
    c = spec.build("meta").layers[1].mlp.slots(s * b)
    assert g.tensors[einsums[0].outputs[0]].shape == [e, c, h]
    assert g.tensors[g.outputs[0]].shape == [b, s, 64]
    g.validate()


def test_every_op_knows_its_layer_of_the_opgraph(moe) -> None:
    _, g, layered = moe
    assert g.layers == layered.layer_names == ["embed", "layers.0", "layers.1", "head"]
    assert {op.layer for op in g.ops} <= set(layered.layer_names)
    # parameters counted at their first use, per layer, as the OpGraph counts them
    first_use: dict[str, str] = {}
    for op in g.ops:
        for t in op.inputs:
            if g.tensors[t].role == "param":
                first_use.setdefault(t, op.layer)
    per_layer = {name: 0 for name in g.layers}
    for t, layer in first_use.items():
        per_layer[layer] += g.tensors[t].numel
    assert per_layer == {layer.name: layer.param_count for layer in layered.layers}
    # and the forward FLOPs of the matmul-like ops agree with the OpGraph's (per sample there)
    for layer in layered.layers:
        ours = sum(op.flops for op in g.ops if op.layer == layer.name) / g.batch
        assert ours == pytest.approx(layer.fwd_flops, rel=1e-6), layer.name


def test_json_round_trip_and_version(moe) -> None:
    _, g, _ = moe
    d = json.loads(g.to_json())
    assert d["format_version"] == 1
    back = AtenGraph.from_dict(d)
    assert back == g
    with pytest.raises(AtenGraphError, match="format_version 9 is newer"):
        AtenGraph.from_dict({**d, "format_version": 9}, source="g.json")
    broken = json.loads(g.to_json())
    broken["ops"][3]["inputs"] = ["nowhere"]
    with pytest.raises(AtenGraphError, match=f"op {broken['ops'][3]['name']} reads unknown tensor 'nowhere'"):
        AtenGraph.from_dict(broken)


def test_capture_of_image_models_on_meta_allocates_nothing() -> None:
    spec = load_model("vit")  # ViT-B/16 at full size: shapes only
    g = capture_aten(spec.build("meta"), spec.sample_batch(2, device="meta")[0], name="vit")
    assert sum(g.tensors[t].numel for t in g.params) == spec.param_count_formula() == 86_567_656
    conv = next(op for op in g.ops if op.kind == "conv2d")
    assert g.tensors[conv.outputs[0]].shape == [2, 768, 14, 14]
    assert g.tensors[g.outputs[0]].shape == [2, 1000]


def test_capture_of_a_real_module_leaves_it_where_it_is() -> None:
    import torch

    spec = load_model("vgg19:width=8,fc=16,image=32,pool=1,classes=6,dropout=0")
    model = spec.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = capture_aten(model, spec.sample_batch(2)[0], name="vgg19")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert g.tensors[g.outputs[0]].shape == [2, 6] and len([op for op in g.ops if op.kind == "conv2d"]) == 16


@pytest.mark.parametrize("model", ["bert:layers=2,hidden=32,heads=4,seq=16,vocab=64", "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"])
def test_a_tied_parameter_is_one_tensor_read_by_both_ops(model: str) -> None:
    """Export lists a tied weight once per path; the graph holds it once (the module's bytes),
    read by the embedding and by the output projection."""
    spec = load_model(model)
    module = spec.build("meta")
    g = capture_aten(module, spec.sample_batch(2, device="meta")[0], name=spec.name)
    assert sum(g.tensors[t].numel for t in g.params) == sum(p.numel() for p in module.parameters())
    word = next(t for t in g.params if g.tensors[t].shape == [64, 32])
    readers = {op.kind for op in g.ops if word in op.inputs}
    assert "embedding" in readers and len(readers) >= 2, readers
