"""Model capture on the meta device: FLOPs, saved bytes, layers, DAG, zoo, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from plait.errors import PlaitError
from plait.graph.capture import CaptureError, capture, layer_assignment
from plait.ir.opgraph import OpGraph

F32 = 4


def _per_sample(graph: OpGraph, attr: str) -> dict[str, float]:
    return {layer.name: getattr(layer, attr) for layer in graph.layers}


# ---------------------------------------------------------------------------- FLOPs
def test_linear_flops_by_hand():
    b, i, o = 3, 16, 24
    x = torch.randn(b, i, requires_grad=True)  # input needs its grad: dX = dY W^T costs 2·b·i·o
    g = capture(nn.Linear(i, o), (x,), name="linear")
    assert [layer.name for layer in g.layers] == ["linear"]
    assert g.fwd_flops * b == 2 * b * i * o
    assert g.bwd_flops * b == 4 * b * i * o
    assert g.param_count == i * o + o
    assert g.capture_batch == b


def test_first_layer_skips_input_grad():
    """The model's input needs no gradient, so the first Linear's backward is dW only."""
    b, i, h, o = 4, 8, 32, 5
    g = capture(nn.Sequential(nn.Linear(i, h), nn.Linear(h, o)), (torch.randn(b, i),), name="mlp")
    fwd, bwd = _per_sample(g, "fwd_flops"), _per_sample(g, "bwd_flops")
    assert fwd == {"0": 2 * i * h, "1": 2 * h * o}
    assert bwd == {"0": 2 * i * h, "1": 4 * h * o}


def test_flops_total_match_flop_counter_mode():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10),
    )
    x = torch.randn(2, 3, 8, 8)
    g = capture(model, (x,), name="cnn")
    meta_model = model.to("meta")
    with FlopCounterMode(display=False) as counter:
        meta_model(x.to("meta")).sum().backward()
    assert (g.fwd_flops + g.bwd_flops) * 2 == counter.get_total_flops()


# ---------------------------------------------------------------------------- saved bytes
def test_mlp_saved_bytes_by_hand():
    b, i, h, o = 3, 8, 16, 4
    model = nn.Sequential(nn.Linear(i, h), nn.GELU(), nn.Linear(h, o))
    g = capture(model, (torch.randn(b, i),), name="mlp")
    saved = _per_sample(g, "saved_bytes")
    # Linear 0 keeps its input (for dW), GELU its input, Linear 2 its input (GELU output).
    assert saved == {"0": i * F32, "1": h * F32, "2": h * F32}
    out = _per_sample(g, "output_bytes")
    assert out["0"] == h * F32 and out["2"] == o * F32
    assert _per_sample(g, "input_bytes")["1"] == h * F32


def test_saved_tensor_counted_once_across_savers():
    """ReLU keeps its output and the next Linear keeps the same tensor: counted once, at ReLU."""
    b, i, h = 2, 8, 16
    model = nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, 3))
    g = capture(model, (torch.randn(b, i),), name="mlp")
    assert _per_sample(g, "saved_bytes") == {"0": i * F32, "1": h * F32, "2": 0.0}


class _TwoViews(nn.Module):
    """y = x W; out = y[:, :h] * y[:, h:] saves two views of one storage, plus sin/cos of y."""

    def __init__(self, i: int, h: int):
        super().__init__()
        self.lin = nn.Linear(i, 2 * h, bias=False)
        self.h = h

    def forward(self, x):
        y = self.lin(x)
        a, b = y[:, : self.h], y[:, self.h :]
        return (a * b).sum(-1) + y.sin().sum(-1) + y.cos().sum(-1)


def test_views_of_one_storage_count_once():
    b, i, h = 2, 4, 8
    g = capture(_TwoViews(i, h), (torch.randn(b, i),), name="views")
    # the input x (i floats) and the storage of y (2h floats), nothing twice
    assert g.saved_bytes == (i + 2 * h) * F32
    # mul, sin and cos ran at the top level: they belong to the layer that fed them
    assert g.layer_names == ["lin"]


def test_dropout_mask_is_one_byte_like_cuda():
    h = 10
    g = capture(
        nn.Sequential(nn.Linear(h, h), nn.Dropout(0.1), nn.Linear(h, h)),
        (torch.randn(2, h),),
        name="d",
    )
    assert _per_sample(g, "saved_bytes")["1"] == h  # bool mask
    g_cpu = capture(
        nn.Sequential(nn.Linear(h, h), nn.Dropout(0.1), nn.Linear(h, h)),
        (torch.randn(2, h),),
        name="d",
        cuda_kernels=False,
    )
    assert _per_sample(g_cpu, "saved_bytes")["1"] == h * F32  # CPU's float mask


def test_parameters_are_not_activations():
    g = capture(nn.Linear(8, 8), (torch.randn(2, 8, requires_grad=True),), name="lin")
    # addmm keeps W^T (a view of the weight) and x; only x is an activation
    assert g.saved_bytes == 8 * F32


# ---------------------------------------------------------------------------- per sample
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_figures_are_per_sample(batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.2), nn.Linear(12, 2))
    g = capture(model, (torch.randn(batch, 6),), name="mlp")
    ref = capture(model, (torch.randn(7, 6),), name="mlp")
    for got, want in zip(g.layers, ref.layers):
        for attr in (
            "fwd_flops",
            "bwd_flops",
            "saved_bytes",
            "input_bytes",
            "output_bytes",
            "param_count",
        ):
            assert getattr(got, attr) == pytest.approx(getattr(want, attr)), (got.name, attr)
    assert g.capture_batch == batch


def test_explicit_batch_for_seq_first_inputs():
    s, b, h = 5, 3, 4
    g = capture(nn.Linear(h, h), (torch.randn(s, b, h),), name="lin", batch=b)
    assert g.fwd_flops == 2 * s * h * h


# ---------------------------------------------------------------------------- layers
class _TwoBranch(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.b = nn.Linear(d, 2 * d)
        self.head = nn.Linear(3 * d, 1)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], dim=-1))


def test_layer_dag_of_two_branch_model():
    d = 8
    g = capture(_TwoBranch(d), (torch.randn(3, d),), name="two")
    assert g.layer_names == ["a", "b", "head"]
    assert sorted(g.layer_edges) == [("a", "head"), ("b", "head")]
    assert not g.is_chain()
    dag = g.layer_dag()
    assert set(dag.predecessors("head")) == {"a", "b"}
    # the concat ran at the top level; it belongs to the layer that consumes it
    cat = [op for op in g.ops.values() if "cat" in op.target]
    assert len(cat) == 1 and cat[0].layer == "head" and cat[0].module == ""
    assert g.layer("a").output_bytes == d * F32
    assert g.layer("b").output_bytes == 2 * d * F32
    assert g.layer("head").input_bytes == 3 * d * F32
    assert g.layer("a").input_bytes == d * F32  # the model input


def test_backward_flops_go_to_the_branch_that_made_them():
    """Backward ops are tied to their forward op by autograd sequence numbers. (torch's
    ModuleTracker, which FlopCounterMode uses, credits part of branch a's backward to b
    here: it reports 1920 FLOPs for b and 3120 in all for a 2736-FLOP step.)"""
    b, d = 3, 8
    g = capture(_TwoBranch(d), (torch.randn(b, d),), name="two")
    # a, b: input needs no grad -> dW only; head: dW and dX
    assert {n: (x.fwd_flops, x.bwd_flops) for n, x in zip(g.layer_names, g.layers)} == {
        "a": (2 * d * d, 2 * d * d),
        "b": (2 * d * 2 * d, 2 * d * 2 * d),
        "head": (2 * 3 * d, 4 * 3 * d),
    }


def test_op_dag_is_consistent():
    g = capture(_TwoBranch(), (torch.randn(2, 8),), name="two")
    dag = g.op_dag()
    import networkx as nx

    assert nx.is_directed_acyclic_graph(dag)
    for op in g.ops.values():
        assert op.layer in g.layer_names
        assert all(src in g.ops for src in op.inputs)
    assert sum(len(layer.ops) for layer in g.layers) == len(g.ops)


class _Marked(nn.Module):
    def __init__(self, d: int = 4, n: int = 3):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.embed.plait_layer = "embedding"
        blocks = []
        for _ in range(n):
            blk = nn.Sequential(nn.Linear(d, d), nn.ReLU())
            blk.plait_layer = "transformer"
            blocks.append(blk)
        self.stack = nn.ModuleDict({"blocks": nn.ModuleList(blocks), "norm": nn.LayerNorm(d)})
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        x = self.embed(x)
        for blk in self.stack["blocks"]:
            x = blk(x)
        return self.out(self.stack["norm"](x))


def test_marked_modules_become_layers():
    model = _Marked()
    heads = layer_assignment(model)
    assert heads == {
        "embed": ("embed", "embedding"),
        "stack.blocks.0": ("stack.blocks.0", "transformer"),
        "stack.blocks.1": ("stack.blocks.1", "transformer"),
        "stack.blocks.2": ("stack.blocks.2", "transformer"),
        "stack.norm": ("stack.norm", "none"),
        "out": ("out", "none"),
    }
    g = capture(model, (torch.randn(2, 4),), name="marked")
    assert g.layer_names == list(heads)
    assert [layer.tp_style for layer in g.layers] == [s for _, s in heads.values()]
    assert g.is_chain()
    assert g.layer("stack.blocks.1").kind == "Sequential"


class _Tied(nn.Module):
    def __init__(self, v: int = 11, d: int = 6):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, v, bias=False)
        self.out.weight = self.emb.weight
        self.unused = nn.Linear(3, 3)  # never called: its weights still count

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.emb(ids))))


def test_tied_and_unused_parameters_counted_once():
    model = _Tied()
    g = capture(model, (torch.randint(0, 11, (2, 5)),), name="tied")
    unique = sum(p.numel() for p in model.parameters())  # parameters() skips duplicates
    assert g.param_count == unique
    assert g.layer("emb").param_count == 11 * 6  # the tied weight, at its first use
    assert "unused" not in g.layer_names  # never ran: its weights go to the last layer
    assert g.layer("out").param_count == 3 * 3 + 3  # and the tied weight is not counted again
    assert g.config["unused_params"] == ["unused"]


def test_real_module_is_not_moved_or_changed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = capture(model, (torch.randn(3, 4),), name="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not model.training  # mode restored
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    g_meta = capture(model.to("meta"), (torch.randn(3, 4),), name="cpu")
    assert g.to_dict() == g_meta.to_dict()


def test_json_round_trip():
    g = capture(_TwoBranch(), (torch.randn(2, 8),), name="two")
    again = OpGraph.from_dict(g.to_dict())
    assert again.to_dict() == g.to_dict()


# ---------------------------------------------------------------------------- transformers
class _Core(nn.Module):
    """Attention core that copies Q, K, V out of the QKV output (unlike the zoo's views)."""

    plait_tp = "sharded"
    plait_selective = True

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, qkv):
        b, s, three_h = qkv.shape
        h = three_h // 3
        d = h // self.heads
        q, k, v = (
            t.reshape(b, s, self.heads, d).transpose(1, 2).contiguous()
            for t in qkv.split(h, dim=-1)
        )
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        return (p @ v).transpose(1, 2).reshape(b, s, h)


