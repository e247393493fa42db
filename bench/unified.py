"""One search across every planner family: the best plan of each family and the unified pick.

    python bench/unified.py                 # every case
    python bench/unified.py --quick         # the small cases only, fewer finalists
    python bench/unified.py --json
    python bench/unified.py --json-out unified.json   # the table, and the JSON in a file
    python bench/unified.py --no-exhaustive --jobs 2   # the figures of docs/DESIGN.md

For each case (model, cluster, global batch) the bench runs `plait.plan(..., families=
"all")` -- every registered family (`plait.search.FAMILIES`: "3d" always; "graph" and "spmd"
when those planners are present), each ranked by the same simulator -- and prints per family
the best predicted iteration time (or why the family proposed nothing), the unified pick and
its family, the gain of the pick over the best single family (the families that are not
compositions: 3d, graph, spmd; the "compose" family -- SPMD programs inside pipeline stages --
is where a gain comes from), the same gain counting only plans the runtime runs
(`Candidate.unsupported` empty; composed plans run, `plait.runtime.compose_worker`), the search time of each family and of the whole search, and the
pick's memory margin (the least free memory over its GPUs).

On the small cases (<= 16 GPUs, <= 24 layers) the bench also runs each family exhaustively
(every candidate placed and simulated: ``finalists=None`` for the 3D family; every device
grouping, pipeline order and micro-batch synthesized and simulated for the composed family -- up
to about 120 syntheses on the 4-unit clusters, minutes per case; the graph and SPMD families have no
finalist cut, so their one search counts) and reports the unified pick's time over the best
exhaustive plan (goal: within 5 %).

Before / today (issue 36): each case is searched twice in one process, first under the driver's
policy before issue 36 (``plan(graph_chains="never")``: the graph family declined chain models
beside the 3D family) and then with today's default (``"always"``: asked for chains on every
cluster); the second table prints both picks, their predicted times and search times (the
first search also loads the model graph, which the second finds cached; `bench/plan_search_time.py
--before` times the pair in fresh processes). `--no-before` skips the first search. Each row also
says whether the pick is no slower than every family's best (``pick_le_every_family``).

Cases: GPT on homogeneous A100 nodes; BERT-Base on a V100 + P100 mix (HAP's kinds); a
multimodal MMT on mixed A100 + V100 nodes; DLRM on identical GPUs; GPT-2 on AMP's two published
clusters (bench/data/amp_*.yaml); GPT on two servers that each mix A100s and T4s, joined by
10 Gb/s Ethernet (bench/data/mixed_2node_slow.yaml), and BERT-Large on two servers that each mix
V100s and P100s (HAP's kinds, bench/data/v100p100_mixed_2node.yaml): the composed family's cases.
Issue 36's chain models on mixed NVLink + PCIe clusters (``new`` in the JSON rows; the closing note
and ``summary.new_cases`` give each pick beside its `plait plan` command): BERT-Large on a V100 NVLink
node + a T4 PCIe node, GPT 1.3B on 4 A100 (NVLink) + 8 A10 (PCIe), GPT-2 medium on V100 NVLink +
P100 PCIe + T4 PCIe nodes, each pair of nodes joined by 100 Gb/s Ethernet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

DATA = ROOT / "bench" / "data"


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    cluster: str
    global_batch: int
    small: bool  # <= 16 GPUs and <= 24 layers: checked against exhaustive per-family search
    new: bool = False  # added by issue 36 (chain models on mixed NVLink + PCIe clusters)

    def command(self) -> str:
        """The `plait plan` command line of this case (paths relative to the repository root)."""
        cluster = self.cluster.replace(str(ROOT) + "/", "")
        return f"plait plan --model {self.model} --cluster {cluster} --global-batch {self.global_batch}"


CASES = [
    Case("gpt-a100", "gpt:layers=24,hidden=2048,heads=16,seq=2048", "dgx-a100:nodes=2", 64, True),
    Case("bert-v100+p100", "bert:layers=12,hidden=768,heads=12,seq=512", str(DATA / "v100_p100_2node.yaml"), 128, True),
    Case("mmt-a100+v100", "mmt", "mixed-a100-v100:a100_nodes=1,v100_nodes=1", 64, True),
    Case("dlrm-a100", "dlrm", "dgx-a100:nodes=1", 512, True),
    Case("gpt2-amp-homog", "gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=52256",
         str(DATA / "amp_homogeneous.yaml"), 32, True),
    Case("gpt2-amp-het", "gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=52256",
         str(DATA / "amp_het_cluster.yaml"), 32, True),
    Case("gpt-a100t4x2-10g", "gpt:layers=16,hidden=2048,heads=16,seq=512", str(DATA / "mixed_2node_slow.yaml"),
         32, True),
    Case("bert-large-v100p100x2-10g", "bert:layers=24,hidden=1024,heads=16,seq=512",
         str(DATA / "v100p100_mixed_2node.yaml"), 64, True),
    # issue 36: chain models on mixed clusters of NVLink and PCIe nodes, where a chain of stages
    # across GPU kinds (each with its own dp and micro-batch: the graph family) is the plan to beat
    Case("bert-large-v100nv+t4pcie", "bert:layers=24,hidden=1024,heads=16,seq=512",
         str(DATA / "v100nv_t4pcie_100g.yaml"), 128, True, new=True),
    Case("gpt-1.3b-a100nv+a10pcie", "gpt:layers=24,hidden=2048,heads=16,seq=1024",
         str(DATA / "a100nv_a10pcie_100g.yaml"), 64, True, new=True),
    Case("gpt2m-v100nv+p100+t4pcie", "gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=52256",
         str(DATA / "v100nv_p100pcie_t4pcie_100g.yaml"), 32, True, new=True),
]
COMPOSED = ("compose",)  # families that compose others: left out of "the best single family"
# each family's options that search it exhaustively (no finalists, every candidate grouping)
EXHAUSTIVE: dict[str, dict[str, Any]] = {"3d": {"finalists": None}, "compose": {"candidates": 10**6}}
# the driver's policy before issue 36 (`plait.search.driver.GRAPH_CHAINS`): the graph family declined
# chain models whenever the 3D family was searched too; run beside today's default ("always") in each case
BEFORE = "never"


def _cluster(text: str) -> Any:
    from plait.cluster import load_cluster

    return load_cluster(text)


def describe(plan: Any, cluster: Any) -> str:
    """A plan in a few words: a stage pipeline as `layers x GPU kind x count, dp, micro-batch` per
    stage (an SPMD stage: its rank count), else the 3D degrees."""
    if plan.stages:
        parts = []
        for st in plan.stages:
            kinds = sorted({cluster.devices[d].kind.name for d in st.devices})
            form = "spmd" if st.spmd is not None else f"dp{st.dp}" + (f"tp{st.tp}" if st.tp > 1 else "")
            parts.append(f"{len(st.layers)}L {'+'.join(kinds)}x{len(st.devices)} {form} "
                         f"mb{st.micro_batch or plan.micro_batch}")
        return " | ".join(parts)
    if plan.spmd is not None:
        return f"spmd program on {cluster.num_devices} GPUs"
    text = f"dp{plan.dp} tp{plan.tp} pp{plan.pp} mb{plan.micro_batch} z{plan.zero}"
    if plan.layer_split is not None:
        text += " layers " + ":".join(map(str, plan.layer_split))
    return text


def run_case(case: Case, finalists: int | None, exhaustive: bool, before_policy: bool = True) -> dict[str, Any]:
    from plait.api import plan
    from plait.errors import PlaitError
    from plait.planners.types import PlanResult

    cluster = _cluster(case.cluster)
    before: dict[str, Any] | None = None
    if before_policy:  # the driver's policy before issue 36, in this process, just before today's
        t0 = time.perf_counter()
        old = plan(case.model, cluster, global_batch=case.global_batch, top=3, families="all",
                   finalists=finalists, progress=False, graph_chains=BEFORE)
        before = {"policy": BEFORE, "pick_family": old.best.family, "pick_plan": str(old.best.plan),
                  "pick_desc": describe(old.best.plan, cluster),
                  "pick_s": old.best.time_s, "search_s": time.perf_counter() - t0,
                  "graph": old.families["graph"] if isinstance(old.families.get("graph"), str) else "asked"}
    t0 = time.perf_counter()
    res = plan(case.model, cluster, global_batch=case.global_batch, top=3, families="all",
               finalists=finalists, progress=False)
    wall = time.perf_counter() - t0
    families = res.families or {res.best.family: res}
    per = {}
    for name, r in families.items():
        if isinstance(r, PlanResult):
            runs = [c for c in r.top if not c.unsupported]
            per[name] = {"best_s": r.best.time_s, "plan": str(r.best.plan), "desc": describe(r.best.plan, cluster),
                         "search_s": r.search_time_s,
                         "runnable": not r.best.unsupported, "unsupported": r.best.unsupported,
                         "best_runnable_s": runs[0].time_s if runs else None}
        else:
            per[name] = {"best_s": None, "why": r}
    singles = [v["best_s"] for n, v in per.items() if v["best_s"] is not None and n not in COMPOSED]
    single_runs = [v["best_runnable_s"] for n, v in per.items()
                   if v["best_s"] is not None and v["best_runnable_s"] is not None and n not in COMPOSED]
    best = res.best
    runs = [v["best_runnable_s"] for v in per.values() if v["best_s"] is not None and v["best_runnable_s"] is not None]
    margin = min(best.headroom_by_kind.values()) if best.headroom_by_kind else None
    out: dict[str, Any] = {
        "case": case.name, "model": case.model, "cluster": cluster.name, "gpus": cluster.num_devices,
        "global_batch": case.global_batch, "families": per, "pick_family": best.family,
        "pick_plan": str(best.plan), "pick_desc": describe(best.plan, cluster), "pick_s": best.time_s,
        "new": case.new, "command": case.command(), "pick_runnable": not best.unsupported,
        "gain_over_best_family": min(singles) / best.time_s if singles else None,
        "runnable_gain_over_best_family": (min(single_runs) / min(runs) if single_runs and runs else None),
        "search_s": wall, "memory_margin_bytes": margin,
        # is the pick no slower than every family's best (the goal of issue 36)?
        "pick_le_every_family": all(best.time_s <= v["best_s"] * (1 + 1e-9) for v in per.values()
                                    if v["best_s"] is not None),
    }
    if before is not None:
        out["before"] = before
        out["before_over_pick"] = before["pick_s"] / best.time_s  # > 1: today's pick is faster
        out["search_s_over_before"] = wall / before["search_s"]
    if exhaustive and case.small:
        # the families with a pruning knob searched again without it (3d: every candidate placed and
        # simulated; compose: every grouping, order and micro-batch synthesized and simulated); graph and spmd have none
        # here, so their pick run is their exhaustive run
        again = [n for n in EXHAUSTIVE if n in families]
        times = [v["best_s"] for n, v in per.items() if n not in again and v["best_s"] is not None]
        for name in again:
            try:
                full = plan(case.model, cluster, global_batch=case.global_batch, top=1, family=name,
                            progress=False, **EXHAUSTIVE[name])
                times.append(full.best.time_s)
            except PlaitError as exc:
                out.setdefault("exhaustive_errors", {})[name] = str(exc)
        if times:
            out["exhaustive_best_s"] = min(times)
            out["pick_vs_exhaustive"] = best.time_s / min(times)
    return out


def _partial(path: str | None, rows: list[dict[str, Any]]) -> None:
    """The rows so far, in `--json-out`'s file (a run cut short keeps its finished cases)."""
    if path:
        Path(path).write_text(json.dumps({"summary": {"partial": True, "cases": len(rows)}, "rows": rows},
                                         indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two cases, 4 finalists, no exhaustive check")
    ap.add_argument("--case", action="append", choices=[c.name for c in CASES],
                    help="only this case (repeatable; run in the order given)")
    ap.add_argument("--finalists", type=int, default=12)
    ap.add_argument("--no-exhaustive", action="store_true")
    ap.add_argument("--no-before", action="store_true",
                    help=f"skip the search under the driver's policy before issue 36 (graph_chains={BEFORE!r})")
    ap.add_argument("--jobs", type=int, default=1, help="cases run in this many processes at once")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", metavar="FILE", help="also write the --json object to FILE (one run, both outputs)")
    args = ap.parse_args(argv)

    from plait.search import FAMILIES

    by_name = {c.name: c for c in CASES}
    cases = [by_name[n] for n in dict.fromkeys(args.case)] if args.case else list(CASES)  # in the order given
    if args.quick and not args.case:
        cases = [CASES[0], CASES[4]]
    finalists = 4 if args.quick else args.finalists
    exh = not (args.quick or args.no_exhaustive)
    if args.jobs > 1:  # cases in parallel processes (each case's search itself is serial)
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            rows = []
            for row in pool.map(run_case, cases, [finalists] * len(cases), [exh] * len(cases),
                                [not args.no_before] * len(cases)):
                rows.append(row)
                _partial(args.json_out, rows)
    else:
        rows = []
        for c in cases:
            rows.append(run_case(c, finalists, exhaustive=exh, before_policy=not args.no_before))
            _partial(args.json_out, rows)
    names = list(FAMILIES)
    summary = {
        "families": names,
        "cases": len(rows),
        "cases_gain_ge_1_2": sum(1 for r in rows if (r["gain_over_best_family"] or 0) >= 1.2),
        "cases_runnable_gain_ge_1_2": sum(1 for r in rows if (r["runnable_gain_over_best_family"] or 0) >= 1.2),
        "worst_pick_vs_exhaustive": max((r["pick_vs_exhaustive"] for r in rows if "pick_vs_exhaustive" in r),
                                        default=None),
        "max_search_s": max(r["search_s"] for r in rows),
        "cases_pick_le_every_family": sum(1 for r in rows if r["pick_le_every_family"]),
        # the closing note: issue 36's new cases, each pick (today's and before) beside its command
        "new_cases": [{"case": r["case"], "command": r["command"], "pick_family": r["pick_family"],
                       "pick_s": r["pick_s"], "pick": r["pick_desc"],
                       "before_pick_s": r["before"]["pick_s"] if "before" in r else None,
                       "before_pick": r["before"]["pick_desc"] if "before" in r else None}
                      for r in rows if r["new"]],
    }
    paired = [r for r in rows if "before" in r]
    if paired:
        summary.update({
            "before_policy": BEFORE,
            "cases_pick_changed": sum(1 for r in paired if r["before"]["pick_plan"] != r["pick_plan"]),
            "cases_faster_than_before": sum(1 for r in paired if r["before_over_pick"] > 1 + 1e-9),
            "cases_slower_than_before": sum(1 for r in paired if r["before_over_pick"] < 1 - 1e-9),
            "max_before_over_pick": max(r["before_over_pick"] for r in paired),
            "total_search_s_over_before": sum(r["search_s"] for r in paired)
            / sum(r["before"]["search_s"] for r in paired),
        })
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}, indent=1))
        return 0
    console = Console(width=170)
    t = Table(title="one search across families: best predicted iteration time per family and the unified pick")
    t.add_column("case")
    t.add_column("GPUs", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    if paired:
        t.add_column(f"before pick ({BEFORE})", justify="right")
    for col in ("pick (family)", "gain vs best family", "gain, runnable only", "pick vs exhaustive", "margin GiB",
                "search s"):
        t.add_column(col, justify="right")
    for r in rows:
        cells = []
        for n in names:
            f = r["families"].get(n)
            cells.append("-" if f is None else (f"{f['best_s'] * 1e3:.1f} ms" + ("" if f["runnable"] else " (sim only)")
                                                 if f["best_s"] is not None else "none: " + f["why"][:40]))
        margin = r["memory_margin_bytes"]
        old = [f"{r['before']['pick_s'] * 1e3:.1f} ms ({r['before']['pick_family']})"] if "before" in r else \
            (["-"] if paired else [])
        t.add_row(r["case"], str(r["gpus"]), *cells, *old, f"{r['pick_s'] * 1e3:.1f} ms ({r['pick_family']})",
                  f"{r['gain_over_best_family']:.2f}x" if r["gain_over_best_family"] else "-",
                  f"{r['runnable_gain_over_best_family']:.2f}x" if r["runnable_gain_over_best_family"] else "-",
                  f"{r['pick_vs_exhaustive']:.3f}" if "pick_vs_exhaustive" in r else "-",
                  "-" if margin is None else f"{margin / 2**30:.1f}", f"{r['search_s']:.1f}")
    console.print(t)
    if paired:
        t2 = Table(title=f"picks before issue 36 (driver graph_chains={BEFORE!r}) and today, same run")
        for col in ("case", "before: plan", "before ms", "today: plan", "today ms", "before/today",
                    "search s before", "search s today"):
            t2.add_column(col, justify="left" if "plan" in col or col == "case" else "right")
        for r in paired:
            b = r["before"]
            t2.add_row(r["case"], f"{b['pick_family']}: {b['pick_desc']}", f"{b['pick_s'] * 1e3:.1f}",
                       f"{r['pick_family']}: {r['pick_desc']}", f"{r['pick_s'] * 1e3:.1f}",
                       f"{r['before_over_pick']:.2f}x", f"{b['search_s']:.1f}", f"{r['search_s']:.1f}")
        console.print(t2)
    console.print(f"summary: {summary}")
    new = [r for r in rows if r["new"]]
    if new:
        console.print("issue 36's cases (chain models on mixed NVLink + PCIe clusters), each pick beside its command:")
        for r in new:
            console.print(f"  {r['case']}: {r['pick_family']} {r['pick_s'] * 1e3:.1f} ms ({r['pick_desc']}); "
                          f"{r['command']}", soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
