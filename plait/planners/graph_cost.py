"""The analytic objective of graph-pipeline planners: one stage's time, memory and a plan's score.

Shared by GraphPipe's partitioner (`plait.planners.graphpipe`), the PipeDream and Piper baselines
(`plait.planners.seq_baselines`), the lower bound and the brute-force tests, so that all of them
optimise the same number; the search driver then ranks their plans by the simulator.

A stage holds a convex set of layers on ``dp`` devices of one GPU kind (data parallel inside
the stage, GraphPipe §3) at micro-batch ``b``. Per iteration of global batch ``B`` each replica
runs ``m = ceil(ceil(B / dp) / b)`` micro-batches (the stage graph's rounding rule), so

    W(stage)  = m * t(b) + allreduce(gradients, dp) + opt(dp)   busy seconds per iteration
    t(b)      = sum over its layers of forward + backward seconds of one micro-batch
                (`plait.cost.compute.layer_cost`, the simulator's compute model)
    opt(dp)   = the optimizer step over the stage's parameters, sharded over its dp replicas
                (`to_plan` gives ZeRO-1 where a stage has replicas), plus the per-iteration host
                work (`plait.cost.compute.optimizer_time` + ``step_host_s``, as the simulator)

and a plan scores ``max_s (W(s) - opt(s) + sum over the longest stage path through s of
(t(b_x) + hop_x) - t(b_s)) + max_s opt(s)``: each stage's busy time before the optimizer step
plus one micro-batch's trip through the rest of its longest path (the pipeline's fill and drain;
Pipette's ``(M - 1) max t + sum t`` generalised to a DAG), then the longest optimizer step, which
every stage runs after the global gradient-norm barrier (as the simulator does; a stage holding
embedding tables has a long one). A stage with inputs adds ``hop = 2 * p2p_host_s``, the host time of the forward
send/recv step into it and of the backward one out of it (the compute model's, which the
simulator charges per pipeline message). A graph plan's stages run **per input** (`segments`,
written to `StageSpec.segments` by `to_plan`): the paths are walked over the segment DAG (a
hand-over between segments of one stage costs no hop) and a stage's path term is the longest trip
through any of its segments, so a stage holding one branch's last block and the join is on the
other branch's path by its join segment only. Sequential plans (``chain=True``) run whole stages. GraphPipe's objective, the time per
sample of the slowest stage, is ``max_s W(s) / B``. Memory: `plait.cost.memory.stage_peak_bytes`
(the one estimator) with the in-flight micro-batches graph 1F1B keeps, ``1 + the stage's longest
path to the sink``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import networkx as nx

from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import choose_algorithm, collective_time, group_links, measured_tables
from plait.cost.compute import (
    DEFAULT_MODEL,
    ComputeModel,
    layer_cost,
    layer_cost_key,
    optimizer_time,
)
from plait.cost.memory import stage_peak_bytes, state_bytes_per_param
from plait.cost.traffic import dp_grad_bytes
from plait.errors import PlaitError
from plait.ir.plan import Plan, StageSpec
from plait.ir.stage_graph import Chunk, segment_edges

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.ir.opgraph import OpGraph


class GraphPlanError(PlaitError, ValueError):
    """A graph-pipeline planning request that cannot be answered; the message says why."""


@dataclass(frozen=True)
class StageChoice:
    """One planned stage: its layers (model order), GPU kind, data-parallel degree, micro-batch,
    busy seconds per iteration `work` and one micro-batch's forward + backward `t_mb`."""

    layers: tuple[str, ...]
    kind: str
    dp: int
    micro_batch: int
    work: float
    t_mb: float


