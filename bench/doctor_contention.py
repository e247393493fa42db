"""A slow link under bursty CPU contention, and clean runs beside the same contention (issue 32).

    python bench/doctor_contention.py              # 8 pairs (a clean run, a 30 ms link run), ~4 min
    python bench/doctor_contention.py --pairs 3 --json

Each pair: two 2-rank `plait run`s (tiny GPT, data parallel, 8 steps, sleep-padded compute, a
256 KiB link probe every step) beside a bursty busy loop -- two processes that each spin for
0.3-2 s and sleep for 0.3-2 s at random -- one run clean, one with `link:ranks=0-1,delay=30ms,
from=3`. The doctor's host-contention rule marks the steps at which other processes took the
host's CPU (`plait.doctor.detect.host_contention`); a contended step's probe is judged only where
it is slower than contention makes it (`Thresholds.contention_probe_s`). Per run: the probe of
each step over the pair's steady level ("C": a contended step), the findings, and whether they
are right (clean: none; link: slow_link of (0, 1) at step 3). Beside it, the same records with
contended steps never judged (`contention_probe_s` = infinity: 76fa74b's rule, except that its
level came from the uncontended steps alone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
PLAN = "dp=2,micro_batch=1,global_batch=2,dtype=fp32"
LINK = "link:ranks=0-1,delay=30ms,from=3"


def _burn(seed: int) -> None:
    """Spin 0.3-2 s, sleep 0.3-2 s, forever (one bursty busy loop)."""
    r = random.Random(seed)
    while True:
        end = time.time() + r.uniform(0.3, 2.0)
        while time.time() < end:
            pass
        time.sleep(r.uniform(0.3, 2.0))


def _hog() -> list[subprocess.Popen]:
    """Two bursty busy loops, each in its own session (killed with its group at the end)."""
    return [subprocess.Popen([sys.executable, __file__, "--burn", str(seed)], start_new_session=True)
            for seed in range(2)]


def _judge(run_dir: Path, spec: str) -> dict:
    from plait.doctor import diagnose
    from plait.doctor.detect import Thresholds, _steady, host_contention, probe_times
    from plait.doctor.folder import read_run

    run = read_run(run_dir)
    contended = set(next(iter(host_contention(run, Thresholds()).values()), []))
    ser = {s: v[0] for s, v in probe_times(run).get((0, 1), {}).items() if s > 0}
    level = _steady(ser) or 1.0  # as the doctor sets it: every step counts (contention only slows a probe)
    truth = [("slow_link", (0, 1), 3)] if spec else []
    out = {"run": "link" if spec else "clean", "level_ms": round(level * 1e3, 2),
           "probe_x_level": "".join(f"{ser[s] / level:.0f}{'C' if s in contended else ''} " for s in sorted(ser)).strip()}
    for name, th in (("now", Thresholds()), ("drop_all", replace(Thresholds(), contention_probe_s=float("inf")))):
        found = [(f.kind, f.ranks, f.step) for f in diagnose(run_dir, thresholds=th).findings]
        out[name] = found
        out[name + "_right"] = found[:1] == truth if spec else not found
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--burn", type=int, default=None, help=argparse.SUPPRESS)  # one busy loop (internal)
    args = ap.parse_args(argv)
    if args.burn is not None:
        _burn(args.burn)

    from plait.runtime.api import FaultsConfig, LaunchConfig, RecordsConfig, run

    rows = []
    hogs = _hog()
    try:
        for _ in range(args.pairs):
            for spec in ("", LINK):
                d = Path(tempfile.mkdtemp(prefix="doctor_contention_"))
                run(TINY, None, PLAN, steps=8, launch=LaunchConfig(timeout=5.0),
                    records=RecordsConfig(run_dir=d, probe_bytes=1 << 18, probe_every=1),
                    faults=FaultsConfig(inject=spec, compute_sleep=0.04))
                rows.append(_judge(d, spec))
    finally:
        for p in hogs:
            os.killpg(p.pid, signal.SIGKILL)
    summary = {f"{kind}_{rule}_right": f"{sum(r[rule + '_right'] for r in rows if r['run'] == kind)}/"
               f"{sum(1 for r in rows if r['run'] == kind)}"
               for kind in ("clean", "link") for rule in ("now", "drop_all")}
    summary["runs_with_contended_steps"] = sum(1 for r in rows if "C" in r["probe_x_level"])
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}, indent=1))
        return 0
    print("| run | level ms | probe / level per step (C: contended) | findings now | right | findings, contended steps dropped | right |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['level_ms']} | {r['probe_x_level']} | {r['now']} | {r['now_right']} | "
              f"{r['drop_all']} | {r['drop_all_right']} |")
    print()
    for k, v in summary.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
