"""Export of homogeneous plans to Megatron-LM, DeepSpeed and torchtitan; refusal of heterogeneous ones."""

from __future__ import annotations

import json

import pytest

from plait.ir.plan import Plan
from plait.planners.export import ExportError, export, heterogeneous_reasons

GPT_ARCH = {"norm": "layernorm", "activation": "gelu", "position": "learned", "norm_position": "pre", "bias": True,
            "tie": True, "causal": True}
CFG = {"layers": 8, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024, "ffn": 1024, **GPT_ARCH}
# torchtitan's llama3_debugmodel shape (torchtitan builds registry models only)
TITAN_CFG = {"layers": 6, "hidden": 256, "heads": 16, "kv_heads": 16, "seq": 128, "vocab": 2048, "ffn": 768,
             "norm": "rmsnorm", "activation": "swiglu", "position": "rope", "norm_position": "pre", "bias": False,
             "tie": False, "causal": True}


def _args(text: str) -> dict[str, str]:
    """Flag -> value (or '' for switches) from a printed command line."""
    tokens = text.replace("\\\n", " ").split()
    out: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        if tok.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            out[tok] = "" if nxt.startswith("--") or nxt.startswith("#") else nxt
    return out


def test_megatron_arguments_carry_every_field():
    plan = Plan.parse("dp=2,tp=2,pp=2,micro_batch=2,global_batch=32,recompute=full,zero=1,schedule=1f1b,"
                      "sequence_parallel=true")
    a = _args(export(plan, "megatron", CFG))
    assert a["--tensor-model-parallel-size"] == "2" and a["--pipeline-model-parallel-size"] == "2"
    assert a["--micro-batch-size"] == "2" and a["--global-batch-size"] == "32"
    assert a["--num-layers"] == "8" and a["--hidden-size"] == "256" and a["--num-attention-heads"] == "8"
    assert a["--seq-length"] == "128" and a["--ffn-hidden-size"] == "1024" and a["--vocab-size"] == "1024"
    assert a["--recompute-granularity"] == "full" and "--sequence-parallel" in a
    assert "--use-distributed-optimizer" in a and "--bf16" in a
    assert a["--nproc-per-node"] == "8"
    sel = _args(export(Plan.parse("dp=8,micro_batch=1,global_batch=8,recompute=selective,zero=3"), "megatron", CFG))
    assert "--recompute-activations" in sel and "--use-torch-fsdp2" in sel and "--sequence-parallel" not in sel
    inter = _args(export(Plan.parse("pp=2,dp=4,micro_batch=1,global_batch=8,schedule=interleaved,virtual_stages=2"),
                         "megatron", CFG))
    assert inter["--num-layers-per-virtual-pipeline-stage"] == "2"


def test_deepspeed_config_is_valid_json_with_consistent_batches():
    plan = Plan.parse("dp=4,tp=2,pp=1,micro_batch=2,global_batch=64,recompute=selective,zero=2")
    text = export(plan, "deepspeed", CFG)
    start = text.index("{")
    depth, end = 0, start
    for i, ch in enumerate(text[start:], start):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            end = i + 1
            break
    cfg = json.loads(text[start:end])
    assert cfg["train_batch_size"] == 64
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * plan.dp == 64
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"]["enabled"] is True
    a = _args(text)
    assert a["--zero-stage"] == "2" and a["--tensor-model-parallel-size"] == "2"
    with pytest.raises(ExportError, match="ZeRO-2 is incompatible"):
        export(Plan.parse("dp=2,pp=2,micro_batch=1,global_batch=4,zero=2"), "deepspeed", CFG)
    with pytest.raises(ExportError, match="1F1B only"):
        export(Plan.parse("dp=1,pp=2,micro_batch=1,global_batch=4,schedule=gpipe"), "deepspeed", CFG)


