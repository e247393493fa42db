"""The rank x rank matrix of link transfer time as a picture (C4D's view: a slow link is one
bright cell, a slow node a bright row and column)."""

from __future__ import annotations

from pathlib import Path

from plait.ir.diagnosis import Diagnosis


def save_matrix(matrix: list[list[float | None]], diag: Diagnosis, path: str | Path) -> Path:
    """Write the median probe transfer time per rank pair (ms) as a PNG/SVG/PDF heat map, the
    slow links found outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(matrix)
    data = np.array([[np.nan if v is None else v * 1e3 for v in row] for row in matrix], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * n, 1.0 + 0.6 * n))
    im = ax.imshow(data, cmap="magma_r")
    fig.colorbar(im, ax=ax, label="transfer time (ms, median of link probes)")
    for a in range(n):
        for b in range(n):
            if not np.isnan(data[a, b]):
                ax.text(b, a, f"{data[a, b]:.2g}", ha="center", va="center", fontsize=8,
                        color="white" if data[a, b] > np.nanmean(data) else "black")
    for f in diag.findings:
        if f.kind == "slow_link":
            for a, b in (f.ranks, f.ranks[::-1]):
                ax.add_patch(plt.Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, edgecolor="cyan", lw=2.5))
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("rank")
    ax.set_ylabel("rank")
    ax.set_title("link transfer time per rank pair")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
