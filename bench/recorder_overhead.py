"""What the runtime's communication recording costs, and plait's step against plain torch DDP.

    python bench/recorder_overhead.py            # 20 pairs per comparison, 10 steps per run (~20 min)
    python bench/recorder_overhead.py --quick    # 10 pairs, 5 steps (~8 min on a busy 2-CPU machine)
    python bench/recorder_overhead.py --json     # one JSON object: {"rows": [...], "summary": {...}}

Each comparison is a set of **interleaved on/off pairs** (the order inside a pair alternates, so a
machine that drifts faster or slower over the bench biases neither side):

1. **recording on vs off, adjacent steps** -- one 4-rank run (tiny GPT, dp=2 x tp=2, gloo on CPU)
   with `comm_records="alternate"`: `plait.runtime.comm` streams its per-call JSON Lines records
   in one step of each pair and not in the other (the Timeline spans stay in both). The two
   steps of a pair are milliseconds apart, so the machine's drift between them is small.
   Goal: <= 2 % of the step.
2. **recording on vs off, whole runs** -- the same plan run with `comm_records=True` (the
   default) and `False`, a run per side: also counts what recording costs outside the steps
   (opening the files), but each pair is seconds apart. Same goal.
3. **plait run vs torch DDP** -- dp=2 on the same tiny GPT, the same global batch and samples
   (`plait.runtime.partition`), AdamW, gloo: `plait.runtime.api.run` (recording on) against a
   plain `DistributedDataParallel` loop started by torchrun. Both time a step the same way:
   after a barrier, from the first rank's start to the last rank's end. Goal: <= 5 %.

A run's step time is the median of its steps after `--warmup` warm-up steps. Per pair, the
relative difference (a - b) / b; the estimate is the median of these with a distribution-free
95 % confidence interval from order statistics (Conover, *Practical Nonparametric Statistics*,
3rd ed., §3.2: [x_(k), x_(n-k+1)] with k the largest index whose binomial tail P(B <= k-1) is
<= 2.5 %; n = 10 gives [x_(2), x_(9)], coverage 97.9 %). Verdict: PASS when the whole interval
lies at or below the goal and is no wider than the goal; FAIL when it lies wholly above the goal;
otherwise INCONCLUSIVE (an interval wider than the goal says the machine was too noisy to tell).

This machine is a shared 2-vCPU VM with other sessions running beside the bench: 4 ranks on 2
CPUs are oversubscribed, and the figures move by tens of percent between minutes. Read the
intervals, not the medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256,dropout=0,attn_dropout=0"
RECORDING_PLAN = "dp=2,tp=2,micro_batch=4,global_batch=16,dtype=fp32"
DDP_PLAN = "dp=2,micro_batch=8,global_batch=16,dtype=fp32"  # one micro-batch per replica, as DDP runs it
RECORDING_GOAL = 0.02
DDP_GOAL = 0.05


# ---------------------------------------------------------------------------------- statistics
def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free confidence interval of the median from order statistics: (low, high, coverage)."""
    n = len(xs)
    ys = sorted(xs)
    tail = (1.0 - level) / 2.0
    cdf, k = 0.0, 0  # k: how many order statistics to cut on each side
    for j in range(n):
        cdf += math.comb(n, j) / 2 ** n  # P(B = j), B ~ Binomial(n, 1/2)
        if cdf > tail:
            break
        k = j + 1
    if k == 0:  # too few pairs for any interval at this level
        return ys[0], ys[-1], 1.0 - 2.0 / 2 ** n
    coverage = 1.0 - 2.0 * sum(math.comb(n, j) for j in range(k)) / 2 ** n
    return ys[k - 1], ys[n - k], coverage


def verdict(low: float, high: float, goal: float) -> str:
    """PASS: the interval lies at or below the goal and is no wider than it; FAIL: it lies wholly
    above the goal (however wide); otherwise INCONCLUSIVE."""
    if low > goal:
        return "FAIL"
    if high - low > goal:
        return "INCONCLUSIVE"
    if high <= goal:
        return "PASS"
    return "INCONCLUSIVE"


