"""HAP's setting (issue 14): even data parallelism, data parallelism proportional to FLOP/s, HAP's own
method re-implemented, and plait's SPMD synthesis, all predicted by the one simulator.

    python bench/hap.py              # HAP's testbed and a 4 A100 + 4 T4 node, four models
    python bench/hap.py --quick      # small models on small clusters (smoke)
    python bench/hap.py --json

Clusters: `bench/data/hap_v100_p100.yaml` (2 x 8 V100 + 6 x 8 P100, 10.4 Gb/s between machines;
what the paper leaves open is stated in the file) and `bench/data/a100_t4_node.yaml`.
Models (plait's zoo at the paper's sizes): VGG19 (224 px), ViT-B/16, BERT-Base (seq 128),
BERT-MoE (BERT-Base with an MoE MLP every other layer, 8 experts, top-2). Every column is one
iteration of the same global batch predicted by `plait.sim.api.simulate_spmd` (the same compute
model, links and engine for all):

* even -- DDP (`ddp`): every device runs the whole model on its part of the batch (MoE capacity
  per device, as DDP), parameters replicated, gradients all-reduced in 25 MB buckets overlapped
  with backward (NCCL's algorithm per bucket); one micro-batch per step (no gradient
  accumulation: it fits at one, and more micro-batches only add passes), so that is the best;
* prop -- the same with batch shares proportional to FLOP/s (integer samples);
* HAP -- HAP's method as its public code has it: uniform-cost search, LP without a memory row,
  one global collective choice (padded or grouped, the better of the two runs), its cluster model
  (one bandwidth per collective: ring all-reduce); its program is simulated on the real links.
  Both searches see the same graph boundary: the outputs end whole or in the loss's batch shards
  (`plait.graph.aten_stage.free_outputs`; the loss is outside the captured graph, HAP's code traces it,
  and a program that leaves logits sharded otherwise pays their gather, as the runtime runs it);
* plait -- `plait.search.spmd_family.synthesize_program`, the flat program `plait plan --family spmd`
  and the search driver emit: `plait.spmd.ratios.synthesize_overlapped`: A*, LP with per-device memory, segments,
  collectives chosen per message on the real links, searched with the parameter-gradient
  collectives counted in full (HAP's sum) and as hidden behind backward, the simulator keeping the
  faster (its synthesis seconds include both searches and simulations); then the same program with
  its whole parameters stored in even shards (ZeRO-3, `synthesize_stored`: all-gathered in the
  forward, gradients reduce-scattered, the optimizer on the shard), kept if the simulator ranks it
  first (form "+zero"; runnable: `Plan.spmd.homes`);
* hier -- `plait.spmd.mesh.synthesize_hierarchical` (clusters of several nodes): the same
  synthesis on one node's GPUs at the node's batch, data parallelism across nodes with the
  gradients all-reduced on the rails (the inner program also with ZeRO-3 storage: node
  reduce-scatter, rails on 1/g of the bytes, node all-gather), ranked by the same simulator; plait's SPMD column is the
  faster of flat and hier that fits, and its synthesis seconds count both;
* bound -- perfect compute balance with communication fully hidden: every op at
  ``1 / sum_i 1 / w_i`` and the optimizer over all parameters at perfect balance.
* dpfloor -- on clusters of several nodes, the time every parameter's gradient takes to cross the
  nodes once at the case's dtype (split over the rails, on the nodes' shared NICs, `dp_floor`): no
  program that keeps data parallelism across nodes (both DDPs, the hierarchical programs, a flat
  program replicating its parameters) is faster, so on HAP's testbed it bounds what any of them
  gains over HAP's method; programs that shard parameters across nodes (VGG19's FC layers) escape it.

Columns: the predicted iteration times (ms) -- "flat" is plait's program sharding over every
device, "hier" its hierarchical program (`plait.spmd.mesh`: any op sharded inside each node,
data parallelism across nodes, gradients all-reduced on the rails; "inf" on one node), "SPMD" the
faster of the two that fits (plait's synthesized program), "plait"
its pick across families on the simulator's one scale (that program or FLOP-proportional DDP,
whichever is faster and fits) --, speedups of the pick over even and over HAP ("xHAPpl": the
same over HAP counting only what a plan file holds -- the flat program or proportional DDP; a
hierarchical program has no plan form yet, so `plait plan --family spmd` cannot emit it), its share of
the bound (bound / plait), states expanded (HAP's UCS and plait's A*; "b" when the exact search
hit its budget and the beam search finished), synthesis CPU seconds (single-threaded; wall time
on a shared machine would count the neighbours; from the captured graph to the program, with the
simulations that rank candidates -- capturing the graphs, at the global batch and at the largest
node's batch for "hier", is the separate "capt s"), and fit (memory per device within
capacity, by `plait.cost.memory.memory_model`). dtype per case: fp32 on HAP's testbed (P100s have
no tensor cores; HAP ran fp32), fp16 on the A100/T4 node.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plait.cluster import load_cluster
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import group_links, measured_tables
from plait.cost.compute import optimizer_time
from plait.cost.memory import memory_model, state_bytes_per_param
from plait.cost.program import Problem, Program, Synthesis
from plait.cost.spmd import Devices, balanced_time, mesh_of, rail_links, rail_time
from plait.graph.aten_capture import capture_aten
from plait.graph.aten_stage import free_outputs
from plait.graph.zoo import load_model
from plait.ir.program import Comm, ShardingError, shard_sizes
from plait.search.spmd_family import OVERLAP_WEIGHTS, synthesize_program
from plait.sim.api import PlanSimulator, simulate_spmd
from plait.spmd.mesh import Hierarchical, node_batches, synthesize_hierarchical
from plait.spmd.ratios import synthesize

DATA = Path(__file__).resolve().parent / "data"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

MODELS = [  # (label, zoo spec, samples per GPU on each cluster: the global batch is this times the GPUs)
    ("VGG19", "vgg19:dropout=0", (16, 16)),
    ("ViT-B/16", "vit", (16, 16)),
    ("BERT-Base", "bert:seq=128,dropout=0,attn_dropout=0", (16, 16)),
    # GShard's dispatch tensors are O(tokens^2) with one capacity for the whole batch: 1 sample per
    # GPU on 64 GPUs; 2 on the 8-GPU node (at 1, FLOP-proportional DDP leaves a T4 no sample)
    ("BERT-MoE", "bert_moe:seq=128,dropout=0,attn_dropout=0", (1, 2)),
]
CLUSTERS = [("hap_v100_p100.yaml", "fp32"), ("a100_t4_node.yaml", "fp16")]
QUICK_MODELS = [
    ("VGG-tiny", "vgg19:width=8,fc=128,image=32,pool=1,classes=10,dropout=0", (16, 16)),
    ("ViT-tiny", "vit:layers=2,hidden=128,heads=4,patch=8,image=32,classes=10", (16, 16)),
    ("BERT-tiny", "bert:layers=2,hidden=128,heads=4,seq=32,vocab=1000,dropout=0,attn_dropout=0", (8, 8)),
    ("MoE-tiny", "bert_moe:layers=2,hidden=128,heads=4,seq=32,vocab=1000,experts=4,dropout=0,attn_dropout=0",
     (8, 8)),
]


def quick_clusters() -> list[tuple[object, str]]:
    """Two tiny mixes: a V100 node and a P100 node, one 10.4 Gb/s NIC each as on HAP's testbed (without
    `count` the V100 node would take its server template's 4 NICs); an A100 + T4 node."""
    from plait.cluster.loader import parse_cluster

    hap = parse_cluster({"name": "v100x2+p100x2", "nodes": [
        {"name": "v", "gpus": {"kind": "v100-16gb", "count": 2}, "intra": {"type": "nvlink", "bandwidth": "150 GB/s"},
         "nic": {"type": "ethernet", "bandwidth": "10.4 Gb/s", "latency": "25 us", "count": 1}},
        {"name": "p", "gpus": {"kind": "p100-pcie-16gb", "count": 2}, "intra": {"type": "pcie", "bandwidth": "12 GB/s"},
         "nic": {"type": "ethernet", "bandwidth": "10.4 Gb/s", "latency": "25 us", "count": 1}}]})
    small = parse_cluster({"name": "a100+t4", "nodes": [
        {"name": "m", "gpus": [{"kind": "a100-40gb", "count": 1}, {"kind": "t4", "count": 1}],
         "intra": {"type": "pcie", "bandwidth": "12 GB/s"}}]})
    return [(hap, "fp32"), (small, "fp16")]