class _Block(nn.Module):
    plait_layer = "transformer"

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.qkv.plait_tp = "column"
        self.core = _Core(heads)
        self.proj = nn.Linear(h, h)
        self.proj.plait_tp = "row"

    def forward(self, x):
        return x + self.proj(self.core(self.qkv(self.ln(x))))


def test_tp_and_selective_markers():
    b, s, h, a = 2, 8, 16, 2
    g = capture(nn.Sequential(_Block(h, a), _Block(h, a)), (torch.randn(b, s, h),), name="blk")
    blk = g.layer("1")
    sbh = s * h * F32
    # LN input sbh + LN mean/rstd 2s + qkv input sbh + Q,K,V copies 3sbh + softmax output
    # a·s² + V-side: p kept by (p @ v) is the softmax output (once) + proj input sbh
    expected = sbh + 2 * s * F32 + sbh + 3 * sbh + a * s * s * F32 + sbh
    assert blk.saved_bytes == pytest.approx(expected)
    # made by qkv (column) or inside the sharded core: the copies, softmax output, proj input
    assert blk.saved_tp_bytes == pytest.approx(3 * sbh + a * s * s * F32 + sbh)
    # selective recompute drops what the core makes and keeps (copies + softmax output) but
    # must then keep the core's input, the QKV output (3sbh), which nothing else keeps
    assert blk.saved_selective_bytes == pytest.approx(3 * sbh + a * s * s * F32 - 3 * sbh)


