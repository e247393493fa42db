"""Peak memory of a data-parallel replica as plait's torch engine runs it, measured: DDP or FSDP2
over `dp` CPU processes (gloo), the figure `plait.cost.memory` is held against for data
parallelism in low precision (bench/memory_error.py table (f), tests/test_memory.py).

Each process builds the zoo model, wraps it as the torch engine does (`plait.runtime.parallelize`:
`apply_ddp` at ZeRO-0 -- gradients as bucket views -- and `apply_fsdp` at ZeRO >= 1: each
transformer block a unit, then the root, `reshard_after_forward` at ZeRO-3, the plan's
MixedPrecisionPolicy), runs a warm-up step (Adam's state made) and then one step under PyTorch's
memory tracker -- `FSDPMemTracker` for FSDP2 (it tells sharded from gathered parameters and
gradients), `MemTracker` for DDP -- with its forward and loss under autocast in the plan's dtype, as
the engine runs them. Rank 0's peak is returned (the replicas are alike).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from plait.measure.step_memory import MeasuredPeak


def measure_data_parallel_peak(model: str, plan: str, *, optimizer: str = "adam-loop",
                               timeout: float = 300.0) -> MeasuredPeak:
    """Peak bytes of one steady-state step of zoo `model` under the data-parallel `plan` (a plan
    string: dp, zero, micro_batch, dtype; one micro-batch per replica), on rank 0. The replicas are
    spawned from a fresh interpreter (`python -m plait.measure.replica_memory`), so no caller's
    main module is imported again in them."""
    from plait.ir.plan import Plan

    p = Plan.parse(plan)
    if p.pp > 1 or p.tp > 1 or p.num_micro_batches != 1 or p.dp < 2:
        raise ValueError(f"plan {plan!r}: data parallelism alone (dp >= 2), one micro-batch per replica")
    done = subprocess.run([sys.executable, "-m", "plait.measure.replica_memory", model, plan, optimizer],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"measure_data_parallel_peak({model!r}, {plan!r}) failed:\n{done.stderr[-2000:]}")
    peak, cats = json.loads(done.stdout.strip().splitlines()[-1])
    return MeasuredPeak(peak_bytes=int(peak), by_category=cats)


def _spawn(model: str, plan: str, optimizer: str) -> tuple[int, dict[str, int]]:
    import torch.multiprocessing as mp

    from plait.ir.plan import Plan
    from plait.net.ports import free_port

    dp = Plan.parse(plan).dp
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_replica, args=(dp, model, plan, optimizer, free_port(), out), nprocs=dp, start_method="spawn")
    return out.get()


def _replica(rank: int, world: int, model: str, plan_text: str, optimizer: str, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from plait.graph.zoo import load_model
    from plait.ir.plan import Plan
    from plait.measure.step_memory import _autocast_dtype, _make_optimizer
    from plait.runtime.parallelize import apply_ddp, apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plan = Plan.parse(plan_text)
        spec = load_model(model)
        torch.manual_seed(0)
        module = spec.build("cpu")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        if plan.zero == 0:
            wrapped = apply_ddp(module, mesh, plan)
        else:
            wrapped = apply_fsdp(module, mesh, plan, list(module.layers))
        opt = _make_optimizer(wrapped, optimizer)
        inputs, target = spec.sample_batch(plan.micro_batch, seed=rank)
        low = _autocast_dtype(plan.dtype if plan.dtype in ("bf16", "fp16") else None)

        def step() -> None:
            # the usual loop, as measure_step_peak's: the outputs stay referenced through backward
            with torch.autocast("cpu", dtype=low) if low is not None else torch.autocast("cpu", enabled=False):
                out = wrapped(*inputs)
                loss = spec.loss(out, target)
            loss.backward()
            opt.step()
            # DDP's gradients are views into its buckets, allocated once: kept as views (not set to
            # None, which leaves the buckets allocated but out of the tracker's sight)
            opt.zero_grad(set_to_none=plan.zero > 0)

        step()  # Adam's state made, as in every step after the first
        if plan.zero == 0:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker: Any = MemTracker()
            tracker.track_external(wrapped, opt)
        else:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            tracker = FSDPMemTracker(wrapped, opt)
            tracker.track_inputs(inputs)
        with tracker:
            step()
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
        if rank == 0:
            out.put((int(snap["Total"]), {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(_spawn(*sys.argv[1:4])))
