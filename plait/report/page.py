"""The report as one self-contained HTML page: inline CSS and SVG, no script, nothing fetched."""

from __future__ import annotations

import datetime as _dt
from html import escape
from typing import Any

from plait.report import charts
from plait.report.charts import GiB, human_bytes, ms
from plait.report.data import ReportData

CSS = """
:root{--ink:#1f2937;--muted:#6b7280;--line:#e5e7eb;--bg:#f8fafc;--card:#fff;--accent:#4338ca;
--good:#047857;--warn:#b45309;--bad:#b91c1c}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
font:15px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,"Helvetica Neue",Arial,"Noto Sans",
"DejaVu Sans",sans-serif}
header{background:linear-gradient(120deg,#1e1b4b,#4338ca);color:#fff;padding:28px 40px 30px}
header h1{margin:0;font-size:26px;font-weight:650;letter-spacing:-.01em}
header .sub{opacity:.8;margin-top:4px;font-size:14px;word-break:break-all}
main{max-width:1180px;margin:0 auto;padding:24px 28px 60px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));gap:12px;margin:-46px 0 24px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px;
box-shadow:0 1px 2px rgba(0,0,0,.04)}
.card .k{font-size:12px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted)}
.card .v{font-size:22px;font-weight:650;margin-top:2px;font-variant-numeric:tabular-nums}
.card .d{font-size:13px;color:var(--muted);word-break:break-word}
.good{color:var(--good)}.warn{color:var(--warn)}.bad{color:var(--bad)}
section{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:18px 22px 20px;
margin:18px 0}
section h2{margin:0 0 4px;font-size:19px;font-weight:650}
section p.lead{margin:0 0 12px;color:var(--muted);font-size:14px}
h3{font-size:15px;margin:18px 0 6px}
code{font:13px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;
background:#eef2ff;border-radius:4px;padding:1px 5px;word-break:break-all}
table{border-collapse:collapse;font-size:14px;margin:6px 0}
th,td{padding:5px 12px 5px 0;text-align:left;border-bottom:1px solid var(--line);vertical-align:top}
th{font-weight:600;color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.05em}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:var(--muted)}
.notes{font-size:13px;color:var(--muted);margin:0;padding-left:18px}
.two{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:24px}
@media (max-width:900px){.two{grid-template-columns:1fr}}
.pill{display:inline-block;border-radius:999px;padding:1px 9px;font-size:12px;font-weight:600;
background:#eef2ff;color:var(--accent);margin-right:4px}
.pill.bad{background:#fee2e2;color:var(--bad)}.pill.good{background:#d1fae5;color:var(--good)}
.bar{display:inline-block;height:9px;border-radius:2px;vertical-align:middle}
svg.chart{display:block;margin:6px 0}
svg .lg,svg .rl,svg .ax,svg .gk,svg .gl{font-size:11px;fill:#374151}
svg .ax{fill:#6b7280}
svg .on{font-size:11px;fill:#fff;font-weight:600}
svg .bad{font-size:11px;fill:#b91c1c;font-weight:600}
svg .nn{font-size:13px;font-weight:650;fill:#1f2937}
svg .gw{font-size:11px;font-weight:650;fill:#fff}
svg .gw2{font-size:10.5px;fill:#fff;opacity:.92}
svg .grid{stroke:#e5e7eb;stroke-width:1}
svg .crit{fill:#111827}
svg .track{fill:#eef0f3}
svg .cap{stroke:#374151;stroke-width:1.5}
svg .capover{stroke:#b91c1c;stroke-width:2}
svg .meas{fill:#111827;stroke:#111827;stroke-width:1.5}
svg .node{fill:#f8fafc;stroke:#cbd5e1}
svg .idle{fill:#e5e7eb}
footer{color:var(--muted);font-size:12px;text-align:center;margin-top:30px}
"""


def _t(text: Any) -> str:
    return escape(str(text), quote=True)


def _card(key: str, value: str, detail: str = "", cls: str = "") -> str:
    return (f'<div class="card"><div class="k">{_t(key)}</div><div class="v {cls}">{_t(value)}</div>'
            f'<div class="d">{_t(detail)}</div></div>')


