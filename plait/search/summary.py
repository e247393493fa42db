"""The unified search's result as a file: what each family found, and which plan won.

`plait plan --out PLAN.json` writes it beside the plan as ``PLAN.search.json`` (format
"search"); `plait report` reads it beside a plan file or in a run folder (``search.json``) and
shows the per-family table: each family's best predicted iteration time and memory margin,
its search time and candidate counts, or why it proposed nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.ir.formats import check_version, stamp
from plait.planners.types import Candidate, PlanResult

TOP_ROWS = 10  # the merged ranking's first rows kept in the file


def margin_bytes(c: Candidate) -> int | None:
    """Least free memory of a candidate over its GPU kinds (None when it was not estimated)."""
    return min(c.headroom_by_kind.values()) if c.headroom_by_kind else None


def _row(c: Candidate) -> dict[str, Any]:
    return {"family": c.family, "plan": str(c.plan), "iteration_time_s": c.time_s,
            "simulated": c.iteration_time_s is not None, "margin_bytes": margin_bytes(c)}


def family_rows(result: PlanResult) -> list[dict[str, Any]]:
    """One row per family searched: its best plan, time, margin and counts, or its reason.
    A single-family search is one row of its own."""
    picked = result.best.family if result.top else None
    families: dict[str, PlanResult | str] = result.families or {result.family: result}
    rows: list[dict[str, Any]] = []
    for name, r in families.items():
        if isinstance(r, str) or not r.top:
            rows.append({"family": name, "status": "declined",
                         "reason": r if isinstance(r, str) else "no plan fits"})
            continue
        best = r.best
        rows.append({"family": name, "status": "picked" if name == picked else "searched",
                     "best_plan": str(best.plan), "iteration_time_s": best.time_s,
                     "margin_bytes": margin_bytes(best), "search_time_s": r.search_time_s,
                     "enumerated": r.enumerated, "simulated": r.simulated})
    return rows


def summary(result: PlanResult) -> dict[str, Any]:
    """The search file's content (module docstring), stamped with its format version."""
    return stamp("search", {
        "model": result.model, "cluster": result.cluster, "global_batch": result.global_batch,
        "world_size": result.world_size, "search_time_s": result.search_time_s,
        "picked": _row(result.best) if result.top else None,
        "families": family_rows(result),
        "top": [_row(c) for c in result.top[:TOP_ROWS]],
    })


def search_path(plan_file: str | Path) -> Path:
    """Where `plait plan --out PLAN.json` writes the search beside the plan."""
    p = Path(plan_file)
    return p.with_name(p.stem + ".search.json")


def write_summary(result: PlanResult, path: str | Path) -> Path:
    out = Path(path)
    out.write_text(json.dumps(summary(result), indent=2) + "\n")
    return out


def read_summary(path: str | Path) -> dict[str, Any]:
    """A search file, checked: PlaitError naming the file and field when it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise PlaitError(f"{p}: not a search file ({exc})") from None
    if not isinstance(data, dict):
        raise PlaitError(f"{p}: not a search file (expected a JSON object)")
    data = check_version("search", data, str(p))
    rows = data.get("families")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "family" in r and "status" in r
                                             for r in rows):
        raise PlaitError(f"{p}: field 'families': expected a list of rows with 'family' and 'status'")
    return data
