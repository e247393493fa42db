"""The models users bring (issue 38): six Hugging Face `transformers` models, built from configs
with random weights (`examples/models/hf.py`, nothing downloaded), through every command.

    python bench/hf_models.py            # the table
    python bench/hf_models.py --json     # one JSON object: {"rows": [...], "summary": {...}}
    python bench/hf_models.py --models llama,t5 --skip plan_run

Columns, per model:

* inspect -- the tiny model's layers, and how many of them are transformer blocks (one per block);
* simulate -- the realistic size (`*_1b`, `gpt2_xl`, `bert_large`, `t5_base`) on one 8 x A100-80GB
  node, dp=8, micro-batch 1, in bf16 and fp16: predicted iteration time and peak memory;
* plan -- `plait plan` of the realistic size on that node (3D family, global batch 64), in bf16 and
  fp16: the bf16 pick, and both picks' predicted iteration times;
* plan --run -- `plait plan --run` of the tiny size on this machine (emulated cluster): exit status;
* dp, pp, tp -- dp=2, pp=2 and tp=2 of the tiny size trained 2 steps with SGD against one process
  (the baseline, run here in the same bench): the largest parameter difference, and for tp the
  parameters each rank holds next to the model's total (tp needs the config's base_model_tp_plan;
  a model without one is refused before launch, and the row says so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "examples" / "models" / "hf.py"
MODELS = {  # tiny factory -> realistic factory
    "llama": "llama_1b", "gpt2": "gpt2_xl", "mixtral": "mixtral_1b",
    "qwen2_moe": "qwen2_moe_1b", "bert": "bert_large", "t5": "t5_base",
}
CLUSTER = "a100-80g:nodes=1"
COLUMNS = ("inspect", "simulate", "plan", "plan_run", "dp", "pp", "tp")


def _cli(*args: str, timeout: int = 900) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, p.stdout, p.stderr


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def inspect_cell(tiny: str) -> dict[str, Any]:
    from torch import nn

    from plait.graph.inspect import inspect_model
    from plait.graph.zoo import load_model

    spec = load_model(f"{HF}:{tiny}")
    g = inspect_model(spec, batch=1, dtype="bf16")
    module = spec.build("meta")
    lists = [p for p, m in module.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [p for p in lists if not any(p.startswith(q + ".") for q in lists)]  # T5Block.layer is inside a block
    blocks = sum(len(module.get_submodule(p)) for p in outer)
    in_blocks = [n for n in g.layer_names if n.rsplit(".", 1)[0] in outer]
    return {"ok": len(in_blocks) == blocks, "layers": len(g.layers), "blocks": blocks,
            "block_layers": len(in_blocks), "tp_blocks": sum(layer.tp_style == "transformer" for layer in g.layers)}


def simulate_cell(real: str) -> dict[str, Any]:
    out: dict[str, Any] = {"ok": True}
    for dtype in ("bf16", "fp16"):
        rc, so, se = _cli("simulate", "--model", f"{HF}:{real}", "--cluster", CLUSTER, "--plan",
                          f"dp=8,micro_batch=1,global_batch=64,dtype={dtype}", "--json")
        if rc:
            out.update(ok=False, error=_last_line(se))
            return out
        d = json.loads(so)
        out[dtype] = {"iteration_ms": round(d["iteration_time_s"] * 1e3, 2), "fits_memory": d["fits_memory"],
                      "peak_gib": round(max(d.get("memory_peak_bytes") or [0]) / 2**30, 2)}
    return out


def plan_cell(real: str) -> dict[str, Any]:
    out: dict[str, Any] = {"ok": True}
    for dtype in ("bf16", "fp16"):
        rc, so, se = _cli("plan", "--model", f"{HF}:{real}", "--cluster", CLUSTER, "--family", "3d",
                          "--global-batch", "64", "--dtype", dtype, "--json")
        if rc:
            return {"ok": False, "error": f"{dtype}: {_last_line(se)}"}
        d = json.loads(so)
        top = d["top"][0]
        out[dtype] = {"best": top["plan_str"], "iteration_ms": round(top["iteration_time_s"] * 1e3, 2),
                      "candidates": d["candidates"]["enumerated"], "search_s": round(d["search_time_s"], 2)}
    return out


def plan_run_cell(tiny: str) -> dict[str, Any]:
    rc, so, se = _cli("plan", "--model", f"{HF}:{tiny}", "--run", "--steps", "2")
    line = next((ln.strip() for ln in so.splitlines() if "losses" in ln), "")
    return {"ok": rc == 0, "run": line[:120] if rc == 0 else _last_line(se)}


def train_cell(tiny: str, plan_text: str) -> dict[str, Any]:
    from plait.graph.zoo import load_model
    from plait.ir.plan import Plan
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run
    from plait.runtime.partition import RuntimeSetupError

    model = f"{HF}:{tiny}"
    plan = Plan.parse(plan_text)
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5)
    try:
        result = run(model, None, plan, steps=2, training=training, launch=LaunchConfig(timeout=300),
                     records=RecordsConfig(return_params=True))
    except RuntimeSetupError as exc:
        return {"ok": False, "refused": str(exc)[:160]}
    ref_losses, ref_params = reference_run(model, plan, 2, training=training)
    assert result.params is not None
    missing = sorted(set(ref_params) ^ set(result.params))
    diff = max((float((v - ref_params[n]).abs().max()) for n, v in result.params.items() if n in ref_params),
               default=float("nan"))
    loss_diff = max(abs(a - b) for a, b in zip(result.losses, ref_losses))
    total = sum(p.numel() for p in load_model(model).build("meta").parameters())
    return {"ok": not missing and diff <= 1e-5 and loss_diff <= 1e-5, "max_param_diff": diff,
            "max_loss_diff": loss_diff, "names_differ": missing[:3],
            "params_per_rank": [r.params for r in result.ranks], "model_params": total}


def _fmt(col: str, c: dict[str, Any]) -> str:
    if c is None:
        return "-"
    if col == "inspect":
        return f"{c['block_layers']}/{c['blocks']} blocks, {c['layers']} layers" + \
            (f", {c['tp_blocks']} tp" if c["tp_blocks"] else "")
    if not c.get("ok") and "refused" in c:
        return "refused"
    if not c.get("ok") and c.get("error") is not None:
        return "FAIL " + c["error"][:40]
    if col == "simulate":
        return f"{c['bf16']['iteration_ms']:.0f}/{c['fp16']['iteration_ms']:.0f} ms {c['bf16']['peak_gib']:.1f} GiB"
    if col == "plan":
        return f"{c['bf16']['best'].split(',recompute')[0]} {c['bf16']['iteration_ms']:.0f}/" \
            f"{c['fp16']['iteration_ms']:.0f} ms"
    if col == "plan_run":
        return "ok" if c["ok"] else "FAIL"
    tag = "ok" if c["ok"] else "FAIL"
    if col == "tp":
        return f"{tag} {c['max_param_diff']:.0e}, {c['params_per_rank'][0]:,}/{c['model_params']:,}"
    return f"{tag} {c['max_param_diff']:.0e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--skip", default="", help="columns to leave out, comma-separated")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    for tiny in args.models.split(","):
        real = MODELS[tiny]
        row: dict[str, Any] = {"model": tiny, "realistic": real}
        t0 = time.perf_counter()
        cells = {
            "inspect": (inspect_cell, (tiny,)),
            "simulate": (simulate_cell, (real,)),
            "plan": (plan_cell, (real,)),
            "plan_run": (plan_run_cell, (tiny,)),
            "dp": (train_cell, (tiny, "dp=2,micro_batch=2,global_batch=4,dtype=fp32",)),
            "pp": (train_cell, (tiny, "pp=2,micro_batch=2,global_batch=4,schedule=1f1b,dtype=fp32",)),
            "tp": (train_cell, (tiny, "tp=2,micro_batch=2,global_batch=4,dtype=fp32",)),
        }
        for col in COLUMNS:
            if col in skip:
                continue
            try:
                fn, fargs = cells[col]
                row[col] = fn(*fargs)
            except Exception as exc:  # a cell's failure is a finding, not the end of the table
                row[col] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"  {tiny} {col}: {json.dumps(row[col])[:200]}", file=sys.stderr, flush=True)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    cols = [c for c in COLUMNS if c not in skip]
    summary = {c: f"{sum(1 for r in rows if r[c].get('ok'))}/{len(rows)}" for c in cols}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, default=str))
        return
    width = {c: max(len(c), *(len(_fmt(c, r[c])) for r in rows)) for c in cols}
    head = f"{'model':10} " + " | ".join(f"{c:{width[c]}}" for c in cols)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:10} " + " | ".join(f"{_fmt(c, r[c]):{width[c]}}" for c in cols))
    print("ok per column: " + ", ".join(f"{c} {v}" for c, v in summary.items()))
    print(f"simulate/plan: realistic sizes on {CLUSTER} (dp=8, mb=1, bf16/fp16 ms); dp/pp/tp: tiny sizes, "
          "2 SGD steps vs one process (max |param diff|; tp: params on rank 0 / model)")


if __name__ == "__main__":
    main()
