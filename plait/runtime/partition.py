"""Model side of the runtime: load a model spec, list its layers, feed it data, cut it into stages.

* `load_model_spec(spec)` returns an object with `build`, `sample_batch` and `loss`
  (the zoo's `ModelSpec` contract).
* `layer_modules(model)` lists the model's layers the way the capture does
  (`plait.graph.layer_cut`): modules marked `plait_layer` in the zoo; in a user's model, its
  modules refined through `ModuleList`/`Sequential` containers down to blocks, so a layer
  may be a nested path such as `towers.0.blocks.1` (torch.fx keeps it a leaf like any other).
* `make_samples(...)` builds samples from a seed per *global sample index*, so any split of
  the global batch over replicas and micro-batches (`replica_micro_batches`) sees the same
  samples as the single-process reference.
* `split_into_stages(model, counts)` cuts the model into a linear pipeline with
  `torch.fx`: layers are traced as leaves, every other node (glue such as a residual
  add or positional-embedding sum) goes to the earliest stage that has all of its inputs,
  and the values alive across each cut become the stage's outputs (GPipe's partitioning
  of a sequential model, generalised to any traceable forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from plait.errors import PlaitError
from plait.ir.stage_graph import Chunk, segment_edges

if TYPE_CHECKING:
    from plait.graph.zoo.registry import ModelSpec
    from plait.ir.plan import Plan


class RuntimeSetupError(PlaitError, ValueError):
    """A model, plan or cluster that the runtime cannot run; the message says which and why."""


# ---------------------------------------------------------------------------------- model specs
def _looks_like_spec(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("build", "sample_batch", "loss"))


def build_seeded(spec: Any, seed: int) -> nn.Module:
    """The model every engine and the single-process reference start from: torch's, Python's and
    numpy's generators seeded with `seed`, built on the CPU in fp32 (the zoo's build draws weights
    from its own `seed`; other models from the global generator seeded here), in training mode."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    try:
        model = spec.build(device="cpu", dtype=torch.float32, seed=seed)
    except TypeError:
        model = spec.build(device="cpu", dtype=torch.float32)
    model.train()
    return model


def load_model_spec(spec: str | ModelSpec) -> Any:
    """A ModelSpec (build, sample_batch, loss) from a zoo string, `file.py:factory`, or a ModelSpec."""
    if _looks_like_spec(spec):
        return spec
    from plait.graph.zoo import load_model

    return load_model(spec)


def model_spec_string(spec: str | ModelSpec) -> str:
    """The string a worker process can load `spec` from (workers cannot receive Python objects)."""
    if isinstance(spec, str):
        return spec
    source = getattr(spec, "spec", None)  # the zoo records the string a ModelSpec came from
    if isinstance(source, str) and source:
        return source
    raise RuntimeSetupError("model: pass a zoo spec string or 'file.py:factory' so worker processes can load it")


# ---------------------------------------------------------------------------------- layers
def layer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers as (qualified name, module), in registration order: exactly the
    OpGraph's layers (`plait.graph.capture.layer_assignment`), so a plan's `layer_split`
    counts the same units here as in the planner and the simulator."""
    from plait.graph.capture import layer_assignment

    return [(path, model.get_submodule(path) if path else model) for path in layer_assignment(model)]


def _layer_style(module: nn.Module) -> str:
    """The OpGraph Layer.tp_style of a layer module (its `plait_layer` marker, else "transformer"
    for a block of column and row linears, else "none"), as `plait.graph.layer_cut` gives it."""
    from plait.graph.tp_plan import tensor_parallel_style

    style = getattr(module, "plait_layer", None)
    return style if isinstance(style, str) else tensor_parallel_style(module)


# ---------------------------------------------------------------------------------- data
def sample_seed(data_seed: int, global_index: int) -> int:
    """Seed of one sample: depends only on the run's data seed and the sample's global index."""
    return (data_seed * 1_000_003 + global_index) % (2**31 - 1)


def make_samples(spec: Any, first: int, count: int, data_seed: int, device: str | torch.device = "cpu"
                 ) -> tuple[tuple[Any, ...], torch.Tensor]:
    """Samples `first .. first+count-1` (global indices), concatenated along the batch dim."""
    if count <= 0:
        raise ValueError("count must be positive")
    parts = [spec.sample_batch(1, device=device, seed=sample_seed(data_seed, first + i)) for i in range(count)]
    inputs = tuple(_cat([p[0][j] for p in parts]) for j in range(len(parts[0][0])))
    target = _cat([p[1] for p in parts])
    return inputs, target


def _cat(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values, dim=0) if values[0].dim() > 0 else values[0]
    return values[0]


def split_counts(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal integers, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class MicroBatch:
    index: int
    first: int  # global sample index of its first sample
    size: int


def stage_micro_batches(plan: Plan, step: int, stage: int, replica: int = 0) -> list[MicroBatch]:
    """Micro-batches replica `replica` of stage `stage` of a graph plan (`Plan.stages`) runs at
    `step`: the stage graph's rule for a stage DAG (`plait.ir.stage_graph.deal_micro_batches`:
    the batch cut at the stage's micro-batch size, dealt to its replicas in turn)."""
    from plait.ir.stage_graph import deal_micro_batches

    spec = plan.stages[stage]
    units = deal_micro_batches(plan.global_batch, spec.micro_batch or plan.micro_batch, spec.dp_shares,
                               spec.dp)[replica]
    base = step * plan.global_batch
    return [MicroBatch(u.index, base + u.first, u.size) for u in units]


