"""plait's own engine against the torch engine (torch's DDP / FSDP2, issue 29) on the same plan.

    python bench/torch_engine.py                 # 10 pairs per plan, 8 steps per run (~10 min)
    python bench/torch_engine.py --pairs 4       # a shorter look (fewer pairs than the protocol asks)
    python bench/torch_engine.py --json          # one JSON object: {"rows": [...], "summary": {...}}

For each plan (dp=2 and ZeRO-3 with dp=2 on a tiny GPT, gloo on CPU, two micro-batches per replica)
the bench runs **interleaved pairs**: `plait.runtime.api.run` with `LaunchConfig(engine="plait")`
(plait's DataParallelStep / Zero3Step and executor) and with the default engine (`torch`: DDP with
its buckets all-reduced asynchronously through the recorded facade, or FSDP2 with its collectives
recorded), the order inside a pair alternating so a drifting machine biases neither side. Records
and heartbeats stay on in both, as by default.

Per run: the median step time after `--warmup` steps (first rank's start to last rank's end) and
the median CPU seconds per rank and step (`time.process_time` of each rank's process, all its
threads, at each step's end: `RUN_DIR/steps/rankN.jsonl`). Per pair the relative difference
(torch - plait) / plait; the estimate is the median with the distribution-free 95 % interval of
`bench/recorder_overhead.py` (order statistics). Negative: the torch engine is faster.

This machine is a shared 2-vCPU VM with other sessions beside the bench: read the intervals.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recorder_overhead import median_ci  # noqa: E402

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256,dropout=0,attn_dropout=0"
PLANS = ("dp=2,micro_batch=4,global_batch=16,dtype=fp32", "dp=2,zero=3,micro_batch=4,global_batch=16,dtype=fp32")


def one_run(plan: str, engine: str, steps: int, warmup: int, model: str) -> dict[str, Any]:
    """(median step seconds, median CPU seconds per rank and step, first loss, the engine that ran)."""
    from plait.runtime.api import LaunchConfig, RecordsConfig, run

    with tempfile.TemporaryDirectory() as tmp:
        result = run(model, None, plan, steps=steps, launch=LaunchConfig(timeout=300, device="cpu", engine=engine),
                     records=RecordsConfig(step_records=True, run_dir=Path(tmp) / "run"))
        records = [[json.loads(line) for line in f.read_text().splitlines()]
                   for f in sorted((Path(tmp) / "run" / "steps").glob("rank*.jsonl"))]
    return {"step_s": statistics.median(result.iteration_times[warmup:]), **cpu_per_step(records, warmup),
            "loss0": result.losses[0], "engine": result.engine}


def cpu_per_step(ranks: list[list[dict[str, Any]]], warmup: int) -> dict[str, float]:
    """Median CPU seconds per rank and step, of the process (`cpu_s`: every thread) and of its main
    thread alone (`main_cpu_s`: the rest is the backend's and heartbeat's threads), from each
    rank's step records ("cpu", "main_cpu" at each step's end: step s runs from step s-1's end to
    its own), the first `warmup` steps left out."""
    out = {}
    for key, name in (("cpu", "cpu_s"), ("main_cpu", "main_cpu_s")):
        if not all(key in r[0] for r in ranks):
            continue
        per_step = [statistics.mean(r[s][key] - r[s - 1][key] for r in ranks) for s in range(warmup, len(ranks[0]))]
        out[name] = statistics.median(per_step)
    return out


def interleaved_pairs(first: Callable[[], dict[str, Any]], second: Callable[[], dict[str, Any]], pairs: int,
                      label: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """`pairs` (first, second) runs, the order inside a pair alternating so that a drifting machine
    biases neither side."""
    runs = []
    for i in range(pairs):
        if i % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        runs.append((a, b))
        print(f"  {label} pair {i + 1}/{pairs}: {a['step_s'] * 1e3:.1f} ms, {a['cpu_s'] * 1e3:.1f} CPU ms | "
              f"{b['step_s'] * 1e3:.1f} ms, {b['cpu_s'] * 1e3:.1f} CPU ms", file=sys.stderr)
    return runs


def relative(runs: list[tuple[dict[str, Any], dict[str, Any]]], first: str, second: str,
             diff_key: str = "diff") -> dict[str, Any]:
    """Per metric (step, CPU and main-thread CPU seconds): each side's median and the median of (second - first) /
    first per pair with its distribution-free 95 % interval."""
    out: dict[str, Any] = {}
    for what in ("step_s", "cpu_s", "main_cpu_s"):
        if not all(what in a and what in b for a, b in runs):
            continue
        diffs = [(b[what] - a[what]) / a[what] for a, b in runs]
        low, high, coverage = median_ci(diffs)
        out[what] = {first: statistics.median(a[what] for a, _ in runs),
                     second: statistics.median(b[what] for _, b in runs),
                     diff_key: statistics.median(diffs), "ci": [low, high], "coverage": coverage}
    return out


def compare(plan: str, pairs: int, steps: int, warmup: int, model: str) -> dict[str, Any]:
    runs = interleaved_pairs(lambda: one_run(plan, "plait", steps, warmup, model),
                             lambda: one_run(plan, "auto", steps, warmup, model), pairs, f"{plan} plait | torch")
    return {"plan": plan, "pairs": pairs, "engines": sorted({r["engine"] for pair in runs for r in pair}),
            "loss0_plait": runs[0][0]["loss0"], "loss0_torch": runs[0][1]["loss0"],
            **relative(runs, "plait", "torch")}


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plait's engine vs the torch engine (same plan; (torch - plait) / plait per pair)")
    for col in ("plan", "pairs", "plait step ms", "torch step ms", "step diff [95 % CI]", "plait CPU ms/rank-step",
                "torch CPU ms/rank-step", "CPU diff [95 % CI]"):
        table.add_column(col)
    for r in rows:
        s, c = r["step_s"], r["cpu_s"]
        table.add_row(r["plan"], str(r["pairs"]), f"{s['plait'] * 1e3:.1f}", f"{s['torch'] * 1e3:.1f}",
                      f"{s['diff']:+.1%} [{s['ci'][0]:+.1%}, {s['ci'][1]:+.1%}]", f"{c['plait'] * 1e3:.1f}",
                      f"{c['torch'] * 1e3:.1f}", f"{c['diff']:+.1%} [{c['ci'][0]:+.1%}, {c['ci'][1]:+.1%}]")
    console = Console()
    console.print(table)
    console.print(f"engines that ran: {[r['engines'] for r in rows]}; first-step losses plait/torch: "
                  f"{[(round(r['loss0_plait'], 6), round(r['loss0_torch'], 6)) for r in rows]}")
    console.print(f"wall time {summary['wall_s']:.0f} s; load average at the end {summary['loadavg']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=10, help="pairs per plan (default 10)")
    ap.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median (default 2, >= 1)")
    ap.add_argument("--plan", action="append", help="a plan to compare (repeatable; default dp=2 and ZeRO-3)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup + 1 or args.pairs < 1:
        ap.error("need --pairs >= 1, --warmup >= 1 and --steps > --warmup + 1")
    t0 = time.time()
    rows = [compare(plan, args.pairs, args.steps, args.warmup, args.model) for plan in args.plan or PLANS]
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "step_diff": {r["plan"]: r["step_s"]["diff"] for r in rows},
        "step_diff_ci": {r["plan"]: r["step_s"]["ci"] for r in rows},
        "cpu_diff": {r["plan"]: r["cpu_s"]["diff"] for r in rows},
        "cpu_diff_ci": {r["plan"]: r["cpu_s"]["ci"] for r in rows},
        "pairs": args.pairs, "steps": args.steps, "warmup": args.warmup, "model": args.model,
        "wall_s": time.time() - t0, "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print_table(rows, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
