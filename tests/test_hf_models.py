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


# ---------------------------------------------------------------------------- 3. outputs as they are
def _equal_to_one_process(model: str, plan) -> object:
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5)
    ref_losses, ref_params = reference_run(model, plan, 2, training=training)
    result = run(model, None, plan, steps=2, training=training,
                 launch=LaunchConfig(timeout=180), records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None and set(result.params) == set(ref_params)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-6, msg=name)
    return result


@pytest.mark.slow  # ~50 s each on a busy 2-core machine
@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["dp=2,micro_batch=2,global_batch=8,dtype=fp32",
                                  "pp=2,micro_batch=2,global_batch=8,schedule=1f1b,dtype=fp32"])
def test_llama_without_a_wrapper_trains_equal_to_one_process(plan):
    """LlamaForCausalLM as transformers builds it (its CausalLMOutputWithPast goes to the loss as
    it is: .logits) trains under data and pipeline parallelism as one process does."""
    from plait.ir.plan import Plan

    result = _equal_to_one_process(f"{HF}:llama", Plan.parse(plan))
    if "pp=2" in plan:
        assert all(r.layers for r in result.ranks) and len(result.ranks) == 2


@pytest.mark.distributed
@pytest.mark.slow  # suite time (2026-12-08): the zoo GPT's tied head across pipeline stages stays (tests/test_runtime_forms.py)
def test_t5_pipeline_with_its_shared_embedding_trains_equal_to_one_process():
    """T5's embedding is one tensor under four names (`shared`, both stacks' `embed_tokens`, the LM
    head): pp=2 holds it on both stages and sums its gradients across them, and the returned
    parameters carry every name (`shared.weight`, which no stage runs, was missing: KeyError)."""
    from plait.ir.plan import Plan

    result = _equal_to_one_process(f"{HF}:t5", Plan.parse("pp=2,micro_batch=2,global_batch=4,schedule=1f1b,dtype=fp32"))
    # the tensor is on both stages: the encoder's embedding on the first, the LM head on the last
    assert "encoder.embed_tokens" in result.ranks[0].layers and "lm_head" in result.ranks[1].layers


def test_layers_of_a_decoder_profile_alone():
    """The layer profiler runs each block of LlamaForCausalLM alone, several times (plan --run's
    calibration). transformers built a key/value cache in train mode (config.use_cache), which the
    second run extended with the first run's keys: 'Trying to backward through the graph a
    second time'. The profiler runs HF models with use_cache off (capture keeps it: without a
    cache transformers cannot rule out packed sequences on fake tensors and builds a mask)."""
    from plait.measure.layer_profile import profile_layers

    s = spec("llama")
    prof = profile_layers(s, 1, repeats=2, warmup=1)
    assert {f"model.layers.{i}" for i in range(4)} <= set(prof.times)
    assert all(f > 0 and b > 0 for n, (f, b) in prof.times.items() if n.startswith("model.layers."))


@pytest.mark.slow  # ~8 s on 2 cores; a decoder's layers profile alone in make test
def test_t5_blocks_profile_alone_and_export_to_the_loss_output():
    """T5's decoder hands every block a key/value cache even with use_cache off, and returns it.
    The profiler ran each block on the one cache object the capture forward had filled, so the
    keys grew run by run ('size of tensor a (64) must match ... (32)'), and torch.export could not
    flatten the returned cache, so the SPMD and composed families declined T5. Now each profiled
    run gets no cache, and the export's outputs are what the loss reads (the logits)."""
    from plait.graph.aten_capture import capture_aten
    from plait.graph.sharding import strategies
    from plait.measure.layer_profile import profile_layers

    s = spec("t5")
    prof = profile_layers(s, 1, repeats=2, warmup=1)
    assert {f"decoder.block.{i}" for i in range(6)} <= set(prof.times)
    inputs, _ = s.sample_batch(2)
    graph = capture_aten(s.build("meta").to(torch.bfloat16), inputs, name="t5")
    (out,) = graph.outputs
    assert graph.tensors[out].shape[-1] == s.build("meta").config.vocab_size  # the logits alone
    assert all(strategies(op, graph) for op in graph.ops)  # every op has a rule (new_ones, min, index...)
    # T5's layer norm casts to a bf16 weight's dtype: the bf16 graph has ops the fp32 one (which the
    # runtime captures and autocasts) lacks, so a runnable SPMD or composed plan is declined, by name
    from plait.spmd.program_plan import dtype_changes_graph

    assert "depends on its dtype" in (dtype_changes_graph(s, 2, "bf16", graph) or "")
    assert dtype_changes_graph(s, 2, "fp32", graph) is None