# ----------------------------------------------------------------------------- baselines


def ddp(spec, batch: int, devices: Devices, weights: np.ndarray, dtype: str) -> tuple[Problem, Synthesis, np.ndarray]:
    """PyTorch DDP as an SPMD program: the graph of one device's batch (captured at ``batch / n``)
    run whole on every device, device ``i`` on its integer share of the batch in proportion to
    `weights` (`device_scale` of the lowering), and every parameter's gradient all-reduced after
    the backward of its first reader (the simulator packs them into DDP's buckets and overlaps them
    with the rest of backward). MoE layers route each device's tokens with their own capacity, as
    DDP does. Memory: parameters, gradients and optimizer state whole, activations at the share."""
    n = devices.n
    local = batch // n
    tdtype = DTYPES[dtype]
    graph = capture_aten(spec.build("meta", dtype=tdtype), spec.sample_batch(local, device="meta", dtype=tdtype)[0],
                         name=spec.name)
    problem = Problem.build(graph, devices)
    strategies = {op.name: opts[0] for op, opts in zip(graph.ops, problem.options)}  # all redundant
    first_reader: dict[str, str] = {}
    for op in graph.ops:
        for t in op.inputs:
            if graph.tensors[t].role == "param":
                first_reader.setdefault(t, op.name)
    comms = [(name, Comm("all_reduce", t, graph.tensors[t].nbytes, "bwd")) for t, name in first_reader.items()]
    program = Program(strategies, comms)
    scale = np.array(shard_sizes(batch, weights / weights.sum(), what="batch"), dtype=float) / local
    model = memory_model(problem, program, dtype)
    w_b, g_b, k_b = state_bytes_per_param(dtype)
    state = sum(graph.tensors[t].numel for t in first_reader) * (w_b + g_b + k_b)
    memory = model.overhead + state + (model.replicated - state) * scale
    ratios = np.full(n, 1.0 / n)
    return problem, Synthesis(program, ratios, 0.0, memory, capacity=devices.memory), scale


