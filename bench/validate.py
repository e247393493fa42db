"""Validate plait's analytic model on public measurements from many sources at once (issue 37).

Supersedes ``bench/validate_a100.py`` as the cross-source check; that script keeps the dev set's own
fit and diagnostics, and this one reuses its evaluator so the dev-set figure is the same number.

Sources (``bench/data/sources/``, cited in docs/DATA_SOURCES.md):

- ``dev-a100-megatron``: shared/data/a100_single_node_megatron.csv (vTrain's single-node Megatron
  A100 runs; the dev set the shipped constants were fitted on), simulated exactly as validate_a100.
- ``megatron-korthikanti``: Megatron-LM's README MFU table (Korthikanti et al. 2022's GPTs, 22B-1T on
  8-512 A100 80GB, TP 8, sequence parallel, selective recompute, dp 1); time from the MFU.
- ``dlperf-megatron-v100``: OneFlow DLPerf's Megatron-LM GPT runs on 1-4 nodes of 8 V100-SXM2-16GB
  (fp16, full recompute, seq 2048; DP, TP, 2D and PP cases).
- ``colossal-lightning-gpt2xl``: GPT-2 XL on 4 A100 40GB with PyTorch Lightning, DDP (AMP) and
  DeepSpeed ZeRO-3 (fp16): time and ``torch.cuda.max_memory_allocated``.
- ``llmfoundry-mpt``: llm-foundry's MPT benchmark tables (Composer, eager PyTorch FSDP FULL_SHARD,
  flash attention, bf16; H100 80GB, A100 80GB, A100 40GB; 8-512 GPUs). Time only (no memory).
- ``hf-ddp-titanrtx``: Hugging Face transformers' docs, GPT-2 (124M) fp32 DDP on 2 TITAN RTX (consumer
  Turing) over their NVLink bridge and with peer-to-peer off (NCCL_P2P_DISABLE=1: through host memory
  over PCIe); time only.
- ``hf-memory-v100-bert``: Hugging Face transformers' docs, BERT-large sequence classification (seq 512)
  on one V100-SXM2 16GB with the Trainer: plain, gradient accumulation, checkpointing, fp16 (AMP);
  time and the GPU memory nvidia-smi shows (NVML used: CUDA context and the caching allocator's
  reserve included).

A row whose `attention` is `flash` is simulated with the fused SDPA/flash kernel (`sdpa=true` graph:
no s x s activations, `plait.cost.compute.flash_attention_time`); `unfused` with explicit attention.

Each row is simulated with plait's current analytic model (`plait.cost.compute.DEFAULT_MODEL`), its
GPU kind from `plait.cluster.catalog` and that kind's node template (DGX-like: NVLink, InfiniBand).

Split (fixed, written here, not chosen by results): within each source rows are numbered in file
order; **even rows fit, odd rows are held out**. Leave-one-source-out (LOSO): each source is
predicted with the constants fitted on every *other* source's rows of the same (GPU kind, engine)
(`FITTERS`). No fitter is registered yet, so every fit returns the shipped model and LOSO equals the
plain error; a fitter is a function ``(rows, simulate) -> ComputeModel`` registered per
(GPU kind, engine).

Memory: each source's reported peak (allocated / reserved / nvidia-smi, ``memory_kind``) against
`plait.cost.memory.estimate_memory`; sources without a memory column show "-".

Usage: ``python bench/validate.py [--json] [--max-gpus N] [--sources a,b] [--by FIELD]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import validate_a100 as va  # noqa: E402

from plait.cluster.catalog import GPU_KINDS, NODE_TEMPLATES  # noqa: E402
from plait.cluster.spec import Cluster, Link, NodeSpec  # noqa: E402
from plait.cost.compute import DEFAULT_MODEL, ComputeModel  # noqa: E402
from plait.cost.memory import estimate_memory  # noqa: E402
from plait.graph.gpt_closed_form import gpt_opgraph  # noqa: E402
from plait.ir.plan import Plan  # noqa: E402
from plait.net.view import ClusterView  # noqa: E402
from plait.sim.engine import simulate as run_engine  # noqa: E402
from plait.sim.lowering import SimOptions, lower  # noqa: E402

SOURCES_DIR = ROOT / "bench" / "data" / "sources"
DEV_GOAL = 0.05


@dataclass
class Source:
    """One table of measurements: its rows (dicts with plait's fields) and how to simulate them."""

    name: str
    engine: str  # "megatron" (fused kernels) or "eager-fsdp" (torch's own modules)
    rows: list[dict]
    simulate: Callable[[list[dict], ComputeModel], np.ndarray]  # rows, model -> predicted seconds
    memory_kind: str | None = None  # what the source's memory column measures, None: no memory


# ----- the dev set: exactly validate_a100's evaluator and constants -----

def dev_data() -> Path:
    """The dev set: shared/data next to the checkout (validate_a100.DATA), or in a folder above it
    (a git worktree lives one level deeper than the main checkout)."""
    name = va.DATA.name
    for d in ROOT.parents:
        if (d / "shared" / "data" / name).exists():
            return d / "shared" / "data" / name
    raise SystemExit(f"{va.DATA}: not found (nor shared/data/{name} in any folder above {ROOT})")


def dev_source() -> Source:
    va.load_measured()
    rows = va.load_rows(dev_data())
    ev = va.Evaluator(rows, va.RECOMPUTE)
    for r in rows:
        r["gpu"] = va.KIND.name

    def simulate(sel: list[dict], model: ComputeModel) -> np.ndarray:
        return ev.predict(model, va.NVLINK_LATENCY, [r["index"] for r in sel])

    return Source("dev-a100-megatron", "megatron", rows, simulate)


# ----- csv sources under bench/data/sources -----

INT_FIELDS = ("hidden", "heads", "layers", "ffn", "vocab", "seq", "global_batch", "micro_batch", "gpus", "dp", "tp",
              "pp", "zero", "gpus_per_node")


def load_csv(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, r in enumerate(csv.DictReader(fh)):
            row: dict = dict(r, index=i)
            for f in INT_FIELDS:
                try:
                    row[f] = int(r[f])
                except (KeyError, ValueError) as e:
                    raise SystemExit(f"{path}: row {i}, field {f!r}: {e}") from None
            row["measured_s"] = float(r["measured_s"])
            row["nics"] = int(r["nics"]) if r.get("nics") else None
            row["sequence_parallel"] = r.get("sequence_parallel", "false").lower() == "true"
            row["memory_gib"] = float(r["memory_gib"]) if r.get("memory_gib") else None
            row["intra_gbs"] = float(r["intra_gbs"]) if r.get("intra_gbs") else None  # the source's GPU link
            row["causal"] = r.get("causal", "true").lower() != "false"
            row["head_out"] = int(r["head_out"]) if r.get("head_out") else None  # a classifier head
            if row["gpu"] not in GPU_KINDS:
                raise SystemExit(f"{path}: row {i}, field 'gpu': {row['gpu']!r} is not in plait's catalog")
            rows.append(row)
    return rows


# A source's GPU-to-GPU link inside a node, where it states one (`intra` column): link kind for plait.
# "pcie-shm": NCCL with peer-to-peer off (NCCL_P2P_DISABLE=1, or consumer GPUs without P2P) stages
# through host memory over each GPU's PCIe link.
INTRA_KINDS = {"nvlink": ("nvlink", 2e-6), "pcie": ("pcie", 4e-6), "pcie-shm": ("pcie", 4e-6)}


def template_cluster(kind_name: str, gpus: int, per_node: int, nics: int | None = None,
                     intra: str | None = None, intra_gbs: float | None = None) -> Cluster:
    """`gpus` GPUs of one kind in nodes of `per_node`, links from the kind's node template; `nics`:
    NICs per node where the source states it (else the template's); `intra` / `intra_gbs`: the
    source's GPU link and its per-direction GB/s (else the template's)."""
    t = NODE_TEMPLATES[kind_name]
    link = t.intra
    if intra and intra_gbs:
        if intra not in INTRA_KINDS:
            raise SystemExit(f"intra: {intra!r} is not one of {sorted(INTRA_KINDS)}")
        link = Link(bandwidth=intra_gbs * 1e9, latency=INTRA_KINDS[intra][1], kind=INTRA_KINDS[intra][0])
    n = max(1, -(-gpus // per_node))
    nodes = [NodeSpec(name=f"n{i}", gpus=[kind_name] * min(per_node, gpus - i * per_node), intra=link, nic=t.nic,
                      nics=nics or t.nics) for i in range(n)]
    return Cluster(name=f"{kind_name}x{gpus}", kinds={kind_name: GPU_KINDS[kind_name]}, nodes=nodes,
                   source="validate")


_GRAPHS: dict[tuple, object] = {}


def row_graph(r: dict):
    sdpa = r.get("attention", "unfused") == "flash"  # the source's attention kernel (flash: SDPA's fused one)
    causal, head_out = r.get("causal", True), r.get("head_out")
    gk = (r["layers"], r["hidden"], r["heads"], r["seq"], r["vocab"], r["ffn"], r["dtype"], sdpa, causal, head_out)
    if gk not in _GRAPHS:
        cfg = {"layers": r["layers"], "hidden": r["hidden"], "heads": r["heads"], "seq": r["seq"], "vocab": r["vocab"],
               "ffn": r["ffn"], "sdpa": sdpa, "causal": causal}
        if head_out:
            cfg.update(head_out=head_out, tie=False)
        _GRAPHS[gk] = gpt_opgraph(cfg, r["dtype"])
    return _GRAPHS[gk]


def row_plan(r: dict) -> Plan:
    return Plan(dp=r["dp"], tp=r["tp"], pp=r["pp"], micro_batch=r["micro_batch"], global_batch=r["global_batch"],
                recompute=r["recompute"], zero=r["zero"], sequence_parallel=r["sequence_parallel"], schedule="1f1b",
                dtype=r["dtype"])


def row_cluster(r: dict) -> Cluster:
    return template_cluster(r["gpu"], r["gpus"], r["gpus_per_node"], r["nics"], r.get("intra"), r.get("intra_gbs"))


def predict_memory_gib(r: dict) -> float:
    """plait's peak bytes of the most loaded GPU (`estimate_memory`, PyTorch's eager loss), in GiB."""
    # torch.cuda.max_memory_allocated counts the caching allocator's live blocks only: no CUDA context,
    # kernels or NCCL buffers (plait's per-GPU framework overhead); nvidia-smi / reserved include them
    overhead = 0 if "allocated" in (r.get("memory_kind") or "") else None
    est = estimate_memory(row_graph(r), row_plan(r), row_cluster(r), optimizer=r.get("optimizer") or "adam",
                          loss="fused" if r["engine"] == "megatron" else "eager", overhead_bytes=overhead)
    return float(max(est.peak_bytes)) / 2**30


def csv_simulator() -> Callable[[list[dict], ComputeModel], np.ndarray]:
    views: dict[tuple, ClusterView] = {}

    def simulate(sel: list[dict], model: ComputeModel) -> np.ndarray:
        out = np.empty(len(sel))
        opts = SimOptions(granularity="stage", compute=model, cost_cache={})
        for j, r in enumerate(sel):
            vk = (r["gpu"], r["gpus"], r["gpus_per_node"], r["nics"], r.get("intra"), r.get("intra_gbs"))
            if vk not in views:
                views[vk] = ClusterView.from_cluster(row_cluster(r))
            out[j] = run_engine(lower(row_graph(r), row_plan(r), views[vk], opts).graph).makespan
        return out

    return simulate


def csv_source(name: str, file: str, engine: str, max_gpus: int) -> Source:
    rows = [dict(r, engine=r.get("engine") or engine) for r in load_csv(SOURCES_DIR / file) if r["gpus"] <= max_gpus
            and r["global_batch"] % (r["micro_batch"] * r["dp"]) == 0]
    kinds = {r["memory_kind"] for r in rows if r.get("memory_kind")}
    return Source(name, engine, rows, csv_simulator(), memory_kind=",".join(sorted(kinds)) or None)


# ----- fitting hook -----

Fitter = Callable[[list[tuple[Source, list[dict]]], ComputeModel], ComputeModel]
# (GPU kind, engine) -> fitter over (source, rows) pairs. Empty: every fit is the shipped model.
FITTERS: dict[tuple[str, str], Fitter] = {}


def fitted_model(kind: str, engine: str, train: list[tuple[Source, list[dict]]]) -> ComputeModel:
    fitter = FITTERS.get((kind, engine))
    return fitter(train, DEFAULT_MODEL) if fitter else DEFAULT_MODEL


def predict(src: Source, rows: list[dict], train: list[tuple[Source, list[dict]]]) -> np.ndarray:
    """Predict `rows` of `src` with the model fitted on `train` per (GPU kind, engine)."""
    out = np.empty(len(rows))
    for kind in sorted({r["gpu"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["gpu"] == kind]
        tr = [(s, [r for r in rs if r["gpu"] == kind]) for s, rs in train if s.engine == src.engine]
        out[idx] = src.simulate([rows[i] for i in idx], fitted_model(kind, src.engine, tr))
    return out


def mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - meas) / meas)) if len(meas) else float("nan")


def evaluate(sources: list[Source]) -> list[dict]:
    results = []
    for src in sources:
        meas = np.array([r["measured_s"] for r in src.rows])
        even = [i for i in range(len(src.rows)) if i % 2 == 0]
        odd = [i for i in range(len(src.rows)) if i % 2 == 1]
        own = [(src, [src.rows[i] for i in even])]
        t0 = time.perf_counter()
        pred = predict(src, src.rows, own)
        others = [(s, s.rows) for s in sources if s is not src]
        loso = predict(src, src.rows, others)
        per_kind = {}
        for kind in sorted({r["gpu"] for r in src.rows}):
            ix = [i for i, r in enumerate(src.rows) if r["gpu"] == kind]
            per_kind[kind] = dict(rows=len(ix), mape=mape(pred[ix], meas[ix]),
                                  ratio_median=float(np.median(pred[ix] / meas[ix])))
        mem_rows = [i for i, r in enumerate(src.rows) if r.get("memory_gib")]
        mem_pred = {i: predict_memory_gib(src.rows[i]) for i in mem_rows}
        mem_err = (float(np.mean([abs(mem_pred[i] / src.rows[i]["memory_gib"] - 1) for i in mem_rows]))
                   if mem_rows else None)
        results.append(dict(
            source=src.name, engine=src.engine, rows=len(src.rows), gpus=sorted({r["gpu"] for r in src.rows}),
            mape_all=mape(pred, meas), mape_fit=mape(pred[even], meas[even]), mape_held=mape(pred[odd], meas[odd]),
            mape_loso=mape(loso, meas), ratio_median=float(np.median(pred / meas)), per_kind=per_kind,
            memory_kind=src.memory_kind, memory_error=mem_err, seconds=time.perf_counter() - t0,
            predictions=[dict(index=r["index"], gpu=r["gpu"], measured_s=r["measured_s"], predicted_s=float(p),
                              measured_gib=r.get("memory_gib"), predicted_gib=mem_pred.get(i))
                         for i, (r, p) in enumerate(zip(src.rows, pred, strict=True))]))
    return results


def pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}"


def by_table(console: Console, sources: list[Source], results: list[dict], field: str) -> None:
    """MAPE and median predicted / measured per value of one row field (diagnosis, not a goal)."""
    t = Table(title=f"time error by {field}")
    for c in ("source", field, "rows", "MAPE %", "pred/meas median"):
        t.add_column(c)
    for src, res in zip(sources, results, strict=True):
        groups: dict = {}
        for r, p in zip(src.rows, res["predictions"], strict=True):
            groups.setdefault(r.get(field), []).append(p["predicted_s"] / p["measured_s"])
        for key in sorted(groups, key=lambda k: (str(type(k)), k)):
            v = np.array(groups[key])
            t.add_row(src.name, str(key), str(len(v)), pct(float(np.mean(np.abs(v - 1)))), f"{np.median(v):.2f}")
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--max-gpus", type=int, default=512, help="simulate rows with at most this many GPUs")
    ap.add_argument("--sources", default="", help="comma-separated names (default: all)")
    ap.add_argument("--by", default="", help="also print MAPE and median pred/meas per value of this row field "
                                             "(e.g. seq, recompute, model, gpus) for each source")
    args = ap.parse_args(argv)
    makers = {"dev-a100-megatron": dev_source,
              "llmfoundry-mpt": lambda: csv_source("llmfoundry-mpt", "llmfoundry_mpt.csv", "eager-fsdp",
                                                   args.max_gpus),
              "megatron-korthikanti": lambda: csv_source("megatron-korthikanti", "megatron_korthikanti.csv",
                                                         "megatron", args.max_gpus),
              "dlperf-megatron-v100": lambda: csv_source("dlperf-megatron-v100", "dlperf_megatron_v100.csv",
                                                         "megatron", args.max_gpus),
              "colossal-lightning-gpt2xl": lambda: csv_source("colossal-lightning-gpt2xl",
                                                              "colossal_lightning_gpt2xl.csv", "eager-ddp-zero3",
                                                              args.max_gpus),
              "hf-ddp-titanrtx": lambda: csv_source("hf-ddp-titanrtx", "hf_ddp_titanrtx.csv", "eager-ddp",
                                                    args.max_gpus),
              "hf-memory-v100-bert": lambda: csv_source("hf-memory-v100-bert", "hf_memory_v100_bert.csv", "eager",
                                                        args.max_gpus)}
    names = [n for n in args.sources.split(",") if n] or list(makers)
    for n in names:
        if n not in makers:
            raise SystemExit(f"--sources: unknown source {n!r}; use one of {sorted(makers)}")
    sources = [makers[n]() for n in names]
    results = evaluate(sources)
    dev = next((r for r in results if r["source"] == "dev-a100-megatron"), None)
    summary = {r["source"]: dict(rows=r["rows"], mape_held=r["mape_held"], mape_loso=r["mape_loso"],
                                 memory_error=r["memory_error"]) for r in results}
    if dev:
        summary["dev_mape_all"] = dev["mape_all"]
        summary["dev_goal_met"] = dev["mape_all"] <= DEV_GOAL
    if args.json:
        print(json.dumps(dict(summary=summary, sources=results), indent=1))
        return 0
    console = Console()
    t = Table(title="plait's analytic model (shipped constants) on each source; time MAPE %, fixed even/odd split")
    for c in ("source", "engine", "GPU", "rows", "all", "fit (even)", "held (odd)", "LOSO", "pred/meas median",
              "memory (kind)", "s"):
        t.add_column(c)
    for r in results:
        for kind, k in r["per_kind"].items():
            t.add_row(r["source"], r["engine"], kind, str(k["rows"]), pct(k["mape"]), "", "", "",
                      f"{k['ratio_median']:.2f}", "", "")
        t.add_row(r["source"], r["engine"], "all", str(r["rows"]), pct(r["mape_all"]), pct(r["mape_fit"]),
                  pct(r["mape_held"]), pct(r["mape_loso"]), f"{r['ratio_median']:.2f}",
                  f"{pct(r['memory_error'])} ({r['memory_kind'] or 'none reported'})", f"{r['seconds']:.0f}")
    console.print(t)
    if args.by:
        by_table(console, sources, results, args.by)
    if dev:
        console.print(f"dev set (shared/data, vTrain A100): MAPE {pct(dev['mape_all'])} % "
                      f"({'<=' if dev['mape_all'] <= DEV_GOAL else '>'} {100 * DEV_GOAL:.0f} % goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
