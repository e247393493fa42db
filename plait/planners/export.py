"""Export a homogeneous 3D plan as launch arguments or config of the usual frameworks.

* ``megatron``   -- a `torchrun ... pretrain_gpt.py` command line for Megatron-LM
  (`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`, ...);
* ``deepspeed``  -- a DeepSpeed JSON config (`train_batch_size`, `zero_optimization`, ...)
  and the Megatron-DeepSpeed command that uses it;
* ``torchtitan`` -- a `torchrun -m torchtitan.train --module M --config F --section.key V ...`
  command line for torchtitan >= 0.3 (no TOML job file), for the plans of models that torchtitan
  has (`TORCHTITAN_MODELS`: its llama3 and qwen3 configs, matched shape for shape);
* ``slurm``      -- an sbatch script that runs the plan itself with `plait run` on the
  cluster's nodes (any plan the runtime runs, heterogeneous ones included).

The model side of each export comes from the architecture fields of the model's config
(`plait.graph.zoo.layers.ARCHITECTURE_FIELDS`: norm, activation, position embedding, pre/post
norm, biases; with `tie` and `kv_heads`), never from its name: a LLaMA-shaped plan carries
Megatron-LM's `--swiglu --normalization RMSNorm --position-embedding-type rope
--group-query-attention --num-query-groups N --untie-embeddings-and-output-weights
--disable-bias-linear`, so Megatron builds the model that was planned. A model a framework
cannot build (an encoder in a decoder-only script, post-norm, a torchtitan model that does not
exist) is refused with the field that differs.

These frameworks split layers evenly, give every data-parallel rank the same batch
and number ranks node-major, so a plan with uneven layers or batch shares, uneven
tensor shards, a stage DAG, or mixed GPU kinds is refused with the reason. A
placement (`device_order`) is exported as per-node `NODE_RANK` and
`CUDA_VISIBLE_DEVICES` when every node's block of ranks lands on one node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.ir.plan import Plan

FORMATS = ("megatron", "deepspeed", "torchtitan", "slurm")
DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Training:
    """How the model trains, as `plait run` does it and Megatron-LM names it, written into every
    export so that a plait run and its exported run train alike (AdamW, Megatron's `get_lr`)."""

    lr: float = 1e-3  # peak learning rate (--lr)
    min_lr: float = 0.0  # learning rate at the end of the decay (--min-lr)
    warmup_iters: int = 0  # linear warm-up from 0 over these steps (--lr-warmup-iters)
    decay_style: str = "constant"  # constant | linear | cosine (--lr-decay-style)
    decay_iters: int | None = None  # steps of the decay; None: all `steps` (--lr-decay-iters)
    weight_decay: float = 0.0  # decoupled weight decay (--weight-decay)
    clip_grad: float | None = None  # global gradient-norm clip; None: none (--clip-grad 0 in Megatron)
    steps: int = 100  # training steps (--train-iters)

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ExportError(f"training: lr decay style {self.decay_style!r}; use one of {DECAY_STYLES}")
        if not self.lr > 0 or self.min_lr < 0 or self.weight_decay < 0 or self.warmup_iters < 0 or self.steps < 1:
            raise ExportError(f"training: lr > 0, min_lr, weight_decay, warmup >= 0 and steps >= 1 needed, got {self}")

    @property
    def decay_steps(self) -> int:
        return self.decay_iters or self.steps


def _megatron_training(t: Training) -> list[str]:
    """Megatron-LM's optimizer/schedule flags (megatron/training/arguments.py); Megatron-DeepSpeed's
    pretrain_gpt.py reads the same ones."""
    return [f"--train-iters {t.steps}", "--optimizer adam", f"--lr {t.lr:g}", f"--min-lr {t.min_lr:g}",
            f"--lr-warmup-iters {t.warmup_iters}", f"--lr-decay-style {t.decay_style}",
            f"--lr-decay-iters {t.decay_steps}", f"--weight-decay {t.weight_decay:g}",
            f"--clip-grad {t.clip_grad if t.clip_grad is not None else 0.0:g}"]


class ExportError(PlaitError, ValueError):
    """A plan that the chosen framework cannot express (the message says which field)."""


def heterogeneous_reasons(plan: Plan, cluster: Cluster | None = None) -> list[str]:
    """Why `plan` is not a plain Megatron-style plan (empty list: it is)."""
    reasons = []
    if plan.stages:
        reasons.append(f"it has an explicit stage DAG ({len(plan.stages)} stages)")
    if plan.layer_split is not None and len(set(plan.layer_split)) > 1:
        reasons.append(f"layer_split {plan.layer_split} is uneven")
    if plan.dp_shares is not None and len(set(plan.samples_per_replica())) > 1:
        reasons.append("dp_shares give data-parallel replicas uneven batches "
                       f"({':'.join(map(str, plan.samples_per_replica()))} samples)")
    if plan.tp_ratios is not None and max(plan.tp_ratios) - min(plan.tp_ratios) > 1e-9:
        reasons.append("tp_ratios shard tensors unevenly")
    if cluster is not None:
        kinds = sorted({cluster.devices[plan.device_of(r)].kind.name for r in range(plan.world_size)})
        if len(kinds) > 1:
            reasons.append(f"it runs on mixed GPU kinds ({', '.join(kinds)})")
    return reasons


def _model_args(config: dict[str, Any]) -> dict[str, int]:
    def need(*names: str) -> int:
        for name in names:
            if config.get(name) is not None:
                return int(config[name])
        raise ExportError(f"export: the model config has no '{names[0]}' (a transformer LM is needed); got {sorted(config)}")

    out = {"layers": need("layers", "num_layers", "n_layer"), "hidden": need("hidden", "hidden_size", "d_model"),
           "heads": need("heads", "num_heads", "n_head"), "seq": need("seq", "seq_len", "block_size"),
           "vocab": need("vocab", "vocab_size")}
    ffn = config.get("ffn") or config.get("ffn_hidden_size")
    if ffn:
        out["ffn"] = int(ffn)
    out["kv_heads"] = int(config.get("kv_heads") or out["heads"])
    out["head_dim"] = int(config.get("head_dim") or out["hidden"] // out["heads"])
    return out


# The architecture fields an export reads (plait.graph.zoo.layers.ARCHITECTURE_FIELDS, plus the
# zoo's `tie` and `causal`), with the values each may take.
ARCH_FIELDS = {"norm": ("layernorm", "rmsnorm"), "activation": ("gelu", "swiglu"), "position": ("learned", "rope"),
               "norm_position": ("pre", "post"), "bias": (True, False), "tie": (True, False),
               "causal": (True, False)}


@dataclass(frozen=True)
class Architecture:
    """What kind of transformer the model is, read from its config (not from its name)."""

    norm: str  # layernorm | rmsnorm
    activation: str  # gelu (fc1-GELU-fc2) | swiglu (gate, up, down)
    position: str  # learned (absolute embeddings) | rope (rotary)
    norm_position: str  # pre (x + f(norm x)) | post (norm(x + f x))
    bias: bool  # the transformer's linears carry biases
    tie: bool  # the LM head shares the word embeddings
    causal: bool  # decoder (causal attention) or encoder
    kv_heads: int  # key/value heads (< heads: grouped-query attention)
    heads: int
    head_dim: int
    qk_norm: bool = False  # normalised queries and keys (Qwen3)
    eps: float | None = None  # normalisation epsilon
    rope_base: float | None = None  # rotary base (theta)
    dropout: float | None = None  # hidden (residual) dropout
    attn_dropout: float | None = None  # attention-probability dropout


def architecture(config: dict[str, Any], fmt: str) -> Architecture:
    """The `Architecture` of a model config; ExportError naming the fields it lacks."""
    missing = [k for k in ARCH_FIELDS if k not in config]
    if missing:
        raise ExportError(f"export {fmt}: the model config does not say its architecture field(s) "
                          f"{', '.join(missing)} ({'; '.join(f'{k}: {ARCH_FIELDS[k]}' for k in missing)}); "
                          "a file model sets them in its ModelSpec config")
    for key, allowed in ARCH_FIELDS.items():
        if config[key] not in allowed:
            raise ExportError(f"export {fmt}: model config field '{key}' is {config[key]!r}; use one of {allowed}")
    m = _model_args(config)

    def num(key: str) -> float | None:
        return float(config[key]) if config.get(key) is not None else None

    dropout = num("dropout")
    return Architecture(norm=config["norm"], activation=config["activation"], position=config["position"],
                        norm_position=config["norm_position"], bias=bool(config["bias"]), tie=bool(config["tie"]),
                        causal=bool(config["causal"]), kv_heads=m["kv_heads"], heads=m["heads"],
                        head_dim=m["head_dim"], qk_norm=bool(config.get("qk_norm", False)), eps=num("eps"),
                        rope_base=num("rope_base"), dropout=dropout,
                        attn_dropout=num("attn_dropout") if config.get("attn_dropout") is not None else dropout)


def _decoder_only(arch: Architecture, fmt: str, script: str) -> None:
    """Refuse what a GPT-style pretraining script cannot build, naming the field."""
    if not arch.causal:
        raise ExportError(f"export {fmt}: model config field 'causal' is False (an encoder); {script} trains "
                          "decoder-only language models")
    if arch.norm_position == "post":
        raise ExportError(f"export {fmt}: model config field 'norm_position' is 'post' (norm after the residual "
                          f"add); {script}'s transformer layers are pre-norm")
    if arch.qk_norm:
        raise ExportError(f"export {fmt}: model config field 'qk_norm' is True; {script} is exported without "
                          "query/key norms")


def _model_flags(arch: Architecture, m: dict[str, int], names: dict[str, str]) -> list[str]:
    """The flags that say `arch` where it differs from GPT's defaults, spelled by `names`
    (one table per framework: the same decisions, two argument parsers)."""
    flags = []
    if arch.norm == "rmsnorm":
        flags.append(names["rmsnorm"])
    if arch.eps is not None and arch.eps != 1e-5:
        flags.append(f"{names['eps']} {arch.eps:g}")
    if arch.activation == "swiglu":
        flags.append("--swiglu")
    if arch.position == "rope":
        flags.append(names["rope"])
        if arch.rope_base is not None and arch.rope_base != 10000:
            flags.append(f"{names['rope_base']} {int(arch.rope_base)}")
    if arch.kv_heads != arch.heads:
        flags.append(f"{names['kv_heads']} {arch.kv_heads}")
    if arch.head_dim * arch.heads != m["hidden"]:
        flags.append(f"--kv-channels {arch.head_dim}")
    if not arch.tie:
        flags.append("--untie-embeddings-and-output-weights")
    if not arch.bias:
        flags.append("--disable-bias-linear")
    if arch.dropout is not None and arch.dropout != 0.1:
        flags.append(f"--hidden-dropout {arch.dropout:g}")
    if arch.attn_dropout is not None and arch.attn_dropout != 0.1:
        flags.append(f"--attention-dropout {arch.attn_dropout:g}")
    return flags


_MEGATRON_NAMES = {"rmsnorm": "--normalization RMSNorm", "eps": "--norm-epsilon",
                   "rope": "--position-embedding-type rope", "rope_base": "--rotary-base",
                   "kv_heads": "--group-query-attention --num-query-groups"}
_MEGATRON_DEEPSPEED_NAMES = {"rmsnorm": "--normalization rmsnorm", "eps": "--layernorm-epsilon",
                             "rope": "--use-rotary-position-embeddings --no-position-embedding",
                             "rope_base": "--rotary-position-embeddings-theta",
                             "kv_heads": "--num-key-value-heads"}


def megatron_model_flags(arch: Architecture, m: dict[str, int]) -> list[str]:
    """Megatron-LM's model flags for `arch` (megatron/training/arguments.py and TransformerConfig's
    argparse names at the 2026-08 main): the defaults are GPT's (LayerNorm, GELU, learned absolute
    positions, biases, tied head, multi-head attention, dropout 0.1), the rest is said."""
    return _model_flags(arch, m, _MEGATRON_NAMES)


def megatron_deepspeed_model_flags(arch: Architecture, m: dict[str, int]) -> list[str]:
    """The same model in Megatron-DeepSpeed's names (megatron/arguments.py of deepspeedai's fork:
    `--normalization rmsnorm`, `--use-rotary-position-embeddings` with `--no-position-embedding`,
    `--num-key-value-heads`, `--layernorm-epsilon`, `--rotary-position-embeddings-theta`)."""
    return _model_flags(arch, m, _MEGATRON_DEEPSPEED_NAMES)


def _placement(plan: Plan, cluster: Cluster | None) -> tuple[int, int, list[str]]:
    """(nodes, GPUs per node, shell lines placing ranks) for torchrun's node-major numbering."""
    world = plan.world_size
    if cluster is None:
        if plan.device_order is not None and plan.device_order != list(range(world)):
            raise ExportError("export: device_order needs the cluster to map ranks to nodes")
        return 1, world, []
    per_node = {len(n.gpus) for n in cluster.nodes}
    if len(per_node) != 1:
        raise ExportError("export: nodes with different GPU counts cannot be launched with one --nproc-per-node")
    g = per_node.pop()
    nodes = max(1, -(-world // g))
    if world % g and nodes > 1:
        raise ExportError(f"export: {world} ranks do not fill whole nodes of {g} GPUs")
    g = min(g, world)
    order = [plan.device_of(r) for r in range(world)]
    if order == list(range(world)):
        return nodes, g, []
    devices = cluster.devices
    lines = []
    for block in range(nodes):
        devs = order[block * g:(block + 1) * g]
        hosts = {devices[d].node for d in devs}
        if len(hosts) != 1:
            raise ExportError(f"export: device_order puts ranks {block * g}..{block * g + g - 1} on several nodes "
                              f"({sorted(hosts)}); torchrun numbers ranks node by node")
        host = hosts.pop()
        local = ",".join(str(devices[d].local) for d in devs)
        lines.append(f"# on node {cluster.nodes[host].name}: NODE_RANK={block} CUDA_VISIBLE_DEVICES={local}")
    return nodes, g, lines


def _check(plan: Plan, cluster: Cluster | None, fmt: str) -> None:
    reasons = heterogeneous_reasons(plan, cluster)
    if reasons:
        raise ExportError(f"export {fmt}: the plan is heterogeneous ({'; '.join(reasons)}); "
                          f"{fmt} splits layers and batches evenly -- run it with `plait run` instead")


def megatron(plan: Plan, config: dict[str, Any], cluster: Cluster | None = None,
             training: Training | None = None) -> str:
    m = _model_args(config)
    arch = architecture(config, "megatron")
    _decoder_only(arch, "megatron", "Megatron-LM's pretrain_gpt.py")
    training = training or Training()
    _check(plan, cluster, "megatron")
    if plan.schedule == "gpipe":
        raise ExportError("export megatron: plan field 'schedule': Megatron-LM has no GPipe schedule (use 1f1b or interleaved)")
    nodes, g, place = _placement(plan, cluster)
    args = [f"--tensor-model-parallel-size {plan.tp}", f"--pipeline-model-parallel-size {plan.pp}",
            f"--num-layers {m['layers']}", f"--hidden-size {m['hidden']}",
            f"--num-attention-heads {m['heads']}", f"--seq-length {m['seq']}",
            f"--max-position-embeddings {m['seq']}"]
    if "ffn" in m:
        args.append(f"--ffn-hidden-size {m['ffn']}")
    args += megatron_model_flags(arch, m)
    args += [f"--micro-batch-size {plan.micro_batch}", f"--global-batch-size {plan.global_batch}",
             f"--tokenizer-type NullTokenizer --vocab-size {m['vocab']} --mock-data"]
    if plan.schedule == "interleaved":
        if m["layers"] % (plan.pp * plan.virtual_stages):
            raise ExportError(f"export megatron: {m['layers']} layers do not split into pp*virtual_stages chunks")
        args.append(f"--num-layers-per-virtual-pipeline-stage {m['layers'] // (plan.pp * plan.virtual_stages)}")
    if plan.recompute == "selective":
        args.append("--recompute-activations")  # = --recompute-granularity selective
    elif plan.recompute == "full":
        args.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if plan.sequence_parallel:
        args.append("--sequence-parallel")
    if plan.zero in (1, 2):
        args.append("--use-distributed-optimizer")  # shards optimizer state (and grads) over dp: ZeRO-1/2
    elif plan.zero == 3:
        args.append("--use-torch-fsdp2")  # parameters sharded too: ZeRO-3
    # gradient-reduction dtype where it is not Megatron's default for the compute dtype (Plan.grad_dtype)
    if plan.dtype == "fp16" and plan.grad_dtype == "fp32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    elif plan.dtype == "bf16" and plan.grad_dtype == "bf16":
        args.append("--grad-reduce-in-bf16")
    args += _megatron_training(training)
    args.append({"bf16": "--bf16", "fp16": "--fp16"}.get(plan.dtype, ""))
    launch = (f"torchrun --nnodes {nodes} --nproc-per-node {g} --node-rank $NODE_RANK "
              f"--master-addr $MASTER_ADDR --master-port 6000 pretrain_gpt.py")
    lines = [f"# plait plan: {plan}", *place, launch + " \\"]
    flat = [a for a in args if a]
    lines += [f"    {a} \\" for a in flat[:-1]] + [f"    {flat[-1]}"]
    return "\n".join(lines) + "\n"


def deepspeed(plan: Plan, config: dict[str, Any], cluster: Cluster | None = None,
              training: Training | None = None) -> str:
    m = _model_args(config)
    arch = architecture(config, "deepspeed")
    _decoder_only(arch, "deepspeed", "Megatron-DeepSpeed's pretrain_gpt.py")
    training = training or Training()
    _check(plan, cluster, "deepspeed")
    if plan.schedule != "1f1b":
        raise ExportError(f"export deepspeed: plan field 'schedule': DeepSpeed's pipeline engine runs 1F1B only, not {plan.schedule}")
    if plan.pp > 1 and plan.zero >= 2:
        raise ExportError(f"export deepspeed: plan field 'zero': ZeRO-{plan.zero} is incompatible with DeepSpeed pipeline parallelism")
    nodes, g, place = _placement(plan, cluster)
    ds: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": {"stage": plan.zero},
        "gradient_clipping": training.clip_grad if training.clip_grad is not None else 0.0,
    }
    if plan.dtype in ("bf16", "fp16"):
        ds[plan.dtype] = {"enabled": True}
        ds["communication_data_type"] = plan.grad_dtype  # gradient all-reduce dtype (Plan.grad_dtype)
    if plan.recompute != "none":
        ds["activation_checkpointing"] = {"partition_activations": plan.tp > 1, "contiguous_memory_optimization": False,
                                          "cpu_checkpointing": False}
    args = [f"--tensor-model-parallel-size {plan.tp}", f"--pipeline-model-parallel-size {plan.pp}",
            f"--num-layers {m['layers']}", f"--hidden-size {m['hidden']}", f"--num-attention-heads {m['heads']}",
            f"--seq-length {m['seq']}", f"--max-position-embeddings {m['seq']}",
            *([f"--ffn-hidden-size {m['ffn']}"] if "ffn" in m else []), *megatron_deepspeed_model_flags(arch, m),
            f"--micro-batch-size {plan.micro_batch}", f"--global-batch-size {plan.global_batch}",
            "--deepspeed --deepspeed_config ds_config.json", f"--zero-stage {plan.zero}",
            *_megatron_training(training)]
    if plan.pp == 1:
        args.append("--no-pipeline-parallel")
    if plan.recompute == "selective":
        args.append("--recompute-granularity selective")
    elif plan.recompute == "full":
        args.append("--deepspeed-activation-checkpointing --checkpoint-activations")
    if plan.dtype in ("bf16", "fp16"):
        args.append(f"--{plan.dtype}")
    lines = [f"# plait plan: {plan}", "# ds_config.json", json.dumps(ds, indent=2), *place,
             f"deepspeed --num_nodes {nodes} --num_gpus {g} pretrain_gpt.py \\"]
    lines += [f"    {a} \\" for a in args[:-1]] + [f"    {args[-1]}"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class TitanModel:
    """One model of torchtitan 0.3's registry: `--module` and its `--config` function, with the shape
    that function builds (torchtitan/models/<module>/__init__.py; tests check it against torchtitan
    when it is installed). All are pre-norm RMSNorm / SwiGLU / rotary decoders without biases."""

    module: str
    config: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tie: bool
    head_dim: int
    qk_norm: bool

    def shape(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _TITAN_SHAPE}


_TITAN_SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tie", "head_dim", "qk_norm")
TORCHTITAN_MODELS = (
    TitanModel("llama3", "llama3_debugmodel", 6, 256, 16, 16, 768, 2048, False, 16, False),
    TitanModel("llama3", "llama3_8b", 32, 4096, 32, 8, 14336, 128256, False, 128, False),
    TitanModel("llama3", "llama3_70b", 80, 8192, 64, 8, 28672, 128256, False, 128, False),
    TitanModel("llama3", "llama3_405b", 126, 16384, 128, 8, 53248, 128256, False, 128, False),
    TitanModel("qwen3", "qwen3_debugmodel", 8, 256, 16, 8, 3072, 2048, True, 128, True),
    TitanModel("qwen3", "qwen3_0_6b", 28, 1024, 16, 8, 3072, 151936, True, 128, True),
    TitanModel("qwen3", "qwen3_1_7b", 28, 2048, 16, 8, 6144, 151936, True, 128, True),
    TitanModel("qwen3", "qwen3_14b", 40, 5120, 40, 8, 17408, 151936, False, 128, True),
    TitanModel("qwen3", "qwen3_32b", 64, 5120, 64, 8, 25600, 151936, False, 128, True),
)
# Mixture-of-experts and multi-head latent attention models (deepseek_v3, gpt_oss, qwen3 MoE, ...)
# have no counterpart in plait's zoo yet.


def torchtitan_model(config: dict[str, Any]) -> TitanModel:
    """The torchtitan model whose architecture and shape are the planned model's; ExportError with
    the reason (and the nearest model, with the fields that differ) otherwise."""
    arch = architecture(config, "torchtitan")
    kind = {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "norm_position": "pre", "bias": False,
            "causal": True}
    wrong = [f"{k}={getattr(arch, k)!r}" for k, v in kind.items() if getattr(arch, k) != v]
    if wrong:
        raise ExportError(f"export torchtitan: torchtitan has no model with {', '.join(wrong)}: its models "
                          f"({', '.join(sorted({t.module for t in TORCHTITAN_MODELS}))}, deepseek_v3, ...) are "
                          "pre-norm RMSNorm/SwiGLU/rotary decoders without biases (a GPT or BERT plan: export "
                          "megatron or deepspeed)")
    m = _model_args(config)
    want = {**{k: m.get(k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "head_dim")},
            "tie": arch.tie, "qk_norm": arch.qk_norm}
    for t in TORCHTITAN_MODELS:
        if t.shape() == want:
            return t
    near = max(TORCHTITAN_MODELS, key=lambda t: sum(t.shape()[k] == want[k] for k in _TITAN_SHAPE))
    diff = ", ".join(f"{k}={want[k]} (torchtitan: {near.shape()[k]})" for k in _TITAN_SHAPE
                     if near.shape()[k] != want[k])
    raise ExportError(f"export torchtitan: no torchtitan model has this shape; the nearest, --module {near.module} "
                      f"--config {near.config}, differs in {diff}. torchtitan builds its models from registry "
                      "functions, not from flags: plan that shape (e.g. --model llama:" +
                      ",".join(f"{k}={near.shape()[k]}" for k in ("layers", "hidden", "heads", "kv_heads", "ffn",
                                                                  "vocab")) + ") to export it")


def torchtitan(plan: Plan, config: dict[str, Any], cluster: Cluster | None = None,
               training: Training | None = None) -> str:
    """A torchtitan >= 0.3 launch: `--module`/`--config` pick the registry model (`torchtitan_model`),
    `--section.key` overrides carry the plan (torchtitan/config/manager.py parses them with tyro;
    activation checkpointing is the trailing `activation-checkpoint:<mode>` subcommand)."""
    titan = torchtitan_model(config)
    m = _model_args(config)
    training = training or Training()
    _check(plan, cluster, "torchtitan")
    if plan.dtype == "fp16":
        raise ExportError("export torchtitan: plan field 'dtype': torchtitan trains in bfloat16 or float32, not fp16")
    if plan.grad_dtype != "fp32":
        raise ExportError(f"export torchtitan: plan field 'grad_reduce_dtype': torchtitan reduces gradients in "
                          f"float32 only, the plan reduces them in {plan.grad_dtype}")
    nodes, g, place = _placement(plan, cluster)
    schedule = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}[plan.schedule]
    # FSDP2 shards over dp for ZeRO >= 1; "never" keeps parameters gathered after forward (ZeRO-2-like),
    # "always" frees them (ZeRO-3). torchtitan has no optimizer-only sharding, so ZeRO-1 exports as ZeRO-2.
    replicate, shard = (plan.dp, 1) if plan.zero == 0 else (1, plan.dp)
    local_batch = plan.global_batch // plan.dp if plan.pp > 1 else plan.micro_batch
    args = [f"--module {titan.module}", f"--config {titan.config}",
            f"--training.local-batch-size {local_batch}", f"--training.global-batch-size {plan.global_batch}",
            f"--training.seq-len {m['seq']}", f"--training.steps {training.steps}",
            f"--training.mixed-precision-param {'bfloat16' if plan.dtype == 'bf16' else 'float32'}",
            "--training.mixed-precision-reduce float32",
            f"--parallelism.data-parallel-replicate-degree {replicate}",
            f"--parallelism.data-parallel-shard-degree {shard}",
            f"--parallelism.tensor-parallel-degree {plan.tp}",
            "--parallelism.enable-sequence-parallel" if plan.sequence_parallel
            else "--parallelism.no-enable-sequence-parallel",
            f"--parallelism.pipeline-parallel-degree {plan.pp}"]
    if training.clip_grad is not None:
        args.append(f"--training.max-norm {training.clip_grad:g}")
    if plan.zero:
        args.append(f"--parallelism.fsdp-reshard-after-forward {'always' if plan.zero == 3 else 'never'}")
    if plan.pp > 1:
        # Megatron's split, as planned: transformer layers evenly over the (virtual) stages, the
        # embedding with the first and the head with the last (torchtitan would otherwise give
        # those stages one layer less each)
        args += ["--training.disable-cuda-graphs",  # torchtitan 0.3 refuses CUDA graphs under pipelining
                 f"--parallelism.pipeline-parallel-schedule {schedule}",
                 f"--parallelism.pipeline-parallel-microbatch-size {plan.micro_batch}",
                 "--parallelism.pipeline-parallel-first-stage-less-layers 0",
                 "--parallelism.pipeline-parallel-last-stage-less-layers 0",
                 f"--parallelism.pipeline-parallel-layers-per-stage {m['layers'] // (plan.pp * plan.virtual_stages)}"]
    decay = 0.0 if training.decay_style == "constant" else min(1.0, training.decay_steps / training.steps)
    args += [f"--optimizer.param-groups.0.optimizer-kwargs.lr {training.lr:g}",
             f"--optimizer.param-groups.0.optimizer-kwargs.weight-decay {training.weight_decay:g}",
             "--optimizer.param-groups.0.optimizer-kwargs.betas 0.9 0.999",  # plait's AdamW (torch's defaults)
             f"--lr-scheduler.warmup-steps {training.warmup_iters}",
             # torchtitan decays over decay_ratio of the steps after warm-up; constant: no decay
             f"--lr-scheduler.decay-ratio {decay:g}",
             f"--lr-scheduler.decay-type {'linear' if training.decay_style == 'constant' else training.decay_style}",
             f"--lr-scheduler.min-lr-factor {training.min_lr / training.lr:g}",
             f"activation-checkpoint:{plan.recompute}"]
    notes = [f"# plait plan: {plan}", *place,
             f"# torchtitan >= 0.3: model {titan.module}/{titan.config} ({titan.layers} layers, hidden "
             f"{titan.hidden}, {titan.heads} heads, {titan.kv_heads} KV heads, vocab {titan.vocab})"]
    if plan.zero == 1:
        notes.append("# ZeRO-1 runs as FSDP with parameters kept after forward (torchtitan has no "
                     "optimizer-only sharding): gradients are sharded too")
    if training.clip_grad is None:
        notes.append("# plait trains without gradient clipping; torchtitan clips at --training.max-norm (1.0)")
    lines = notes + [f"torchrun --nnodes {nodes} --nproc-per-node {g} --node-rank $NODE_RANK "
                     "--master-addr $MASTER_ADDR --master-port 29500 -m torchtitan.train \\"]
    lines += [f"    {a} \\" for a in args[:-1]] + [f"    {args[-1]}"]
    return "\n".join(lines) + "\n"


def torchtitan_argv(text: str) -> list[str]:
    """The arguments after `-m torchtitan.train` in an exported launch (what torchtitan's
    `ConfigManager.parse_args` receives)."""
    body = text.split("-m torchtitan.train", 1)[1].replace("\\\n", " ")
    return body.split()


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'" if any(c in text for c in " ,;&|$()<>*?'\"[]{}=:") else text


def run_training_flags(t: Training | None) -> list[str]:
    """`plait run`'s flags for `t` (the same names as Megatron-LM's)."""
    t = t or Training()
    out = [f"--steps {t.steps}", f"--lr {t.lr:g}", f"--min-lr {t.min_lr:g}", f"--lr-warmup-iters {t.warmup_iters}",
           f"--lr-decay-style {t.decay_style}", f"--weight-decay {t.weight_decay:g}"]
    if t.decay_iters is not None:
        out.append(f"--lr-decay-iters {t.decay_iters}")
    if t.clip_grad is not None:
        out.append(f"--clip-grad {t.clip_grad:g}")
    return out


def slurm(plan: Plan, cluster: Cluster | None, *, model: str, cluster_file: str, plan_file: str,
          training: Training | None = None, job_name: str = "plait", time_limit: str = "01:00:00") -> str:
    """An sbatch script for `plan`: one task (one `plait run`) per node that holds plan ranks; each
    starts as many workers as the cluster file puts plan ranks on its node, and inside `srun`
    `plait run` takes the rendezvous from SLURM_* (first host of the node list, the job id) and
    its node name from SLURMD_NODENAME, matched against the cluster file's node names."""
    if cluster is None:
        raise ExportError("export slurm: needs the cluster file (its nodes are the job's nodes)")
    devices = cluster.devices
    world = plan.world_size
    if world > len(devices):
        raise ExportError(f"export slurm: the plan needs {world} devices but {cluster.name} has {len(devices)}")
    per_node: dict[int, int] = {}
    for r in range(world):
        per_node[devices[plan.device_of(r)].node] = per_node.get(devices[plan.device_of(r)].node, 0) + 1
    used = [cluster.nodes[i] for i in sorted(per_node)]
    gpus = {len(n.gpus) for n in used}
    lines = ["#!/bin/bash", f"# plait plan: {plan}", "# written by `plait plan --export slurm`; submit with: sbatch THIS_FILE",
             "# nodes of the cluster file that run plan ranks (Slurm hostname = node name in the cluster file):"]
    lines += [f"#   {n.name}: {per_node[i]} plan rank(s) on {len(n.gpus)} x {', '.join(sorted(set(n.gpus)))}"
              for i, n in zip(sorted(per_node), used)]
    # one `plait run` per node (one task): it starts that node's workers itself
    lines += [f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={len(used)}", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --time={time_limit}"]
    nodelist = ",".join(n.name for n in used)
    if len(gpus) == 1:
        lines += [f"#SBATCH --gpus-per-node={gpus.pop()}",
                  "# optional: nodes are matched by name when their hostnames are in the cluster file, else in",
                  "# the order they join the rendezvous",
                  f"##SBATCH --nodelist={nodelist}"]
    else:
        # Different GPU counts per node: whole nodes (all their GPUs), by name, so that each host finds
        # its node in the cluster file.
        lines += ["# the nodes differ in GPU count: whole nodes, chosen by name", "#SBATCH --exclusive",
                  f"#SBATCH --nodelist={nodelist}"]
    lines += ["", "set -euo pipefail",
              "# the rendezvous store listens on the first node of the job, on this port",
              "export MASTER_PORT=${MASTER_PORT:-29400}",
              "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
              f"    plait run --model {_quote(model)} --cluster {_quote(cluster_file)} --plan {_quote(plan_file)} \\",
              f"    {' '.join(run_training_flags(training))} \\",
              "    --run-dir runs/$SLURM_JOB_ID  # each node writes runs/JOB/NODE_NAME/"]
    return "\n".join(lines) + "\n"


def export(plan: Plan, fmt: str, config: dict[str, Any], cluster: Cluster | None = None,
           launch: dict[str, Any] | None = None, training: Training | None = None) -> str:
    """The plan as `fmt` launch arguments/config; `config` holds the model's layers, hidden, heads, seq, vocab.
    `launch` (slurm only): the model spec, cluster file and plan file the script passes to `plait run`."""
    if fmt == "slurm":
        if not launch or not all(launch.get(k) for k in ("model", "cluster_file", "plan_file")):
            raise ExportError("export slurm: needs the model, the cluster file and the plan file (--out PLAN.json)")
        return slurm(plan, cluster, training=training, **launch)
    fns = {"megatron": megatron, "deepspeed": deepspeed, "torchtitan": torchtitan}
    if fmt not in fns:
        raise ExportError(f"export: unknown format {fmt!r}; use one of {FORMATS}")
    return fns[fmt](plan, config, cluster, training)
