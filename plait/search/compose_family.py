"""The composed family for the search driver: a pipeline whose stages run SPMD programs.

Composition of families (issue 17 item 1). On a cluster of mixed GPUs -- fast nodes and slow
nodes, slow links between them -- no single family fits well: a pipeline crosses the slow link
once per micro-batch but runs even tensor or data parallelism inside a stage; one SPMD program
over every device pays its collectives on the slow link. The composed plan is a linear pipeline
whose stages sit on contiguous groups of the cluster's units -- a unit is a node, or the run of
one GPU kind inside a node that mixes kinds -- so a slow link between nodes is crossed by
point-to-point messages only, and each stage runs a HAP-style SPMD program of its layers on its
GPUs, with uneven ratios by the LP (`plait.spmd.ratios.synthesize`) where they mix kinds.

For each cut into ``pp`` contiguous groups (``pp`` up to `max_stages`; cut only between nodes or
between the GPU kinds of a node) of each pipeline order of the units (`unit_orders`), at the
largest micro-batches that give at least ``pp`` micro-batches, ranked by `pipeline_estimate`
(compute, the boundary messages on their links, gradient and tied all-reduces), the best
`candidates`:

1. the layers are split over the stages by `plait.planners.hetero.split_layers` (the exact DP of the
   3D family's uneven splits) on each stage's layer times from `plait.cost.compute.layer_cost`
   (a group's rate is the sum of its GPUs' rates);
2. each stage's program is synthesized on its own AtenGraph (`plait.graph.aten_stage.stage_subgraph`
   of the model captured at the micro-batch) and its own devices, memory-aware, and its peak
   memory is the program's (`plait.cost.memory.memory_model`) with the activations of the
   micro-batches 1F1B keeps in flight on that stage, read off the schedule's action lists
   (`plait.cost.memory.composed_peak_memory`);
3. the plan (`Plan.stages[i].spmd`) is simulated by the one engine
   (the `Simulator`'s `compose`, `plait.sim.api.simulate_compose`: the pipeline schedule of `plait.schedule` whose
   forward and backward are the programs' lowered ops), with the pipeline's message bytes from
   the one stage graph (`plait.ir.stage_graph`).

The runtime runs such plans (`plait.runtime.compose_worker`: each stage's program on its own
process group, 1F1B between the stages, the messages as the simulator prices them); a plan it
cannot run carries `plait.runtime.supports`' reason (`Candidate.unsupported`); the runtime runs them
in any dtype (fp32 masters, ops autocast to bf16 / fp16), so `runnable=True` keeps the plan's dtype.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.cluster.spec import Cluster
from plait.cost.devices import DeviceModel
from plait.cost.memory import composed_in_flight, composed_peak_memory
from plait.cost.program import ProgramStage
from plait.errors import PlaitError
from plait.ir.plan import Plan, StageSpec
from plait.planners.types import (
    Candidate,
    PlanResult,
    SearchError,
    Simulator,
    auto_dtype,
)
from plait.workers import map_parallel

if TYPE_CHECKING:
    from plait.cost.compute import ComputeModel
    from plait.graph.resolve import ModelSource
    from plait.net.view import ClusterView
    from plait.planners.options import ComposeOptions, SearchOptions

_CAPTURES: dict[tuple[str, int, str], Any] = {}  # (model spec, micro-batch, dtype) -> AtenGraph
# (estimate, index, groups, micro-batch, split): a composed option, ranked by `pipeline_estimate`
_Option = tuple[float, int, list[list[int]], int, Any]


@dataclass
class ComposedCandidate:
    """One synthesized composed plan, before simulation."""

    plan: Plan
    stages: list[ProgramStage]
    bytes_per_sample: dict[tuple[int, int], float]
    tied: list[tuple[int, int, float]]
    memory: list[int]  # peak bytes per cluster device under the plan's schedule
    analytic_s: float  # the bottleneck stage's synthesized cost x micro-batches (a lower bound)
    # per stage: its devices, each one's bytes with one micro-batch in flight, and the activation
    # bytes of each further micro-batch in flight (`MemoryModel.activations_on`)
    stage_bytes: list[tuple[list[int], np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)


def cluster_units(cluster: Cluster) -> list[list[int]]:
    """The cluster's units: runs of GPUs of one kind in one node (a whole node when it has one kind)."""
    return [[d.id for d in run] for _, run in itertools.groupby(cluster.devices, key=lambda d: (d.node, d.kind.name))]