# ---------------------------------------------------------------------------- zoo
ZOO = [
    "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64",
    "bert:layers=2,hidden=32,heads=2,seq=16,vocab=64",
    "llama:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64",
    "mmt:branches=2,layers=2,seq=8,hidden=32,heads=2,classes=10",
    "dlrm:dense_branches=2,dense_layers=2,hidden=32,sparse_branches=2,rows=100,emb_dim=8,bag=4,top_layers=2",
    "candle_uno:branches=3,branch_layers=2,hidden=32,top_layers=2",
    "resnet50:blocks=1-1-1-1,width=8,image=32,classes=10",
    "vgg16:width=4,fc=32,image=32,pool=1,classes=10",
]
BRANCHING = {"mmt", "dlrm", "candle_uno"}


@pytest.mark.parametrize("spec_str", ZOO, ids=[s.split(":")[0] for s in ZOO])
def test_capture_every_zoo_model(spec_str):
    import networkx as nx

    from plait.graph.zoo import load_model

    spec = load_model(spec_str)
    module = spec.build(device="meta")
    inputs, target = spec.sample_batch(2, device="meta")
    g = capture(
        module,
        inputs,
        name=spec.name,
        config=spec.config,
        loss_fn=lambda out: spec.loss(out, target),
    )
    assert g.param_count == sum(p.numel() for p in module.parameters())
    assert g.param_count == spec.param_count_formula()
    assert g.fwd_flops > 0 and g.bwd_flops > g.fwd_flops
    assert g.saved_bytes > 0
    assert nx.is_directed_acyclic_graph(g.layer_dag())
    assert nx.is_weakly_connected(g.layer_dag())
    assert g.is_chain() == (spec.name not in BRANCHING)
    assert "unattributed_bwd_flops" not in g.config


