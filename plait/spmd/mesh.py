"""Hierarchical SPMD programs on a two-level device mesh: nodes (outer) x the GPUs of a node (inner).

The flat program (`plait.spmd.search`) shards over *all* devices, so every sharded op's
collectives cross the slowest link of the cluster. A hierarchical program keeps the op-level
sharding inside each node, where links are fast, and runs data parallelism across nodes
(the mesh of Megatron-style "TP inside the node, DP across nodes", Narayanan et al. SC'21
section 3.3, with HAP's uneven per-device ratios inside the node):

* **outer** (across nodes): node ``a`` takes ``b_a`` samples of the global batch, in proportion to
  its effective FLOP/s (integer samples, `plait.ir.program.shard_sizes`); parameters are
  replicated across nodes and every parameter's gradient is all-reduced across nodes once, on the
  *rails* (device ``j`` of every node, NCCL's per-rail rings);
* **inner** (inside a node): the program found by the flat search + ratio LP with memory
  (`plait.spmd.ratios.synthesize`) on the node's devices at its batch -- any op may be sharded
  there, collectives run on the node's group only. The flat search is the special case of a
  mesh with one node.

Costs, all from `plait.cost.collectives` on the real groups (`GroupLinks` of a node, of a rail):

* an inner collective runs in every node at once; it takes the longest of the nodes' times (each
  node's links, its inner ratios, its bytes: activations scale with the node's batch);
* a parameter's cross-node reduction (`rail_time`): each of the ``g`` rails all-reduces its part
  -- ``r_j`` of the bytes when the inner program stores the parameter sharded, ``1/g`` when it is
  replicated (then an intra-node all-gather puts it back together: the hierarchical all-reduce
  of `hierarchical_all_reduce_time`, Goyal et al. / NCCL). The ``g`` rails share the node's NICs:
  one rail gets ``min(g, NICs)/g`` of their bandwidth.

Where the search's objective is concerned, the rail traffic is the same for every inner
program (each byte of every gradient crosses the nodes once, sharded or not), so the inner
search does not need it; `synthesize_hierarchical` ranks its candidates on the simulator, which
prices it (`plait.sim.lowering.spmd`, groups "node" and "rail").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster
from plait.cost.program import Problem, Program, Synthesis, stored_placements
from plait.cost.spmd import Devices, mesh_of, op_work
from plait.ir.aten_graph import AtenGraph
from plait.ir.program import NODE, RAIL, Comm, Mesh, shard_dim, shard_sizes
from plait.spmd.ratios import synthesize, synthesize_overlapped, synthesize_stored


def stored_inner(problem: Problem, program: Program) -> dict[str, str]:
    """Each parameter's placement in the inner program (`search.stored_placements`)."""
    return stored_placements(problem.graph, program)


@dataclass
class Hierarchical:
    """A hierarchical program: the inner synthesis, where it runs, and its world form for the
    simulator (`world_problem`, `world_program`, `world_ratios`, `device_scale`)."""

    inner: Synthesis
    problem: Problem  # the inner problem: graph at `graph_batch` on the node `home`
    mesh: Mesh
    node_batch: list[int]
    graph_batch: int
    home: int  # the node whose devices the inner program was searched on
    world_problem: Problem
    world_program: Program
    world_ratios: np.ndarray  # (segments, devices of the world), node-major
    device_scale: np.ndarray  # node batch / graph batch per device
    memory: np.ndarray  # bytes per device of the world
    capacity: np.ndarray
    seconds: float = 0.0
    expanded: int = 0
    candidates: list[tuple[int, float]] = field(default_factory=list)  # (home node, simulated s)

    @property
    def fits(self) -> bool:
        return bool(np.all(self.memory <= self.capacity * (1 + 1e-9)))

    @property
    def segments(self) -> Any:
        return self.inner.segments

    @property
    def segment_ratios(self) -> np.ndarray:
        return self.world_ratios

    @property
    def ratios(self) -> np.ndarray:
        return self.world_ratios.mean(axis=0) if self.world_ratios.ndim > 1 else self.world_ratios

    @property
    def program(self) -> Program:
        return self.world_program


def node_batches(cluster: Cluster, mesh: Mesh, batch: int, dtype: str = "fp32") -> list[int]:
    """Samples per node in proportion to the node's effective FLOP/s (every node at least one)."""
    power = [float(Devices.from_cluster(cluster, dtype, node).flops.sum()) for node in mesh.nodes]
    return shard_sizes(batch, power, what=f"batch of {batch}",
                       devices=[f"node {cluster.nodes[cluster.devices[n[0]].node].name}" for n in mesh.nodes])


