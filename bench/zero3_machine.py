"""ZeRO-3 on this machine: the machine prediction of the demo's plans against their runs.

    python bench/zero3_machine.py                 # zero 0, 1, 3 x 2 rounds on the demo default (~5 min)
    python bench/zero3_machine.py --rounds 1 --json

`plait plan --run` (`make demo`) predicts its pick for this machine with
`plait.measure.machine.LocalMachine` and runs it. This bench does the same for the default
model and cluster (`plait.search.DEFAULT_MODEL` / `DEFAULT_CLUSTER`) at dp=2, micro-batch 8,
global batch 16 with ZeRO 0, 1 and 3 -- the ZeRO-0/1 rows are the baseline, measured in the same
run by the same calibration -- and prints per plan:

* predicted and measured iteration time (median step after the warm-up) and the error;
* the **replay** error: the same simulation at the compute speed each device had during the run
  (`bench/sim_vs_real.py`), i.e. what is left of the error once the machine's drift between
  profile and run is taken out: the schedule, the collectives and the host overheads;
* per step on the slowest (emulated) device: compute seconds (spans minus the communication
  nested in them, stretch included) and communication seconds, simulated and measured, and the
  number of collective calls of each.

ZeRO-3 as the runtime runs it (`plait.runtime.zero3`): per layer an all-gather before its forward
and before its backward and a reduce-scatter after its backward, each waited for by the training
thread (no prefetch), the tied embedding (the root unit) gathered once per step; gloo runs a
reduce-scatter as an all-reduce of the whole input. The simulator lowers exactly that
(`plait.sim.lowering.tensor_parallel._emit_zero3_item`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

PLANS = {"zero 0": "dp=2,micro_batch=8,global_batch=16,zero=0,dtype=fp16",
         "zero 1": "dp=2,micro_batch=8,global_batch=16,zero=1,dtype=fp16",
         "zero 3": "dp=2,micro_batch=8,global_batch=16,zero=3,dtype=fp16"}


def per_step(timeline: Any, device: int, steps: list[int] | None) -> dict[str, float]:
    """Compute and communication seconds per step of `device`, and collective calls per step.
    A simulated collective is one task for its whole group (on its first device, or on no
    device), so `steps=None` (a prediction) counts every communication task."""
    out = {"compute": 0.0, "comm": 0.0, "calls": 0.0}
    for e in timeline.events:
        if steps is not None and e.args.get("step") not in steps:
            continue
        if e.category.startswith("comm") and (steps is None or e.device == device):
            out["comm"] += e.duration
            out["calls"] += 1
        elif e.device == device and e.category in ("forward", "backward", "recompute", "optimizer"):
            out["compute"] += e.duration - float(e.args.get("comm_inside", 0.0))
    n = len(steps) if steps else 1
    return {k: v / n for k, v in out.items()}


def trial(machine: Any, label: str, spec: str, steps: int) -> dict[str, Any]:
    from sim_vs_real import _compute_work, replay

    mr = machine.measure_and_predict(spec, steps=steps)
    res, pred = mr.run, mr.prediction
    measured_steps = res.steps[mr.warmup_steps:]
    slow = max(range(len(pred.layer_time_scale)), key=lambda d: list(pred.layer_time_scale.values())[d])
    row = {"plan": label, "spec": spec, "measured_s": mr.measured_s, "predicted_s": mr.predicted_s,
           "error": mr.error, "drift": mr.drift, "steps_s": [round(t, 5) for t in res.iteration_times],
           "replay_s": replay(pred, _compute_work(res.timeline, measured_steps)),
           "device": slow, "sim": per_step(pred.result.timeline, slow, None),
           "real": per_step(res.timeline, slow, measured_steps), "host_comm_s": pred.compute.host_comm_s}
    row["replay_error"] = (row["replay_s"] - mr.measured_s) / mr.measured_s
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="runs of every plan (odd rounds in reverse order)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--plans", default=",".join(PLANS), help="which of: " + ", ".join(PLANS))
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from plait.measure.machine import LocalMachine
    from plait.search import DEFAULT_CLUSTER, DEFAULT_MODEL

    console = Console(width=160, stderr=args.json)
    labels = [p.strip() for p in args.plans.split(",") if p.strip()]
    bad = [p for p in labels if p not in PLANS]
    if bad:
        ap.error(f"--plans: unknown {bad}; use {list(PLANS)}")
    t0, cpu0 = time.perf_counter(), time.process_time()
    rows: list[dict[str, Any]] = []
    with LocalMachine(DEFAULT_CLUSTER, DEFAULT_MODEL, emulate_dtype="fp16",
                      say=lambda t: console.print(f"  {t}")) as machine:
        for rnd in range(args.rounds):
            for label in (labels if rnd % 2 == 0 else labels[::-1]):
                try:
                    row = trial(machine, label, PLANS[label], args.steps)
                except Exception as exc:  # noqa: BLE001 -- a bench reports what failed and goes on
                    console.print(f"[red]failed[/] r{rnd} {label}: {type(exc).__name__}: {exc}")
                    continue
                row["round"] = rnd
                rows.append(row)
                console.print(f"  r{rnd} {label}: predicted {row['predicted_s'] * 1e3:.1f} ms, measured "
                              f"{row['measured_s'] * 1e3:.1f} ms ({row['error'] * 100:+.1f} %), replay "
                              f"{row['replay_error'] * 100:+.1f} %")
    table = Table(title=f"{DEFAULT_MODEL} on {DEFAULT_CLUSTER}: machine prediction vs run (median round; "
                        f"per step on the slowest device)")
    for col in ("plan", "predicted ms", "measured ms", "error", "replay error", "all rounds' errors",
                "compute sim / real ms", "comm sim / real ms", "calls sim / real"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    summary: dict[str, Any] = {}
    for label in labels:
        mine = sorted((r for r in rows if r["plan"] == label), key=lambda r: r["error"])
        if not mine:
            continue
        r = mine[len(mine) // 2]
        s, m = r["sim"], r["real"]
        table.add_row(label, f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                      f"{r['error'] * 100:+.1f} %", f"{r['replay_error'] * 100:+.1f} %",
                      " ".join(f"{x['error'] * 100:+.0f}" for x in mine),
                      f"{s['compute'] * 1e3:.1f} / {m['compute'] * 1e3:.1f}",
                      f"{s['comm'] * 1e3:.1f} / {m['comm'] * 1e3:.1f}", f"{s['calls']:.0f} / {m['calls']:.0f}")
        summary[label.replace(" ", "")] = {"error": r["error"], "replay_error": r["replay_error"],
                                           "abs_errors": [abs(x["error"]) for x in mine]}
    summary["cpu_s"] = time.process_time() - cpu0
    summary["wall_s"] = time.perf_counter() - t0
    console.print(table)  # on stderr with --json
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}, default=float))
    else:
        console.print(f"bench process CPU {summary['cpu_s']:.1f} s, wall {summary['wall_s']:.0f} s; "
                      f"median over rounds of |error|: " + ", ".join(
                          f"{k} {statistics.median(v['abs_errors']) * 100:.1f} %" for k, v in summary.items()
                          if isinstance(v, dict)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
