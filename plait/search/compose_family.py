"""The composed family for the search driver: a pipeline whose stages run SPMD programs.

Composition of families (issue 17 item 1). On a cluster of mixed GPUs -- fast nodes and slow
nodes, slow links between them -- no single family fits well: a pipeline crosses the slow link
once per micro-batch but runs even tensor or data parallelism inside a stage; one SPMD program
over every device pays its collectives on the slow link. The composed plan is a linear pipeline
whose stages sit on groups of whole nodes (a node's GPUs never span two stages, so every slow
link the pipeline crosses is crossed by point-to-point messages only) and each stage runs a
HAP-style SPMD program of its layers on its GPUs, with uneven ratios by the LP
(`plait.spmd.ratios.synthesize`).

For each cut of the nodes into ``pp`` contiguous groups (in cluster order, ``pp`` up to
`max_stages`) and each micro-batch:

1. the layers are split over the stages by `plait.plan.hetero.split_layers` (the exact DP of the
   3D family's uneven splits) on each stage's layer times from `plait.cost.compute.layer_cost`
   (a group's rate is the sum of its GPUs' rates);
2. each stage's program is synthesized on its own AtenGraph (`plait.spmd.stage.stage_subgraph`
   of the model captured at the micro-batch) and its own devices, memory-aware, and its peak
   memory is the program's (`plait.spmd.ratios.memory_model`) with the activations of the
   micro-batches 1F1B keeps in flight on that stage;
3. the plan (`Plan.stages[i].spmd`) is simulated by the one engine
   (`plait.sim.compose_lower.simulate_compose`: the pipeline schedule of `plait.schedule` whose
   forward and backward are the programs' lowered ops), with the pipeline's message bytes from
   the one stage graph (`plait.ir.stage_graph`).

The runtime does not run such plans yet (`plait.runtime.supports` says why): the family's
candidates carry that reason (`Candidate.unsupported`), and `runnable=True` declines.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster
from plait.errors import PlaitError
from plait.ir.plan import Plan, StageSpec
from plait.plan.threed import Candidate, Evaluate, PlanResult, SearchError, auto_dtype


@dataclass
class ComposedCandidate:
    """One synthesized composed plan, before simulation."""

    plan: Plan
    stages: list[Any]  # plait.sim.compose_lower.StageProgram
    bytes_per_sample: dict[tuple[int, int], float]
    tied: list[tuple[int, int, float]]
    memory: list[int]  # peak bytes per cluster device
    analytic_s: float  # the bottleneck stage's synthesized cost x micro-batches (a lower bound)


def node_groups(cluster: Cluster, max_stages: int) -> list[list[list[int]]]:
    """Every cut of the cluster's nodes (in order) into 2..max_stages contiguous groups, as lists of
    device ids per stage; a one-node cluster is cut between runs of one GPU kind instead."""
    units: list[list[int]] = []
    by_node: dict[int, list[int]] = {}
    for d in cluster.devices:
        by_node.setdefault(d.node, []).append(d.id)
    units = [by_node[k] for k in sorted(by_node)]
    if len(units) == 1:
        units = [list(g) for _, g in itertools.groupby(units[0], key=lambda i: cluster.devices[i].kind.name)]
        units = [[i for i in g] for g in units]
    out = []
    for pp in range(2, min(max_stages, len(units)) + 1):
        for cuts in itertools.combinations(range(1, len(units)), pp - 1):
            bounds = [0, *cuts, len(units)]
            out.append([sum(units[a:b], []) for a, b in zip(bounds, bounds[1:])])
    return out


def layer_times(graph: Any, groups: list[list[int]], cluster: Cluster, micro_batch: int, dtype: str) -> np.ndarray:
    """times[p, i]: layer i's forward + backward on stage p's group, its GPUs' rates summed
    (`plait.cost.compute.layer_cost` per kind)."""
    from plait.cost.compute import layer_cost

    out = np.zeros((len(groups), len(graph.layers)))
    cache: dict[tuple[int, str], float] = {}
    for i, layer in enumerate(graph.layers):
        for p, ids in enumerate(groups):
            rate = 0.0
            for d in ids:
                kind = cluster.devices[d].kind
                key = (i, kind.name)
                if key not in cache:
                    c = layer_cost(layer, graph, micro_batch, kind, dtype)
                    cache[key] = c.fwd.compute_s + c.bwd.compute_s
                rate += 1.0 / max(cache[key], 1e-12)
            out[p, i] = 1.0 / rate
    return out


def synthesize_stages(spec: Any, opgraph: Any, aten: Any, cluster: Cluster, groups: list[list[int]],
                      split: list[int], micro_batch: int, global_batch: int, dtype: str,
                      max_states: int) -> ComposedCandidate:
    """The composed plan of one device grouping and layer split: each stage's program synthesized
    on its sub-graph and devices; raises a PlaitError when a stage has no program that fits."""
    from plait.cost.traffic import activation_scale
    from plait.ir.stage_graph import stage_graph
    from plait.sim.compose_lower import StageProgram
    from plait.spmd.cost import Devices
    from plait.spmd.program_plan import program_plan
    from plait.spmd.ratios import memory_model
    from plait.spmd.ratios import synthesize as synth
    from plait.spmd.search import Problem
    from plait.spmd.stage import shared_params, stage_subgraph

    names = [layer.name for layer in opgraph.layers]
    bounds = np.concatenate([[0], np.cumsum(split)]).astype(int)
    layers = [names[a:b] for a, b in zip(bounds, bounds[1:])]
    pp = len(groups)
    m = global_batch // micro_batch
    programs, specs, memory = [], [], [0] * cluster.num_devices
    bottleneck = 0.0
    for s, (ids, lays) in enumerate(zip(groups, layers)):
        sub = stage_subgraph(aten, lays, name=f"{aten.model} stage {s}")
        problem = Problem.build(sub, Devices.from_cluster(cluster, dtype, ids))
        syn = synth(problem, dtype=dtype, max_states=max_states)
        if not syn.fits:
            raise SearchError(f"compose: stage {s} ({len(lays)} layers on {len(ids)} GPUs) does not fit at "
                              f"micro-batch {micro_batch}")
        ratios = syn.segment_ratios if syn.segment_ratios is not None else syn.ratios
        segs = syn.segments
        mm = memory_model(problem, syn.program, dtype, segs=segs)
        in_flight = min(m, pp - s)  # 1F1B keeps pp - s micro-batches' activations on stage s
        peak = syn.memory + (in_flight - 1) * mm.activations_on(ratios)
        for d, b in zip(ids, peak):
            memory[d] = int(b)
        programs.append(StageProgram(problem, syn.program, np.asarray(ratios, dtype=float),
                                     segs.of_op if segs is not None else None,
                                     segs.of_dim if segs is not None else None, name=f"s{s}"))
        stage_spmd = program_plan(syn.program.strategies, ratios, micro_batch, model=spec.spec,
                                  predicted_s=syn.cost, dtype=dtype).spmd
        specs.append(StageSpec(f"s{s}", lays, list(ids), micro_batch=micro_batch, spmd=stage_spmd))
        bottleneck = max(bottleneck, float(syn.cost))
    plan = Plan(pp=pp, micro_batch=micro_batch, global_batch=global_batch, dtype=dtype, stages=specs,
                stage_edges=[(s, s + 1) for s in range(pp - 1)])
    sg = stage_graph(plan, opgraph)
    scale = activation_scale(opgraph, plan)
    per_sample = {(e.src, e.dst): e.bytes_per_sample * scale for e in sg.edges}
    tied = []
    for t in shared_params(aten, layers):
        holders = [s for s, lays in enumerate(layers) if any(op.layer in lays and t in op.inputs for op in aten.ops)]
        tied.append((holders[0], holders[-1], float(aten.tensors[t].nbytes)))
    for d in range(cluster.num_devices):
        if all(d not in ids for ids in groups):
            raise SearchError(f"compose: device {d} is in no stage")
    return ComposedCandidate(plan, programs, per_sample, tied, memory, bottleneck * (m + pp - 1))


def micro_batches_to_try(global_batch: int, pp: int) -> list[int]:
    """Micro-batch sizes with at least 2 pp micro-batches (pipeline fill), largest two, dividing the batch."""
    sizes = [b for b in range(1, global_batch + 1) if global_batch % b == 0 and global_batch // b >= 2 * pp]
    return sorted(sizes, reverse=True)[:2]


def search_compose(model: Any, cluster: Cluster, *, global_batch: int | None, top: int,
                   evaluate: Evaluate | None, supports: Callable[[Plan], tuple[bool, str]] | None,
                   compute: Any = None, dtype: str | None = None, max_states: int = 20_000,
                   max_devices: int = 64, max_stages: int = 4, runnable: bool = False) -> PlanResult:
    """The best composed plans of `model` on `cluster` (module docstring) as a `PlanResult`."""
    from plait.graph.aten_capture import capture_aten
    from plait.graph.zoo import load_model
    from plait.plan.hetero import split_layers
    from plait.plan.threed import DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL, load_graph
    from plait.sim.compose_lower import simulate_compose

    t0 = time.perf_counter()
    n = cluster.num_devices
    if runnable:
        raise SearchError("compose: the runtime does not yet run a pipeline stage as an SPMD program "
                          "(plans of this family are planned and simulated only)")
    if n > max_devices:
        raise SearchError(f"compose: {n} devices; the composed family synthesizes stage programs on clusters of "
                          f"up to {max_devices} GPUs (max_devices)")
    if not isinstance(model, str | None):
        raise SearchError("compose: the family captures a zoo spec or file.py:factory, not a prepared graph")
    groupings = node_groups(cluster, max_stages)
    if not groupings:
        raise SearchError(f"compose: cluster {cluster.name!r} is one node of one GPU kind; a composed pipeline "
                          "needs two nodes (or two GPU kinds) to put its stages on")
    gb = DEFAULT_GLOBAL_BATCH if global_batch is None else int(global_batch)
    dtype = dtype or auto_dtype(cluster)
    spec = load_model(DEFAULT_MODEL if model is None else model)
    _, opgraph = load_graph(spec.spec, dtype)
    captures: dict[int, Any] = {}
    found: list[ComposedCandidate] = []
    reasons: dict[str, int] = {}
    enumerated = 0
    for groups in groupings:
        for b in micro_batches_to_try(gb, len(groups)):
            enumerated += 1
            split = split_layers(layer_times(opgraph, groups, cluster, b, dtype))
            if split is None:
                reasons["fewer layers than stages"] = reasons.get("fewer layers than stages", 0) + 1
                continue
            if b not in captures:
                inputs, _ = spec.sample_batch(b)
                captures[b] = capture_aten(spec.build(device="meta"), inputs, name=spec.name)
            try:
                found.append(synthesize_stages(spec, opgraph, captures[b], cluster, groups, split, b, gb, dtype,
                                               max_states))
            except PlaitError as exc:
                key = str(exc).split(":")[0] if "does not fit" not in str(exc) else "a stage does not fit"
                reasons[key] = reasons.get(key, 0) + 1
    if not found:
        raise SearchError(f"compose: no composed plan for {spec.spec} on {cluster.name}: {reasons}")
    cands = [_candidate(c, cluster, evaluate is not None, supports, spec.spec, opgraph, simulate_compose)
             for c in found]
    cands.sort(key=lambda c: c.time_s)
    return PlanResult(model=spec.spec, cluster=cluster.name, global_batch=gb, world_size=n, top=cands[:top],
                      enumerated=enumerated, pruned=sum(reasons.values()), pruned_reasons=reasons,
                      memory_checked=len(found), ranked_analytic=len(found),
                      simulated=len(found) if evaluate is not None else 0, search_time_s=time.perf_counter() - t0,
                      ranker="simulator" if evaluate is not None else "analytic", family="compose",
                      extra={"groupings": len(groupings)})


def _candidate(c: ComposedCandidate, cluster: Cluster, simulate: bool,
               supports: Callable[[Plan], tuple[bool, str]] | None, name: str, opgraph: Any,
               simulate_compose: Callable[..., Any]) -> Candidate:
    cand = Candidate(plan=c.plan, analytic_s=c.analytic_s, family="compose", peak_bytes=list(c.memory))
    if simulate:
        plan = c.plan
        flops = (opgraph.fwd_flops + opgraph.bwd_flops) * plan.global_batch
        sim = simulate_compose(c.stages, list(plan.stage_edges), c.bytes_per_sample, plan.num_micro_batches,
                               plan.micro_batch, cluster, tied=c.tied, memory=c.memory, name=str(plan), flops=flops)
        cand.iteration_time_s = sim.iteration_time_s
        cand.throughput = sim.throughput_samples_per_s
        cand.tflops_per_gpu = sim.tflops_per_gpu
        cand.sim = sim.to_dict()
    else:
        cand.throughput = c.plan.global_batch / c.analytic_s
    free: dict[str, int] = {}
    for d, peak in zip(cluster.devices, c.memory):
        free[d.kind.name] = min(free.get(d.kind.name, d.kind.memory_bytes), d.kind.memory_bytes - peak)
    cand.headroom_by_kind = free
    if supports is not None:
        ok, why = supports(c.plan)
        cand.unsupported = "" if ok else why
    return cand
