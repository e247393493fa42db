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

On a machine with one GPU, where no multi-rank plan runs, it sweeps single-GPU plans instead
(`--models`, several micro-batch sizes, recompute none/full, eager or SDPA attention) so the
memory estimator and the simulator are still held against CUDA. `--gemm` adds a table of
measured GEMM throughput beside `plait.cost.compute.gemm_time` for transformer-layer shapes.

Then every engine path (issue 30 item 4; `--no-engines` leaves it out): each form of plan on the
engine `plait.runtime.engine_for` gives it -- one GPU: a one-rank plan on torch's DDP, on FSDP2
and on plait's own executor, and a one-device SPMD program; several GPUs: DDP, FSDP2 (ZeRO-3),
DTensor tensor parallelism (fp32), a chain pipeline on torch's pipelining, plait's own tensor and
pipeline parallelism (`engine=plait`), a stage graph, an SPMD program and a composed plan (the SPMD
and composed families' own picks for the machine), and with 4 GPUs or more ZeRO-3 with pipelines
(FSDP2 over each stage's replicas) -- with the engine that ran it, its CUDA peak beside the simulator's memory for the
busiest GPU (`simulate(...).memory_peak_bytes`, the one memory model of every form) and its step
beside the simulator's. `engine_cases` builds them; `tests/test_gpu_check.py` holds them to every
engine without a GPU.

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


def _one_row(model: str, label: str, plan, cluster, steps: int, dtype: str) -> dict:
    """Run `plan` on NCCL and hold its busiest rank's CUDA peak and its median step against
    the memory estimator and the simulator."""
    import statistics

    from plait.cost.memory import estimate_memory
    from plait.graph.resolve import resolve_model
    from plait.runtime.api import LaunchConfig, TrainingConfig, run
    from plait.sim.api import simulate

    graph = resolve_model(model, plan, precision="amp")  # plait's engines: fp32 parameters under autocast
    est = estimate_memory(graph, plan, cluster, overhead_bytes=0)
    predicted = simulate(graph, cluster, plan, memory=False).iteration_time_s
    result = run(model, cluster, plan, steps=steps, training=TrainingConfig(dtype=dtype),
                 launch=LaunchConfig(device="cuda", emulate=False))
    measured = statistics.median(result.iteration_times[1:] or result.iteration_times)
    peak_rank = max(result.ranks, key=lambda r: r.peak_memory_bytes)
    est_peak = est.peak_bytes[plan.device_of(peak_rank.rank)]
    return {"model": model, "plan": label, "spec": str(plan), "ranks": plan.world_size, "engine": result.engine,
            "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
            "time_error_pct": (predicted / measured - 1) * 100,
            "cuda_peak_gib": peak_rank.peak_memory_bytes / 2**30, "estimated_gib": est_peak / 2**30,
            "memory_error_pct": (est_peak / peak_rank.peak_memory_bytes - 1) * 100,
            "memory_kind": peak_rank.memory_kind}


ENGINE_MODEL = "gpt:layers=4,hidden=512,heads=8,seq=256,vocab=8192"


def engine_cases(model: str, cluster, gpus: int, global_batch: int, dtype: str) -> list[tuple]:
    """(label, plan, the run's `LaunchConfig.engine`, the run's dtype) for every engine path `gpus`
    GPUs allow (module doc): the same model on each form, so their rows compare."""
    from plait.api import plan as search
    from plait.graph.resolve import resolve_model
    from plait.ir.plan import Plan, StageSpec

    def grid(text: str) -> Plan:
        return Plan.parse(f"{text},global_batch={global_batch},dtype={dtype}")

    def family(name: str, where=cluster) -> Plan:
        return search(model, where, global_batch=global_batch, top=1, families=name).best.plan

    if gpus == 1:
        return [("DDP, 1 rank", grid("dp=1,micro_batch=2"), "auto", dtype),
                ("FSDP2, 1 rank", grid("dp=1,zero=3,micro_batch=2"), "auto", dtype),
                ("plait executor, 1 rank", grid("dp=1,micro_batch=2"), "plait", dtype),
                ("SPMD program, 1 device", family("spmd"), "auto", dtype)]
    layers = [layer.name for layer in resolve_model(model, Plan()).layers]
    half = len(layers) // 2
    graph = Plan(stages=[StageSpec(name="front", layers=layers[:half], devices=[0]),
                         StageSpec(name="back", layers=layers[half:], devices=[1])],
                 stage_edges=[(0, 1)], micro_batch=2, global_batch=global_batch, dtype=dtype)
    # the composed family puts stages on nodes (or GPU kinds): it plans for the same GPUs as two
    # nodes, and the row runs and simulates that plan on the machine's one node
    from plait.cluster import load_cluster

    kind = cluster.devices[0].kind.name
    composed = family("compose", load_cluster(f"{kind}:nodes=2,gpus_per_node={gpus // 2}"))
    cases = [("DDP", grid("dp=2,micro_batch=2"), "auto", dtype),
             ("FSDP2 (ZeRO-3)", grid("dp=2,zero=3,micro_batch=2"), "auto", dtype),
             ("DTensor TP", grid("tp=2,micro_batch=2"), "auto", dtype),
             ("plait TP", grid("tp=2,micro_batch=2"), "plait", dtype),
             ("pipelining 1F1B", grid("pp=2,micro_batch=2,schedule=1f1b"), "auto", dtype),
             ("plait PP 1F1B", grid("pp=2,micro_batch=2,schedule=1f1b"), "plait", dtype),
             ("stage graph", graph, "auto", dtype),
             ("SPMD program", family("spmd"), "auto", dtype),
             ("composed", composed, "auto", dtype)]
    if gpus >= 4:  # ZeRO-3 with pipelines: FSDP2 over each stage's replicas on torch's pipelining
        cases.append(("FSDP2 + pipelining (ZeRO-3, pp=2)", grid("pp=2,dp=2,zero=3,micro_batch=2,schedule=1f1b"),
                      "auto", dtype))
    return cases


def _engine_row(model: str, label: str, plan, cluster, steps: int, engine: str, dtype: str,
                device: str = "cuda") -> dict:
    """Run `plan` on NCCL on the engine `engine_for` names, beside the simulator's step and memory
    (`device="cpu"`: the same run on gloo, to try the script without a GPU)."""
    from plait.runtime import engine_for
    from plait.runtime.api import LaunchConfig, TrainingConfig, run
    from plait.sim.api import simulate

    # max_memory_allocated does not see the CUDA context: the framework constant is left out
    sim = simulate(model, cluster, plan, memory_options={"overhead_bytes": 0})
    result = run(model, cluster, plan, steps=steps, training=TrainingConfig(dtype=dtype),
                 launch=LaunchConfig(device=device, emulate=False, engine=engine))
    measured = statistics.median(result.iteration_times[1:] or result.iteration_times)
    peak = max(r.peak_memory_bytes for r in result.ranks)
    est = max(sim.memory_peak_bytes) if sim.memory_peak_bytes else float("nan")
    return {"model": model, "plan": label, "spec": str(plan), "ranks": len(result.ranks),
            "engine": result.engine, "engine_expected": engine_for(plan, {"engine": engine, "dtype": dtype}).engine,
            "measured_ms": measured * 1e3, "predicted_ms": sim.iteration_time_s * 1e3,
            "time_error_pct": (sim.iteration_time_s / measured - 1) * 100,
            "cuda_peak_gib": peak / 2**30, "estimated_gib": est / 2**30,
            "memory_error_pct": (est / peak - 1) * 100, "memory_kind": result.ranks[0].memory_kind}


SWEEP_MODELS = (MODEL, MODEL + ",sdpa=true",
                "gpt:layers=24,hidden=2048,heads=16,seq=1024,vocab=50257,sdpa=true")


def single_gpu_plans(global_batch: int) -> list[tuple[str, str]]:
    """(label, plan) of one GPU: micro-batch sizes with and without full recompute."""
    out = [(f"mb={mb}", f"dp=1,micro_batch={mb},global_batch={global_batch}") for mb in (1, 2, 4, 8)]
    out += [(f"mb={mb} full recompute", f"dp=1,micro_batch={mb},global_batch={global_batch},recompute=full")
            for mb in (2, 8)]
    return out


def gemm_rows(kind_name: str, dtype: str) -> list[dict]:
    """Measured GEMM throughput (CUDA events around 20 back-to-back products, median of 10 samples) beside
    `gemm_time`'s prediction, for the (tokens x hidden) @ (hidden x k*hidden/tp) shapes of
    transformer layers at tp 1..8."""
    import torch

    from plait.cluster.catalog import GPU_KINDS
    from plait.cost.compute import gemm_time

    kind = GPU_KINDS[kind_name]
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    rows = []
    for tokens in (512, 2048, 8192):
        for hidden in (1024, 4096, 8192):
            for tp in (1, 8):
                for label, n in (("qkv", 3 * hidden // tp), ("mlp-up", 4 * hidden // tp)):
                    m, k = tokens, hidden
                    a = torch.randn(m, k, device="cuda", dtype=tdt)
                    b = torch.randn(k, n, device="cuda", dtype=tdt)
                    for _ in range(5):
                        a @ b
                    times = []
                    for _ in range(10):  # 20 back-to-back products per sample: no launch gaps
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        for _ in range(20):
                            a @ b
                        e1.record()
                        torch.cuda.synchronize()
                        times.append(e0.elapsed_time(e1) * 1e-3 / 20)
                    meas = statistics.median(times)
                    pred = gemm_time(m, n, k, kind, dtype)
                    rows.append({"m": m, "n": n, "k": k, "what": f"{label} tp={tp}",
                                 "measured_us": meas * 1e6, "predicted_us": pred * 1e6,
                                 "measured_tflops": 2 * m * n * k / meas / 1e12,
                                 "error_pct": (pred / meas - 1) * 100})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--models", nargs="*", default=None,
                    help="models of the one-GPU sweep (default: three GPT shapes)")
    ap.add_argument("--gemm", action="store_true", help="add the GEMM throughput table")
    ap.add_argument("--no-engines", action="store_true", help="leave out the engine-path rows")
    ap.add_argument("--engine-model", default=ENGINE_MODEL, help="the model of the engine-path rows")
    ap.add_argument("--out", default=None, help="also write the JSON here, after every row")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        msg = "gpu_check: no CUDA GPU on this machine; nothing to check (the NCCL/CUDA path needs one)"
        print(json.dumps({"summary": {"gpus": 0, "note": msg}, "rows": []}) if args.json else msg)
        return 0

    from plait.cluster import load_cluster
    from plait.ir.plan import Plan

    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    kind = detect_kind(name)
    if kind is None:
        print(f"gpu_check: {name!r} is not in plait's GPU catalog; add it (plait cluster presets) to predict it")
        return 2
    cluster = load_cluster(f"{kind}:nodes=1,gpus_per_node={gpus}")
    if gpus == 1:
        cases = [(m, label, text) for m in (args.models or SWEEP_MODELS)
                 for label, text in single_gpu_plans(args.global_batch)]
    else:
        cases = [(args.model, label, text) for label, text in plans_for(gpus, args.global_batch)]
    rows: list[dict] = []
    gemms = gemm_rows(kind, args.dtype) if args.gemm else []
    for model, label, text in cases:
        plan = Plan.parse(f"{text},dtype={args.dtype}")
        try:
            rows.append(_one_row(model, label, plan, cluster, args.steps, args.dtype))
        except Exception as exc:  # one failing plan (out of memory, say) must not lose the others
            rows.append({"model": model, "plan": label, "spec": str(plan), "error": f"{type(exc).__name__}: {exc}"[:400]})
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": rows, "gemm": gemms}, indent=1))
    if not args.no_engines:
        try:
            engine_rows = engine_cases(args.engine_model, cluster, gpus, args.global_batch, args.dtype)
        except Exception as exc:  # a family that proposes nothing must not lose the rows above
            rows.append({"model": args.engine_model, "plan": "engine paths", "error": f"{type(exc).__name__}: {exc}"[:400]})
            engine_rows = []
        for label, plan, engine, run_dtype in engine_rows:
            try:
                rows.append(_engine_row(args.engine_model, label, plan, cluster, args.steps, engine, run_dtype))
            except Exception as exc:
                rows.append({"model": args.engine_model, "plan": label, "spec": str(plan),
                             "error": f"{type(exc).__name__}: {exc}"[:400]})
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows, "gemm": gemms}, indent=1))
    ok = [r for r in rows if "error" not in r]
    bases = {}
    for r in ok:
        bases.setdefault(r["model"], r)
    for r in ok:
        base = bases[r["model"]]
        r["speedup_measured"] = base["measured_ms"] / r["measured_ms"]
        r["speedup_predicted"] = base["predicted_ms"] / r["predicted_ms"]
    rows_all, rows = rows, ok
    time_err = [abs(r["time_error_pct"]) for r in rows] or [float("nan")]
    mem_err = [abs(r["memory_error_pct"]) for r in rows] or [float("nan")]
    summary = {"gpus": gpus, "device": name, "kind": kind, "dtype": args.dtype, "plans": len(rows_all),
               "failed": len(rows_all) - len(rows),
               "time_mape_pct": statistics.fmean(time_err), "time_worst_pct": max(time_err),
               "memory_mape_pct": statistics.fmean(mem_err), "memory_worst_pct": max(mem_err)}
    long = [g["predicted_us"] / g["measured_us"] for g in gemms if g["measured_us"] >= 500]
    if long:
        # what `GPUKind.tensor_sustained` should be for this kind: the prediction's remaining
        # over-speed on GEMMs long enough to reach the sustained clock, times the value in use
        from plait.cluster.catalog import GPU_KINDS

        summary["gemm_long_pred_over_measured"] = statistics.geometric_mean(long)
        summary["tensor_sustained_implied"] = GPU_KINDS[kind].tensor_sustained * summary["gemm_long_pred_over_measured"]
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows_all, "gemm": gemms}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"NCCL on {gpus} x {name} ({kind}), {args.dtype}, median of {args.steps - 1} steps")
    for c in ("model", "plan", "ranks", "engine", "measured ms", "predicted ms", "error", "speed-up meas./pred.",
              "CUDA peak GiB", "estimated GiB", "error"):
        t.add_column(c, justify="right")
    for r in rows_all:
        if "error" in r:
            t.add_row(r["model"], r["plan"], "", "", "failed: " + r["error"][:60])
            continue
        t.add_row(r["model"], r["plan"], str(r["ranks"]), r.get("engine") or "", f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}",
                  f"{r['time_error_pct']:+.1f} %", f"{r['speedup_measured']:.2f} / {r['speedup_predicted']:.2f}",
                  f"{r['cuda_peak_gib']:.2f}", f"{r['estimated_gib']:.2f}", f"{r['memory_error_pct']:+.1f} %")
    Console().print(t)
    if gemms:
        g = Table(title=f"GEMM (m x k) @ (k x n), {args.dtype}: measured vs plait.cost.compute.gemm_time")
        for c in ("shape", "m", "n", "k", "measured us", "predicted us", "TFLOP/s", "error"):
            g.add_column(c, justify="right")
        for r in gemms:
            g.add_row(r["what"], str(r["m"]), str(r["n"]), str(r["k"]), f"{r['measured_us']:.1f}",
                      f"{r['predicted_us']:.1f}", f"{r['measured_tflops']:.0f}", f"{r['error_pct']:+.1f} %")
        Console().print(g)
    print(f"time MAPE {summary['time_mape_pct']:.1f} % (worst {summary['time_worst_pct']:.1f} %), memory MAPE "
          f"{summary['memory_mape_pct']:.1f} % (worst {summary['memory_worst_pct']:.1f} %)")
    if "tensor_sustained_implied" in summary:
        print(f"GEMMs >= 0.5 ms: predicted / measured {summary['gemm_long_pred_over_measured']:.3f} (geometric mean); "
              f"implied tensor_sustained for {kind}: {summary['tensor_sustained_implied']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