def test_torchtitan_command_line_carries_the_plan():
    plan = Plan.parse("dp=2,tp=2,pp=2,micro_batch=2,global_batch=32,recompute=full,zero=3,schedule=gpipe")
    text = export(plan, "torchtitan", TITAN_CFG)
    a = _args(text)
    assert a["--module"] == "llama3" and a["--config"] == "llama3_debugmodel" and "--job.config_file" not in a
    assert (a["--parallelism.tensor-parallel-degree"], a["--parallelism.pipeline-parallel-degree"]) == ("2", "2")
    assert a["--parallelism.data-parallel-shard-degree"] == "2"
    assert a["--parallelism.data-parallel-replicate-degree"] == "1"
    assert a["--parallelism.pipeline-parallel-schedule"] == "GPipe"
    assert a["--parallelism.pipeline-parallel-microbatch-size"] == "2"
    assert a["--parallelism.pipeline-parallel-layers-per-stage"] == "3"
    assert a["--parallelism.fsdp-reshard-after-forward"] == "always"
    assert a["--training.global-batch-size"] == "32" and a["--training.local-batch-size"] == "16"
    assert text.rstrip().endswith("activation-checkpoint:full")
    ddp = _args(export(Plan.parse("dp=4,micro_batch=2,global_batch=16"), "torchtitan", TITAN_CFG))
    assert ddp["--parallelism.data-parallel-replicate-degree"] == "4"
    assert ddp["--training.local-batch-size"] == "2"


@pytest.mark.parametrize("fmt", ["megatron", "deepspeed", "torchtitan"])
def test_heterogeneous_plans_are_refused_with_the_reason(fmt):
    cfg = TITAN_CFG if fmt == "torchtitan" else CFG
    uneven_layers = Plan.parse("dp=1,pp=2,micro_batch=1,global_batch=4,layer_split=4:2")
    with pytest.raises(ExportError, match="layer_split"):
        export(uneven_layers, fmt, cfg)
    shares = Plan(dp=2, micro_batch=1, global_batch=4, dp_shares=[0.75, 0.25])
    with pytest.raises(ExportError, match="dp_shares"):
        export(shares, fmt, cfg)
    assert heterogeneous_reasons(Plan.parse("dp=2,micro_batch=1,global_batch=4")) == []
    assert heterogeneous_reasons(Plan.parse("pp=2,micro_batch=1,global_batch=2,layer_split=5:5")) == []


def test_bad_format_and_incomplete_model_config():
    plan = Plan.parse("dp=2,micro_batch=1,global_batch=4")
    with pytest.raises(ExportError, match="unknown format"):
        export(plan, "alpa", CFG)
    with pytest.raises(ExportError, match="'heads'"):
        export(plan, "megatron", {"layers": 2, "hidden": 64, "seq": 8, "vocab": 10})


def test_gradient_reduction_dtype_is_exported():
    fp16_fp32 = Plan(dp=2, micro_batch=1, global_batch=2, dtype="fp16", grad_reduce_dtype="fp32")
    assert "--accumulate-allreduce-grads-in-fp32" in export(fp16_fp32, "megatron", CFG)
    bf16 = Plan(dp=2, micro_batch=1, global_batch=2)  # Megatron's default: fp32 grads, no flag
    assert "grads-in-fp32" not in export(bf16, "megatron", CFG)
    assert "--grad-reduce-in-bf16" in export(Plan(dp=2, micro_batch=1, global_batch=2, grad_reduce_dtype="bf16"),
                                             "megatron", CFG)
    assert '"communication_data_type": "fp32"' in export(bf16, "deepspeed", CFG)
    # torchtitan 0.3 reduces in float32 and computes in bfloat16 or float32 only: the rest is refused
    assert "--training.mixed-precision-reduce float32" in export(bf16, "torchtitan", TITAN_CFG)
    with pytest.raises(ExportError, match="'dtype'.*fp16"):
        export(Plan(dp=2, micro_batch=1, global_batch=2, dtype="fp16"), "torchtitan", TITAN_CFG)
    with pytest.raises(ExportError, match="grad_reduce_dtype"):
        export(Plan(dp=2, micro_batch=1, global_batch=2, grad_reduce_dtype="bf16"), "torchtitan", TITAN_CFG)


