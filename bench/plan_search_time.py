"""Search time of `plait plan` at scale: GPT-3 175B on 1024 GPUs, every family (issue 17 item 3).

    python bench/plan_search_time.py                       # large-mixed:nodes=128, global batch 1536
    python bench/plan_search_time.py --nodes 64 --finalists 8
    python bench/plan_search_time.py --quick --json        # a smoke run on 2 nodes

Cluster: the `large-mixed` preset -- nodes x 8 GPUs, A100-80GB in the first half and
V100-32GB in the second, a leaf/spine fabric and a seeded 10 % of node pairs at a quarter
of the NIC bandwidth. Model: the zoo's GPT-3 175B (96 layers, hidden 12288, 96 heads,
seq 2048). Global batch 1536 (GPT-3's 3.2M tokens).

Runs `plait.search.plan(..., families="all")` in one process, alternately `--repeat` times
(default 2): the baseline with the search's speed-ups turned off (`fast=False`: what the search
did before them) and the search as it runs by default. Prints the CPU time (this process's,
`time.process_time`: the machine is shared, wall time is not a measure; each row the least over
the repeats) of each family and of each of its phases (checking memory, ranking analytically,
placing + simulating), both columns side by side; the candidates enumerated, pruned, ranked and
simulated; and whether the top plans of every run agree (they must).
Target (issue 17): the whole search under 10 s on 2 cores (the column and the summary
"goal 10 s met", JSON key ``summary.goal_10s_met``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

TARGET_S = 10.0


def measure(model: str, cluster: Any, global_batch: int, finalists: int, top: int, fast: bool,
            families: str = "all") -> dict[str, Any]:
    """One search; CPU seconds of the whole search, of each family and of each family's phases
    (keys "3d", "3d memory", "3d analytic", "3d simulate", "graph", "graph search", ...)."""
    from plait.search import plan

    first: dict[str, float] = {}
    last: dict[str, float] = {}

    def on_progress(phase: str, done: int, total: int) -> None:
        now = time.process_time()
        first.setdefault(phase, now)
        last[phase] = now

    c0, w0 = time.process_time(), time.perf_counter()
    res = plan(model, cluster, global_batch=global_batch, top=top, finalists=finalists, families=families,
               on_progress=on_progress, fast=fast)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    # a phase runs from its first report (its start) to the next phase's first report
    starts = sorted(first.items(), key=lambda kv: kv[1])
    times: dict[str, float] = {}
    for fam, t0 in ((n, t) for n, t in starts if " " not in n):  # a family: from its start to its end
        times[fam] = last[fam] - t0
        phases = [(n, t) for n, t in starts if n.startswith(fam + " ")]
        for i, (name, t) in enumerate(phases):
            times[name] = (phases[i + 1][1] if i + 1 < len(phases) else last[fam]) - t
    return {"cpu_s": cpu, "wall_s": wall, "times": times, "result": res}


def _least(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' least CPU time per row (and whole search); the first run's result."""
    keys = {k for r in runs for k in r["times"]}
    return {"cpu_s": min(r["cpu_s"] for r in runs), "wall_s": min(r["wall_s"] for r in runs),
            "times": {k: min(r["times"][k] for r in runs if k in r["times"]) for k in
                      sorted(keys, key=lambda k: list(runs[0]["times"]).index(k) if k in runs[0]["times"] else 99)},
            "result": runs[0]["result"], "runs": len(runs)}


