"""Export a homogeneous 3D plan as launch arguments or config of the usual frameworks.

* ``megatron``   -- a `torchrun ... pretrain_gpt.py` command line for Megatron-LM
  (`--tensor-model-parallel-size`, `--pipeline-model-parallel-size`, ...);
* ``deepspeed``  -- a DeepSpeed JSON config (`train_batch_size`, `zero_optimization`, ...)
  and the Megatron-DeepSpeed command that uses it;
* ``torchtitan`` -- the `[parallelism]`, `[training]` and `[activation_checkpoint]`
  sections of a torchtitan TOML job config;
* ``slurm``      -- an sbatch script that runs the plan itself with `plait run` on the
  cluster's nodes (any plan the runtime runs, heterogeneous ones included).

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
    if plan.dp_shares is not None and max(plan.dp_shares) - min(plan.dp_shares) > 1e-9:
        reasons.append("dp_shares give data-parallel replicas uneven batches")
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
    return out


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


def torchtitan(plan: Plan, config: dict[str, Any], cluster: Cluster | None = None,
               training: Training | None = None) -> str:
    m = _model_args(config)
    training = training or Training()
    _check(plan, cluster, "torchtitan")
    nodes, g, place = _placement(plan, cluster)
    schedule = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}[plan.schedule]
    # FSDP2 shards over dp for ZeRO >= 1; "never" keeps parameters gathered after forward (ZeRO-2-like),
    # "always" frees them (ZeRO-3). torchtitan has no optimizer-only sharding, so ZeRO-1 exports as ZeRO-2.
    replicate, shard = (plan.dp, 1) if plan.zero == 0 else (1, plan.dp)
    local_batch = plan.global_batch // plan.dp if plan.pp > 1 else plan.micro_batch
    lines = [f"# plait plan: {plan}", *place,
             f"# launch: torchrun --nnodes {nodes} --nproc-per-node {g} -m torchtitan.train --job.config_file plait.toml",
             "", "[training]", f"local_batch_size = {local_batch}", f"global_batch_size = {plan.global_batch}",
             f"seq_len = {m['seq']}", f"steps = {training.steps}"]
    if training.clip_grad is not None:
        lines.append(f"max_norm = {training.clip_grad:g}")
    if plan.dtype in ("bf16", "fp16"):
        torch_dtype = {"bf16": "bfloat16", "fp16": "float16"}[plan.dtype]
        lines.append(f'mixed_precision_param = "{torch_dtype}"')
        reduce = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[plan.grad_dtype]
        lines.append(f'mixed_precision_reduce = "{reduce}"')
    lines += ["", "[parallelism]", f"data_parallel_replicate_degree = {replicate}",
              f"data_parallel_shard_degree = {shard}", f"tensor_parallel_degree = {plan.tp}",
              f"pipeline_parallel_degree = {plan.pp}"]
    if plan.zero:
        lines.append(f'fsdp_reshard_after_forward = "{"always" if plan.zero == 3 else "never"}"')
    if plan.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{schedule}"',
                  f"pipeline_parallel_microbatch_size = {plan.micro_batch}"]
        if plan.schedule == "interleaved":
            lines.append(f"pipeline_parallel_layers_per_stage = {m['layers'] // (plan.pp * plan.virtual_stages)}")
    lines += ["", "[activation_checkpoint]", f'mode = "{plan.recompute}"']
    lines += ["", "[optimizer]", 'name = "AdamW"', f"lr = {training.lr:g}", f"weight_decay = {training.weight_decay:g}",
              "", "[lr_scheduler]", f"warmup_steps = {training.warmup_iters}",
              # torchtitan decays over decay_ratio of the steps after warm-up; constant: no decay
              f"decay_ratio = {0.0 if training.decay_style == 'constant' else min(1.0, training.decay_steps / training.steps):g}",
              f'decay_type = "{"linear" if training.decay_style == "constant" else training.decay_style}"',
              f"min_lr_factor = {training.min_lr / training.lr:g}"]
    return "\n".join(lines) + "\n"


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
