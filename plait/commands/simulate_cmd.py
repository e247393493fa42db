"""`plait simulate`: predict one training iteration of a model under a plan on a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from plait.commands.training_args import add_memory_args, memory_kwargs_of, precision_of


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
    add_memory_args(p)
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="each gradient bucket (the plan's grad_bucket_mb) is all-reduced as soon as its "
                        "layers' backward ends (WFBP; DDP, Megatron --overlap-grad-reduce); default: "
                        "the buckets are reduced after the backward, as plait's runtime does")
    p.add_argument("--capture", action="store_true",
                   help="always capture the model (default: GPT zoo specs over 24 layers use the closed form)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from plait.errors import check_output_path
    from plait.ir.plan import Plan
    from plait.sim.api import simulate

    check_output_path(args.trace, "--trace")
    check_output_path(args.gantt, "--gantt")
    res = simulate(args.model, args.cluster, args.plan, granularity=args.granularity,
                   symmetry=not args.no_symmetry,
                   overlap_grad_reduce=args.overlap_grad_reduce,
                   analytic=False if args.capture else None, memory_options=memory_kwargs_of(args),
                   precision=precision_of(args))
    written = []
    if args.trace:
        res.save_chrome_trace(args.trace)
        written.append(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.gantt:
        res.save_gantt(args.gantt)
        written.append(f"Gantt chart written to {args.gantt}")
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        _print_table(res, Plan.load(args.plan).dtype)
        _print_critical_path(res.critical_path, res.iteration_time_s)
    for line in written:  # stderr under --json, so that stdout stays one JSON document
        print(line, file=sys.stderr if args.json else sys.stdout)
    return _memory_verdict(res)


def critical_path_segments(path: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The critical path with consecutive tasks on the same resource and category merged:
    [{resource, category, tasks, start_s, end_s, first, last}] in time order."""
    segs: list[dict[str, Any]] = []
    for t in path:
        if segs and segs[-1]["resource"] == t["resource"] and segs[-1]["category"] == t["category"]:
            segs[-1].update(tasks=segs[-1]["tasks"] + 1, end_s=t["end_s"], last=t["name"])
        else:
            segs.append({"resource": t["resource"], "category": t["category"], "tasks": 1, "start_s": t["start_s"],
                         "end_s": t["end_s"], "first": t["name"], "last": t["name"]})
    return segs


def _print_critical_path(path: list[dict[str, Any]], total_s: float, max_rows: int = 12) -> None:
    """The chain of tasks that sets the iteration time (Shi et al.'s DAG model): merged per
    resource and category, the longest segments kept when there are more than `max_rows`."""
    from rich.console import Console
    from rich.table import Table

    if not path:
        return
    segs = critical_path_segments(path)
    by_cat: dict[str, float] = {}
    for s in segs:
        by_cat[s["category"]] = by_cat.get(s["category"], 0.0) + s["end_s"] - s["start_s"]
    shown = sorted(sorted(segs, key=lambda s: s["start_s"] - s["end_s"])[:max_rows], key=lambda s: s["start_s"])
    t = Table(title=f"critical path: {len(path)} tasks in {len(segs)} segments over {total_s * 1e3:.2f} ms ("
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
                         if v * 1e3 >= 0.005) + ")")
    for col in ("start ms", "ms", "resource", "category", "tasks"):
        t.add_column(col, justify="right" if col in ("start ms", "ms") else "left")
    for s in shown:
        first, last = s["first"], s["last"]
        t.add_row(f"{s['start_s'] * 1e3:.2f}", f"{(s['end_s'] - s['start_s']) * 1e3:.2f}", s["resource"],
                  s["category"], f"{s['tasks']}" + (f" ({first} .. {last})" if first != last else f" ({first})"))
    if len(shown) < len(segs):
        t.caption = f"{len(segs) - len(shown)} shorter segments not shown (--json lists every task)"
    Console(file=sys.stdout).print(t)


def _memory_verdict(res: Any) -> int:
    """Exit code 1, with one line per GPU that runs out of memory (which GPU, by how much), when
    the plan does not fit: a prediction of a plan that cannot run must not look like a success."""
    if res.memory is None or res.fits_memory:
        return 0
    for v in res.memory.violations:
        print(f"plait simulate: error: plan {v}", file=sys.stderr)
    return 1


def _print_table(res: Any, dtype: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout)
    t = Table(title=f"plait simulate: {res.model} | {res.plan} | {res.cluster}", show_header=False)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("iteration time", f"{res.iteration_time_s * 1e3:.2f} ms")
    t.add_row("training dtype", dtype)
    if res.costs:  # measured (a model profile) vs modelled, issue 28
        t.add_row("costs", res.costs)
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