def _params(n: int | None) -> str:
    if not n:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit} parameters"
    return f"{n} parameters"


def summary_cards(d: ReportData) -> str:
    p, c = d.plan, d.cluster
    kinds = sorted({dev.kind.name for dev in c.devices})
    cfg = d.model_config
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("layers", "hidden", "heads", "seq") if k in cfg)
    cards = [_card("model", d.model.split(":", 1)[0], " · ".join(x for x in (_params(d.params), shape) if x)),
             _card("cluster", f"{len(c.devices)} GPUs", f"{c.name} · {len(c.nodes)} nodes · {', '.join(kinds)}"),
             _card("plan", f"dp{p.dp} · tp{p.tp} · pp{p.pp}",
                   f"micro-batch {p.micro_batch} · batch {p.global_batch} · {p.schedule} · {p.dtype}"
                   + (f" · ZeRO-{p.zero}" if p.zero else "") + (f" · rc={p.recompute}" if p.recompute != "none" else "")),
             _card("predicted step", ms(d.sim.iteration_time_s),
                   f"{d.sim.throughput_samples_per_s:.1f} samples/s · {d.sim.model_tflops_per_gpu:.1f} TFLOP/s/GPU"
                   " on the cluster's GPUs")]
    if d.machine is not None:
        cards.append(_card("predicted, this machine", ms(d.machine.iteration_s),
                           "the simulator fed with this machine's measured links and layer times"))
    if d.measured_s is not None:
        err = d.error or 0.0
        cls = "good" if abs(err) <= 0.10 else "warn" if abs(err) <= 0.30 else "bad"
        cards.append(_card("measured step", ms(d.measured_s), f"{d.measured_how} on {d.run.backend}/{d.run.device}"))
        if d.run.device == "cpu" and d.machine is None:  # CPU processes vs the cluster's GPUs: no error
            cards.append(_card("prediction error", f"{err * 100:+.1f} %", "measured on CPU processes, predicted "
                               "for the cluster's GPUs: not comparable", "muted"))
        else:
            what = "this machine's prediction" if d.machine is not None else "predicted"
            cards.append(_card("prediction error", f"{err * 100:+.1f} %", f"({what} − measured) / measured", cls))
    else:
        cards.append(_card("measured step", "—", "a run folder shows the measured step"))
    margin = d.memory_margin
    if margin is not None:
        free, dev = margin
        mem = d.sim.memory
        cap = mem.capacity_bytes[dev] if hasattr(mem, "devices") else d.cluster.devices[dev].kind.memory_bytes
        cls = "bad" if free < 0 else "warn" if free < 0.1 * cap else "good"
        cards.append(_card("memory margin", f"{free / GiB:.1f} GiB",
                           f"least free: GPU {dev} ({c.devices[dev].kind.name}), {free / cap:.0%} of "
                           f"{cap / GiB:.0f} GiB", cls))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _section(title: str, lead: str, body: str, ident: str) -> str:
    return f'<section id="{ident}"><h2>{_t(title)}</h2><p class="lead">{lead}</p>{body}</section>'


def plan_section(d: ReportData) -> str:
    p = d.plan
    stages = sorted({r["stage"] for r in d.roles.values()})
    chips = "".join(f'<span class="pill" style="background:{charts.STAGE_COLORS[s % 10]};color:#fff">stage {s}</span>'
                    for s in stages[:20])
    rows = []
    for s in stages:
        devs = sorted(dev for dev, r in d.roles.items() if r["stage"] == s)
        layers = next(r["layers"] for r in d.roles.values() if r["stage"] == s)
        kinds = sorted({d.cluster.devices[x].kind.name for x in devs})
        rows.append(f"<tr><td>{s}</td><td>{_t(layers)}</td><td>{_t(', '.join(map(str, devs[:24])))}"
                    f"{' …' if len(devs) > 24 else ''}</td><td>{_t(', '.join(kinds))}</td></tr>")
    table = ("<table><tr><th>stage</th><th>layers</th><th>GPUs</th><th>kinds</th></tr>" + "".join(rows[:32])
             + "</table>")
    body = (f"<p><code>{_t(str(p))}</code></p>{chips}" + charts.placement(d.cluster, d.roles) + table)
    return _section("Plan and placement", "Which GPU runs which rank: colour = pipeline stage; "
                    "<b>s</b> stage, <b>dp</b> data-parallel replica, <b>tp</b> tensor rank. Hover a GPU for "
                    "its layers.", body, "plan")