# ---------------------------------------------------------------------------- 4. prices of the kernels
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_moe_expert_flops_match_a_hand_count(dtype):
    """aten._grouped_mm (transformers' MoE experts) is priced 2·T·k·n, and captures in fp16 too
    (its meta kernel is bf16-only). Hand count of one tiny Mixtral block, per sample."""
    s = spec("mixtral")
    g = inspect_model(s, batch=1, dtype=dtype)
    cfg = s.build("meta").config
    t, h, f = 32, cfg.hidden_size, cfg.intermediate_size
    d = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * d
    proj = 2 * t * h * (h + 2 * kv + h)  # q, k, v, o
    core = 2 * 2 * t * t * d * cfg.num_attention_heads  # QK^T and PV
    router = 2 * t * h * cfg.num_local_experts
    experts = 2 * t * cfg.num_experts_per_tok * 3 * h * f  # gate, up, down of each chosen expert
    hand = proj + core + router + experts
    assert g.layer("model.layers.1").fwd_flops == pytest.approx(hand, rel=0.02)


def _llama_saved_per_block(seq: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(2, seq, dtype=torch.long)
    g = capture(model, (ids,), name="llama", loss_fn=lambda out: out.logits.float().sum())
    ops = g.layer("model.layers.1").ops
    assert any("flash_attention" in g.ops[o].target for o in ops)  # the kernel CUDA runs for GQA
    return g.layer("model.layers.1").saved_bytes


def test_gqa_attention_memory_has_no_s2_term():
    """SDPA called with enable_gqa (transformers does so without a mask) takes the flash kernel:
    a block keeps O(s) bytes, so doubling s doubles them (the math path keeps s x s scores)."""
    assert _llama_saved_per_block(128) == pytest.approx(2 * _llama_saved_per_block(64), rel=0.01)


def test_an_output_the_loss_cannot_take_is_refused_before_launch(tmp_path):
    """A model returning a tuple, with no loss of its own, is refused before any worker starts,
    saying what to return."""
    from plait.runtime.api import run
    from plait.runtime.partition import RuntimeSetupError

    f = tmp_path / "pair.py"
    f.write_text(
        "import torch\nfrom torch import nn\n"
        "class Pair(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(4, 3)\n"
        "    def forward(self, x):\n        return self.a(x), x\n"
        "def make():\n"
        "    def sample_batch(batch, device='cpu', seed=0):\n"
        "        return (torch.randn(batch, 4).to(device),), torch.zeros(batch, dtype=torch.long).to(device)\n"
        "    return Pair(), sample_batch\n")
    with pytest.raises(RuntimeSetupError, match=r"returned tuple.*\.logits.*loss\(output, target\)"):
        run(f"{f}:make", None, "dp=2,micro_batch=1,global_batch=2,dtype=fp32", steps=1)


def test_tp_on_a_model_with_nothing_to_shard_is_refused_before_launch(tmp_path):
    """tp=2 of a model without a tensor-parallel plan or marks (no config plan, no model_type plait
    has one for) would replicate it on both ranks: refused in one line before any worker starts,
    and by the simulator (which the 3D planner never asks for such a plan)."""
    from plait.runtime.api import run
    from plait.runtime.partition import RuntimeSetupError

    f = tmp_path / "mlp.py"
    f.write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n"
        "    def sample_batch(batch, device='cpu', seed=0):\n"
        "        return (torch.randn(batch, 4).to(device),), torch.zeros(batch, dtype=torch.long).to(device)\n"
        "    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), sample_batch\n")
    with pytest.raises(RuntimeSetupError, match=r"plan field 'tp'.*marks nothing tensor parallelism can shard"):
        run(f"{f}:make", None, "tp=2,micro_batch=1,global_batch=2,dtype=fp32", steps=1)
    from plait.sim.api import SimulateError, simulate  # nor predicted as if it were cut

    with pytest.raises(SimulateError, match=r"plan field 'tp'.*no layer tensor parallelism can cut"):
        simulate(f"{f}:make", "emulated-mixed", "tp=2,micro_batch=1,global_batch=2,dtype=fp32")


