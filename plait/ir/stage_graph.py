"""The stage graph: one derivation, from a Plan and an OpGraph, of what runs where.

Every room that needs the pipeline's shape reads it from here -- the planner's analytic
model, the memory estimator, the simulator's lowering, the traffic module and the
runtime's micro-batching -- so that a plan means the same thing to all of them:

* **stages** (device stage = pipeline rank): layers, device group (replica-major, tensor
  rank fastest, as `StageSpec.devices`), dp / tp, tensor ratios, micro-batch size;
* **chunks**: consecutive runs of layers; a chain with ``v`` virtual stages puts chunks
  ``p, p+pp, ...`` on stage ``p`` (Megatron's interleaved layout), an explicit stage DAG
  (GraphPipe) has one chunk per stage, or one per segment of a stage that runs per input
  (`StageSpec.segments`, `segment_edges`: a segment waits only for the inputs it reads);
* **replicas**: the samples each data-parallel replica of a stage owns per iteration and
  its micro-batches (first global sample, size), under ONE rounding rule (below);
* **edges** between chunks, each with the tensors that cross it: for a chain, every value
  alive across the cut (a producer before it with a consumer after it -- what
  `plait.runtime.partition.split_into_stages` sends); for a DAG, the outputs of the
  producer stage's layers that a layer of the consumer stage reads. Bytes are the op
  graph's per-sample `Layer.output_bytes` in the capture dtype (`OpGraph.
  activation_dtype_bytes`); `plait.cost.traffic` scales them to the plan's dtype.

The rounding rule
-----------------
Samples per replica: ``Plan.samples_per_replica`` (HAP §5: floor of ``share *
global_batch``, the remainder to the largest deficits). A replica with ``n`` samples at
micro-batch ``b`` runs ``m = ceil(n / b)`` micro-batches of near-equal sizes, larger
first: 10 samples at b = 4 give [4, 3, 3], not [4, 4, 2]. This is what the runtime has
run since uneven shares exist (`plait.runtime.partition.replica_micro_batches`); it
keeps the fewest micro-batches that respect the size limit (so pipeline depth and
gradient-accumulation count are the same as [4, 4, 2]) while the largest micro-batch --
which sets activation memory and the slowest pipeline slot -- is as small as it can be
(ceil(n / m) <= b). Even shares give exactly ``num_micro_batches`` of size ``b``.

That is the rule of a *chain* plan (no explicit ``stages``): a replica is a whole pipeline, the
same samples at every stage (DDP-style data loading, HAP shares). A stage DAG (GraphPipe)
lets each stage choose its own data-parallel degree, so a replica cannot own one consecutive
range there: a stage of 2 replicas behind a stage of 1 would wait for the first half of the batch
before its second replica starts. A DAG stage instead cuts the whole batch into
``M = ceil(B / b)`` near-equal micro-batches (the same sizes as above) and **deals them to its
replicas in turn** (round-robin, GraphPipe §6 and PipeDream's 1F1B-RR; weighted by
``dp_shares`` when given: each micro-batch to the replica furthest below its share), so
micro-batch ``i`` of a stage with ``dp`` replicas runs on replica ``i mod dp`` and a
neighbour of any degree feeds all of them from its first micro-batches on. With ``dp = 1``
both rules are the same ([4, 3, 3] for 10 samples at b = 4); the busiest replica runs
``ceil(M / dp) = ceil(ceil(B / dp) / b)`` micro-batches either way. `replica_loads` gives the
counts and largest sizes without building lists (the memory estimator's question).

This module uses only plain data types (Plan, OpGraph) and `plait.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan, PlanError, StageSpec, share_samples


class StageGraphError(PlanError):
    """A plan whose stages contradict the model's op graph; the message names the field."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one replica: its first global sample index (within the step) and size."""

    index: int
    first: int
    size: int