def search_section(d: ReportData) -> str:
    """The unified search's per-family table (`plait.search.summary`), when the plan came with it."""
    sr = d.search
    if not sr:
        return ""
    rows = []
    for r in sr["families"]:
        fam = _t(r["family"])
        if r["status"] == "declined":
            rows.append(f"<tr><td>{fam}</td><td><span class='pill'>declined</span></td>"
                        f"<td colspan='4' class='muted'>{_t(r.get('reason', ''))}</td></tr>")
            continue
        pill = "<span class='pill good'>picked</span>" if r["status"] == "picked" else "searched"
        m = r.get("margin_bytes")
        margin = "—" if m is None else f"{m / GiB:.1f} GiB"
        mcls = " class='n bad'" if m is not None and m < 0 else " class='n'"
        rows.append(f"<tr><td>{fam}</td><td>{pill}</td><td><code>{_t(r['best_plan'])}</code></td>"
                    f"<td class='n'>{_t(ms(r['iteration_time_s']))}</td><td{mcls}>{margin}</td>"
                    f"<td class='n'>{r.get('search_time_s', 0.0):.1f} s · {r.get('enumerated', 0)} enumerated, "
                    f"{r.get('simulated', 0)} simulated</td></tr>")
    body = ("<table><tr><th>family</th><th></th><th>its best plan</th><th>predicted step</th>"
            "<th>memory margin</th><th>search</th></tr>" + "".join(rows) + "</table>")
    picked = sr.get("picked")
    if picked:
        body = (f"<p>Picked: the <b>{_t(picked['family'])}</b> family's <code>{_t(picked['plan'])}</code>, "
                f"{_t(ms(picked['iteration_time_s']))} per step, out of every family's finalists ranked "
                f"by the one simulator ({sr.get('search_time_s', 0.0):.1f} s of search).</p>") + body
    return _section("Search across families", "What each planner family (3D, graph pipeline, SPMD, ...) "
                    "found for this model and cluster, ranked by the same simulator; a family that "
                    "proposes nothing says why.", body, "search")


def timeline_section(d: ReportData) -> str:
    sim = d.sim
    crit = {(t["name"], t["resource"]) for t in sim.critical_path}
    pred = sim.timeline
    body = ["<h3>Predicted (simulator, the cluster's GPUs) — " + _t(ms(sim.iteration_time_s)) + "</h3>",
            charts.gantt(pred, critical=crit, label="predicted Gantt chart"),
            charts.critical_breakdown(sim.critical_path, sim.iteration_time_s)]
    if d.machine is not None:
        m = d.machine
        body += ["<h3>Predicted for this machine — " + _t(ms(m.iteration_s)) + "</h3>",
                 charts.gantt(m.timeline, critical={(t["name"], t["resource"]) for t in m.critical_path},
                              label="machine Gantt chart"),
                 charts.critical_breakdown(m.critical_path, m.iteration_s)]
        pred = m.timeline  # the busy-time table compares like with like
    if d.measured_step is not None:
        step = d.run.steps[d.measured_step_index]
        body += [f"<h3>Measured (step {step}, the median step after warm-up) — "
                 f"{_t(ms(d.run.iteration_times[d.measured_step_index]))}</h3>",
                 charts.gantt(d.measured_step, label="measured Gantt chart"),
                 _category_table(pred, d.measured_step)]
    lead = ("One iteration, one row per GPU stream and link; forward, backward, optimizer and each "
            "communication class in their colours. The dark band under a row marks the critical "
            "path, the chain of tasks that sets the iteration time.")
    if d.measured_step is not None:
        lead += " Below it, the measured step from the run's own spans (same event names)."
    return _section("Timeline", lead, "".join(body), "timeline")