def test_attention_attributes_take_the_local_head_count_once():
    """An attention's stored head count and head width become the local ones, once: the block's
    group of sharded modules alone no longer halves them a second time (T5's n_heads was 1 of 4 at
    tp=2, harmless only because its views use -1; GPT-2 splits [q | k | v] by split_size)."""
    from plait.runtime.comm import NullGroup
    from plait.runtime.tensor_parallel import TPContext, apply_tensor_parallel

    tp = TPContext(NullGroup(2), 2, 0)
    t5 = spec("t5").build("cpu")
    apply_tensor_parallel(t5.get_submodule("decoder.block.1"), tp, None)
    assert t5.get_submodule("decoder.block.1.layer.1.EncDecAttention").n_heads == 2
    gpt2 = spec("gpt2").build("cpu")
    apply_tensor_parallel(gpt2.get_submodule("transformer.h.0"), tp, None)
    attn = gpt2.get_submodule("transformer.h.0.attn")
    assert (attn.num_heads, attn.split_size) == (2, 32) and attn.c_attn.weight.shape == (64, 96)


@pytest.mark.slow  # suite time: a fresh process importing transformers (9 s) for a check of log noise
def test_pre_launch_check_is_quiet():
    """The pre-launch check of an fp32 Mixtral (whose `_grouped_mm` has no fp32 meta kernel) printed
    the fake mode's traceback at ERROR level, 22 lines, before every run; it is quiet now, and the
    tiny GPT-2 config no longer warns that its token ids lie outside the vocabulary. A real refusal
    still comes through (test_an_output_the_loss_cannot_take_is_refused_before_launch). In a fresh
    process: torch's loggers write to the stderr they found at import."""
    import subprocess
    import sys

    code = ("from plait.runtime.api import _check_user_model\n"
            "from plait.graph.zoo import load_model\n"
            "from plait.ir.plan import Plan\n"
            f"_check_user_model(load_model('{HF}:mixtral'), Plan.parse('dp=2,micro_batch=1,global_batch=2,dtype=fp32'), 'm')\n"
            f"load_model('{HF}:gpt2').build('meta')\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-500:]
    assert "failed while attempting to run meta" not in out.stderr and "Traceback" not in out.stderr
    assert "token_id must be" not in out.stderr


# ---------------------------------------------------------------------------- 6. tp from the model's plan
def test_base_model_tp_plan_marks_the_blocks():
    """LlamaConfig.base_model_tp_plan (colwise q/k/v, gate/up; rowwise o, down) becomes plait's
    markers: each block is a tensor-parallel layer, its ops carry their roles, and the cost model
    holds half of each block's linear weights per rank at tp=2 (norms stay whole). GPT-2's config
    has no plan: plait's for its model_type marks it."""
    from plait.cluster.catalog import get_kind
    from plait.cost.compute import generic_layer_cost, layer_cost

    s = spec("llama")
    module = s.build("meta")
    marks = {n: m.plait_tp for n, m in module.named_modules() if hasattr(m, "plait_tp")}
    assert marks["model.layers.0.self_attn.q_proj"] == "column" and marks["model.layers.0.mlp.down_proj"] == "row"
    assert marks["model.layers.0.self_attn"] == "sharded" and "lm_head" not in marks
    gpt2 = {n: m.plait_tp for n, m in spec("gpt2").build("meta").named_modules() if hasattr(m, "plait_tp")}
    assert gpt2["transformer.h.0.attn.c_attn"] == "column" and gpt2["transformer.h.0.mlp.c_proj"] == "row"
    g = inspect_model(s, batch=1, dtype="bf16")
    assert [layer.name for layer in g.layers if layer.tp_style == "transformer"] == [f"model.layers.{i}" for i in range(4)]
    assert (g.config["heads"], g.config["kv_heads"]) == (4, 2)
    block = module.get_submodule("model.layers.1")
    linear = sum(p.numel() for n, p in block.named_parameters() if "proj" in n)
    norms = sum(p.numel() for n, p in block.named_parameters() if "norm" in n)
    kind = get_kind("a100-80gb")
    layer = g.layer("model.layers.1")
    one, two = (generic_layer_cost(layer, g, 1, kind, "bf16", tp=t) for t in (1, 2))  # op by op, by the roles
    assert one.params == linear + norms and two.params == linear / 2 + norms
    flops = [sum(i.flops for i in c.fwd.items if hasattr(i, "flops")) for c in (one, two)]
    assert flops[1] == pytest.approx(flops[0] / 2, rel=0.05)  # matmuls and attention on half the heads
    assert any(getattr(i, "op", None) == "all_reduce" for i in two.fwd.items)  # after o_proj and down_proj
    # a dense decoder's block is priced as the zoo's LLaMA block of the same shape (the closed form)
    zoo = inspect_model("llama:layers=4,hidden=64,heads=4,kv_heads=2,seq=32,vocab=128,ffn=128", batch=1, dtype="bf16")
    for t in (1, 2):
        hf_cost, zoo_cost = layer_cost(layer, g, 1, kind, "bf16", tp=t), layer_cost(zoo.layer("layers.1"), zoo, 1, kind, "bf16", tp=t)
        assert (hf_cost.fwd.compute_s, hf_cost.bwd.compute_s) == pytest.approx((zoo_cost.fwd.compute_s, zoo_cost.bwd.compute_s))


@pytest.mark.distributed
@pytest.mark.slow  # suite time (2026-12-08): test_tp2_from_plaits_plan_trains_equal_to_one_process keeps a Hugging Face model on tp=2
def test_llama_tp2_from_its_own_plan_trains_equal_to_one_process():
    """tp=2 of LlamaForCausalLM, cut where its config's plan says: equal to one process, and each
    rank holds half of every block's linear weights (the embedding, norms and LM head whole)."""
    from plait.ir.plan import Plan

    result = _equal_to_one_process(f"{HF}:llama", Plan.parse("tp=2,micro_batch=2,global_batch=4,dtype=fp32"))
    module = spec("llama").build("meta")
    linear = sum(p.numel() for n, p in module.named_parameters() if "layers." in n and "proj" in n)
    total = sum(p.numel() for p in module.parameters())
    assert [r.params for r in result.ranks] == [total - linear // 2] * 2


@pytest.mark.distributed
# t5 ~7 s, bert ~16 s: slow (suite time, 2026-12-07); gpt2 stays in make test
@pytest.mark.parametrize("name", [pytest.param("bert", marks=pytest.mark.slow), pytest.param("t5", marks=pytest.mark.slow),
                                  "gpt2"])
def test_tp2_from_plaits_plan_trains_equal_to_one_process(name):
    """BERT, T5 and GPT-2 ship no base_model_tp_plan; plait's plan for their model_type (Megatron's
    pairing: q/k/v and the first MLP linear by columns, the attention output and second MLP
    linear by rows, T5's relative-position bias by heads, GPT-2's fused [q | k | v] Conv1D block
    by block) cuts them. BERT's columns (attention.self) and row (attention.output.dense) sit
    under different parents, paired through the attention module. tp=2 equals one process and
    holds half of every cut weight."""
    from plait.ir.plan import Plan

    result = _equal_to_one_process(f"{HF}:{name}", Plan.parse("tp=2,micro_batch=2,global_batch=4,dtype=fp32"))
    module = spec(name).build("meta")
    cut = [m for m in module.modules() if getattr(m, "plait_tp", None) in ("column", "row")]
    halved = sum(m.weight.numel() // 2 + (m.bias.numel() // 2 if getattr(m, "bias", None) is not None
                                          and m.plait_tp == "column" else 0) for m in cut)
    assert cut and [r.params for r in result.ranks] == [sum(p.numel() for p in module.parameters()) - halved] * 2


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_blocks_are_priced_with_their_experts_cut(name):
    """The simulator reads the experts' mark as the runtime does: at tp=2 a block's cost holds half
    of the attention and expert tensors (Mixtral's router `mlp.gate` whole, though the zoo calls a
    column linear so) and of Qwen's shared expert, which its plan leaves out and plait detects as a
    standard MLP (its gate `shared_expert_gate` whole); the memory model splits the same share,
    the experts' FLOPs halve, and g all-reduces their output (forward) and f their input gradient."""
    from plait.cluster.catalog import get_kind
    from plait.cost.compute import generic_layer_cost
    from plait.cost.memory import _tp_param_fraction

    module = spec(name).build("meta")
    g = inspect_model(spec(name), batch=1, dtype="bf16")
    layer = g.layer("model.layers.1")
    block = module.get_submodule("model.layers.1")
    total = sum(p.numel() for p in block.parameters())
    cut = sum(p.numel() for n, p in block.named_parameters()
              if "experts" in n or "self_attn" in n or "shared_expert." in n)
    one, two = (generic_layer_cost(layer, g, 1, get_kind("a100-80gb"), "bf16", tp=t) for t in (1, 2))
    assert one.params == total and two.params == total - cut / 2
    assert _tp_param_fraction(g, [x.name for x in g.layers].index("model.layers.1")) == pytest.approx(cut / total)
    reduces = [[i for i in c.items if getattr(i, "op", None) == "all_reduce"] for c in (two.fwd, two.bwd)]
    # forward: g after attention's o_proj, the experts and Qwen's shared expert; backward: f
    # before each of them (the attention's q/k/v input, the shared expert's, the experts')
    mlps = 2 if name == "qwen2_moe" else 1
    assert len(reduces[0]) == 1 + mlps and len(reduces[1]) == 1 + mlps
    experts = [g.ops[n] for n in layer.ops if g.ops[n].tp_role == "experts" and g.ops[n].fwd_flops > 0]
    assert experts and any("grouped_mm" in op.target for op in experts)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen2_moe"])  # mixtral ~18 s: slow
def test_moe_tp2_cuts_every_expert_and_trains_equal_to_one_process(name):
    """Mixtral's and Qwen2-MoE's plans cut their experts (`packed_colwise` fused [gate | up],
    `rowwise` down, `moe_tp_experts`): every expert keeps half of its intermediate features on each
    rank, equal to one process; with the attention and Qwen's shared expert (a standard MLP its
    plan leaves out, `detected_mlps`) cut too, each rank holds half of every cut tensor (router,
    shared-expert gate, norms, embedding and head whole)."""
    from plait.ir.plan import Plan

    module = spec(name).build("meta")
    experts = [m for m in module.modules() if getattr(m, "plait_tp", None) == "experts"]
    assert len(experts) == 4 and all(set(m.plait_tp_experts) == {"gate_up_proj", "down_proj"} for m in experts)
    result = _equal_to_one_process(f"{HF}:{name}", Plan.parse("tp=2,micro_batch=2,global_batch=4,dtype=fp32"))
    linears = [m for m in module.modules() if getattr(m, "plait_tp", None) in ("column", "row")]
    halved = sum(m.weight.numel() // 2 + (m.bias.numel() // 2 if m.bias is not None and m.plait_tp == "column" else 0)
                 for m in linears) + sum(p.numel() // 2 for m in experts for p in m.parameters(recurse=False))
    assert [r.params for r in result.ranks] == [sum(p.numel() for p in module.parameters()) - halved] * 2


def test_a_dense_decoder_takes_the_zoo_llamas_layers():
    """LlamaForCausalLM is cut and priced as the zoo's LLaMA of its shape: its token embedding is
    the zoo's `embedding` layer and its LM head the `head` (vocabulary-parallel on GPUs), its
    rotary tables are glue (the zoo computes them in each block), so per block and per model the
    two hold the same parameters; only HF's separate final norm remains a layer of its own."""
    hf = inspect_model(spec("llama"), batch=1, dtype="bf16")
    zoo = inspect_model("llama:layers=4,hidden=64,heads=4,kv_heads=2,seq=32,vocab=128,ffn=128", batch=1, dtype="bf16")
    assert [layer.tp_style for layer in hf.layers] == ["embedding", *["transformer"] * 4, "none", "head"]
    assert [layer.tp_style for layer in zoo.layers] == ["embedding", *["transformer"] * 4, "head"]
    assert "model.rotary_emb" not in {layer.name for layer in hf.layers}
    assert hf.param_count == zoo.param_count and hf.config["vocab"] == zoo.config["vocab"] == 128
    assert hf.layer("model.layers.1").param_count == zoo.layer("layers.1").param_count


@pytest.mark.parametrize("name, dtype", [("mixtral", "fp16"), ("qwen2_moe", "bf16")])
def test_the_spmd_family_plans_moe_routing_and_names_a_missing_rule(name, dtype):
    """An MoE layer's routing (sort by expert, histc counts, _grouped_mm at their offsets,
    index_put_ back; transformers' own grouped_mm_fallback where _grouped_mm lacks the dtype) has
    rules -- whole on every device, since a shard of the tokens sorts and counts differently -- so
    the SPMD family plans both MoE models; an op without a rule is named alone, not the table."""
    from plait.cluster import load_cluster
    from plait.graph.sharding import RULES
    from plait.search import SearchOptions, SpmdOptions
    from plait.search.spmd_family import search_spmd

    cluster = load_cluster("emulated-mixed:gpus_per_node=1")
    common = SearchOptions(global_batch=8, top=1, dtype=dtype)
    res = search_spmd(f"{HF}:{name}", cluster, common, None, SpmdOptions())
    assert res.best is not None and res.best.plan.spmd is not None and res.best.plan.dtype == dtype
    if name != "mixtral":
        return
    saved = RULES.pop("histc")
    try:
        with pytest.raises(Exception, match=r"no sharding rule for 'histc'") as info:
            search_spmd(f"{HF}:{name}", cluster, common, None, SpmdOptions())
        assert "sort," not in str(info.value) and "topk" not in str(info.value)  # not the whole table
    finally:
        RULES["histc"] = saved


@pytest.mark.distributed
@pytest.mark.slow  # suite time (2026-12-08): tests/test_program_precision.py's SPMD runs stay
def test_an_moe_spmd_program_runs_the_planners_graph_equal_to_one_process():
    """The SPMD family's program of Mixtral runs on the graph the planner captured (the meta
    device: transformers picks its GPU routing there -- integer histc, its grouped_mm fallback --
    and the workers capture the same graph, so every planned op exists), equal to one process."""
    from plait.cluster import load_cluster
    from plait.search import SearchOptions, SpmdOptions
    from plait.search.spmd_family import search_spmd

    res = search_spmd(f"{HF}:mixtral", load_cluster("emulated-mixed:gpus_per_node=1"),
                      SearchOptions(global_batch=4, top=1, dtype="fp32"), None, SpmdOptions())
    plan = res.best.plan
    assert any(s.splits_work for s in plan.spmd.strategies.values())  # some op is sharded
    _equal_to_one_process(f"{HF}:mixtral", plan)


def test_a_standard_mlp_the_plan_leaves_out_is_detected_and_nothing_else():
    """`detected_mlps`: inside a block the plan cuts, a module of linears whose forward feeds its
    input to columns (hidden -> F), joins them elementwise and returns one row (F -> hidden) is
    cut Megatron's way; an MLP with a norm between its linears (not feature by feature), one
    that returns its input added back, and one outside every cut block stay whole."""
    from plait.graph.tp_plan import detected_mlps

    class Gated(nn.Module):
        def __init__(self, mid: nn.Module | None = None, residual: bool = False) -> None:
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
            self.mid, self.residual = mid or nn.Dropout(0.0), residual

        def forward(self, x):
            y = self.down(self.mid(nn.functional.gelu(self.gate(x)) * self.up(x)))
            return x + y if self.residual else y

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(8, 8)
            self.attn.plait_tp = "column"  # something the plan cuts
            self.good, self.normed, self.residual = Gated(), Gated(nn.LayerNorm(16)), Gated(residual=True)

    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block()])
    model.outside = nn.ModuleList([nn.Module()])
    model.outside[0].mlp = Gated()
    assert detected_mlps(model) == [(f"blocks.{i}.good", [f"blocks.{i}.good.gate", f"blocks.{i}.good.up"],
                                     f"blocks.{i}.good.down", {}) for i in (0, 1)]
    # a model with no plan and no marks: the standard MLPs of all its blocks are cut, a fused
    # [gate | up] projection split by chunk(2, -1) block by block (Phi-3's MLP)
    from plait.graph.tp_plan import mark_tp_plan

    class Fused(nn.Module):
        def __init__(self, dim: int = -1) -> None:
            super().__init__()
            self.gate_up, self.down, self.dim = nn.Linear(8, 32), nn.Linear(16, 8), dim

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=self.dim)
            return self.down(up * nn.functional.silu(gate))

    bare = nn.Module()
    bare.blocks = nn.ModuleList([nn.ModuleDict({"mlp": Gated(), "normed": Gated(nn.LayerNorm(16)),
                                                "fused": Fused(), "by_rows": Fused(dim=0)})])
    assert mark_tp_plan(bare) == ["blocks.0.mlp", "blocks.0.mlp.gate", "blocks.0.mlp.up", "blocks.0.mlp.down",
                                  "blocks.0.fused", "blocks.0.fused.gate_up", "blocks.0.fused.down"]
    block = bare.blocks[0]
    assert block["mlp"].down.plait_tp == "row" and not hasattr(block["normed"], "plait_tp")
    assert block["fused"].gate_up.plait_tp_chunks == 2 and not hasattr(block["by_rows"], "plait_tp")