@pytest.mark.parametrize("s,h,a", [(32, 64, 4), (64, 96, 3), (16, 128, 8)])
def test_gpt_saved_bytes_match_korthikanti(s, h, a):
    """Korthikanti et al. 2022, §4.1: sbh(34 + 5as/h) bytes per layer in fp16 with dropout."""
    from plait.graph.inspect import inspect_model

    g = inspect_model(f"gpt:layers=2,hidden={h},heads={a},seq={s},vocab=128", batch=1, dtype="fp16")
    for name in ("layers.0", "layers.1"):
        layer = g.layer(name)
        assert layer.tp_style == "transformer"
        assert layer.saved_bytes == pytest.approx(s * h * (34 + 5 * a * s / h), rel=0.05)
        # tensor parallelism splits sbh(24 + 5as/h) of it; selective recompute drops 5as²b
        assert layer.saved_tp_bytes == pytest.approx(s * h * (24 + 5 * a * s / h), rel=0.05)
        assert layer.saved_selective_bytes == pytest.approx(5 * a * s * s, rel=0.05)
        assert layer.input_bytes == layer.output_bytes == 2 * s * h


def test_sdpa_traced_as_flash_attention():
    """F.scaled_dot_product_attention keeps O(s) per head (flash on GPU), not the s x s
    probabilities of the CPU math path: Korthikanti's 5as/h term disappears."""
    from plait.graph.zoo import load_model

    s, h, a = 64, 96, 3
    spec = load_model(f"gpt:layers=2,hidden={h},heads={a},seq={s},vocab=128,sdpa=true")
    inputs, target = spec.sample_batch(2, device="meta")
    kwargs = dict(name="gpt", loss_fn=lambda out: spec.loss(out, target))
    graph = capture(spec.build("meta", dtype=torch.float16), inputs, **kwargs)
    flash = graph.layer("layers.1")
    math_path = capture(
        spec.build("meta", dtype=torch.float16), inputs, cuda_kernels=False, **kwargs
    ).layer("layers.1")
    assert flash.saved_bytes == pytest.approx(34 * s * h, rel=0.02)
    assert flash.saved_selective_bytes < 0.01 * flash.saved_bytes
    assert math_path.saved_bytes > 34 * s * h + 4 * a * s * s  # keeps s x s tensors
    ops = {op.target for op in graph.ops.values()}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert flash.fwd_flops == math_path.fwd_flops  # 4·s²·h either way


