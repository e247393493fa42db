"""Lowering: (OpGraph, Plan, ClusterView) -> TaskGraph of one training iteration.

Units of simulation
-------------------
A **worker** is one data-parallel replica of one pipeline stage: the tensor-parallel
group that runs it. Tensor ranks synchronise at every tensor-parallel collective, so a
worker advances at the pace of its slowest rank: each segment of kernels between two
collectives costs the maximum over the group's ranks (each rank with its own GPU kind
and share of the split dimensions), and each collective costs the alpha-beta time of
the group's ring (`plait.cost.collectives`). Pipeline *chunks* are consecutive runs of
layers; a chain pipeline with ``v`` virtual stages puts chunks ``p, p+pp, ...`` on
stage ``p`` (Megatron's interleaved layout); a plan with an explicit stage DAG
(GraphPipe) has one chunk per stage.

Symmetry: when every replica of every stage has the same GPU kinds, the same share of
the batch and equivalent links, replica 0's pipeline stands for all of them and only it
is simulated (its data-parallel collectives still run over every replica's links, and
a flow of replica 0 counts once per tensor rank on links the ranks share). Otherwise
every replica is simulated.

Tasks of one worker, in program order on its compute stream
-----------------------------------------------------------
* data loading and host-to-device copy of each micro-batch (first chunk only, prefetched
  on their own streams);
* per micro-batch and chunk: forward, [recompute forward], backward -- one task per
  chunk ("stage" granularity) or one per layer segment with every tensor-parallel
  collective as its own flow task ("layer" granularity). The order is the compute
  actions of the plan's schedule from `plait.schedule` (GPipe, 1F1B, interleaved 1F1B,
  graph 1F1B), the same action lists the runtime executes; tasks are named with the
  shared key ``"fwd s{stage} c{chunk} mb{micro_batch}"`` (chunk: local on the stage);
* pipeline sends: activations after a forward and gradients after a backward, to the
  replicas of the next chunk that need those samples. A transfer starts when the sender
  has produced the tensor and the receiver has reached its receive (rendezvous); with
  Megatron's blocking p2p (1F1B, GPipe) the sender also waits for it to complete;
* gradient synchronisation per bucket on the worker's communication stream: bucket
  ``i`` (layers in backward order, up to `bucket_bytes`) starts at
  ``max(comm_end_{i-1}, bwd_end_i)`` (Shi et al. 2018's WFBP); without buckets one
  reduction after the last backward (Megatron's default). All-reduce, or
  reduce-scatter under ZeRO (none under ZeRO-3);
* ZeRO-3 as plait's runtime runs it (`plait.runtime.zero3`, units from
  `plait.cost.traffic.zero3_units`): per micro-batch and layer, an all-gather of the layer's
  parameters before its forward and again before its backward and a reduce-scatter of its
  gradients right after its backward, each between two compute tasks (the training thread
  issues it from a module hook and waits for it: nothing is prefetched or overlapped);
  parameters two layers of the stage share (the tied embedding: the root unit) gathered once
  before the step's first forward and reduce-scattered after its last backward;
* tied-embedding gradient all-reduce between the first and last stage;
* a global barrier (gradient-norm all-reduce), the optimizer step, and under ZeRO-1/2
  the parameter all-gather.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from plait import schedule as schedules
from plait.cluster.spec import GPUKind
from plait.cost import traffic
from plait.cost.collectives import (
    GroupLinks,
    choose_algorithm,
    collective_time,
    latency_steps,
    ring_hops,
)
from plait.cost.compute import (
    DEFAULT_MODEL,
    Collective,
    ComputeModel,
    LayerCost,
    PassCost,
    Segment,
    layer_cost,
    layer_cost_key,
    optimizer_time,
)
from plait.errors import PlaitError
from plait.ir.opgraph import Layer, OpGraph
from plait.ir.plan import Plan, StageSpec
from plait.ir.stage_graph import StageGraph, stage_graph
from plait.net.view import ClusterView
from plait.schedule import Node, PipelineGraph, Schedule, ScheduleError, event_key
from plait.sim.engine import TaskGraph
from plait.sim.lowering.pipeline import PipelineDriver, compute_program


class LoweringError(PlaitError, ValueError):
    """A plan that cannot be lowered onto this model and cluster."""


@dataclass
class SimOptions:
    """Knobs of the lowering that are not part of the plan."""

    granularity: str = "auto"  # "layer" | "stage" | "auto"
    symmetry: bool = True  # simulate one representative of equivalent replicas
    # WFBP (Shi et al. 2018; DDP, Megatron --overlap-grad-reduce): each gradient bucket's
    # all-reduce starts when its layers' backward ends. False: the buckets (the plan's
    # grad_bucket_mb) are reduced back to back after the backward, as plait's runtime does.
    overlap_grad_reduce: bool = False
    compute: ComputeModel = DEFAULT_MODEL
    h2d_bandwidth: float = 24e9  # host-to-device copy (PCIe 4.0 x16, achievable)
    data_loader_s: float = 0.0  # data-loader time per micro-batch (overlapped by prefetch)
    max_layer_tasks: int = 60_000  # "auto" uses layer granularity below this many tasks
    cost_cache: dict | None = field(default=None, repr=False)  # share layer costs across runs (fitting)
    # Measured or hand-given per-layer (forward s, backward s) for one micro-batch on one rank of
    # the plan (e.g. `plait.measure.layer_profile`): these layers skip the compute model. Under tensor
    # parallelism the times are one tensor rank's compute; the layer's collectives still come from
    # the compute model's kernel sequence (where they fall, their bytes) priced on the group's links.
    layer_times: dict[str, tuple[float, float]] | None = None
    # Per GPU kind name: multiplier on `layer_times` for devices of that kind (its slowdown relative
    # to the device the times were measured on). None: the times are the fastest kind's in the
    # cluster and a kind takes peak_flops(fastest) / peak_flops(kind) longer at the plan's dtype.
    layer_time_scale: dict[str, float] | None = None
    # Legacy Megatron-LM's --scatter-gather-tensors-in-pipeline: without sequence parallelism each
    # tensor rank sends 1/tp of a pipeline boundary value (`traffic.pp_message_bytes`). False: the
    # whole value, as plait's engines (torch's pipelining over DTensor stages, plait's executor) send it.
    pp_scatter_gather: bool = False


@dataclass
class Chunk:
    cid: int
    stage: int  # device stage that runs it
    layers: list[Layer]


@dataclass
class Worker:
    wid: int
    stage: int
    replica: int
    devices: list[int]  # tensor-parallel group, rank order
    kinds: list[GPUKind]
    shares: list[float]
    chunks: list[int]
    units: list[tuple[int, int]] = field(default_factory=list)  # micro-batches: (first sample, size)
    links: GroupLinks | None = None

    @property
    def rep(self) -> int:
        return self.devices[0]


@dataclass
class Lowered:
    graph: TaskGraph
    workers: list[Worker]
    chunks: list[Chunk]
    symmetric: bool
    symmetry_note: str
    granularity: str
    world_size: int
    tp_comm_s: dict[int, float] = field(default_factory=dict)  # task id -> folded TP comm seconds


# ---------------------------------------------------------------- helpers


# ---------------------------------------------------------------- combined layer costs
@dataclass
class _Item:
    kind: str  # "c" compute segment | "tp" collective
    seconds: float
    op: str = ""
    nbytes: float = 0.0


@dataclass
class _Combined:
    fwd: list[_Item]
    bwd: list[_Item]
    rec: list[_Item]
    params: float
    grad_params: float
    flops_fwd: float
    flops_bwd: float

    @staticmethod
    def total(items: list[_Item]) -> tuple[float, float]:
        """(seconds, of which TP collective seconds)."""
        t = c = 0.0
        for it in items:
            t += it.seconds
            if it.kind == "tp":
                c += it.seconds
        return t, c


def _ring_of(links: GroupLinks | None) -> tuple[float, float] | None:
    """(ring bandwidth, ring latency) of a tensor-parallel group's links; None without a group."""
    return None if links is None else (links.ring_bandwidth, links.ring_latency)