def test_whole_parameters_inside_a_cut_attention_are_summed_and_experts_alone_make_a_tp_layer():
    """Qwen3's per-head `q_norm` / `k_norm` weights stay whole inside the attention tp cuts: each rank
    sees its heads only, so their gradients are summed over the tensor group (`head_local_params`;
    the row's bias, whose gradient every rank has whole, is not). OLMoE's plan cuts its experts and
    gathers its attention's projections (`column_gather` / `row_split`, its q/k norms whole): its
    blocks are tensor-parallel layers for the runtime and the simulator alike."""
    from plait.graph.tp_plan import tensor_parallel_style
    from plait.runtime.tensor_parallel import head_local_params, is_tensor_parallel_layer

    block = spec("qwen3").build("meta").get_submodule("model.layers.0")
    attn = block.self_attn
    assert head_local_params(block, {}, "model.layers.0.") == [attn.q_norm.weight, attn.k_norm.weight]
    olmoe = spec("olmoe").build("meta")
    blocks = olmoe.get_submodule("model.layers")
    assert all(is_tensor_parallel_layer(b) and tensor_parallel_style(b) == "transformer" for b in blocks)
    attn = {n: getattr(m, "plait_tp", None) for n, m in blocks[0].self_attn.named_modules()}
    assert attn["q_proj"] == "column_gather" and attn["o_proj"] == "row_split" and attn["q_norm"] is None