def replica_micro_batches(plan: Plan, step: int, dp_index: int, micro_batch: int | None = None) -> list[MicroBatch]:
    """Micro-batches replica `dp_index` runs at `step`.

    The replica owns a contiguous range of the step's global batch (its share from
    `plan.samples_per_replica()`), cut into ceil(n / micro_batch) near-equal micro-batches,
    so even shares give exactly `plan.num_micro_batches` of size `plan.micro_batch` and an
    uneven (HAP-style) share runs more or fewer micro-batches. `micro_batch` overrides the
    plan's (a graph pipeline's stage with its own micro-batch size)."""
    from plait.ir.stage_graph import replica_micro_batches as stage_graph_micro_batches
    from plait.ir.stage_graph import replica_samples

    # The stage graph's rounding rule (plait.ir.stage_graph): the same split the planner,
    # the memory estimator and the simulator use.
    counts = replica_samples(plan.global_batch, plan.dp_shares, plan.dp)
    offset = step * plan.global_batch + sum(counts[:dp_index])
    return [MicroBatch(u.index, u.first, u.size)
            for u in stage_graph_micro_batches(offset, counts[dp_index], micro_batch or plan.micro_batch)]


# ---------------------------------------------------------------------------------- stages
@dataclass
class Stage:
    """One piece of the model that one pipeline node runs (a stage, or one chunk of an
    interleaved rank): ``module(*inputs)`` returns the tuple of values it passes on (the model
    output, unwrapped, for the sink).

    ``inputs`` are the model inputs it reads itself (positions `data_inputs` of the sample
    tuple) followed by the values it receives, edge by edge (`recv`: predecessor node ->
    names, in argument order); `send` lists, per successor node, which of `output_names`
    go to it."""

    index: int
    module: nn.Module
    layers: list[str]
    input_names: list[str]
    output_names: list[str]
    data_inputs: list[int] | None = None  # None: every model input (an untraced whole model)
    varargs: bool = False  # the last of data_inputs is a *args placeholder: it takes every input from there on
    batch_dims: dict[str, int] = field(default_factory=dict)  # value name -> its batch dimension (default 0)
    recv: dict[int, list[str]] = field(default_factory=dict)
    send: dict[int, list[str]] = field(default_factory=dict)


def split_into_stages(model: nn.Module,
                      counts: Sequence[int] | Callable[[int, list[str]], list[int]],
                      probe: Sequence[tuple[Any, ...]] | None = None) -> list[Stage]:
    """Cut `model` into a linear pipeline of stages holding counts[i] consecutive layers each
    (in execution order); values used further down are relayed through the stages between.
    `probe`: the model's inputs at two batch sizes, to find each boundary value's batch dimension
    (`Stage.batch_dims`: where micro-batches of several sizes cross, torch's stages size their
    receive buffers by it).

    `counts` may be a function of the number of layers the forward runs and their styles
    (e.g. `plan.layers_per_stage`, which applies Megatron's split to transformers). A single
    stage is the model itself, untraced."""
    layers = layer_modules(model)
    names = [n for n, _ in layers]
    if not callable(counts) and len(counts) == 1:
        return [Stage(0, model, names, [], [])]
    graph = _trace(model, names)
    order = _layer_order(graph, names)
    if callable(counts):
        modules = dict(layers)
        styles = [_layer_style(modules[name]) for name in order]
        counts = counts(len(order), styles)
    if len(counts) == 1:
        return [Stage(0, model, order, [], [])]
    if sum(counts) != len(order):
        raise RuntimeSetupError(
            f"model {type(model).__name__}: plan splits {sum(counts)} layers but the model runs {len(order)}")
    layer_node: dict[str, int] = {}
    i = 0
    for s, c in enumerate(counts):
        for name in order[i:i + c]:
            layer_node[name] = s
        i += c
    dims = _batch_dims(model, graph, probe) if probe else {}
    return _split(model, graph, order, layer_node, len(counts), [(k, k + 1) for k in range(len(counts) - 1)], dims)


