"""Graph pipelines (GraphPipe) against sequential pipelines, every plan ranked by the one simulator (issue 13).

    python bench/graph_pipeline.py            # MMT, DLRM, CANDLE-Uno at 4/8/16/32 A100s + a mixed cluster,
                                              # and GraphPipe's case study on 8 GPUs
    python bench/graph_pipeline.py --quick    # small models, 4 and 8 GPUs (a smoke run)
    python bench/graph_pipeline.py --json     # the same rows as one JSON object, headline under "summary"

Per case (model, cluster, global batch = `--batch-per-gpu` x GPUs):

* **graph**: `plait plan --family graph` (GraphPipe's partitioner, `plait.planners.graphpipe`, its
  plans ranked by the simulator);
* **PipeDream**: its DP on the linearised model (`plait.planners.seq_baselines.pipedream`), per
  data-parallel space (per-stage degrees, and each uniform degree), the best simulated;
* **Piper**: its DP over ideals where it fits, else how many ideals it would need;
* **3D**: plait's 3D planner (`plait plan`, Pipette-style; finalists 4, no placement annealing);
* **sequential** = the better of PipeDream and 3D; speedup = sequential / graph time;
* depth of the graph plan and of the best sequential plan (stages on the longest path), and in
  brackets the graph plan's effective depth (`StageCost.effective_depth`: stage-equivalents on
  the longest path -- a stage that runs per input, holding one branch's last block and the join,
  is on the other branch's path by its join segment's share only);
* search seconds of each (wall; the model capture excluded: it is shared and cached), and the
  graph search's CPU seconds (less sensitive to other processes on the machine; the load
  average at the end is in the summary);
* the lower bound (`plait.planners.graph_cost.lower_bound`), the graph plan's gap to it, and the
  ceiling it puts on any plan's speedup (sequential / bound: where it is under 1.6 no plan can
  reach GraphPipe's 1.6x on that case).

All times are simulated iteration seconds divided by the global batch (time per sample).
The case study row also plans pure pipelines (one GPU per stage, as in the paper) and reports
their depths (paper: sequential 8, graph 4; here the graph plan has 5 stages on its longest path
and an effective depth of 4.2: the head shares the last block's GPU of one branch and runs per
input, so the other branch waits for the head segment only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {"MMT": "mmt", "DLRM": "dlrm", "CANDLE-Uno": "candle_uno"}
CLUSTERS = {4: "a100-80g:nodes=1,gpus_per_node=4", 8: "a100-80g:nodes=1", 16: "a100-80g:nodes=2",
            32: "a100-80g:nodes=4"}
MIXED = "mixed-a100-v100:a100_nodes=1,v100_nodes=1"
QUICK_MODELS = {"MMT-small": "mmt:layers=4,hidden=512,heads=8,seq=128",
                "CANDLE-small": "candle_uno:branches=4,hidden=1024"}
CASE = "graphpipe_case"


def run_case(model: str, cluster: str, global_batch: int, *, three_d: bool = True,
             pure_pipeline: bool = False) -> dict[str, Any]:
    """One row: graph plan, PipeDream, Piper and 3D on the same model, cluster and batch."""
    from plait.api import plan
    from plait.cluster import load_cluster
    from plait.planners.graph_cost import StageCost, lower_bound
    from plait.planners.graph_search import search_graph
    from plait.planners.graphpipe import replica_counts
    from plait.planners.seq_baselines import pipedream, piper
    from plait.search import GraphOptions, SearchOptions, auto_dtype, load_graph
    from plait.sim.api import PlanSimulator

    cl = load_cluster(cluster)
    dtype = auto_dtype(cl)
    _, graph = load_graph(model, dtype)
    sim = PlanSimulator(cl)
    ev = sim.evaluate
    B = global_batch
    row: dict[str, Any] = {"model": model, "cluster": cl.name, "gpus": cl.num_devices, "global_batch": B}

    cpu = time.process_time()
    res = search_graph(graph, cl, SearchOptions(global_batch=B, dtype=dtype), sim,
                       GraphOptions(max_dp=1 if pure_pipeline else None))
    row["graph_search_cpu_s"] = time.process_time() - cpu
    row["graph_s"] = res.best.time_s / B
    row["graph_depth"] = res.extra["pipeline_depth"]
    row["graph_effective_depth"] = res.extra["effective_depth"]
    row["graph_stages"] = len(res.best.plan.stages) or res.best.plan.pp  # pure data parallelism: 3D form
    row["graph_micro_batches"] = sorted({s.micro_batch for s in res.best.plan.stages} or {res.best.plan.micro_batch})
    row["graph_plan"] = str(res.best.plan)
    row["graph_search_s"] = res.search_time_s
    row["graph_notes"] = res.extra["notes"]

    cost = StageCost(graph, cl, B, dtype=dtype, max_dp=1 if pure_pipeline else None)
    t = time.perf_counter()
    # PipeDream's DP per data-parallel space (each stage its own degree; every stage one degree, for
    # each of `replica_counts`), the best of each ranked by the simulator as the graph plans are
    row["pipedream_s"], row["pipedream_depth"] = math.inf, None
    for reps in ([None], *([d] for d in replica_counts(cost))):
        pd = pipedream(cost, replicas=reps)
        if not pd.stages:
            continue
        sim_s = ev(graph, cost.to_plan(pd.stages, chain=True))["iteration_time_s"] / B
        if sim_s < row["pipedream_s"]:
            row["pipedream_s"], row["pipedream_depth"] = sim_s, len(pd.stages)
    row["pipedream_search_s"] = time.perf_counter() - t

    t = time.perf_counter()
    pi = piper(cost)
    if pi.stages:
        row["piper_s"] = ev(graph, cost.to_plan(pi.stages, chain=True))["iteration_time_s"] / B
        row["piper_note"] = ""
    else:
        row["piper_s"] = None
        row["piper_note"] = pi.note
    row["piper_search_s"] = time.perf_counter() - t
    row["piper_ideals"] = pi.ideals

    row["3d_s"] = row["3d_plan"] = row["3d_depth"] = None
    if three_d:
        t = time.perf_counter()
        r3 = plan(graph, cl, global_batch=B, top=1, finalists=4, placement=False, progress=False)
        row["3d_search_s"] = time.perf_counter() - t
        row["3d_s"] = r3.best.time_s / B
        row["3d_plan"] = str(r3.best.plan)
        row["3d_depth"] = r3.best.plan.pp
    seq = [(row["pipedream_s"], row["pipedream_depth"], "PipeDream")]
    if row["3d_s"] is not None:
        seq.append((row["3d_s"], row["3d_depth"], "3D"))
    best = min(seq, key=lambda x: x[0])
    row["sequential_s"], row["sequential_depth"], row["sequential_from"] = best
    row["speedup"] = best[0] / row["graph_s"]
    bound = lower_bound(cost)
    row["bound_s"] = bound["bound"] / B
    row["gap"] = row["graph_s"] / row["bound_s"] - 1.0
    # no plan beats the bound, so no plan is faster than sequential by more than this
    row["speedup_ceiling"] = row["sequential_s"] / row["bound_s"]
    return row


def _us(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e6:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models on 4 and 8 GPUs")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--batch-per-gpu", type=int, default=16, help="global batch = this x GPUs (default 16)")
    ap.add_argument("--no-3d", action="store_true", help="leave out plait's 3D planner (the slowest baseline)")
    args = ap.parse_args(argv)

    cases: list[tuple[str, str, str, int, bool]] = []
    if args.quick:
        for label, spec in QUICK_MODELS.items():
            for n in (4, 8):
                cases.append((label, spec, CLUSTERS[n], n * args.batch_per_gpu, False))
    else:
        for label, spec in MODELS.items():
            for n, cl in CLUSTERS.items():
                cases.append((label, spec, cl, n * args.batch_per_gpu, False))
            cases.append((label + " (mixed)", spec, MIXED, 16 * args.batch_per_gpu, False))
    cases.append(("case study", CASE, CLUSTERS[8], 8 * args.batch_per_gpu, False))
    cases.append(("case study, 1 GPU/stage", CASE, CLUSTERS[8], 8 * args.batch_per_gpu, True))

    rows = []
    for label, spec, cl, B, pure in cases:
        row = run_case(spec, cl, B, three_d=not args.no_3d and not pure, pure_pipeline=pure)
        row["label"] = label
        rows.append(row)
        if not args.json:
            print(f"  {label} on {row['gpus']} GPUs: graph {_us(row['graph_s'])} us/sample, "
                  f"sequential {_us(row['sequential_s'])} ({row['speedup']:.2f}x)", file=sys.stderr)

    multi = [r for r in rows if r["gpus"] >= 8 and not r["label"].startswith("case study")]
    summary = {
        "cases": len(rows),
        "min_speedup_multibranch_8plus": min((r["speedup"] for r in multi), default=None),
        "max_speedup": max(r["speedup"] for r in rows),
        "geomean_speedup": math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows)),
        "slower_than_sequential": sum(r["speedup"] < 0.995 for r in rows),
        "ceiling_below_1_6": [f"{r['label']} {r['gpus']}" for r in rows if r["speedup_ceiling"] < 1.6],
        "max_graph_search_s": max(r["graph_search_s"] for r in rows),
        "max_graph_search_cpu_s": max(r["graph_search_cpu_s"] for r in rows),
        "load_average_1min_at_end": os.getloadavg()[0],
        "case_study_depths": {r["label"]: {"graph": r["graph_depth"], "graph_effective": r["graph_effective_depth"],
                                           "sequential": r["sequential_depth"]}
                              for r in rows if r["label"].startswith("case study")},
    }
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="time per sample (us, simulated); graph vs the best sequential plan "
                        f"(global batch {args.batch_per_gpu} x GPUs)")
    for col in ("model", "GPUs", "PipeDream", "Piper", "3D", "graph", "speedup", "depth g (eff.)/s",
                "search s g/PD/Piper/3D", "graph CPU s", "bound", "gap", "ceiling"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        piper = _us(r["piper_s"]) if r["piper_s"] is not None else r["piper_note"].split(" (")[0].split(":")[0]
        search = "/".join(f"{x:.1f}" if x is not None else "-" for x in
                          (r["graph_search_s"], r["pipedream_search_s"], r["piper_search_s"], r.get("3d_search_s")))
        table.add_row(r["label"], str(r["gpus"]), _us(r["pipedream_s"]), piper, _us(r["3d_s"]), _us(r["graph_s"]),
                      f"{r['speedup']:.2f}x",
                      f"{r['graph_depth']} ({r['graph_effective_depth']:.2f})/{r['sequential_depth']}", search,
                      f"{r['graph_search_cpu_s']:.1f}", _us(r["bound_s"]), f"{r['gap'] * 100:.0f}%",
                      f"{r['speedup_ceiling']:.2f}x")
    console = Console(width=200)
    console.print(table)
    console.print(f"summary: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