def world_form(problem: Problem, syn: Synthesis, cluster: Cluster, mesh: Mesh, node_batch: Sequence[int],
               graph_batch: int, home: int) -> Hierarchical:
    """The inner synthesis `syn` as one program over every device of the mesh: inner collectives
    on group "node", one "rail" all-reduce per parameter (after its inner gradient collective)."""
    graph = problem.graph
    world = Devices.from_cluster(cluster, problem.devices.dtype, mesh.ids)
    wproblem = dataclasses.replace(problem, devices=world, work=[op_work(op, graph, world) for op in graph.ops])
    comms = [(name, dataclasses.replace(c, group=NODE)) for name, c in syn.program.comms]
    stored = stored_inner(problem, syn.program)
    first: dict[str, str] = {}
    for op in graph.ops:
        for t in op.inputs:
            if t in stored:
                first.setdefault(t, op.name)
    for t, name in (first.items() if mesh.outer > 1 else ()):  # one node: nothing crosses nodes
        d = shard_dim(stored[t])
        comms.append((name, Comm("all_reduce", t, graph.tensors[t].nbytes, "bwd", dim=d, group=RAIL)))
    program = dataclasses.replace(syn.program, comms=comms)
    r = syn.segment_ratios if syn.segment_ratios is not None else np.atleast_2d(syn.ratios)
    ratios = np.tile(np.asarray(r, dtype=float), (1, mesh.outer))
    scale = np.repeat(np.asarray(node_batch, dtype=float) / graph_batch, mesh.inner)
    # memory: the inner program's at the graph batch, the largest node's -- exact there, an upper
    # bound on nodes with fewer samples (their activations are smaller, their state the same)
    mem = np.tile(np.asarray(syn.memory, dtype=float), mesh.outer)
    return Hierarchical(syn, problem, mesh, list(node_batch), graph_batch, home, wproblem, program, ratios,
                        scale, mem, world.memory, syn.seconds, syn.expanded)


def synthesize_hierarchical(build: Callable[[int], AtenGraph], cluster: Cluster, batch: int, *,
                            dtype: str = "fp32", devices: Sequence[int] | None = None,
                            evaluate: Callable[[Hierarchical], float] | None = None,
                            weights: Sequence[float] = (1.0,), every_kind: bool = False,
                            **options: Any) -> Hierarchical:
    """The hierarchical program for a global `batch`: node batches by FLOP/s, the graph built at
    the largest (`build(samples)`), the inner program synthesized on a node of the most common
    kind of node (its devices' kinds and links: most nodes run at that node's pace) -- or, with
    `every_kind`, on one node of every kind, keeping the program `evaluate` (the simulator;
    default the inner synthesis's own cost) ranks first. `weights`: the overlap weights of
    `synthesize_overlapped` (each candidate ranked by `evaluate` too)."""
    mesh = mesh_of(cluster, devices)
    node_batch = node_batches(cluster, mesh, batch, dtype)
    graph_batch = max(node_batch)
    graph = build(graph_batch)
    classes: dict[tuple, list[int]] = {}
    for a, node in enumerate(mesh.nodes):
        key = tuple(cluster.devices[i].kind.name for i in node) + (cluster.nodes[cluster.devices[node[0]].node].intra,)
        classes.setdefault(key, []).append(a)
    homes = [members[0] for members in classes.values()]
    if not every_kind:
        homes = [max(classes.values(), key=len)[0]]
    best: tuple[float, Hierarchical] | None = None
    seconds, expanded = 0.0, 0
    tried: list[tuple[int, float]] = []
    for home in homes:
        problem = Problem.build(graph, Devices.from_cluster(cluster, dtype, mesh.nodes[home]))

        def score(p: Problem, syn: Synthesis, home: int = home) -> float:
            h = world_form(p, syn, cluster, mesh, node_batch, graph_batch, home)
            if not h.fits:
                return float("inf")
            return evaluate(h) if evaluate is not None else syn.cost

        if len(weights) > 1:
            syn = synthesize_overlapped(problem, score, weights, dtype=dtype, **options)
        else:
            syn = synthesize(problem, dtype=dtype, **options)
        # the next kind of node searches the same graph: start from the parameters this one had
        # to shard, and at the beam if the exact search overran here
        options = {**options, "forced": syn.forced, **({} if syn.program.optimal else {"max_states": 0})}
        seconds += syn.seconds
        expanded += syn.expanded
        h = world_form(problem, syn, cluster, mesh, node_batch, graph_batch, home)
        t = (evaluate(h) if evaluate is not None else syn.cost) if h.fits else float("inf")
        tried.append((home, t))
        if best is None or t < best[0]:
            best = (t, h)
        # ZeRO-3 storage inside the node (`synthesize_stored`): each whole parameter's gradient
        # reduce-scattered in the node, its 1/g all-reduced on the rails, all-gathered in the node
        # for the forward -- the hierarchical all-reduce, with the optimizer on the shards
        stored = synthesize_stored(problem, syn, dtype=dtype) if evaluate is not None else None
        if stored is not None:
            h = world_form(problem, stored, cluster, mesh, node_batch, graph_batch, home)
            t = evaluate(h) if h.fits else float("inf")
            tried.append((home, t))
            if t < best[0]:
                best = (t, h)
    assert best is not None
    result = best[1]
    result.seconds, result.expanded, result.candidates = seconds, expanded, tried
    return result