@pytest.mark.slow  # ~25 s each on a busy 2-core machine
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["qwen3", "olmoe", "phi3"])
def test_qwen3_olmoe_and_phi3_tp2_train_equal_to_one_process(name):
    """tp=2 of Qwen3 (whole q_norm / k_norm summed over the group), of OLMoE (experts cut, the
    attention's projections gathered / split) and of Phi-3 (fused MLP detected, fused q/k/v
    gathered) equals one process."""
    from plait.ir.plan import Plan

    _equal_to_one_process(f"{HF}:{name}", Plan.parse("tp=2,micro_batch=2,global_batch=4,dtype=fp32"))


def test_a_block_priced_op_by_op_reduces_each_column_input_in_backward():
    """Megatron's f: under tp, backward all-reduces the gradient of each distinct input that column
    linears read -- BERT's attention input and its MLP input, two per block, as g after its two
    row linears in forward."""
    from plait.cluster.catalog import get_kind
    from plait.cost.compute import generic_layer_cost

    g = inspect_model(spec("bert"), batch=1, dtype="bf16")
    layer = g.layer("bert.encoder.layer.1")
    cost = generic_layer_cost(layer, g, 1, get_kind("a100-80gb"), "bf16", tp=2)
    reduces = [[i for i in c.items if getattr(i, "op", None) == "all_reduce"] for c in (cost.fwd, cost.bwd)]
    assert len(reduces[0]) == 2 and len(reduces[1]) == 2
    inputs = {g.ops[n].inputs[0] for n in layer.ops if g.ops[n].tp_role == "column"}
    assert sorted(r.nbytes for r in reduces[1]) == sorted(g.ops[i].output_bytes for i in inputs)


