"""A plain torch training script -- DDP, FSDP2 or a pipeline -- as a user writes one, launched by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/plain_torch_train.py \
        --mode ddp --model "gpt:layers=4,hidden=256,heads=4,seq=64,vocab=1024" \
        --micro-batch 4 --global-batch 16 --steps 10 --out /tmp/plain

The baseline of `bench/torch_overhead.py` (issue 29: plait's torch engine against plain torch on
the same model, batch and ranks). Only the model and its synthetic samples come from plait (the
zoo's module and `make_samples`, so both sides train the same thing on the same data); the rest is
torch: gloo, `DistributedDataParallel` (buckets of `--bucket-mb`, `no_sync` for all micro-batches
but the last) or FSDP2 `fully_shard` per layer then the root (`reshard_after_forward` for ZeRO-3,
False for ZeRO-1/2), or (`--mode pp`, GPT only, one rank per stage) a two-stage pipeline on
`torch.distributed.pipelining` -- the embedding and the first `--split` layers, then the rest and
the head, as `PipelineStage`s run by torch's `Schedule1F1B`, the tied embedding's gradients summed
across the two stages (as Megatron and plait do) --; AdamW, the mean loss over the global batch.

Each rank appends one line per step to ``OUT/rankN.jsonl``: the step's start and end
(`time.time()`, the samples made before the start, as plait's engines make them before theirs)
and `time.process_time()` at its end (all the process's threads) and `time.thread_time()` (the main
thread's), and the replica's mean loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("ddp", "fsdp2", "pp"), required=True)
    ap.add_argument("--model", required=True, help="a plait zoo model string")
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--zero", type=int, default=3, help="FSDP2: 3 reshards after forward, 1/2 keep them")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (plait's default)")
    ap.add_argument("--split", type=int, default=2, help="pp: transformer layers on the first stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from plait.graph.zoo import load_model
    from plait.runtime.partition import make_samples
    from plait.runtime.torch_worker import fsdp_units

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    spec = load_model(args.model)
    model = spec.build(seed=args.seed)
    if args.mode == "pp":
        return pipeline(args, spec, model, rank, world)
    if args.mode == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:
        from torch.distributed.fsdp import fully_shard

        for unit in fsdp_units(model):  # the same units as plait's: one per layer that shares nothing
            fully_shard(unit, reshard_after_forward=args.zero >= 3)
        runner = fully_shard(model, reshard_after_forward=args.zero >= 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_replica = args.global_batch // world
    micro = per_replica // args.micro_batch
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"rank{rank}.jsonl", "w")
    for step in range(args.steps):
        first = step * args.global_batch + rank * per_replica
        data = [make_samples(spec, first + i * args.micro_batch, args.micro_batch, args.seed, torch.device("cpu"))
                for i in range(micro)]
        t0 = time.time()
        total = torch.zeros(())
        for i, (inputs, target) in enumerate(data):
            sync = runner.no_sync() if args.mode == "ddp" and i < micro - 1 else contextlib.nullcontext()
            with sync:
                loss = spec.loss(runner(*inputs), target) / micro
                loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        log.write(json.dumps({"step": step, "t0": t0, "t1": t1, "cpu": time.process_time(),
                              "main_cpu": time.thread_time(),
                              "loss": float(total)}) + "\n")
        log.flush()
    log.close()
    dist.destroy_process_group()
    return 0


class _Front(torch.nn.Module):
    """The first stage: the embedding and the first `split` transformer layers."""

    def __init__(self, gpt: torch.nn.Module, split: int) -> None:
        super().__init__()
        self.embed, self.layers = gpt.embed, torch.nn.ModuleList(gpt.layers[:split])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x.contiguous()


class _Back(torch.nn.Module):
    """The last stage: the remaining layers and the LM head."""

    def __init__(self, gpt: torch.nn.Module, split: int) -> None:
        super().__init__()
        self.layers, self.head = torch.nn.ModuleList(gpt.layers[split:]), gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _ContiguousGrad.apply(x)  # gloo sends contiguous tensors only; the [s, b, h] gradient is not
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def pipeline(args: argparse.Namespace, spec: object, model: torch.nn.Module, rank: int, world: int) -> int:
    """`--mode pp`: one stage per rank (world = 2), torch's Schedule1F1B over the global batch."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from plait.runtime.partition import make_samples

    assert world == 2, "--mode pp runs two stages, one per rank"
    stage_module = _Front(model, args.split) if rank == 0 else _Back(model, args.split)
    micro = args.global_batch // args.micro_batch
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    loss_fn = lambda out, target: spec.loss(out, target) / micro  # noqa: E731 -- the mean over the micro-batches
    schedule = Schedule1F1B(stage, micro, loss_fn=loss_fn, scale_grads=False)
    tied = model.embed.tok.weight  # = model.head.lm.weight: held by both stages, its gradients summed
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"rank{rank}.jsonl", "w")
    for step in range(args.steps):
        inputs, target = make_samples(spec, step * args.global_batch, args.global_batch, args.seed,
                                      torch.device("cpu"))
        t0 = time.time()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(*inputs)
        else:
            schedule.step(target=target, losses=losses)
        dist.all_reduce(tied.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        log.write(json.dumps({"step": step, "t0": t0, "t1": t1, "cpu": time.process_time(),
                              "main_cpu": time.thread_time(),
                              "loss": float(sum(losses)) if losses else None}) + "\n")
        log.flush()
    log.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
