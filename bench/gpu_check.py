"""The GPU path, checked on a machine that has GPUs: NCCL runs of DP, TP, PP and 3D plans, each
next to plait's own figures for it.

    python bench/gpu_check.py            # every plan the visible GPUs allow
    python bench/gpu_check.py --json     # the same rows as one JSON object ("summary" at the top)
    python bench/gpu_check.py --steps 8 --model gpt:layers=8,hidden=1024,heads=16,seq=1024

Per plan it prints the measured CUDA peak memory of the busiest rank
(`torch.cuda.max_memory_allocated`, what `plait run` records on CUDA) beside the memory
estimator's peak for that rank (`plait.cost.memory.estimate_memory`, framework overhead
excluded, since max_memory_allocated does not see the CUDA context), and the measured step time
(median after one warm-up step) beside the simulator's prediction for the same plan on a
one-node cluster of the detected GPU kind (`plait.sim.api.simulate`). The baseline, measured
in the same run, is the one-GPU plan (dp=1): every other plan's speed-up over it is printed
measured and predicted.

On a machine without CUDA it says so and exits 0; it is not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "gpt:layers=8,hidden=1024,heads=16,seq=512,vocab=32000"


def detect_kind(name: str) -> str | None:
    """The catalog kind of a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100-80gb')."""
    from plait.cluster.catalog import GPU_KINDS
    from plait.runtime.multinode import _kind_matches

    hits = [k for k in GPU_KINDS if _kind_matches(k, name)]
    if not hits:
        return None
    mem = [k for k in hits if k.split("-")[-1].rstrip("gb").isdigit() and k.split("-")[-1][:-2] in name]
    return (mem or hits)[0]


def plans_for(gpus: int, global_batch: int) -> list[tuple[str, str]]:
    """(label, plan) for DP, TP, PP and 3D shapes that fit on `gpus` devices, plus the 1-GPU baseline."""
    out = [("1 GPU (baseline)", f"dp=1,micro_batch=2,global_batch={global_batch}")]
    if gpus >= 2:
        out += [("DP", f"dp=2,micro_batch=2,global_batch={global_batch}"),
                ("TP", f"tp=2,micro_batch=2,global_batch={global_batch}"),
                ("PP 1F1B", f"pp=2,micro_batch=2,global_batch={global_batch},schedule=1f1b")]
    if gpus >= 4:
        out += [("DP x TP", f"dp=2,tp=2,micro_batch=2,global_batch={global_batch}")]
    if gpus >= 8:
        out += [("3D", f"dp=2,tp=2,pp=2,micro_batch=2,global_batch={global_batch},schedule=1f1b"),
                ("3D + SP + ZeRO-1", f"dp=2,tp=2,pp=2,micro_batch=2,global_batch={global_batch},"
                                     f"sequence_parallel=true,zero=1")]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        msg = "gpu_check: no CUDA GPU on this machine; nothing to check (the NCCL/CUDA path needs one)"
        print(json.dumps({"summary": {"gpus": 0, "note": msg}, "rows": []}) if args.json else msg)
        return 0

    from plait.cluster import load_cluster
    from plait.cost.memory import estimate_memory
    from plait.graph.resolve import resolve_model
    from plait.ir.plan import Plan
    from plait.runtime.api import LaunchConfig, TrainingConfig, run
    from plait.sim.api import simulate

    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    kind = detect_kind(name)
    if kind is None:
        print(f"gpu_check: {name!r} is not in plait's GPU catalog; add it (plait cluster presets) to predict it")
        return 2
    cluster = load_cluster(f"{kind}:nodes=1,gpus_per_node={gpus}")
    rows = []
    for label, text in plans_for(gpus, args.global_batch):
        plan = Plan.parse(f"{text},dtype={args.dtype}")
        graph = resolve_model(args.model, plan)
        est = estimate_memory(graph, plan, cluster, overhead_bytes=0)
        predicted = simulate(graph, cluster, plan, memory=False).iteration_time_s
        result = run(args.model, cluster, plan, steps=args.steps, training=TrainingConfig(dtype=args.dtype),
                     launch=LaunchConfig(device="cuda", emulate=False))
        measured = statistics.median(result.iteration_times[1:] or result.iteration_times)
        peak_rank = max(result.ranks, key=lambda r: r.peak_memory_bytes)
        est_peak = est.peak_bytes[plan.device_of(peak_rank.rank)]
        rows.append({"plan": label, "spec": str(plan), "ranks": plan.world_size,
                     "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                     "time_error_pct": (predicted / measured - 1) * 100,
                     "cuda_peak_gib": peak_rank.peak_memory_bytes / 2**30, "estimated_gib": est_peak / 2**30,
                     "memory_error_pct": (est_peak / peak_rank.peak_memory_bytes - 1) * 100,
                     "memory_kind": peak_rank.memory_kind})
    base = rows[0]
    for r in rows:
        r["speedup_measured"] = base["measured_ms"] / r["measured_ms"]
        r["speedup_predicted"] = base["predicted_ms"] / r["predicted_ms"]
    time_err = [abs(r["time_error_pct"]) for r in rows]
    mem_err = [abs(r["memory_error_pct"]) for r in rows]
    summary = {"gpus": gpus, "device": name, "kind": kind, "model": args.model, "dtype": args.dtype,
               "time_mape_pct": statistics.fmean(time_err), "time_worst_pct": max(time_err),
               "memory_mape_pct": statistics.fmean(mem_err), "memory_worst_pct": max(mem_err)}
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"NCCL on {gpus} x {name} ({kind}), {args.model}, {args.dtype}, median of {args.steps - 1} steps")
    for c in ("plan", "ranks", "measured ms", "predicted ms", "error", "speed-up meas./pred.",
              "CUDA peak GiB", "estimated GiB", "error"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["plan"], str(r["ranks"]), f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}",
                  f"{r['time_error_pct']:+.1f} %", f"{r['speedup_measured']:.2f} / {r['speedup_predicted']:.2f}",
                  f"{r['cuda_peak_gib']:.2f}", f"{r['estimated_gib']:.2f}", f"{r['memory_error_pct']:+.1f} %")
    Console().print(t)
    print(f"time MAPE {summary['time_mape_pct']:.1f} % (worst {summary['time_worst_pct']:.1f} %), memory MAPE "
          f"{summary['memory_mape_pct']:.1f} % (worst {summary['memory_worst_pct']:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
