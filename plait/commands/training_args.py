"""The training flags `plait run` trains with and `plait plan --export` writes into the exported
launch (Megatron-LM's names), defined once for both commands."""

from __future__ import annotations

import argparse
from typing import Any


def add_training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay (Megatron-LM)")
    p.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up from 0 over these steps")
    p.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    p.add_argument("--lr-decay-iters", type=int, default=None, help="steps of the decay (default: --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay (AdamW)")
    p.add_argument("--clip-grad", metavar="N", type=float, default=None,
                   help="clip the global gradient norm (over every shard of the plan) to N (Megatron's --clip-grad)")


def training_of(args: argparse.Namespace) -> Any:
    """The `plait.planners.export.Training` the flags describe (steps: --steps)."""
    from plait.planners.export import Training

    return Training(lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                    decay_style=args.lr_decay_style, decay_iters=args.lr_decay_iters,
                    weight_decay=args.weight_decay, clip_grad=args.clip_grad, steps=args.steps)


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """The memory model's framework choices (`plait.cost.memory.estimate_memory`)."""
    from plait.cost.memory import OPTIMIZERS, PRECISIONS

    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer kind of the memory estimate: fused Adam (Megatron/Apex, "
                                        "default), PyTorch's foreach or per-tensor Adam, SGD")
    p.add_argument("--loss", choices=("eager", "fused"), default="eager",
                   help="cross-entropy as PyTorch computes it (eager, default) or Megatron's fused loss")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="how a bf16 / fp16 plan trains: amp, as plait's engines do (fp32 parameters, ops "
                        "under autocast: the model captured so, its memory checked so; default) or megatron "
                        "(the model in that dtype with fp32 main parameters: Megatron-LM, DeepSpeed; the "
                        "default with --export megatron / deepspeed)")


def memory_kwargs_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"optimizer": args.optimizer, "loss": args.loss}


def precision_of(args: argparse.Namespace) -> str:
    """`--precision`, else the engine the plan is for: Megatron-LM's and DeepSpeed's exports keep
    the model in the plan's dtype; plait's engines (and torchtitan's FSDP2) train under autocast."""
    if args.precision:
        return args.precision
    return "megatron" if getattr(args, "export", None) in ("megatron", "deepspeed") else "amp"
