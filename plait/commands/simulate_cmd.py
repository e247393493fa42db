"""`plait simulate`: predict one training iteration of a model under a plan on a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="predict iteration time, throughput, memory and the timeline of a plan",
        description="Lower (model, plan, cluster) to a task DAG and simulate it with link contention.",
    )
    p.add_argument("--model", required=True, help="zoo spec (gpt:layers=24,hidden=1024), file.py:factory "
                   "or an OpGraph JSON file")
    p.add_argument("--cluster", required=True, help="cluster preset (a100-80g:nodes=2) or YAML file")
    p.add_argument("--plan", required=True, help="plan string (dp=2,tp=2,pp=2,micro_batch=4,global_batch=64) "
                   "or plan JSON file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace-event JSON")
    p.add_argument("--gantt", metavar="FILE", help="write a PNG Gantt chart")
    p.add_argument("--granularity", choices=("auto", "layer", "stage"), default="auto",
                   help="task granularity: one task per layer segment, or per stage and micro-batch")
    p.add_argument("--no-symmetry", action="store_true", help="simulate every replica even when equivalent")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="data-parallel gradient buckets (MiB) overlapping the backward (WFBP); "
                        "default: one reduction after the backward (Megatron)")
    p.add_argument("--capture", action="store_true",
                   help="always capture the model (default: GPT zoo specs over 24 layers use the closed form)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from plait.sim.api import simulate

    res = simulate(args.model, args.cluster, args.plan, granularity=args.granularity,
                   symmetry=not args.no_symmetry,
                   bucket_bytes=args.bucket_mb * 2**20 if args.bucket_mb else None,
                   analytic=False if args.capture else None)
    if args.trace:
        res.save_chrome_trace(args.trace)
    if args.gantt:
        res.save_gantt(args.gantt)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    _print_table(res)
    return 0


def _print_table(res: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout)
    t = Table(title=f"plait simulate: {res.model} | {res.plan} | {res.cluster}", show_header=False)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("iteration time", f"{res.iteration_time_s * 1e3:.2f} ms")
    t.add_row("throughput", f"{res.throughput_samples_per_s:.2f} samples/s")
    # Both conventions, named: model FLOPs (recompute excluded, MFU's numerator) and hardware
    # FLOPs (recompute included, what Megatron-LM's papers report as achieved TFLOP/s).
    t.add_row("model TFLOP/s/GPU (no recompute)", f"{res.model_tflops_per_gpu:.1f}")
    t.add_row("hardware TFLOP/s/GPU (with recompute)", f"{res.hardware_tflops_per_gpu:.1f}")
    t.add_row("exposed communication", f"{res.exposed_comm_s * 1e3:.2f} ms")
    if res.memory_peak_bytes:
        peak = max(res.memory_peak_bytes)
        t.add_row("memory peak (max over GPUs)", f"{peak / 2**30:.2f} GiB")
        t.add_row("fits memory", "yes" if res.fits_memory else "NO")
    t.add_row("tasks simulated", f"{res.num_tasks} ({res.granularity} granularity, {res.sim_wall_s:.2f} s)")
    t.add_row("symmetry", res.symmetry)
    busy = res.busy_fraction
    if busy:
        t.add_row("compute busy (min / max)", f"{min(busy.values()):.0%} / {max(busy.values()):.0%}")
    console.print(t)
    cats = Table(title="time by category (summed over simulated streams)")
    cats.add_column("category")
    cats.add_column("ms", justify="right")
    for k, v in sorted(res.breakdown.items(), key=lambda kv: -kv[1]):
        if v > 0:
            cats.add_row(k, f"{v * 1e3:.2f}")
    console.print(cats)
    if res.memory is not None and getattr(res.memory, "violations", None):
        for v in res.memory.violations:
            console.print(f"[red]memory: {v}[/red]")