def _kinds(cluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in cluster.devices:
        out[d.kind.name] = out.get(d.kind.name, 0) + 1
    return out


def _short(plan) -> str:
    if plan.stages:  # a graph pipeline
        return (f"{len(plan.stages)} stages, dp " + ":".join(str(st.dp) for st in plan.stages)
                + f", mb {plan.micro_batch}, z{plan.zero}")
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


def _top(res) -> list[dict[str, Any]]:
    return [{"family": c.family, "plan": _short(c.plan), "layout": c.layout, "analytic_s": c.analytic_s,
             "iteration_time_s": c.iteration_time_s, "tflops_per_gpu": c.tflops_per_gpu} for c in res.top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt:size=175b")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--finalists", type=int, default=8)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--families", default="all", help="families to search (default: all)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run with the speed-ups off")
    ap.add_argument("--repeat", type=int, default=2,
                    help="alternating baseline/fast runs; each row shows its least CPU time (default 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: GPT-3 1.3B on 2 nodes, batch 64")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.nodes, args.global_batch, args.finalists, args.repeat = "gpt:size=1.3b", 2, 64, 3, 1

    from plait.cluster import load_cluster
    from plait.search import auto_dtype, load_graph

    cluster = load_cluster(f"large-mixed:nodes={args.nodes}")
    t = time.process_time()
    load_graph(args.model, auto_dtype(cluster))  # cached: both runs search the same graph
    graph_s = time.process_time() - t
    # baseline and fast runs alternate and each row keeps its least CPU time over the repeats:
    # on a shared machine one run can be a quarter slower than the next for nothing it did
    tries: dict[str, list[dict[str, Any]]] = {"baseline": [], "now": []}
    for _ in range(max(1, args.repeat)):
        if not args.no_baseline:
            tries["baseline"].append(measure(args.model, cluster, args.global_batch, args.finalists, args.top,
                                             False, args.families))
        tries["now"].append(measure(args.model, cluster, args.global_batch, args.finalists, args.top, True,
                                    args.families))
    now = _least(tries["now"])
    base = _least(tries["baseline"]) if tries["baseline"] else None
    keys = list(now["times"]) + [k for k in (base or {"times": {}})["times"] if k not in now["times"]]
    same = all([(c["plan"], c["iteration_time_s"]) for c in _top(r["result"])] ==
               [(c["plan"], c["iteration_time_s"]) for c in _top(now["result"])]
               for r in tries["baseline"] + tries["now"])
    res = now["result"]
    summary = {"cpu_s": now["cpu_s"], "baseline_cpu_s": base["cpu_s"] if base else None,
               "speedup": base["cpu_s"] / now["cpu_s"] if base else None, "target_s": TARGET_S,
               "under_target": now["cpu_s"] < TARGET_S, "goal_10s_met": now["cpu_s"] < TARGET_S, "same_top": same,
               "best_plan": _short(res.best.plan), "best_iteration_time_s": res.best.iteration_time_s}
    if args.json:
        out = {"model": args.model, "cluster": cluster.name, "devices": cluster.num_devices,
               "global_batch": args.global_batch, "finalists": args.finalists, "model_graph_cpu_s": graph_s,
               "rows": [{"phase": k, "baseline_cpu_s": base["times"].get(k) if base else None,
                         "cpu_s": now["times"].get(k)} for k in keys],
               "top": _top(res), "baseline_top": _top(base["result"]) if base else None, "summary": summary}
        print(json.dumps(out, indent=2, default=str))
        return 0

    console = Console(width=160)
    console.print(f"[bold]{args.model}[/] on [bold]{cluster.name}[/] ({cluster.num_devices} GPUs: "
                  + ", ".join(f"{n} x {k}" for k, n in _kinds(cluster).items())
                  + f"), global batch {args.global_batch}, {args.finalists} finalists; model graph "
                  f"{graph_s:.1f} s CPU (once)")
    t1 = Table(title=f"search CPU time per family and phase (seconds; least of {now['runs']} alternating runs)")
    for col in ("family / phase", "baseline (fast=False)", "now", "speed-up", f"goal {TARGET_S:.0f} s met"):
        t1.add_column(col, justify="left" if col.startswith("family") else "right")

    def cell(run: dict | None, k: str) -> str:
        v = run["times"].get(k) if run else None
        return "-" if v is None else f"{v:.1f}"

    for k in keys:
        b, n = (base["times"].get(k) if base else None), now["times"].get(k)
        label = f"[bold]{k}" if " " not in k else "  " + k.split(" ", 1)[1]
        t1.add_row(label, cell(base, k), cell(now, k), f"{b / n:.2f}x" if b and n else "-", "")
    met = now["cpu_s"] < TARGET_S
    t1.add_row("[bold]whole search", f"{base['cpu_s']:.1f}" if base else "-", f"[bold]{now['cpu_s']:.1f}",
               f"{base['cpu_s'] / now['cpu_s']:.2f}x" if base else "-",
               "[green]yes[/]" if met else f"[red]no[/] ({now['cpu_s'] - TARGET_S:+.1f} s)")
    console.print(t1)
    t2 = Table(title="candidates (now)")
    t2.add_column("stage")
    t2.add_column("count", justify="right")
    t2.add_row("enumerated", str(res.enumerated))
    for reason, n in sorted(res.pruned_reasons.items(), key=lambda x: -x[1]):
        t2.add_row(f"pruned: {reason}", str(n))
    t2.add_row("memory estimates computed", str(res.memory_checked))
    t2.add_row("fit, ranked analytically", str(res.ranked_analytic))
    t2.add_row("placed + simulated", str(res.simulated))
    console.print(t2)
    for name, fr in res.families.items():
        if isinstance(fr, str):
            console.print(f"family {name}: proposed nothing ({fr})")
    t3 = Table(title=f"top {len(res.top)} (now)")
    for col in ("#", "family", "plan", "layout", "analytic", "simulated", "TFLOP/s/GPU"):
        t3.add_column(col)
    for i, c in enumerate(_top(res), 1):
        t3.add_row(str(i), c["family"], c["plan"], c["layout"], f"{c['analytic_s']:.2f} s",
                   f"{c['iteration_time_s']:.2f} s", f"{c['tflops_per_gpu']:.1f}")
    console.print(t3)
    if base is not None:
        console.print("top plans and simulated times: " + ("[green]identical[/] to the baseline's" if same
                                                           else "[red]differ[/] from the baseline's"))
    verdict = "[green]under[/]" if now["cpu_s"] < TARGET_S else "[red]over[/]"
    console.print(f"whole search {now['cpu_s']:.1f} s CPU: {verdict} the {TARGET_S:.0f} s target -- goal "
                  f"{TARGET_S:.0f} s met: " + ("[green]yes[/]" if met else "[red]no[/]"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