@dataclass
class Replica:
    """One data-parallel replica of a stage: its tensor-parallel device group and its samples,
    run as micro-batches of at most `micro_batch` by the rounding rule (built on first use:
    planners ask about thousands of 1024-GPU plans and mostly need only the counts)."""

    index: int
    devices: list[int]
    first: int  # first global sample of its share
    samples: int
    micro_batch: int  # the stage's micro-batch size limit
    _units: list[MicroBatch] | None = field(default=None, repr=False, compare=False)

    @property
    def micro_batches(self) -> list[MicroBatch]:
        if self._units is None:
            self._units = replica_micro_batches(self.first, self.samples, self.micro_batch)
        return self._units

    @property
    def count(self) -> int:
        """How many micro-batches the replica runs."""
        if self._units is not None:
            return len(self._units)
        return micro_batch_count(self.samples, self.micro_batch)

    def size_counts(self) -> dict[int, int]:
        """{micro-batch size: how many}, without building the list (sizes differ by at most 1)."""
        if self._units is not None:
            out: dict[int, int] = {}
            for u in self._units:
                out[u.size] = out.get(u.size, 0) + 1
            return out
        m = self.count
        if m == 0:
            return {}
        base, extra = divmod(self.samples, m)
        return {k: v for k, v in ((base + 1, extra), (base, m - extra)) if v}


@dataclass
class Stage:
    index: int
    name: str
    layers: list[str]
    devices: list[int]
    dp: int
    tp: int
    micro_batch: int
    tp_ratios: list[float]
    chunks: list[int]
    replicas: list[Replica]


@dataclass
class Chunk:
    index: int
    stage: int
    layers: list[str]


@dataclass(frozen=True)
class EdgeTensor:
    """A value crossing a stage edge: the layer that produced it and its bytes per sample."""

    producer: str
    bytes_per_sample: float


@dataclass
class Edge:
    src: int  # chunk ids
    dst: int
    tensors: list[EdgeTensor]

    @property
    def bytes_per_sample(self) -> float:
        """Bytes per sample crossing the edge, capture dtype (`OpGraph.activation_dtype_bytes`)."""
        return float(sum(t.bytes_per_sample for t in self.tensors))


@dataclass
class StageGraph:
    stages: list[Stage]
    chunks: list[Chunk]
    edges: list[Edge]
    global_batch: int
    activation_dtype_bytes: int

    @property
    def world_size(self) -> int:
        return len({d for s in self.stages for d in s.devices})

    def stage_of_chunk(self, chunk: int) -> Stage:
        return self.stages[self.chunks[chunk].stage]

    def predecessors(self, chunk: int) -> list[int]:
        return [e.src for e in self.edges if e.dst == chunk]

    def successors(self, chunk: int) -> list[int]:
        return [e.dst for e in self.edges if e.src == chunk]


# ---------------------------------------------------------------- the rounding rule
def replica_samples(global_batch: int, shares: list[float] | None, dp: int) -> list[int]:
    """Samples per replica (integers summing to `global_batch`): floor, remainder to the largest deficits."""
    return share_samples(global_batch, shares, dp)


