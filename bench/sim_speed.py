"""Simulator speed: GPT-3 175B, one iteration, on 64 ... 4096 A100s.

Target (issue 3): tp 8, pp 16, dp 8, 1F1B, 64 micro-batches on 1024 A100s simulates in
under 10 s. Rows: the target configuration at "auto" granularity (one task per stage
and micro-batch, tensor-parallel collectives folded into the compute tasks) and at
"layer" granularity (a task per layer segment, every tensor-parallel all-reduce a flow
on the NVLink ring), then the scaling from 64 to 4096 GPUs with 64 micro-batches per
replica, and a heterogeneous cluster where replicas differ and all are simulated.

Symmetry: on a homogeneous cluster every data-parallel replica of a stage is
equivalent, so replica 0's pipeline is simulated and stands for the others (its
data-parallel all-reduce still runs over all replicas' links); tensor ranks are
represented by their group. The "simulated" column says how many workers (stage x
replica pipelines) were simulated. The baseline is the same simulation with symmetry
off (every replica simulated), measured in the same run.

The OpGraph is `plait.graph.gpt_closed_form.gpt_opgraph` (closed form, identical to the capture for
the zoo's GPT; see tests/test_sim_gpt.py); its construction time is shown apart.

Usage: ``python bench/sim_speed.py [--max-gpus 4096] [--no-baseline]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.cluster import load_cluster  # noqa: E402
from plait.graph.gpt_closed_form import gpt_opgraph  # noqa: E402
from plait.ir.plan import Plan  # noqa: E402
from plait.net.view import ClusterView  # noqa: E402
from plait.sim.api import simulate  # noqa: E402

GPT3 = {"layers": 96, "hidden": 12288, "heads": 96, "seq": 2048, "vocab": 50257}
MICRO_BATCHES = 64


def run(graph, view, plan: Plan, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    res = simulate(graph, view, plan, memory=False, **kw)
    return time.perf_counter() - t0, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-gpus", type=int, default=4096)
    ap.add_argument("--no-baseline", action="store_true", help="skip the symmetry-off baseline")
    args = ap.parse_args(argv)
    console = Console(width=160)
    t0 = time.perf_counter()
    graph = gpt_opgraph(GPT3, "bf16")
    console.print(f"GPT-3 175B OpGraph (closed form): {len(graph.layers)} layers, {len(graph.ops)} ops, "
                  f"{graph.param_count / 1e9:.1f} B parameters, built in {time.perf_counter() - t0:.2f} s")

    table = Table(title="one training iteration of GPT-3 175B, 1F1B, 64 micro-batches per replica")
    for c in ("GPUs", "cluster", "tp/pp/dp", "granularity", "simulated", "tasks", "sim s", "tasks/s",
              "iteration s", "TFLOP/s/GPU", "baseline (no symmetry) s"):
        table.add_column(c, justify="right")

    def row(gpus: int, cluster_name: str, view: ClusterView, plan: Plan, granularity: str = "auto",
            baseline: bool = False) -> None:
        wall, res = run(graph, view, plan, granularity=granularity)
        base = "-"
        if baseline and not args.no_baseline:
            bwall, bres = run(graph, view, plan, granularity=granularity, symmetry=False)
            assert abs(bres.iteration_time_s / res.iteration_time_s - 1) < 1e-6, "symmetry changed the result"
            base = f"{bwall:.2f} ({bres.num_tasks} tasks)"
        workers = len(res.busy_fraction)  # compute streams simulated (one per worker)
        table.add_row(str(gpus), cluster_name, f"{plan.tp}/{plan.pp}/{plan.dp}", res.granularity, str(workers),
                      str(res.num_tasks), f"{wall:.2f}", f"{res.num_tasks / wall:,.0f}",
                      f"{res.iteration_time_s:.2f}", f"{res.tflops_per_gpu:.0f}", base)
        console.print(f"  {gpus} GPUs {res.granularity}: {wall:.2f} s, {res.symmetry}")

    views: dict[int, ClusterView] = {}

    def view_for(gpus: int) -> ClusterView:
        if gpus not in views:
            views[gpus] = ClusterView.from_cluster(load_cluster(f"a100-80g:nodes={gpus // 8}"))
        return views[gpus]

    # The target configuration.
    target = Plan(dp=8, tp=8, pp=16, micro_batch=1, global_batch=8 * MICRO_BATCHES, recompute="full")
    t0 = time.perf_counter()
    v1024 = view_for(1024)
    console.print(f"cluster a100-80g:nodes=128 loaded in {time.perf_counter() - t0:.2f} s")
    row(1024, "a100-80g x128", v1024, target, "auto", baseline=True)
    row(1024, "a100-80g x128", v1024, target, "layer")
    # Scaling.
    for gpus in (64, 128, 256, 512, 2048, 4096):
        if gpus > args.max_gpus:
            continue
        pp = 8 if gpus == 64 else 16
        dp = gpus // (8 * pp)
        plan = Plan(dp=dp, tp=8, pp=pp, micro_batch=1, global_batch=dp * MICRO_BATCHES, recompute="full")
        row(gpus, f"a100-80g x{gpus // 8}", view_for(gpus), plan)
    # Heterogeneous: half A100 nodes, half V100 nodes; even replicas on A100s, odd ones on V100s
    # with 1.6x the samples on the faster kind (HAP-style shares). Replicas differ, so every one
    # of the 8 x 16 workers is simulated.
    mixed = ClusterView.from_cluster(load_cluster("mixed-a100-v100:a100_nodes=64,v100_nodes=64"))
    a100 = [n for n in range(128) if mixed.kinds[8 * n].name.startswith("a100")]
    v100 = [n for n in range(128) if n not in a100]
    order = []
    for _p in range(16):
        for d in range(8):
            node = a100.pop() if d % 2 == 0 else v100.pop()
            order += [8 * node + t for t in range(8)]
    fast, slow = 1.6 / (4 * 2.6), 1.0 / (4 * 2.6)
    # fp16: V100s have no bf16 tensor cores (the catalog falls back to their FP32 rate).
    het = Plan(dp=8, tp=8, pp=16, micro_batch=1, global_batch=8 * MICRO_BATCHES, recompute="full",
               device_order=order, dp_shares=[fast, slow] * 4, dtype="fp16")
    row(1024, "A100+V100 64+64", mixed, het)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
