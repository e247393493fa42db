"""The model zoo: every model trains at a tiny size, counts its parameters in closed form,
builds on meta at paper size, and keeps the contracts the capture and runtime rely on
(module markers, Korthikanti's saved activations, tensor-parallel sharding, layer data flow)."""

from __future__ import annotations

import resource
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from plait.errors import PlaitError
from plait.graph.zoo import (
    ModelSpec,
    ModelSpecError,
    count_params,
    layer_graph,
    list_models,
    load_model,
    tied_parameters,
)
from plait.graph.zoo.layers import GQAttentionCore, SelfAttentionCore, TransformerBlock

TINY = {
    "gpt": "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0,attn_dropout=0",
    "llama": "llama:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,ffn=96",
    "bert": "bert:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0,attn_dropout=0",
    "resnet50": "resnet50:blocks=1-1-1-1,width=8,image=32,classes=10",
    "vgg16": "vgg16:width=8,fc=32,image=32,pool=1,classes=10,dropout=0",
    "vgg19": "vgg19:width=16,fc=64,image=32,pool=1,classes=10,dropout=0",
    "vit": "vit:layers=2,hidden=32,heads=4,patch=8,image=32,classes=10",
    "bert_moe": (
        "bert_moe:layers=2,hidden=32,heads=4,seq=16,vocab=64,experts=4,moe_every=2,dropout=0,attn_dropout=0"
    ),
    "mmt": "mmt:branches=2,layers=2,seq=8,hidden=32,heads=4,in_dim=12,classes=5,dropout=0,attn_dropout=0",
    "dlrm": (
        "dlrm:dense_branches=2,dense_layers=2,hidden=32,dense_in=12,sparse_branches=2,"
        "rows=100,emb_dim=8,bag=5,top_layers=2"
    ),
    "candle_uno": "candle_uno:branches=3,branch_layers=2,hidden=32,in_dim=12,top_layers=2",
    "graphpipe_case": "graphpipe_case:seq=8,hidden=32,heads=4,in_dim=12,classes=5,dropout=0,attn_dropout=0",
}

