"""Capture time and peak RAM for GPT-3 shapes up to 175B, and the accuracy of what is captured.

    python bench/capture_175b.py              # 350m, 1.3b, 13b, 175b
    python bench/capture_175b.py --sizes 175b

Each measurement runs in a fresh process (so peak RSS is that job's alone), in three modes:

* `plain`   -- baseline: the model's own forward + loss + backward on meta, nothing recorded;
* `full`    -- baseline: `capture(..., replicate=False)`, every layer traced;
* `capture` -- `capture(...)` as plait runs it (identical layers traced twice, then replicated).

Time columns are the step itself (build excluded, shown apart); RSS is the process peak
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`), torch's import included. Accuracy columns
compare the capture with closed forms: parameters with the zoo's formula (Narayanan et al.
2021, eq. 2), forward FLOPs per sample with 24·s·L·h²·(1 + s/6h) + 2·s·h·V (the forward
part of Narayanan et al.'s eq. 3: 24sh² + 4s²h per layer, 2shV for the logits), and saved
bytes of a transformer layer (bf16, dropout on) with Korthikanti et al. 2022:
s·h·(34 + 5·a·s/h).

Steps are timed warm: a tiny GPT runs first in the same process, because the first meta
op that has a Python meta kernel imports torch's decompositions (seconds, once per
process); that one-off cost is the `warm-up s` column.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

LIMIT_SECONDS = 30.0
LIMIT_RSS = 2 * 2**30


def worker(size: str, mode: str) -> dict:
    import torch

    from plait.graph.capture import capture
    from plait.graph.zoo import load_model

    tw = time.perf_counter()
    tiny = load_model("gpt:layers=2,hidden=16,heads=2,seq=8,vocab=32")
    tiny_in, tiny_target = tiny.sample_batch(2, device="meta")
    tiny_model = tiny.build(device="meta")
    if mode == "plain":
        tiny.loss(tiny_model(*tiny_in), tiny_target).backward()
    else:
        capture(tiny_model, tiny_in, name="warm-up", loss_fn=lambda o: tiny.loss(o, tiny_target))
    warm = time.perf_counter() - tw

    spec = load_model(f"gpt:size={size}")
    t0 = time.perf_counter()
    module = spec.build(device="meta", dtype=torch.bfloat16)
    inputs, target = spec.sample_batch(2, device="meta", dtype=torch.bfloat16)
    t1 = time.perf_counter()
    out: dict = {"build_s": t1 - t0, "warm_s": warm}
    if mode == "plain":
        spec.loss(module(*inputs), target).backward()
    else:
        g = capture(
            module,
            inputs,
            name=spec.name,
            config=spec.config,
            loss_fn=lambda o: spec.loss(o, target),
            replicate=mode == "capture",
        )
        c = spec.config
        s, h, a, L, V = c["seq"], c["hidden"], c["heads"], c["layers"], c["vocab"]
        mid = g.layer(f"layers.{L // 2}")
        out.update(
            params=g.param_count,
            params_formula=spec.param_count_formula(),
            fwd_flops=g.fwd_flops,
            fwd_formula=24 * s * L * h * h * (1 + s / (6 * h)) + 2 * s * h * V,
            bwd_over_fwd=g.bwd_flops / g.fwd_flops,
            layer_saved=mid.saved_bytes,
            korthikanti=s * h * (34 + 5 * a * s / h),
            ops=len(g.ops),
            replicated=bool(g.config.get("capture_replicated")),
        )
    out["step_s"] = time.perf_counter() - t1
    out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return out


def measure(size: str, mode: str) -> dict:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", size, mode],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        },
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker {size} {mode} failed:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="350m,1.3b,13b,175b")
    parser.add_argument("--worker", nargs=2, metavar=("SIZE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0

    from rich.console import Console
    from rich.table import Table

    speed = Table(
        title="capture speed and memory (fresh process each; step = forward+loss+backward)"
    )
    for col in (
        "model",
        "mode",
        "warm-up s",
        "build s",
        "step s",
        "process s",
        "peak RSS",
        "ops",
        "replicated",
    ):
        speed.add_column(col, justify="left" if col in ("model", "mode") else "right")
    acc = Table(title="what the capture measures vs closed forms (per sample, bf16, dropout on)")
    for col in ("model", "params", "vs formula", "fwd TFLOP", "vs formula ", "bwd/fwd",
                "layer saved MiB", "vs Korthikanti"):  # fmt: skip
        acc.add_column(col, justify="left" if col == "model" else "right")
    ok = True
    for size in args.sizes.split(","):
        results = {mode: measure(size, mode) for mode in ("plain", "full", "capture")}
        for mode, r in results.items():
            speed.add_row(
                f"gpt {size}",
                mode,
                f"{r['warm_s']:.2f}",
                f"{r['build_s']:.2f}",
                f"{r['step_s']:.2f}",
                f"{r['process_s']:.1f}",
                f"{r['rss'] / 2**20:.0f} MiB",
                str(r.get("ops", "")),
                {True: "yes", False: "no"}.get(r.get("replicated"), ""),
            )
        r = results["capture"]
        acc.add_row(
            f"gpt {size}",
            f"{r['params'] / 1e9:.3f} B",
            f"{r['params'] / r['params_formula'] - 1:+.2%}",
            f"{r['fwd_flops'] / 1e12:.3f}",
            f"{r['fwd_flops'] / r['fwd_formula'] - 1:+.2%}",
            f"{r['bwd_over_fwd']:.3f}",
            f"{r['layer_saved'] / 2**20:.1f}",
            f"{r['layer_saved'] / r['korthikanti'] - 1:+.2%}",
        )
        full = results["full"]
        if any(full[k] != r[k] for k in ("params", "fwd_flops", "bwd_over_fwd", "layer_saved")):
            ok = False
        if size == "175b":
            ok &= r["step_s"] < LIMIT_SECONDS and r["rss"] < LIMIT_RSS
    console = Console(width=140)
    console.print(speed)
    console.print(acc)
    console.print(
        f"target: 175B captured in < {LIMIT_SECONDS:.0f} s with < {LIMIT_RSS / 2**30:.0f} GiB RSS, "
        f"replicated == full: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