def unit_orders(units: list[list[int]], cluster: Cluster, max_units: int = 4) -> list[list[list[int]]]:
    """Pipeline orders of the units: every permutation up to `max_units` units (so a slow node may
    take the first stage -- the embedding -- rather than be left the head, and stages may group
    units of one kind across nodes), else the cluster order and the units sorted by kind (slowest
    first and fastest first)."""
    if len(units) <= max_units:
        return [list(p) for p in itertools.permutations(units)]
    speed = {u[0]: cluster.devices[u[0]].kind.flops("fp16") for u in units}
    slow = sorted(units, key=lambda u: (speed[u[0]], u[0]))
    return [units, slow, slow[::-1]]


def grouping_signature(cluster: Cluster, groups: list[list[int]]) -> tuple:
    """What a grouping looks like up to renaming identical nodes: per stage, the (node's kind of
    server, GPU kind, count) of each node part; per pair of stages, which nodes they share. Orders
    of identical nodes (AMP's four g4dn servers) give one grouping, not 24 that crowd the ranking."""
    def server(n: int) -> tuple:
        node = cluster.nodes[n]
        return (tuple(sorted(node.gpus)), node.nics, node.nic.bandwidth, node.intra.bandwidth)

    node_of = {d.id: d.node for d in cluster.devices}
    parts = [sorted({(server(node_of[d]), cluster.devices[d].kind.name, sum(1 for e in ids if node_of[e] == node_of[d]))
                     for d in ids}) for ids in groups]
    nodes = [{node_of[d] for d in ids} for ids in groups]
    shared = tuple(tuple(len(nodes[a] & nodes[b]) for b in range(len(groups))) for a in range(len(groups)))
    return tuple(map(tuple, parts)), shared