@dataclass
class StageCost:
    """Costs of candidate stages of `graph` on `cluster` at `global_batch` (module docstring)."""

    graph: OpGraph
    cluster: Cluster
    global_batch: int
    dtype: str = "bf16"
    compute: ComputeModel = DEFAULT_MODEL
    memory: bool = True  # check each stage against its GPU kind's memory
    overhead_bytes: int | None = None  # per-GPU framework constant of the memory estimate
    # largest micro-batch of a stage (powers of two up to it, and a replica's whole share): a stage may
    # run its share as one micro-batch -- branches side by side, no pipelining -- which beats any
    # pipelined split of DLRM and CANDLE-Uno at 16 samples per GPU (at 64, the cap until then, it
    # could not: 58.9 vs 42.7 us/sample on DLRM at 16 A100s)
    max_micro_batch: int = 1024
    max_dp: int | None = None  # most data-parallel replicas per stage (1: pure pipelines)
    # every stage exactly this many replicas (the stage graph replicated); None: any
    uniform_dp: int | None = None
    # build each (layers, kind, dp) row of `table` when first asked (False: every degree's row at
    # once, as before; the same numbers, kept to measure the speed-up in bench/plan_search_time.py)
    lazy: bool = True
    _rows: dict = field(default_factory=dict, repr=False)
    _obps: dict = field(default_factory=dict, repr=False)
    _t: dict = field(default_factory=dict, repr=False)
    _ar: dict = field(default_factory=dict, repr=False)
    _fit: dict = field(default_factory=dict, repr=False)
    _seg: dict = field(default_factory=dict, repr=False)
    _table: dict = field(default_factory=dict, repr=False)
    _mbs: dict = field(default_factory=dict, repr=False)
    _params: dict = field(default_factory=dict, repr=False)
    _parts: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.by_name = {layer.name: layer for layer in self.graph.layers}
        self.pos = {n: i for i, n in enumerate(self.graph.layer_names)}
        kinds: dict[str, list[int]] = {}
        for d in self.cluster.devices:
            kinds.setdefault(d.kind.name, []).append(d.id)
        self.kind_obj = {d.kind.name: d.kind for d in self.cluster.devices}
        # fastest first: the order devices are handed out in, and the order of `counts`
        self.kinds = sorted(kinds, key=lambda k: -self.kind_obj[k].flops(self.dtype))
        self.devices_of = {k: kinds[k] for k in self.kinds}
        self.counts = tuple(len(kinds[k]) for k in self.kinds)
        self.plan_template = Plan(dtype=self.dtype, global_batch=self.global_batch)
        self.bw, self.lat = bandwidth_matrix(self.cluster), latency_matrix(self.cluster)
        self.node_of = [d.node for d in self.cluster.devices]
        self.out_bytes = {layer.name: layer.output_bytes for layer in self.graph.layers}
        self.succ: dict[str, list[str]] = {}
        self.preds: dict[str, list[str]] = {}
        for a, b in self.graph.layer_edges:
            self.succ.setdefault(a, []).append(b)
            self.preds.setdefault(b, []).append(a)

    # ------------------------------------------------------------ pieces
    def layer_time(self, name: str, kind: str, b: int) -> float:
        """Forward + backward seconds of layer `name` for a micro-batch of `b` on one `kind` GPU."""
        layer = self.by_name[name]
        key = (layer_cost_key(layer, self.compute, (kind,), b), kind, b)
        hit = self._t.get(key)
        if hit is None:
            c = layer_cost(layer, self.graph, b, self.kind_obj[kind], self.dtype, model=self.compute)
            hit = self._t[key] = c.fwd.compute_s + c.bwd.compute_s
        return hit

    def seg_time(self, layers: tuple[str, ...], kind: str, b: int) -> float:
        key = (layers, kind, b)
        hit = self._seg.get(key)
        if hit is None:
            hit = self._seg[key] = sum(self.layer_time(n, kind, b) for n in layers)
        return hit

    def params(self, layers: tuple[str, ...]) -> int:
        hit = self._params.get(layers)
        if hit is None:
            hit = self._params[layers] = sum(self.by_name[n].param_count for n in layers)
        return hit

    def allreduce(self, params: int, kind: str, dp: int) -> float:
        """Gradient all-reduce of a stage on `dp` devices of `kind` (the first `dp` of that kind in
        node order: where `place` puts a stage, so intra-node when it fits one node)."""
        if dp <= 1 or params == 0:
            return 0.0
        key = (params, kind, dp)
        hit = self._ar.get(key)
        if hit is None:
            links = self._ar.get((kind, dp))
            if links is None:  # as the simulator's ClusterView.group: NICs per node, measured tables
                links = self._ar[(kind, dp)] = group_links(
                    self.devices_of[kind][:dp], self.bw, self.lat, self.node_of,
                    [max(1, n.nics) for n in self.cluster.nodes], measured_tables(self.cluster))
            nbytes = dp_grad_bytes(params, self.plan_template)
            algo = choose_algorithm("all_reduce", nbytes, links)
            hit = self._ar[key] = collective_time("all_reduce", nbytes, links, algo) + self.compute.host_comm_s
        return hit

    def micro_batches(self, dp: int) -> list[int]:
        """Candidate micro-batch sizes of a stage with `dp` replicas: powers of two up to the
        replica's samples, and the replica's samples themselves."""
        hit = self._mbs.get(dp)
        if hit is None:
            n = -(-self.global_batch // dp)
            hit = [b for b in (2**i for i in range(12)) if b <= min(n, self.max_micro_batch)]
            if n <= self.max_micro_batch and n not in hit:
                hit.append(n)
            self._mbs[dp] = hit
        return hit

    def table(self, layers: tuple[str, ...], kind: str) -> list[list[tuple[float, int, float]]]:
        """Per data-parallel degree 1.. (index dp - 1): [(work, micro-batch, t_mb)] by work."""
        key = (layers, kind)
        hit = self._table.get(key)
        if hit is None:
            n = self.counts[self.kinds.index(kind)]
            hit = self._table[key] = [sorted(((w, b, t) for b in self.micro_batches(dp)
                                              for w, t in [self.work(layers, kind, dp, b)]),
                                             key=lambda x: (x[0] * (1 + 1e-9 * x[1]), x[1]))
                                      for dp in range(1, n + 1)]
        return hit

    def row(self, layers: tuple[str, ...], kind: str, dp: int) -> list[tuple[float, int, float]]:
        """`table(layers, kind)[dp - 1]`, built alone: a search with one data-parallel degree per
        stage (`uniform_dp`) asks for one row of a kind's hundreds."""
        if not self.lazy:
            return self.table(layers, kind)[dp - 1]
        key = (layers, kind, dp)
        hit = self._rows.get(key)
        if hit is None:
            hit = self._rows[key] = sorted(((w, b, t) for b in self.micro_batches(dp)
                                            for w, t in [self.work(layers, kind, dp, b)]),
                                           key=lambda x: (x[0] * (1 + 1e-9 * x[1]), x[1]))
        return hit

    def dp_cap(self, kind: str) -> int:
        n = self.counts[self.kinds.index(kind)]
        if self.uniform_dp is not None:
            return min(n, self.uniform_dp)
        return n if self.max_dp is None else min(n, self.max_dp)

    def dp_allowed(self, dp: int) -> bool:
        return self.uniform_dp is None or dp == self.uniform_dp

    def work(self, layers: tuple[str, ...], kind: str, dp: int, b: int) -> tuple[float, float]:
        """(busy seconds per iteration, one micro-batch's seconds) of a stage."""
        n = -(-self.global_batch // dp)
        m = -(-n // b)
        t = self.seg_time(layers, kind, b)
        return m * t + self.allreduce(self.params(layers), kind, dp) + self.optimizer(layers, kind, dp), t

    def optimizer(self, layers: tuple[str, ...], kind: str, dp: int) -> float:
        """The optimizer step of a stage's replica: its 1/dp shard of the parameters (ZeRO-1 where a
        stage has replicas, `to_plan`) plus the step's host work, as the simulator charges it."""
        return optimizer_time(self.params(layers) / dp, self.kind_obj[kind], self.compute) + self.compute.step_host_s

    def out_bytes_per_sample(self, layers: tuple[str, ...]) -> float:
        hit = self._obps.get(layers) if self.lazy else None
        if hit is None:
            inside = set(layers)
            hit = self._obps[layers] = float(sum(self.out_bytes[n] for n in layers if any(s not in inside for s in self.succ.get(n, ()))))
        return hit

    def fits(self, layers: tuple[str, ...], kind: str, dp: int, b: int, in_flight: int) -> bool:
        if not self.memory:
            return True
        per_replica = -(-self.global_batch // dp)
        m = -(-per_replica // b)
        key = (layers, kind, dp, b, min(in_flight, m))
        hit = self._fit.get(key)
        if hit is None:
            peak = stage_peak_bytes(self.graph, list(layers), self.plan_template, micro_batch=b,
                                    in_flight=min(in_flight, m), dp=dp,
                                    p2p_bytes_per_sample=2 * self.out_bytes_per_sample(layers),
                                    overhead_bytes=self.overhead_bytes)
            hit = self._fit[key] = peak <= self.kind_obj[kind].memory_bytes
        return hit

    def state_bytes(self, layers: tuple[str, ...]) -> float:
        """Weights, gradients and optimizer state of `layers` (one replica)."""
        w, g, k = state_bytes_per_param(self.dtype, "adam", self.plan_template.grad_dtype)
        return float((w + g + k) * self.params(layers))

    # ------------------------------------------------------------ plans
    def owners(self, stages: list[StageChoice]) -> dict[str, int]:
        """Each layer's stage; a GraphPlanError naming the layers if a stage list leaves one out or
        puts one in two stages (a partition must cover the model exactly once)."""
        owner: dict[str, int] = {}
        twice = []
        for s, st in enumerate(stages):
            for n in st.layers:
                if n in owner:
                    twice.append(n)
                owner[n] = s
        missing = [n for n in self.graph.layer_names if n not in owner]
        unknown = [n for n in owner if n not in self.by_name]
        if missing or twice or unknown:
            raise GraphPlanError(f"graph plan of {self.graph.model!r}: stages must hold every layer once; "
                                 f"missing {missing[:4]}, in two stages {twice[:4]}, unknown {unknown[:4]}")
        return owner

    def stage_edges(self, stages: list[StageChoice], chain: bool = False) -> list[tuple[int, int]]:
        """Edges between stages that the layers' edges cross; `chain`: a sequential pipeline, whose
        stages (in list order) also pass to the next one (PipeDream's and Piper's plans)."""
        owner = self.owners(stages)
        edges = {(owner[a], owner[b]) for a, b in self.graph.layer_edges if owner[a] != owner[b]}
        if chain:
            edges |= {(s, s + 1) for s in range(len(stages) - 1)}
        return sorted(edges)

    def _dag(self, stages: list[StageChoice], chain: bool) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(range(len(stages)))
        g.add_edges_from(self.stage_edges(stages, chain))
        return g

    def segments(self, layers: tuple[str, ...]) -> list[tuple[str, ...]]:
        """A graph stage's layers (model order) cut where it runs per input (`StageSpec.segments`):
        a new segment at each layer, after the first, that reads a layer of another stage -- the
        stage waits for that input only there (GraphPipe runs operators as their inputs arrive)."""
        hit = self._parts.get(layers)
        if hit is None:
            inside = set(layers)
            ordered = sorted(layers, key=self.pos.__getitem__)
            out: list[list[str]] = []
            for n in ordered:
                external = any(p not in inside for p in self.preds.get(n, ()))
                if not out or (external and out[-1]):
                    out.append([])
                out[-1].append(n)
            hit = self._parts[layers] = [tuple(x) for x in out]
        return hit

    def _segment_dag(self, stages: list[StageChoice], chain: bool,
                     per_input: bool = True) -> tuple[list[tuple[int, float]], nx.DiGraph]:
        """Per segment (its stage, one micro-batch's seconds) and the segment DAG: a sequential
        plan's stages (`chain`) run whole; a graph plan's per input (`segments`; whole where not
        `per_input`), with the edges of `plait.ir.stage_graph.segment_edges` (the stage graph the
        simulator and runtime run)."""
        segs: list[tuple[int, float]] = []
        chunks: list[Chunk] = []
        for s, st in enumerate(stages):
            parts = [tuple(sorted(st.layers, key=self.pos.__getitem__))] if chain or not per_input \
                else self.segments(st.layers)
            for part in parts:
                chunks.append(Chunk(len(chunks), s, list(part)))
                segs.append((s, self.seg_time(part, st.kind, st.micro_batch) if len(parts) > 1 else st.t_mb))
        g = nx.DiGraph()
        g.add_nodes_from(range(len(segs)))
        if len(chunks) == len(stages):
            g.add_edges_from(self.stage_edges(stages, chain))
        else:
            g.add_edges_from(segment_edges(self.graph.layer_edges, chunks, self.stage_edges(stages, chain)))
        return segs, g

    def _trips(self, stages: list[StageChoice], chain: bool,
               per_input: bool = True) -> tuple[list[tuple[int, float]], dict, dict] | None:
        """(segments, to, after): one micro-batch's forward + backward seconds from the sources through
        each segment and from it to the sink, a hop between stages costing ``2 * p2p_host_s`` and a
        hand-over inside a stage none; None if the stage graph has a cycle."""
        if not nx.is_directed_acyclic_graph(self._dag(stages, chain)):
            return None
        segs, g = self._segment_dag(stages, chain, per_input)
        hop = 2 * self.compute.p2p_host_s
        order = list(nx.topological_sort(g))
        to: dict[int, float] = {}
        for x in order:
            to[x] = segs[x][1] + max((to[p] + hop * (segs[p][0] != segs[x][0]) for p in g.predecessors(x)),
                                     default=0.0)
        after: dict[int, float] = {}
        for x in reversed(order):
            after[x] = segs[x][1] + max((after[c] + hop * (segs[c][0] != segs[x][0]) for c in g.successors(x)),
                                        default=0.0)
        return segs, to, after

    def score(self, stages: list[StageChoice], chain: bool = False, per_input: bool = True) -> float:
        """The analytic iteration seconds of a stage list (module docstring): the slowest stage's
        busy time before the step plus its fill and drain, then the longest optimizer step
        (`per_input=False`: a graph plan's stages run whole)."""
        trips = self._trips(stages, chain, per_input)
        if trips is None:
            return math.inf
        segs, to, after = trips
        through = [0.0] * len(stages)  # the longest trip through any segment of the stage
        for x, (s, t) in enumerate(segs):
            through[s] = max(through[s], to[x] + after[x] - t)
        opt = [self.optimizer(st.layers, st.kind, st.dp) for st in stages]
        # Pipette's (M - 1) t + sum t through each stage (its own micro-batch is in its work), the
        # optimizer step after the global gradient-norm barrier (the simulator's `_emit_step`)
        before = max(st.work - o + through[s] - st.t_mb for s, (st, o) in enumerate(zip(stages, opt)))
        return before + max(opt)

    def effective_depth(self, stages: list[StageChoice], chain: bool = False, per_input: bool = True) -> float:
        """Stage-equivalents on the longest path: each segment on it counts its share of its stage's
        micro-batch time (a whole stage 1; the join segment of a stage that runs per input, which
        the other branch waits for, its own share). Equals `pipeline_depth` where every stage
        runs whole; a stage that runs per input is on the other branch's path by its join only."""
        segs, g = self._segment_dag(stages, chain, per_input)
        total = [0.0] * len(stages)
        for s, t in segs:
            total[s] += t
        w = [t / total[s] if total[s] > 0 else 1.0 / sum(1 for x, _ in segs if x == s) for s, t in segs]
        best: dict[int, float] = {}
        for x in nx.topological_sort(g):
            best[x] = w[x] + max((best[p] for p in g.predecessors(x)), default=0.0)
        return max(best.values(), default=0.0)

    def depths(self, stages: list[StageChoice], chain: bool = False) -> list[int]:
        """Per stage, its longest path to a sink in stages (graph 1F1B warm-up)."""
        g = self._dag(stages, chain)
        out = [0] * len(stages)
        for s in reversed(list(nx.topological_sort(g))):
            out[s] = max((out[c] + 1 for c in g.successors(s)), default=0)
        return out

    def pipeline_depth(self, stages: list[StageChoice], chain: bool = False) -> int:
        """Stages on the longest path of the stage graph (GraphPipe's pipeline depth)."""
        return max(self.depths(stages, chain), default=0) + 1

    def to_plan(self, stages: list[StageChoice], schedule: str = "1f1b", chain: bool = False,
                per_input: bool = True) -> Plan:
        """A Plan of the stages: topological stage order (the sink last), devices handed out per
        kind in node order along that order (a stage's replicas and neighbouring stages land on
        the same or nearby nodes), stage edges from the layers' edges."""
        edges = self.stage_edges(stages, chain)
        g = self._dag(stages, chain)
        first = [min(self.pos[n] for n in st.layers) for st in stages]
        order = list(nx.lexicographical_topological_sort(g, key=lambda s: first[s]))
        new = {old: i for i, old in enumerate(order)}
        nxt = {k: 0 for k in self.kinds}
        specs = []
        for i, old in enumerate(order):
            st = stages[old]
            devs = self.devices_of[st.kind][nxt[st.kind]:nxt[st.kind] + st.dp]
            if len(devs) < st.dp:
                raise GraphPlanError(f"graph plan: stages need more {st.kind} GPUs than the cluster's "
                                     f"{len(self.devices_of[st.kind])}")
            nxt[st.kind] += st.dp
            layers = sorted(st.layers, key=self.pos.__getitem__)
            parts = self.segments(st.layers) if per_input and not chain else []
            specs.append(StageSpec(name=f"stage{i}", layers=layers, devices=list(devs), dp=st.dp, tp=1,
                                   micro_batch=st.micro_batch,
                                   segments=[len(p) for p in parts] if len(parts) > 1 else None))
        plan_edges = sorted((new[a], new[b]) for a, b in edges)
        # ZeRO-1 (Megatron's distributed optimizer) where a stage has replicas: each updates 1/dp of
        # the optimizer state, for a reduce-scatter + all-gather instead of an all-reduce.
        zero = 1 if any(st.dp > 1 for st in stages) else 0
        return Plan(global_batch=self.global_batch, dtype=self.dtype, schedule=schedule, zero=zero,
                    micro_batch=max(st.micro_batch for st in stages), stages=specs, stage_edges=plan_edges)

    def choices_of(self, plan: Plan) -> list[StageChoice]:
        """The StageChoice list of a graph plan (for scoring a plan made elsewhere)."""
        out = []
        kind_of = {d.id: d.kind.name for d in self.cluster.devices}
        for spec in plan.stages:
            kind = min((kind_of[d] for d in spec.devices), key=lambda k: self.kind_obj[k].flops(self.dtype))
            b = spec.micro_batch or plan.micro_batch
            w, t = self.work(tuple(spec.layers), kind, spec.dp, b)
            out.append(StageChoice(tuple(spec.layers), kind, spec.dp, b, w, t))
        return out


def best_micro_batch(cost: StageCost, layers: tuple[str, ...], kind: str, dp: int,
                     in_flight: int, limit: float = math.inf, max_b: int | None = None) -> StageChoice | None:
    """The micro-batch (at most `max_b`) of least busy time (at most `limit`) that fits memory
    (ties: the smaller, less fill); None if none does. Memory is asked only of the sizes that
    meet the time."""
    for w, b, t in cost.row(layers, kind, dp):
        if w > limit:
            return None
        if max_b is not None and b > max_b:
            continue
        if cost.fits(layers, kind, dp, b, in_flight):
            return StageChoice(layers, kind, dp, b, w, t)
    return None


def lower_bound(cost: StageCost) -> dict[str, float]:
    """A lower bound on any plan's iteration seconds under the analytic model (issue 13, item 6).

    * ``work``: every sample crosses every layer, at best at the layer's most efficient
      micro-batch, spread over all GPUs (on a mixed cluster each kind counts by its speed relative
      to the fastest on this model);
    * ``memory``: the same, with each layer's micro-batch limited to what fits one GPU holding
      that layer alone (its states and one micro-batch in flight: the per-stage memory floor);
    * ``critical_path``: one sample's forward and backward along the longest layer path;
    * ``optimizer``: the Adam step of all parameters spread over all GPUs in proportion to their
      memory bandwidth (it is memory-bound), plus one step's host time. Every GPU steps after the
      global gradient-norm barrier, which waits for all compute, so it adds to the others.

    ``bound`` is ``max(work, memory, critical_path) + optimizer``. Gradient all-reduces, ZeRO's
    parameter gathers and pipeline fill are left out, so the gap of a plan to it includes them."""
    names = cost.graph.layer_names
    fastest = cost.kinds[0]
    mbs = cost.micro_batches(1)
    best, best_mem = {}, {}
    for n in names:
        per = [(cost.layer_time(n, fastest, b) / b, b) for b in mbs]
        best[n] = min(p for p, _ in per)
        fit = [p for p, b in per if cost.fits((n,), fastest, 1, b, 1)]
        best_mem[n] = min(fit) if fit else math.inf
    total = sum(best.values())
    speed = 0.0
    for kind, count in zip(cost.kinds, cost.counts):
        own = sum(min(cost.layer_time(n, kind, b) / b for b in mbs) for n in names)
        speed += count * (total / own if own > 0 else 1.0)
    work = cost.global_batch * total / speed
    memory = cost.global_batch * sum(best_mem.values()) / speed
    dag = cost.graph.layer_dag()
    cp: dict[str, float] = {}
    for n in nx.topological_sort(dag):
        cp[n] = cost.layer_time(n, fastest, 1) + max((cp[p] for p in dag.predecessors(n)), default=0.0)
    critical = max(cp.values(), default=0.0)
    params = float(sum(layer.param_count for layer in cost.graph.layers))
    unit = 1e6  # optimizer_time is linear in the parameters: a GPU of kind k steps 1/a_k of them a second
    rate = sum(count * unit / optimizer_time(unit, cost.kind_obj[kind], cost.compute)
               for kind, count in zip(cost.kinds, cost.counts))
    opt = (params / rate if params > 0 else 0.0) + cost.compute.step_host_s
    return {"work": work, "memory": memory, "critical_path": critical, "optimizer": opt,
            "bound": max(work, memory, critical) + opt}
