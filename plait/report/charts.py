"""SVG charts of the report, as strings: Gantt, memory bars, traffic heat map, cable loads, placement.

Plain SVG (no script, no fonts fetched): the page stays one self-contained file. Every mark has a
`<title>` child, which browsers show as a tooltip. Category colours are the simulator's Gantt
colours (`plait.sim.gantt.COLORS`), so the PNG and the page read alike.
"""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Any

from plait.ir.timeline import Timeline, _resource_sort_key
from plait.sim.gantt import COLORS

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster

GiB = 2**30
FONT = "font-family:inherit"
# Pipeline stages on the placement and Gantt label chips (Tableau 10, readable on white).
STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                "#9c755f", "#bab0ac"]
MEMORY_COLORS = {"weights": "#4e79a7", "grads": "#76b7b2", "optimizer": "#59a14f", "activations": "#f28e2b",
                 "logits": "#edc948", "comm_buffers": "#b07aa1", "other": "#bab0ac"}


def _t(text: Any) -> str:
    return escape(str(text), quote=True)


def ms(seconds: float) -> str:
    if seconds >= 10:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _nice_step(span: float, ticks: int = 8) -> float:
    raw = span / max(1, ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _legend(items: list[tuple[str, str]], x: float, y: float, width: float) -> tuple[str, float]:
    """Colour chips with labels, wrapped to `width`; returns (svg, height used)."""
    out, cx, cy = [], x, y
    for label, color in items:
        w = 16 + 7 * len(label) + 14
        if cx + w > x + width and cx > x:
            cx, cy = x, cy + 18
        out.append(f'<rect x="{cx:.1f}" y="{cy:.1f}" width="11" height="11" rx="2" fill="{color}"/>'
                   f'<text x="{cx + 16:.1f}" y="{cy + 9.5:.1f}" class="lg">{_t(label)}</text>')
        cx += w
    return "".join(out), cy - y + 18


def gantt(timeline: Timeline, *, width: int = 1100, critical: set[tuple[str, str]] | None = None,
          max_rows: int = 40, span: float | None = None, label: str = "") -> str:
    """One row per resource (devN/compute, devN/comm, links), bars coloured by category; tasks on the
    critical path outlined. Bars narrower than half a pixel that touch on a row are merged (a
    10^5-event timeline stays a small page); `span` fixes the time axis (seconds)."""
    events = [e for e in timeline.events if e.end > e.start]
    if not events:
        return '<p class="muted">no events</p>'
    t0 = min(e.start for e in events)
    total = span if span else max(e.end for e in events) - t0
    resources = sorted({e.resource for e in events}, key=_resource_sort_key)
    hidden = len(resources) - max_rows
    resources = resources[:max_rows]
    row = {r: i for i, r in enumerate(resources)}
    left, right, top, rh = 132, 16, 26, 17
    plot = width - left - right
    scale = plot / total if total > 0 else 0.0
    cats = sorted({e.category for e in events if e.resource in row}, key=lambda c: list(COLORS).index(c)
                  if c in COLORS else 99)
    legend, lh = _legend([(c, COLORS.get(c, "#777")) for c in cats] +
                         ([("critical path", "#111")] if critical else []), left, 4, plot)
    top += lh
    height = top + rh * len(resources) + 28
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
             f'aria-label="{_t(label or "Gantt chart")}">', legend]
    for i, r in enumerate(resources):
        y = top + i * rh
        if i % 2 == 0:
            parts.append(f'<rect x="{left}" y="{y}" width="{plot}" height="{rh}" fill="#f6f7f9"/>')
        parts.append(f'<text x="{left - 8}" y="{y + rh - 5}" class="rl" text-anchor="end">{_t(r)}</text>')
    step = _nice_step(total)
    k = 0
    while k * step <= total * 1.0001:
        x = left + k * step * scale
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + rh * len(resources)}" class="grid"/>'
                     f'<text x="{x:.1f}" y="{top + rh * len(resources) + 15}" class="ax" '
                     f'text-anchor="middle">{_t(ms(k * step)) if k else "0"}</text>')
        k += 1
    merged: dict[tuple[str, str], list[list[Any]]] = {}
    crit_spans: dict[str, list[list[float]]] = {}  # per row: merged x-intervals of critical tasks
    for e in sorted(events, key=lambda e: (e.resource, e.start)):
        if e.resource not in row:
            continue
        x0, x1 = (e.start - t0) * scale, (e.end - t0) * scale
        if critical is not None and (e.name, e.resource) in critical:
            spans = crit_spans.setdefault(e.resource, [])
            if spans and x0 - spans[-1][1] < 1.0:
                spans[-1][1] = max(spans[-1][1], x1)
            else:
                spans.append([x0, x1])
        bars = merged.setdefault((e.resource, e.category), [])
        if bars and x1 - x0 < 0.5 and x0 - bars[-1][1] < 0.5:
            bars[-1][1] = max(bars[-1][1], x1)
            bars[-1][3] += 1
            continue
        bars.append([x0, x1, e, 1])
    for (res, cat), bars in merged.items():
        y = top + row[res] * rh + 2
        for x0, x1, e, n in bars:
            w = max(x1 - x0, 0.6)
            tip = (f"{e.name} ({cat}) {ms(e.end - e.start)} at {ms(e.start - t0)}" if n == 1
                   else f"{n} {cat} events")
            parts.append(f'<rect x="{left + x0:.2f}" y="{y}" width="{w:.2f}" height="{rh - 4}" '
                         f'fill="{COLORS.get(cat, "#777")}"><title>{_t(tip)}</title></rect>')
    for res, spans in crit_spans.items():  # a dark band under the bars the critical path runs through
        y = top + row[res] * rh + rh - 3
        parts += [f'<rect x="{left + a:.2f}" y="{y}" width="{max(b - a, 1.0):.2f}" height="2.6" class="crit"/>'
                  for a, b in spans]
    if hidden > 0:
        parts.append(f'<text x="{left}" y="{height - 2}" class="ax">{hidden} more rows not drawn</text>')
    parts.append("</svg>")
    return "".join(parts)