# Published parameter counts of the paper-size defaults (HuggingFace / torchvision / Meta).
KNOWN_COUNTS = {
    "gpt": 354_823_168,  # GPT-2 medium (345M), seq 1024
    "bert": 109_514_298,  # BertForMaskedLM, bert-base-uncased
    "llama": 6_738_415_616,  # LLaMA-2-7B
    "resnet50": 25_557_032,  # torchvision resnet50
    "vgg16": 138_357_544,  # torchvision vgg16
    "vgg19": 143_667_240,  # torchvision vgg19
    "vit": 86_567_656,  # torchvision vit_b_16
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP's
    waiting threads make each step ~30x slower; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_registry_lists_every_zoo_model():
    assert list_models() == sorted(TINY)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_model_trains(name):
    spec = load_model(TINY[name])
    model = spec.build(seed=0)
    inputs, target = spec.sample_batch(4, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        opt.zero_grad()
        loss = spec.loss(model(*inputs), target)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        if step == 0:  # every parameter takes part in the loss
            missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not missing, f"{name}: parameters without gradient: {missing}"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], f"{name}: loss did not decrease: {losses}"


@pytest.mark.parametrize("name", sorted(TINY))
def test_param_count_matches_closed_form(name):
    spec = load_model(TINY[name])
    assert count_params(spec.build()) == spec.param_count_formula()
    paper = load_model(name)
    assert count_params(paper.build("meta")) == paper.param_count_formula()
    if name in KNOWN_COUNTS:
        assert paper.param_count_formula() == KNOWN_COUNTS[name]


def test_gpt_175b_param_count():
    spec = load_model("gpt:size=175b")
    c = spec.config
    L, h, V, s = c["layers"], c["hidden"], c["vocab"], c["seq"]
    assert (L, h, c["heads"], s) == (96, 12288, 96, 2048)
    closed = 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h
    assert spec.param_count_formula() == closed
    assert abs(closed / 174.6e9 - 1) < 1e-3
    untied = load_model("gpt:size=175b,tie=false")
    assert untied.param_count_formula() == closed + V * h


def test_paper_sizes_build_on_meta_without_allocating():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    specs = [load_model(n) for n in list_models()]
    specs += [load_model("gpt:size=175b"), load_model("llama:size=70b"), load_model("bert:size=large")]
    for spec in specs:
        model = spec.build("meta")
        tensors = list(model.parameters()) + list(model.buffers())
        assert all(t.is_meta for t in tensors), spec.spec
        assert count_params(model) == spec.param_count_formula()
        inputs, target = spec.sample_batch(2, device="meta")
        assert all(t.is_meta for t in (*inputs, target))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 300, f"building on meta grew the process by {grown_mib:.0f} MiB"


def test_meta_forward_backward_of_branchy_paper_models():
    for name in ("dlrm", "candle_uno", "mmt:layers=1"):
        spec = load_model(name)
        model = spec.build("meta")
        inputs, target = spec.sample_batch(2, device="meta")
        spec.loss(model(*inputs), target).backward()
        assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


def test_build_and_batches_are_deterministic():
    spec = load_model(TINY["gpt"])
    a, b, c = spec.build(seed=3), spec.build(seed=3), spec.build(seed=4)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    (x1,), y1 = spec.sample_batch(3, seed=7)
    (x2,), y2 = spec.sample_batch(3, seed=7)
    (x3,), _ = spec.sample_batch(3, seed=8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # next-token targets
    (xm,), ym = spec.sample_batch(3, device="meta", seed=7)
    assert xm.shape == x1.shape and ym.shape == y1.shape and xm.dtype == x1.dtype
    # float inputs follow the requested dtype
    (img,), _ = load_model(TINY["vgg16"]).sample_batch(2, dtype=torch.float16)
    assert img.dtype == torch.float16
    with pytest.raises(ModelSpecError, match="batch must be >= 1"):
        spec.sample_batch(0)


def test_build_dtype_and_tied_weights():
    spec = load_model(TINY["gpt"])
    model = spec.build(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert tied_parameters(model) == [["embed.tok.weight", "head.lm.weight"]]
    assert model.head.lm.weight is model.embed.tok.weight
    assert tied_parameters(load_model(TINY["llama"]).build("meta")) == []
    assert tied_parameters(load_model(TINY["bert"]).build("meta")) == [["embed.tok.weight", "head.decoder.weight"]]


def test_bert_sequence_classifier_counts_as_huggingface_and_trains():
    """`classes=2`: BertForSequenceClassification's head (pooler on [CLS], classifier): bert-base
    has 109,483,778 parameters there; one label per sample, and the loss falls."""
    assert load_model("bert:classes=2").param_count_formula() == 109_483_778
    spec = load_model(TINY["bert"] + ",classes=3")
    model = spec.build(seed=0)
    assert count_params(model) == spec.param_count_formula()
    (ids, types), target = spec.sample_batch(8, seed=1)
    assert target.shape == (8,) and int(target.max()) < 3
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = spec.loss(model(ids, types), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_bert_masks_some_positions_only():
    spec = load_model(TINY["bert"])
    (ids, types), target = spec.sample_batch(4)
    masked = target != -100
    assert (masked.sum(dim=1) == round(0.15 * 16)).all()
    assert (ids[masked] == 63).all()  # [MASK] is the last id when the vocabulary has no id 103
    assert set(types.unique().tolist()) == {0, 1}


# ----------------------------------------------------------------------------- markers and layers


def _marked(model, attr):
    return {n: getattr(m, attr) for n, m in model.named_modules() if hasattr(m, attr)}


def test_transformer_markers_follow_the_contract():
    gpt = load_model(TINY["gpt"]).build("meta")
    layers = _marked(gpt, "plait_layer")
    assert layers == {"embed": "embedding", "layers.0": "transformer", "layers.1": "transformer", "head": "head"}
    tp = {n: v for n, v in _marked(gpt, "plait_tp").items() if n.startswith("layers.0.")}
    assert tp == {
        "layers.0.attn.qkv": "column",
        "layers.0.attn.core": "sharded",
        "layers.0.attn.proj": "row",
        "layers.0.mlp.fc1": "column",
        "layers.0.mlp.act": "sharded",
        "layers.0.mlp.fc2": "row",
    }
    assert _marked(gpt, "plait_selective") == {"layers.0.attn.core": True, "layers.1.attn.core": True}
    names = {n for n, _ in gpt.layers[0].named_children()} | {
        f"{a}.{b}" for a in ("attn", "mlp") for b, _ in getattr(gpt.layers[0], a).named_children()
    }
    assert {"ln1", "ln2", "attn.qkv", "attn.core", "attn.proj", "attn.drop"} <= names
    assert {"mlp.fc1", "mlp.act", "mlp.fc2", "mlp.drop"} <= names

    llama = load_model(TINY["llama"]).build("meta")
    tp = {n: v for n, v in _marked(llama, "plait_tp").items() if n.startswith("layers.0.")}
    assert tp == {
        "layers.0.attn.q": "column",
        "layers.0.attn.kv": "column",
        "layers.0.attn.core": "sharded",
        "layers.0.attn.proj": "row",
        "layers.0.mlp.gate": "column",
        "layers.0.mlp.up": "column",
        "layers.0.mlp.act": "sharded",
        "layers.0.mlp.down": "row",
    }
    assert _marked(load_model(TINY["bert"]).build("meta"), "plait_layer")["layers.1"] == "transformer"


def _layer_calls(name):
    graph = layer_graph(load_model(TINY[name]).build("meta")).graph
    calls = {n.name: n for n in graph.nodes if n.op == "call_module"}
    others = [n for n in graph.nodes if n.op == "call_function" and n.target.__name__ != "getitem"]
    return calls, others


@pytest.mark.parametrize("name", sorted(TINY))
def test_layer_graph_has_only_layers(name):
    model = load_model(TINY[name]).build("meta")
    calls, others = _layer_calls(name)
    assert not others, f"{name}: computation outside layers: {others}"
    assert {n.target for n in calls.values()} == set(_marked(model, "plait_layer"))


def test_branchy_models_form_a_layer_dag():
    calls, _ = _layer_calls("mmt")
    head_inputs = [a.target for a in calls["head"].args]
    assert head_inputs == ["branches.0.layers.1", "branches.1.layers.1"]
    calls, _ = _layer_calls("dlrm")
    assert [a.target for a in calls["top_0"].args] == ["dense.0.1", "dense.1.1", "sparse.0", "sparse.1"]
    calls, _ = _layer_calls("candle_uno")
    assert len(calls["top_0"].args) == 3


# ----------------------------------------------------------------------------- Korthikanti


def _saved_activation_bytes(block, x):
    """Bytes autograd saves in ``block``, deduplicated by storage and grouped by who made them.

    Returns (total, replicated, tp_split, selective, ln_stats): a tensor is tp-split when the
    module that produced its storage sits inside a ``plait_tp`` module; selective when both
    producer and saver sit inside a ``plait_selective`` module. LayerNorm's per-token mean and
    rstd (Korthikanti leaves them out) are reported apart.
    """
    names = {m: n for n, m in block.named_modules()}
    stack = [None]

    def enter(mod, args):
        stack.append(mod)

    def leave(mod, args, out):
        stack.pop()

    for m in block.modules():
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)

    def inside(mod, attr):
        name = names.get(mod)
        if name is None:
            return False
        parts = name.split(".") if name else []
        return any(getattr(block.get_submodule(".".join(parts[:i])), attr, False) for i in range(1, len(parts) + 1))

    producer, keep = {}, []

    class Producers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    producer.setdefault(t.untyped_storage().data_ptr(), stack[-1])
                    keep.append(t)  # keep storages alive so addresses are not reused
            return out

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in saved:
            saved[ptr] = (t.untyped_storage().nbytes(), producer.get(ptr), stack[-1], t.dim() and t.shape[-1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Producers():
        block(x)
    total = replicated = split = selective = ln_stats = 0
    for nbytes, made_by, saved_by, last_dim in saved.values():
        if last_dim == 1 and isinstance(saved_by, torch.nn.LayerNorm):
            ln_stats += nbytes
            continue
        total += nbytes
        if inside(made_by, "plait_tp"):
            split += nbytes
        else:
            replicated += nbytes
        if inside(made_by, "plait_selective") and inside(saved_by, "plait_selective"):
            selective += nbytes
    return total, replicated, split, selective, ln_stats


def test_gpt_block_saves_korthikanti_activations():
    """sbh(34 + 5as/h) bytes in fp16 with dropout; 10sbh replicated under TP; 5as^2b selective."""
    s, b, h, a = 32, 2, 64, 4
    torch.manual_seed(0)
    block = TransformerBlock(h, a, 4 * h, dropout=0.1, attn_dropout=0.1).half()
    x = torch.randn(s, b, h, dtype=torch.half, requires_grad=True)
    total, replicated, split, selective, ln_stats = _saved_activation_bytes(block, x)
    sbh = s * b * h
    assert total == sbh * 34 + 5 * a * s * s * b
    assert replicated == 10 * sbh
    assert split == 24 * sbh + 5 * a * s * s * b
    assert selective == 5 * a * s * s * b
    assert ln_stats <= 2 * 2 * s * b * 4  # mean and rstd per token, two LayerNorms


def test_sdpa_flag_matches_explicit_attention():
    torch.manual_seed(0)
    for causal in (True, False):
        qkv = torch.randn(8, 3, 4 * 3 * 16)
        explicit = SelfAttentionCore(16, causal, 0.0)(qkv)
        fused = SelfAttentionCore(16, causal, 0.0, sdpa=True)(qkv)
        torch.testing.assert_close(explicit, fused)
    q, kv = torch.randn(8, 3, 4 * 16), torch.randn(8, 3, 2 * 2 * 16)
    torch.testing.assert_close(GQAttentionCore(16)(q, kv), GQAttentionCore(16, sdpa=True)(q, kv))


def test_sdpa_attention_runs_on_a_fused_kernel():
    """sdpa=true must reach a fused kernel: 3-D inputs fall back to the math path, which keeps
    the s x s probabilities the memory estimator assumes are gone (measured on an H100)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    qkv = torch.randn(16, 2, 4 * 3 * 16)
    q, kv = torch.randn(16, 2, 4 * 16), torch.randn(16, 2, 2 * 2 * 16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # no math fallback allowed
        fused = SelfAttentionCore(16, True, 0.0, sdpa=True)(qkv)
        fused_gqa = GQAttentionCore(16, sdpa=True)(q, kv)
    torch.testing.assert_close(fused, SelfAttentionCore(16, True, 0.0)(qkv))
    torch.testing.assert_close(fused_gqa, GQAttentionCore(16)(q, kv))


# ----------------------------------------------------------------------------- tensor parallel


def _shards(linear, t, dim):
    w = linear.weight.chunk(t, dim=dim)
    if linear.bias is None or dim == 1:
        return [(wi, None) for wi in w]
    return list(zip(w, linear.bias.chunk(t)))


def test_contiguous_column_shards_hold_whole_heads():
    """Megatron TP by hand: chunk column linears by output rows, row linears by input columns;
    the cores run unchanged on a shard and the partial outputs sum to the unsharded result."""
    torch.manual_seed(0)
    t = 2
    gpt = load_model(TINY["gpt"]).build(dtype=torch.float64).layers[0]
    x = torch.randn(16, 3, 32, dtype=torch.float64)
    attn, mlp = gpt.attn, gpt.mlp
    parts_attn = [
        F.linear(attn.core(F.linear(x, w, b)), wp)
        for (w, b), (wp, _) in zip(_shards(attn.qkv, t, 0), _shards(attn.proj, t, 1))
    ]
    torch.testing.assert_close(sum(parts_attn) + attn.proj.bias, attn.proj(attn.core(attn.qkv(x))))
    parts_mlp = [
        F.linear(mlp.act(F.linear(x, w, b)), w2)
        for (w, b), (w2, _) in zip(_shards(mlp.fc1, t, 0), _shards(mlp.fc2, t, 1))
    ]
    torch.testing.assert_close(sum(parts_mlp) + mlp.fc2.bias, mlp.fc2(mlp.act(mlp.fc1(x))))

    llama = load_model(TINY["llama"]).build(dtype=torch.float64).layers[0]
    attn, mlp = llama.attn, llama.mlp
    parts = [
        F.linear(attn.core(F.linear(x, wq), F.linear(x, wkv)), wp)
        for (wq, _), (wkv, _), (wp, _) in zip(
            _shards(attn.q, t, 0), _shards(attn.kv, t, 0), _shards(attn.proj, t, 1)
        )
    ]
    torch.testing.assert_close(sum(parts), attn(x))
    parts = [
        F.linear(mlp.act(F.linear(x, wg), F.linear(x, wu)), wd)
        for (wg, _), (wu, _), (wd, _) in zip(_shards(mlp.gate, t, 0), _shards(mlp.up, t, 0), _shards(mlp.down, t, 1))
    ]
    torch.testing.assert_close(sum(parts), mlp(x))


# ----------------------------------------------------------------------------- spec parser


def test_spec_overrides_sizes_and_canonical_form():
    spec = load_model("gpt:layers=2,size=175b")  # size first, whatever the order
    assert (spec.config["layers"], spec.config["hidden"], spec.config["seq"]) == (2, 12288, 2048)
    assert spec.config["ffn"] == 4 * 12288 and spec.config["vocab"] == 50257
    again = load_model(spec.spec)
    assert again.config == spec.config and again.spec == spec.spec
    assert load_model("gpt").spec == "gpt"
    assert load_model("gpt", layers=3).config["layers"] == 3
    assert load_model("dlrm:rows=1e6").config["rows"] == 1_000_000
    assert load_model("dlrm:rows=2_000").config["rows"] == 2000
    assert load_model("gpt:tie=no").config["tie"] is False
    assert load_model("resnet50:blocks=3-4-23-3").config["blocks"] == [3, 4, 23, 3]
    assert load_model("llama:size=70b").config["kv_heads"] == 8
    assert load_model(spec) is spec
    for name in list_models():
        s = load_model(TINY[name])
        assert load_model(s.spec).config == s.config


@pytest.mark.parametrize(
    "text, words",
    [
        ("gpt:layers=2,foo=1", ["'foo'", "valid keys", "layers", "hidden", "size"]),
        ("gtp", ["unknown model", "gpt", "llama"]),
        ("gpt:layers=abc", ["layers", "'abc'", "int"]),
        ("gpt:layers=2.5", ["layers", "int"]),
        ("gpt:dropout=lots", ["dropout", "float"]),
        ("gpt:tie=maybe", ["tie", "bool"]),
        ("gpt:layers", ["'layers'", "key=value"]),
        ("gpt:layers=2,layers=3", ["'layers'", "twice"]),
        ("gpt:size=3b", ["'3b'", "175b", "1.3b"]),
        ("gpt:hidden=100,heads=16", ["hidden=100", "heads=16"]),
        ("gpt:layers=0", ["layers", ">= 1"]),
        ("gpt:dropout=1.5", ["dropout"]),
        ("llama:heads=8,kv_heads=3,hidden=64", ["kv_heads=3"]),
        ("resnet50:blocks=3-x", ["blocks", "3-4-6-3"]),
        ("vgg16:image=16", ["image=16", "32"]),
        ("models/thing.py", ["factory"]),
        ("", ["model name"]),
    ],
)
def test_spec_errors_name_the_problem(text, words):
    with pytest.raises(ModelSpecError) as err:
        load_model(text)
    assert isinstance(err.value, PlaitError)
    message = str(err.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


# ----------------------------------------------------------------------------- user files


USER_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from plait.graph.zoo import ModelSpec

    class Net(nn.Module):
        plait_layer = "none"
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)
        def forward(self, x):
            return self.fc(x)

    def batch(n, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(n, 6, generator=g),), torch.randint(0, 3, (n,), generator=g)

    def as_tuple():
        return Net(), batch

    def as_factory_tuple():
        return Net, batch, lambda out, y: nn.functional.cross_entropy(out, y) * 2

    def as_spec():
        spec = ModelSpec.from_module(Net, batch, name="net", config={"hidden": 6})
        return spec

    def broken():
        raise RuntimeError("no GPU here")

    def wrong():
        return 42

    helper_value = 3
    """
)


def test_user_file_factories(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(USER_FILE)
    for factory in ("as_tuple", "as_factory_tuple", "as_spec"):
        spec = load_model(f"{path}:{factory}")
        assert isinstance(spec, ModelSpec)
        assert spec.spec == f"{path.resolve()}:{factory}"
        model = spec.build()
        assert spec.build() is not model
        inputs, target = spec.sample_batch(5, seed=1)
        assert torch.equal(inputs[0], spec.sample_batch(5, seed=1)[0][0])
        loss = spec.loss(model(*inputs), target)
        assert loss.dim() == 0
        assert spec.param_count_formula() == 6 * 3 + 3
        assert all(p.is_meta for p in spec.build("meta").parameters())
    assert load_model(f"{path}:as_spec").config == {"hidden": 6}


@pytest.mark.parametrize(
    "factory, words",
    [
        ("missing", ["no callable 'missing'", "as_tuple", "user_model.py"]),
        ("broken", ["broken() failed", "no GPU here"]),
        ("wrong", ["returned int", "ModelSpec"]),
    ],
)
def test_user_file_errors(tmp_path, factory, words):
    path = tmp_path / "user_model.py"
    path.write_text(USER_FILE)
    with pytest.raises(ModelSpecError) as err:
        load_model(f"{path}:{factory}")
    for word in words:
        assert word in str(err.value)


def test_user_file_that_does_not_exist_or_import(tmp_path):
    with pytest.raises(ModelSpecError, match="does not exist"):
        load_model(f"{tmp_path}/nope.py:make")
    bad = tmp_path / "bad.py"
    bad.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ModelSpecError, match="bad.py: importing failed: ModuleNotFoundError"):
        load_model(f"{bad}:make")


# ----------------------------------------------------------------------------- HAP's models


def test_hap_models_forward_shapes():
    vit = load_model(TINY["vit"])
    (img,), target = vit.sample_batch(3)
    assert vit.build()(img).shape == (3, 10) and target.shape == (3,)
    assert vit.config["seq"] == (32 // 8) ** 2 + 1
    vgg = load_model(TINY["vgg19"])
    assert vgg.build()(vgg.sample_batch(2)[0][0]).shape == (2, 10)
    assert sum(len(b.convs) for b in vgg.build("meta").blocks) == 16  # VGG-19: 16 convs + 3 fc
    moe = load_model(TINY["bert_moe"])
    (ids, types), _ = moe.sample_batch(2)
    model = moe.build()
    assert model(ids, types).shape == (2, 16, 64)
    styles = _marked(model, "plait_layer")
    assert styles["layers.0"] == "transformer" and styles["layers.1"] == "none"  # every 2nd is MoE


def test_moe_routing_follows_gshard():
    """Each token reaches at most top_k experts, no expert holds more than its capacity, the
    combine weights of a token are its renormalised top-k gates (sum 1 unless dropped)."""
    from plait.graph.zoo.moe import MixtureOfExperts

    torch.manual_seed(0)
    moe = MixtureOfExperts(8, 16, experts=4, top_k=2, capacity=1.0, dropout=0.0)
    tokens = torch.randn(12, 8)
    dispatch, combine = moe.route(tokens)
    c = moe.slots(12)
    assert dispatch.shape == (12, 4, c) == combine.shape and c == 6
    assert dispatch.sum(dim=(1, 2)).max() <= 2
    assert dispatch.sum(dim=(0, 2)).max() <= c  # capacity per expert
    assert dispatch.sum(dim=0).max() <= 1  # one token per slot
    full = dispatch.sum(dim=(1, 2)) == 2
    assert torch.allclose(combine.sum(dim=(1, 2))[full], torch.ones(int(full.sum())))
    # with capacity for everyone, every token keeps both choices
    roomy = MixtureOfExperts(8, 16, experts=4, top_k=2, capacity=4.0, dropout=0.0)
    assert roomy.route(tokens)[0].sum() == 24


def test_llama_rmsnorm_equals_torch_and_keeps_its_product_in_the_input_dtype() -> None:
    """The zoo's RMSNorm computes torch's values, but the weight multiplies the normalised input
    cast back to the input's dtype (LLaMA's reference code, transformers), so a bf16 model's
    backward keeps 2 bytes per element there, not fp32's 4."""
    import torch

    from plait.graph.zoo.layers import RMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    ours, ref = RMSNorm(16, eps=1e-5), torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(16))
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x))

    def saved_bytes(norm: torch.nn.Module) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm.bfloat16()(x.bfloat16().requires_grad_())
        return sum(storages.values())

    # the fp32 upcast input is kept by both; torch's also keeps the fp32 normalised product
    assert saved_bytes(torch.nn.RMSNorm(16)) - saved_bytes(RMSNorm(16)) >= 2 * x.numel()


@pytest.mark.parametrize("sdpa", [True, False])
def test_llama_gqa_core_reads_each_kv_head_for_its_query_group(sdpa: bool) -> None:
    """With SDPA in bf16 the core passes kv_heads-wide K and V (enable_gqa, as flash kernels take
    them); fp32 and the explicit path repeat them. All equal attention over K/V repeated per query
    group (bf16 at its resolution)."""
    import torch
    import torch.nn.functional as F

    from plait.graph.zoo.layers import GQAttentionCore, apply_rotary, rotary_tables

    torch.manual_seed(0)
    s, b, heads, kv_heads, d = 6, 2, 4, 2, 8
    q, kv = torch.randn(s, b, heads * d).bfloat16().float(), torch.randn(s, b, kv_heads * 2 * d).bfloat16().float()
    out = GQAttentionCore(d, sdpa=sdpa)(q.bfloat16(), kv.bfloat16()).float()  # bf16: the enable_gqa path
    k, v = kv.view(s, b, kv_heads, 2 * d).split(d, dim=-1)
    cos, sin = rotary_tables(s, d, 10000.0, q.device, q.dtype)
    qh, kh = apply_rotary(q.view(s, b, heads, d), cos, sin), apply_rotary(k, cos, sin)
    rep = heads // kv_heads
    kh, vh = kh.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    ref = F.scaled_dot_product_attention(qh.permute(1, 2, 0, 3), kh.permute(1, 2, 0, 3), vh.permute(1, 2, 0, 3),
                                         is_causal=True)
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(s, b, heads * d), rtol=2e-2, atol=2e-2)
    # fp32 repeats K/V (CUDA has no fused fp32 GQA kernel): the same attention at fp32 precision
    out32 = GQAttentionCore(d, sdpa=sdpa)(q, kv)
    torch.testing.assert_close(out32, ref.permute(2, 0, 1, 3).reshape(s, b, heads * d), rtol=1e-5, atol=1e-6)