def _category_table(pred: Any, meas: Any) -> str:
    """Each category's share of the busy time of its own timeline (the two run on different
    machines and clocks, so shares compare where absolute times may not)."""
    a, b = pred.by_category(), meas.by_category()
    ta, tb = sum(a.values()) or 1.0, sum(b.values()) or 1.0
    cats = [c for c in charts.COLORS if a.get(c, 0.0) > 0 or b.get(c, 0.0) > 0]
    rows = []
    for c in cats:
        pa, mb = a.get(c, 0.0), b.get(c, 0.0)
        bars = "".join(f'<span class="bar" style="width:{160 * v:.0f}px;background:{charts.COLORS[c]};opacity:{o}">'
                       "</span><br>" for v, o in ((pa / ta, 1), (mb / tb, 0.55)))
        rows.append(f"<tr><td>{_t(c)}</td><td class='n'>{_t(ms(pa))}</td><td class='n'>{pa / ta:.0%}</td>"
                    f"<td class='n'>{_t(ms(mb))}</td><td class='n'>{mb / tb:.0%}</td><td>{bars}</td></tr>")
    return ("<h3>Busy time by category, summed over streams (share of each timeline's busy time)</h3>"
            "<table><tr><th>category</th><th>predicted</th><th>share</th><th>measured</th><th>share</th>"
            "<th>predicted / measured</th></tr>" + "".join(rows) + "</table>")


def memory_section(d: ReportData) -> str:
    mem = d.sim.memory
    if mem is None:
        return _section("Memory per GPU", "no memory estimate for this cluster", "", "memory")
    if not hasattr(mem, "devices"):  # an SPMD program: one total per program rank, no breakdown
        rows = "".join(f"<tr><td>{d.plan.device_of(r)}</td><td>{_t(name)}</td><td class='n'>{peak / GiB:.2f}</td>"
                       f"<td class='n'>{cap / GiB:.1f}</td></tr>"
                       for r, (name, peak, cap) in enumerate(zip(mem.names, mem.peak_bytes, mem.capacity_bytes)))
        body = ("<table><tr><th>GPU</th><th>device</th><th>GiB held</th><th>GiB capacity</th></tr>" + rows
                + "</table>")
        if mem.violations:
            body += "<ul class='notes bad'>" + "".join(f"<li>{_t(v)}</li>" for v in mem.violations) + "</ul>"
        return _section("Memory per GPU", "What the SPMD program keeps on each GPU (parameters, gradients, "
                        "optimizer state and activations at its shares: plait.cost.memory.memory_model) "
                        "against the GPU's capacity.", body, "memory")
    devices = sorted(mem.devices)

    def label(ids: list[int]) -> str:
        kind = d.cluster.devices[ids[0]].kind.name
        if len(ids) == 1:
            return f"GPU {ids[0]} · {kind} · {d.cluster.nodes[d.cluster.devices[ids[0]].node].name}"
        return f"GPUs {charts.ranges(ids)} · {kind} ({len(ids)})"
    measured = None
    if d.run is not None and d.run.ranks and all(r.memory_kind == "cuda_max_allocated" for r in d.run.ranks):
        measured = {r.device: r.peak_memory_bytes for r in d.run.ranks}
    body = charts.memory_bars(mem, devices, label, measured)
    if mem.violations:
        body += "<ul class='notes bad'>" + "".join(f"<li>{_t(v)}</li>" for v in mem.violations) + "</ul>"
    lead = ("Peak memory of each GPU from the memory estimator, by what holds it, against the GPU's "
            "capacity (the track and its end mark); GPUs with the same estimate share a row.")
    if d.run is not None and not measured:
        lead += " The run's ranks were CPU processes, whose RSS is not GPU memory: no measured peaks drawn."
    return _section("Memory per GPU", lead, body, "memory")


