"""What a strategy costs on a heterogeneous cluster: compute at the devices' ratios, collectives.

Every number comes from the one cost package; this module only arranges them for the search and
the ratio LP.

Compute (HAP section 5.1): an op's work on device ``i`` is ``w_i = 3 t_i`` with ``t_i`` the
roofline time of its forward (`plait.cost.compute.op_time`: FLOPs at the kind's effective FLOP/s,
or its output bytes at the memory bandwidth, whichever is longer; views launch no kernel and
cost nothing) -- backward ~ 2x forward (the gradients of both operands of every product). A
sharded strategy takes ``max_i r_i w_i`` (the slowest device finishes last), a redundant one
``max_i w_i``. Both are at least the perfect-balance time ``1 / sum_i (1 / w_i)`` -- the
search's admissible heuristic.

Communication (issue 14 item 5): every collective is priced by `plait.cost.collectives` on the
program's actual device group (`GroupLinks` of the cluster: the ring's slowest link, intra- and
inter-node figures, NICs per node, the cluster's measured busbw tables), and its algorithm is
chosen per message (`choose`), not once for the program:

* uneven all-gather / reduce-scatter: padded (ring on every shard padded to the largest) or
  grouped (one broadcast / reduce per shard owner), whichever `choose_uneven` finds cheaper at
  the ratios -- or one global choice (`pinned`, HAP's flag);
* all-reduce: the algorithm NCCL's tuner would take on this group (`choose_algorithm`: ring,
  tree, or hierarchical across nodes), or ring only (`Devices.nccl=False`: HAP's cost model,
  one bandwidth per collective).

The LP needs times affine in the largest ratio ``m``: a padded collective is
``a + b m`` (`comm_affine` reads ``a`` and ``b`` off the cost module at two points; it is exact
for the alpha-beta model), a grouped one and an all-reduce do not depend on the ratios.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster, GPUKind
from plait.cost.collectives import (
    UNEVEN_OPS,
    GroupLinks,
    choose_algorithm,
    choose_uneven,
    collective_time,
    uneven_collective_time,
)
from plait.cost.compute import DEFAULT_MODEL, op_time
from plait.cost.devices import DeviceModel
from plait.ir.aten_graph import AtenGraph, AtenOp
from plait.ir.profile import ModelProfile
from plait.ir.program import Comm, Mesh, ShardingError

BACKWARD_FACTOR = 3.0  # forward + backward work, as multiples of the forward
PADDED = UNEVEN_OPS  # collectives whose time may depend on the largest ratio
# aten views: a new header over the same storage, no kernel
VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze", "unflatten",
                   "transpose", "permute", "t", "expand", "select", "slice", "split", "split_with_sizes",
                   "chunk", "narrow", "alias", "detach", "lift_fresh_copy"})


@dataclass(frozen=True)
class Devices:
    """The devices of one SPMD program: kinds, effective FLOP/s, memory bandwidth, capacity and
    the links of their group in the cluster -- a group of the one device model at a dtype
    (`of`: `plait.cost.devices.DeviceModel`, which the simulator's `ClusterView` is too)."""

    names: tuple[str, ...]
    flops: np.ndarray  # effective FLOP/s (peak x the compute model's GEMM efficiency)
    mem_bw: np.ndarray  # bytes/s
    memory: np.ndarray  # bytes
    links: GroupLinks  # the group of all of them, ring in the given order
    kinds: tuple[GPUKind, ...] = ()
    dtype: str = "fp32"
    ids: tuple[int, ...] = ()  # device ids in the cluster
    nccl: bool = True  # all-reduce algorithm as NCCL picks it (False: ring only, HAP's model)

    @property
    def n(self) -> int:
        return len(self.names)

    @classmethod
    def from_cluster(cls, cluster: Cluster, dtype: str = "fp32", devices: Sequence[int] | None = None) -> Devices:
        """`of` the cluster's device model."""
        return cls.of(DeviceModel.of_cluster(cluster), dtype, devices)

    @classmethod
    def of(cls, model: DeviceModel, dtype: str = "fp32", devices: Sequence[int] | None = None) -> Devices:
        """The group `devices` (all of them when None, in this order) of the one device model
        (`plait.cost.devices.DeviceModel`; a simulator's `ClusterView` is one) at `dtype`."""
        n = model.num_devices
        ids = list(range(n)) if devices is None else list(devices)
        for i in ids:
            if not 0 <= i < n:
                raise ShardingError(f"device {i} is not in cluster {model.name!r} ({n} devices)")
        if len(set(ids)) != len(ids):
            raise ShardingError(f"devices: {ids} names a device twice")
        picked = [model.kinds[i] for i in ids]
        eff = DEFAULT_MODEL.gemm_efficiency
        return cls(
            names=tuple(f"gpu {i} ({k.name}, node {int(model.node_of[i])})" for i, k in zip(ids, picked)),
            flops=np.array([k.flops(dtype) * eff for k in picked]),
            mem_bw=np.array([k.streaming_bandwidth * DEFAULT_MODEL.memory_efficiency for k in picked]),
            memory=np.array([float(k.memory_bytes) for k in picked]),
            links=model.group(ids),
            kinds=tuple(picked),
            dtype=dtype,
            ids=tuple(ids),
        )

    def hap_model(self) -> Devices:
        """HAP's cluster model (its public code): one bandwidth per collective -- the ring's
        slowest link, no tree or hierarchical all-reduce, no measured tables."""
        return dataclasses.replace(self, nccl=False, links=dataclasses.replace(self.links, measured=()))


def op_work(op: AtenOp, graph: AtenGraph, devices: Devices) -> np.ndarray:
    """Seconds of forward + backward work of the whole op on each device (``w_i``)."""
    if op.kind in VIEWS:
        return np.zeros(devices.n)
    out_bytes = sum(graph.tensors[t].nbytes for t in op.outputs)
    if devices.kinds:
        fwd = np.array([op_time(op.flops, out_bytes, k, devices.dtype) for k in devices.kinds])
    else:  # devices given by their figures only (tests)
        fwd = np.maximum(op.flops / devices.flops, out_bytes / devices.mem_bw)
    return BACKWARD_FACTOR * fwd


def cluster_model_profile(cluster: Cluster, spec: Any, dtype: str) -> ModelProfile | None:
    """The cluster's merged model profile of `spec` in `dtype` (`plait.ir.profile.profile_for`,
    which refuses a profile of another model in one line), or None when it names none: what an
    SPMD program's ops read their measured times from (`plait.cost.spmd.measured_work`)."""
    if not getattr(cluster, "model_profiles", None):
        return None
    from plait.graph.resolve import resolve_model
    from plait.ir.plan import Plan
    from plait.ir.profile import profile_for

    opgraph = resolve_model(getattr(spec, "spec", None) or spec, Plan(dtype=dtype))
    return profile_for(cluster.model_profiles, opgraph, dtype)


def measured_work(graph: AtenGraph, devices: Devices, work: list[np.ndarray],
                  profile: ModelProfile) -> tuple[list[np.ndarray], np.ndarray, str]:
    """`work` (`op_work` of every op) with the model profile's measured layer times where it has
    them (issue 28), the (ops, devices) mask of what was measured, and the provenance line.

    A profile is kept per (GPU kind, OpGraph layer, micro-batch, tp degree); an aten op knows its
    layer (`AtenOp.layer`). A device's work is that of ``batch / n`` samples of the graph's
    ``batch`` (sharded on the batch, or the whole batch on a ``1 / n`` shard of a tensor: the same
    FLOPs), so each (kind, layer) is looked up at ``b = batch / n`` on one device (tp1), and every
    op of the layer is scaled by the measured (forward + backward) over the modelled work of the
    layer at ``b`` (the roofline of `op_work` is linear in the batch): each op keeps its share of
    the layer's modelled time -- its FLOP share where the ops are compute-bound. Where the profile
    has no entry (another kind, a layer it lacks, ``b`` outside its sweep: never extrapolated),
    the analytic work stays. The backward stays `BACKWARD_FACTOR` - 1 times the forward."""
    n = devices.n
    out = [np.array(w, dtype=float, copy=True) for w in work]
    measured = np.zeros((len(graph.ops), n), dtype=bool)
    kinds = [k.name for k in devices.kinds]
    if not kinds or not graph.batch:
        return out, measured, "compute modelled per aten op"
    b = graph.batch / n
    by_layer: dict[str, list[int]] = {}
    for k, op in enumerate(graph.ops):
        by_layer.setdefault(op.layer, []).append(k)
    hit: dict[str, dict[str, bool]] = {}  # kind -> layer -> measured
    for layer, ks in by_layer.items():
        modelled = np.sum([work[k] for k in ks], axis=0) * (b / graph.batch)  # (n,) seconds at b
        for i, kind in enumerate(kinds):
            t = profile.layer_time(kind, layer, b, tp=1) if layer in profile.layer_names else None
            if layer in profile.layer_names:
                hit.setdefault(kind, {})[layer] = t is not None and modelled[i] > 0
            if t is None or not modelled[i] > 0:
                continue
            rho = (t[0] + t[1]) / modelled[i]
            for k in ks:
                out[k][i] *= rho
                measured[k, i] = True
    full = [k for k, v in hit.items() if v and all(v.values())]
    part = [f"{k} ({sum(v.values())} of {len(v)} layers)" for k, v in hit.items()
            if any(v.values()) and not all(v.values())]
    none = [k for k in dict.fromkeys(kinds) if k not in full and not any(hit.get(k, {}).values())]
    parts = [f"measured on {', '.join(full)}"] if full else []
    parts += [f"partly measured on {', '.join(part)}"] if part else []
    parts += [f"modelled on {', '.join(none)}"] if none else []
    where = f" (profile {profile.source}, per layer at {b:g} samples a device, spread over its aten ops)" \
        if full or part else ""
    return out, measured, "compute " + ", ".join(parts) + where


def compute_time(work: np.ndarray, splits: bool, ratios: np.ndarray) -> float:
    """``max_i r_i w_i`` when the strategy splits the work (`Strategy.splits_work`), else ``max_i w_i``."""
    return float(np.max(ratios * work)) if splits else float(np.max(work))


def balanced_time(work: np.ndarray) -> float:
    """The least time any strategy can take: perfect balance, ``1 / sum_i 1 / w_i``."""
    if not np.any(work > 0):
        return 0.0
    return float(1.0 / np.sum(1.0 / np.where(work > 0, work, np.inf)))


def choose(comm: Comm, devices: Devices, ratios: np.ndarray, pinned: str | None = None) -> tuple[Comm, float]:
    """`comm` with its algorithm chosen for this message at these ratios, and its seconds.

    `pinned`: "padded" or "grouped" for every uneven collective (HAP's one global flag); None or
    "auto": the cheaper per message. A comm whose algorithm is already set keeps it."""
    if comm.algorithm is not None:
        return comm, comm_seconds(comm, devices, ratios)
    links = devices.links
    if comm.op in UNEVEN_OPS:
        algo, t = choose_uneven(comm.op, comm.nbytes, ratios, links, pinned)
    else:
        algo = choose_algorithm(comm.op, comm.nbytes, links) if devices.nccl else "ring"
        t = collective_time(comm.op, comm.nbytes, links, algo)
    return Comm(comm.op, comm.tensor, comm.nbytes, comm.phase, comm.dim, comm.group, algo), t


def comm_seconds(comm: Comm, devices: Devices, ratios: np.ndarray) -> float:
    """Seconds of `comm` (its algorithm chosen, `choose`) at these ratios."""
    if comm.algorithm is None:
        return choose(comm, devices, ratios)[1]
    if comm.op in UNEVEN_OPS:
        return uneven_collective_time(comm.op, comm.nbytes, ratios, devices.links, comm.algorithm)
    return collective_time(comm.op, comm.nbytes, devices.links, comm.algorithm)


def comm_affine(comm: Comm, devices: Devices) -> tuple[float, float]:
    """``(a, b)``: the collective takes ``a + b max_i r_i`` seconds with its chosen algorithm
    (read off the cost module at ``max r = 1/n`` and ``max r = 1``)."""
    n = devices.n
    even = np.full(n, 1.0 / n)
    if comm.algorithm is None:
        comm = choose(comm, devices, even)[0]
    if comm.op not in UNEVEN_OPS or comm.algorithm != "padded" or n <= 1:
        return comm_seconds(comm, devices, even), 0.0
    one = np.zeros(n)
    one[0] = 1.0
    t_even, t_full = comm_seconds(comm, devices, even), comm_seconds(comm, devices, one)
    slope = (t_full - t_even) / (1.0 - 1.0 / n)
    return t_even - slope / n, slope


def comm_time(comm: Comm, devices: Devices, ratios: np.ndarray) -> float:
    """Seconds of `comm` at `ratios` (its algorithm chosen there when not set)."""
    return comm_seconds(comm, devices, ratios)


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


def rail_links(cluster: Cluster, mesh: Mesh) -> list[GroupLinks]:
    """The links of each rail as one of the ``g`` rails running at once sees them: a node's NICs
    are shared, so one rail's inter-node bandwidth is ``min(g, NICs) / g`` of what the rail's ring
    alone would get (`group_links` counts one NIC per member of a node) -- on the node with the
    fewest NICs, since the ring crosses every node."""
    out = []
    g = mesh.inner
    model = DeviceModel.of_cluster(cluster)
    for rail in mesh.rails():
        links = model.group(rail)
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
