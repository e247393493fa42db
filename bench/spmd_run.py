"""Synthesized SPMD programs trained on this machine's emulated mixed cluster: predicted next to
measured, and the speedup over the same program at even ratios (the baseline, run in the same go).

    python bench/spmd_run.py                 # 4 cases on 2 ranks, 12 steps, 2 runs each (fp16 ratios)
    python bench/spmd_run.py --only 2 --repeats 3   # one case (0-based), three runs
    python bench/spmd_run.py --dtype fp32    # the fp32 ratios (A100:V100 19.5 / 15.7: little to balance)
    python bench/spmd_run.py --quick         # one tiny BERT, 3 steps (a smoke run)
    python bench/spmd_run.py --json          # the same rows as one JSON object
    python bench/spmd_run.py --pin           # ranks pinned to CPUs with high cpu.shares (root)
    python bench/spmd_run.py --cluster emulated-mixed   # 4 ranks (more ranks than a 2-CPU machine has)

For each case (model, global batch, cluster): `plait plan --family spmd`'s program for the cluster
(plait.spmd: A* search, ratio LP with memory), trained by `plait run` twice -- at its ratios and at
even ratios -- with ranks slowed to their GPU kind's speed at `--dtype` (`plait.runtime.emulate`;
the CPU ranks compute fp32). The first two cases replicate every op (on `emulated-mixed` these
small programs are cheaper redundant than split across the NIC: their even twin differs only in
where the sharded weights live, so their speedup is ~1 by construction); the last two are sharded
programs (data parallel at uneven shares, a tensor-parallel MLP) on an A100 + T4 pair.

Predicted (`plait.commands.spmd_plan.machine_pieces`): plait.spmd's cost model on this machine's
ranks -- each rank's speed from the whole program timed by the ranks themselves, side by side,
before and after their steps, on the CPU clock (thread CPU seconds: what a CPU per rank gives);
links fitted to the ranks' all-gathers -- plus the outputs' gather, the loss, its all-reduce and the
optimizer step. Measured: the median step after 2 warm-up steps, over `--steps` steps, each case
run `--repeats` times (median and range printed). "steal": the ranks' compute spans in wall
seconds over their thread CPU seconds -- how much other jobs slowed the ranks (1.0 on an idle
machine with a CPU per rank, which is what the prediction assumes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.commands.spmd_plan import run_both, synthesize_plan  # noqa: E402
from plait.commands.spmd_plan import steal as spmd_steal  # noqa: E402

REPLICATED = "emulated-mixed:gpus_per_node=1"  # A100 + V100 across a NIC: these small programs replicate
PAIR = str(Path(__file__).resolve().parent / "data" / "a100_t4_pair.yaml")  # A100 + T4 on PCIe: they shard
CASES = [  # (model, global batch, cluster)
    ("gpt:layers=2,hidden=128,heads=4,seq=64,vocab=256,dropout=0,attn_dropout=0", 64, REPLICATED),
    ("bert:layers=2,hidden=128,heads=4,seq=64,vocab=256,dropout=0,attn_dropout=0", 64, REPLICATED),
    ("gpt:layers=2,hidden=128,heads=4,seq=64,vocab=256,dropout=0,attn_dropout=0", 64, PAIR),
    ("candle_uno:branches=1,branch_layers=2,hidden=1024,top_layers=1", 512, PAIR),
]
QUICK = [("bert:layers=1,hidden=32,heads=4,seq=8,vocab=64,dropout=0,attn_dropout=0", 8, REPLICATED)]
CLUSTER = REPLICATED


def measure(model: str, batch: int, cluster: str, steps: int, dtype: str = "fp16", pin: bool = False) -> dict:
    """One row: synthesize for `cluster`, run the program and its even twin, predicted vs measured."""
    choice = synthesize_plan(model, cluster, batch, dtype=dtype)
    args = argparse.Namespace(json=True, steps=steps, lr=1e-3)
    run = run_both(args, choice, pin=pin)
    syn = choice.synthesis
    return {"model": model, "batch": batch, "cluster": choice.cluster.name, "ranks": choice.plan.world_size,
            "dtype": dtype, "sharded_ops": sum(1 for s in syn.program.strategies.values() if s.splits_work),
            "ops": len(choice.graph.ops), "ratios": [round(float(x), 3) for x in syn.ratios],
            "gpu_predicted_s": syn.cost, "gpu_predicted_even_s": choice.even_cost, **run}


def steal(run: dict) -> float:
    """`plait.commands.spmd_plan.steal` of a run's step pieces."""
    return spmd_steal(run.get("pieces") or {})


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def combine(reps: list[dict]) -> dict:
    """One case's repeats: the first repeat's row, with each figure's median and spread over repeats."""
    row = dict(reps[0])
    row["repeats"] = reps
    for k in ("uneven", "even"):
        row[k] = dict(reps[0][k])
        row[k]["steal"] = statistics.median(steal(r[k]) for r in reps)
        for f in ("measured_iteration_s", "predicted_machine_s", "error"):
            vals = [r[k][f] for r in reps if r[k].get(f) is not None]
            if vals:
                row[k][f] = statistics.median(vals)
                row[k][f + "_spread"] = spread(vals)
    for f in ("measured_speedup_over_even", "predicted_speedup_over_even", "load_average"):
        vals = [r[f] for r in reps if r.get(f) is not None]
        if vals:
            row[f] = statistics.median(vals)
            row[f + "_spread"] = spread(vals)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one tiny model, 3 steps")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    ap.add_argument("--cluster", default=None, help="emulated cluster for every case (default: each case's own)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 12; --quick 3)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each case (default 2; --quick 1)")
    ap.add_argument("--only", type=int, action="append", help="run only case K (0-based; repeatable)")
    ap.add_argument("--pin", action="store_true",
                    help="ranks pinned to CPUs with high cpu.shares, their program timings too (root, cgroup v1)")
    ap.add_argument("--dtype", default="fp16", choices=("fp32", "tf32", "bf16", "fp16"),
                    help="dtype the programs are synthesized and the kinds emulated at (default fp16)")
    args = ap.parse_args(argv)
    cases = QUICK if args.quick else [c for k, c in enumerate(CASES) if not args.only or k in args.only]
    steps = args.steps or (3 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 2)
    rows = []
    for m, b, cluster in cases:
        reps = [measure(m, b, args.cluster or cluster, steps, args.dtype, args.pin) for _ in range(repeats)]
        rows.append(combine(reps))
    errors = [abs(r[k]["error"]) for r in rows for k in ("uneven", "even") if r[k].get("error") is not None]
    sharded = [r for r in rows if r["sharded_ops"] > 0]
    summary = {"dtype": args.dtype, "cpus": len(os.sched_getaffinity(0)), "steps": steps, "repeats": repeats,
               "max_abs_error": max(errors) if errors else None,
               "within_15pct": sum(e <= 0.15 for e in errors), "predictions": len(errors),
               "mean_measured_speedup_over_even": sum(r["measured_speedup_over_even"] for r in rows) / len(rows),
               "sharded_cases_measured_speedup_over_even": [round(r["measured_speedup_over_even"], 3)
                                                            for r in sharded],
               "sharded_cases_predicted_speedup_over_even": [round(r.get("predicted_speedup_over_even") or 0, 3)
                                                             for r in sharded],
               "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0
    _print(rows, summary)
    return 0


def _pm(sp: dict | None, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """A repeated figure's range, "lo-hi" (empty for one repeat)."""
    if not sp or sp["min"] == sp["max"]:
        return ""
    return f"{fmt.format(sp['min'] * scale)}..{fmt.format(sp['max'] * scale)}"


def _print(rows: list[dict], summary: dict) -> None:
    head = (f"{'model':<30} {'cluster':<13} {'shard':>7} {'ratios':>11} {'program':>7} {'pred ms':>8} "
            f"{'meas ms':>8} {'(range)':>13} {'error':>7} {'(range)':>13} {'steal':>5} {'speedup meas/pred':>18} "
            f"{'load':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        for k in ("uneven", "even"):
            m = r[k]
            speed = (f"{r['measured_speedup_over_even']:.2f}x/{r.get('predicted_speedup_over_even', float('nan')):.2f}x"
                     if k == "uneven" else "(baseline)")
            err = f"{m['error'] * 100:+.1f}%" if m.get("error") is not None else "-"
            print(f"{r['model'].split(',dropout')[0][:30]:<30} {r['cluster'][:13]:<13} "
                  f"{r['sharded_ops']:>3}/{r['ops']:<3} {':'.join(f'{x:.2f}' for x in r['ratios']):>11} {k:>7} "
                  f"{(m.get('predicted_machine_s') or 0) * 1e3:>8.1f} {m['measured_iteration_s'] * 1e3:>8.1f} "
                  f"{_pm(m.get('measured_iteration_s_spread'), 1e3):>13} {err:>7} "
                  f"{_pm(m.get('error_spread'), 100, '{:+.0f}%'):>13} {steal(m):>5.2f} {speed:>18} "
                  f"{r['load_average'] or 0:>5.1f}")
    print(f"\n{summary['within_15pct']} of {summary['predictions']} predictions within 15 %; largest error "
          f"{(summary['max_abs_error'] or 0) * 100:.1f} %; measured speedup over even ratios of the sharded "
          f"programs {summary['sharded_cases_measured_speedup_over_even']} (predicted "
          f"{summary['sharded_cases_predicted_speedup_over_even']}); {summary['cpus']} CPUs, "
          f"{summary['steps']} steps x {summary['repeats']} runs per program")


if __name__ == "__main__":
    sys.exit(main())