def critical_breakdown(path: list[dict[str, Any]], total: float, width: int = 1100) -> str:
    """The critical path's time by category, as one stacked bar (what bounds the iteration)."""
    by_cat: dict[str, float] = {}
    for t in path:
        by_cat[t["category"]] = by_cat.get(t["category"], 0.0) + t["end_s"] - t["start_s"]
    busy = sum(by_cat.values())
    if total <= 0 or not by_cat:
        return ""
    if total - busy > 1e-12 * total:
        by_cat["idle"] = total - busy  # waiting on the path: gaps between its tasks
    left, plot = 132, width - 148
    parts = [f'<svg class="chart" viewBox="0 0 {width} 62" width="100%" role="img" aria-label="critical path">',
             f'<text x="{left - 8}" y="22" class="rl" text-anchor="end">critical path</text>']
    x = left
    for cat, sec in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        w = plot * sec / max(total, busy)
        color = COLORS.get(cat, "#777") if cat != "idle" else "#e5e7eb"
        parts.append(f'<rect x="{x:.2f}" y="8" width="{w:.2f}" height="20" fill="{color}">'
                     f'<title>{_t(cat)}: {_t(ms(sec))} ({sec / total:.0%})</title></rect>')
        if w > 60:
            parts.append(f'<text x="{x + 5:.1f}" y="22" class="on">{_t(cat)} {sec / total:.0%}</text>')
        x += w
    parts.append(f'<text x="{left}" y="50" class="ax">{len(path)} tasks, {_t(ms(total))}; hover a segment for '
                 "its time</text></svg>")
    return "".join(parts)