# ---------------------------------------------------------------------------------- runs
def alternating_pairs(plan: str, steps: int, warmup: int, model: str) -> list[tuple[float, float]]:
    """(records on, records off) step times of adjacent steps of one run (`comm_records="alternate"`:
    step s records when (s // 2 + s) is even: pairs (on, off), (off, on), ...)."""
    from plait.runtime.api import LaunchConfig, RecordsConfig, run

    times = run(model, None, plan, steps=steps, launch=LaunchConfig(timeout=300, device="cpu"),
                records=RecordsConfig(comm_records="alternate")).iteration_times
    first = warmup + warmup % 2  # pairs start on an even step
    pairs = []
    for s in range(first, steps - 1, 2):
        on = s if (s // 2 + s) % 2 == 0 else s + 1
        pairs.append((times[on], times[2 * s + 1 - on]))
    return pairs


def plait_step(plan: str, steps: int, warmup: int, comm_records: bool, model: str) -> float:
    from plait.runtime.api import LaunchConfig, RecordsConfig, run

    result = run(model, None, plan, steps=steps, launch=LaunchConfig(timeout=300, device="cpu"),
                 records=RecordsConfig(comm_records=comm_records))
    return statistics.median(result.iteration_times[warmup:])


def ddp_step(plan: str, steps: int, warmup: int, model: str, tries: int = 2) -> tuple[float, float]:
    """Median step time of plain DDP under torchrun, and its first-step global loss (a run that
    fails or hangs is tried again, up to `tries` times, and said so)."""
    for attempt in range(tries):
        try:
            return _ddp_once(plan, steps, warmup, model)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            if attempt + 1 == tries:
                raise
            print(f"  DDP baseline run failed ({str(exc).splitlines()[0][:120]}); trying again", file=sys.stderr)
    raise AssertionError("unreachable")


def _ddp_once(plan: str, steps: int, warmup: int, model: str) -> tuple[float, float]:
    from plait.ir.plan import Plan

    world = Plan.load(plan).dp
    with tempfile.TemporaryDirectory(prefix="plait-ddp-") as tmp:
        out = Path(tmp) / "ddp.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        # --standalone: torchrun's own c10d store on a port it picks (a port chosen here could be taken
        # before the workers bind it, and one run of this bench hung on that)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               __file__, "--ddp-worker", "--plan", plan, "--model", model, "--steps", str(steps), "--out", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"DDP run failed:\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
    return statistics.median(data["iteration_times"][warmup:]), data["losses"][0]


def ddp_worker(plan_text: str, model: str, steps: int, out: str) -> None:
    """One torchrun rank of the DDP baseline: the runtime's model, samples and optimizer, DDP's reduction."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from plait.ir.plan import Plan
    from plait.runtime.data_parallel import make_optimizer
    from plait.runtime.partition import load_model_spec, make_samples, replica_micro_batches

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A collective that waits longer than this raises instead of hanging the bench (two runs of this
    # baseline hung with both workers idle; `ddp_step` retries the pair once).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = Plan.load(plan_text)
    spec = load_model_spec(model)
    torch.manual_seed(0)
    module = spec.build(device="cpu", dtype=torch.float32, seed=0)
    module.train()
    ddp = DistributedDataParallel(module)
    opt = make_optimizer([p for p in module.parameters() if p.requires_grad], {"name": "adamw", "lr": 1e-3})
    bounds, losses = [], []
    for step in range(steps):
        (mb,) = replica_micro_batches(plan, step, rank)
        inputs, target = make_samples(spec, mb.first, mb.size, 0)
        dist.barrier()  # as plait's step barrier: every rank starts the step together
        t0 = time.perf_counter()
        loss = spec.loss(ddp(*inputs), target)  # local mean; DDP averages the gradients over ranks
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        bounds.append((t0, time.perf_counter()))
        losses.append(float(loss.detach()))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"bounds": bounds, "losses": losses})
    if rank == 0:  # ranks share this host's monotonic clock: first start to last end, like plait
        times = [max(e["bounds"][i][1] for e in everyone) - min(e["bounds"][i][0] for e in everyone)
                 for i in range(steps)]
        mean_losses = [statistics.fmean(e["losses"][i] for e in everyone) for i in range(steps)]
        Path(out).write_text(json.dumps({"iteration_times": times, "losses": mean_losses}))
    dist.barrier()  # rank 0's file is written before anyone leaves
    # Leave without tearing the gloo process group and DDP down: that teardown hung twice with both
    # workers idle (py-spy: in `main`, after `ddp_worker` had returned), after the results were written.
    sys.stdout.flush()
    os._exit(0)


def record_cost(plan: str, model: str, warmup: int) -> dict[str, float]:
    """A bound beside the measurement: seconds to build and write one record (timed in this process)
    x records per rank and step (counted in a real run's files) / the run's step time."""
    from plait.ir.comm import CommRecord, read_run_comm_records
    from plait.runtime.api import LaunchConfig, RecordsConfig, run
    from plait.runtime.comm import CommLog

    with tempfile.TemporaryDirectory(prefix="plait-rec-") as tmp:
        log = CommLog(Path(tmp) / "probe.jsonl", 0, 4)
        costs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(2000):
                log.write(CommRecord(rank=0, group="tp", op="all_reduce", bytes=4096, seq=i, t_enqueue=1.0,
                                     t_start=1.1, t_end=1.2, key="all_reduce tp", name="allreduce tp g-fwd", step=3))
            costs.append((time.perf_counter() - t0) / 2000)
        log.close()
        result = run(model, None, plan, steps=warmup + 3, launch=LaunchConfig(timeout=300, device="cpu"),
                     records=RecordsConfig(run_dir=Path(tmp) / "run"))
        files = read_run_comm_records(Path(tmp) / "run" / "comm")
    per_step = statistics.fmean(sum(1 for r in f.records if r.step == result.steps[-1]) for f in files.values())
    step = statistics.median(result.iteration_times[warmup:])
    cost = statistics.median(costs)
    return {"record_s": cost, "records_per_rank_step": per_step, "step_s": step, "bound": cost * per_step / step}


# ---------------------------------------------------------------------------------- comparisons
def summarise(name: str, goal: float, a_label: str, b_label: str, pairs: list[tuple[float, float]]
              ) -> dict[str, Any]:
    """The median relative difference (a - b) / b over `pairs` with its CI and verdict."""
    rel = [(a - b) / b for a, b in pairs]
    low, high, coverage = median_ci(rel)
    a_times, b_times = [a for a, _ in pairs], [b for _, b in pairs]
    return {"name": name, "a": a_label, "b": b_label, "pairs": len(pairs), "goal": goal,
            "a_median_s": statistics.median(a_times), "b_median_s": statistics.median(b_times),
            "median_rel_diff": statistics.median(rel), "ci_low": low, "ci_high": high, "ci_coverage": coverage,
            "verdict": verdict(low, high, goal), "a_step_s": a_times, "b_step_s": b_times, "rel_diffs": rel}


def compare(name: str, goal: float, pairs: int, run_a: Any, run_b: Any, a_label: str, b_label: str,
            say: Any) -> dict[str, Any]:
    """`pairs` interleaved (a, b) runs; the median relative difference (a - b) / b with its CI."""
    done: list[tuple[float, float]] = []
    for i in range(pairs):
        order = [("a", run_a), ("b", run_b)] if i % 2 == 0 else [("b", run_b), ("a", run_a)]
        got: dict[str, float] = {}
        for tag, fn in order:
            got[tag] = fn()
        done.append((got["a"], got["b"]))
        say(f"{name}: pair {i + 1}/{pairs}: {a_label} {got['a'] * 1e3:.2f} ms, {b_label} {got['b'] * 1e3:.2f} ms "
            f"({(got['a'] - got['b']) / got['b'] * 100:+.1f} %)")
    return summarise(name, goal, a_label, b_label, done)


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="communication recording overhead and plait vs DDP (step time, interleaved pairs)")
    for col in ("comparison", "pairs", "a (median)", "b (median)", "median (a-b)/b", "CI", "goal", "verdict"):
        table.add_column(col, justify="left" if col in ("comparison", "verdict") else "right")
    for r in rows:
        colour = {"PASS": "green", "FAIL": "red"}.get(r["verdict"], "yellow")
        table.add_row(f"{r['name']}\n{r['a']} vs {r['b']}", str(r["pairs"]), f"{r['a_median_s'] * 1e3:.2f} ms",
                      f"{r['b_median_s'] * 1e3:.2f} ms", f"{r['median_rel_diff'] * 100:+.2f} %",
                      f"[{r['ci_low'] * 100:+.2f}, {r['ci_high'] * 100:+.2f}] % ({r['ci_coverage'] * 100:.1f} %)",
                      f"<= {r['goal'] * 100:.0f} %", f"[{colour}]{r['verdict']}[/]")
    console = Console(width=max(170, Console().width))  # one line per row, piped output too
    console.print(table)
    console.print(f"first-step loss: plait {summary['loss_check']['plait']:.6f}, DDP "
                  f"{summary['loss_check']['ddp']:.6f} (same model, samples and optimizer)")
    b = summary["record_cost"]
    console.print(f"one record costs {b['record_s'] * 1e6:.1f} us to build and write; {b['records_per_rank_step']:.0f} "
                  f"records per rank and step at {b['step_s'] * 1e3:.1f} ms per step: at most "
                  f"{b['bound'] * 100:.2f} % of a rank's step (a bound from the parts, not the protocol)")
    console.print(f"wall time {summary['wall_s']:.0f} s; load average at the end {summary['loadavg']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 pairs (the protocol's minimum), 5 steps per run")
    ap.add_argument("--pairs", type=int, default=None, help="pairs per comparison (default 20; quick 10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 10; quick 5)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median (default 2)")
    ap.add_argument("--alt-steps", type=int, default=26,
                    help="steps of each alternating-records run (default 26: 12 pairs after 2 warm-up steps)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--recording-plan", default=RECORDING_PLAN)
    ap.add_argument("--ddp-plan", default=DDP_PLAN)
    ap.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    steps = args.steps or (5 if args.quick else 10)
    if args.ddp_worker:
        ddp_worker(args.plan, args.model, steps, args.out)
        return 0
    pairs = args.pairs or (10 if args.quick else 20)
    if pairs < 10:
        ap.error("--pairs: the protocol needs at least 10 pairs")
    if steps <= args.warmup:
        ap.error(f"--steps must exceed --warmup ({args.warmup})")

    def say(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    t0 = time.time()
    adjacent: list[tuple[float, float]] = []
    per_run = max(1, args.alt_steps - args.warmup - args.warmup % 2) // 2
    while len(adjacent) < pairs:
        adjacent += alternating_pairs(args.recording_plan, args.alt_steps, args.warmup, args.model)
        say(f"recording, adjacent steps: {len(adjacent)}/{pairs} pairs ({per_run} per run)")
    rows = [
        summarise("recording, adjacent steps", RECORDING_GOAL, f"records on ({args.recording_plan})", "records off",
                  adjacent),
        compare("recording, whole runs", RECORDING_GOAL, pairs,
                lambda: plait_step(args.recording_plan, steps, args.warmup, True, args.model),
                lambda: plait_step(args.recording_plan, steps, args.warmup, False, args.model),
                f"records on ({args.recording_plan})", "records off", say),
    ]
    ddp_losses: list[float] = []

    def ddp() -> float:
        t, loss = ddp_step(args.ddp_plan, steps, args.warmup, args.model)
        ddp_losses.append(loss)
        return t

    rows.append(compare("plait vs DDP", DDP_GOAL, pairs,
                        lambda: plait_step(args.ddp_plan, steps, args.warmup, True, args.model), ddp,
                        f"plait run ({args.ddp_plan})", "torch DDP", say))
    from plait.runtime.api import LaunchConfig, run

    plait_loss = run(args.model, None, args.ddp_plan, steps=1, launch=LaunchConfig(timeout=300, device="cpu")).losses[0]
    bound = record_cost(args.recording_plan, args.model, args.warmup)
    summary = {
        "verdicts": {r["name"]: r["verdict"] for r in rows},
        "recording_overhead": rows[0]["median_rel_diff"], "recording_ci": [rows[0]["ci_low"], rows[0]["ci_high"]],
        "recording_overhead_whole_runs": rows[1]["median_rel_diff"],
        "recording_whole_runs_ci": [rows[1]["ci_low"], rows[1]["ci_high"]],
        "plait_vs_ddp": rows[2]["median_rel_diff"], "plait_vs_ddp_ci": [rows[2]["ci_low"], rows[2]["ci_high"]],
        "loss_check": {"plait": plait_loss, "ddp": ddp_losses[0]},
        "record_cost": bound,
        "steps": steps, "warmup": args.warmup, "model": args.model, "wall_s": time.time() - t0,
        "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print_table(rows, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