def dp_floor(nbytes: float, cluster) -> float:
    """Seconds the parameters' gradients take to cross the nodes once (every byte of every
    gradient, split over the rails, on the node's NICs: `plait.cost.spmd.rail_time`), at the
    graph's dtype: no program that keeps data parallelism across nodes -- even and proportional
    DDP, the hierarchical programs, any flat program that replicates its parameters over nodes --
    iterates faster. Programs that shard a parameter across nodes escape it (they move
    activations instead: VGG19's FC layers). `nbytes`: the model's parameters, a tied weight once
    (`param_bytes`). 0 on one node."""
    mesh = mesh_of(cluster)
    if mesh.outer <= 1:
        return 0.0
    rails = rail_links(cluster, mesh)
    nodes = [group_links(list(node), bandwidth_matrix(cluster), latency_matrix(cluster),
                         [d.node for d in cluster.devices], [max(1, n.nics) for n in cluster.nodes],
                         measured_tables(cluster)) for node in mesh.nodes]
    return rail_time(nbytes, np.full(mesh.inner, 1.0 / mesh.inner), rails, nodes)


def param_bytes(spec, dtype: str) -> float:
    """Bytes of the model's parameters at `dtype`, each storage once (`nn.Module.parameters`
    skips a tied weight's second name; the aten graph lists it under both)."""
    module = spec.build("meta", dtype=DTYPES[dtype])
    return float(sum(p.numel() * p.element_size() for p in module.parameters()))


def bound(problem: Problem) -> float:
    """Perfect compute balance, communication hidden; the optimizer over every parameter once,
    at perfect balance too."""
    compute = sum(balanced_time(w) for w in problem.work)
    read = {t for op in problem.graph.ops for t in op.inputs}  # a tied weight's unread second name: not a parameter
    params = sum(problem.graph.tensors[t].numel for t in problem.graph.params if t in read)
    steps = np.array([optimizer_time(params, k) for k in problem.devices.kinds])
    return compute + balanced_time(steps)


