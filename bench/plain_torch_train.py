"""A plain torch training script -- DDP or FSDP2 -- as a user writes one, launched by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/plain_torch_train.py \
        --mode ddp --model "gpt:layers=4,hidden=256,heads=4,seq=64,vocab=1024" \
        --micro-batch 4 --global-batch 16 --steps 10 --out /tmp/plain

The baseline of `bench/torch_overhead.py` (issue 29: plait's torch engine against plain torch on
the same model, batch and ranks). Only the model and its synthetic samples come from plait (the
zoo's module and `make_samples`, so both sides train the same thing on the same data); the rest is
torch: gloo, `DistributedDataParallel` (buckets of `--bucket-mb`, `no_sync` for all micro-batches
but the last) or FSDP2 `fully_shard` per layer then the root (`reshard_after_forward` for ZeRO-3,
False for ZeRO-1/2), AdamW, the mean loss over the global batch.

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
    ap.add_argument("--mode", choices=("ddp", "fsdp2"), required=True)
    ap.add_argument("--model", required=True, help="a plait zoo model string")
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--zero", type=int, default=3, help="FSDP2: 3 reshards after forward, 1/2 keep them")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (plait's default)")
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


if __name__ == "__main__":
    raise SystemExit(main())