def test_gathered_projections_are_priced_as_their_plan_cuts_them():
    """Phi-3's fused [q | k | v] is cut with its output all-gathered and its o_proj with its input
    split (its plan's styles; the attention core then runs whole), its fused [gate | up] MLP
    Megatron's way (detected): at tp=2 the block holds half of its linear weights, its GEMMs halve
    and the attention core does not, and the collectives are an all-gather and two all-reduces
    forward (q/k/v out; o_proj, down_proj out), two all-reduces and an all-gather backward."""
    from plait.cluster.catalog import get_kind
    from plait.cost.compute import generic_layer_cost
    from plait.cost.memory import _tp_param_fraction

    module = spec("phi3").build("meta")
    block = module.get_submodule("model.layers.1")
    marks = {n: getattr(m, "plait_tp", None) for n, m in block.named_modules()}
    assert (marks["self_attn.qkv_proj"], marks["self_attn.o_proj"]) == ("column_gather", "row_split")
    assert (marks["mlp.gate_up_proj"], marks["mlp.down_proj"]) == ("column", "row")
    assert block.mlp.gate_up_proj.plait_tp_chunks == 2
    g = inspect_model(spec("phi3"), batch=1, dtype="bf16")
    layer = g.layer("model.layers.1")
    one, two = (generic_layer_cost(layer, g, 1, get_kind("a100-80gb"), "bf16", tp=t) for t in (1, 2))
    linear = sum(p.numel() for n, p in block.named_parameters() if "proj" in n)
    assert two.params == pytest.approx(one.params - linear / 2)
    assert _tp_param_fraction(g, [x.name for x in g.layers].index("model.layers.1")) == \
        pytest.approx(linear / sum(p.numel() for p in block.parameters()))
    ops = [[getattr(i, "op", None) for i in c.items if hasattr(i, "op")] for c in (two.fwd, two.bwd)]
    assert sorted(ops[0]) == ["all_gather", "all_reduce", "all_reduce"]
    assert sorted(ops[1]) == ["all_gather", "all_reduce", "all_reduce"]