# ----------------------------------------------------------------------------- one case


@dataclass
class Case:
    cluster: str
    model: str
    dtype: str
    batch: int
    ops: int
    even_ms: float
    prop_ms: float
    hap_ms: float
    plait_ms: float
    bound_ms: float
    hap_flag: str
    hap_states: int
    plait_states: int
    hap_exact: bool
    plait_exact: bool
    hap_s: float
    plait_s: float
    fits: dict
    plait_overlap: float = 1.0
    flat_ms: float = 0.0  # plait's flat program (sharding over every device)
    hier_ms: float = float("inf")  # plait's hierarchical program (inf: one node, or none fits)
    spmd_form: str = "flat"  # which of the two the SPMD column is
    flat_s: float = 0.0  # CPU seconds of the flat synthesis alone (plait_s: flat and hierarchical)
    capture_s: float = 0.0  # CPU seconds of capturing the model's graphs (global and node batch)
    floor_ms: float = 0.0  # `dp_floor`: cross-node gradient time of any program with data parallelism across nodes

    @property
    def best_ms(self) -> float:
        """plait's pick across families on the simulator's one scale: its SPMD program or
        FLOP-proportional DDP (what `plait.search` does with every family's finalists)."""
        options = [self.plait_ms] + ([self.prop_ms] if self.fits["prop"] else [])
        return min(options)

    @property
    def row(self) -> dict:
        d = dict(self.__dict__)
        best = self.best_ms
        d.update(best_ms=best, speedup_even=self.even_ms / best, speedup_hap=self.hap_ms / best,
                 spmd_speedup_even=self.even_ms / self.plait_ms, spmd_speedup_hap=self.hap_ms / self.plait_ms,
                 of_bound=self.bound_ms / best, bound_speedup=self.even_ms / self.bound_ms,
                 emitted_speedup_hap=self.hap_ms / self.emitted_ms)
        return d

    @property
    def emitted_ms(self) -> float:
        """The pick among what a plan file holds (`plait plan --family spmd` writes flat programs,
        with or without sharded storage; a hierarchical program has no plan form yet)."""
        options = ([self.flat_ms] if self.fits["flat"] else []) + ([self.prop_ms] if self.fits["prop"] else [])
        return min(options) if options else float("inf")


