"""The live doctor left on clean runs (issue 32): >= 20 clean `plait run --recover` runs, counting
what it did that it should not have -- any recovery, any action or report in `recovery.json`
-- and every finding the live doctor would have named at any moment of the run (the records
replayed as they stood at ~40 moments, `plait.doctor.folder.as_of`, each diagnosed live), what the
live doctor would have *reported* (the same replay polled every 2 s through its persistence,
`plait.doctor.live`: K=3 polls in a row, at 4 phases of the polls against the run), and every
finding after it (post hoc). The goal of every column but "named at a moment" is 0.

    python bench/doctor_clean.py                  # 20 clean --recover runs (~15-20 min idle on 2 cores)
    python bench/doctor_clean.py --runs 3         # a smoke test
    python bench/doctor_clean.py --load           # beside a busy loop on each core (the issue's loaded run)
    python bench/doctor_clean.py --replay DIR     # the kept run folders again (seconds)
    python bench/doctor_clean.py --json           # {"rows": [...], "summary": {...}}

Each run is the injection suite's clean case (bench/doctor.py: the 4-node emulated cluster, a tiny
GPT, sleep-padded compute, link probes every step) for `--steps` steps (default 30, so the
recovery loop's live diagnosis -- every 2 s, acted on after K=3 polls in a row -- polls a few
times while the job trains), under `--recover` (checkpoint every 5 steps: the checkpoint
writes are the runtime's marked pauses), the plan shape drawn at random per run from `--seed`.
It is a bench, not CI (tests/test_recover.py holds one clean `--recover` run that does nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.doctor import DoctorConfig, Persistence, Thresholds, diagnose_records, read_run  # noqa: E402
from plait.doctor.folder import as_of  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_doctor", ROOT / "bench" / "doctor.py")
suite = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_doctor"] = suite
_spec.loader.exec_module(suite)  # type: ignore[union-attr]


def run_one(d: Path, plan: str, seed: int, steps: int, cluster: Path) -> dict[str, Any]:
    """One clean `plait run --recover --json` into `d`; the recovery result as it printed it."""
    cmd = [sys.executable, "-m", "plait.cli", "run", "--model", suite.MODEL, "--cluster", str(cluster),
           "--plan", plan, "--steps", str(steps), "--run-dir", str(d), "--compute-sleep", str(suite.COMPUTE_SLEEP),
           "--timeout", str(suite.TIMEOUT), "--seed", str(seed % 1000), "--data-seed", str(seed), "--json",
           "--probe-every", "1", "--recover", "--checkpoint-every", "5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.time() - t0, 1), "plan": plan,
                           "stderr": proc.stderr[-2000:]}
    try:
        out["result"] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out["result"] = None
    (d / "bench.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def analyse(d: Path, th: Thresholds) -> dict[str, Any]:
    meta = json.loads((d / "bench.json").read_text())
    res = meta.get("result") or {}
    phases = res.get("phases") or []
    row: dict[str, Any] = {"id": d.name, "plan": meta["plan"], "rc": meta["rc"], "wall_s": meta["wall_s"],
                           "phases": len(phases), "transitions": len(res.get("transitions") or []),
                           "actions": [f"{a.get('action')}: {[f.get('kind') for f in a.get('findings', [])]}"
                                       for a in res.get("actions") or []],
                           "ended": [p.get("ended") for p in phases]}
    phase0 = d / "phase-0"
    try:
        run = read_run(phase0 if phase0.is_dir() else d)
    except Exception as exc:  # noqa: BLE001 -- a run that never wrote records is itself the answer
        row["error"] = str(exc)[:200]
        return row
    row["post_hoc"] = [f"{f.kind}{list(f.ranks)}" for f in diagnose_records(run, thresholds=th).findings]
    times = sorted({c.t_end for rr in run.ranks.values() for c in rr.records})
    marks = sorted({times[i] for i in range(0, len(times), max(1, len(times) // 40))} | {run.t_obs})
    live: list[str] = []
    for t in marks:
        for f in diagnose_records(as_of(run, t), live=True, thresholds=th).findings:
            name = f"{f.kind}{list(f.ranks)}@{t:.1f}s"
            if f"{f.kind}{list(f.ranks)}" not in {x.split("@")[0] for x in live}:
                live.append(name)
    row["live"] = live
    row["moments"] = len(marks)
    # What the live doctor reports (plait.doctor.live): polls every DoctorConfig.poll_s of run time,
    # a finding reported once K polls in a row named it; every phase of the polls against the run
    # (4 offsets) -- the run counts if any phase reports.
    cfg = DoctorConfig()
    reported: list[str] = []
    for k in range(4):
        watch = Persistence(cfg)
        t = k * cfg.poll_s / 4
        while t < run.t_obs + cfg.poll_s:
            for f in watch.update(diagnose_records(as_of(run, min(t, run.t_obs)), live=True, thresholds=th),
                                  now=t).findings:
                if f"{f.kind}{list(f.ranks)}" not in {x.split("@")[0] for x in reported}:
                    reported.append(f"{f.kind}{list(f.ranks)}@{t:.1f}s")
            t += cfg.poll_s
    row["live_reported"] = reported
    row["recovered"] = row["transitions"] > 0 or row["phases"] > 1
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": len(rows), "failed": sum(1 for r in rows if r["rc"] != 0 or r.get("error")),
            "recoveries": sum(1 for r in rows if r.get("recovered")),
            "runs_with_actions": sum(1 for r in rows if r["actions"]),
            "runs_with_live_findings": sum(1 for r in rows if r.get("live")),
            "runs_with_live_reports": sum(1 for r in rows if r.get("live_reported")),
            "runs_with_post_hoc_findings": sum(1 for r in rows if r.get("post_hoc")),
            "live_moments": sum(r.get("moments", 0) for r in rows),
            "wall_s_per_run_median": statistics.median(r["wall_s"] for r in rows) if rows else None,
            "false": [f"{r['id']} ({r['plan']}): recovered={r.get('recovered')} actions={r['actions']} "
                      f"live={r.get('live')} live_reported={r.get('live_reported')} post_hoc={r.get('post_hoc')} "
                      f"{r.get('error', '')}"
                      for r in rows if r.get("recovered") or r["actions"] or r.get("live") or r.get("post_hoc")
                      or r["rc"] != 0 or r.get("error")]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=4000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replay", metavar="DIR", default=None)
    ap.add_argument("--load", action="store_true", help="beside a busy loop on each core")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    th = Thresholds()
    t0 = time.time()
    if args.replay:
        root = Path(args.replay)
    else:
        root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="plait-doctor-clean-"))
        root.mkdir(parents=True, exist_ok=True)
        cluster = root / "cluster.yaml"
        cluster.write_text(suite.CLUSTER)
        rng = random.Random(args.seed)
        hogs = suite.cpu_hog() if args.load else []
        try:
            for i in range(args.runs):
                shape = rng.choice(sorted(suite.SHAPES))
                plan = f"{suite.SHAPES[shape]},micro_batch=1,global_batch=4,dtype=fp32"
                d = root / f"clean-recover-{i:02d}"
                d.mkdir(exist_ok=True)
                res = run_one(d, plan, rng.randrange(1 << 16), args.steps, cluster)
                print(f"  [{i + 1}/{args.runs}] {d.name} {shape} rc={res['rc']} {res['wall_s']:.0f} s", file=sys.stderr)
        finally:
            for h in hogs:
                h.kill()
    rows = [analyse(d, th) for d in sorted(root.iterdir()) if (d / "bench.json").exists()]
    summary = summarise(rows)
    summary["wall_s"] = round(time.time() - t0, 1)
    summary["dir"] = str(root)
    summary["load"] = bool(args.load)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1, default=str))
        return 0
    s = summary
    print(f"{'clean --recover runs':<22} {'failed':>6} {'recovered':>9} {'with actions':>12} "
          f"{'named at a moment':>17} {'live reported':>13} {'post-hoc findings':>17} {'live moments':>12} "
          f"{'wall/run s':>10}")
    print(f"{s['runs']:<22} {s['failed']:>6} {s['recoveries']:>9} {s['runs_with_actions']:>12} "
          f"{s['runs_with_live_findings']:>17} {s['runs_with_live_reports']:>13} {s['runs_with_post_hoc_findings']:>17} "
          f"{s['live_moments']:>12} {s['wall_s_per_run_median'] or 0:>10.1f}")
    print("(runs with: named at a moment -- any of ~40 replayed moments named a finding, no persistence;"
          " live reported -- polls every 2 s, reported after K=3 in a row, 4 poll phases)")
    for x in s["false"]:
        print(f"  {x}")
    print(f"run folders: {root} (replay: python bench/doctor_clean.py --replay {root}); wall {s['wall_s']} s"
          + (" (beside a busy loop on each core)" if args.load else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