def ranges(ids: list[int]) -> str:
    """'0-31, 40, 42-43' for sorted ids."""
    out: list[str] = []
    for i in ids:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def memory_bars(mem: Any, devices: list[int], label: Any, measured: dict[int, int] | None = None,
                width: int = 1100, max_rows: int = 48) -> str:
    """Per GPU: its capacity as a track, the estimate's peak stacked by category inside it (red past
    the end when it does not fit), a measured CUDA peak as a tick when there is one. GPUs whose
    estimate and capacity are identical (the replicas of a stage) share a row; `label(ids)` names
    a row's GPUs."""
    groups: dict[tuple, list[int]] = {}
    for d in devices:
        b = mem.breakdown(d)
        key = (mem.capacity_bytes[d], mem.kinds[d], tuple(getattr(b, c) for c in MEMORY_COLORS),
               measured.get(d) if measured else None)
        groups.setdefault(key, []).append(d)
    rows = list(groups.values())
    shown = rows[:max_rows]
    scale_to = max(max(mem.capacity_bytes[g[0]], mem.peak_bytes[g[0]]) for g in shown)
    left, right, rh = 250, 180, 22
    plot = width - left - right
    legend, lh = _legend([(c.replace("_", " "), col) for c, col in MEMORY_COLORS.items()] +
                         ([("measured peak", "#111")] if measured else []), left, 4, plot)
    top = lh + 12
    height = top + rh * len(shown) + 14
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
             f'aria-label="memory per GPU">', legend]
    for i, g in enumerate(shown):
        d = g[0]
        y = top + i * rh
        cap, peak = mem.capacity_bytes[d], mem.peak_bytes[d]
        cw = plot * cap / scale_to
        parts.append(f'<text x="{left - 8}" y="{y + 14}" class="rl" text-anchor="end">{_t(label(g))}</text>'
                     f'<rect x="{left}" y="{y + 3}" width="{cw:.1f}" height="{rh - 6}" rx="3" class="track"/>')
        b = mem.breakdown(d)
        x = left
        for cat in MEMORY_COLORS:
            v = getattr(b, cat)
            if v <= 0:
                continue
            w = plot * v / scale_to
            parts.append(f'<rect x="{x:.2f}" y="{y + 5}" width="{w:.2f}" height="{rh - 10}" '
                         f'fill="{MEMORY_COLORS[cat]}"><title>{_t(cat)}: {_t(human_bytes(v))}</title></rect>')
            x += w
        over = peak > cap
        parts.append(f'<line x1="{left + cw:.1f}" x2="{left + cw:.1f}" y1="{y + 1}" y2="{y + rh - 1}" '
                     f'class="{"capover" if over else "cap"}"/>')
        if measured and d in measured:
            mx = left + plot * measured[d] / scale_to
            parts.append(f'<path d="M{mx:.1f} {y + 1} l-4 -1 l8 0 z M{mx:.1f} {y + 1} v{rh - 2}" class="meas">'
                         f'<title>measured peak {_t(human_bytes(measured[d]))}</title></path>')
        free = cap - peak
        parts.append(f'<text x="{left + plot + 10}" y="{y + 14}" class="{"bad" if over else "rl"}">'
                     f'{_t(human_bytes(peak))} / {_t(human_bytes(cap))} · '
                     f'{"over " + human_bytes(-free) if over else human_bytes(free) + " free"}</text>')
    if len(rows) > max_rows:
        parts.append(f'<text x="{left}" y="{height - 2}" class="ax">{len(rows) - max_rows} more rows not drawn</text>')
    parts.append("</svg>")
    return "".join(parts)


def _heat(v: float) -> str:
    """White -> indigo on [0, 1] (a sequential scale: more bytes, darker)."""
    v = min(max(v, 0.0), 1.0)
    lo, hi = (247, 248, 252), (49, 46, 129)
    return "#" + "".join(f"{round(a + (b - a) * v):02x}" for a, b in zip(lo, hi))


def heatmap(matrix: list[list[float]], labels: list[str], width: int = 560) -> str:
    """Bytes sent row -> column per iteration; the colour is sqrt-scaled so small flows stay visible."""
    n = len(labels)
    peak = max((v for r in matrix for v in r), default=0.0)
    if n == 0 or peak <= 0:
        return '<p class="muted">no traffic between GPUs</p>'
    show = n <= 32
    left = 70 if show else 20
    cell = max(4.0, min(28.0, (width - left - 20) / n))
    size = cell * n
    height = left + size + 40
    view_w = max(left + size + 20, left + 420)  # room for the colour scale's caption
    parts = [f'<svg class="chart" viewBox="0 0 {view_w:.0f} {height:.0f}" '
             f'width="{min(width, view_w):.0f}" role="img" aria-label="traffic heat map">']
    for i in range(n):
        if show:
            parts.append(f'<text x="{left - 6}" y="{left + i * cell + cell * 0.7:.1f}" class="rl" '
                         f'text-anchor="end">{_t(labels[i])}</text>'
                         f'<text transform="translate({left + i * cell + cell * 0.7:.1f},{left - 6}) rotate(-60)" '
                         f'class="rl">{_t(labels[i])}</text>')
        for j in range(n):
            v = matrix[i][j]
            parts.append(f'<rect x="{left + j * cell:.1f}" y="{left + i * cell:.1f}" width="{cell - 1:.1f}" '
                         f'height="{cell - 1:.1f}" fill="{_heat((v / peak) ** 0.5) if v > 0 else "#fbfbfd"}">'
                         f'<title>{_t(labels[i])} → {_t(labels[j])}: {_t(human_bytes(v))} per iteration</title>'
                         "</rect>")
    y = left + size + 14
    for k in range(11):
        parts.append(f'<rect x="{left + k * 16}" y="{y}" width="16" height="8" fill="{_heat(k / 10)}"/>')
    parts.append(f'<text x="{left + 184}" y="{y + 8}" class="ax">0 … {_t(human_bytes(peak))} '
                 "(sender row → receiver column)</text></svg>")
    return "".join(parts)