def run_case(cluster, cluster_name: str, label: str, spec_text: str, batch: int, dtype: str,
             max_states: int = 20_000) -> Case:
    spec = load_model(spec_text)
    tdtype = DTYPES[dtype]
    c0 = time.process_time()
    graph = capture_aten(spec.build("meta", dtype=tdtype), spec.sample_batch(batch, device="meta", dtype=tdtype)[0],
                         name=spec.name)
    capture_s = time.process_time() - c0
    devices = Devices.from_cluster(cluster, dtype)
    problem = Problem.build(graph, devices, outputs_free=free_outputs(graph, loss=True))  # plait's: what its runtime gathers
    sims = {}
    fits = {}
    for key, weights in (("even", np.ones(devices.n)), ("prop", devices.flops)):
        local, syn, scale = ddp(spec, batch, devices, weights, dtype)
        sims[key] = simulate_spmd(local, syn, cluster, batch=batch, name=key, device_scale=scale).iteration_time_s
        fits[key] = syn.fits
    # HAP: its cluster model, uniform-cost search, LP without memory, one global collective flag
    best = None
    for flag in ("padded", "grouped"):
        hap_problem = Problem.build(graph, devices.hap_model(), flag, outputs_free=free_outputs(graph, loss=True))
        cpu = time.process_time()
        syn = synthesize(hap_problem, dtype=dtype, memory=False, heuristic=False, max_states=max_states)
        syn.seconds = time.process_time() - cpu  # CPU seconds: the machine may be shared
        t = simulate_spmd(hap_problem, syn, cluster, batch=batch, name=f"hap-{flag}").iteration_time_s
        if best is None or t < best[0]:
            best = (t, flag, syn)
    assert best is not None
    sims["hap"], hap_flag, hap = best
    fits["hap"] = hap.fits
    cpu = time.process_time()
    # plait's flat program: the one `plait plan --family spmd` and the search driver emit
    plait_syn, flat_t, _ = synthesize_program(problem, PlanSimulator(cluster), batch=batch, dtype=dtype,
                                              max_states=max_states)
    sims["flat"] = flat_t if flat_t is not None else simulate_spmd(problem, plait_syn, cluster,
                                                                      batch=batch).iteration_time_s
    flat_s = time.process_time() - cpu
    fits["flat"] = plait_syn.fits
    # the hierarchical program (`plait.spmd.mesh`: op-level sharding inside each node, data
    # parallelism across nodes), on clusters of more than one node
    hier: Hierarchical | None = None
    sims["hier"] = float("inf")
    if len({d.node for d in cluster.devices}) > 1:
        # the graph at the largest node's batch, captured before the clock runs again (capture is
        # not synthesis: the flat program's and HAP's graphs are captured before theirs too)
        graphs: dict[int, object] = {}
        c0 = time.process_time()
        try:
            samples = max(node_batches(cluster, mesh_of(cluster), batch, dtype))
            graphs[samples] = capture_aten(spec.build("meta", dtype=tdtype),
                                           spec.sample_batch(samples, device="meta", dtype=tdtype)[0],
                                           name=spec.name)
        except ShardingError:
            pass  # synthesize_hierarchical says why below
        capture_s += time.process_time() - c0
        cpu += time.process_time() - c0

        def build(samples: int):
            if samples not in graphs:
                graphs[samples] = capture_aten(spec.build("meta", dtype=tdtype),
                                               spec.sample_batch(samples, device="meta", dtype=tdtype)[0],
                                               name=spec.name)
            return graphs[samples]

        def evaluate_h(h: Hierarchical) -> float:
            return simulate_spmd(h.world_problem, h, cluster, batch=batch, device_scale=h.device_scale,
                                 mesh=h.mesh).iteration_time_s

        try:
            hier = synthesize_hierarchical(build, cluster, batch, dtype=dtype, evaluate=evaluate_h,
                                           weights=OVERLAP_WEIGHTS, max_states=max_states)
            sims["hier"] = evaluate_h(hier) if hier.fits else float("inf")
        except ShardingError:
            hier = None
    plait_s = time.process_time() - cpu  # every candidate's synthesis and simulation, flat and hierarchical
    use_hier = hier is not None and sims["hier"] < (sims["flat"] if plait_syn.fits else float("inf"))
    form = "hier" if use_hier else "flat"
    program = hier.inner.program if use_hier and hier is not None else plait_syn.program
    form += "+zero" if program.homes else ""
    sims["plait"] = sims["hier"] if use_hier else sims["flat"]
    fits["plait"] = hier.fits if use_hier and hier is not None else plait_syn.fits
    return Case(cluster_name, label, dtype, batch, len(graph.ops), sims["even"] * 1e3, sims["prop"] * 1e3,
                sims["hap"] * 1e3, sims["plait"] * 1e3, bound(problem) * 1e3, hap_flag, hap.expanded,
                plait_syn.expanded + (hier.expanded if hier is not None else 0), hap.program.optimal,
                plait_syn.program.optimal, hap.seconds, plait_s, fits, plait_syn.overlap,
                sims["flat"] * 1e3, sims["hier"] * 1e3, form, flat_s, capture_s,
                dp_floor(param_bytes(spec, dtype), cluster) * 1e3)


# ----------------------------------------------------------------------------- table


