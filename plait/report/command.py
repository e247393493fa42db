"""`plait report PLAN_OR_RUN_DIR [-o report.html]`: the report page of a plan or a run.

    plait report runs/demo                         # a run folder (plait run --run-dir): predicted + measured
    plait report plan.json --model gpt:size=1.3b --cluster a100-80g:nodes=4 -o plan.html

Registered by `plait.cli` like the modules of `plait.commands`; it lives here because the import
contract keeps `plait.commands` and `plait.report` side by side on the top row.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="one self-contained HTML page for a plan file or a run folder",
        description="Write an HTML page (inline CSS and SVG, nothing fetched) with the plan and its placement, "
                    "the predicted Gantt chart and critical path (and the measured step of a run), memory per GPU "
                    "against capacity, the traffic between GPUs and on the fabric's cables, and the doctor's "
                    "findings when the run folder has a diagnosis.json.",
    )
    p.add_argument("source", metavar="PLAN_OR_RUN_DIR",
                   help="a plan JSON file (plait plan --out) or a run folder (plait run --run-dir)")
    p.add_argument("-o", "--out", metavar="FILE", default=None,
                   help="the page to write (default: report.html inside a run folder, PLAN.html beside a plan)")
    p.add_argument("--model", default=None, help="zoo spec or file.py:factory (needed for a plan file; a run "
                                                 "folder names its own)")
    p.add_argument("--cluster", default=None, help="cluster YAML or preset (needed for a plan file; a run folder "
                                                   "holds its cluster.yaml)")
    p.add_argument("--search", metavar="FILE", default=None,
                   help="the unified search's file for the per-family table (default: PLAN.search.json "
                        "beside a plan file, search.json in a run folder; plait plan --out writes it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.errors import check_output_path
    from plait.report import write_report

    source = Path(args.source)
    out = Path(args.out) if args.out else (source / "report.html" if source.is_dir() else source.with_suffix(".html"))
    check_output_path(str(out), "--out")
    data = write_report(source, out, model=args.model, cluster=args.cluster, search=args.search)
    line = (f"report written to {out}: predicted step {data.predicted_s * 1e3:.2f} ms"
            + (" (this machine)" if data.machine is not None else ""))
    if data.measured_s is not None:
        line += f", measured {data.measured_s * 1e3:.2f} ms"
    margin = data.memory_margin
    if margin is not None:
        line += f", least free memory {margin[0] / 2**30:.1f} GiB (GPU {margin[1]})"
    print(line)
    return 0
