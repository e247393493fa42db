"""`plait doctor RUN_DIR`: name what is wrong with a run from its communication records.

    plait doctor runs/job1                  # a finished, failed or killed run's folder
    plait doctor runs/job1 --live           # watch a running job until it names something
    plait doctor runs/job1 --json --matrix links.png

Classes (after C4D): comm_hang, noncomm_hang, slow_rank, slow_link, mismatch, dead_rank; each with
its culprit rank or rank pair, the evidence and when it was first seen (docs/doctor.md).
Exit code: 0 healthy, 1 something found, 2 the folder cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="find the hung, dead or slow rank, the slow link or the mismatched collective of a run",
        description="Read RUN_DIR/comm/rankN.jsonl (the per-rank communication records `plait run` streams), "
                    "the heartbeats and exit records, and name what is wrong: the class, the culprit rank or "
                    "rank pair, the evidence and when it was first seen.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (plait run --run-dir) or a folder of rankN.jsonl")
    p.add_argument("--live", action="store_true",
                   help="the run is still going: poll until something is found (named at K polls in a row, "
                        "K from --interval and the 15 s detection goal), the run ends or --watch expires")
    p.add_argument("--watch", metavar="S", type=float, default=600.0,
                   help="--live: stop polling after S seconds (default 600)")
    p.add_argument("--interval", metavar="S", type=float, default=1.0, help="--live: seconds between polls")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON (format_version'd)")
    p.add_argument("--matrix", metavar="FILE", default=None,
                   help="write the rank x rank matrix of link transfer time as a picture (png, svg, pdf)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from plait.doctor import DoctorConfig, Persistence, diagnose_records, link_matrix, read_run
    from plait.errors import check_output_path

    check_output_path(args.matrix, "--matrix")
    deadline = time.time() + max(0.0, args.watch)
    from plait.ir.diagnosis import DiagnosisError

    # --live: a finding is printed once K consecutive polls named it (plait.doctor.live); once every
    # rank has ended, the whole stream is judged as after the run.
    watch = Persistence(DoctorConfig(poll_s=max(0.1, args.interval)))

    while True:
        try:
            records = read_run(args.run_dir, live=args.live)
        except DiagnosisError:
            if not args.live or time.time() >= deadline:
                raise
            time.sleep(max(0.1, args.interval))  # --live: the job has not written its records yet
            continue
        ended = all(rr.done or rr.exit for rr in records.ranks.values())
        diag = diagnose_records(records, live=args.live and not ended)
        if args.live and not ended:
            diag = watch.update(diag, now=time.time())
        if not args.live or diag.findings or ended or time.time() >= deadline:
            break
        time.sleep(max(0.1, args.interval))
    matrix = link_matrix(records)
    if args.matrix:
        from plait.doctor.picture import save_matrix

        save_matrix(matrix, diag, args.matrix)
    if args.json:
        out = diag.to_dict()
        out["link_matrix_s"] = matrix
        print(json.dumps(out, indent=1))
    else:
        _print(diag, matrix, args)
    return 1 if diag.findings else 0


def _print(diag: Any, matrix: list[list[float | None]], args: argparse.Namespace) -> None:
    for w in diag.warnings:
        print(f"plait doctor: warning: {w}", file=sys.stderr)
    print(f"run {diag.run_dir}: {diag.world_size} ranks")
    if diag.healthy:
        print("healthy: no hang, dead rank, mismatch, slow rank or slow link found")
    for f in diag.findings:
        who = f"ranks {f.ranks[0]}-{f.ranks[1]}" if f.kind == "slow_link" else \
            (f"rank {f.ranks[0]}" if len(f.ranks) == 1 else f"ranks {list(f.ranks)}" if f.ranks else "no single rank")
        where = f" on {', '.join(f.nodes)}" if f.nodes else ""
        step = f" at step {f.step}" if f.step is not None else ""
        det = f", named from the records at {f.detected_s:.2f} s" if f.detected_s is not None else ""
        print(f"{f.kind}: {who}{where}{step}; first seen {f.first_seen_s:.2f} s into the run{det}")
        if f.collective:
            print(f"  collective: {f.collective}")
        for k, v in f.evidence.items():
            text = json.dumps(v) if not isinstance(v, str) else v
            print(f"  {k}: {text if len(text) < 200 else text[:197] + '...'}")
    if any(v is not None for row in matrix for v in row):
        print("link transfer time (ms, median of probes), rank x rank:")
        n = len(matrix)
        print("      " + "".join(f"{b:>8}" for b in range(n)))
        for a in range(n):
            print(f"{a:>6}" + "".join(f"{'-' if v is None else f'{v * 1e3:.2f}':>8}" for v in matrix[a]))
    if args.matrix:
        print(f"matrix picture: {args.matrix}")