def split_into_graph(model: nn.Module, node_layers: Sequence[Sequence[str]],
                     edges: Sequence[tuple[int, int]], probe: Sequence[tuple[Any, ...]] | None = None,
                     node_stage: Sequence[int] | None = None) -> list[Stage]:
    """Cut `model` into the nodes of a stage DAG: node i runs the layers `node_layers[i]`;
    values flow along `edges` (a value used by a node that is not a direct successor of its
    producer is relayed along the shortest path of the DAG). The sink (the one node without
    successors) returns the model output. `probe`: the model's inputs at two batch sizes, to find
    each boundary value's batch dimension (needed where stages cut the batch differently).

    `node_stage`: the nodes are the segments of stages that run per input (node i a segment of
    stage ``node_stage[i]``, `StageSpec.segments`) and `edges` are between stages; the edges between
    segments are the stage graph's rule (`plait.ir.stage_graph.segment_edges`) on the layer
    dependencies of the traced model (`layer_dependencies`). The nodes' `send` give them back."""
    names = [n for n, _ in layer_modules(model)]
    layer_node: dict[str, int] = {}
    for i, layers in enumerate(node_layers):
        for name in layers:
            if name not in names:
                raise RuntimeSetupError(f"plan field 'stages[{i}].layers': {name!r} is not a layer of "
                                        f"{type(model).__name__}")
            if name in layer_node:
                raise RuntimeSetupError(f"plan field 'stages[{i}].layers': {name!r} is also in stage "
                                        f"{layer_node[name]}")
            layer_node[name] = i
    # A layer that ran no op when the planner captured the model (a dropout of p=0) is not in
    # the OpGraph, so no plan names it; holding no state, it is traced through as glue.
    stateless = {n for n, m in layer_modules(model) if n not in layer_node
                 and next(m.parameters(), None) is None and next(m.buffers(), None) is None}
    names = [n for n in names if n not in stateless]
    missing = [n for n in names if n not in layer_node]
    if missing:
        raise RuntimeSetupError(f"plan field 'stages': layers {missing[:3]} are in no stage")
    graph = _trace(model, names)
    dims = _batch_dims(model, graph, probe) if probe else {}
    if node_stage is not None:
        chunks = [Chunk(i, node_stage[i], list(layers)) for i, layers in enumerate(node_layers)]
        try:
            edges = segment_edges(layer_dependencies(graph, set(names)), chunks, list(edges))
        except PlaitError as exc:
            raise RuntimeSetupError(str(exc)) from None
    return _split(model, graph, _layer_order(graph, names), layer_node, len(node_layers), list(edges), dims)


def layer_dependencies(graph: fx.Graph, names: set[str]) -> list[tuple[str, str]]:
    """(producer, consumer) layer pairs of a traced model: the consumer reads the producer's
    output directly or through glue (the runtime's view of `OpGraph.layer_edges`)."""
    src: dict[fx.Node, set[str]] = {}
    out: set[tuple[str, str]] = set()
    for n in graph.nodes:
        ins: set[str] = set().union(*(src.get(a, set()) for a in n.all_input_nodes))
        if n.op == "call_module" and n.target in names:
            out |= {(p, str(n.target)) for p in ins if p != n.target}
            src[n] = {str(n.target)}
        else:
            src[n] = ins
    return sorted(out)


def _batch_dims(model: nn.Module, graph: fx.Graph, probe: Sequence[tuple[Any, ...]]) -> dict[str, int]:
    """Per fx value, the dimension whose size follows the batch: shapes at two batch sizes
    (torch.fx ShapeProp, eval mode and no grad, so no statistics or RNG state move)."""
    from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

    gm = fx.GraphModule(model, graph)
    was_training = model.training
    model.eval()
    gm.eval()
    shapes: list[dict[str, tuple[int, ...]]] = []
    try:
        with torch.no_grad():
            for inputs in probe:
                ShapeProp(gm).propagate(*inputs)
                shapes.append({n.name: tuple(n.meta["tensor_meta"].shape) for n in graph.nodes
                               if isinstance(n.meta.get("tensor_meta"), TensorMetadata)})
    finally:
        model.train(was_training)
    out: dict[str, int] = {}
    for name, a in shapes[0].items():
        b = shapes[1].get(name)
        if b is not None and len(a) == len(b):
            diff = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
            if diff:
                out[name] = diff[0]
    return out