def _combine(costs: list[PassCost], links: GroupLinks | None, pinned: str | None,
             host_comm_s: float = 0.0, rs_algorithm: str = "auto") -> list[_Item]:
    """Item-wise max over tensor ranks (they synchronise at each collective); `host_comm_s` is
    added to each collective (callers whose segments do not already hold it); `rs_algorithm`:
    the library's reduce-scatter (`ComputeModel.reduce_scatter_algorithm`) where none is pinned."""
    if not costs:
        return []
    out: list[_Item] = []
    for group in zip(*(c.items for c in costs)):
        head = group[0]
        if isinstance(head, Segment):
            out.append(_Item("c", max(g.time for g in group if isinstance(g, Segment))))
        else:
            assert isinstance(head, Collective)
            secs = 0.0
            if links is not None and links.n > 1:
                algo = choose_algorithm(head.op, head.nbytes, links, _pin(head.op, pinned, rs_algorithm))
                secs = collective_time(head.op, head.nbytes, links, algo) + host_comm_s
            out.append(_Item("tp", secs, head.op, head.nbytes))
    return out


def _pin(op: str, pinned: str | None, rs_algorithm: str) -> str | None:
    """The algorithm pinned for `op`: the plan's, else the library's reduce-scatter for one."""
    if pinned in (None, "auto") and op == "reduce_scatter" and rs_algorithm != "auto":
        return rs_algorithm
    return pinned


def _retime(items: list[_Item], compute_s: float) -> list[_Item]:
    """`items` with their compute segments rescaled to total `compute_s` (collectives kept)."""
    segs = [it for it in items if it.kind == "c"]
    if not segs:
        return [_Item("c", compute_s), *items]
    total = sum(it.seconds for it in segs)
    return [_Item("c", compute_s * (it.seconds / total if total > 0 else 1.0 / len(segs)))
            if it.kind == "c" else it for it in items]