def traffic_section(d: ReportData) -> str:
    tr = d.traffic
    if tr is None:
        return ""
    labels, matrix, unit = [f"GPU {x}" for x in tr.devices], tr.matrix, "GPU"
    if len(tr.devices) > 64:  # a node x node matrix keeps the page small on large clusters
        labels, matrix = _by_node(d, tr)
        unit = "node"
    classes = "".join(f'<tr><td>{_t(k)}</td><td class="n">{_t(human_bytes(v))}</td></tr>'
                      for k, v in sorted(tr.by_class.items(), key=lambda kv: -kv[1]))
    left = charts.heatmap(matrix, labels)
    right = ("<h3>Bytes on the wire per iteration, by class</h3><table><tr><th>class</th><th>bytes</th></tr>"
             + (classes or "<tr><td colspan=2 class='muted'>none</td></tr>") + "</table>")
    body = f'<div class="two"><div>{left}</div><div>{right}</div></div>'
    if tr.links:
        body += (f"<h3>Busiest fabric cables ({_t(tr.routing)}): seconds of transfer per iteration</h3>"
                 + charts.link_bars(tr.links))
    return _section("Traffic", f"Every message of one iteration (plait.cost.traffic) as bytes each {unit} sends "
                    f"each other {unit}; on a switched fabric, the load each cable carries (plait.net).", body,
                    "traffic")


def _by_node(d: ReportData, tr: Any) -> tuple[list[str], list[list[float]]]:
    """The device matrix summed per node pair (traffic inside a node on the diagonal)."""
    node_of = [d.cluster.devices[x].node for x in tr.devices]
    nodes = sorted(set(node_of))
    index = {n: i for i, n in enumerate(nodes)}
    out = [[0.0] * len(nodes) for _ in nodes]
    for i, row in enumerate(tr.matrix):
        for j, v in enumerate(row):
            out[index[node_of[i]]][index[node_of[j]]] += v
    return [d.cluster.nodes[n].name for n in nodes], out


def doctor_section(d: ReportData) -> str:
    if d.kind != "run":
        return ""
    dg = d.diagnosis
    if dg is None:
        body = "<p class='muted'>The doctor has not looked at this run (no diagnosis.json in the run folder).</p>"
    elif dg.healthy:
        body = "<p><span class='pill good'>healthy</span> the doctor found nothing wrong.</p>"
    else:
        rows = []
        for f in dg.findings:
            ev = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in f.evidence.items())
            rows.append(f"<tr><td><span class='pill bad'>{_t(f.kind.replace('_', ' '))}</span></td>"
                        f"<td>{_t(', '.join(map(str, f.ranks)))}</td><td>{_t(', '.join(f.nodes) or '-')}</td>"
                        f"<td>{_t(f.step if f.step is not None else '-')}</td><td>{_t(f.collective or '-')}</td>"
                        f"<td class='n'>{f.first_seen_s:.2f} s</td><td>{_t(ev)}</td></tr>")
        body = ("<table><tr><th>finding</th><th>ranks</th><th>nodes</th><th>step</th><th>collective</th>"
                "<th>first seen</th><th>evidence</th></tr>" + "".join(rows) + "</table>")
    if dg is not None and dg.warnings:
        body += "<ul class='notes'>" + "".join(f"<li>{_t(w)}</li>" for w in dg.warnings[:20]) + "</ul>"
    return _section("Doctor's findings", "What the doctor read in the run's communication records "
                    "(hangs, slow ranks and links, mismatched collectives, dead ranks).", body, "doctor")


def render(d: ReportData) -> str:
    """The whole page."""
    title = f"plait report — {d.model.split(':', 1)[0]} on {d.cluster.name}"
    notes = ("<section><h2>Notes</h2><ul class='notes'>" + "".join(f"<li>{_t(n)}</li>" for n in d.notes)
             + "</ul></section>") if d.notes else ""
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width,initial-scale=1'>"
            f"<title>{_t(title)}</title><style>{CSS}</style></head><body>"
            f"<header><h1>{_t(title)}</h1><div class='sub'>{_t(d.kind)} · {_t(d.source)} · model "
            f"<code style='background:rgba(255,255,255,.15);color:#fff'>{_t(d.model)}</code></div></header>"
            f"<main>{summary_cards(d)}{notes}{plan_section(d)}{search_section(d)}{timeline_section(d)}{memory_section(d)}"
            f"{traffic_section(d)}{doctor_section(d)}"
            f"<footer>written by <b>plait report</b> on {when}; one self-contained page (no network)</footer>"
            "</main></body></html>")