class _Dag:
    """Reachability and shortest paths of a stage DAG."""

    def __init__(self, n: int, edges: Sequence[tuple[int, int]]) -> None:
        self.n = n
        self.succ: dict[int, list[int]] = {i: sorted(b for a, b in edges if a == i) for i in range(n)}
        indeg = {i: 0 for i in range(n)}
        for _, b in edges:
            indeg[b] += 1
        ready, self.topo = sorted(i for i in range(n) if indeg[i] == 0), []
        while ready:
            i = ready.pop(0)
            self.topo.append(i)
            for b in self.succ[i]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
            ready.sort()
        if len(self.topo) != n:
            raise RuntimeSetupError("plan field 'stage_edges': the stage graph has a cycle")
        self.reach: dict[int, set[int]] = {}
        for i in reversed(self.topo):
            self.reach[i] = {i}.union(*(self.reach[b] for b in self.succ[i]))

    def parents(self, src: int) -> dict[int, int]:
        """BFS tree from `src`: node -> the node it is reached from (ties by id)."""
        parent, frontier = {src: src}, [src]
        while frontier:
            nxt = []
            for a in frontier:
                for b in self.succ[a]:
                    if b not in parent:
                        parent[b] = a
                        nxt.append(b)
            frontier = nxt
        return parent

    def place(self, inputs: set[int], users: set[int], earliest: bool = False) -> int | None:
        """The latest (or earliest) node in topological order reachable from all `inputs` that
        reaches all `users`."""
        ok = [i for i in self.topo if all(i in self.reach[a] for a in inputs)
              and all(u in self.reach[i] for u in users)]
        return (ok[0] if earliest else ok[-1]) if ok else None


