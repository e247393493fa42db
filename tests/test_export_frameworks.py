"""Exports checked against the architecture plait planned and against the frameworks' own config code.

* Megatron-LM: the model flags of every zoo family follow the architecture read off the *built*
  module (norm layers, MLP structure, position embedding, KV heads, tied weights, biases), not the
  model's name -- a LLaMA plan carries --swiglu, RMSNorm, rope, GQA, untied head, no biases.
* DeepSpeed: the exported JSON is accepted by DeepSpeed's own `DeepSpeedConfig` (batch arithmetic
  over the data-parallel size, ZeRO stage, bf16) where deepspeed is installed (`make frameworks`).
* torchtitan >= 0.3: the exported command line is parsed by torchtitan's own `ConfigManager` (and
  its model table checked against torchtitan's registry) where torchtitan is installed.
"""

from __future__ import annotations

import json

import pytest
from torch import nn

from plait.graph.zoo import load_model, tied_parameters
from plait.ir.plan import Plan
from plait.planners.export import (
    TORCHTITAN_MODELS,
    ExportError,
    architecture,
    export,
    torchtitan_argv,
)


def _args(text: str) -> dict[str, str]:
    tokens = text.replace("\\\n", " ").split()
    out: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        if tok.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            out[tok] = "" if nxt.startswith("--") or nxt.startswith("#") else nxt
    return out


def module_architecture(spec: str) -> dict:
    """What the built model (on the meta device) actually is, read off its modules."""
    model = load_model(spec)
    module = model.build(device="meta")
    blocks = [m for m in module.modules() if getattr(m, "plait_layer", None) == "transformer"]
    assert blocks, spec
    block = blocks[0]
    norms = {type(m) for m in block.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))}
    assert len(norms) == 1, norms
    mlp = block.mlp
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    head_dim = model.config["hidden"] // model.config["heads"]
    attn = block.attn
    kv_heads = attn.kv.out_features // (2 * head_dim) if hasattr(attn, "kv") else model.config["heads"]
    rotary = any(hasattr(m, "rope_base") for m in block.modules())
    learned = any(isinstance(m, nn.Embedding) and m.num_embeddings == model.config["seq"]
                  for name, m in module.named_modules() if name.endswith("pos"))
    assert rotary != learned, spec  # exactly one kind of position information
    return {"norm": "rmsnorm" if any(issubclass(t, nn.RMSNorm) for t in norms) else "layernorm",
            "activation": "swiglu" if hasattr(mlp, "gate") else "gelu",
            "position": "rope" if rotary else "learned",
            "norm_position": "pre" if getattr(block, "pre_ln", True) else "post",
            "bias": any(m.bias is not None for m in linears),
            "tie": bool(tied_parameters(module)), "kv_heads": kv_heads}


LM_SPECS = ["gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1024",
            "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1024,tie=false",
            "llama:layers=4,hidden=256,heads=8,kv_heads=2,seq=128,vocab=1024,ffn=512",
            "llama:layers=4,hidden=256,heads=8,seq=128,vocab=1024,ffn=512,tie=true",
            "llama:size=70b"]


@pytest.mark.parametrize("spec", LM_SPECS)
def test_megatron_model_flags_follow_the_built_architecture(spec):
    built = module_architecture(spec)
    config = load_model(spec).config
    arch = architecture(config, "megatron")
    for key in ("norm", "activation", "position", "norm_position", "bias", "tie", "kv_heads"):
        assert getattr(arch, key) == built[key], (spec, key)  # the config says what the module is
    plan = Plan.parse("dp=2,tp=2,pp=1,micro_batch=1,global_batch=8,dtype=bf16")
    for fmt, names in (("megatron", {"rmsnorm": "--normalization RMSNorm", "rope": "--position-embedding-type rope",
                                     "gqa": f"--group-query-attention --num-query-groups {built['kv_heads']}"}),
                       ("deepspeed", {"rmsnorm": "--normalization rmsnorm",
                                      "rope": "--use-rotary-position-embeddings --no-position-embedding",
                                      "gqa": f"--num-key-value-heads {built['kv_heads']}"})):
        text = export(plan, fmt, config)
        assert (names["rmsnorm"] in text) == (built["norm"] == "rmsnorm"), (fmt, spec)
        assert ("--swiglu" in text) == (built["activation"] == "swiglu"), (fmt, spec)
        assert (names["rope"] in text) == (built["position"] == "rope"), (fmt, spec)
        assert (names["gqa"] in text) == (built["kv_heads"] < config["heads"]), (fmt, spec)
        assert ("--untie-embeddings-and-output-weights" in text) == (not built["tie"]), (fmt, spec)
        assert ("--disable-bias-linear" in text) == (not built["bias"]), (fmt, spec)


