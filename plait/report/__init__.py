"""`plait report`: one self-contained HTML page for a plan file or a run folder.

    from plait.report import write_report
    write_report("runs/demo", "report.html")                     # a run folder: predicted + measured
    write_report("plan.json", "report.html", model="gpt:size=1.3b", cluster="a100-80g:nodes=4")

The page shows the plan and its placement on the cluster's nodes, the simulator's Gantt chart
with the critical path (and, after a run, the measured step beside it), memory per GPU against its
capacity, per-iteration traffic as a GPU x GPU heat map (and cable loads on a switched fabric),
the doctor's findings when the run folder has a diagnosis.json, and the unified search's
per-family table when the plan came with its search file (`plait.search.summary`). Inline CSS and
SVG only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from plait.report.data import ReportData, ReportError, load
from plait.report.page import render

if TYPE_CHECKING:
    from plait.cluster.spec import ClusterSource

__all__ = ["ReportData", "ReportError", "load", "render", "write_report"]


def write_report(source: str | Path, out: str | Path, model: str | None = None, cluster: ClusterSource | None = None,
                 search: str | Path | None = None) -> ReportData:
    """Gather the data of `source` (plan file or run folder), write the page to `out`, return the data.
    `search`: the unified search's file (default: found beside the plan or in the run folder)."""
    data = load(source, model, cluster, search)
    Path(out).write_text(render(data), encoding="utf-8")
    return data
