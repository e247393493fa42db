"""Planner vs simulator bytes per traffic class, for every zoo model x three plans.

For each model of the zoo (small configurations) and each plan -- 3D (dp=2, tp=2,
pp=2), uneven heterogeneous (layer_split + dp_shares of 10/16 and 6/16 on a mixed
A100/V100 preset) and ZeRO-3 (dp=4, tp=2) -- the table shows the wire bytes per traffic
class that the planner's analytic model times (`AnalyticModel.traffic`, from
`plait.cost.traffic`) and that the simulator's lowered task graph carries (its
communication tasks summed by `plait.cost.traffic.task_class_bytes`, layer granularity,
one representative per equivalent replica), and whether they are equal.

Usage: ``python bench/traffic_agreement.py [--json]`` (``--json``: the same rows as one
JSON object with a "summary"). Exit status 1 when any row disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.cluster import load_cluster  # noqa: E402
from plait.cost.traffic import CLASSES, task_class_bytes  # noqa: E402
from plait.graph.inspect import inspect_model  # noqa: E402
from plait.ir.plan import Plan  # noqa: E402
from plait.net.view import ClusterView  # noqa: E402
from plait.planners.threed import AnalyticModel  # noqa: E402
from plait.sim.lowering import SimOptions, lower  # noqa: E402

CLUSTER = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=4"
MODELS = {
    "gpt": "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128",
    "llama": "llama:layers=4,hidden=64,heads=4,seq=32,vocab=128",
    "bert": "bert:layers=4,hidden=64,heads=4,seq=32,vocab=128",
    "resnet50": "resnet50",
    "vgg16": "vgg16",
    "mmt": "mmt",
    "dlrm": "dlrm",
    "candle_uno": "candle_uno",
}


def plans_for(n_layers: int) -> dict[str, Plan]:
    front = n_layers // 2 + 1
    return {
        "3d": Plan(dp=2, tp=2, pp=2, micro_batch=2, global_batch=8),
        "hetero": Plan(dp=2, tp=2, pp=2, micro_batch=4, global_batch=16, dp_shares=[10 / 16, 6 / 16],
                       layer_split=[front, n_layers - front]),
        "zero3": Plan(dp=4, tp=2, micro_batch=2, global_batch=16, zero=3),
    }


def rows() -> list[dict[str, Any]]:
    cluster = load_cluster(CLUSTER)
    view = ClusterView.from_cluster(cluster)
    out = []
    for model, spec in MODELS.items():
        graph = inspect_model(spec, 2)
        planner = AnalyticModel(graph, cluster)
        for name, plan in plans_for(len(graph.layers)).items():
            planned = planner.traffic(plan).totals()
            lowered = task_class_bytes(lower(graph, plan, view, SimOptions(granularity="layer")).graph.args)
            out.append({"model": model, "plan_name": name, "plan": str(plan), "planner_bytes": planned,
                        "simulator_bytes": lowered, "equal": planned == lowered})
    return out


def _mb(x: int) -> str:
    return f"{x / 1e6:,.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = parser.parse_args()
    t0 = time.perf_counter()
    table = rows()
    summary = {"rows": len(table), "equal": sum(r["equal"] for r in table), "cluster": CLUSTER,
               "all_equal": all(r["equal"] for r in table), "seconds": round(time.perf_counter() - t0, 2)}
    if args.json:
        print(json.dumps({"summary": summary, "rows": table}, indent=2))
        return 0 if summary["all_equal"] else 1
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"wire bytes per traffic class (MB), planner / simulator, on {CLUSTER}")
    t.add_column("model")
    t.add_column("plan")
    for cls in CLASSES:
        t.add_column(cls, justify="right")
    t.add_column("equal")
    for r in table:
        cells = [f"{_mb(r['planner_bytes'][c])} / {_mb(r['simulator_bytes'][c])}" for c in CLASSES]
        t.add_row(r["model"], r["plan_name"], *cells, "yes" if r["equal"] else "NO")
    console = Console(width=200)
    console.print(t)
    console.print(f"{summary['equal']} of {summary['rows']} rows equal in every class "
                  f"({summary['seconds']} s)")
    return 0 if summary["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