def test_slurm_script_runs_the_plan_with_plait_run_one_task_per_node():
    from plait.cluster.loader import parse_yaml_text

    cluster = parse_yaml_text("name: m\nnodes:\n  - {name: gpu01, gpus: {kind: a100-80gb, count: 8}}\n"
                              "  - {name: gpu02, gpus: {kind: v100-32gb, count: 2}}\n"
                              "  - {name: gpu03, gpus: {kind: v100-32gb, count: 2}}\n", source="m.yaml")
    plan = Plan.parse("dp=1,pp=2,micro_batch=1,global_batch=8,layer_split=6:2,device_order=0:8")  # gpu01, gpu02
    launch = {"model": "gpt:layers=8,hidden=64", "cluster_file": "m.yaml", "plan_file": "plan.json"}
    text = export(plan, "slurm", CFG, cluster, launch)
    directives = [line.split()[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["--job-name=plait", "--nodes=2", "--ntasks-per-node=1", "--time=01:00:00",
                          "--exclusive", "--nodelist=gpu01,gpu02"]  # uneven GPU counts: whole nodes by name
    srun = text[text.index("srun"):].replace("\\\n", " ").split()
    assert srun[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert srun[3:11] == ["plait", "run", "--model", "'gpt:layers=8,hidden=64'", "--cluster", "m.yaml",
                          "--plan", "plan.json"]
    assert "--nnodes" not in srun  # inside srun, plait run reads SLURM_* itself
    even = export(Plan.parse("dp=4,micro_batch=1,global_batch=8,device_order=8:9:10:11"), "slurm", CFG, cluster, launch)
    assert "#SBATCH --gpus-per-node=2" in even and "#SBATCH --nodes=2" in even and "--exclusive" not in even
    with pytest.raises(ExportError, match="--out PLAN.json"):
        export(plan, "slurm", CFG, cluster, {"model": "gpt", "cluster_file": "m.yaml", "plan_file": None})


def test_training_settings_reach_every_export():
    """A plait run and its exported run train alike: lr schedule, weight decay, clipping, steps."""
    from plait.planners.export import Training, run_training_flags

    t = Training(lr=3e-4, min_lr=3e-5, warmup_iters=10, decay_style="cosine", decay_iters=90, weight_decay=0.1,
                 clip_grad=1.0, steps=100)
    plan = Plan(dp=2, micro_batch=1, global_batch=2)
    mega = export(plan, "megatron", CFG, training=t)
    for flag in ("--train-iters 100", "--lr 0.0003", "--min-lr 3e-05", "--lr-warmup-iters 10",
                 "--lr-decay-style cosine", "--lr-decay-iters 90", "--weight-decay 0.1", "--clip-grad 1"):
        assert flag in mega, flag
    ds = export(plan, "deepspeed", CFG, training=t)
    assert '"gradient_clipping": 1.0' in ds and "--lr-decay-style cosine" in ds
    titan = export(plan, "torchtitan", TITAN_CFG, training=t)
    for flag in ("--optimizer.param-groups.0.optimizer-kwargs.lr 0.0003",
                 "--optimizer.param-groups.0.optimizer-kwargs.weight-decay 0.1", "--lr-scheduler.warmup-steps 10",
                 "--lr-scheduler.decay-type cosine", "--lr-scheduler.min-lr-factor 0.1", "--training.max-norm 1",
                 "--training.steps 100", "--lr-scheduler.decay-ratio 0.9"):
        assert flag in titan, flag
    # no clipping in plait (the default) is no clipping in Megatron and DeepSpeed, not their 1.0 default
    assert "--clip-grad 0" in export(plan, "megatron", CFG) and '"gradient_clipping": 0.0' in export(plan, "deepspeed", CFG)
    assert run_training_flags(t)[:2] == ["--steps 100", "--lr 0.0003"] and "--clip-grad 1" in run_training_flags(t)
    with pytest.raises(ExportError, match="decay style"):
        Training(decay_style="step")