def micro_batch_count(samples: int, micro_batch: int) -> int:
    """How many micro-batches `samples` make at micro-batch size `micro_batch`: ceil(samples / b)."""
    if micro_batch < 1:
        raise PlanError(f"plan field 'micro_batch': must be a positive integer, got {micro_batch!r}")
    return -(-samples // micro_batch) if samples > 0 else 0


def largest_micro_batch(samples: int, micro_batch: int) -> int:
    """Size of the largest of `micro_batch_sizes(samples, micro_batch)` without building the list."""
    m = micro_batch_count(samples, micro_batch)
    return -(-samples // m) if m else 0


def micro_batch_sizes(samples: int, micro_batch: int) -> list[int]:
    """`samples` cut into ceil(samples / micro_batch) near-equal micro-batches, larger first."""
    m = micro_batch_count(samples, micro_batch)
    if m == 0:
        return []
    base, extra = divmod(samples, m)
    return [base + (1 if i < extra else 0) for i in range(m)]


_UNITS: dict[tuple[int, int, int], tuple[MicroBatch, ...]] = {}


def replica_micro_batches(first: int, samples: int, micro_batch: int) -> list[MicroBatch]:
    """The micro-batches of `samples` samples from `first` (a new list; the MicroBatch values are
    frozen and shared: replica r of every stage of a chain asks for the same ones)."""
    key = (first, samples, micro_batch)
    hit = _UNITS.get(key)
    if hit is None:
        out, start = [], first
        for i, size in enumerate(micro_batch_sizes(samples, micro_batch)):
            out.append(MicroBatch(i, start, size))
            start += size
        if len(_UNITS) > 4096:
            _UNITS.clear()
        hit = _UNITS[key] = tuple(out)
    return list(hit)


def deal_micro_batches(global_batch: int, micro_batch: int, shares: list[float] | None,
                       dp: int) -> list[list[MicroBatch]]:
    """A stage DAG's stage: the batch cut into ceil(B / b) near-equal micro-batches, dealt to the
    `dp` replicas in turn (module docstring); per replica its micro-batches in sample order."""
    dealt: list[list[int]] = [[] for _ in range(dp)]  # per replica, the indices of its micro-batches
    for i, r in enumerate(_deal_order(micro_batch_count(global_batch, micro_batch), shares, dp)):
        dealt[r].append(i)
    units = replica_micro_batches(0, global_batch, micro_batch)
    return [[MicroBatch(k, units[i].first, units[i].size) for k, i in enumerate(row)] for row in dealt]


def _deal_order(m: int, shares: list[float] | None, dp: int) -> list[int]:
    """The replica of each of `m` micro-batches: in turn (i mod dp), or each to the replica
    furthest below its share of the micro-batches dealt so far (lowest index on ties)."""
    if not shares or len(set(shares)) == 1:
        return [i % dp for i in range(m)]
    total = float(sum(shares))
    given = [0] * dp
    order = []
    for i in range(m):
        r = max(range(dp), key=lambda j: (shares[j] / total * (i + 1) - given[j], -j))
        given[r] += 1
        order.append(r)
    return order


def replica_loads(plan: Plan, shares: list[float] | None, dp: int, micro_batch: int) -> list[tuple[int, int]]:
    """(micro-batches, largest micro-batch) of each replica of a stage of `plan` with `dp`
    replicas at `micro_batch`, under the rule the plan's form takes (module docstring)."""
    if plan.stages:
        m = micro_batch_count(plan.global_batch, micro_batch)
        if m == 0:
            return [(0, 0)] * dp
        base, extra = divmod(plan.global_batch, m)  # micro-batch i has base + (i < extra)
        order = _deal_order(m, shares, dp)
        first_of: dict[int, int] = {}  # replica -> its first micro-batch
        counts = [0] * dp
        for i, r in enumerate(order):
            counts[r] += 1
            first_of.setdefault(r, i)
        return [(counts[r], (base + (first_of[r] < extra)) if r in first_of else 0) for r in range(dp)]
    return [(micro_batch_count(n, micro_batch), largest_micro_batch(n, micro_batch))
            for n in replica_samples(plan.global_batch, shares, dp)]


# ---------------------------------------------------------------- derivation
def stage_graph(plan: Plan, graph: OpGraph) -> StageGraph:
    """The stage graph of `plan` on `graph` (module docstring); raises StageGraphError naming the field."""
    specs, chunks, edges = chunk_graph(plan, graph)
    stages = [_stage(plan, s, spec, chunks) for s, spec in enumerate(specs)]
    return StageGraph(stages, chunks, edges, plan.global_batch, graph.activation_dtype_bytes)


def chunk_graph(plan: Plan, graph: OpGraph) -> tuple[list[StageSpec], list[Chunk], list[Edge]]:
    """Stage specs, chunks and edges with their tensors, validated -- without the replicas'
    micro-batches (what a caller that asks for thousands of plans, the memory estimator, needs)."""
    names = graph.layer_names
    if not names:
        raise StageGraphError(f"model {graph.model!r} has no layers to place")
    styles = [layer.tp_style for layer in graph.layers]
    specs = plan.stage_specs(names, styles)
    if plan.stages:
        if not any(spec.segments and len(spec.segments) > 1 for spec in specs):
            chunks = [Chunk(s, s, list(spec.layers)) for s, spec in enumerate(specs)]
            chunk_edges = list(plan.stage_graph_edges())
        else:
            chunks = [Chunk(0, s, seg) for s, spec in enumerate(specs) for seg in spec.segment_layers()]
            chunks = [Chunk(c, ch.stage, ch.layers) for c, ch in enumerate(chunks)]
            validate_stages(plan, graph, specs, [Chunk(s, s, list(sp.layers)) for s, sp in enumerate(specs)],
                            list(plan.stage_graph_edges()))
            chunk_edges = segment_edges(graph.layer_edges, chunks, list(plan.stage_graph_edges()))
    else:
        counts = plan.layers_per_stage(len(names), styles)
        chunks, start = [], 0
        for c, count in enumerate(counts):
            chunks.append(Chunk(c, c % plan.pp, names[start:start + count]))
            start += count
        chunk_edges = [(c, c + 1) for c in range(len(chunks) - 1)]
    if len(chunks) == len(specs) or not plan.stages:
        validate_stages(plan, graph, specs, chunks, chunk_edges)
    chunk_of = {n: c.index for c in chunks for n in c.layers}
    out = {layer.name: layer.output_bytes for layer in graph.layers}
    edges = [Edge(a, b, _edge_tensors(graph, chunks, a, b, chain=not plan.stages, chunk_of=chunk_of, out=out))
             for a, b in chunk_edges]
    return specs, chunks, edges


def segment_edges(layer_edges: list[tuple[str, str]], chunks: list[Chunk],
                  stage_edges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Edges between the segment chunks of a stage DAG whose stages run per input
    (`StageSpec.segments`): a layer edge joins its layers' chunks, within a stage too (handed over
    in memory, in segment order; one running backwards is an error naming the layers); a stage
    edge no layer edge carries (a plan's own ordering edge) joins the producer's last segment to
    the consumer's first. (Segments are consecutive runs of a stage's layers, so acyclic stages
    give acyclic segments.)"""
    chunk_of = {n: c.index for c in chunks for n in c.layers}
    out: set[tuple[int, int]] = set()
    for src, dst in layer_edges:
        a, b = chunk_of.get(src), chunk_of.get(dst)
        if a is None or b is None or a == b:
            continue
        if chunks[a].stage == chunks[b].stage and a > b:
            raise StageGraphError(f"plan field 'stages[{chunks[a].stage}].segments': layer {src!r} feeds layer "
                                  f"{dst!r} of an earlier segment of its stage")
        out.add((a, b))
    firsts: dict[int, int] = {}
    lasts: dict[int, int] = {}
    for c in chunks:
        firsts.setdefault(c.stage, c.index)
        lasts[c.stage] = c.index
    for s, t in stage_edges:
        if not any(chunks[a].stage == s and chunks[b].stage == t for a, b in out):
            out.add((lasts[s], firsts[t]))
    return sorted(out)


def _stage(plan: Plan, s: int, spec: StageSpec, chunks: list[Chunk]) -> Stage:
    mb = spec.micro_batch or plan.micro_batch
    replicas = []
    if plan.stages:  # a stage DAG: micro-batches dealt to the replicas in turn
        for r, units in enumerate(deal_micro_batches(plan.global_batch, mb, spec.dp_shares, spec.dp)):
            devs = list(spec.devices[r * spec.tp:(r + 1) * spec.tp])
            replicas.append(Replica(r, devs, units[0].first if units else 0, sum(u.size for u in units), mb,
                                    _units=units))
    else:  # a chain: each replica one consecutive share
        first = 0
        for r, n in enumerate(replica_samples(plan.global_batch, spec.dp_shares, spec.dp)):
            devs = list(spec.devices[r * spec.tp:(r + 1) * spec.tp])
            replicas.append(Replica(r, devs, first, n, mb))
            first += n
    ratios = list(spec.tp_ratios) if spec.tp_ratios else [1.0 / spec.tp] * spec.tp
    return Stage(s, spec.name, list(spec.layers) or [n for c in chunks if c.stage == s for n in c.layers],
                 list(spec.devices), spec.dp, spec.tp, mb, ratios,
                 [c.index for c in chunks if c.stage == s], replicas)


def _edge_tensors(graph: OpGraph, chunks: list[Chunk], a: int, b: int, chain: bool,
                  chunk_of: dict[str, int] | None = None, out: dict[str, float] | None = None) -> list[EdgeTensor]:
    """Values crossing chunk edge (a, b): alive across the cut (chain) or read by b from a (DAG).

    Without recorded layer edges (a graph built by hand), the producer chunk's last
    layer's output crosses. `chunk_of` (layer -> chunk) and `out` (layer -> output bytes) may
    come from the caller, who asks for every edge of one plan."""
    if chunk_of is None:
        chunk_of = {n: c.index for c in chunks for n in c.layers}
    producers: list[str] = []
    if graph.layer_edges:
        for src, dst in graph.layer_edges:
            cs, cd = chunk_of.get(src), chunk_of.get(dst)
            if cs is None or cd is None:
                continue
            crosses = (cs <= a and cd >= b) if chain else (cs == a and cd == b)
            if crosses and src not in producers:
                producers.append(src)
    elif chunks[a].layers:
        producers = [chunks[a].layers[-1]]
    if out is None:
        out = {layer.name: layer.output_bytes for layer in graph.layers}
    return [EdgeTensor(p, float(out[p])) for p in producers]


def chain_cut_bytes(graph: OpGraph) -> list[float]:
    """Bytes per sample crossing a chain cut before layer k, for k = 0..n: the producers
    `_edge_tensors` lists for a chain edge (index < k, a consumer at index >= k), summed --
    one number per cut, for callers that ask about thousands of splits (the memory estimator)."""
    names = graph.layer_names
    pos = {n: i for i, n in enumerate(names)}
    out = [float(layer.output_bytes) for layer in graph.layers]
    cut = [0.0] * (len(names) + 1)
    if not graph.layer_edges:
        for k in range(1, len(names)):
            cut[k] = out[k - 1]
        return cut
    last: dict[int, int] = {}
    for src, dst in graph.layer_edges:
        if src in pos and dst in pos:
            last[pos[src]] = max(last.get(pos[src], -1), pos[dst])
    diff = [0.0] * (len(names) + 2)
    for i, j in last.items():
        if j > i:
            diff[i + 1] += out[i]
            diff[j + 1] -= out[i]
    acc = 0.0
    for k in range(len(names) + 1):
        acc += diff[k]
        cut[k] = acc
    return cut


# ---------------------------------------------------------------- validation
def validate_stages(plan: Plan, graph: OpGraph, specs: list[StageSpec], chunks: list[Chunk],
                    edges: list[tuple[int, int]]) -> None:
    """Reject stages that contradict the op graph: an unknown layer, a layer in no stage,
    a layer dependency with no stage edge to carry it, or a stage edge running against
    the layers' dependencies (the plan-only checks -- cycles, a layer in two stages,
    overlapping device groups -- are `Plan.validate`'s)."""
    names = set(graph.layer_names)
    for s, spec in enumerate(specs):
        unknown = [n for n in spec.layers if n not in names]
        if unknown:
            raise StageGraphError(f"plan field 'stages[{s}].layers': {unknown[:3]} are not layers of "
                                  f"model {graph.model!r}")
        if spec.spmd is None and len(spec.devices) != spec.dp * spec.tp:
            raise StageGraphError(f"plan field 'stages[{s}].devices': stage {spec.name!r} needs dp*tp = "
                                  f"{spec.dp * spec.tp} devices, got {len(spec.devices)}")
    if not plan.stages:
        return
    stage_of = {n: c.stage for c in chunks for n in c.layers}
    lost = [n for n in graph.layer_names if n not in stage_of]
    if lost:
        raise StageGraphError(f"plan field 'stages': layers {lost[:3]} are in no stage")
    edge_set = set(edges)
    for src, dst in graph.layer_edges:
        a, b = stage_of[src], stage_of[dst]
        if a == b:
            continue
        if (b, a) in edge_set and (a, b) not in edge_set:
            raise StageGraphError(f"plan field 'stage_edges': edge ({b}, {a}) runs against the model: layer "
                                  f"{src!r} (stage {a}) feeds layer {dst!r} (stage {b})")
        if (a, b) not in edge_set:
            raise StageGraphError(f"plan field 'stage_edges': layer {src!r} (stage {a}) feeds layer {dst!r} "
                                  f"(stage {b}) but there is no edge ({a}, {b}) to carry it")
