"""Search time of `plait plan` at scale: GPT-3 175B on 1024 GPUs (SYSTEMS.md §2, issue 4).

    python bench/plan_search_time.py                       # large-mixed:nodes=128, global batch 1536
    python bench/plan_search_time.py --nodes 64 --finalists 8

Cluster: the `large-mixed` preset -- 128 nodes x 8 GPUs, A100-80GB in the first half and
V100-32GB in the second, a leaf/spine fabric and a seeded 10 % of node pairs at a quarter
of the NIC bandwidth. Model: the zoo's GPT-3 175B (96 layers, hidden 12288, 96 heads,
seq 2048). Global batch 1536 (GPT-3's 3.2M tokens).

Prints the time of each phase (the model graph, enumeration + memory pruning + analytic
ranking, placement + simulation of the finalists), the candidates enumerated, pruned by
the memory estimator (by reason), ranked analytically and simulated, and the top plans.
Target (issue 4): the whole search under 60 s on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt:size=175b")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--finalists", type=int, default=8)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)

    from plait.cluster import load_cluster
    from plait.search import auto_dtype, load_graph, plan

    console = Console(width=160)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    cluster = load_cluster(f"large-mixed:nodes={args.nodes}")
    phases["cluster"] = time.perf_counter() - t0
    t = time.perf_counter()
    load_graph(args.model, auto_dtype(cluster))
    phases["model graph"] = time.perf_counter() - t
    marks: dict[str, float] = {}

    def on_progress(phase: str, done: int, total: int) -> None:
        marks.setdefault(phase + " start", time.perf_counter())
        if done == total:
            marks[phase + " end"] = time.perf_counter()

    t = time.perf_counter()
    res = plan(args.model, cluster, global_batch=args.global_batch, top=args.top, finalists=args.finalists,
               on_progress=on_progress)
    t_search = time.perf_counter() - t
    total = time.perf_counter() - t0
    phases["enumerate + memory + analytic"] = marks.get("simulate start", t + t_search) - t
    phases["place + simulate finalists"] = t_search - phases["enumerate + memory + analytic"]

    console.print(f"[bold]{args.model}[/] on [bold]{cluster.name}[/] ({cluster.num_devices} GPUs: "
                  + ", ".join(f"{n} x {k}" for k, n in _kinds(cluster).items())
                  + f"), global batch {args.global_batch}")
    t1 = Table(title="search time")
    t1.add_column("phase")
    t1.add_column("seconds", justify="right")
    for k, v in phases.items():
        t1.add_row(k, f"{v:.1f}")
    t1.add_row("[bold]total", f"[bold]{total:.1f}")
    console.print(t1)
    t2 = Table(title="candidates")
    t2.add_column("stage")
    t2.add_column("count", justify="right")
    t2.add_row("enumerated", str(res.enumerated))
    for reason, n in sorted(res.pruned_reasons.items(), key=lambda x: -x[1]):
        t2.add_row(f"pruned: {reason}", str(n))
    t2.add_row("memory estimates computed", str(res.memory_checked))
    t2.add_row("fit, ranked analytically", str(res.ranked_analytic))
    t2.add_row("placed + simulated", str(res.simulated))
    console.print(t2)
    t3 = Table(title=f"top {len(res.top)}")
    for col in ("#", "plan", "layout", "analytic", "simulated", "TFLOP/s/GPU"):
        t3.add_column(col)
    for i, c in enumerate(res.top, 1):
        t3.add_row(str(i), _short(c.plan), c.layout, f"{c.analytic_s:.2f} s",
                   f"{c.iteration_time_s:.2f} s", f"{c.tflops_per_gpu:.1f}")
    console.print(t3)
    b = res.best
    if b.placement is not None and b.default_order_time_s:
        console.print(f"best plan: Pipette placement {b.placement.cost:.2f} s vs {b.placement.default_cost:.2f} s of "
                      f"path-model communication in the default order; simulated {b.iteration_time_s:.2f} s vs "
                      f"{b.default_order_time_s:.2f} s ({b.default_order_time_s / b.iteration_time_s:.3f}x)")
    verdict = "[green]under[/]" if total < 60 else "[red]over[/]"
    console.print(f"whole search {total:.1f} s: {verdict} the 60 s target")
    return 0


def _kinds(cluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in cluster.devices:
        out[d.kind.name] = out.get(d.kind.name, 0) + 1
    return out


def _short(plan) -> str:
    text = f"dp{plan.dp} tp{plan.tp} pp{plan.pp} mb{plan.micro_batch} {plan.recompute} z{plan.zero} {plan.schedule}"
    if plan.virtual_stages > 1:
        text += f"x{plan.virtual_stages}"
    if plan.sequence_parallel:
        text += " sp"
    if plan.layer_split is not None:
        text += " layers " + ":".join(map(str, plan.layer_split))
    if plan.dp_shares is not None:
        counts = sorted(set(plan.samples_per_replica()), reverse=True)
        text += " batch/replica " + "|".join(map(str, counts))
    if plan.device_order is not None:
        text += " placed"
    return text


if __name__ == "__main__":
    sys.exit(main())
