"""Simulator vs reality on this machine: predicted and measured iteration times of real plans.

    python bench/sim_vs_real.py                 # 2 clusters x 4 plans, 5 steps each
    python bench/sim_vs_real.py --quick         # 2 plans per cluster, 3 steps
    python bench/sim_vs_real.py --keep DIR      # keep cluster files, profiles and traces in DIR

What it does, end to end:

1. writes two **emulated clusters** of 2 nodes x 2 "GPUs" (`homo`: four A100s; `hetero`:
   two A100s + two T4s, whose datasheet fp32 ratio 19.5/8.1 = 2.41 becomes the T4
   ranks' compute slowdown), nodes joined by NICs shaped with tc to
   `bandwidth x emulation.bandwidth_scale` (namespaces need root; without it the run
   falls back to loopback and says so);
2. **profiles** each with `plait profile` inside its namespaces (p2p pairs, all-reduce /
   all-gather busbw, matmul FLOP/s with the slowdown applied) into a measured cluster YAML;
3. for each plan (DP, TP, PP, mixed; uneven DP shares and layer splits on `hetero`)
   **predicts** the iteration time with `plait.sim.api.simulate` on the *measured*
   cluster and **measures** it with `plait.runtime.api.run` on the *emulated* cluster
   (median of the steps after the first two), and prints both with the error, per-cluster
   Spearman rank correlation and whether the ranking is the same.

Plans run in fp32 (the dtype of the emulated slowdown and of the profile's matmul figure)
and pin ring collectives (`collective.dp=ring,collective.tp=ring`): gloo runs rings, so
that is the algorithm the simulator must price. The prediction uses the simulator's
compute model with CPU constants from the profile (`cpu_compute_model`); the baseline
column is the simulator's default (A100-fitted) compute model on the same measured
cluster. The target (issue 5) is <= 10 % per plan and the same ranking.

Everything runs on this machine's CPUs: with 4 ranks on 2 cores the ranks contend for
CPU time, which the profile's concurrent measurements capture only on average.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MODEL = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=512"

CLUSTERS = {
    # 100 Gb/s NICs x 0.004 = 50 MB/s between nodes; NVLink inside a node is not shaped
    # (ranks of a node talk over the namespace's loopback).
    "homo": """
        name: emu-homo
        nodes:
          - {name: a, gpus: {kind: a100-80gb, count: 2}, nic: {type: ethernet, bandwidth: 100 Gb/s, count: 1}}
          - {name: b, gpus: {kind: a100-80gb, count: 2}, nic: {type: ethernet, bandwidth: 100 Gb/s, count: 1}}
        emulation: {bandwidth_scale: 0.004}
    """,
    "hetero": """
        name: emu-hetero
        nodes:
          - {name: fast, gpus: {kind: a100-80gb, count: 2}, nic: {type: ethernet, bandwidth: 100 Gb/s, count: 1}}
          - {name: slow, gpus: {kind: t4, count: 2}, nic: {type: ethernet, bandwidth: 50 Gb/s, count: 1}}
        emulation: {bandwidth_scale: 0.004}
    """,
}

# (cluster, label, plan). Megatron rank order: tp fastest, then dp, then pp, so with 2
# devices per node a tp=2 group or a dp=2 group of a pp=2 plan stays inside a node.
PLANS = [
    ("homo", "DP4", "dp=4,micro_batch=4,global_batch=16,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("homo", "TP2xDP2", "tp=2,dp=2,micro_batch=4,global_batch=16,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("homo", "PP2xDP2 1F1B", "pp=2,dp=2,micro_batch=2,global_batch=16,schedule=1f1b,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("homo", "PP4 GPipe", "pp=4,micro_batch=2,global_batch=16,schedule=gpipe,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("hetero", "DP4 even", "dp=4,micro_batch=4,global_batch=16,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("hetero", "DP4 shares", "dp=4,micro_batch=4,global_batch=16,dp_shares=0.35:0.35:0.15:0.15,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("hetero", "PP2xDP2 split 4:2", "pp=2,dp=2,micro_batch=2,global_batch=16,layer_split=4:2,dtype=fp32,collective.dp=ring,collective.tp=ring"),
    ("hetero", "TP2xDP2", "tp=2,dp=2,micro_batch=4,global_batch=16,dtype=fp32,collective.dp=ring,collective.tp=ring"),
]
QUICK = {"DP4", "PP2xDP2 1F1B", "DP4 shares", "PP2xDP2 split 4:2"}


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    if len(xs) < 2:
        return float("nan")
    return float(spearmanr(xs, ys).statistic)


def profile_cluster(path: Path, out: Path, max_size: int) -> Any:
    from plait.commands.profile_cmd import profile

    result, _ = profile(str(path), max_size=max_size, p2p_bytes=2 * 2**20, matmul_sizes=[128, 256, 512],
                        dtypes=["fp32"], slowdown_dtype="fp32", min_time=0.05, out=out)
    return result


def cpu_compute_model(result: Any) -> Any:
    """The simulator's compute model with the physical constants of CPU ranks.

    The defaults of `plait.cost.compute.ComputeModel` describe A100s (fitted on Megatron
    runs): 128x128-tile wave quantisation over 108 SMs, 80 % of tensor-core peak, a host
    that runs ahead of the GPU. On a CPU rank none of that holds: a GEMM has no SM waves
    (tile 1), the measured kind's FLOP/s *is* the achieved matmul rate (efficiency 1, no
    alignment penalty), streaming kernels run at the measured copy bandwidth, and the
    eager dispatch cost of each op is paid serially with its work -- so it goes in the
    per-kernel device time, from the profile's tiny-op measurement (backward weighted 2:1,
    as backward runs about two kernels per forward one), not in a host time that overlaps.
    Optimizer traffic: fp32 AdamW reads p, g, m, v and writes p, m, v (28 B/param)."""
    from plait.cost.compute import ComputeModel

    fastest = [r for r, s in enumerate(result.slowdowns) if s == min(result.slowdowns)]
    fwd = statistics.median(result.op_overhead[r][0] for r in fastest)
    bwd = statistics.median(result.op_overhead[r][1] for r in fastest)
    return ComputeModel(gemm_efficiency=1.0, unaligned_penalty=1.0, memory_efficiency=1.0,
                        kernel_gpu_s=(fwd + 2 * bwd) / 3, host_fwd_s=0.0, host_bwd_s=0.0, host_comm_s=0.0,
                        p2p_host_s=0.0, loss_host_s=0.0, batch_host_s=0.0, step_host_s=0.0,
                        optimizer_bytes_per_param=28.0, grad_accum_bytes_per_param=12.0,
                        embedding_grad_bytes_per_param=4.0, tile=1)


def predict(model: str, cluster: str, plan: str, compute: Any = None) -> tuple[float, dict[str, float]]:
    from plait.sim.api import simulate

    res = simulate(model, cluster, plan, **({"compute": compute} if compute is not None else {}))
    return float(res.iteration_time_s), _per_device(res.timeline)


def _per_device(timeline: Any) -> dict[str, float]:
    """Mean per-device seconds in forward, backward (+ recompute, optimizer) and communication
    (measured communication includes the wait for the slowest peer)."""
    devices = {e.device for e in timeline.events if e.device is not None} or {None}
    out = {"fwd": 0.0, "bwd": 0.0, "comm": 0.0}
    for e in timeline.events:
        if e.category == "forward":
            out["fwd"] += e.duration
        elif e.category in ("backward", "recompute", "optimizer"):
            out["bwd"] += e.duration
        elif e.category.startswith("comm"):
            out["comm"] += e.duration
    return {k: v / len(devices) for k, v in out.items()}


def measure(model: str, cluster: str, plan: str, steps: int) -> tuple[float, float, dict[str, float], Any]:
    from plait.runtime.api import run

    res = run(model, cluster, plan, steps=steps, dtype="fp32")
    # Median of the steps after the first two (warm-up: allocator, gloo connections): robust
    # to the spikes other processes on this shared machine put into single steps.
    skip = 2 if len(res.iteration_times) > 3 else 0
    times = res.iteration_times[skip:]
    med = statistics.median(times)
    sd = statistics.stdev(times) if len(times) > 1 else 0.0
    k = min(range(skip, len(res.iteration_times)), key=lambda i: abs(res.iteration_times[i] - med))
    return med, sd, _per_device(res.step_timeline(k)), res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 plans per cluster, 4 steps")
    ap.add_argument("--steps", type=int, default=None, help="training steps per plan (default 8; quick 4)")
    ap.add_argument("--keep", help="directory for cluster files, profiles and traces (default: a temp dir)")
    ap.add_argument("--max-size", default="16M", help="largest collective size profiled (default 16M)")
    ap.add_argument("--model", default=MODEL)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from plait.cluster.profile import parse_size

    console = Console(width=170)
    steps = args.steps or (4 if args.quick else 8)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plait-sim-vs-real-"))
    work.mkdir(parents=True, exist_ok=True)
    plans = [p for p in PLANS if not args.quick or p[1] in QUICK]
    t_start = time.time()

    emulated, measured, models = {}, {}, {}
    for name, text in CLUSTERS.items():
        emulated[name] = work / f"{name}.yaml"
        emulated[name].write_text(textwrap.dedent(text))
        measured[name] = work / f"{name}-measured.yaml"
        t0 = time.time()
        res = profile_cluster(emulated[name], measured[name], parse_size(args.max_size))
        models[name] = cpu_compute_model(res)
        cross = [v["bandwidth"] for k, v in res.p2p.items()
                 if res.node_of[int(k.split("-")[0])] != res.node_of[int(k.split("-")[1])]]
        console.print(f"profiled [bold]{name}[/]: {time.time() - t0:.0f} s; fp32 GFLOP/s per rank "
                      + ", ".join(f"{m['fp32'] / 1e9:.1f}" for m in res.matmul)
                      + f"; cross-node p2p median {statistics.median(cross) / 1e6:.1f} MB/s"
                      + f"; slowdowns {[round(s, 2) for s in res.slowdowns]}"
                      + f"; op overhead {models[name].kernel_gpu_s * 1e6:.1f} us")

    rows = []
    for cname, label, plan in plans:
        try:
            sim_t, sim_cat = predict(args.model, str(measured[cname]), plan, models[cname])
            base_t, _ = predict(args.model, str(measured[cname]), plan)
        except Exception as exc:  # noqa: BLE001 -- a bench reports what failed and goes on
            sim_t, base_t, sim_cat = float("nan"), float("nan"), {}
            console.print(f"[red]simulate failed[/] for {cname} {label}: {type(exc).__name__}: {exc}")
        try:
            real_t, real_sd, real_cat, res = measure(args.model, str(emulated[cname]), plan, steps)
            all_steps = [round(t, 4) for t in res.iteration_times]
            res.timeline.save_chrome_trace(work / f"{cname}-{label.replace(' ', '_')}.trace.json")
        except Exception as exc:  # noqa: BLE001
            real_t, real_sd, real_cat, all_steps = float("nan"), 0.0, {}, []
            console.print(f"[red]run failed[/] for {cname} {label}: {type(exc).__name__}: {exc}")
        err = (sim_t - real_t) / real_t if real_t == real_t and real_t > 0 else float("nan")
        rows.append({"cluster": cname, "plan": label, "spec": plan, "predicted_s": sim_t, "measured_s": real_t,
                     "measured_sd_s": real_sd, "steps_s": all_steps, "error": err,
                     "baseline_s": base_t, "baseline_error": (base_t - real_t) / real_t if real_t > 0 else float("nan"), "sim": sim_cat, "real": real_cat})
        console.print(f"  {cname:6s} {label:18s} predicted {sim_t:.3f} s  measured {real_t:.3f} ± {real_sd:.3f} s"
                      f"  error {err * 100:+.1f} %")

    table = Table(title=f"sim vs real: {args.model}, {steps} steps (median of steps 3..{steps}), 4 CPU ranks")
    for col in ("cluster", "plan", "predicted s", "measured s", "error", "sim fwd/bwd+opt/comm s", "real fwd/bwd+opt/comm s",
                "baseline s (GPU model)", "baseline error"):
        table.add_column(col, justify="right" if col not in ("cluster", "plan") else "left")
    for r in rows:
        ok = abs(r["error"]) <= 0.10
        table.add_row(r["cluster"], r["plan"], f"{r['predicted_s']:.3f}", f"{r['measured_s']:.3f} ± {r['measured_sd_s']:.3f}",
                      f"[{'green' if ok else 'red'}]{r['error'] * 100:+.1f} %[/]",
                      "/".join(f"{r['sim'].get(k, float('nan')):.3f}" for k in ("fwd", "bwd", "comm")),
                      "/".join(f"{r['real'].get(k, float('nan')):.3f}" for k in ("fwd", "bwd", "comm")),
                      f"{r['baseline_s']:.3f}", f"{r['baseline_error'] * 100:+.0f} %")
    console.print(table)
    summary = {}
    for cname in CLUSTERS:
        sub = [r for r in rows if r["cluster"] == cname and r["error"] == r["error"]]
        if not sub:
            continue
        pred, real = [r["predicted_s"] for r in sub], [r["measured_s"] for r in sub]
        same = sorted(range(len(sub)), key=lambda i: pred[i]) == sorted(range(len(sub)), key=lambda i: real[i])
        mape = statistics.fmean(abs(r["error"]) for r in sub)
        summary[cname] = {"mape": mape, "max_abs_error": max(abs(r["error"]) for r in sub),
                          "spearman": spearman(pred, real), "same_ranking": same}
        console.print(f"{cname}: MAPE {mape * 100:.1f} %, worst {summary[cname]['max_abs_error'] * 100:.1f} %, "
                      f"Spearman {summary[cname]['spearman']:.2f}, same ranking: {same}")
    all_ok = rows and all(abs(r["error"]) <= 0.10 for r in rows) and all(s["same_ranking"] for s in summary.values())
    console.print(f"target (<= 10 % per plan, same ranking): {'met' if all_ok else 'NOT met'}; "
                  f"total {time.time() - t_start:.0f} s; files in {work}")
    (work / "sim_vs_real.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