def table(rows: list[dict]) -> str:
    head = (f"{'cluster':<18} {'model':<10} {'dt':<4} {'batch':>5} {'even':>8} {'prop':>8} {'HAP':>8} "
            f"{'flat':>8} {'hier':>8} {'SPMD':>8} {'plait':>8} {'bound':>8} {'dpfloor':>8} {'x even':>6} {'x HAP':>6} {'xHAPpl':>6} {'%bound':>6} {'HAP st':>7} "
            f"{'ours st':>7} {'HAP s':>6} {'ours s':>6} {'capt s':>6}  fits e/p/H/o")
    lines = [head, "-" * len(head)]
    for r in rows:
        f = r["fits"]
        mark = lambda ok: "y" if ok else "N"  # noqa: E731
        lines.append(
            f"{r['cluster']:<18} {r['model']:<10} {r['dtype']:<4} {r['batch']:>5} {r['even_ms']:8.1f} "
            f"{r['prop_ms']:8.1f} {r['hap_ms']:8.1f} {r['flat_ms']:8.1f} {r['hier_ms']:8.1f} {r['plait_ms']:8.1f} {r['best_ms']:8.1f} {r['bound_ms']:8.1f} {r['floor_ms']:8.1f} "
            f"{r['speedup_even']:6.2f} {r['speedup_hap']:6.2f} {r['emitted_speedup_hap']:6.2f} {100 * r['of_bound']:5.0f}% "
            f"{r['hap_states']:>6}{'' if r['hap_exact'] else 'b'} {r['plait_states']:>6}"
            f"{'' if r['plait_exact'] else 'b'} {r['hap_s']:6.2f} {r['plait_s']:6.2f} {r['capture_s']:6.2f}  "
            f"{mark(f['even'])}/{mark(f['prop'])}/{mark(f['hap'])}/{mark(f['plait'])}  (HAP: {r['hap_flag']})")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {}
    hap_over = [r for r in rows if not r["fits"]["hap"]]
    return {
        "best_speedup_over_even": max(r["speedup_even"] for r in rows),
        "spmd_only_mean_speedup_over_hap": float(np.mean([r["spmd_speedup_hap"] for r in rows])),
        "mean_speedup_over_hap": float(np.mean([r["speedup_hap"] for r in rows])),
        "emitted_mean_speedup_over_hap": float(np.mean([r["emitted_speedup_hap"] for r in rows])),
        "geomean_speedup_over_hap": float(np.exp(np.mean(np.log([r["speedup_hap"] for r in rows])))),
        "min_share_of_bound": min(r["of_bound"] for r in rows),
        "hap_plans_over_memory": len(hap_over),
        "plait_plans_over_memory": sum(1 for r in rows if not r["fits"]["plait"]),
        "max_plait_synthesis_s": max(r["plait_s"] for r in rows),
        "plait_overlap_weights_chosen": [r["plait_overlap"] for r in rows],
        "plait_spmd_forms": [r["spmd_form"] for r in rows],
        "max_flat_synthesis_s": max(r["flat_s"] for r in rows),
        "max_capture_s": max(r["capture_s"] for r in rows),
        "cases": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models on tiny clusters (smoke)")
    parser.add_argument("--json", action="store_true", help="one JSON object: rows and summary")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--models", type=int, default=4, help="only the first N models")
    parser.add_argument("--only", default=None, help="only models whose label contains this")
    parser.add_argument("--max-states", type=int, default=10_000, help="exact search budget per round")
    args = parser.parse_args()
    if args.quick:
        clusters = quick_clusters()
        models = QUICK_MODELS
    else:
        clusters = [(load_cluster(str(DATA / f)), dt) for f, dt in CLUSTERS]
        models = MODELS
    rows = []
    start = time.perf_counter()
    for ci, (cluster, dtype) in enumerate(clusters):
        for label, spec_text, per_gpu in models[:args.models]:
            if args.only and args.only.lower() not in label.lower():
                continue
            batch = per_gpu[ci] * len(cluster.devices)
            try:
                case = run_case(cluster, cluster.name, label, spec_text, batch, dtype, args.max_states)
            except ShardingError as exc:
                print(f"{cluster.name} {label}: {exc}", flush=True)
                continue
            rows.append(case.row)
            if not args.json:
                print(table([case.row]).splitlines()[-1], flush=True)
    out = {"rows": rows, "summary": summary(rows), "wall_s": time.perf_counter() - start}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=float))
    if args.json:
        print(json.dumps(out, indent=1, default=float))
    else:
        print()
        print(table(rows))
        print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
