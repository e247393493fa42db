"""plait's torch engine against plain torch on the same model, batch and ranks (issue 29's overhead goal).

    python bench/torch_overhead.py                # 10 pairs per plan, 10 steps per run (~10 min)
    python bench/torch_overhead.py --pairs 3      # a shorter look (fewer pairs than the protocol asks)
    python bench/torch_overhead.py --json         # one JSON object: {"rows": [...], "summary": {...}}

For each plan (dp=2 on DDP; dp=2 ZeRO-3 on FSDP2, two micro-batches per replica; pp=2 on torch's
pipelining, 1F1B over four; gloo on CPU) the
bench runs **interleaved pairs**: `plait.runtime.api.run` with `LaunchConfig(engine="torch")`, records
and heartbeats on as by default (plus the per-step CPU records it is measured by), and the plain
script `bench/plain_torch_train.py` under torchrun (DDP or `fully_shard`, AdamW, nothing of plait's
but the model and its samples); the order inside a pair alternates so a drifting machine biases
neither side. Both give each rank ``cpu_count // 2`` threads (plait's launcher's default).

Per run, after `--warmup` steps: the median step time (first rank's start to last rank's end; the
samples are made before the start on both sides) and the median CPU seconds per rank and step
(`time.process_time` of each rank's process at each step's end, step s from step s-1's end: the
whole loop, records, barriers and data included). Per pair the overhead (plait - plain) / plain;
the estimate is the median with the distribution-free 95 % interval of `bench/recorder_overhead.py`.
The goal: <= 2 % of step time in CPU seconds and in wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_engine import cpu_per_step, interleaved_pairs, one_run, relative  # noqa: E402

MODEL = "gpt:layers=4,hidden=256,heads=4,seq=64,vocab=1024,dropout=0,attn_dropout=0"
MICRO, GLOBAL = 4, 16
PLANS = {  # plait plan -> the plain script's flags
    f"dp=2,micro_batch={MICRO},global_batch={GLOBAL},dtype=fp32": ["--mode", "ddp"],
    f"dp=2,zero=3,micro_batch={MICRO},global_batch={GLOBAL},dtype=fp32": ["--mode", "fsdp2", "--zero", "3"],
    # embed + 2 layers | 2 layers + head, 1F1B over 4 micro-batches: torch's pipelining on both sides
    f"pp=2,micro_batch={MICRO},global_batch={GLOBAL},layer_split=3:3,schedule=1f1b,dtype=fp32":
        ["--mode", "pp", "--split", "2"],
}
SCRIPT = Path(__file__).resolve().parent / "plain_torch_train.py"


def plain_run(flags: list[str], steps: int, warmup: int, model: str) -> dict[str, Any]:
    """The plain script on 2 ranks under torchrun: (median step s, median CPU s per rank and step, first loss)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // 2)))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               *flags, "--model", model, "--micro-batch", str(MICRO), "--global-batch", str(GLOBAL),
               "--steps", str(steps), "--out", tmp]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        ranks = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(Path(tmp).glob("rank*.jsonl"))]
    steps_s = [max(r[s]["t1"] for r in ranks) - min(r[s]["t0"] for r in ranks) for s in range(steps)]
    return {"step_s": statistics.median(steps_s[warmup:]), **cpu_per_step(ranks, warmup),
            "loss0": statistics.mean(r[0]["loss"] for r in ranks if r[0]["loss"] is not None), "engine": "plain torch"}


def compare(plan: str, flags: list[str], pairs: int, steps: int, warmup: int, model: str) -> dict[str, Any]:
    runs = interleaved_pairs(lambda: plain_run(flags, steps, warmup, model),
                             lambda: one_run(plan, "torch", steps, warmup, model), pairs, f"{plan} plain | plait")
    return {"plan": plan, "plain": " ".join(flags), "pairs": pairs, "engines": sorted({p["engine"] for _, p in runs}),
            "loss0_plait": runs[0][1]["loss0"], "loss0_plain": runs[0][0]["loss0"],
            **relative(runs, "plain", "plait", diff_key="overhead")}


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plait's torch engine vs plain torch (same model, batch, ranks; (plait - plain) / plain per pair)")
    for col in ("plan", "plain script", "pairs", "plait step ms", "plain step ms", "step overhead [95 % CI]",
                "plait CPU ms/rank-step", "plain CPU ms/rank-step", "CPU overhead [95 % CI]",
                "main thread CPU ms plait / plain", "main thread overhead [95 % CI]"):
        table.add_column(col)
    for r in rows:
        s, c, m = r["step_s"], r["cpu_s"], r["main_cpu_s"]
        table.add_row(r["plan"], r["plain"], str(r["pairs"]), f"{s['plait'] * 1e3:.1f}", f"{s['plain'] * 1e3:.1f}",
                      f"{s['overhead']:+.1%} [{s['ci'][0]:+.1%}, {s['ci'][1]:+.1%}]", f"{c['plait'] * 1e3:.1f}",
                      f"{c['plain'] * 1e3:.1f}", f"{c['overhead']:+.1%} [{c['ci'][0]:+.1%}, {c['ci'][1]:+.1%}]",
                      f"{m['plait'] * 1e3:.1f} / {m['plain'] * 1e3:.1f}",
                      f"{m['overhead']:+.1%} [{m['ci'][0]:+.1%}, {m['ci'][1]:+.1%}]")
    console = Console()
    console.print(table)
    console.print(f"engines that ran: {[r['engines'] for r in rows]}; first-step losses plait/plain: "
                  f"{[(round(r['loss0_plait'], 6), round(r['loss0_plain'], 6)) for r in rows]}")
    console.print(f"goal <= 2 %: wall {summary['goal_wall_met']}, CPU {summary['goal_cpu_met']} (upper CI bounds); "
                  f"wall time {summary['wall_s']:.0f} s; load average at the end {summary['loadavg']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=10, help="pairs per plan (default 10)")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of each run's median (default 3, >= 1)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup + 1 or args.pairs < 1:
        ap.error("need --pairs >= 1, --warmup >= 1 and --steps > --warmup + 1")
    t0 = time.time()
    rows = [compare(plan, flags, args.pairs, args.steps, args.warmup, args.model) for plan, flags in PLANS.items()]
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "step_overhead": {r["plan"]: r["step_s"]["overhead"] for r in rows},
        "step_overhead_ci": {r["plan"]: r["step_s"]["ci"] for r in rows},
        "cpu_overhead": {r["plan"]: r["cpu_s"]["overhead"] for r in rows},
        "cpu_overhead_ci": {r["plan"]: r["cpu_s"]["ci"] for r in rows},
        "main_thread_cpu_overhead": {r["plan"]: r["main_cpu_s"]["overhead"] for r in rows},
        "main_thread_cpu_overhead_ci": {r["plan"]: r["main_cpu_s"]["ci"] for r in rows},
        "goal_wall_met": all(r["step_s"]["ci"][1] <= 0.02 for r in rows),
        "goal_cpu_met": all(r["cpu_s"]["ci"][1] <= 0.02 for r in rows),
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