def link_bars(links: list[Any], width: int = 1100, top_n: int = 16) -> str:
    """The busiest fabric cables: bytes over capacity (seconds per iteration), heat-coloured."""
    busy = sorted(links, key=lambda link: -link.seconds)[:top_n]
    if not busy:
        return ""
    worst = busy[0].seconds
    left, right, rh = 260, 170, 20
    plot = width - left - right
    parts = [f'<svg class="chart" viewBox="0 0 {width} {rh * len(busy) + 8}" width="100%" role="img" '
             'aria-label="cable loads">']
    for i, link in enumerate(busy):
        y = 4 + i * rh
        w = plot * link.seconds / worst if worst > 0 else 0
        parts.append(f'<text x="{left - 8}" y="{y + 13}" class="rl" text-anchor="end">{_t(link.name)}</text>'
                     f'<rect x="{left}" y="{y + 2}" width="{plot}" height="{rh - 6}" rx="3" class="track"/>'
                     f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{rh - 6}" rx="3" '
                     f'fill="{_heat(0.25 + 0.75 * link.seconds / worst)}"><title>{_t(human_bytes(link.bytes))} at '
                     f'{_t(human_bytes(link.capacity))}/s</title></rect>'
                     f'<text x="{left + plot + 10}" y="{y + 13}" class="rl">{_t(ms(link.seconds))} · '
                     f'{_t(human_bytes(link.bytes))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def placement(cluster: Cluster, roles: dict[int, dict[str, Any]], width: int = 1100) -> str:
    """Node boxes with their GPUs; a GPU the plan uses is coloured by its pipeline stage and says
    its stage, data-parallel replica and tensor rank; the others are grey."""
    nodes = cluster.nodes
    devices = cluster.devices
    by_node: dict[int, list[Any]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d)
    tile_w, tile_h, pad = 96, 58, 10
    max_gpus = max(len(v) for v in by_node.values())
    per_row_tiles = min(max_gpus, 8)
    box_w = max(250, pad * 2 + per_row_tiles * (tile_w + 6) - 6)
    box_h = 30 + pad + -(-max_gpus // per_row_tiles) * (tile_h + 6)
    cols = max(1, int((width + 14) // (box_w + 14)))
    shown = list(by_node)[:48]
    rows = -(-len(shown) // cols)
    height = rows * (box_h + 14)
    parts = [f'<svg class="chart" viewBox="0 0 {max(width, box_w)} {height}" width="100%" role="img" '
             'aria-label="placement">']
    for k, n in enumerate(shown):
        bx, by = (k % cols) * (box_w + 14), (k // cols) * (box_h + 14)
        node = nodes[n]
        parts.append(f'<rect x="{bx}" y="{by}" width="{box_w}" height="{box_h}" rx="8" class="node"/>'
                     f'<text x="{bx + pad}" y="{by + 19}" class="nn">{_t(node.name)}</text>'
                     f'<text x="{bx + box_w - pad}" y="{by + 19}" class="ax" text-anchor="end">'
                     f'{len(node.gpus)} GPU{"s" if len(node.gpus) > 1 else ""}</text>')
        for j, d in enumerate(by_node[n]):
            tx = bx + pad + (j % per_row_tiles) * (tile_w + 6)
            ty = by + 30 + (j // per_row_tiles) * (tile_h + 6)
            role = roles.get(d.id)
            if role is None:
                parts.append(f'<rect x="{tx}" y="{ty}" width="{tile_w}" height="{tile_h}" rx="5" class="idle"/>'
                             f'<text x="{tx + 7}" y="{ty + 16}" class="gl">GPU {d.id}</text>'
                             f'<text x="{tx + 7}" y="{ty + 32}" class="gk">{_t(d.kind.name)}</text>'
                             f'<text x="{tx + 7}" y="{ty + 48}" class="gk">unused</text>')
                continue
            color = STAGE_COLORS[role["stage"] % len(STAGE_COLORS)]
            tip = (f"GPU {d.id} ({d.kind.name}) on {node.name}: rank {role['rank']}, stage {role['stage']} "
                   f"({role['layers']}), replica {role['replica']}, tensor rank {role['tp']}")
            parts.append(f'<g><title>{_t(tip)}</title>'
                         f'<rect x="{tx}" y="{ty}" width="{tile_w}" height="{tile_h}" rx="5" fill="{color}"/>'
                         f'<text x="{tx + 7}" y="{ty + 16}" class="gw">GPU {d.id} · r{role["rank"]}</text>'
                         f'<text x="{tx + 7}" y="{ty + 32}" class="gw2">{_t(d.kind.name)}</text>'
                         f'<text x="{tx + 7}" y="{ty + 48}" class="gw2">s{role["stage"]} dp{role["replica"]}'
                         f' tp{role["tp"]}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
