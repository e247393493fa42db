"""The same LLaMA architecture as a Hugging Face model and as plait's zoo model (issue 38 goal:
predicted step time and memory within 2 %). 1.1B shape: h=2048, ffn 5632, 22 layers, 32 heads,
4 key/value heads, s=2048, V=32000, untied head -- `examples/models/hf.py:llama_1b` and
`llama:layers=22,...`. Both are captured on fake tensors and simulated on one 8 x A100-80GB node.

    python bench/hf_vs_zoo.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HF = f"{ROOT / 'examples' / 'models' / 'hf.py'}:llama_1b"
ZOO = "llama:layers=22,hidden=2048,heads=32,kv_heads=4,seq=2048,vocab=32000,ffn=5632"
CLUSTER = "a100-80g:nodes=1"
PLANS = ["dp=8,micro_batch=1,global_batch=64", "dp=8,micro_batch=2,global_batch=64",
         "dp=4,tp=2,micro_batch=1,global_batch=64", "dp=4,pp=2,micro_batch=1,global_batch=64"]


def simulate(model: str, plan: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "plait.cli", "simulate", "--model", model, "--cluster", CLUSTER,
                        "--plan", plan, "--json"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode:
        raise SystemExit(f"{model} {plan}: {p.stderr.strip().splitlines()[-1]}")
    d = json.loads(p.stdout)
    return {"ms": d["iteration_time_s"] * 1e3, "gib": max(d["memory_peak_bytes"]) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for plan in PLANS:
        z, h = simulate(ZOO, plan), simulate(HF, plan)
        rows.append({"plan": plan, "zoo_ms": z["ms"], "hf_ms": h["ms"], "time_diff": h["ms"] / z["ms"] - 1,
                     "zoo_gib": z["gib"], "hf_gib": h["gib"], "memory_diff": h["gib"] / z["gib"] - 1})
    summary = {"max_abs_time_diff": max(abs(r["time_diff"]) for r in rows),
               "max_abs_memory_diff": max(abs(r["memory_diff"]) for r in rows), "goal": 0.02}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}))
        return
    print(f"{'plan':42} {'zoo ms':>9} {'hf ms':>9} {'diff':>7} {'zoo GiB':>8} {'hf GiB':>8} {'diff':>7}")
    for r in rows:
        print(f"{r['plan']:42} {r['zoo_ms']:9.1f} {r['hf_ms']:9.1f} {r['time_diff']:+7.1%} "
              f"{r['zoo_gib']:8.2f} {r['hf_gib']:8.2f} {r['memory_diff']:+7.1%}")
    print(f"max |diff|: time {summary['max_abs_time_diff']:.1%}, memory {summary['max_abs_memory_diff']:.1%} "
          f"(goal 2 %); the zoo model is the baseline, simulated in the same run on {CLUSTER}")


if __name__ == "__main__":
    main()
