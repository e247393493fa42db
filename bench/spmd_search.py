"""HAP-style program search on small configurations of HAP's models: A* against uniform-cost
search (states expanded, same optimum), and what the ratio LP gains over even ratios.

    python bench/spmd_search.py
    python bench/spmd_search.py --inter "10.4 Gb/s"
    python bench/spmd_search.py --full --max-states 20000   # BERT-base, ViT-B/16, VGG-19, BERT-MoE

Cluster: one V100 (16 GB) node and one node of two P100 SXM2 (DGX-1 NVLink between them),
`--inter` between the nodes (HAP's setting: 10.4 Gb/s). fp32: V100 vs P100 differ 1.48x.
Columns: ops of the captured forward graph; states A* and uniform-cost search expanded at
ratios proportional to FLOP/s (the same optimum, checked); the cost (predicted iteration time)
of the best program at even ratios; HAP's own method (uniform-cost search, LP without memory)
and whether its program fits; plait's `synthesize` (A*, LP with memory, segments, alternated);
the ratios it chose (work-weighted mean of the segments'); synthesis seconds. Graphs whose exact search exceeds `--max-states` use the
beam search (marked "beam").
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from plait.cluster.loader import parse_cluster
from plait.cost.program import Problem
from plait.cost.spmd import Devices
from plait.graph.aten_capture import capture_aten
from plait.graph.zoo import load_model
from plait.ir.program import ShardingError
from plait.spmd.ratios import synthesize
from plait.spmd.search import SearchBudgetExceeded, beam_search, search

CASES = [
    ("vit:layers=2,hidden=256,heads=4,patch=8,image=32,classes=10", 256),
    ("vgg19:width=16,fc=256,image=32,pool=1,classes=10,dropout=0", 64),
    ("bert:layers=2,hidden=256,heads=4,seq=64,vocab=1000,dropout=0,attn_dropout=0", 16),
    ("bert_moe:layers=2,hidden=256,heads=4,seq=64,vocab=1000,experts=4,dropout=0,attn_dropout=0", 16),
]
FULL = [("bert:seq=128", 8), ("vit", 32), ("vgg19", 32), ("bert_moe:seq=128", 8)]  # paper sizes (--full)


def cluster(inter: str):
    return parse_cluster({"name": "v100+2p100", "nodes": [
        {"name": "v", "gpus": {"kind": "v100-16gb", "count": 1}, "nic": {"type": "ethernet", "bandwidth": inter}},
        {"name": "p", "gpus": {"kind": "p100-16gb", "count": 2}, "intra": {"type": "nvlink", "bandwidth": "80 GB/s"},
         "nic": {"type": "ethernet", "bandwidth": inter}},
    ]})


def run(spec_text: str, batch: int, devices: Devices, max_states: int) -> str:
    spec = load_model(spec_text)
    graph = capture_aten(spec.build("meta"), spec.sample_batch(batch, device="meta")[0], name=spec.name)
    problem = Problem.build(graph, devices)
    r = devices.flops / devices.flops.sum()
    try:
        astar = search(problem, r, max_states=max_states)
        ucs = search(problem, r, heuristic=False, max_states=max_states)
        assert abs(astar.cost - ucs.cost) <= 1e-12 * ucs.cost
        states = f"{astar.expanded:>8} {ucs.expanded:>8}"
        even = search(problem, np.full(devices.n, 1 / devices.n), max_states=max_states).cost
    except SearchBudgetExceeded:
        states = f"{'beam':>8} {'beam':>8}"
        even = beam_search(problem, np.full(devices.n, 1 / devices.n)).cost
    hap = synthesize(problem, memory=False, heuristic=False, max_states=max_states)
    hap_text = f"{hap.cost * 1e3:9.3f} {'yes' if hap.fits else 'NO':>4}"
    start = time.perf_counter()
    try:
        result = synthesize(problem, max_states=max_states)
        ours, ratios = f"{result.cost * 1e3:9.3f}", " ".join(f"{x:.3f}" for x in result.ratios)
    except ShardingError as exc:
        ours, ratios = "  no fit", str(exc)[:40]
    took = time.perf_counter() - start
    return (f"{spec.name:<9} {batch:>5} {len(graph.ops):>5} {states} {even * 1e3:9.3f} {hap_text} {ours} "
            f"{ratios:<20} {took:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inter", default="100 Gb/s", help="bandwidth between the two nodes")
    parser.add_argument("--max-states", type=int, default=100_000)
    parser.add_argument("--cases", type=int, default=len(CASES), help="run only the first N models")
    parser.add_argument("--full", action="store_true", help="the paper-size models (beam search past the budget)")
    args = parser.parse_args()
    devices = Devices.from_cluster(cluster(args.inter))
    print(f"cluster: {', '.join(devices.names)}; {args.inter} between nodes; fp32")
    print(f"{'model':<9} {'batch':>5} {'ops':>5} {'A* exp':>8} {'UCS exp':>8} {'even ms':>9} {'HAP ms':>9} "
          f"{'fits':>4} {'ours ms':>9} {'ratios':<20} {'synth s':>6}")
    for spec_text, batch in (FULL if args.full else CASES)[:args.cases]:
        print(run(spec_text, batch, devices, args.max_states), flush=True)


if __name__ == "__main__":
    main()