def _trace(model: nn.Module, names: list[str]) -> fx.Graph:
    try:
        from plait.graph.layer_cut import LayerTracer

        return LayerTracer(set(names)).trace(model)
    except Exception as exc:  # fx cannot trace data-dependent control flow
        raise RuntimeSetupError(
            f"model {type(model).__name__}: cannot be cut into pipeline stages, torch.fx tracing "
            f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def _layer_order(graph: fx.Graph, names: list[str]) -> list[str]:
    order: list[str] = []
    for n in graph.nodes:
        if n.op == "call_module" and n.target in set(names) and n.target not in order:
            order.append(n.target)
    return order


REPLICATED = -1  # a model input (or glue on inputs alone) that several stages read or compute themselves


def _assign(model: nn.Module, nodes: list[fx.Node], layer_node: dict[str, int], dag: _Dag,
            sink: int) -> tuple[dict[fx.Node, int], dict[fx.Node, set[int]]]:
    """The DAG node of every fx node: layers as given; glue at the earliest node that has all
    its inputs (the one input node every other input node reaches), else -- where branches
    merge, or for parameters and constants -- the latest node between its inputs and users;
    model inputs (and glue on them alone) at the earliest node that reaches all their users, or,
    when no node reaches them all, read by every stage that uses them."""
    where: dict[fx.Node, int | None] = {}
    merged: set[fx.Node] = set()  # glue placed after its users are known (branches merge in it or before)
    from_data: set[fx.Node] = set()  # model inputs and glue computed from them alone (indexing, reshapes)
    # Glue on model inputs alone, reading no parameter (a reshape, a scaling): where no stage
    # reaches all its users (parallel branches), each stage that needs it computes it itself.
    pure: set[fx.Node] = {n for n in nodes if n.op == "placeholder"}
    for n in nodes:
        if n.op in ("call_function", "call_method") and n.all_input_nodes and pure.issuperset(n.all_input_nodes):
            pure.add(n)
    for n in nodes:
        if n.op == "call_module" and n.target in layer_node:
            where[n] = layer_node[n.target]
        elif n.op == "output":
            where[n] = sink
        elif n.op == "placeholder":
            where[n] = None
            from_data.add(n)
        else:
            fixed = {where[a] for a in n.all_input_nodes if where[a] is not None}
            if not fixed and from_data.intersection(n.all_input_nodes):
                from_data.add(n)
            top = [a for a in fixed if all(a in dag.reach[b] for b in fixed)]
            if len(top) == 1 and not merged.intersection(n.all_input_nodes):
                where[n] = top[0]
            else:
                where[n] = None
                if fixed:
                    merged.add(n)
    need: dict[fx.Node, set[int]] = {}  # the stages that compute (or read) a replicated value

    def stages_of(u: fx.Node) -> set[int]:
        return need[u] if where[u] == REPLICATED else {where[u]} if where[u] is not None else set()

    for n in reversed(nodes):
        if where[n] is None:
            fixed = {where[a] for a in n.all_input_nodes if where[a] is not None}
            users = set().union(*(stages_of(u) for u in n.users))
            # Model inputs enter at the first stage that reaches all their users (stage 0 of a
            # chain, relayed from there); glue runs as late as it can.
            placed = dag.place(fixed, users, earliest=n in from_data)  # type: ignore[arg-type]
            if placed is None and n in pure:
                # No stage reaches every user (parallel sources, e.g. one branch per input): every
                # stage that uses it reads the model input itself (samples are seeded per index),
                # and computes the glue on it.
                where[n] = REPLICATED
                need[n] = users
                continue
            if placed is None:
                raise RuntimeSetupError(
                    f"model {type(model).__name__}: {n.name} takes inputs from stages {sorted(fixed)} "
                    f"and feeds stages {sorted(users)}; no stage of the stage graph lies between them")
            where[n] = placed
    for n in nodes:
        for a in n.all_input_nodes:
            if where[a] == REPLICATED:
                continue
            if where[n] not in dag.reach[where[a]]:  # type: ignore[index]
                raise RuntimeSetupError(
                    f"model {type(model).__name__}: layer order is not a chain of the stage graph "
                    f"({a.name} in stage {where[a]} feeds {n.name} in stage {where[n]}, which it does not reach)")
    return where, need  # type: ignore[return-value]


def _split(model: nn.Module, graph: fx.Graph, order: list[str], layer_node: dict[str, int], count: int,
           edges: list[tuple[int, int]], batch_dims: dict[str, int] | None = None) -> list[Stage]:
    dag = _Dag(count, edges)
    sinks = [i for i in range(count) if not dag.succ[i]]
    if len(sinks) != 1:
        raise RuntimeSetupError(f"plan field 'stage_edges': the stage graph needs exactly one sink (the stage "
                                f"that computes the loss), it has {len(sinks)}: {sinks}")
    nodes = list(graph.nodes)
    where, need = _assign(model, nodes, layer_node, dag, sinks[0])
    # Each value travels from its producer along the BFS tree to every node that uses it.
    carried: dict[tuple[int, int], list[fx.Node]] = {e: [] for e in edges}
    for n in nodes:
        if n.op == "output" or where[n] == REPLICATED:
            continue
        users = {where[u] for u in n.users} - {where[n]}
        if not users:
            continue
        parent = dag.parents(where[n])
        hops: set[tuple[int, int]] = set()
        for u in users:
            x = u
            while x != where[n]:
                hops.add((parent[x], x))
                x = parent[x]
        for e in hops:
            carried[e].append(n)
    position = {n: i for i, n in enumerate(nodes)}
    output_node = next(n for n in nodes if n.op == "output")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    stages = []
    for k in range(count):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        data = [i for i, n in enumerate(placeholders)
                if where[n] == k or (where[n] == REPLICATED and k in need[n])]
        for i in data:
            env[placeholders[i]] = g.node_copy(placeholders[i])
        recv = {a: sorted(carried[(a, b)], key=position.__getitem__) for a, b in edges if b == k}
        received: list[fx.Node] = []
        for a in sorted(recv):
            for n in recv[a]:
                if n not in env:
                    env[n] = g.placeholder(n.name)
                    received.append(n)
        for n in nodes:
            here = where[n] == k or (where[n] == REPLICATED and k in need[n])
            if here and n.op not in ("placeholder", "output") and n not in env:
                env[n] = g.node_copy(n, env.__getitem__)
        send = {b: sorted(carried[(a, b)], key=position.__getitem__) for a, b in edges if a == k}
        outs = sorted({n for vals in send.values() for n in vals}, key=position.__getitem__)
        if k == sinks[0]:
            g.output(fx.node.map_arg(output_node.args[0], env.__getitem__))
        else:
            g.output(tuple(env[n] for n in outs))
        g.lint()
        module = fx.GraphModule(model, g, class_name=f"Stage{k}")
        stages.append(Stage(k, module, [n for n in order if layer_node[n] == k],
                            [placeholders[i].name for i in data] + [n.name for n in received],
                            [n.name for n in outs], data,
                            bool(data) and str(placeholders[data[-1]].target).startswith("*"),
                            {n.name: batch_dims[n.name] for n in received + outs if n.name in (batch_dims or {})},
                            {a: [n.name for n in v] for a, v in recv.items()},
                            {b: [n.name for n in v] for b, v in send.items()}))
    return stages