def node_groups(cluster: Cluster, max_stages: int) -> list[list[list[int]]]:
    """Device groups (device ids per stage, in pipeline order) to put the stages on:

    * every cut into 2..max_stages contiguous groups of every pipeline order of the cluster's
      units (`cluster_units`, `unit_orders`): a stage spans whole nodes, or a run of one kind, or
      the mixed GPUs of one node, or the runs of one kind in several nodes;
    * every node cut into ``q`` slices of the same mix of kinds (``q`` dividing each kind's count
      in every node, ``q x nodes <= max_stages``): stages that each mix fast and slow GPUs, the
      layout of a 3D plan whose replicas are of different kinds; with two slices also folded
      (node 0..N-1's first slices, then node N-1..0's second ones)."""
    units = cluster_units(cluster)
    out: list[list[list[int]]] = []
    seen: set[tuple] = set()
    for order in unit_orders(units, cluster):
        for pp in range(2, min(max_stages, len(order)) + 1):
            for cuts in itertools.combinations(range(1, len(order)), pp - 1):
                bounds = [0, *cuts, len(order)]
                groups = [sorted(sum(order[a:b], [])) for a, b in zip(bounds, bounds[1:])]
                key = grouping_signature(cluster, groups)
                if key not in seen:
                    seen.add(key)
                    out.append(groups)
    nodes: dict[int, list[list[int]]] = {}
    for run in units:
        nodes.setdefault(cluster.devices[run[0]].node, []).append(run)
    counts = [len(run) for runs in nodes.values() for run in runs]
    for q in range(2, max_stages // len(nodes) + 1):
        if any(len(runs) < 2 for runs in nodes.values()) or any(c % q for c in counts):
            continue  # a node of one kind is already cut by the units
        def piece(n: int, k: int, q: int = q) -> list[int]:
            return sum((run[k * len(run) // q:(k + 1) * len(run) // q] for run in nodes[n]), [])

        node_order = sorted(nodes)
        out.append([piece(n, k) for n in node_order for k in range(q)])
        if q == 2 and len(node_order) > 1:  # folded: out over the nodes and back, so the first and last
            # stages (embedding and head: tied weights) share a node and the messages cross the
            # slow links in both directions at once
            out.append([piece(n, 0) for n in node_order] + [piece(n, 1) for n in reversed(node_order)])
    return out


def pipeline_estimate(opgraph: Any, groups: list[list[int]], times: np.ndarray, split: list[int],
                      micro_batch: int, global_batch: int, view: Any, dtype: str) -> float:
    """A quick estimate of a composed pipeline's iteration that ranks the groupings to synthesize:
    ``(m + pp - 1) x`` the slowest of each stage's compute per micro-batch (its GPUs' rates summed)
    and each boundary's message (the last layer's output bytes, carried as the simulator carries
    it, `plait.net.view.transfer_seconds`), plus the slowest stage's gradient all-reduce
    on its group and the tied weights' all-reduce between their stages (`plait.cost.collectives`).
    A compute-only bound ranks a stage that spans a slow link, or a cut across it that sends more
    than it computes, as well as any other; this does not."""
    from plait.cost.collectives import choose_algorithm, collective_time
    from plait.net.view import transfer_seconds

    grad_bytes = {"fp16": 2, "bf16": 2}.get(dtype, 4)
    edges = np.concatenate([[0], np.cumsum(split)]).astype(int)
    per_mb = max(times[p, a:e].sum() for p, (a, e) in enumerate(zip(edges, edges[1:])))
    for p in range(len(groups) - 1):
        nbytes = opgraph.layers[edges[p + 1] - 1].output_bytes * micro_batch
        per_mb = max(per_mb, transfer_seconds(view, groups[p], groups[p + 1], nbytes))
    tail = 0.0
    for p, ids in enumerate(groups):
        nbytes = sum(layer.param_count for layer in opgraph.layers[edges[p]:edges[p + 1]]) * grad_bytes
        links = view.group(ids)
        if len(ids) > 1 and nbytes > 0:
            tail = max(tail, collective_time("all_reduce", nbytes, links,
                                             choose_algorithm("all_reduce", nbytes, links)))
    stage_of = {layer.name: p for p, (a, e) in enumerate(zip(edges, edges[1:])) for layer in opgraph.layers[a:e]}
    for tie in opgraph.tied:
        a, b = stage_of.get(tie.owner), stage_of.get(tie.user)
        if a is not None and b is not None and a != b:
            links = view.group([groups[a][0], groups[b][0]])
            nbytes = tie.params * grad_bytes
            tail += collective_time("all_reduce", nbytes, links, choose_algorithm("all_reduce", nbytes, links))
    m = global_batch // micro_batch
    return float(per_mb * (m + len(groups) - 1) + tail)


def layer_times(graph: Any, groups: list[list[int]], cluster: Cluster, micro_batch: int, dtype: str,
                launch_floor: bool = False, model: ComputeModel | None = None) -> np.ndarray:
    """times[p, i]: layer i's forward + backward on stage p's group, its GPUs' rates summed
    (`plait.cost.compute.layer_cost` per kind): what the layer split balances. With
    `launch_floor`, no less than the host time of the slowest-launching GPU: each GPU of a group
    still launches every kernel, so a launch-bound stage does not run ``len(group)`` times faster
    (what `pipeline_estimate` ranks by; summed rates alone priced bert-large's 4-GPU stages at
    micro-batch 4 at 168.6 ms against 288.5 ms simulated)."""
    shared, host = _group_layer_times(graph, groups, cluster, micro_batch, dtype, model=model)
    return np.maximum(shared, host) if launch_floor else shared


def _group_layer_times(graph: Any, groups: list[list[int]], cluster: Cluster, micro_batch: int,
                       dtype: str, costs: dict | None = None, model: ComputeModel | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(summed-rate times, slowest GPU's host times), each [stage, layer]: `layer_times`' two parts.
    `costs` keeps each (layer, kind, micro-batch, dtype)'s cost for the next grouping (a search
    prices hundreds of groupings of the same few kinds). `model`: the compute model (default: the
    A100-fitted one); with a profile (`ComputeModel.with_profile`) measured layers read it."""
    from plait.cost.compute import DEFAULT_MODEL, layer_cost

    model = DEFAULT_MODEL if model is None else model

    shared = np.zeros((len(groups), len(graph.layers)))
    host = np.zeros_like(shared)
    cache: dict[tuple, tuple[float, float]] = {} if costs is None else costs
    kinds = [d.kind for d in cluster.devices]
    for i, layer in enumerate(graph.layers):
        for p, ids in enumerate(groups):
            rate = 0.0
            for d in ids:
                kind = kinds[d]
                key = (i, kind.name, micro_batch, dtype)
                hit = cache.get(key)
                if hit is None:
                    c = layer_cost(layer, graph, micro_batch, kind, dtype, model=model)
                    hit = cache[key] = (c.fwd.compute_s + c.bwd.compute_s, c.fwd.host_s + c.bwd.host_s)
                whole, launch = hit
                rate += 1.0 / max(whole, 1e-12)
                if launch > host[p, i]:
                    host[p, i] = launch
            shared[p, i] = 1.0 / rate
    return shared, host


def synthesize_stages(spec: Any, opgraph: Any, aten: Any, cluster: Cluster, groups: list[list[int]],
                      split: list[int], micro_batch: int, global_batch: int, dtype: str,
                      max_states: int, cache: dict | None = None,
                      devices: DeviceModel | None = None) -> ComposedCandidate:
    """The composed plan of one device grouping and layer split: each stage's program synthesized
    on its sub-graph and devices (`cache`: programs already synthesized for the same devices,
    layers and micro-batch, e.g. by another order of the same groups); raises a PlaitError when a
    stage has no program that fits. `devices`: the search's one device model of `cluster` (the
    simulator's view); None: built here."""
    from plait.cost.memory import memory_model
    from plait.cost.program import ProgramStage, stage_problem
    from plait.cost.spmd import Devices
    from plait.cost.traffic import composed_boundaries
    from plait.graph.aten_stage import received_inputs
    from plait.ir.profile import profile_for
    from plait.spmd.program_plan import program_plan
    from plait.spmd.ratios import synthesize as synth

    devices = devices if devices is not None else DeviceModel.of_cluster(cluster)
    # each stage's ops read the cluster's measured layer times where it has them (`measured_work`)
    profile = profile_for(cluster.model_profiles, opgraph, dtype) if cluster.model_profiles else None
    names = [layer.name for layer in opgraph.layers]
    bounds = np.concatenate([[0], np.cumsum(split)]).astype(int)
    layers = [names[a:b] for a, b in zip(bounds, bounds[1:])]
    pp = len(groups)
    m = global_batch // micro_batch
    programs: list[Any] = []
    specs: list[StageSpec] = []
    stage_bytes: list[tuple[list[int], np.ndarray, np.ndarray]] = []
    bottleneck = 0.0
    for s, (ids, lays) in enumerate(zip(groups, layers)):
        key = (tuple(ids), tuple(lays), micro_batch)
        if cache is None or key not in cache:
            problem = stage_problem(aten, lays, Devices.of(devices, dtype, ids), m, s == pp - 1,
                                    f"{aten.model} stage {s}", profile=profile)
            hit = (problem, synth(problem, dtype=dtype, max_states=max_states))
            if cache is not None:
                cache[key] = hit
        problem, syn = cache[key] if cache is not None else hit
        if not syn.fits:
            raise SearchError(f"compose: stage {s} ({len(lays)} layers on {len(ids)} GPUs) does not fit at "
                              f"micro-batch {micro_batch}")
        ratios = syn.segment_ratios if syn.segment_ratios is not None else syn.ratios
        segs = syn.segments
        mm = memory_model(problem, syn.program, dtype, segs=segs)
        stage_bytes.append((list(ids), np.asarray(syn.memory, dtype=float),
                            np.asarray(mm.activations_on(ratios), dtype=float)))
        programs.append(ProgramStage(problem, syn.program, np.asarray(ratios, dtype=float),
                                     segs.of_op if segs is not None else None,
                                     segs.of_dim if segs is not None else None, name=f"s{s}",
                                     grad_inputs=received_inputs(problem.graph, aten)))
        stage_spmd = program_plan(syn.program.strategies, ratios, micro_batch, model=spec.spec,
                                  predicted_s=syn.cost, dtype=dtype).spmd
        specs.append(StageSpec(f"s{s}", lays, list(ids), micro_batch=micro_batch, spmd=stage_spmd))
        bottleneck = max(bottleneck, float(syn.cost))
    plan = Plan(pp=pp, micro_batch=micro_batch, global_batch=global_batch, dtype=dtype, stages=specs,
                stage_edges=[(s, s + 1) for s in range(pp - 1)])
    per_sample, tied = composed_boundaries(plan, opgraph, aten)
    for d in range(cluster.num_devices):
        if all(d not in ids for ids in groups):
            raise SearchError(f"compose: device {d} is in no stage")
    memory = composed_peak_memory(stage_bytes, plan.schedule, m, cluster.num_devices)
    return ComposedCandidate(plan, programs, per_sample, tied, memory, bottleneck * (m + pp - 1), stage_bytes)


def micro_batches_to_try(global_batch: int, pp: int, sizes: int = 3) -> list[int]:
    """The `sizes` largest micro-batches dividing the batch into at least pp micro-batches: fewer,
    larger ones pay less per-op host time, fewer per-message latencies and fewer gathers of a
    stage's messages, more, smaller ones less fill and drain (the estimate, then the simulator,
    weigh both)."""
    fits = [b for b in range(1, global_batch + 1) if global_batch % b == 0 and global_batch // b >= pp]
    return sorted(fits, reverse=True)[:sizes]


def search_compose(model: ModelSource | None, cluster: Cluster, common: SearchOptions, simulator: Simulator | None,
                   options: ComposeOptions) -> PlanResult:
    """The best composed plans of `model` on `cluster` (module docstring) as a `PlanResult`: the
    `options.candidates` (grouping, micro-batch) options with the least `pipeline_estimate` are
    synthesized and simulated, on `common.jobs` worker processes (None: this machine's CPUs)."""
    t0 = time.perf_counter()
    n, max_devices, candidates, jobs = cluster.num_devices, options.max_devices, options.candidates, common.jobs
    if n > max_devices:  # said before the imports below (a third of a second) are paid
        raise SearchError(f"compose: {n} devices; the composed family synthesizes stage programs on clusters of "
                          f"up to {max_devices} GPUs (max_devices)")
    from plait.graph.zoo import ModelSpec, load_model
    from plait.net.view import ClusterView
    from plait.planners.types import DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL, load_graph

    if not (model is None or isinstance(model, str) or (isinstance(model, ModelSpec) and model.spec)):
        raise SearchError("compose: the family captures a zoo spec or file.py:factory (the ModelSpec of one), "
                          "not a prepared graph")
    groupings = node_groups(cluster, options.max_stages)
    if not groupings:
        raise SearchError(f"compose: cluster {cluster.name!r} is one node of one GPU kind; a composed pipeline "
                          "needs two nodes (or two GPU kinds in a node) to put its stages on")
    gb = DEFAULT_GLOBAL_BATCH if common.global_batch is None else int(common.global_batch)
    dtype = common.dtype or auto_dtype(cluster)
    spec = load_model(DEFAULT_MODEL if model is None else model)
    _, opgraph = load_graph(spec, dtype)
    from plait.cost.compute import DEFAULT_MODEL as DEFAULT_COMPUTE

    # the layer split's pre-screen prices with the cluster's profile where it has the entry
    compute = (common.compute or DEFAULT_COMPUTE).with_profile(cluster, opgraph, dtype)
    view = simulator.view if simulator is not None else ClusterView.from_cluster(cluster)
    reasons: dict[str, int] = {}
    ranked, enumerated = _estimated_options(opgraph, groupings, cluster, gb, dtype, compute, view, reasons)
    chosen = ranked[:candidates]
    if len(ranked) > len(chosen):
        reasons[f"not among the {candidates} best by the pipeline estimate"] = len(ranked) - len(chosen)
    captures = _captures(spec, chosen, dtype, options.runnable)
    found = _synthesized(spec, opgraph, captures, cluster, view, chosen, gb, dtype, options.max_states, jobs,
                         reasons)
    if not found:
        raise SearchError(f"compose: no composed plan for {spec.spec} on {cluster.name}: {reasons}")
    found = [v for c in found for v in schedule_variants(c, cluster, reasons)]
    cands = map_parallel(lambda c: _candidate(c, cluster, simulator, common.supports, opgraph), found, jobs)
    cands.sort(key=lambda c: c.time_s)
    return PlanResult(model=spec.spec, cluster=cluster.name, global_batch=gb, world_size=n, top=cands[:common.top],
                      enumerated=enumerated, pruned=sum(reasons.values()), pruned_reasons=reasons,
                      memory_checked=len(found), ranked_analytic=len(found),
                      simulated=len(found) if simulator is not None else 0, search_time_s=time.perf_counter() - t0,
                      ranker="simulator" if simulator is not None else "analytic", family="compose",
                      extra={"groupings": len(groupings)})


def _estimated_options(opgraph: Any, groupings: list[list[list[int]]], cluster: Cluster, gb: int, dtype: str,
                       compute: Any, view: Any, reasons: dict[str, int]) -> tuple[list[_Option], int]:
    """Every (grouping, micro-batch) with a layer split, least `pipeline_estimate` first, and how
    many were enumerated (those with fewer layers than stages are tallied in `reasons`)."""
    from plait.planners.hetero import split_layers

    enumerated = 0
    options: list[_Option] = []
    costs: dict = {}
    for groups in groupings:
        for b in micro_batches_to_try(gb, len(groups)):
            enumerated += 1
            times, host = _group_layer_times(opgraph, groups, cluster, b, dtype, costs, compute)  # `layer_times`, both ways
            split = split_layers(times)
            if split is None:
                reasons["fewer layers than stages"] = reasons.get("fewer layers than stages", 0) + 1
                continue
            est = pipeline_estimate(opgraph, groups, np.maximum(times, host), split, b, gb, view, dtype)
            options.append((est, len(options), groups, b, split))
    options.sort(key=lambda o: o[:2])
    return options, enumerated


def _captures(spec: Any, chosen: list[_Option], dtype: str, runnable: bool) -> dict[int, Any]:
    """The model's AtenGraph at each chosen micro-batch (memoized in `_CAPTURES`); with `runnable`,
    raises a SearchError when the runtime's dtype would change the graph."""
    import torch

    from plait.graph.aten_capture import capture_aten

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
    captures: dict[int, Any] = {}
    for *_, b, _split in chosen:  # torch.export runs here, before any worker is forked
        key = (spec.spec, b, dtype)
        if key not in _CAPTURES:  # in the compute dtype: messages and gradients in the plan's dtype
            inputs, _ = spec.sample_batch(b, dtype=torch_dtype)
            _CAPTURES[key] = capture_aten(spec.build(device="meta", dtype=torch_dtype), inputs, name=spec.name)
        captures[b] = _CAPTURES[key]
    if runnable and captures:
        from plait.spmd.program_plan import dtype_changes_graph

        b = min(captures)
        if why := dtype_changes_graph(spec, b, dtype, captures[b]):
            raise SearchError(f"compose: {why}")
    return captures


def _synthesized(spec: Any, opgraph: Any, captures: dict[int, Any], cluster: Cluster, view: ClusterView,
                 chosen: list[_Option], gb: int, dtype: str, max_states: int, jobs: int | None,
                 reasons: dict[str, int]) -> list[ComposedCandidate]:
    """The chosen options' composed plans, in option order; an option with a stage that does not
    fit is tallied in `reasons`."""
    cache: dict = {}  # stage programs by (devices, layers, micro-batch): a memo, per process

    def synthesize(option: _Option) -> ComposedCandidate | str:
        _, _, groups, b, split = option
        try:
            return synthesize_stages(spec, opgraph, captures[b], cluster, groups, split, b, gb, dtype, max_states,
                                     cache, devices=view)
        except PlaitError as exc:  # as text: the reason is tallied in the parent, in option order
            return str(exc)

    # each option's stage programs, and then each variant's simulation, on `jobs` worker processes
    # (`plait.workers`: the same results, in the same order, as one process gives)
    found: list[ComposedCandidate] = []
    for out in map_parallel(synthesize, chosen, jobs):
        if isinstance(out, str):
            reason = "a stage does not fit" if "does not fit" in out else out.split(":")[0]
            reasons[reason] = reasons.get(reason, 0) + 1
        else:
            found.append(out)
    return found


def schedule_variants(c: ComposedCandidate, cluster: Cluster, reasons: dict[str, int]) -> list[ComposedCandidate]:
    """The plan under 1F1B and, where it keeps more micro-batches in flight and still fits, under
    eager 1F1B (`plait.schedule.builders.eager_1f1b`): over a slow link between stages a message's
    round trip outlasts 1F1B's pp - s micro-batches of compute and stalls the stage; the simulator
    weighs that against the memory and the longer fill."""
    m, pp = c.plan.num_micro_batches, len(c.stage_bytes)
    out = [c]
    if composed_in_flight("eager_1f1b", pp, m) == composed_in_flight(c.plan.schedule, pp, m):
        return out
    memory = composed_peak_memory(c.stage_bytes, "eager_1f1b", m, cluster.num_devices)
    if any(b > d.kind.memory_bytes for b, d in zip(memory, cluster.devices)):
        reasons["eager 1F1B does not fit"] = reasons.get("eager 1F1B does not fit", 0) + 1
        return out
    return [c, dataclasses.replace(c, plan=dataclasses.replace(c.plan, schedule="eager_1f1b"), memory=memory)]


def _candidate(c: ComposedCandidate, cluster: Cluster, simulator: Simulator | None,
               supports: Callable[[Plan], tuple[bool, str]] | None, opgraph: Any) -> Candidate:
    cand = Candidate(plan=c.plan, analytic_s=c.analytic_s, family="compose", peak_bytes=list(c.memory))
    if simulator is not None:
        plan = c.plan
        flops = (opgraph.fwd_flops + opgraph.bwd_flops) * plan.global_batch
        sim = simulator.compose(c.stages, list(plan.stage_edges), c.bytes_per_sample, plan.num_micro_batches,
                                plan.micro_batch, schedule=plan.schedule, tied=c.tied, memory=c.memory,
                                name=str(plan), flops=flops)
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
