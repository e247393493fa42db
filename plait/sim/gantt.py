"""PNG Gantt chart of a Timeline: one row per stream (compute, comm, p2p link), coloured by category."""

from __future__ import annotations

import re
from pathlib import Path

from plait.ir.timeline import Timeline, _resource_sort_key

COLORS = {
    "forward": "#4C9BE8", "backward": "#3BAA5C", "recompute": "#A6D96A", "optimizer": "#D7301F",
    "data": "#BDBDBD", "h2d": "#969696", "comm_tp": "#F4A442", "comm_pp": "#9E6EBD", "comm_dp": "#E7298A",
    "comm_zero": "#FF7F00", "comm": "#8C6D31", "idle": "#FFFFFF",
}


TITLE_POINTS = 10.0


def wrap_title(text: str, width_in: float, points: float) -> str:
    """`text` broken into lines that fit a `width_in`-inch figure at `points`-point type (a plan
    string has no spaces, so lines break after commas, spaces and '|'); matplotlib would cut it.
    DejaVu Sans averages about 0.6 em per character; 72 points per inch."""
    per_line = max(20, int(0.92 * width_in * 72 / (0.6 * points)))
    pieces = re.findall(r"[^,| ]*[,| ]?", text)
    lines, line = [], ""
    for piece in filter(None, pieces):
        if line and len(line) + len(piece) > per_line:
            lines.append(line.rstrip())
            line = ""
        while len(piece) > per_line:  # one piece longer than a line: hard break
            lines.append(piece[:per_line])
            piece = piece[per_line:]
        line += piece
    if line.strip():
        lines.append(line.rstrip())
    return "\n".join(lines)


def _row_label(resource: str, timeline: Timeline) -> str:
    """A compute row's label names the pipeline stage(s) it runs ("stage 2  dev5/compute"): a graph
    pipeline then reads one row per stage."""
    if not resource.endswith("/compute"):
        return resource
    stages = sorted({e.stage for e in timeline.events if e.resource == resource and e.stage is not None})
    if not stages:
        return resource
    return f"stage {','.join(map(str, stages[:3]))}{'...' if len(stages) > 3 else ''}  {resource}"


def save_gantt(timeline: Timeline, path: str | Path, title: str | None = None, max_rows: int = 64) -> Path:
    """Write a Gantt chart of `timeline` to `path` (PNG); returns the path.

    Rows are the timeline's resources (``devN/compute``, ``devN/comm``, ``link a->b``,
    ...), stages top to bottom; at most `max_rows` rows are drawn (the first ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    resources = sorted({e.resource for e in timeline.events}, key=_resource_sort_key)[:max_rows]
    row = {r: i for i, r in enumerate(resources)}
    bars: dict[str, dict[int, list[tuple[float, float]]]] = {}
    t0 = min((e.start for e in timeline.events), default=0.0)
    for e in timeline.events:
        if e.resource not in row or e.end <= e.start:
            continue
        bars.setdefault(e.category, {}).setdefault(row[e.resource], []).append(((e.start - t0) * 1e3,
                                                                                 (e.end - e.start) * 1e3))
    height = max(2.5, 0.32 * len(resources) + 1.2)
    fig, ax = plt.subplots(figsize=(12, height))
    for cat, rows in bars.items():
        for r, spans in rows.items():
            ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=COLORS.get(cat, "#777777"), linewidth=0)
    ax.set_yticks(range(len(resources)))
    ax.set_yticklabels([_row_label(r, timeline) for r in resources], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(wrap_title(title or f"{timeline.source} timeline ({timeline.span * 1e3:.2f} ms)", 12.0,
                            TITLE_POINTS), fontsize=TITLE_POINTS)
    used = [c for c in COLORS if c in bars]
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in used], fontsize=7, loc="upper right",
              ncol=min(4, max(1, len(used))))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