def test_llama_70b_is_exported_as_llama_to_megatron():
    """The flags whose absence made Megatron build a GELU MLP with 64 KV heads for Llama-70B."""
    text = export(Plan.parse("dp=1,tp=8,pp=4,micro_batch=1,global_batch=64,dtype=bf16,sequence_parallel=true"),
                  "megatron", load_model("llama:size=70b").config)
    a = _args(text)
    assert "--swiglu" in a and a["--normalization"] == "RMSNorm" and a["--position-embedding-type"] == "rope"
    assert "--group-query-attention" in a and a["--num-query-groups"] == "8"
    assert "--untie-embeddings-and-output-weights" in a and "--disable-bias-linear" in a
    assert a["--ffn-hidden-size"] == "28672" and a["--hidden-dropout"] == "0" and a["--attention-dropout"] == "0"
    gpt = _args(export(Plan.parse("dp=8,micro_batch=1,global_batch=8"), "megatron",
                       load_model("gpt:size=1.3b").config))
    for flag in ("--swiglu", "--normalization", "--position-embedding-type", "--group-query-attention",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout"):
        assert flag not in gpt, flag  # GPT is Megatron's default model


def test_models_megatron_cannot_build_are_refused_with_the_field():
    plan = Plan.parse("dp=2,micro_batch=1,global_batch=4")
    with pytest.raises(ExportError, match="'causal' is False"):
        export(plan, "megatron", load_model("bert:layers=2,hidden=64,heads=4,seq=32,vocab=128").config)
    with pytest.raises(ExportError, match="'vocab'"):  # an image model is no language model
        export(plan, "megatron", load_model("vit:layers=2,hidden=64,heads=4,image=32,patch=16").config)
    bare = {"layers": 2, "hidden": 64, "heads": 4, "seq": 8, "vocab": 10}
    with pytest.raises(ExportError, match="architecture field.*norm.*activation"):
        export(plan, "megatron", bare)  # a config that does not say what it is: no guessing
    post = {**load_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128").config, "norm_position": "post"}
    with pytest.raises(ExportError, match="norm_position"):
        export(plan, "deepspeed", post)


def test_torchtitan_maps_only_its_own_models():
    plan = Plan.parse("dp=2,micro_batch=1,global_batch=4,dtype=bf16")
    llama3_8b = load_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192").config
    a = _args(export(plan, "torchtitan", llama3_8b))
    assert (a["--module"], a["--config"]) == ("llama3", "llama3_8b")
    with pytest.raises(ExportError, match="torchtitan has no model with norm='layernorm'.*activation='gelu'"):
        export(plan, "torchtitan", load_model("gpt:size=1.3b").config)
    # LLaMA-2-70B's vocabulary is not Llama-3-70B's: refused, naming the nearest model and the field
    with pytest.raises(ExportError, match=r"llama3_70b, differs in vocab=32000 \(torchtitan: 128256\)"):
        export(plan, "torchtitan", load_model("llama:size=70b").config)


# ------------------------------------------------------------------ the frameworks' own code
PLANS = ["dp=8,micro_batch=2,global_batch=64,zero=1,dtype=bf16",
         "dp=4,tp=2,micro_batch=2,global_batch=64,zero=2,dtype=bf16,recompute=selective",
         "dp=2,tp=2,pp=2,micro_batch=1,global_batch=32,zero=1,dtype=bf16,recompute=full",
         "dp=16,micro_batch=4,global_batch=512,dtype=fp16,grad_reduce_dtype=fp32"]


def _ds_json(text: str) -> dict:
    start = text.index("{")
    depth = 0
    for i, ch in enumerate(text[start:], start):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return json.loads(text[start:i + 1])
    raise AssertionError("no JSON object")


@pytest.mark.parametrize("plan_text", PLANS)
def test_deepspeed_accepts_the_exported_config(plan_text, monkeypatch):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (make frameworks)")
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig asks torch.distributed for this rank first and falls back to a world of one
    # without a process group; rank 0 lets it take the data-parallel size from the mpu below.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)

    plan = Plan.parse(plan_text)
    ds = _ds_json(export(plan, "deepspeed", load_model("gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1024").config))

    class DataParallel:  # what DeepSpeed asks of Megatron's mpu
        def get_data_parallel_world_size(self) -> int:
            return plan.dp

    cfg = DeepSpeedConfig(ds, mpu=DataParallel())
    assert cfg.train_batch_size == plan.global_batch
    assert cfg.train_micro_batch_size_per_gpu == plan.micro_batch
    assert cfg.gradient_accumulation_steps * plan.micro_batch * plan.dp == plan.global_batch
    assert cfg.zero_optimization_stage == plan.zero
    assert cfg.bfloat16_config.enabled == (plan.dtype == "bf16")
    assert cfg.float16_config.enabled == (plan.dtype == "fp16")
    import torch

    reduce = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.grad_dtype]
    assert cfg.communication_data_type == reduce  # the gradient all-reduce dtype planned
    # a wrong batch is caught by DeepSpeed itself: the check is not vacuous
    with pytest.raises(AssertionError):
        DeepSpeedConfig({**ds, "train_batch_size": plan.global_batch + plan.dp * plan.micro_batch},
                        mpu=DataParallel())


TITAN_PLANS = ["dp=8,micro_batch=2,global_batch=64,dtype=bf16",
               "dp=2,tp=2,pp=2,micro_batch=1,global_batch=16,zero=1,dtype=bf16,recompute=full",
               "dp=2,tp=2,pp=2,micro_batch=2,global_batch=32,zero=3,schedule=gpipe,recompute=selective",
               "dp=1,tp=1,pp=2,micro_batch=1,global_batch=8,schedule=interleaved,virtual_stages=2,dtype=fp32"]


@pytest.fixture(scope="module")
def titan_config_manager():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (make frameworks)")
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401  (its whole dependency chain)
        from torchtitan.config.manager import ConfigManager
    except ImportError as exc:  # installed without its dependencies
        pytest.skip(f"torchtitan does not import: {exc}")
    return ConfigManager


@pytest.mark.parametrize("plan_text", TITAN_PLANS)
def test_torchtitan_parses_the_exported_command_line(plan_text, titan_config_manager):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    plan = Plan.parse(plan_text)
    model = load_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192")
    cfg = titan_config_manager().parse_args(torchtitan_argv(export(plan, "torchtitan", model.config)))
    par, tr = cfg.parallelism, cfg.training
    assert cfg.model_spec.name == "llama3" and cfg.model_spec.flavor == "8B"
    dp = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    assert dp * par.tensor_parallel_degree * par.pipeline_parallel_degree == plan.world_size
    assert (dp, par.tensor_parallel_degree, par.pipeline_parallel_degree) == (plan.dp, plan.tp, plan.pp)
    assert (par.data_parallel_shard_degree > 1) == (plan.zero > 0 and plan.dp > 1)
    assert tr.global_batch_size == plan.global_batch and tr.seq_len == 8192
    if plan.pp > 1:  # one local batch per step, cut into the plan's micro-batches by the pipeline
        assert tr.local_batch_size * dp == plan.global_batch
        assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == plan.num_micro_batches
        assert par.pipeline_parallel_layers_per_stage * plan.pp * plan.virtual_stages == 32
    else:  # gradient accumulation over micro-batches
        assert tr.local_batch_size == plan.micro_batch
        assert plan.global_batch // (tr.local_batch_size * dp) == plan.num_micro_batches
    assert par.enable_sequence_parallel == plan.sequence_parallel
    ac = {"full": FullAC.Config, "selective": SelectiveAC.Config}.get(plan.recompute)
    assert isinstance(cfg.activation_checkpoint, ac) if ac else type(cfg.activation_checkpoint).__name__ in (
        "NoneType", "Config") and not isinstance(cfg.activation_checkpoint, (FullAC.Config, SelectiveAC.Config))
    assert tr.mixed_precision_param == ("bfloat16" if plan.dtype == "bf16" else "float32")


def test_torchtitan_model_table_is_torchtitans(titan_config_manager):
    """Each (module, config) of TORCHTITAN_MODELS builds the shape the table says."""
    import importlib

    checked = 0
    for t in TORCHTITAN_MODELS:
        registry = importlib.import_module(f"torchtitan.models.{t.module}.config_registry")
        try:
            model = getattr(registry, t.config)().model_spec.model
        except ImportError:  # e.g. 405B's float8 needs torchao
            continue
        block = model.layers[0]
        attn = block.attention
        assert len(model.layers) == t.layers and model.dim == t.hidden and model.vocab_size == t.vocab, t
        assert attn.n_heads == t.heads and (attn.n_kv_heads or attn.n_heads) == t.kv_heads, t
        assert block.feed_forward.w1.out_features == t.ffn, t
        assert bool(getattr(model, "enable_weight_tying", False)) == t.tie, t
        assert (attn.qk_norm is not None) == t.qk_norm and attn.qkv_linear.head_dim == t.head_dim, t
        checked += 1
    assert checked >= 6


MEGATRON_CASES = [
    ("llama:size=70b", "dp=1,tp=8,pp=4,micro_batch=1,global_batch=64,dtype=bf16,sequence_parallel=true"),
    ("llama:layers=16,hidden=2048,heads=32,kv_heads=8,ffn=8192", "dp=2,tp=2,pp=2,micro_batch=1,global_batch=16,zero=1"),
    ("gpt:size=1.3b", "dp=16,micro_batch=1,global_batch=64,dtype=bf16"),
    ("gpt:size=13b", "dp=2,tp=4,micro_batch=1,global_batch=64,dtype=bf16,sequence_parallel=true,zero=1"),
    ("gpt:size=175b", "dp=1,tp=8,pp=4,micro_batch=1,global_batch=64,dtype=bf16,schedule=interleaved,"
                      "virtual_stages=2,recompute=selective"),
]


@pytest.mark.parametrize("spec,plan_text", MEGATRON_CASES)
def test_megatron_parse_args_accepts_the_export(spec, plan_text, monkeypatch):
    """Megatron-LM's own `parse_args` + `validate_args` on the exported arguments, where a
    Megatron-LM checkout is named by PLAIT_MEGATRON_LM (it is no pip package); the model it would
    build is the planned one."""
    import os
    import shlex
    import sys
    import typing

    root = os.environ.get("PLAIT_MEGATRON_LM")
    if not root:
        pytest.skip("set PLAIT_MEGATRON_LM to a Megatron-LM checkout to check against its parse_args")
    if not hasattr(typing, "override"):  # Megatron needs Python 3.12's typing.override
        typing_extensions = pytest.importorskip("typing_extensions")
        monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)
    monkeypatch.syspath_prepend(root)
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # no CUDA device to ask
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    plan = Plan.parse(plan_text)
    config = load_model(spec).config
    text = export(plan, "megatron", config)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py",
                                      *shlex.split(text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))])
    args = arguments.parse_args()
    args.world_size, args.rank = plan.world_size, 0
    arguments.validate_args(args, {})
    arch = architecture(config, "megatron")
    assert args.swiglu == (arch.activation == "swiglu")
    assert args.normalization == ("RMSNorm" if arch.norm == "rmsnorm" else "LayerNorm")
    assert args.position_embedding_type == ("rope" if arch.position == "rope" else "learned_absolute")
    assert args.group_query_attention == (arch.kv_heads < arch.heads)
    assert not args.group_query_attention or args.num_query_groups == arch.kv_heads
    assert args.untie_embeddings_and_output_weights == (not arch.tie)
    assert args.add_bias_linear == arch.bias
    assert args.ffn_hidden_size == config["ffn"] and args.num_layers == config["layers"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (plan.tp, plan.pp)
    assert args.data_parallel_size == plan.dp and args.global_batch_size == plan.global_batch