# ---------------------------------------------------------------- the lowering
class _Lowerer(PipelineDriver):
    """The tensor-parallel emitter on the one pipeline driver (`plait.sim.lowering.pipeline`)."""

    def __init__(self, graph: OpGraph, plan: Plan, view: ClusterView, options: SimOptions) -> None:
        self.graph, self.plan, self.view, self.opt = graph, plan, view, options
        self.model = options.compute
        self.tg = TaskGraph()
        self.dtype = plan.dtype
        # Message sizes come from plait.cost.traffic (one truth with the planner and memory).
        self.grad_bytes = traffic.grad_elem_bytes(plan)
        self.cost_cache: dict[tuple, _Combined] = {} if options.cost_cache is None else options.cost_cache
        self.cache_salt = (id(graph), self.model, plan.dtype, plan.sequence_parallel, plan.recompute,
                           plan.collectives.get("tp"), tuple(sorted((options.layer_times or {}).items())),
                           tuple(sorted((options.layer_time_scale or {}).items())))
        self.chunk_cache: dict[tuple, list[tuple[Layer, _Combined]]] = {}
        self.shared_colls: dict[tuple, int] = {}
        self.ring_cache: dict[tuple, tuple[float, list[tuple[int, float, float]]]] = {}
        self._twin_cache: dict[tuple[int, int], dict[tuple, float]] = {}  # (src, dst) worker -> copies per resource
        self.tp_algo_cache: dict[tuple, tuple[str, float]] = {}
        # Flows of equal rings and times are equal: one list each (the engine only reads them).
        self.flow_cache: dict[tuple, list[tuple[int, float, float]]] = {}
        self.total_cache: dict[tuple, tuple] = {}
        self._pass_cache: dict[tuple, tuple] = {}  # (id(chunk costs), pass) -> (costs, items)
        self._items_key: dict[int, tuple] = {}  # id(items of _pass_items) -> its total_cache key
        # worker pair -> (latency, resources, latency + host time, link label, copies, flows by bytes)
        self.route_cache: dict[tuple[int, int], tuple] = {}
        self.tp_comm: dict[int, float] = {}
        self.layer_index = {layer.name: i for i, layer in enumerate(graph.layers)}
        self._zero3_last: dict[int, int] = {}  # worker -> its last ZeRO-3 collective of the step
        self._keys: dict[tuple, str] = {}  # (op, stage, chunk id, micro-batch) -> event name
        self._schedules: dict[tuple[int, ...], Schedule] = {}  # a chain's schedule per micro-batch sizes
        self._programs: dict[tuple, list[tuple[str, int, int]]] = {}  # read-only compute orders, shared
        self._labels: dict[tuple[int, str], str] = {}  # (device, stream) -> stream label

    # ------------------------------------------------------------ structure
    def build_structure(self) -> tuple[list[StageSpec], list[Chunk], list[tuple[int, int]]]:
        plan, graph = self.plan, self.graph
        if not graph.layer_names:
            raise LoweringError(f"model {graph.model!r} has no layers to simulate")
        # The one derivation of stages, chunks, replicas and edge tensors (plait.ir.stage_graph).
        try:
            self.sg: StageGraph = stage_graph(plan, graph)
        except PlaitError as exc:
            raise LoweringError(str(exc)) from None
        by_name = {layer.name: layer for layer in graph.layers}
        stages = plan.stage_specs(graph.layer_names, [layer.tp_style for layer in graph.layers])
        chunks = [Chunk(c.index, c.stage, [by_name[n] for n in c.layers]) for c in self.sg.chunks]
        edges = [(e.src, e.dst) for e in self.sg.edges]
        for spec in stages:
            bad = [d for d in spec.devices if not 0 <= d < self.view.num_devices]
            if bad:
                raise LoweringError(
                    f"plan stage {spec.name!r}: device ids {bad[:3]} are not in cluster "
                    f"{self.view.name!r} ({self.view.num_devices} devices)")
        return stages, chunks, edges

    def build_workers(self, stages: list[StageSpec], chunks: list[Chunk]) -> tuple[list[Worker], bool, str]:
        chunks_of: dict[int, list[int]] = defaultdict(list)
        for ch in chunks:
            chunks_of[ch.stage].append(ch.cid)
        all_workers: list[list[Worker]] = []
        for s, spec in enumerate(stages):
            replicas = self.sg.stages[s].replicas
            ratios = spec.tp_ratios or [1.0 / spec.tp] * spec.tp
            row = []
            for r in range(spec.dp):
                devs = list(spec.devices[r * spec.tp:(r + 1) * spec.tp])
                w = Worker(wid=-1, stage=s, replica=r, devices=devs, kinds=[self.view.kinds[d] for d in devs],
                           shares=list(ratios), chunks=list(chunks_of[s]),
                           units=[(m.first, m.size) for m in replicas[r].micro_batches])
                w.links = self.view.group(devs)
                row.append(w)
            all_workers.append(row)
        symmetric, note = self._check_symmetry(stages, all_workers)
        workers: list[Worker] = []
        for row in all_workers:
            for w in (row[:1] if symmetric else row):
                w.wid = len(workers)
                workers.append(w)
        self.all_workers = all_workers
        self.symmetric = symmetric
        return workers, symmetric, note

    def _check_symmetry(self, stages: list[StageSpec], rows: list[list[Worker]]) -> tuple[bool, str]:
        world = sum(len(s.devices) for s in stages)
        if not self.opt.symmetry:
            return False, f"symmetry off: simulating all {world} devices' workers"
        dps = {s.dp for s in stages}
        mbs = {s.micro_batch or self.plan.micro_batch for s in stages}
        reason = None
        if len(dps) != 1 or len(mbs) != 1:
            reason = "stages differ in data-parallel degree or micro-batch"
        for row in rows:
            if reason:
                break
            w0 = row[0]
            for w in row[1:]:
                if [k.name for k in w.kinds] != [k.name for k in w0.kinds]:
                    reason = f"stage {w.stage} replicas have different GPU kinds"
                elif [n for _, n in w.units] != [n for _, n in w0.units]:
                    reason = f"stage {w.stage} replicas have different shares of the batch"
                elif _ring_of(w.links) != _ring_of(w0.links):
                    reason = f"stage {w.stage} replicas' tensor-parallel links differ"
                if reason:
                    break
        if not reason:
            for a, b in zip(rows, rows[1:]):
                p0 = self.view.pair(a[0].rep, b[0].rep)
                if any(self.view.pair(x.rep, y.rep) != p0 for x, y in zip(a, b)):
                    reason = "pipeline links differ between replicas"
                    break
        dp = next(iter(dps))
        tp_max = max(s.tp for s in stages)
        if reason:
            return False, f"simulating every replica ({reason})"
        if dp == 1 and tp_max == 1:
            return True, "every device simulated (no replicas to collapse)"
        return True, (f"symmetric: simulated 1 of {dp} data-parallel replicas per stage and one "
                      f"representative per tensor-parallel group of {tp_max} (all equivalent: same GPU "
                      f"kinds, shares and links)")

    # ------------------------------------------------------------ costs
    def _worker_sig(self, w: Worker) -> tuple:
        sig = getattr(w, "_sig", None)
        if sig is None:
            sig = (tuple(k.name for k in w.kinds), tuple(round(s, 9) for s in w.shares),
                   (w.links.ring_bandwidth, w.links.ring_latency, w.links.n) if w.links else None)
            w._sig = sig  # type: ignore[attr-defined]
        return sig

    def chunk_costs(self, w: Worker, c: int, mb: int) -> list[tuple[Layer, _Combined]]:
        key = (self._worker_sig(w), c, mb)
        hit = self.chunk_cache.get(key)
        if hit is None:
            hit = self.chunk_cache[key] = [(layer, self.combined(w, layer, mb)) for layer in self.chunks[c].layers]
        return hit

    def _cost_sig(self, w: Worker, layer: Layer, mb: int, given: tuple[float, float] | None) -> str | tuple:
        """What `combined`'s cache keys a layer's cost on (`layer_cost_key`): a layer with a given
        time (`SimOptions.layer_times`) or a profiled one is priced by its name."""
        if given is not None:
            return layer.name
        return layer_cost_key(layer, self.model, [k.name for k in w.kinds], mb, len(w.devices))

    def combined(self, w: Worker, layer: Layer, mb: int) -> _Combined:
        given = (self.opt.layer_times or {}).get(layer.name)
        key = (self._cost_sig(w, layer, mb, given), self._worker_sig(w), mb, self.cache_salt)
        hit = self.cost_cache.get(key)
        if hit is not None:
            return hit
        tp = len(w.devices)
        if given is not None:
            out = self._given_cost(w, layer, mb, given)
            self.cost_cache[key] = out
            return out
        distinct: dict[tuple, LayerCost] = {}
        per_rank: list[LayerCost] = []
        for kind, share in zip(w.kinds, w.shares):
            k2 = (kind.name, round(share, 9))
            if k2 not in distinct:
                distinct[k2] = layer_cost(layer, self.graph, mb, kind, self.dtype, tp=tp,
                                          share=share if tp > 1 else None,
                                          sequence_parallel=self.plan.sequence_parallel, model=self.model)
            per_rank.append(distinct[k2])
        ranks = list(distinct.values())
        pinned = self.plan.collectives.get("tp")
        rs = self.model.reduce_scatter_algorithm
        rec_mode = self.plan.recompute
        out = _Combined(
            fwd=_combine([c.fwd for c in ranks], w.links, pinned, rs_algorithm=rs),
            bwd=_combine([c.bwd for c in ranks], w.links, pinned, rs_algorithm=rs),
            rec=_combine([c.recompute(rec_mode) for c in ranks], w.links, pinned, rs_algorithm=rs)
            if rec_mode != "none" else [],
            params=per_rank[0].params,
            grad_params=per_rank[0].grad_params,
            flops_fwd=max(c.fwd.flops for c in ranks),
            flops_bwd=max(c.bwd.flops for c in ranks),
        )
        self.cost_cache[key] = out
        return out

    def _time_scale(self, kind: GPUKind) -> float:
        """Multiplier on given layer times for a device of `kind` (`SimOptions.layer_time_scale`)."""
        scales = self.opt.layer_time_scale
        if scales is not None:
            return float(scales.get(kind.name, 1.0))
        fastest = getattr(self, "_fastest_flops", None)
        if fastest is None:
            fastest = self._fastest_flops = max(k.flops(self.dtype) for k in self.view.kinds)
        own = kind.flops(self.dtype)
        return fastest / own if own > 0 else 1.0

    def _given_cost(self, w: Worker, layer: Layer, mb: int, given: tuple[float, float]) -> _Combined:
        """A layer with given (measured) times: the worker's slowest rank's kind scales them; under
        tensor parallelism the layer's collectives (Megatron's kernel sequence, `layer_cost`) are
        kept at their places and the given compute is spread over the segments between them in
        proportion to the compute model's segment times."""
        tp = len(w.devices)
        scale = max(self._time_scale(k) for k in w.kinds)
        fwd_s, bwd_s = given[0] * scale, given[1] * scale
        split = layer.tp_style == "transformer" or (layer.tp_style in ("head", "embedding") and self.model.vocab_parallel)
        params = layer.param_count / (tp if split else 1)
        full = self.plan.recompute == "full"
        if tp > 1 and w.links is not None and w.links.n > 1:
            try:
                cost = layer_cost(layer, self.graph, mb, w.kinds[0], self.dtype, tp=tp, share=w.shares[0],
                                  sequence_parallel=self.plan.sequence_parallel, model=self.model)
            except PlaitError:
                cost = None
            if cost is not None and (cost.fwd.collectives or cost.bwd.collectives):
                # The measured compute holds no collective call: each pays its host cost serially,
                # as data-parallel collectives do (`_new_collective`).
                pinned, host = self.plan.collectives.get("tp"), self.model.host_comm_s
                rs = self.model.reduce_scatter_algorithm
                fwd = _retime(_combine([cost.fwd], w.links, pinned, host, rs), fwd_s)
                return _Combined(fwd, _retime(_combine([cost.bwd], w.links, pinned, host, rs), bwd_s),
                                 list(fwd) if full else [], params, params, layer.fwd_flops * mb,
                                 layer.bwd_flops * mb)
        return _Combined([_Item("c", fwd_s)], [_Item("c", bwd_s)], [_Item("c", fwd_s)] if full else [],
                         params, params, layer.fwd_flops * mb, layer.bwd_flops * mb)

    # ------------------------------------------------------------ task emission
    def lower(self) -> Lowered:
        stages, chunks, edges = self.build_structure()
        self.chunks = chunks
        workers, symmetric, note = self.build_workers(stages, chunks)
        self.workers = workers
        plan, opt = self.plan, self.opt
        world = plan.world_size if not plan.stages else len({d for s in stages for d in s.devices})
        granularity = opt.granularity
        if granularity == "auto":
            # Tasks per layer and micro-batch at layer granularity: a pass is one task, or three
            # segments and two collectives under tensor parallelism; forward, backward, recompute.
            passes = 3 if plan.recompute != "none" else 2
            est = 0
            for w in workers:
                per_pass = 5 if len(w.devices) > 1 else 1
                est += len(w.units) * sum(len(chunks[c].layers) for c in w.chunks) * per_pass * passes
            granularity = "layer" if est <= opt.max_layer_tasks else "stage"
        if granularity not in ("layer", "stage"):
            raise LoweringError(f"granularity: must be 'layer', 'stage' or 'auto', got {granularity!r}")
        self.granularity = granularity
        self.programs = {w.wid: self._program(w, stages) for w in workers}
        # a chain's chunk k is chunk k // pp of its rank; a graph stage's chunks are its segments
        self.local_chunk = {c.cid: c.cid // plan.pp for c in chunks} if not plan.stages else \
            {cid: k for row in self.all_workers for w in row[:1] for k, cid in enumerate(w.chunks)}
        self.layer_bwd_end: dict[int, dict[str, int]] = {}
        self.pred_chunks = defaultdict(list)
        self.succ_chunks = defaultdict(list)
        for a, b in edges:
            self.succ_chunks[a].append(b)
            self.pred_chunks[b].append(a)
        # Megatron's p2p: a transfer meets its receiver at the receive, and blocks the sender
        # under 1F1B and GPipe; a graph stage that runs per input posts its receives at once
        self.rendezvous = True
        self.blocking = not plan.stages and plan.schedule in ("1f1b", "gpipe") and plan.virtual_stages == 1
        self.per_input = bool(plan.stages)
        self.edge_bytes = {(e.src, e.dst): e.bytes_per_sample for e in self.sg.edges}
        self.act_scale = traffic.activation_scale(self.graph, plan)
        self.drive(workers, edges)
        return Lowered(self.tg, workers, chunks, symmetric, note, granularity, world, self.tp_comm)

    def _program(self, w: Worker, stages: list[StageSpec]) -> list[tuple[str, int, int]]:
        """The worker's compute order, read from `plait.schedule` (schedules as data):
        [("F" | "B", chunk id, micro-batch)]."""
        schedule = self._schedule(w)
        if self.plan.stages:
            # A graph stage's schedule runs over all its replicas' micro-batches in sample order
            # (`_schedule`; the stage graph deals them to the replicas in turn); this replica runs
            # its own, in that order.
            mine = {i: k for i, (r, k) in enumerate(self._stage_units(w.stage)) if r == w.replica}
            return compute_program(schedule.compute(w.stage), w.chunks, mine)
        key = (id(schedule), w.stage, tuple(w.chunks))  # the replicas of a stage with equal sizes: one list
        hit = self._programs.get(key)
        if hit is None:
            hit = self._programs[key] = compute_program(schedule.compute(w.stage), w.chunks)
        return hit

    def _stage_units(self, stage: int) -> list[tuple[int, int]]:
        """(replica, its micro-batch) of every micro-batch of a stage, in sample order."""
        row = self.all_workers[stage]
        return sorted(((r, k) for r, x in enumerate(row) for k in range(len(x.units))),
                      key=lambda rk: row[rk[0]].units[rk[1]][0])

    def _schedule(self, w: Worker) -> Schedule:
        plan = self.plan
        sizes = tuple(n for _, n in w.units)
        try:
            if plan.stages:
                # Graph pipeline: one node per stage running every replica's micro-batches in sample
                # order (dealt to the replicas in turn), so stages of different data-parallel
                # degrees or micro-batch sizes meet on sample ranges; each replica keeps the order of
                # its own (`_program`): a restriction of one deadlock-free order stays deadlock-free.
                node_sizes = [tuple(row[r].units[k][1] for r, k in self._stage_units(s))
                              for s, row in enumerate(self.all_workers)]
                if len(self.sg.chunks) == len(node_sizes):
                    graph = PipelineGraph.dag(node_sizes, self.plan.stage_graph_edges(),
                                              [len(row) for row in self.all_workers])
                else:  # stages that run per input: a node per segment (chunk ids are stage-major)
                    local = [sum(1 for d in self.sg.chunks[:c.index] if d.stage == c.stage) for c in self.sg.chunks]
                    graph = PipelineGraph(
                        tuple(Node(c.stage, local[c.index], node_sizes[c.stage], len(self.all_workers[c.stage]))
                              for c in self.sg.chunks), tuple((e.src, e.dst) for e in self.sg.edges))
                return schedules.build("gpipe" if plan.schedule == "gpipe" else "graph_1f1b", graph)
            # a chain's schedule depends on the replica's micro-batch sizes alone (schedules are
            # frozen data): built once per replica, not once per stage of it
            hit = self._schedules.get(sizes)
            if hit is None:
                v = plan.virtual_stages if plan.schedule == "interleaved" else 1
                graph = PipelineGraph(tuple(Node(k % plan.pp, k // plan.pp, sizes) for k in range(plan.pp * v)),
                                      tuple((k, k + 1) for k in range(plan.pp * v - 1)))
                hit = self._schedules[sizes] = schedules.build(plan.schedule, graph)
            return hit
        except ScheduleError as exc:
            raise LoweringError(f"replica {w.replica} of stage {w.stage}: {exc}") from None

    def _key(self, op: str, w: Worker, c: int, i: int) -> str:
        """The shared event name (`plait.schedule.event_key`) of chunk id `c` on worker `w` (a
        stage's replicas share their names: each is formatted once)."""
        k = (op, w.stage, c, i)
        name = self._keys.get(k)
        if name is None:
            name = self._keys[k] = event_key(op, w.stage, self.local_chunk[c], i)
        return name

    def _label(self, w: Worker, stream: str) -> str:
        key = (w.devices[0], stream)
        label = self._labels.get(key)
        if label is None:
            label = self._labels[key] = f"dev{w.rep}/{stream}"
        return label

    def _pass_total(self, items_per_layer: list[tuple[Layer, list[_Item]]]) -> tuple[float, float]:
        """(seconds, of which tensor-parallel collective seconds) of a pass run as one task."""
        key = self._items_key.get(id(items_per_layer))
        if key is None:  # not a list of `_pass_items`: key it by its cached per-layer lists
            key = tuple(id(items) for _, items in items_per_layer)
        hit = self.total_cache.get(key)
        if hit is None:
            total = comm = 0.0
            for _layer, items in items_per_layer:
                t, c = _Combined.total(items)
                total += t
                comm += c
            hit = self.total_cache[key] = (total, comm, items_per_layer)  # keep the lists alive
        return hit[0], hit[1]

    def _emit_items(self, w: Worker, items_per_layer: list[tuple[Layer, list[_Item]]], name: str,
                    category: str, mb: int, deps: list[int], per_layer: bool,
                    record_layers: dict[str, int] | None = None, chunk: int | None = None) -> tuple[int, int]:
        """Emit a pass; returns (first task, last task)."""
        tg = self.tg
        label = self._label(w, "compute")
        if not per_layer:
            total, comm = self._pass_total(items_per_layer)
            tid = tg.add(name, category, label, total, deps, device=w.devices[0], stage=w.stage, micro_batch=mb,
                         args={"tp_comm_s": comm} if comm else None, chunk=chunk)
            if comm:
                self.tp_comm[tid] = comm
            if record_layers is not None:
                for layer, _ in items_per_layer:
                    record_layers[layer.name] = tid
            return tid, tid
        first = last = -1
        prev = list(deps)
        links = w.links
        for layer, items in items_per_layer:
            acc = 0.0
            for it in items:
                if it.kind == "c":
                    acc += it.seconds
                    continue
                if acc > 0 or last < 0:
                    tid = tg.add(f"{name} {layer.name}", category, label, acc, prev, device=w.rep,
                                 stage=w.stage, micro_batch=mb, chunk=chunk)
                    first = tid if first < 0 else first
                    prev, last, acc = [tid], tid, 0.0
                tid = self._tp_flow(w, it, links, prev, f"{it.op} tp {layer.name}", mb)
                first = tid if first < 0 else first
                prev, last = [tid], tid
            if acc > 0 or last < 0:
                tid = tg.add(f"{name} {layer.name}", category, label, acc, prev, device=w.rep,
                             stage=w.stage, micro_batch=mb, chunk=chunk)
                first = tid if first < 0 else first
                prev, last = [tid], tid
            if record_layers is not None:
                record_layers[layer.name] = last
        return first, last

    def _tp_flow(self, w: Worker, it: _Item, links: GroupLinks | None, deps: list[int], name: str, mb: int) -> int:
        """A tensor-parallel collective as a flow over the group's ring (layer granularity)."""
        n = len(w.devices)
        ck = (it.op, it.nbytes, links)
        hit = self.tp_algo_cache.get(ck)
        if hit is None:
            pin = _pin(it.op, self.plan.collectives.get("tp"), self.model.reduce_scatter_algorithm)
            algo = choose_algorithm(it.op, it.nbytes, links, pin) if links else "ring"
            hit = self.tp_algo_cache[ck] = (algo, latency_steps(it.op, n, algo) * (links.ring_latency if links else 0.0))
        algo, lat = hit
        flow = self._ring_flow(w.devices, max(0.0, it.seconds - lat), None)
        tid = self.tg.add(name, "comm_tp", self._label(w, "compute"), lat, deps, flow=flow, device=w.rep,
                          stage=w.stage, micro_batch=mb,
                          args={"bytes": traffic.whole_bytes(it.nbytes), "algorithm": algo, "cls": "tp",
                                "op": it.op, "ranks": n, "copies": self._replicas_of(w)})
        return tid

    def _ring_flow(self, devices: list[int], bandwidth_seconds: float,
                   twins: list[list[int]] | None) -> list[tuple[int, float, float]] | None:
        """Flow over the ring through `devices` whose uncontended bandwidth phase takes `bandwidth_seconds`.

        Each hop carries ``bandwidth_seconds * B_slowest`` bytes, so alone the flow ends
        exactly at the alpha-beta time; `twins` are the rings of the other tensor ranks it
        stands for (they count as copies on resources they share)."""
        if len(devices) < 2 or bandwidth_seconds <= 0:
            return None
        key = (tuple(devices), tuple(tuple(r) for r in twins) if twins else None)
        flow = self.flow_cache.get((key, bandwidth_seconds))
        if flow is not None:
            return flow
        shape = self.ring_cache.get(key)
        if shape is None:
            shape = self.ring_cache[key] = self._ring_shape(devices, twins)
        slowest, parts = shape
        nbytes = bandwidth_seconds * slowest
        flow = self.flow_cache[(key, bandwidth_seconds)] = [(r, nbytes * hops, copies) for r, hops, copies in parts]
        return flow

    def _ring_shape(self, devices: list[int], twins: list[list[int]] | None
                    ) -> tuple[float, list[tuple[int, float, float]]]:
        """(slowest hop bandwidth, [(resource, load as a multiple of the flow's bytes, copies)]) of
        a ring (`ClusterView.ring_loads`: NCCL's rails between nodes)."""
        slowest, hops = self.view.ring_loads(devices)
        if self.view.fabric is not None:
            others = [self.view.ring_loads(r)[1] for r in twins or [] if r != devices]
            return slowest, self._fabric_ring_shape([hops] + others)
        copies: dict[tuple, float] = defaultdict(float)
        for ring in (twins or []):
            for a, b, share in ring_hops(ring, self.view.node_of, self.view.node_nics):
                for k, _cap in self.view.path(a, b):
                    copies[k] += share
        count: dict[int, list] = {}
        for a, b, load in hops:
            for k, cap in self.view.path(a, b):
                r = self.tg.add_resource(k, cap)
                if r in count:
                    count[r][1] += load
                else:
                    count[r] = [r, load, float(max(1, round(copies.get(k, 1))))]
        return slowest, [tuple(v) for v in count.values()]

    def _fabric_ring_shape(self, rings: list[list[tuple[int, int, float]]]) -> list[tuple[int, float, float]]:
        """On a switched fabric the rings of a collective hash differently, so the one flow
        standing for them all carries every ring's bytes on every link it crosses (plait.net):
        it runs at the pace of the busiest link of any ring."""
        load: dict[int, float] = defaultdict(float)
        for hops in rings:
            for a, b, x in hops:
                for k, cap, share in self.view.route(a, b):
                    load[self.tg.add_resource(k, cap)] += share * x
        return [(r, x, 1.0) for r, x in load.items()]

    def _pass_items(self, costs: list[tuple[Layer, _Combined]], which: str) -> list[tuple[Layer, list[_Item]]]:
        """[(layer, items of pass `which`)] of a chunk's cached costs (backward: last layer first),
        built once per cost list with its `total_cache` key (the ids of the per-layer lists, as
        `_emit_items` would key it): every micro-batch of every worker asks for the same few."""
        ck = (id(costs), which)
        hit = self._pass_cache.get(ck)
        if hit is None:
            order = reversed(costs) if which == "bwd" else costs
            items = [(lay, getattr(cc, which)) for lay, cc in order]
            self._pass_cache[ck] = hit = (costs, items)  # holds `costs` so its id stays unique
            self._items_key[id(items)] = tuple(id(it) for _, it in items)
        return hit[1]

    def emit_worker(self, w: Worker) -> None:
        plan = self.plan
        program = self.programs[w.wid]
        per_layer = self.granularity == "layer"
        wfbp = self.opt.overlap_grad_reduce
        zero3 = self._zero3_units(w)
        firsts, lasts = [], []
        last_b_item: dict[int, int] = {}
        for idx, (k, c, _i) in enumerate(program):
            if k == "B":
                last_b_item[c] = idx
        self.layer_bwd_end[w.wid] = {}
        prev: list[int] = []
        if zero3 is not None and zero3.root > 0:  # the root unit, once per step (Zero3Step.begin_step)
            prev = [self._zero3_collective(w, "all_gather", zero3.root, "root", None, [], ("z3root-ag", w.stage))]
        mine: dict[tuple[int, int], tuple] = {}  # this worker's chunk costs and their passes
        tg, label, dev = self.tg, self._label(w, "compute"), w.devices[0]

        def whole_pass(items: list, op: str, category: str, c: int, i: int, deps: list[int]) -> int:
            """`_emit_items` of a whole pass as one task (forward, recompute), without its per-layer
            machinery: its tensor-parallel seconds kept apart for the exposed communication."""
            total, comm = self._pass_total(items)
            tid = tg.add(self._key(op, w, c, i), category, label, total, deps, device=dev, stage=w.stage,
                         micro_batch=i, args={"tp_comm_s": comm} if comm else None, chunk=self.local_chunk[c])
            if comm:
                self.tp_comm[tid] = comm
            return tid

        for idx, (k, c, i) in enumerate(program):
            mb_size = w.units[i][1]
            hit = mine.get((c, mb_size))
            if hit is None:
                costs = self.chunk_costs(w, c, mb_size)
                rec = plan.recompute != "none" and any(cc.rec for _, cc in costs)
                hit = mine[(c, mb_size)] = (costs, self._pass_items(costs, "fwd"), self._pass_items(costs, "bwd"),
                                            self._pass_items(costs, "rec") if rec else None)
            costs, fwd_items, bwd_items, rec_items = hit
            deps = prev
            if zero3 is not None:
                first, last = self._emit_zero3_item(w, zero3, k, c, i, costs, prev,
                                                    self.layer_bwd_end[w.wid] if idx == last_b_item.get(c) else None)
            elif k == "F" and not per_layer:  # the commonest task
                first = last = whole_pass(fwd_items, "fwd", "forward", c, i, deps)
            elif k == "F":
                first, last = self._emit_items(w, fwd_items, self._key("fwd", w, c, i),
                                               "forward", i, deps, per_layer, chunk=self.local_chunk[c])
            else:
                first = -1
                if rec_items is not None and not per_layer:
                    first = rlast = whole_pass(rec_items, "recompute", "recompute", c, i, deps)
                    deps = [rlast]
                elif rec_items is not None:
                    first, rlast = self._emit_items(w, rec_items, self._key("recompute", w, c, i), "recompute", i,
                                                    deps, per_layer, chunk=self.local_chunk[c])
                    deps = [rlast]
                fine = per_layer or (wfbp and idx == last_b_item.get(c))
                record = self.layer_bwd_end[w.wid] if idx == last_b_item.get(c) else None
                bfirst, last = self._emit_items(w, bwd_items, self._key("bwd", w, c, i), "backward", i, deps,
                                                fine, record, chunk=self.local_chunk[c])
                first = bfirst if first < 0 else first
            firsts.append(first)
            lasts.append(last)
            prev = [last]
        if zero3 is not None:
            last = lasts[-1] if lasts else (prev[0] if prev else -1)
            if zero3.root > 0:  # Zero3Step.step: the root's gradients after the last backward
                last = self._zero3_collective(w, "reduce_scatter", zero3.root, "root", None,
                                              [last] if last >= 0 else [], ("z3root-rs", w.stage))
            self._zero3_last[w.wid] = last
        self.item_first[w.wid] = firsts
        self.item_last[w.wid] = lasts

    # ------------------------------------------------------------ ZeRO-3
    def _dp_group(self, w: Worker) -> tuple[list[int], list[list[int]]]:
        """Devices of w's data-parallel ring (tensor rank 0 of each replica) and the other ranks' rings."""
        row = self.all_workers[w.stage]
        ring = [x.devices[0] for x in row]
        twins = [[x.devices[t] for x in row] for t in range(len(w.devices))]
        return ring, twins

    def _collective_task(self, name: str, category: str, op: str, nbytes: int, ring: list[int],
                         twins: list[list[int]], deps: list[int], w: Worker, pinned_class: str,
                         mb: int | None = None, share: tuple | None = None, cls: str | None = None,
                         copies: int | None = None) -> int:
        """One collective over `ring`; with `share`, the replicas simulated separately reuse one task."""
        if share is not None:
            hit = self.shared_colls.get(share)
            if hit is not None:
                for d in deps:
                    if d is not None and d >= 0:
                        self.tg.add_dep(d, hit)
                return hit
        tid = self._new_collective(name, category, op, nbytes, ring, twins, deps, w, pinned_class, mb, cls,
                                   len(twins) if copies is None else copies)
        if share is not None:
            self.shared_colls[share] = tid
        return tid

    def _new_collective(self, name: str, category: str, op: str, nbytes: int, ring: list[int],
                        twins: list[list[int]], deps: list[int], w: Worker, pinned_class: str,
                        mb: int | None = None, cls: str | None = None, copies: int = 1) -> int:
        links = self.view.group(ring)
        algo = choose_algorithm(op, nbytes, links, _pin(op, self.plan.collectives.get(pinned_class),
                                                        self.model.reduce_scatter_algorithm))
        total = collective_time(op, nbytes, links, algo)
        lat = latency_steps(op, links.n, algo) * links.ring_latency
        if algo in ("hierarchical", "measured"):
            lat = min(lat, total)
        flow = self._ring_flow(ring, max(0.0, total - lat), twins)
        return self.tg.add(name, category, self._label(w, "comm"), lat + self.model.host_comm_s, deps,
                           flow=flow, device=w.rep, stage=w.stage, micro_batch=mb,
                           args={"bytes": nbytes, "algorithm": algo, "ranks": links.n, "op": op,
                                 "cls": cls or pinned_class, "copies": copies})

    def _zero3_units(self, w: Worker) -> traffic.Zero3Units | None:
        """ZeRO-3's units of w's stage (`plait.cost.traffic.zero3_units`, the runtime's), or None
        when the plan does not shard parameters over replicas of this stage."""
        if self.plan.zero != 3 or len(self.all_workers[w.stage]) < 2 or not w.links:
            return None
        mb = w.units[0][1] if w.units else 1
        layers = [layer for c in w.chunks for layer in self.chunks[c].layers]
        return traffic.zero3_units(layers, [self.combined(w, layer, mb).params for layer in layers],
                                   self.graph.tied, len(w.devices))

    def _zero3_collective(self, w: Worker, op: str, params: float, unit: str, mb: int | None,
                          deps: list[int], share: tuple) -> int:
        """One ZeRO-3 collective of a unit's parameters (all-gather) or gradients (reduce-scatter)
        over w's data-parallel group: the runtime issues it from the training thread and waits
        for it (`plait.runtime.zero3`), so it sits on the path between two compute tasks."""
        ring, twins = self._dp_group(w)
        if op == "all_gather":
            name, nbytes = "allgather params", traffic.param_gather_bytes(params, self.plan)
        else:
            name, nbytes = "reducescatter grads", traffic.grad_scatter_bytes(params, self.plan)
        label = f"{name} {unit}" if mb is None else f"{name} {unit} mb{mb}"
        return self._collective_task(label, "comm_zero", op, nbytes, ring, twins, deps, w, "zero", mb, share=share)

    def _emit_zero3_item(self, w: Worker, z: traffic.Zero3Units, k: str, c: int, i: int,
                         costs: list[tuple[Layer, _Combined]], deps: list[int],
                         record: dict[str, int] | None) -> tuple[int, int]:
        """One forward or backward item of a ZeRO-3 worker, layer by layer as the runtime's hooks
        run it: forward -- all-gather the layer's unit, its forward; backward -- all-gather,
        [recompute,] backward, reduce-scatter its gradients. Nothing is prefetched: each collective
        waits for the compute before it and the compute after it waits for the collective."""
        own = dict(z.layers)
        chunk = self.local_chunk[c]
        which = "fwd" if k == "F" else "bwd"
        first, prev = -1, list(deps)
        recs = {layer.name: items for layer, items in self._pass_items(costs, "rec")} \
            if k == "B" and self.plan.recompute != "none" else {}
        for layer, items in self._pass_items(costs, which):
            params = own.get(layer.name, 0.0)
            if params > 0:
                ag = self._zero3_collective(w, "all_gather", params, layer.name, i, prev,
                                            ("z3ag", w.stage, c, i, k, layer.name))
                first = ag if first < 0 else first
                prev = [ag]
            if recs.get(layer.name):
                _, rlast = self._emit_items(w, [(layer, recs[layer.name])], self._key("recompute", w, c, i), "recompute",
                                            i, prev, True, chunk=chunk)
                prev = [rlast]
            f, last = self._emit_items(w, [(layer, items)], self._key(which, w, c, i),
                                       "forward" if k == "F" else "backward", i, prev, True,
                                       record if k == "B" else None, chunk=chunk)
            first = f if first < 0 else first
            prev = [last]
            if k == "B" and params > 0:
                prev = [self._zero3_collective(w, "reduce_scatter", params, layer.name, i, prev,
                                               ("z3rs", w.stage, c, i, layer.name))]
        return first, prev[0]

    # ------------------------------------------------------------ pipeline transfers
    def message_bytes(self, edge: tuple[int, int], samples: int, src: Worker) -> float:
        """What crosses chunk `edge` for `samples` samples: the stage graph's boundary tensors
        (`plait.ir.stage_graph`) in the plan's dtype, one tensor rank's share."""
        return traffic.pp_message_bytes(self.edge_bytes[edge], samples, self.act_scale, len(src.devices),
                                        traffic.pp_split(self.plan, self.opt.pp_scatter_gather))

    def send(self, src: Worker, dst: Worker, c_src: int, c_dst: int, u_src: int, u_dst: int, nbytes: float,
             deps: list[int], forward: bool) -> int:
        """One flow from src's representative to dst's over their route, counting the other tensor
        ranks' twin transfers and the replicas it stands for as copies."""
        # the pair's latency and resources (index, share of the bytes, tensor-rank copies), once
        # per worker pair: a 1024-GPU pipeline sends tens of thousands of transfers over them
        route = self.route_cache.get((src.wid, dst.wid))
        if route is None:
            _bw, lat = self.view.pair(src.rep, dst.rep)
            res = [] if src.rep == dst.rep else [
                (self.tg.add_resource(key, cap), share, float(max(1, self._twin_copies(src, dst, key))))
                for key, cap, share in self.view.route(src.rep, dst.rep)]
            route = self.route_cache[(src.wid, dst.wid)] = (
                lat, res, lat + self.model.p2p_host_s, f"link {src.rep}->{dst.rep}",
                len(src.devices) * self._replicas_of(src), {})
        _lat, res, delay, label, copies, flows = route
        flow = None
        if nbytes > 0 and res:  # equal transfers over one pair have equal flows: one list (read only)
            flow = flows.get(nbytes)
            if flow is None:
                flow = flows[nbytes] = [(r, nbytes * share, c) for r, share, c in res]
        s_rep, keys = src.devices[0], self._keys  # `_key`, inlined for the hits: 10^5 transfers
        send = keys.get(("send_fwd" if forward else "send_bwd", src.stage, c_src, u_src)) \
            or self._key("send_fwd" if forward else "send_bwd", src, c_src, u_src)
        peer = keys.get(("recv_fwd" if forward else "recv_bwd", dst.stage, c_dst, u_dst)) \
            or self._key("recv_fwd" if forward else "recv_bwd", dst, c_dst, u_dst)
        return self.tg.add(send, "comm_pp", label, delay, deps, flow=flow, device=s_rep, stage=src.stage,
                           micro_batch=u_src,
                           args={"bytes": nbytes, "src": s_rep, "dst": dst.devices[0], "cls": "pp",
                                 "op": "send_recv", "ranks": 2, "copies": copies, "peer": peer},
                           chunk=self.local_chunk[c_src])

    def _replicas_of(self, w: Worker) -> int:
        """Replicas a simulated worker stands for (all of its stage's under symmetry, else itself)."""
        return len(self.all_workers[w.stage]) if self.symmetric else 1

    def _twin_copies(self, src: Worker, dst: Worker, key: tuple) -> float:
        """How many tensor ranks' transfers (src rank t -> dst rank t) cross resource `key`."""
        cache = self._twin_cache
        ck = (src.wid, dst.wid)
        if ck not in cache:
            counts: dict[tuple, float] = defaultdict(float)
            for a, b in zip(src.devices, dst.devices):
                for kk, _, share in self.view.route(a, b):
                    counts[kk] += share
            cache[ck] = counts
        return cache[ck].get(key, 1)

    # ------------------------------------------------------------ data loading
    def emit_data(self, workers: list[Worker]) -> None:
        sources = {c.cid for c in self.chunks if not self.pred_chunks[c.cid]}
        in_bytes = self.graph.layers[0].input_bytes if self.graph.layers else 0.0
        for w in workers:
            prev_data = -1
            for idx, (k, c, i) in enumerate(self.programs[w.wid]):
                if k != "F" or c not in sources:
                    continue
                size = w.units[i][1]
                d = self.tg.add(f"data mb{i}", "data", self._label(w, "data"), self.opt.data_loader_s,
                                [prev_data] if prev_data >= 0 else [], device=w.rep, stage=w.stage, micro_batch=i)
                prev_data = d
                nbytes = in_bytes * size
                h = self.tg.add(f"h2d mb{i}", "h2d", self._label(w, "h2d"),
                                nbytes / self.opt.h2d_bandwidth if nbytes else 0.0, [d], device=w.rep,
                                stage=w.stage, micro_batch=i, args={"bytes": nbytes})
                self.tg.add_dep(h, self.item_first[w.wid][idx])

    # ------------------------------------------------------------ gradients and step
    def _worker_params(self, w: Worker) -> tuple[float, list[tuple[Layer, float]]]:
        """(parameters per tensor rank, [(layer, gradient params)] in backward order)."""
        mb = w.units[0][1] if w.units else 1
        layers = [layer for c in w.chunks for layer in self.chunks[c].layers]
        has_embedding = any(layer.tp_style == "embedding" for layer in layers)
        grads = [(layer, traffic.layer_grad_params(layer, self.combined(w, layer, mb), has_embedding))
                 for layer in layers]
        total = float(sum(p for _, p in grads))
        grads.sort(key=lambda lg: -self.layer_index.get(lg[0].name, 0))
        return total, grads

    def _emit_grad_sync(self, workers: list[Worker]) -> dict[int, int]:
        """Per worker: the task after which its gradients are final (reduced)."""
        plan = self.plan
        ends: dict[int, int] = {}
        self.worker_params: dict[int, float] = {}
        for w in workers:
            total, grads = self._worker_params(w)
            self.worker_params[w.wid] = total
            last = self.item_last[w.wid][-1] if self.item_last[w.wid] else -1
            if self._zero3_last.get(w.wid) is not None:
                last = self._zero3_last[w.wid]
            row = self.all_workers[w.stage]
            if len(row) < 2 or plan.zero == 3:
                ends[w.wid] = last
                continue
            op = traffic.dp_grad_op(plan)
            assert op is not None  # ZeRO-3 (no gradient collective) went on above
            buckets = self._grad_buckets(total, grads)
            ring, twins = self._dp_group(w)
            prev = -1
            for bi, (params, lname) in enumerate(buckets):
                ready = self.layer_bwd_end[w.wid].get(lname, last) if (lname and self.opt.overlap_grad_reduce) else last
                deps = [ready] + ([prev] if prev >= 0 else [])
                # When every replica is simulated they all join the same collective task.
                tid = self._collective_task(f"{op.replace('_', '')} dp bucket{bi}", "comm_dp", op,
                                            traffic.dp_grad_bytes(params, plan), ring, twins, deps, w, "dp",
                                            share=("dp", w.stage, bi))
                prev = tid
            ends[w.wid] = prev
        # Tied embeddings on different stages: all-reduce the two copies' gradients.
        tied = self._tied_pairs(workers)
        for we, wh, nbytes in tied:
            twins = [[a, b] for a, b in zip(we.devices, wh.devices)]
            tid = self._collective_task("allreduce tied embedding", "comm_dp", "all_reduce", nbytes,
                                        [we.rep, wh.rep], twins, [ends[we.wid], ends[wh.wid]], we, "dp",
                                        cls="tied", copies=len(twins) * self._replicas_of(we))
            ends[we.wid] = tid
            ends[wh.wid] = tid
        return ends

    def _grad_buckets(self, total: float, grads: list) -> list[tuple[float, str]]:
        """(parameters, last layer) of each data-parallel gradient bucket, in backward order: the
        plan's `grad_bucket_mb` cut as the runtime cuts it (a bucket closes once it holds at
        least that many bytes; 0: one bucket). Without overlap the last layer is not used: every
        bucket waits for the end of the backward."""
        size = self.plan.grad_bucket_bytes
        if not size:
            return [(total, "")]
        buckets: list[tuple[float, str]] = []
        acc, lastname = 0.0, ""
        for layer, p in grads:
            acc += p * self.grad_bytes
            lastname = layer.name
            if acc >= size:
                buckets.append((acc / self.grad_bytes, lastname))
                acc = 0.0
        if acc > 0:
            buckets.append((acc / self.grad_bytes, lastname))
        return buckets or [(total, "")]

    def _tied_pairs(self, workers: list[Worker]) -> list[tuple[Worker, Worker, int]]:
        """(owner's worker, user's worker, bytes) for parameters two stages of one replica share
        (`OpGraph.tied`): their gradients are all-reduced between the copies every step."""
        def holding(layer: str) -> list[Worker]:
            return [w for w in workers if any(x.name == layer for c in w.chunks for x in self.chunks[c].layers)]

        out = []
        for t in self.graph.tied:
            for wo in holding(t.owner):
                for wu in holding(t.user):
                    if wo.wid != wu.wid and wo.replica == wu.replica:
                        out.append((wo, wu, traffic.tied_grad_bytes(t, len(wo.devices), self.plan)))
        return out

    def finish(self, workers: list[Worker]) -> None:
        self._emit_step(workers, self._emit_grad_sync(workers))

    def _emit_step(self, workers: list[Worker], ends: dict[int, int]) -> None:
        plan, model = self.plan, self.model
        world = max(2, sum(len(s) for s in self.all_workers))
        alpha = float(self.view.latency.max()) if self.view.num_devices > 1 else 0.0
        barrier = self.tg.add("grad-norm allreduce", "comm", "global/sync",
                              2 * math.ceil(math.log2(world)) * alpha + model.host_comm_s,
                              [ends[w.wid] for w in workers if ends[w.wid] >= 0]
                              + [self.item_last[w.wid][-1] for w in workers if self.item_last[w.wid]])
        for w in workers:
            params = self.worker_params[w.wid]
            dp = len(self.all_workers[w.stage])
            shard = params / dp if plan.zero >= 1 else params
            kind = min(w.kinds, key=lambda k: k.memory_bandwidth)  # the slowest memory paces the group
            t = optimizer_time(shard, kind, model) + model.step_host_s
            opt_task = self.tg.add("optimizer step", "optimizer", self._label(w, "compute"), t, [barrier],
                                   device=w.rep, stage=w.stage, args={"params": shard})
            if plan.zero in (1, 2) and dp > 1:
                ring, twins = self._dp_group(w)
                self._collective_task("allgather params", "comm_zero", "all_gather",
                                      traffic.param_gather_bytes(params, plan),
                                      ring, twins, [opt_task], w, "zero", share=("ag-step", w.stage))


def lower(graph: OpGraph, plan: Plan, view: ClusterView, options: SimOptions | None = None) -> Lowered:
    """Lower one training iteration of `graph` under `plan` on `view` to a task graph."""
    options = options or SimOptions()
    if not plan.stages and plan.world_size > view.num_devices:
        raise LoweringError(
            f"plan needs {plan.world_size} devices (dp*tp*pp) but cluster {view.name!r} has {view.num_devices}")
    if plan.device_order is not None and max(plan.device_order) >= view.num_devices:
        raise LoweringError(
            f"plan field 'device_order': device {max(plan.device_order)} is not in cluster "
            f"{view.name!r} ({view.num_devices} devices)")
    return _Lowerer(graph, plan, view, options).lower()
