"""Hierarchical SPMD programs on a two-level device mesh: nodes (outer) x the GPUs of a node (inner).

The flat program (`plait.spmd.search`) shards over *all* devices, so every sharded op's
collectives cross the slowest link of the cluster. A hierarchical program keeps the op-level
sharding inside each node, where links are fast, and runs data parallelism across nodes
(the mesh of Megatron-style "TP inside the node, DP across nodes", Narayanan et al. SC'21
section 3.3, with HAP's uneven per-device ratios inside the node):

* **outer** (across nodes): node ``a`` takes ``b_a`` samples of the global batch, in proportion to
  its effective FLOP/s (integer samples, `plait.spmd.placement.shard_sizes`); parameters are
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
prices it (`plait.sim.spmd_lower`, groups "node" and "rail").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import (
    GroupLinks,
    choose_algorithm,
    collective_time,
    group_links,
    measured_tables,
)
from plait.ir.aten_graph import AtenGraph
from plait.spmd.cost import Devices, op_work
from plait.spmd.placement import Comm, ShardingError, shard_dim, shard_sizes
from plait.spmd.ratios import Synthesis, synthesize, synthesize_overlapped, synthesize_stored
from plait.spmd.search import Problem, Program, stored_placements

NODE, RAIL, WORLD = "node", "rail", "world"  # `Comm.group` of a hierarchical program's collectives


@dataclass(frozen=True)
class Mesh:
    """Device ids of the cluster, one row per node (outer index ``a``, inner index ``j``)."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def outer(self) -> int:
        return len(self.nodes)

    @property
    def inner(self) -> int:
        return len(self.nodes[0])

    @property
    def ids(self) -> tuple[int, ...]:
        """Every device, node-major (the order of the world `Devices` of a hierarchical program)."""
        return tuple(i for node in self.nodes for i in node)

    def rails(self) -> list[tuple[int, ...]]:
        """Rail ``j``: device ``j`` of every node."""
        return [tuple(node[j] for node in self.nodes) for j in range(self.inner)]


def mesh_of(cluster: Cluster, devices: Sequence[int] | None = None) -> Mesh:
    """The nodes x GPUs mesh of `cluster` (or of `devices` of it); ShardingError naming the node
    when the nodes do not hold the same number of the devices (a mesh needs equal rows)."""
    every = cluster.devices
    ids = list(range(len(every))) if devices is None else list(devices)
    rows: dict[int, list[int]] = {}
    for i in ids:
        if not 0 <= i < len(every):
            raise ShardingError(f"device {i} is not in cluster {cluster.name!r} ({len(every)} devices)")
        rows.setdefault(every[i].node, []).append(i)
    first = min(rows)
    for node, r in sorted(rows.items()):
        if len(r) != len(rows[first]):
            raise ShardingError(f"cluster {cluster.name!r}: node {cluster.nodes[node].name!r} has {len(r)} of the "
                                f"devices, node {cluster.nodes[first].name!r} {len(rows[first])}: a two-level mesh "
                                "needs the same number of devices on every node")
    return Mesh(tuple(tuple(r) for _, r in sorted(rows.items())))


def _links(cluster: Cluster, ids: Sequence[int]) -> GroupLinks:
    every = cluster.devices
    return group_links(list(ids), bandwidth_matrix(cluster), latency_matrix(cluster), [d.node for d in every],
                       [max(1, n.nics) for n in cluster.nodes], measured_tables(cluster))


def rail_links(cluster: Cluster, mesh: Mesh) -> list[GroupLinks]:
    """The links of each rail as one of the ``g`` rails running at once sees them: a node's NICs
    are shared, so one rail's inter-node bandwidth is ``min(g, NICs) / g`` of what the rail's ring
    alone would get (`group_links` counts one NIC per member of a node) -- on the node with the
    fewest NICs, since the ring crosses every node."""
    out = []
    g = mesh.inner
    for rail in mesh.rails():
        links = _links(cluster, rail)
        nics = min(min(max(1, cluster.nodes[cluster.devices[i].node].nics), g) for i in rail)
        share = nics / g
        out.append(dataclasses.replace(links, ring_bandwidth=links.ring_bandwidth * share,
                                       inter_bandwidth=links.inter_bandwidth * share, measured=()))
    return out


def rail_time(nbytes: float, shares: np.ndarray | None, rails: Sequence[GroupLinks],
              node_links: Sequence[GroupLinks]) -> float:
    """Seconds of one parameter gradient's cross-node all-reduce.

    `shares`: the inner ratios when the inner program stores it sharded (rail ``j`` all-reduces
    ``shares[j] nbytes``); None when replicated (each rail ``nbytes / g``, then an intra-node
    all-gather of the whole, the slowest node's)."""
    g = len(rails)
    if shares is None:
        part = [nbytes / g] * g
        gather = max(collective_time("all_gather", nbytes, links, "ring") for links in node_links)
    else:
        part = [float(s) * nbytes for s in shares]
        gather = 0.0
    ring = max(collective_time("all_reduce", p, links, choose_algorithm("all_reduce", p, links))
               for p, links in zip(part, rails))
    return ring + gather


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
