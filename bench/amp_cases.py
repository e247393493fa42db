"""plait against AMP's planner on AMP's own published cases, with AMP's measured runs as referee.

    python bench/amp_cases.py                       # both clusters, plait's predictions and picks
    python bench/amp_cases.py --amp ../AMP          # also time AMP's own planner (its public code)
    python bench/amp_cases.py --json
    python bench/amp_cases.py --no-search --amp-known-cost AMP/src/known_cost   # + AMP's costs as a profile

Data: ``bench/data/amp_trials.yaml`` -- every configuration AMP ranked and then launched for real
(DeepSpeed + Megatron-LM v1.1.5, GPT-2 24 x 1024, global batch 32, fp16) on its two clusters
(``bench/data/amp_homogeneous.yaml``: 4 x 4 T4; ``bench/data/amp_het_cluster.yaml``: 3 x 4 V100 +
4 T4), with AMP's own predicted cost and the measured iteration time (null: the run failed).

For each cluster the bench prints, over the trials that ran:
* **ranking**: Spearman's rho between predicted and measured iteration time, plait's simulator
  and AMP's cost model side by side (same trials);
* **scale**: median predicted / measured, plait and AMP;
* **pick among the measured trials**: the trial each model ranks first and its measured time
  over the measured best (1.00 = the fastest; a failed run counts as a miss), and whether
  plait's memory estimate flags the trials that failed;
* **plait's own search** (`plait.plan` on the cluster, no knowledge of the trials): its
  plan, and the measured time of the trial with the same dp x tp x pp x micro-batch when one
  was measured;
* **planner CPU time**: plait's search (CPU seconds of this process and the search's worker processes) and, with ``--amp DIR`` (a checkout
  of github.com/DachengLi1/AMP), AMP's planner (``src/homogeneous.py`` / ``src/het_cluster.py``
  without real trials) timed in the same run; skipped cleanly without it.

Trials whose pipeline partition leaves a stage without a whole layer of plait's graph (AMP's
partition is over 30 pipeline specs, plait's over 26 layers: see `partition_to_split`) cannot be
expressed as a plait plan and are counted, not scored.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

DATA = ROOT / "bench" / "data"
MODEL = "gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=52256"
GLOBAL_BATCH = 32
CASES = {"homogeneous": DATA / "amp_homogeneous.yaml", "het_cluster": DATA / "amp_het_cluster.yaml"}


def partition_to_split(partition: list[int], blocks: int = 24) -> list[int] | None:
    """plait's `layer_split` (embedding, blocks, head) of a DeepSpeed GPT2ModelPipe partition.

    The pipe's specs are: 0 embedding, 1 transpose, 2..blocks+1 the transformer layers, then a
    transpose, the final layer norm, the tied LM head and an fp16->fp32 cast; plait's layers are
    the embedding, the blocks and the head (final norm + LM head). Stage i holds specs
    [partition[i], partition[i+1]). None when a stage would hold no plait layer."""
    head = blocks + 4  # the LM head's spec index (the final norm, blocks + 3, goes with it)
    to_layer = {0: 0, **{k: k - 1 for k in range(2, blocks + 2)}, head: blocks + 1}
    split = [sum(1 for k in range(a, b) if k in to_layer) for a, b in zip(partition, partition[1:])]
    return split if all(split) else None


def trial_plan(t: dict[str, Any]) -> Any:
    """The plait Plan of an AMP trial, or None when its partition cannot be expressed."""
    from plait.ir.plan import Plan

    split = partition_to_split(t["partition"]) if t["pp"] > 1 else None
    if t["pp"] > 1 and split is None:
        return None
    return Plan(dp=t["dp"], tp=t["tp"], pp=t["pp"], micro_batch=t["micro_batch"], global_batch=GLOBAL_BATCH,
                dtype="fp16", grad_reduce_dtype="fp32", recompute="none", schedule="1f1b",
                layer_split=split, grad_bucket_mb=0)


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic) if len(a) > 2 else float("nan")


def score_case(name: str, trials: list[dict[str, Any]], search: bool = True, compute: Any = None) -> dict[str, Any]:
    from plait.sim.api import simulate

    cluster = str(CASES[name])
    rows, skipped = [], 0
    for t in trials:
        plan = trial_plan(t)
        if plan is None:
            skipped += 1
            continue
        # AMP ran DeepSpeed + Megatron-LM in fp16: the model in fp16, fp32 master weights
        res = simulate(MODEL, cluster, plan, precision="megatron", **({"compute": compute} if compute is not None else {}))
        rows.append({**t, "plait_s": res.iteration_time_s, "fits": bool(res.fits_memory), "plan": str(plan)})
    ran = [r for r in rows if r["measured_s"] is not None]
    failed = [r for r in rows if r["measured_s"] is None]
    best = min(r["measured_s"] for r in ran)
    out: dict[str, Any] = {
        "case": name, "trials": len(trials), "expressible": len(rows), "not_expressible": skipped,
        "ran": len(ran), "failed": len(failed),
        "spearman_plait": spearman([r["plait_s"] for r in ran], [r["measured_s"] for r in ran]),
        "spearman_amp": spearman([r["amp_predicted_s"] for r in ran], [r["measured_s"] for r in ran]),
        "scale_plait": statistics.median(r["plait_s"] / r["measured_s"] for r in ran),
        "scale_amp": statistics.median(r["amp_predicted_s"] / r["measured_s"] for r in ran),
        "failed_flagged_by_memory": sum(not r["fits"] for r in failed),
        "ran_flagged_by_memory": sum(not r["fits"] for r in ran),
        "measured_best_s": best,
    }
    # each model's first choice among the expressible trials (a failed trial is a miss: inf)
    for who, key in (("plait", "plait_s"), ("amp", "amp_predicted_s")):
        pool = [r for r in rows if r["fits"]] if who == "plait" else rows
        pick = min(pool, key=lambda r: r[key])
        meas = pick["measured_s"]
        out[f"pick_{who}"] = pick["plan"]
        out[f"pick_{who}_vs_best"] = (meas / best) if meas is not None else float("inf")
    if search:
        out.update(_search(cluster, rows, best))
    out["rows"] = [{k: r[k] for k in ("plan", "partition", "measured_s", "amp_predicted_s", "plait_s", "fits")}
                   for r in rows]
    return out


def _search(cluster: str, rows: list[dict[str, Any]], best: float) -> dict[str, Any]:
    from plait.api import plan
    from plait.workers import cpu_seconds  # the search's worker processes included

    c0 = cpu_seconds()
    res = plan(MODEL, cluster, global_batch=GLOBAL_BATCH, top=5, progress=False, precision="megatron")
    cpu = cpu_seconds() - c0
    p = res.best.plan
    same = [r for r in rows if r["measured_s"] is not None and (r["dp"], r["tp"], r["pp"], r["micro_batch"])
            == (p.dp, p.tp, p.pp, p.micro_batch)]
    meas = min((r["measured_s"] for r in same), default=None)
    return {"search_plan": str(p), "search_predicted_s": res.best.time_s, "search_cpu_s": cpu,
            "search_measured_same_shape_s": meas,
            "search_vs_best": (meas / best) if meas is not None else None}


def amp_planner_cpu(amp_dir: Path, case: str, timeout_s: float) -> float | None:
    """CPU seconds of AMP's own planner for `case` (its script without --full: prediction only),
    or None when the checkout or its dependencies (tqdm, spur) are missing. The script runs
    unmodified; NumPy 2 dropped the `np.infty` alias it uses, so the runner restores it. Its logs
    go to a temporary HOME."""
    import tempfile

    script = amp_dir / "src" / f"{case}.py"
    if not script.exists():
        return None
    shim = ("import numpy as np, runpy, sys; np.infty = np.inf; sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as home:
        try:
            subprocess.run([sys.executable, "-c", shim, script.name], cwd=script.parent, timeout=timeout_s,
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "HOME": home})
        except (subprocess.SubprocessError, OSError):
            return None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _short(plan: str | None) -> str:
    if not plan:
        return "-"
    keep = ("dp", "tp", "pp", "micro_batch", "layer_split", "dp_shares", "zero", "recompute")
    return " ".join(f.replace("micro_batch", "mb") for f in plan.split(",") if f.split("=")[0] in keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amp", metavar="DIR", type=Path, default=None,
                    help="a checkout of github.com/DachengLi1/AMP: also time its planner")
    ap.add_argument("--amp-timeout", type=float, default=1800.0)
    ap.add_argument("--no-search", action="store_true", help="skip plait's own search")
    ap.add_argument("--case", choices=list(CASES), action="append", help="only this cluster (repeatable)")
    ap.add_argument("--amp-known-cost", metavar="DIR", type=Path, default=None,
                    help="AMP's src/known_cost folder: also score plait with those per-layer costs imported "
                         "as a model profile (plait.cost.profile_import), beside the analytic model")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    trials = yaml.safe_load((DATA / "amp_trials.yaml").read_text())
    results = []
    for name in args.case or list(CASES):
        r = score_case(name, trials[name], search=not args.no_search)
        if args.amp is not None:
            r["amp_cpu_s"] = amp_planner_cpu(args.amp, name, args.amp_timeout)
        if args.amp_known_cost is not None:
            r.update(_imported(name, trials[name], args.amp_known_cost))
        results.append(r)
    summary = {r["case"]: {k: r.get(k) for k in ("spearman_plait", "spearman_amp", "pick_plait_vs_best",
                                                  "pick_amp_vs_best", "search_vs_best", "scale_plait",
                                                  "search_cpu_s", "amp_cpu_s", "imported_spearman",
                                                  "imported_pick", "imported_pick_vs_best",
                                                  "imported_pick_failed", "imported_scale")} for r in results}
    for r in results:
        if r.get("amp_cpu_s") and r.get("search_cpu_s"):
            summary[r["case"]]["cpu_speedup_vs_amp"] = r["amp_cpu_s"] / r["search_cpu_s"]
    if args.json:
        print(json.dumps({"summary": summary, "cases": results}, indent=1, default=str))
        return 0
    console = Console(width=150)
    t = Table(title="plait vs AMP's cost model on AMP's measured trials (GPT-2 24x1024, global batch 32, fp16)",
              caption="search vs best: the measured trial of the same dp x tp x pp x micro-batch as plait's "
                      "own pick (with AMP's layer split, not plait's) over the measured best")
    for col in ("cluster", "trials ran/failed/not expr.", "Spearman plait | AMP", "pred/meas plait | AMP",
                "1st pick vs best: plait | AMP", "failed flagged OOM", "plait search pick", "search vs best",
                "CPU s plait | AMP (AMP/plait)"):
        t.add_column(col)
    for r in results:
        amp_cpu = r.get("amp_cpu_s")
        t.add_row(r["case"], f"{r['ran']}/{r['failed']}/{r['not_expressible']}",
                  f"{r['spearman_plait']:.2f} | {r['spearman_amp']:.2f}",
                  f"{r['scale_plait']:.2f} | {r['scale_amp']:.2f}",
                  f"{r['pick_plait_vs_best']:.2f} | {r['pick_amp_vs_best']:.2f}",
                  f"{r['failed_flagged_by_memory']}/{r['failed']}",
                  _short(r.get("search_plan")),
                  "no trial" if r.get("search_vs_best") is None else f"{r['search_vs_best']:.2f}",
                  f"{r.get('search_cpu_s', float('nan')):.1f} | "
                  + ("not run (--amp DIR)" if amp_cpu is None else f"{amp_cpu:.0f}")
                  + (f" ({amp_cpu / r['search_cpu_s']:.0f}x)" if amp_cpu and r.get("search_cpu_s") else ""))
    console.print(t)
    if args.amp_known_cost is not None:
        t2 = Table(title="plait with AMP's known_cost imported as a model profile (pick among the trials; "
                         "analytic = today's model, same run)")
        for col in ("cluster", "pick (imported)", "vs best", "pick was inf", "Spearman imported | analytic",
                    "pred/meas imported | analytic", "analytic pick vs best", "coverage"):
            t2.add_column(col)
        for r in results:
            t2.add_row(r["case"], _short(r["imported_pick"]), f"{r['imported_pick_vs_best']:.2f}",
                       str(r["imported_pick_failed"]), f"{r['imported_spearman']:.2f} | {r['spearman_plait']:.2f}",
                       f"{r['imported_scale']:.2f} | {r['scale_plait']:.2f}", f"{r['pick_plait_vs_best']:.2f}",
                       r["imported_coverage"])
        console.print(t2)
    return 0


def _imported(name: str, trials: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """The same trials scored with AMP's known_cost as a profile (never fitted to the measured times)."""
    from plait.cluster import load_cluster
    from plait.cost.compute import ComputeModel
    from plait.cost.profile_import import import_amp_known_cost

    prof = import_amp_known_cost(folder, max_micro_batch=GLOBAL_BATCH)
    r = score_case(name, trials, search=False, compute=ComputeModel(profile=prof))
    kinds = sorted({d.kind.name for d in load_cluster(str(CASES[name])).devices})
    return {"imported_spearman": r["spearman_plait"], "imported_scale": r["scale_plait"],
            "imported_pick": r["pick_plait"], "imported_pick_vs_best": r["pick_plait_vs_best"],
            "imported_pick_failed": r["pick_plait_vs_best"] == float("inf"),
            "imported_coverage": prof.coverage(kinds)}


if __name__ == "__main__":
    raise SystemExit(main())