# ---------------------------------------------------------------------------- errors
class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pick = _Pick()

    def forward(self, x):
        return self.pick(self.lin(x))


class _Pick(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()  # boolean indexing: the output size depends on the data


class _Item(nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:  # Python control flow on a value
            return x * 2
        return x


def test_data_dependent_op_raises_plait_error():
    with pytest.raises(CaptureError, match=r"aten.index.*'pick'.*nonzero") as info:
        capture(_DataDependent(), (torch.randn(2, 4),), name="dd")
    assert isinstance(info.value, PlaitError)
    with pytest.raises(CaptureError, match=r"_local_scalar_dense.*module '<root>'"):
        capture(_Item(), (torch.randn(2, 4, requires_grad=True),), name="item")


@torch.library.custom_op("plait_test::numpy_sin", mutates_args=())
def _numpy_sin(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy().copy()).sin()


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = _CustomAct()

    def forward(self, x):
        return self.act(self.lin(x))


class _CustomAct(nn.Module):
    def forward(self, x):
        return _numpy_sin(x)


def test_op_without_meta_kernel_raises_plait_error():
    with pytest.raises(CaptureError, match=r"plait_test.numpy_sin.*'act'"):
        capture(_Custom(), (torch.randn(2, 4),), name="custom")


def test_loss_must_be_a_scalar():
    with pytest.raises(CaptureError, match="scalar"):
        capture(nn.Linear(3, 3), (torch.randn(2, 3),), name="l", loss_fn=lambda out: out * 2)


def test_shared_module_called_twice_is_reported():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(self.b(self.a(x)))

    with pytest.raises(CaptureError, match="both ways"):
        capture(Reuse(), (torch.randn(2, 4),), name="reuse")


def test_functional_dropout_is_routed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)

        def forward(self, x):
            return F.dropout(self.lin(x), 0.3, training=True)

    g = capture(M(), (torch.randn(2, 5),), name="fd")
    assert g.saved_bytes == 5 * F32 + 5  # Linear input, bool mask


# ---------------------------------------------------------------------------- replication
@pytest.mark.parametrize(
    "spec_str,template",
    [
        ("gpt:layers=5,hidden=32,heads=2,seq=16,vocab=64", {"layers.1": ["layers.2", "layers.4"]}),
        # the first layer of each branch reads the model input (no input grad): the run
        # starts one later
        (
            "candle_uno:branches=2,branch_layers=4,hidden=16,top_layers=2",
            {
                "branches.0.2": ["branches.0.3", "branches.0.3"],
                "branches.1.2": ["branches.1.3", "branches.1.3"],
            },
        ),
    ],
    ids=["gpt", "candle_uno"],
)
def test_replicated_layers_equal_full_trace(spec_str, template):
    from plait.graph.zoo import load_model

    spec = load_model(spec_str)
    module = spec.build(device="meta")
    inputs, target = spec.sample_batch(2, device="meta")

    def loss(out):
        return spec.loss(out, target)

    fast = capture(module, inputs, name=spec.name, loss_fn=loss)
    full = capture(module, inputs, name=spec.name, loss_fn=loss, replicate=False)
    assert fast.config.pop("capture_replicated") == template
    assert "capture_replicated" not in full.config
    assert fast.to_dict() == full.to_dict()
    assert len(module.layers if spec.name == "gpt" else module.branches[0]) >= 4  # restored


def _stack(n: int = 4, d: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Dropout(0.1)) for _ in range(n)])


