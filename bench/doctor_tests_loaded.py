"""The doctor's tests of `make test`, run again and again beside a CPU hog (issue 32's goal: 20
times in a row, each passing): a busy loop on each core for the whole run, then
`pytest tests/test_doctor*.py -m "not slow"` `--times` times; prints a row per round (passed,
failed, seconds) and the failing tests' names, and with --json the same rows as one object.

    python bench/doctor_tests_loaded.py                 # 20 rounds beside the hog (~2 h on a shared 2-vCPU VM)
    python bench/doctor_tests_loaded.py --times 2       # a smoke test
    python bench/doctor_tests_loaded.py --no-load       # the same rounds on the idle machine (the baseline)
    python bench/doctor_tests_loaded.py -k runs         # only the tests of real injected runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def hog() -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def one_round(k: str | None) -> dict[str, Any]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_doctor*.py"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *files]
    if k:
        cmd += ["-k", k]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    tail = proc.stdout[-4000:]
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|error)", tail)}
    return {"rc": proc.returncode, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0)
            + counts.get("error", 0), "seconds": round(time.time() - t0, 1),
            "failures": re.findall(r"^FAILED (\S+)", tail, re.M)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--times", type=int, default=20)
    ap.add_argument("--no-load", action="store_true", help="without the busy loops (the idle baseline)")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    hogs = [] if args.no_load else hog()
    rows = []
    try:
        for i in range(args.times):
            rows.append(one_round(args.k))
            print(f"  [{i + 1}/{args.times}] passed {rows[-1]['passed']} failed {rows[-1]['failed']} "
                  f"{rows[-1]['seconds']} s {' '.join(rows[-1]['failures'])}", file=sys.stderr)
    finally:
        for h in hogs:
            h.kill()
    streak = next((i for i, r in enumerate(rows) if r["rc"] != 0), len(rows))
    summary = {"rounds": len(rows), "all_passed": sum(1 for r in rows if r["rc"] == 0), "first_streak": streak,
               "load": not args.no_load, "seconds": round(sum(r["seconds"] for r in rows), 1)}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return 0
    print(f"{'round':>5} {'passed':>6} {'failed':>6} {'seconds':>8}  failures")
    for i, r in enumerate(rows):
        print(f"{i + 1:>5} {r['passed']:>6} {r['failed']:>6} {r['seconds']:>8}  {' '.join(r['failures'])}")
    print(f"rounds all passing: {summary['all_passed']} of {summary['rounds']} "
          f"({'beside a busy loop on each core' if summary['load'] else 'idle'}); {summary['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