def test_only_identical_private_layers_are_replicated():
    from plait.graph.capture import _find_runs

    assert [r.paths for r in _find_runs(_stack())] == [["0", "1", "2", "3"]]
    different = _stack()
    different[2][1].p = 0.2  # a plain attribute differs: layer 2 breaks the run
    assert _find_runs(different) == []
    shared = _stack()
    shared[3][0].weight = shared[1][0].weight  # tied weights: first use would differ
    assert _find_runs(shared) == []
    hooked = _stack(5)
    hooked[1].register_forward_hook(lambda *a: None)
    assert [r.paths for r in _find_runs(hooked)] == [["2", "3", "4"]]


def test_parallel_branches_of_identical_layers_are_traced_in_full() -> None:
    """DLRM's seven embedding bags sit in one ModuleList but run side by side, not as a
    chain: replication must not drop them (their outputs are concatenated)."""
    from plait.graph.inspect import inspect_model
    from plait.graph.zoo import load_model

    spec = load_model("dlrm:rows=1000,hidden=64,sparse_branches=4,dense_branches=3")
    graph = inspect_model("dlrm:rows=1000,hidden=64,sparse_branches=4,dense_branches=3", batch=2)
    assert graph.param_count == spec.param_count_formula()
    assert sum(1 for layer in graph.layers if layer.name.startswith("sparse.")) == 4


def test_tied_parameters_are_found_between_any_two_layers():
    """A parameter tensor held by two layers' modules (here a shared projection, not a GPT
    embedding) is a TiedParams of the graph: owner = the layer that uses it first."""
    import torch
    from torch import nn

    from plait.graph.capture import capture

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.mid = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight  # tied, like an embedding and its LM head

        def forward(self, x):
            return self.b(torch.relu(self.mid(self.a(x))))

    g = capture(Shared(), torch.randn(4, 8), name="shared")
    assert [(t.owner, t.user, t.params, t.tp_sharded) for t in g.tied] == [("a", "b", 64, False)]
    from plait.ir.opgraph import OpGraph

    assert OpGraph.from_dict(g.to_dict()).tied == g.tied
    # a pipeline that separates the two users all-reduces the copies' gradients (fp32: 4 B each)
    from plait.cost.traffic import iteration_traffic
    from plait.ir.plan import Plan

    msgs = iteration_traffic(g, Plan(pp=2, layer_split=[1, 2], micro_batch=4, global_batch=4)).messages
    tied = [m for m in msgs if m.cls == "tied"]
    assert len(tied) == 1 and tied[0].nbytes == 64 * 4
    one_stage = iteration_traffic(g, Plan(micro_batch=4, global_batch=4)).messages
    assert not [m for m in one_stage if m.cls == "tied"]
